"""Launch configurations (tile sizes, warps, pipeline stages) of the kernels, and how one is chosen.

`BlockSizes` is a frozen, hashable dataclass so it can be a static argument of jitted functions. The
one GPU table, behind `default_block_sizes` (the portable kernels) and `hopper_block_sizes` (the Hopper
ones), is keyed by (GPU name, kernel family, bits of the inputs, padded head dimension, longest
max_seq_len covered); `python -m benchmarks.tune` writes entries of exactly that form to a JSON file,
which `load_table` merges over the built-in table (measured on an H200; select.py passes the file
$JAGGED_FLASH_JAX_TUNED_CONFIGS names). The interpreter uses small, deliberately unequal tiles so that
CPU tests walk several blocks in every loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

MAX_HEAD_DIM = 256
# The GPU whose table is used for GPUs (and head dimensions) that have no entry of their own.
FALLBACK_GPU = "NVIDIA H200"
# The longest key block `fit_to_lengths` grows a key block to.
FITTED_MAX_BLOCK_N = 128
# Shared memory a block may take on sm_90 (H100, H200: 227 KB), which a key block that
# `fit_to_lengths` grows must leave room in (`portable_shared_bytes`).
SHARED_MEMORY_BYTES = 232448


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile of one kernel: BLOCK_M query rows by BLOCK_N key rows, with Triton's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    # A cap on registers per thread (Triton's maxnreg, through jax-triton >= 0.4), or None: for
    # latency-bound tiles, where more programs per SM beat the registers they give up.
    max_registers: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Configurations of the forward, the dk/dv and dq programs, and the preprocess's row block.

    dk/dv and dq programs share one backward launch when they have the same num_warps, num_stages and
    max_registers, and run in a launch each otherwise. In the table's "hopper" entries a kernel that has
    no Hopper version at the entry's head dimension is None (the portable one runs there). fwd_causal,
    where not None, is the forward's tiles under causal=True (`default_block_sizes` and
    `hopper_block_sizes` put it in fwd's place); where None, fwd serves every mask.
    """

    fwd: KernelConfig | None
    dkdv: KernelConfig | None
    dq: KernelConfig | None
    preprocess_block_m: int = 64
    fwd_causal: KernelConfig | None = None

    @property
    def one_backward_launch(self) -> bool:
        launch = lambda c: (c.num_warps, c.num_stages, c.max_registers)  # noqa: E731
        return launch(self.dkdv) == launch(self.dq)


def head_block(head_dim: int) -> int:
    """The padded head dimension the kernels work on: a power of two, at least 16 (tl.dot's minimum).
    Also the longest block that rows of this many tokens need."""
    return max(16, 1 << (head_dim - 1).bit_length())


