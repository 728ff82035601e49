"""The benchmark cases (the seed benchmark's, so numbers compare), their useful FLOPs and random inputs.

Lengths are `np.random.default_rng(0).integers(min_len, max_seq_len + 1, size=B)`, exactly as the seed's
script draws them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jagged_flash_jax import jagged_to_padded, offsets_from_lengths

MODES = ("fwd", "fwd+bwd")
DTYPES = ("bfloat16", "float16", "float32")
# Forward + backward does 2.5 forwards' worth of matrix products more than the forward alone.
BACKWARD_FLOP_FACTOR = 3.5
# Inputs of one rotation set are kept at least this large in total, so that consecutive timed calls
# find cold data in the 60 MB L2 of an H200 (the seed's do_bench flushes L2 before each call).
ROTATION_BYTES = 150e6
MAX_ROTATION_SETS = 8


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    head_dim: int
    max_seq_len: int
    min_len: int

    def lengths(self) -> np.ndarray:
        return np.random.default_rng(0).integers(self.min_len, self.max_seq_len + 1, size=self.batch)

    def attended_lengths(self) -> np.ndarray:
        return np.minimum(self.lengths(), self.max_seq_len)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths().sum())

    @property
    def padded_head_dim(self) -> int:
        """D rounded up to a multiple of 8, as cuDNN needs."""
        return -(-self.head_dim // 8) * 8

    def flops(self, mode: str) -> float:
        """Useful FLOPs: 4 H D sum(n_b^2) for the forward; 3.5 times that for forward + backward."""
        n = self.attended_lengths().astype(np.float64)
        forward = 4.0 * self.heads * self.head_dim * float(np.sum(n * n))
        return forward if mode == "fwd" else BACKWARD_FLOP_FACTOR * forward

    def quick(self) -> Case:
        """A tiny version (B/8, max_seq_len/8; renamed, so no seed row matches it) for CPU smoke runs."""
        max_seq_len = max(8, self.max_seq_len // 8)
        return dataclasses.replace(self, name=f"{self.name}-quick", batch=max(2, self.batch // 8),
                                   max_seq_len=max_seq_len, min_len=min(self.min_len, max_seq_len))

    def describe(self) -> dict:
        return dict(B=self.batch, H=self.heads, D=self.head_dim, max_seq_len=self.max_seq_len,
                    min_len=self.min_len, tokens=self.num_tokens)


CASES = (
    Case("rec-small", 1024, 2, 32, 128, 1),
    Case("gr-ml1m", 128, 2, 25, 200, 1),
    Case("rec-mid", 256, 4, 64, 256, 1),
    Case("rec-long", 64, 8, 128, 1024, 1),
    Case("long", 16, 8, 128, 4096, 1),
    Case("dlrm-long", 32, 4, 128, 4096, 512),
)
CASES_BY_NAME = {case.name: case for case in CASES}


def pad_head_dim(x: jax.Array, padded_dim: int) -> jax.Array:
    extra = padded_dim - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def jagged_to_cudnn_layout(x: jax.Array, offsets: jax.Array, max_seq_len: int, padded_dim: int):
    """[H, T, D] jagged -> [B, max_seq_len, H, padded_dim], zero padded: what dot_product_attention takes."""
    padded = jnp.swapaxes(jagged_to_padded(x, offsets, max_seq_len), 1, 2)
    return pad_head_dim(padded, padded_dim)


@dataclasses.dataclass
class InputSet:
    """One set of random inputs, jagged [H, T, D] and (on demand) padded [B, L, H, Dp]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    do: jax.Array
    offsets: jax.Array
    lengths: jax.Array
    padded: tuple[jax.Array, ...] | None = None

    def jagged_args(self, mode: str) -> tuple:
        args = (self.q, self.k, self.v, self.offsets)
        return args + (self.do,) if mode == "fwd+bwd" else args

    def padded_args(self, case: Case, mode: str) -> tuple:
        if self.padded is None:
            convert = jax.jit(jagged_to_cudnn_layout, static_argnums=(2, 3))
            self.padded = tuple(convert(x, self.offsets, case.max_seq_len, case.padded_head_dim)
                                for x in (self.q, self.k, self.v, self.do))
        qp, kp, vp, dop = self.padded
        args = (qp, kp, vp, self.lengths)
        return args + (dop,) if mode == "fwd+bwd" else args


def num_rotation_sets(case: Case, dtype: str) -> int:
    """How many input sets to rotate through: at least 3, more when one set would sit in L2."""
    itemsize = np.dtype(dtype).itemsize
    jagged = 4 * case.heads * case.num_tokens * case.head_dim * itemsize
    padded = 4 * case.batch * case.max_seq_len * case.heads * case.padded_head_dim * itemsize
    smallest = min(jagged, padded)
    return int(min(MAX_ROTATION_SETS, max(3, math.ceil(ROTATION_BYTES / smallest))))


def make_input_sets(case: Case, dtype: str, count: int, seed: int = 0) -> list[InputSet]:
    """`count` independent sets of standard-normal q, k, v and cotangent do (never zeros)."""
    lengths = case.lengths()
    offsets = offsets_from_lengths(jnp.asarray(lengths, jnp.int32))
    attended = jnp.asarray(case.attended_lengths(), jnp.int32)
    shape = (case.heads, case.num_tokens, case.head_dim)
    draw = jax.jit(lambda key: jax.random.normal(key, (4, *shape), jnp.float32).astype(dtype))
    sets = []
    for key in jax.random.split(jax.random.key(seed), count):
        q, k, v, do = draw(key)
        sets.append(InputSet(q, k, v, do, offsets, attended))
    return sets
