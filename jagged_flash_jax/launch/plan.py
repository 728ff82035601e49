"""Which kernels the forward and backward run, on which grid, with which outputs: shared by launchers.

A launcher is a function `run(call, arrays) -> outputs` that executes one `KernelCall`; gpu.py does it
with jax-triton, interpret.py with Triton's interpreter. The kernels' parameters are the arrays of the
call, then `num_tokens`, then the outputs, then `constants`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import kernels
from ..configs import BlockSizes, KernelConfig, head_block

# CUDA's limit on the second grid dimension, which enumerates blocks of one sequence.
MAX_GRID_Y = 65535


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one attention call (hashable: it is a custom_vjp static argument)."""

    num_heads: int
    num_tokens: int
    head_dim: int
    batch: int
    max_seq_len: int
    head_major: bool
    input_precision: str
    block_sizes: BlockSizes
    launcher: str

    def grid(self, block: int) -> tuple[int, int]:
        # A sequence has at most min(max_seq_len, T) attended tokens.
        return (self.batch * self.num_heads, -(-min(self.max_seq_len, self.num_tokens) // block))

    def constants(self, config: KernelConfig | None = None, **extra) -> dict[str, Any]:
        consts = dict(NUM_HEADS=self.num_heads, MAX_SEQ_LEN=self.max_seq_len, D=self.head_dim,
                      HEAD_MAJOR=self.head_major, BLOCK_D=head_block(self.head_dim), **extra)
        if config is not None:
            consts.update(INPUT_PRECISION=self.input_precision, BLOCK_M=config.block_m,
                          BLOCK_N=config.block_n)
        return consts

    @property
    def empty(self) -> bool:
        return self.batch * self.num_heads * self.num_tokens * self.head_dim == 0


@dataclasses.dataclass(frozen=True)
class KernelCall:
    kernel: Any  # a @triton.jit function of kernels.py
    grid: tuple[int, int]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    zeroed_outputs: tuple[int, ...]
    num_tokens: int
    constants: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2


Runner = Callable[[KernelCall, Sequence[jax.Array]], Sequence[jax.Array]]


def _stats_shape(p: Problem) -> jax.ShapeDtypeStruct:
    # The log-sum-exp and delta stay float32 whatever the input dtype.
    return jax.ShapeDtypeStruct((p.num_heads, p.num_tokens), jnp.float32)


def forward(run: Runner, p: Problem, q, k, v, offsets):
    """o (zero outside the attended tokens) and the float32 log-sum-exp [H, T]."""
    if p.empty:
        return jnp.zeros_like(q), jnp.zeros((p.num_heads, p.num_tokens), jnp.float32)
    cfg = p.block_sizes.fwd
    call = KernelCall(
        kernels.jagged_attention_fwd_kernel, p.grid(cfg.block_m),
        out_shapes=(jax.ShapeDtypeStruct(q.shape, q.dtype), _stats_shape(p)),
        zeroed_outputs=(0,), num_tokens=p.num_tokens, constants=p.constants(cfg),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    o, lse = run(call, (q, k, v, offsets))
    return o, lse


def backward(run: Runner, p: Problem, q, k, v, offsets, o, lse, do):
    """dq, dk, dv: the preprocess (delta = rowsum(o * do)), then one launch of dk/dv and dq programs."""
    if p.empty:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    bs = p.block_sizes
    (delta,) = run(KernelCall(
        kernels.jagged_attention_bwd_preprocess_kernel, p.grid(bs.preprocess_block_m),
        out_shapes=(_stats_shape(p),), zeroed_outputs=(), num_tokens=p.num_tokens,
        constants=p.constants(BLOCK_M=bs.preprocess_block_m)), (o, do, offsets))
    # dk/dv programs take the even blocks, dq programs the odd ones (see the kernel's docstring).
    blocks = max(p.grid(bs.dkdv.block_n)[1], p.grid(bs.dq.block_m)[1])
    dq, dk, dv = run(KernelCall(
        kernels.jagged_attention_bwd_kernel, (p.batch * p.num_heads, 2 * blocks),
        out_shapes=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
        zeroed_outputs=(0, 1, 2), num_tokens=p.num_tokens,
        constants=p.constants(INPUT_PRECISION=p.input_precision, DKDV_BLOCK_M=bs.dkdv.block_m,
                              DKDV_BLOCK_N=bs.dkdv.block_n, DQ_BLOCK_M=bs.dq.block_m,
                              DQ_BLOCK_N=bs.dq.block_n),
        num_warps=bs.dkdv.num_warps, num_stages=bs.dkdv.num_stages), (q, k, v, do, lse, delta, offsets))
    return dq, dk, dv


def check_grid(p: Problem) -> None:
    """Raise ValueError when a sequence would need more blocks than CUDA's grid allows."""
    bs = p.block_sizes
    for block, factor in ((bs.fwd.block_m, 1), (bs.dkdv.block_n, 2), (bs.dq.block_m, 2),
                          (bs.preprocess_block_m, 1)):
        blocks = factor * p.grid(block)[1]
        if blocks > MAX_GRID_Y:
            raise ValueError(
                f"max_seq_len={p.max_seq_len} needs {blocks} blocks of {block} rows per sequence; "
                f"at most {MAX_GRID_Y} are supported (use larger blocks or a smaller max_seq_len)")
