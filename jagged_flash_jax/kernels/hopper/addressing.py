"""Where a Hopper kernel's tiles are in global memory: the layouts of its arrays, a sequence's first token
in the TMA descriptors' 2-D views, a query's float32 statistics, and the masked row stores of the
epilogues. A layout is (tokens, token_stride, head_stride), the strides in elements.

The descriptors view each array as 2-D [elements / token_stride, token_stride] (one row per token in
"THD", one per (head, token) in "HTD"): token t of head h is at row t + (h * head_stride) // token_stride
and column (h * head_stride) % token_stride. A tile that runs past a sequence reads other tokens or heads
(the copy engine reads zeros past the array, never outside it), which the kernels mask or zero.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..shared import (
    PARAM_KV_HEAD_STRIDE,
    PARAM_KV_TOKEN_STRIDE,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
)
from ..spec import HOPPER_FWD
from .pipeline import CONSUMER_ROWS

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