# The Hopper kernels (kernels/hopper/: forward.py, dkdv.py, dq.py) take their tiles from the table's
# "hopper" entries (BUILTIN_TABLE). Their fixed shapes: the forward's and dq's 128 query rows are two
# consumer warpgroups of 64, as dk/dv's 128 keys; 4 warps requested (the compiled kernel has 12: the
# consumers and a producer warpgroup, whose count the launch takes from the PTX, see
# _compat.patch_jax_triton); num_stages is the kernel's own ring of key (dq: query) tiles; max_registers
# is the cap that setmaxnreg redistributes, HOPPER_CONSUMER_REGS per consumer thread and
# HOPPER_PRODUCER_REGS per producer's. Measured on the H200: docs/performance.md, "Hopper kernels".
HOPPER_CONSUMER_REGS = 240
HOPPER_PRODUCER_REGS = 24
# Triton's num_stages for the Hopper kernels, whose pipelines are their own (the rings above): it only
# decides whether jax-triton's make_ttgir runs Triton's software pipeliner over them, which from 1 on
# puts a wgmma.wait_group 0 right after each asynchronous warpgroup_mma (PTX for sm_90a, triton 3.6 and
# 3.9), so that no product overlaps the work beside it. 0 skips it, leaving the kernel's own waits (the
# PTX is then the same as without the pass). Measured on the H200: the forward is faster with its own
# waits (its next S beside the softmax and P V); dq is no faster without the pipeliner; dk/dv with its
# own waits is faster where no band masks its query tiles (neither causal nor a window: 2.5-3.3% on
# `long`) and slower under a window (4% at a window of 1024): docs/performance.md, "Hopper kernels".
HOPPER_FWD_TRITON_STAGES = 0
HOPPER_BWD_TRITON_STAGES = 1  # dq, and dk/dv under causal or a window before triton 3.7
HOPPER_DKDV_UNBANDED_TRITON_STAGES = 0
# From triton 3.7 on, the pipeliner's PTX of a banded dk/dv makes ptxas serialize every wgmma (its C7513:
# "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline
# stage"; CUDA 13.0's ptxas and Triton 3.9's alike, causal or a window at D = 64 and 128; SASS: a
# WARPGROUP.DEPBAR after each of the loop's 24 HGMMA, where the same kernel from triton 3.6 waits where
# its PTX says, 5 times a tile): from there the banded dk/dv takes its own waits too.
HOPPER_DKDV_BANDED_OWN_WAITS_FROM = (3, 7)
# From this Triton release the portable forward loads its unmasked key blocks by TMA on Hopper GPUs
# (kernels.attention_fwd_tma_kernel): Triton >= 3.7 fences (fence.proxy.async) both products of every
# key block that cp.async loaded, TMA's writes need no fence (docs/performance.md, "Measured on 2026-12-07,
# session 3"; benchmarks/probes/proxy_fences.py).
PORTABLE_TMA_LOADS_FROM = (3, 7)
# ... at these head dimensions, where it measured faster (one H100, triton 3.9, benchmarks.probes.tma_forward;
# tests/gpu_results, "2026-12-07, session 5"): rec-long (D = 128) 0.281 against 0.291-0.293 ms. At D = 64
# it was not (L4096-D64 1.086-1.118 against 1.097-1.100 ms, its causal row 0.625 against 0.606-0.607, GQA
# 16/4 L512 causal 0.509-0.516 against 0.460-0.463); D = 256 is not measured. Elsewhere
# Portable(tma_loads=True) forces them.
PORTABLE_TMA_LOADS_HEAD_DIMS = (128,)


def hopper_dq_triton_stages(head_dim: int) -> int:
    """Triton's num_stages for the Hopper dq kernel: at D = 64 its own waits (0: it issues the next key
    tile's S and dP ahead of dQ, kernels/hopper/dq.py), else the pipeliner's (HOPPER_BWD_TRITON_STAGES)."""
    return 0 if head_dim <= 64 else HOPPER_BWD_TRITON_STAGES


def hopper_dkdv_triton_stages(banded: bool, triton_release: tuple[int, ...]) -> int:
    """Triton's num_stages for the Hopper dk/dv kernel (with or without a band) under a Triton release."""
    if banded and triton_release < HOPPER_DKDV_BANDED_OWN_WAITS_FROM:
        return HOPPER_BWD_TRITON_STAGES
    return HOPPER_DKDV_UNBANDED_TRITON_STAGES


