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


@dataclasses.dataclass(frozen=True)
class HstuProblem:
    """What one call of HSTU attention computes (reference.hstu_attention_reference's semantics). q, k
    are [Z*T, H, D] ("THD") or [H, Z*T, D] ("HTD"), v and o the same with V: Z segments of T tokens, each
    with its row of offsets (or one shared row), and of num_targets [rows, B] when `has_targets`. Each
    query's factor s_i is the constant `scale` (1 / max_seq_len, or a static attn_scale), or, where
    `scale` is None, the per-token operand [Z*T] float32 (an array attn_scale, scalar ones broadcast)."""

    layout: str  # "THD" or "HTD"
    num_heads: int
    head_dim: int  # of q and k
    value_dim: int  # of v and the output
    batch: int  # sequences per segment
    num_segments: int
    tokens: int  # per segment
    offsets_rows: int  # 1 (shared by every segment) or num_segments
    max_seq_len: int
    alpha: float  # multiplies q . k before silu
    scale: float | None  # s_i, or None: a per-token operand
    causal: bool = True
    max_attn_len: int = 0  # 0: no window
    contextual_seq_len: int = 0
    min_full_attn_seq_len: int = 0
    has_targets: bool = False
    dtype: str = "float32"
    input_precision: str = "ieee"  # "ieee" or "tf32": float32 matrix products

    def shape(self, dim: int) -> tuple[int, int, int]:
        """The shape of an operand whose last axis is `dim`, in the problem's layout."""
        total = self.num_segments * self.tokens
        return (total, self.num_heads, dim) if self.layout == "THD" else (self.num_heads, total, dim)

    def strides(self, dim: int) -> tuple[int, int]:
        """(token stride, head stride) in elements of an operand whose last axis is `dim`."""
        if self.layout == "THD":
            return self.num_heads * dim, dim
        return dim, self.num_segments * self.tokens * dim

    @property
    def itemsize(self) -> int:
        return {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def empty(self) -> bool:
        return self.num_segments * self.tokens * self.num_heads * self.batch == 0

    def mask_options(self) -> dict:
        return dict(causal=self.causal, max_attn_len=self.max_attn_len,
                    contextual_seq_len=self.contextual_seq_len,
                    min_full_attn_seq_len=self.min_full_attn_seq_len)

    def with_(self, **changes) -> HstuProblem:
        return dataclasses.replace(self, **changes)
