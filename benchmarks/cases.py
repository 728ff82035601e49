"""The cases, their useful FLOPs and random input sets (jagged [T, H, D], never zeros). The "fbgemm" cases
are the external PyTorch script's (lengths np.random.default_rng(0).integers(min_len, L + 1, size=B),
FBGEMM's semantics: no scale, output / L); the other groups have the standard semantics.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jagged_flash_jax import offsets_from_lengths

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str
    batch: int
    heads: int
    head_dim: int
    max_seq_len: int
    min_len: int
    kv_heads: int | None = None  # GQA when fewer than heads
    causal: bool = False
    kv_len: tuple[int, int] | None = None  # cross-attention: key lengths drawn from [lo, hi]
    window: tuple[int | None, int | None] | None = None  # (left, right) of jagged_attention's window=
    softcap: float | None = None
    dtypes: tuple[str, ...] = ("bfloat16",)

    fbgemm = property(lambda self: self.group == "fbgemm")
    kv_max_seq_len = property(lambda self: self.kv_len[1] if self.kv_len else self.max_seq_len)

    def lengths(self) -> np.ndarray:
        return np.random.default_rng(0).integers(self.min_len, self.max_seq_len + 1, size=self.batch)

    def kv_lengths(self) -> np.ndarray:
        if self.kv_len is None:
            return self.lengths()
        return np.random.default_rng(1).integers(self.kv_len[0], self.kv_len[1] + 1, size=self.batch)

    def flops(self, mode: str) -> float:
        """4 H D per attended query-key pair (causal and window, bottom-right: exactly the pairs kept);
        fwd+bwd 3.5x."""
        left, right = self.window or (None, None)
        pairs = 0
        for n_q, n_k in zip(np.minimum(self.lengths(), self.max_seq_len),
                            np.minimum(self.kv_lengths(), self.kv_max_seq_len)):
            unbounded = n_q + n_k
            diagonal = np.arange(n_q) + n_k - n_q  # the key aligned with each query
            first = np.maximum(0, diagonal - (unbounded if left is None else left))
            last = np.minimum(n_k - 1, diagonal + min(unbounded if right is None else right,
                                                      0 if self.causal else unbounded))
            pairs += int(np.maximum(0, last - first + 1).sum())
        return 4.0 * self.heads * self.head_dim * pairs * (1.0 if mode == "fwd" else 3.5)

    def describe(self) -> dict:
        options = {k: v for k, v in (("window", self.window), ("softcap", self.softcap)) if v is not None}
        return dict(group=self.group, B=self.batch, H=self.heads, H_kv=self.kv_heads or self.heads,
                    D=self.head_dim, L=self.max_seq_len, L_kv=self.kv_max_seq_len, causal=self.causal,
                    **options, tokens=int(self.lengths().sum()), kv_tokens=int(self.kv_lengths().sum()))

    def shrunk(self) -> Case:
        """A tiny version for --quick runs on the CPU (same name and kind)."""
        length = max(min(self.max_seq_len, 16), self.max_seq_len // 64)
        kv_len = self.kv_len and (max(1, self.kv_len[0] // 64), max(2, self.kv_len[1] // 64))
        window = self.window and tuple(w and max(1, w * length // self.max_seq_len)
                                       for w in self.window)
        return dataclasses.replace(self, batch=min(self.batch, 6), max_seq_len=length, kv_len=kv_len,
                                   window=window, min_len=max(1, self.min_len * length // self.max_seq_len))


def _fbgemm(*args) -> Case:
    return Case(args[0], "fbgemm", *args[1:], dtypes=("bfloat16", "float32"))


def _sweep(group: str, max_seq_len: int, name: str | None = None, heads=8, head_dim=128, **kw) -> Case:
    """About 65k tokens in sequences of lengths uniform in [L/2, L]."""
    batch = max(2, round(65536 / (0.75 * max_seq_len)))
    return Case(name or f"L{max_seq_len}", group, batch, heads, head_dim, max_seq_len, max_seq_len // 2, **kw)


CASES = (  # name, group, B, H, D, L, min_len
    _fbgemm("rec-small", 1024, 2, 32, 128, 1),
    _fbgemm("gr-ml1m", 128, 2, 25, 200, 1),
    _fbgemm("rec-mid", 256, 4, 64, 256, 1),
    _fbgemm("rec-long", 64, 8, 128, 1024, 1),
    _fbgemm("long", 16, 8, 128, 4096, 1),
    _fbgemm("dlrm-long", 32, 4, 128, 4096, 512),
    *(_sweep("L-sweep", 2**p) for p in range(8, 16)),
    _sweep("D-sweep", 4096, "L4096-D64", head_dim=64),
    _sweep("D-sweep", 4096, "L4096-D256", head_dim=256),
    Case("long-causal", "causal", 16, 8, 128, 4096, 1, causal=True),
    _sweep("causal", 4096, "L4096-causal", causal=True),
    _sweep("causal", 16384, "L16384-causal", causal=True),
    _sweep("causal", 4096, "L4096-D64-causal", head_dim=64, causal=True),
    _sweep("causal", 4096, "L4096-D256-causal", head_dim=256, causal=True),
    _sweep("gqa", 4096, "gqa-16x2", heads=16, kv_heads=2),
    _sweep("gqa", 4096, "gqa-16x4", heads=16, kv_heads=4),
    # Shorter sequences, recommender-sized: where launch and tail costs weigh more.
    Case("rec-long-causal", "causal", 64, 8, 128, 1024, 1, causal=True),
    Case("gqa-16x4-L512-D64", "gqa", 256, 16, 64, 512, 256, kv_heads=4),
    Case("gqa-16x4-L512-D64-causal", "gqa", 256, 16, 64, 512, 256, kv_heads=4, causal=True),
    # Recommendation-style cross-attention: 1-8 candidates per user against histories of 512-4096 events.
    Case("cross", "cross", 64, 4, 128, 8, 1, kv_len=(512, 4096)),
    # Local attention: each query sees itself and the w keys before it.
    *(_sweep("window", L, f"L{L}-w{w}", window=(w, 0)) for L in (4096, 16384) for w in (256, 1024)),
    _sweep("softcap", 4096, "L4096-softcap50", softcap=50.0),
    _sweep("softcap", 4096, "L4096-causal-softcap50", causal=True, softcap=50.0),
    # Cost against the window at L = 16384, with the window group's w = 256 and 1024 (None: unbounded).
    *(_sweep("window-sweep", 16384, f"L16384-w{w}", window=(w, 0)) for w in (128, 512, 2048, 4096, None)),
)
QUICK = ("rec-small", "L256", "L4096", "long-causal", "gqa-16x2", "cross", "L4096-w256",
         "L4096-causal-softcap50")


def select(names: list[str] | None, quick: bool) -> list[Case]:
    """Cases by name or group (all when None); with quick, shrunk (and only QUICK when names is None)."""
    chosen = [c for c in CASES if names is None or c.name in names or c.group in names]
    return [c.shrunk() for c in chosen if names or c.name in QUICK] if quick else chosen


class InputSet(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    do: jax.Array
    offsets: jax.Array
    kv_offsets: jax.Array
    lengths: jax.Array  # attended lengths, int32
    kv_lengths: jax.Array


def input_sets(case: Case, dtype: str, count: int) -> list[InputSet]:
    """`count` independent sets of standard-normal q, k, v and cotangent do."""
    lengths, kv_lengths = case.lengths(), case.kv_lengths()
    shapes = [(int(n.sum()), h, case.head_dim) for n, h in ((lengths, case.heads),
                                                              (kv_lengths, case.kv_heads or case.heads))]
    fixed = (offsets_from_lengths(lengths), offsets_from_lengths(kv_lengths),
             jnp.asarray(np.minimum(lengths, case.max_seq_len), jnp.int32),
             jnp.asarray(np.minimum(kv_lengths, case.kv_max_seq_len), jnp.int32))
    normal = lambda key, i: jax.random.normal(key, shapes[i], jnp.float32).astype(dtype)  # noqa: E731
    keys = jax.random.split(jax.random.key(0), (count, 4))
    return [InputSet(normal(q, 0), normal(k, 1), normal(v, 1), normal(do, 0), *fixed) for q, k, v, do in keys]


def rotation_count(case: Case, dtype: str, quick: bool) -> int:
    """Input sets to rotate through: enough that one call's inputs are not left in a 60 MB L2."""
    info = case.describe()
    set_bytes = 2 * (info["tokens"] * case.heads + info["kv_tokens"] * info["H_kv"]) * case.head_dim
    return 2 if quick else int(np.clip(np.ceil(240e6 / (set_bytes * jnp.dtype(dtype).itemsize)), 2, 6))