# The Hopper kernels take 16-bit inputs (bfloat16, float16) only: the table refuses "hopper" entries of
# other bits (entry_from_json), so that a problem's Hopper tiles alone say whether a Hopper kernel runs.
HOPPER_BITS = 16
# Under "auto" the Hopper forward runs from sequences (the longer of max_seq_len and kv_max_seq_len) of
# this many tokens; shorter ones run the portable forward, its tiles fitted to the lengths (H200,
# D = 128, the persistent Hopper forward against the portable one: rec-long 0.241 against 0.285 ms,
# L1024 0.502 against 0.598; below 1024 tokens not measured; docs/performance.md).
HOPPER_FORWARD_MIN_LENGTH = 1024
# ... and only where a sequence may have a query block's worth of queries (max_seq_len, the queries'
# bound): with fewer, every 128-row block of the Hopper forward is mostly empty (H200, `cross`, 1-8
# queries against 512-4096 keys: the Hopper forward 0.112 ms, the portable one 0.0925; docs/performance.md).
HOPPER_FORWARD_MIN_QUERIES = 128
# The persistent Hopper forward's grid where the device does not say its SM count (H100 and H200 SXM).
HOPPER_SMS = 132
# Under "auto" the Hopper backward runs from sequences of this many tokens, and at these head dimensions
# only: below, and elsewhere, the portable backward is as fast or faster (H200, docs/performance.md,
# "Hopper kernels"). "hopper" runs it wherever the table has its tiles.
HOPPER_BACKWARD_MIN_LENGTH = 512
HOPPER_BACKWARD_AUTO_HEAD_DIMS = (64, 128, 256)
# (D = 64 since the GPU suite and memcheck ran with it chosen, under 3.6 and 3.9 (2026-12-04): L4096-D64
# 4.25 against the portable backward's 4.70 ms forward + backward under 3.6, 4.28-4.41 against 4.62-4.69
# under 3.9; gqa-16x4-L512-D64 2.64 against 2.68 under 3.6, causal 2.00 against 2.20.)
# With deterministic=False, "auto" takes the dq-fused Hopper backward ("hopper-fused-dq") where Triton's
# Gluon has the TMA reduce-add (3.7 on), at these head dimensions, from sequences of this many tokens
# (head dimension: tokens). On the H200 under 3.9, forward + backward in ms: at D = 128 faster from L8192
# (10.18 against 10.68; L16384 20.83 against 21.92, L32768 58.20 against 62.51, L16384 causal 11.05
# against 12.43), about even at L4096 (2.75 against 2.72) and slower below (L2048 3.43 against 3.20); at
# D = 64 faster wherever the Hopper backward runs (from 512 tokens): L4096-D64 3.79 against 4.28, causal
# 2.35 against 2.50, gqa-16x4-L512-D64 2.41 against 2.50, causal 1.97 against 2.02. By atomics from
# registers (3.6) slower on every D = 128 row, and on L4096-D64 (4.40 against 4.23) (docs/performance.md).
FUSED_DQ_MIN_LENGTH = {64: 512, 128: 8192}

# HSTU's Hopper forward (kernels/hopper/hstu_forward.py, implementation "hstu-hopper"): its fixed tile,
# 128 queries (two consumer warpgroups) by 64 keys in a 2-deep ring, the softmax forward's register
# split. Not measured: the softmax Hopper forward's narrow-band tile, a first choice until a GPU run
# tunes it. Its head dimensions (D of q and k, V of v), each its own (not padded).
HSTU_HOPPER_FWD_TILE = KernelConfig(128, 64, num_warps=4, num_stages=2, max_registers=168)
# HSTU's Hopper backward (kernels/hopper/hstu_backward.py): dk/dv's 128 keys (two consumer warpgroups') by
# query tiles of 64 in a 2-deep ring, dq's 128 queries by key tiles of 64 (the forward's), the softmax
# Hopper backward's register split. Not measured: a first choice (the softmax dk/dv's D = 128 tile)
# until a GPU run tunes them.
HSTU_HOPPER_BWD_DKDV_TILE = KernelConfig(64, 128, num_warps=4, num_stages=2, max_registers=168)
HSTU_HOPPER_BWD_DQ_TILE = KernelConfig(128, 64, num_warps=4, num_stages=2, max_registers=168)
HSTU_HOPPER_HEAD_DIMS = (64, 128)
# backend="auto" takes "hstu-hopper" (both passes) from sequences of this many tokens: it measured faster
# than the portable op, forward and forward + backward, at 1024, 4096 and 8192 under triton 3.6 and 3.9
# (docs/performance.md, 2026-12-03); shorter sequences were not measured.
HSTU_HOPPER_AUTO_MIN_LENGTH = 1024

INTERPRET_BLOCK_SIZES = BlockSizes(
    fwd=KernelConfig(16, 32),
    dkdv=KernelConfig(block_m=16, block_n=32),
    dq=KernelConfig(block_m=32, block_n=16),
    preprocess_block_m=16,
)

# ---------------------------------------------------------------------------------------------------
# The table: {(gpu, kernels, bits, head_dim, max_seq_len): BlockSizes}, and its JSON form (a list of
# entries)
# ---------------------------------------------------------------------------------------------------

# gpu: jax.devices()[0].device_kind; kernels: KERNEL_FAMILIES, whose tiles the entry holds; bits: 16 or
# 32 (the inputs' element size); head_dim: the padded head dimension (head_block; the Hopper kernels do
# not pad, their entries cover their own head dimension only); max_seq_len: the longest max_seq_len the
# entry covers (None: any longer), or the widest band (see band_width).
TableKey = tuple[str, str, int, int, "int | None"]
KERNEL_FAMILIES = ("portable", "hopper")


