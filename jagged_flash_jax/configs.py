"""Launch configurations (tile sizes, warps, pipeline stages) of the kernels, and how one is chosen.

`BlockSizes` is a frozen, hashable dataclass so it can be a static argument of jitted functions. The
GPU table in `default_block_sizes` was measured on an H200 (benchmarks/tune.py); the interpreter uses
small, deliberately unequal tiles so that CPU tests walk several blocks in every loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile of one kernel: BLOCK_M query rows by BLOCK_N key rows, with Triton's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Configurations of the forward, dk/dv and dq kernels and the preprocess's row block."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    preprocess_block_m: int = 64


def head_block(head_dim: int) -> int:
    """The padded head dimension the kernels work on: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


INTERPRET_BLOCK_SIZES = BlockSizes(
    fwd=KernelConfig(16, 32),
    dkdv=KernelConfig(block_m=16, block_n=32),
    dq=KernelConfig(block_m=32, block_n=16),
    preprocess_block_m=16,
)


def default_block_sizes(head_dim: int, dtype, max_seq_len: int) -> BlockSizes:
    """Tiles for the GPU kernels, by padded head dimension, element size and sequence length."""
    block_d = head_block(head_dim)
    wide = np.dtype(dtype).itemsize >= 4  # float32 tiles take twice the shared memory and registers
    short = max_seq_len <= 128
    if wide:
        if block_d <= 64:
            return BlockSizes(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2),
                              KernelConfig(64, 32, 4, 2))
        return BlockSizes(KernelConfig(32, 32, 4, 2), KernelConfig(32, 32, 4, 2),
                          KernelConfig(32, 32, 4, 2), preprocess_block_m=32)
    if block_d <= 64:
        fwd = KernelConfig(64, 64, 4, 2) if short else KernelConfig(128, 64, 4, 3)
        return BlockSizes(fwd, KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2))
    if block_d <= 128:
        return BlockSizes(KernelConfig(128, 64, 8, 3), KernelConfig(32, 128, 8, 2),
                          KernelConfig(128, 32, 8, 2))
    return BlockSizes(KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 1),
                      KernelConfig(64, 32, 4, 1), preprocess_block_m=32)
