"""The Hopper kernels' zero fills, done by each persistent program before its blocks: the tokens of each
(sequence, head) past the maximum length and the tokens no sequence covers, for the forward's o and
log-sum-exp, dq, and dk with dv. `targets` is (o_ptr, second_ptr) and FILL = (D, BLOCK, SECOND): the
head dimension, the rows a store writes, and what the second target is (FILL_NONE, FILL_LSE, FILL_ROWS).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..shared import INF, attended, chunk_tokens, covered_range, decreasing, extent

# What the zero fills write besides their first array (see `_fill_rows`).
FILL_NONE: gl.constexpr = gl.constexpr(0)
FILL_LSE: gl.constexpr = gl.constexpr(1)
FILL_ROWS: gl.constexpr = gl.constexpr(2)


@gluon.jit
def _fill_rows(bases, tokens, keep, token_stride, FILL: gl.constexpr, layout: gl.constexpr):
    """o = 0 on the tokens `tokens` (a [BLOCK] row slice of `layout`) where `keep`, of one head: bases =
    (o_base, second_base) point at token 0 of the head. The second is, by SECOND: FILL_LSE the head's
    log-sum-exp (set to +inf), FILL_ROWS a second array of o's strides (zeroed too: dk and dv),
    FILL_NONE nothing."""
    o_base, second_base = bases
    D: gl.constexpr = FILL[0]
    BLOCK: gl.constexpr = FILL[1]
    SECOND: gl.constexpr = FILL[2]
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(tokens * token_stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(keep, 1) & gl.expand_dims(cols < D, 0)
    zeros = gl.zeros([BLOCK, D], gl.float32, layout=layout)
    gl.store(o_base + offsets, zeros.to(o_base.dtype.element_ty), mask=mask)
    if SECOND == FILL_LSE:
        infs = gl.full([BLOCK], INF, gl.float32, layout=gl.SliceLayout(1, layout))
        gl.store(second_base + tokens, infs, mask=keep)
    elif SECOND == FILL_ROWS:
        gl.store(second_base + offsets, zeros.to(second_base.dtype.element_ty), mask=mask)


@gluon.jit
def _fill_range(bases, first, last, token_stride, FILL: gl.constexpr):
    """`_fill_rows` on tokens [first, last) (int64)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for block_start in range(first, last, FILL[1]):
        tokens = block_start + gl.arange(0, FILL[1], layout=gl.SliceLayout(1, layout)).to(gl.int64)
        _fill_rows(bases, tokens, tokens < last, token_stride, FILL, layout)


@gluon.jit
def _bases(targets, head, layout, SECOND: gl.constexpr):
    """Token 0 of `head` in both targets (the log-sum-exp is [1, H, tokens])."""
    o_ptr, second_ptr = targets
    num_tokens, _, head_stride = layout
    o_base = o_ptr + head.to(gl.int64) * head_stride
    if SECOND == FILL_ROWS:
        second_base = second_ptr + head.to(gl.int64) * head_stride
    else:
        second_base = second_ptr + head.to(gl.int64) * num_tokens
    return o_base, second_base


@gluon.jit
def _offsets_sorted(offsets_ptr, batch, num_tokens, BLOCK: gl.constexpr):
    """Whether the clamped offsets are non-decreasing (then the sequences tile the tokens in order)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    unsorted = gl.zeros([BLOCK], gl.int32, layout=layout)
    for first in range(0, batch, BLOCK):
        index = first + gl.arange(0, BLOCK, layout=layout)
        unsorted += decreasing(offsets_ptr, index, batch, num_tokens).to(gl.int32)
    return gl.sum(unsorted, axis=0) == 0


@gluon.jit
def _zero_tail(targets, offsets_ptr, sequence, head, layout, MAX_LEN: gl.constexpr, FILL: gl.constexpr):
    """The tokens of a sequence past its first MAX_LEN."""
    num_tokens, token_stride, _ = layout
    start, end = extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        bases = _bases(targets, head, layout, FILL[2])
        _fill_range(bases, start + MAX_LEN, end, token_stride, FILL)


@gluon.jit
def _zero_uncovered(targets, offsets_ptr, batch, head, chunk, fill_chunk, layout, MAX_LEN: gl.constexpr,
                    FILL: gl.constexpr):
    """The tokens of [chunk * fill_chunk, +fill_chunk) that no sequence covers: with sorted offsets those
    before the first sequence and after the last; with malformed ones every token checked against every
    sequence's first MAX_LEN (slow, but right)."""
    num_tokens, token_stride, _ = layout
    first, last = chunk_tokens(chunk, fill_chunk, num_tokens)
    bases = _bases(targets, head, layout, FILL[2])
    if _offsets_sorted(offsets_ptr, batch, num_tokens, 128):
        covered_start, covered_end = covered_range(offsets_ptr, batch, num_tokens)
        _fill_range(bases, first, gl.minimum(last, covered_start), token_stride, FILL)
        _fill_range(bases, gl.maximum(first, covered_end), last, token_stride, FILL)
    else:
        layout_2d: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for block_start in range(first, last, FILL[1]):
            tokens = block_start + gl.arange(0, FILL[1], layout=gl.SliceLayout(1, layout_2d)).to(gl.int64)
            covered = attended(tokens, offsets_ptr, batch, num_tokens, MAX_LEN)
            keep = (tokens < last) & ~covered
            _fill_rows(bases, tokens, keep, token_stride, FILL, layout_2d)


@gluon.jit
def zero_fills(targets, offsets_ptr, batch, blocks, fill_chunk, layout, NUM_HEADS: gl.constexpr,
               MAX_LEN: gl.constexpr, FILL: gl.constexpr):
    """A persistent program's share of the zero fills (fill i, i + programs, ...), before its blocks: per
    (sequence, head) `_zero_tail`, then per head the blocks + 1 chunks of fill_chunk tokens of
    `_zero_uncovered` (fill_chunk * (blocks + 1) >= the tokens). Plain stores of the default partition's
    4 warps, before the partitions start. layout is the targets' (tokens, token_stride, head_stride)."""
    for fill in range(gl.program_id(0), (batch + blocks + 1) * NUM_HEADS, gl.num_programs(0)):
        sequence = fill // NUM_HEADS
        head = fill % NUM_HEADS
        if sequence < batch:
            _zero_tail(targets, offsets_ptr, sequence, head, layout, MAX_LEN, FILL)
        else:  # chunk sequence - batch of the uncovered tokens
            _zero_uncovered(targets, offsets_ptr, batch, head, sequence - batch, fill_chunk, layout, MAX_LEN,
                            FILL)
