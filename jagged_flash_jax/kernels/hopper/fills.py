"""The Hopper kernels' zero fills, done by each persistent program before its blocks: the tokens of each
(sequence, head) past the maximum length and the tokens no sequence covers, for the forward's o and
log-sum-exp, dq, and dk with dv.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..shared import INF, bounds, extent

# What the zero fills write besides their first array (see `_fill_rows`).
FILL_NONE: gl.constexpr = gl.constexpr(0)
FILL_LSE: gl.constexpr = gl.constexpr(1)
FILL_ROWS: gl.constexpr = gl.constexpr(2)


@gluon.jit
def _fill_rows(o_base, lse_base, tokens, keep, token_stride, D: gl.constexpr, BLOCK: gl.constexpr,
               layout: gl.constexpr, SECOND: gl.constexpr):
    """o = 0 on the tokens `tokens` (a [FILL_BLOCK] row slice of `layout`) where `keep`, of one head: o_base
    points at token 0 of the head. SECOND says what lse_base is: FILL_LSE the head's log-sum-exp of token
    0 (set to +inf), FILL_ROWS token 0 of a second array of o's strides (zeroed too: dk and dv),
    FILL_NONE nothing."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(tokens * token_stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(keep, 1) & gl.expand_dims(cols < D, 0)
    zeros = gl.zeros([BLOCK, D], gl.float32, layout=layout)
    gl.store(o_base + offsets, zeros.to(o_base.dtype.element_ty), mask=mask)
    if SECOND == FILL_LSE:
        infs = gl.full([BLOCK], INF, gl.float32, layout=gl.SliceLayout(1, layout))
        gl.store(lse_base + tokens, infs, mask=keep)
    elif SECOND == FILL_ROWS:
        gl.store(lse_base + offsets, zeros.to(lse_base.dtype.element_ty), mask=mask)


@gluon.jit
def _fill_range(o_base, lse_base, first, last, token_stride, D: gl.constexpr, BLOCK: gl.constexpr,
                SECOND: gl.constexpr):
    """`_fill_rows` on tokens [first, last) (int64)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for block_start in range(first, last, BLOCK):
        tokens = block_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout)).to(gl.int64)
        _fill_rows(o_base, lse_base, tokens, tokens < last, token_stride, D, BLOCK, layout, SECOND)


@gluon.jit
def _second_base(lse_ptr, head, num_tokens, head_stride, SECOND: gl.constexpr):
    """The head's token 0 in `_fill_rows`'s second target."""
    if SECOND == FILL_ROWS:
        base = lse_ptr + head.to(gl.int64) * head_stride
    else:
        base = lse_ptr + head.to(gl.int64) * num_tokens
    return base


@gluon.jit
def _offsets_sorted(offsets_ptr, batch, num_tokens, BLOCK: gl.constexpr):
    """common._offsets_sorted: whether the clamped offsets are non-decreasing."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    unsorted = gl.zeros([BLOCK], gl.int32, layout=layout)
    for first in range(0, batch, BLOCK):
        index = first + gl.arange(0, BLOCK, layout=layout)
        valid = index < batch
        lo = gl.load(offsets_ptr + index, mask=valid, other=0).to(gl.int64)
        hi = gl.load(offsets_ptr + index + 1, mask=valid, other=0).to(gl.int64)
        lo = gl.minimum(gl.maximum(lo, 0), num_tokens)
        hi = gl.minimum(gl.maximum(hi, 0), num_tokens)
        unsorted += (valid & (hi < lo)).to(gl.int32)
    return gl.sum(unsorted, axis=0) == 0


@gluon.jit
def _zero_tail(o_ptr, lse_ptr, offsets_ptr, sequence, head, num_tokens, token_stride, head_stride,
               MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr, SECOND: gl.constexpr):
    """common._zero_tail: the tokens of a sequence past its first MAX_LEN (`_fill_rows`' targets)."""
    start, end = extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        o_base = o_ptr + head.to(gl.int64) * head_stride
        lse_base = _second_base(lse_ptr, head, num_tokens, head_stride, SECOND)
        _fill_range(o_base, lse_base, start + MAX_LEN, end, token_stride, D, BLOCK, SECOND)


@gluon.jit
def _zero_uncovered(o_ptr, lse_ptr, offsets_ptr, batch, head, chunk, fill_chunk, num_tokens, token_stride,
                    head_stride, MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr,
                    SECOND: gl.constexpr):
    """common._zero_uncovered: the tokens of [chunk * fill_chunk, +fill_chunk) that no sequence covers
    (with sorted offsets those before the first sequence and after the last; else every token checked
    against every sequence's first n_q)."""
    first = chunk.to(gl.int64) * fill_chunk
    last = gl.minimum(first + fill_chunk, num_tokens)
    o_base = o_ptr + head.to(gl.int64) * head_stride
    lse_base = _second_base(lse_ptr, head, num_tokens, head_stride, SECOND)
    if _offsets_sorted(offsets_ptr, batch, num_tokens, 128):
        covered_start = gl.minimum(gl.maximum(gl.load(offsets_ptr).to(gl.int64), 0), num_tokens)
        covered_end = gl.minimum(gl.maximum(gl.load(offsets_ptr + batch).to(gl.int64), covered_start),
                                 num_tokens)
        _fill_range(o_base, lse_base, first, gl.minimum(last, covered_start), token_stride, D, BLOCK,
                    SECOND)
        _fill_range(o_base, lse_base, gl.maximum(first, covered_end), last, token_stride, D, BLOCK, SECOND)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for block_start in range(first, last, BLOCK):
            tokens = block_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout)).to(gl.int64)
            attended = tokens < 0
            for sequence in range(0, batch):
                start, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
                attended = attended | ((tokens >= start) & (tokens < start + length))
            _fill_rows(o_base, lse_base, tokens, (tokens < last) & ~attended, token_stride, D, BLOCK,
                       layout, SECOND)


@gluon.jit
def zero_fills(o_ptr, lse_ptr, offsets_ptr, batch, blocks, fill_chunk, num_tokens, token_stride, head_stride,
                NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr,
                SECOND: gl.constexpr):
    """A persistent program's share of the zero fills (fill i, i + programs, ...), before its blocks:
    per (sequence, head) `_zero_tail`, then per head the blocks + 1 chunks of fill_chunk tokens of
    `_zero_uncovered` (fill_chunk * (blocks + 1) >= num_tokens). Plain stores of the default partition's
    4 warps, before the partitions start."""
    for fill in range(gl.program_id(0), (batch + blocks + 1) * NUM_HEADS, gl.num_programs(0)):
        sequence = fill // NUM_HEADS
        head = fill % NUM_HEADS
        if sequence < batch:
            _zero_tail(o_ptr, lse_ptr, offsets_ptr, sequence, head, num_tokens, token_stride, head_stride,
                       MAX_LEN, D, BLOCK, SECOND)
        else:  # chunk sequence - batch of the uncovered tokens
            _zero_uncovered(o_ptr, lse_ptr, offsets_ptr, batch, head, sequence - batch, fill_chunk,
                            num_tokens, token_stride, head_stride, MAX_LEN, D, BLOCK, SECOND)