def entry_to_json(key: TableKey, tiles: BlockSizes) -> dict:
    gpu, kernels, bits, head_dim, max_seq_len = key
    names = ("fwd", "dkdv", "dq") + (("fwd_causal",) if tiles.fwd_causal is not None else ())
    configs = {name: None if getattr(tiles, name) is None else list(dataclasses.astuple(getattr(tiles, name)))
               for name in names}
    return dict(gpu=gpu, kernels=kernels, bits=bits, head_dim=head_dim, max_seq_len=max_seq_len, **configs,
                preprocess_block_m=tiles.preprocess_block_m)


def entry_from_json(entry: dict) -> tuple[TableKey, BlockSizes]:
    """An entry; without "kernels", the portable kernels' (as tables written before the field)."""
    kernels = str(entry.get("kernels", "portable"))
    if kernels not in KERNEL_FAMILIES:
        raise ValueError(f"a tile table entry's kernels must be one of {KERNEL_FAMILIES}, got {kernels!r}")
    key = (str(entry["gpu"]), kernels, int(entry["bits"]), int(entry["head_dim"]), entry.get("max_seq_len"))
    config = lambda name: None if entry.get(name) is None else KernelConfig(*entry[name])  # noqa: E731
    tiles = BlockSizes(config("fwd"), config("dkdv"), config("dq"), entry.get("preprocess_block_m", 64),
                       config("fwd_causal"))
    if kernels == "portable" and None in (tiles.fwd, tiles.dkdv, tiles.dq):
        raise ValueError(f"a portable tile table entry needs fwd, dkdv and dq tiles, got {entry}")
    if kernels == "hopper" and key[2] != HOPPER_BITS:
        raise ValueError(f"a hopper tile table entry's bits must be {HOPPER_BITS} (the Hopper kernels take "
                         f"16-bit inputs only), got {entry}")
    return key, tiles


def table_to_json(table: dict) -> list[dict]:
    return [entry_to_json(key, tiles) for key, tiles in table.items()]


def table_from_json(entries: list[dict]) -> dict:
    return dict(entry_from_json(entry) for entry in entries)


