"""Where a Hopper kernel's tiles are in global memory: a sequence's first token in the TMA descriptors'
2-D views, a query's float32 statistics, and the masked row stores of the epilogues.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .pipeline import CONSUMER_ROWS


@gluon.jit
def tile_origin(first_token, head, token_stride, head_stride):
    """(row, column) of a sequence's first token of `head` in the descriptors' 2-D view (see the
    module's docstring), int32 as TMA takes them."""
    head_offset = head.to(gl.int64) * head_stride
    row = first_token + head_offset // token_stride
    return row.to(gl.int32), (head_offset % token_stride).to(gl.int32)


@gluon.jit
def stat_origin(first_token, head, q_tokens):
    """Where a sequence's first query of `head` sits in the float32 per-query statistics (the
    log-sum-exp, delta: [1, H, q_tokens])."""
    return head.to(gl.int64) * q_tokens + first_token



@gluon.jit
def store_rows(ptr, acc, first_token, row0, n, head, factor, token_stride, head_stride, D: gl.constexpr,
                acc_layout: gl.constexpr):
    """Rows row0 + [0, 64) < n of one head (tokens from first_token), from a float32 [64, D] accumulator
    times `factor`."""
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offsets = (first_token + rows).to(gl.int64) * token_stride + head.to(gl.int64) * head_stride
    ptrs = ptr + gl.expand_dims(offsets, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, (acc * factor).to(ptr.dtype.element_ty), mask=gl.expand_dims(rows < n, 1))

