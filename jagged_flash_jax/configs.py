"""Launch configurations (tile sizes, warps, pipeline stages) of the kernels, and how one is chosen.

`BlockSizes` is a frozen, hashable dataclass so it can be a static argument of jitted functions. The
GPU table behind `default_block_sizes` was measured on an H200 (benchmarks/tune.py) and can be replaced
by a table file; the interpreter uses small, deliberately unequal tiles so that CPU tests walk several
blocks in every loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

# A JSON table written by `python -m benchmarks.tune --write-table PATH` replaces the built-in one.
TUNED_CONFIGS_ENV = "JAGGED_FLASH_JAX_TUNED_CONFIGS"

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
    """Configurations of the forward, the dk/dv and dq programs, and the preprocess's row block.

    dk/dv and dq programs share one backward launch, hence one num_warps and num_stages.
    """

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    preprocess_block_m: int = 64

    def __post_init__(self):
        if (self.dkdv.num_warps, self.dkdv.num_stages) != (self.dq.num_warps, self.dq.num_stages):
            raise ValueError("BlockSizes.dkdv and .dq run in one launch: give them the same num_warps "
                             f"and num_stages, got {self.dkdv} and {self.dq}")


def head_block(head_dim: int) -> int:
    """The padded head dimension the kernels work on: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


INTERPRET_BLOCK_SIZES = BlockSizes(
    fwd=KernelConfig(16, 32),
    dkdv=KernelConfig(block_m=16, block_n=32),
    dq=KernelConfig(block_m=32, block_n=16),
    preprocess_block_m=16,
)


def _tiles(fwd, dkdv, dq, preprocess_block_m=64) -> BlockSizes:
    return BlockSizes(KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq), preprocess_block_m)


# (16-bit inputs?, padded D, longest max_seq_len) -> tiles as (block_m, block_n, num_warps, num_stages).
# The table `python -m benchmarks.tune --write-table` chose on an H200 (jax-triton 0.3.1, triton 3.6):
# benchmarks/results/tuned_configs.json, from the sweep in tune.json beside it. Entries by case:
# rec-small and gr-ml1m (D <= 32), rec-mid (D = 64), rec-long (D = 128, 1024), long and dlrm-long.
_TUNED = {
    (True, 32, 256): _tiles((64, 32, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)),
    (True, 64, 256): _tiles((64, 32, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)),
    (True, 128, 1024): _tiles((128, 32, 8, 3), (32, 64, 4, 3), (128, 32, 4, 3)),
    (True, 128, None): _tiles((128, 64, 8, 3), (32, 64, 4, 3), (128, 32, 4, 3)),
    (False, 32, 256): _tiles((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2)),
    (False, 64, 256): _tiles((128, 32, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
    (False, 128, None): _tiles((128, 32, 8, 2), (16, 128, 8, 2), (128, 16, 8, 2)),
}
# Not measured: chosen to compile for sm_90 without register spills (checked with ptxas).
_UNTUNED = {
    (True, 256): _tiles((64, 32, 4, 2), (32, 64, 4, 1), (64, 32, 4, 1), 32),
    (False, 256): _tiles((64, 16, 4, 1), (16, 64, 4, 1), (64, 16, 4, 1), 32),
}


def table_key(head_dim: int, dtype, max_seq_len: int) -> tuple[bool, int, int | None] | None:
    """The entry of the tuned table a problem takes: the smallest measured padded head dimension that
    covers it, then the shortest max_seq_len bucket that covers it (the longest for longer ones).
    None for head dimensions past the measured ones."""
    narrow = np.dtype(dtype).itemsize <= 2
    block_d = head_block(head_dim)
    dims = sorted({d for n, d, _ in _TUNED if n == narrow and d >= block_d})
    if not dims:
        return None
    lengths = sorted((length or float("inf"), length) for n, d, length in _TUNED
                     if n == narrow and d == dims[0])
    covering = [length for bound, length in lengths if max_seq_len <= bound]
    return narrow, dims[0], covering[0] if covering else lengths[-1][1]


def key_to_text(key) -> str:
    narrow, dim, length = key
    return f"{'16bit' if narrow else '32bit'}/D{dim}/L{length if length else 'max'}"


@functools.cache
def _table(path: str | None) -> dict:
    if not path:
        return _TUNED
    with open(path) as f:
        entries = json.load(f)
    table = dict(_TUNED)
    by_text = {key_to_text(key): key for key in _TUNED}
    for text, tiles in entries.items():
        if text not in by_text:
            raise ValueError(f"{TUNED_CONFIGS_ENV}={path}: unknown entry {text!r}; known: {list(by_text)}")
        table[by_text[text]] = _tiles(tiles["fwd"], tiles["dkdv"], tiles["dq"])
    return table


def default_block_sizes(head_dim: int, dtype, max_seq_len: int) -> BlockSizes:
    """Tiles for the GPU kernels, by element size, padded head dimension and max_seq_len."""
    key = table_key(head_dim, dtype, max_seq_len)
    if key is None:
        return _UNTUNED[(np.dtype(dtype).itemsize <= 2, 256)]
    return _table(os.environ.get(TUNED_CONFIGS_ENV))[key]