# The portable kernels' entries: what `python -m benchmarks.tune` chose on an H200, an entry per benchmark
# case it was tuned on. Where dq's warps or stages differ from dk/dv's the two run in separate launches.
# docs/performance.md ("Tile configurations") gives each entry's case and the measurements behind the
# choices. Then the Hopper kernels' (16-bit inputs only, fixed shapes: see HOPPER_CONSUMER_REGS), from
# the sweeps of docs/performance.md, "Hopper kernels". The portable forward at D = 64 under causal takes
# 4-warp tiles of 64 queries (fwd_causal; finer steps along the diagonal; H100, benchmarks.tune, two runs
# each: L4096-D64-causal 0.586-0.587 against 0.608-0.610 ms under 3.6, 0.603-0.614 against 0.642-0.651
# under 3.9; gqa-16x4-L512-D64-causal 0.451-0.452 against 0.539, and 0.460-0.463 against 0.559), where
# without a mask the 8-warp tile stays (L4096-D64: 1.038-1.045 against 1.049-1.054 under 3.6, 1.117-1.118
# against 1.163-1.188 under 3.9). Hopper entries: bands of at most 512 keys (a sliding window's,
# or sequences as short) take 64-key tiles in the forward and in dq, where a consumer warpgroup
# computes only the key tiles its own 64 queries see; 3 stages of 128 keys exceed shared memory at D = 128.
# So do causal forwards at D = 128 on sequences of at most 1024 tokens (fwd_causal: 3 stages of 64 keys,
# warpgroup 0 passing the diagonal block's last tile; H200, rec-long-causal under 3.9: 0.161 against
# 0.189 ms with the 128-key tiles, and 0.169 where both warpgroups compute every tile; cuDNN 0.178).
# At D = 256 dK and dV of 64 rows x 256 in float32 alone would need a consumer thread's 256 registers:
# dk/dv takes blocks of 64 keys, both consumers', each with half of the columns (kernels/hopper/dkdv.py,
# SPLIT_D), and dq key tiles of 32 (two stages of 64 exceed shared memory).
_H200 = FALLBACK_GPU
BUILTIN_TABLE = table_from_json([
    dict(gpu=_H200, bits=16, head_dim=32, max_seq_len=256, fwd=[64, 32, 4, 3], dkdv=[32, 64, 4, 3],
         dq=[64, 32, 4, 3]),
    dict(gpu=_H200, bits=16, head_dim=64, max_seq_len=256, fwd=[64, 32, 4, 3], dkdv=[32, 64, 4, 3],
         dq=[64, 32, 4, 3]),
    dict(gpu=_H200, bits=16, head_dim=64, max_seq_len=None, fwd=[128, 64, 8, 3], fwd_causal=[64, 64, 4, 3],
         dkdv=[32, 64, 4, 3], dq=[128, 32, 8, 3]),
    dict(gpu=_H200, bits=16, head_dim=128, max_seq_len=256, fwd=[64, 64, 4, 3], dkdv=[32, 64, 4, 3],
         dq=[128, 32, 4, 3]),
    dict(gpu=_H200, bits=16, head_dim=128, max_seq_len=1024, fwd=[128, 64, 8, 2, 128], dkdv=[64, 128, 8, 2],
         dq=[128, 64, 8, 2]),
    dict(gpu=_H200, bits=16, head_dim=128, max_seq_len=None, fwd=[128, 64, 8, 3], dkdv=[64, 128, 8, 2],
         dq=[128, 128, 8, 2]),
    dict(gpu=_H200, bits=16, head_dim=256, max_seq_len=None, fwd=[128, 64, 8, 2], dkdv=[64, 64, 8, 2],
         dq=[128, 32, 8, 3], preprocess_block_m=32),
    dict(gpu=_H200, bits=32, head_dim=32, max_seq_len=256, fwd=[32, 16, 2, 2], dkdv=[32, 64, 4, 2],
         dq=[64, 32, 4, 2]),
    dict(gpu=_H200, bits=32, head_dim=64, max_seq_len=256, fwd=[64, 32, 4, 2, 128], dkdv=[32, 128, 8, 2, 128],
         dq=[128, 32, 8, 2, 128]),
    dict(gpu=_H200, bits=32, head_dim=128, max_seq_len=None, fwd=[128, 64, 8, 2], dkdv=[16, 128, 8, 2],
         dq=[128, 32, 8, 2]),
    dict(gpu=_H200, bits=32, head_dim=256, max_seq_len=None, fwd=[64, 16, 4, 1], dkdv=[16, 64, 4, 1],
         dq=[64, 16, 4, 1], preprocess_block_m=32),
    dict(gpu=_H200, kernels="hopper", bits=16, head_dim=64, max_seq_len=None, fwd=None,
         dkdv=[64, 128, 4, 2, 168], dq=[128, 128, 4, 3, 168]),
    dict(gpu=_H200, kernels="hopper", bits=16, head_dim=128, max_seq_len=512, fwd=[128, 64, 4, 2, 168],
         dkdv=[64, 128, 4, 2, 168], dq=[128, 64, 4, 2, 168]),
    dict(gpu=_H200, kernels="hopper", bits=16, head_dim=128, max_seq_len=1024, fwd=[128, 128, 4, 2, 168],
         fwd_causal=[128, 64, 4, 3, 168], dkdv=[64, 128, 4, 2, 168], dq=[128, 128, 4, 2, 168]),
    dict(gpu=_H200, kernels="hopper", bits=16, head_dim=128, max_seq_len=None, fwd=[128, 128, 4, 2, 168],
         dkdv=[64, 128, 4, 2, 168], dq=[128, 128, 4, 2, 168]),
    dict(gpu=_H200, kernels="hopper", bits=16, head_dim=256, max_seq_len=None, fwd=[128, 64, 4, 2, 168],
         dkdv=[64, 64, 4, 2, 168], dq=[128, 32, 4, 2, 168]),
])


@functools.cache
def load_table(path: str | None) -> dict:
    """The built-in table, with the entries of the JSON file at `path` (if any) merged over it."""
    table = dict(BUILTIN_TABLE)
    if path:
        with open(path) as f:
            entries = json.load(f)
        if not isinstance(entries, list):
            raise ValueError(f"tuned tile table {path}: expected a list of entries as written by "
                             f"`python -m benchmarks.tune`, got {type(entries).__name__}")
        table.update(table_from_json(entries))
    return table


