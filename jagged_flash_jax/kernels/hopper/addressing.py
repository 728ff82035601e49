"""Where a Hopper kernel's tiles are in global memory: the layouts of its arrays, a sequence's first token
in the TMA descriptors' 2-D views, a query's float32 statistics, the masked row stores of the epilogues
and fused dq's adds (masked atomics, or TMA reduce-adds of whole tiles). A layout is (tokens,
token_stride, head_stride), the strides in elements.

The descriptors view each array as 2-D [elements / token_stride, token_stride] (one row per token in
"THD", one per (head, token) in "HTD"): token t of head h is at row t + (h * head_stride) // token_stride
and column (h * head_stride) % token_stride. A tile that runs past a sequence reads other tokens or heads
(the copy engine reads zeros past the array, never outside it), which the kernels mask or zero.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from ..shared import (
    PARAM_KV_HEAD_STRIDE,
    PARAM_KV_TOKEN_STRIDE,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
)
from ..spec import HOPPER_FWD
from .pipeline import CONSUMER_ROWS, partition_barrier, tma_reduce_add

# The slots the Hopper kernels' runtime parameters add to the attention kernels' (the same in the three
# specs): the blocks of each (sequence, head) and the tokens of a fill chunk.
PARAM_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("blocks"))
PARAM_FILL_CHUNK: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("fill_chunk"))


@gluon.jit
def read_layout(params_ptr, KEYS: gl.constexpr, ALIGN: gl.constexpr):
    """The layout of q, o, do, dq, or with KEYS of k, v, dk, dv, from the runtime parameters (strides in
    units of ALIGN elements there)."""
    if KEYS:
        tokens = gl.load(params_ptr + PARAM_KV_TOKENS)
        token_stride = gl.load(params_ptr + PARAM_KV_TOKEN_STRIDE) * ALIGN
        head_stride = gl.load(params_ptr + PARAM_KV_HEAD_STRIDE) * ALIGN
    else:
        tokens = gl.load(params_ptr + PARAM_Q_TOKENS)
        token_stride = gl.load(params_ptr + PARAM_Q_TOKEN_STRIDE) * ALIGN
        head_stride = gl.load(params_ptr + PARAM_Q_HEAD_STRIDE) * ALIGN
    return tokens, token_stride, head_stride


@gluon.jit
def tile_origin(first_token, head, layout):
    """(row, column) of a sequence's first token of `head` in the descriptors' 2-D view, int32 as TMA takes
    them."""
    _, token_stride, head_stride = layout
    head_offset = head.to(gl.int64) * head_stride
    row = first_token + head_offset // token_stride
    return row.to(gl.int32), (head_offset % token_stride).to(gl.int32)


@gluon.jit
def stat_origin(first_token, head, q_tokens):
    """Where a sequence's first query of `head` sits in the float32 per-query statistics (the
    log-sum-exp, delta: [1, H, q_tokens])."""
    return head.to(gl.int64) * q_tokens + first_token


@gluon.jit
def store_rows(ptr, acc, factor, first_token, head, row0, n, layout, D: gl.constexpr,
               acc_layout: gl.constexpr):
    """acc * factor, a float32 [64, D] accumulator, into rows row0 + [0, 64) < n of `head` (tokens counted
    from first_token)."""
    _, token_stride, head_stride = layout
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offsets = (first_token + rows).to(gl.int64) * token_stride + head.to(gl.int64) * head_stride
    ptrs = ptr + gl.expand_dims(offsets, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, (acc * factor).to(ptr.dtype.element_ty), mask=gl.expand_dims(rows < n, 1))


# The staging buffer of `add_columns`: [64 columns d, queries] float32, each query's columns contiguous,
# in groups of 8 XOR-swizzled by the query: a warp's stores from the wgmma layout (8 columns d of 4
# queries two apart) hit 32 banks.
STAGE_LAYOUT: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[0, 1])


@gluon.jit
def row_base(ptr, first_token, head, layout):
    """Where token first_token of `head` starts in an array of `layout`."""
    _, token_stride, head_stride = layout
    return ptr + (first_token.to(gl.int64) * token_stride + head.to(gl.int64) * head_stride)


@gluon.jit
def add_columns(base, token_stride, acc_t, stage, col0, n):
    """acc_t, a float32 [64, COLS] wgmma accumulator of 64 columns d of rows transposed, atomically added
    (relaxed) into the rows of a sequence's head from `base` (`row_base`), token_stride apart: its column
    c into row col0 + c at base's 64 columns, unless col0 + c >= n (then nothing is added or addressed).
    Through `stage` (a [64, COLS] float32 buffer of one warpgroup's, STAGE_LAYOUT), read back 8 rows at a
    time, a row of four consecutive columns per thread: the layout Triton's coalescing gives the adds
    (`red.global.add.v4.f32`), so that it converts nothing itself (it would convert the whole tile in
    registers, beside the dk/dv kernel's accumulators: hundreds of bytes of spills more). Row offsets
    within a sequence are int32, as the launcher bounds them."""
    D: gl.constexpr = acc_t.shape[0]
    COLS: gl.constexpr = acc_t.shape[1]
    CHUNK: gl.constexpr = 8 if COLS > 8 else COLS
    chunk_layout: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])
    partition_barrier()  # every warp done reading the last tile's
    stage.store(acc_t)
    partition_barrier()
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, chunk_layout))
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_layout))
    ptrs = base + (gl.expand_dims((col0 + rows) * token_stride, 0) + gl.expand_dims(dims, 1))
    # The rows left below n, a scalar of the tile: a bound of each chunk's own would be a loop invariant
    # of the kernel's tile loop, which the compiler hoists (a register each, spilled).
    left = n - col0
    for c in gl.static_range(COLS // CHUNK):
        values = stage.slice(c * CHUNK, CHUNK, dim=1).load(chunk_layout)
        gl.atomic_add(ptrs, values, mask=gl.expand_dims(rows < left - c * CHUNK, 0), sem="relaxed")
        ptrs += CHUNK * token_stride


@gluon.jit
def reduce_columns(desc, origin, acc_t, stage, col0, D0: gl.constexpr):
    """acc_t, a float32 [64, COLS] wgmma accumulator of 64 columns d of rows transposed, added whole into
    the rows col0 + [0, COLS), columns D0 + [0, 64) of a sequence's head from origin in the 2-D view of
    `desc` (float32, blocks [COLS, 64]) by one asynchronous TMA reduce-add (`tma_reduce_add`, triton >=
    3.7), through `stage` (a [COLS, 64] buffer of one warpgroup's, desc's layout), once the warpgroup's
    last reduce-add has read it. The rows past the sequence's queries are added too (0, or NaN where the
    sequence has an inf key): desc's array must give them rows of their own, which no one reads (the
    dq-fused backward's padded accumulator). The warpgroup waits for its last reduce-add
    (tma.store_wait(0)) before the kernel ends."""
    row, col = origin
    tma.store_wait(0)  # the last reduce-add has read `stage` (issued by one thread: then the barrier)
    partition_barrier()
    stage.permute((1, 0)).store(acc_t)
    fence_async_shared()  # the generic-proxy writes visible to the copy engine, from every warp's rows
    partition_barrier()
    tma_reduce_add(desc, [row + col0, col + D0], stage)
