"""The portable kernels' zero fills: the tokens of a sequence past its maximum length, and the tokens no
sequence covers, so that every output element is written without a memset. `targets` is (first_ptr,
second_ptr), two arrays of one layout (dk and dv) or one twice; FILL = (D, BLOCK_D, BLOCK, TWO): the
head dimension and its block, the rows a store writes, and whether the second array is written.
"""

import triton
import triton.language as tl

from ..shared import bounds, extent
from .memory import token_ptr


@triton.jit
def _offsets_sorted(offsets_ptr, batch, num_tokens, BLOCK: tl.constexpr):
    """Whether the clamped offsets are non-decreasing (then the sequences tile the tokens in order)."""
    unsorted = tl.zeros([1], dtype=tl.int32)
    for first in range(0, batch, BLOCK):
        index = first + tl.arange(0, BLOCK)
        valid = index < batch
        lo = tl.load(offsets_ptr + index, mask=valid, other=0).to(tl.int64)
        hi = tl.load(offsets_ptr + index + 1, mask=valid, other=0).to(tl.int64)
        lo = tl.minimum(tl.maximum(lo, 0), num_tokens)
        hi = tl.minimum(tl.maximum(hi, 0), num_tokens)
        unsorted += tl.sum((valid & (hi < lo)).to(tl.int32), axis=0)
    return tl.sum(unsorted, axis=0) == 0


@triton.jit
def _store_zeros(targets, rows, keep, cols, token_stride, FILL: tl.constexpr):
    """Write 0 to the rows `rows` where `keep` of the targets."""
    first_ptr, second_ptr = targets
    D: tl.constexpr = FILL[0]
    offset = rows[:, None] * token_stride + cols[None, :]
    mask = keep[:, None] & (cols[None, :] < D)
    zeros = tl.zeros([FILL[2], FILL[1]], dtype=tl.float32)
    tl.store(first_ptr + offset, zeros.to(first_ptr.dtype.element_ty), mask=mask)
    if FILL[3]:
        tl.store(second_ptr + offset, zeros.to(second_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_rows(targets, rows_start, rows_end, cols, token_stride, FILL: tl.constexpr):
    """Write 0 to rows [rows_start, rows_end) of the targets."""
    for start in range(rows_start, rows_end, FILL[2]):
        rows = start + tl.arange(0, FILL[2])
        _store_zeros(targets, rows, rows < rows_end, cols, token_stride, FILL)


@triton.jit
def zero_tail(targets, offsets_ptr, sequence, segment, head, layout, MAX_LEN: tl.constexpr,
              FILL: tl.constexpr):
    """Write 0 to the tokens of a sequence past its first MAX_LEN (the sequence's own, unattended)."""
    first_ptr, second_ptr = targets
    num_tokens, token_stride, _ = layout
    start, end = extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        first = token_ptr(first_ptr, segment, head, start, layout)
        second = token_ptr(second_ptr, segment, head, start, layout)
        _zero_rows((first, second), MAX_LEN, end - start, tl.arange(0, FILL[1]), token_stride, FILL)


@triton.jit
def zero_uncovered(targets, offsets_ptr, batch, segment, head, chunk, fill_chunk, layout,
                   MAX_LEN: tl.constexpr, FILL: tl.constexpr):
    """Write 0 to the tokens of [chunk * fill_chunk, +fill_chunk) that no sequence covers.

    With sorted offsets those are the tokens before the first sequence and after the last (each
    sequence's programs clear its own tokens past MAX_LEN). With malformed offsets every token is
    checked against every sequence: slow, but right.
    """
    first_ptr, second_ptr = targets
    num_tokens, token_stride, _ = layout
    cols = tl.arange(0, FILL[1])
    first = chunk.to(tl.int64) * fill_chunk
    last = tl.minimum(first + fill_chunk, num_tokens)
    bases = (token_ptr(first_ptr, segment, head, 0, layout), token_ptr(second_ptr, segment, head, 0, layout))
    if _offsets_sorted(offsets_ptr, batch, num_tokens, 256):
        covered_start = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), num_tokens)
        covered_end = tl.minimum(tl.maximum(tl.load(offsets_ptr + batch).to(tl.int64), covered_start),
                                 num_tokens)
        _zero_rows(bases, first, tl.minimum(last, covered_start), cols, token_stride, FILL)
        _zero_rows(bases, tl.maximum(first, covered_end), last, cols, token_stride, FILL)
    else:
        for block_start in range(first, last, FILL[2]):
            tokens = block_start + tl.arange(0, FILL[2])
            attended = tokens < 0
            for sequence in range(0, batch):
                start, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
                attended = attended | ((tokens >= start) & (tokens < start + length))
            _store_zeros(bases, tokens, (tokens < last) & ~attended, cols, token_stride, FILL)