def hopper_head_dims(table: dict, gpu: str, *kernels: str) -> list[int]:
    """The head dimensions at which `table` has Hopper tiles of every kernel named ("fwd", "dkdv", "dq"),
    for `gpu` or FALLBACK_GPU."""
    gpus = (gpu, FALLBACK_GPU)
    return sorted({head_dim for (name, family, _, head_dim, _), tiles in table.items()
                   if name in gpus and family == "hopper"
                   and None not in (getattr(tiles, kernel) for kernel in kernels)})


def table_bits(dtype) -> int:
    """The entries' `bits` for inputs of `dtype`: 16 for 16-bit floats, 32 for float32."""
    return 16 if np.dtype(dtype).itemsize <= 2 else 32


def table_key(head_dim: int, dtype, max_seq_len: int, gpu: str = FALLBACK_GPU, table: dict | None = None,
              kernels: str = "portable") -> TableKey | None:
    """The entry a problem takes: the GPU's own entries of the kernel family, else FALLBACK_GPU's, for
    the inputs' bits; among them the smallest padded head dimension that covers head_dim, then the
    shortest max_seq_len bucket that covers max_seq_len (the longest for longer ones). None when no entry
    covers head_dim."""
    table = BUILTIN_TABLE if table is None else table
    bits = table_bits(dtype)
    block_d = head_block(head_dim)
    for name in dict.fromkeys((gpu, FALLBACK_GPU)):
        family = (name, kernels, bits)
        dims = sorted(d for *key, d, _ in table if tuple(key) == family and d >= block_d)
        if dims:
            lengths = sorted((float("inf") if n is None else n, n) for *key, d, n in table
                             if (*key, d) == (*family, dims[0]))
            covering = [n for bound, n in lengths if max_seq_len <= bound]
            return *family, dims[0], covering[0] if covering else lengths[-1][1]
    return None


def portable_shared_bytes(kernel: str, c: KernelConfig, head_dim: int, itemsize: int) -> int:
    """The shared memory a portable kernel's program takes with tiles `c` (`kernel`: "fwd", "dq" or
    "dkdv"), as Triton lays it out for sm_90a: the tiles it streams and those it holds. The forward
    streams K and V tiles of block_n rows and holds Q's block_m rows; the dq programs hold Q and dO; the
    dk/dv programs hold K and V and stream Q and dO tiles of block_m rows and their statistics. Query
    tiles of 64 rows or more (wgmma) take a buffer a stage; smaller ones (mma) one fewer, and their
    probabilities pass through shared memory (a KiB of slack covers what else they take). Within that
    KiB of the compiled figure on every tile checked (docs/performance.md, "Tile configurations")."""
    row = head_block(head_dim) * itemsize
    if kernel == "dkdv":
        return c.num_stages * (2 * c.block_m * row + 2 * c.block_m * 4) + 2 * c.block_n * row
    held = (2 if kernel == "dq" else 1) * c.block_m * row
    if c.block_m >= 64:
        return c.num_stages * 2 * c.block_n * row + held
    return (c.num_stages - 1) * 2 * c.block_n * row + held + c.block_m * c.block_n * itemsize + 1024


