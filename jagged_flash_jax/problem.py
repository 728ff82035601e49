"""What one call of the attention computes, as a static, hashable description: shapes, lengths, the band
and the score options. Which implementation runs it, and with which tiles, is the plan's (select.py).

Arrays at this level: q, o, do, dq are [Z*T_q, H, D] ("THD") or [H, Z*T_q, D] ("HTD"), k, v, dk, dv the
same with H_kv and T_kv: Z segments of T tokens each along the token axis, every segment with its own
row of offsets (or all with one shared row). The log-sum-exp residual is float32 [Z, H, T_q].
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    layout: str  # "THD" or "HTD"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int  # sequences per segment
    num_segments: int
    q_tokens: int  # per segment
    kv_tokens: int
    q_offsets_rows: int  # 1 (shared by every segment) or num_segments
    kv_offsets_rows: int
    max_seq_len: int
    kv_max_seq_len: int
    causal: bool
    scale: float
    out_scale: float
    dtype: str  # of q, k, v (a NumPy dtype name)
    input_precision: str  # "tf32" or "ieee": float32 matrix products
    # (left, right): query i (at key position i + n_k - n_q) sees keys from i + n_k - n_q - left to
    # i + n_k - n_q + right; None is no bound (right is None under causal, which bounds it at 0).
    window: tuple[int | None, int | None] = (None, None)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap), on the scaled scores
    alibi: bool = False  # the slopes [Z, H] come as an operand (transforms.ForwardArgs.slopes)

    def shape(self, heads: int, tokens: int) -> tuple[int, int, int]:
        total = self.num_segments * tokens
        return (total, heads, self.head_dim) if self.layout == "THD" else (heads, total, self.head_dim)

    @property
    def q_shape(self) -> tuple[int, int, int]:
        return self.shape(self.num_heads, self.q_tokens)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.shape(self.num_kv_heads, self.kv_tokens)

    @property
    def stats_shape(self) -> tuple[int, int, int]:
        return (self.num_segments, self.num_heads, self.q_tokens)

    def strides(self, heads: int, tokens: int) -> tuple[int, int]:
        """(token stride, head stride) in elements."""
        d = self.head_dim
        if self.layout == "THD":
            return heads * d, d
        return d, self.num_segments * tokens * d

    @property
    def itemsize(self) -> int:
        return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def banded(self) -> bool:
        """Whether causal masking or a window bands the keys a query sees."""
        return self.causal or self.window != (None, None)

    @property
    def empty(self) -> bool:
        return self.num_segments * self.num_heads * self.q_tokens * self.head_dim == 0

    def with_(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)