def fit_to_lengths(tiles: BlockSizes, max_seq_len: int, kv_max_seq_len: int, head_dim: int,
                   itemsize: int) -> BlockSizes:
    """`tiles` with each block no longer than the sequences it covers needs (a power of two, at least
    16): query blocks (block_m) up to max_seq_len, key blocks (block_n) up to kv_max_seq_len. So that a
    few queries against long keys (cross-attention) do not pad every query block to the keys' tile.

    A query block cut this way gives its rows to the key block (up to FITTED_MAX_BLOCK_N), keeping each
    program's work, and a forward of 16-32 query rows runs on at most 4 warps, which on few queries
    against many keys beat cutting the query blocks alone (docs/performance.md, "Tile configurations").
    A key block grows only as far as the program's shared memory (at this head dimension and element
    size) stays within SHARED_MEMORY_BYTES, or within the entry's own where that is more.
    """
    q_rows, kv_rows = head_block(max_seq_len), head_block(kv_max_seq_len)

    def fit(c: KernelConfig, kernel: str) -> KernelConfig:
        block_m = min(c.block_m, q_rows)
        block_n = c.block_n
        warps = c.num_warps
        if block_m < c.block_m:
            block_n = max(block_n, min(block_n * (c.block_m // block_m), FITTED_MAX_BLOCK_N))
            warps = min(warps, 4) if kernel == "fwd" else warps
        fitted = dataclasses.replace(c, block_m=block_m, block_n=min(block_n, kv_rows), num_warps=warps)
        budget = max(SHARED_MEMORY_BYTES, portable_shared_bytes(kernel, c, head_dim, itemsize))
        while (fitted.block_n > c.block_n
               and portable_shared_bytes(kernel, fitted, head_dim, itemsize) > budget):
            fitted = dataclasses.replace(fitted, block_n=fitted.block_n // 2)
        return fitted

    return dataclasses.replace(tiles, fwd=fit(tiles.fwd, "fwd"), dkdv=fit(tiles.dkdv, "dkdv"),
                               dq=fit(tiles.dq, "dq"))


def band_width(window: tuple[int | None, int | None], causal: bool) -> int | None:
    """A window's width, left + right (right 0 under causal; a query sees one key more, its own
    position's), which keys the tile table as a sequence length would; None where a side is unbounded."""
    left, right = window[0], 0 if causal else window[1]
    return None if left is None or right is None else left + right


def _entry(kernels: str, head_dim: int, dtype, max_seq_len: int, kv_max_seq_len: int | None,
           band: int | None, table: dict | None, gpu: str) -> tuple[TableKey | None, dict, int]:
    """The key of the kernel family's entry for the problem, keyed by the most keys one query sees: the
    longer of max_seq_len and kv_max_seq_len, or `band` where shorter (a sliding window's width, whose
    blocks are shaped like short sequences'); the table (the built-in one where None); and
    kv_max_seq_len (default: max_seq_len)."""
    table = BUILTIN_TABLE if table is None else table
    kv_max_seq_len = max_seq_len if kv_max_seq_len is None else kv_max_seq_len
    longest = max(max_seq_len, kv_max_seq_len)
    keys = longest if band is None else min(longest, band)
    return table_key(head_dim, dtype, keys, gpu=gpu, table=table, kernels=kernels), table, kv_max_seq_len


def _for_mask(tiles: BlockSizes, causal: bool) -> BlockSizes:
    """An entry's tiles under causal masking: its fwd_causal, where it has one, in fwd's place."""
    if causal and tiles.fwd_causal is not None:
        return dataclasses.replace(tiles, fwd=tiles.fwd_causal, fwd_causal=None)
    return tiles


def default_block_sizes(head_dim: int, dtype, max_seq_len: int, kv_max_seq_len: int | None = None,
                        band: int | None = None, *, causal: bool = False, table: dict | None = None,
                        gpu: str = FALLBACK_GPU) -> BlockSizes:
    """Tiles for the portable GPU kernels: the table's entry by GPU, element size, padded head dimension
    and the most keys one query sees (see `_entry`), its fwd_causal as fwd where causal, fitted to both
    lengths; the tiles that run, so without a fwd_causal of their own (as the block_sizes argument)."""
    key, table, kv_max_seq_len = _entry("portable", head_dim, dtype, max_seq_len, kv_max_seq_len, band, table,
                                        gpu)
    if key is None:
        raise ValueError(f"no tile configuration covers head dimension {head_dim} (at most {MAX_HEAD_DIM})")
    tiles = dataclasses.replace(_for_mask(table[key], causal), fwd_causal=None)
    return fit_to_lengths(tiles, max_seq_len, kv_max_seq_len, head_dim, np.dtype(dtype).itemsize)


def hopper_block_sizes(head_dim: int, dtype, max_seq_len: int, kv_max_seq_len: int | None = None,
                       band: int | None = None, *, causal: bool = False, table: dict | None = None,
                       gpu: str = FALLBACK_GPU) -> BlockSizes | None:
    """Tiles for the Hopper kernels, as `default_block_sizes` chooses them from the table's "hopper"
    entries, of exactly this head dimension (the kernels do not pad it) and not fitted (their shapes are
    fixed), the entry's fwd_causal as fwd where causal; None where there is no entry (no Hopper kernel
    runs). A kernel whose tiles are None runs its portable version."""
    key, table, _ = _entry("hopper", head_dim, dtype, max_seq_len, kv_max_seq_len, band, table, gpu)
    if key is None:
        return None
    _, _, _, entry_head_dim, _ = key
    if entry_head_dim != head_dim:
        return None
    return _for_mask(table[key], causal)
