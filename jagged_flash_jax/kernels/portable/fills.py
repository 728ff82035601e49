"""The portable kernels' zero fills: the tokens of a sequence past its maximum length, and the tokens no
sequence covers, so that every output element is written without a memset.
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
def _store_zeros(first_ptr, second_ptr, rows, keep, cols, token_stride, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TWO: tl.constexpr):
    """Write 0 to the rows `rows` where `keep` of a [tokens, D] view (of two, with TWO)."""
    offset = rows[:, None] * token_stride + cols[None, :]
    mask = keep[:, None] & (cols[None, :] < D)
    zeros = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    tl.store(first_ptr + offset, zeros.to(first_ptr.dtype.element_ty), mask=mask)
    if TWO:
        tl.store(second_ptr + offset, zeros.to(second_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_rows(first_ptr, second_ptr, rows_start, rows_end, cols, token_stride, D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TWO: tl.constexpr):
    """Write 0 to rows [rows_start, rows_end) of a [tokens, D] view (of two, with TWO)."""
    for start in range(rows_start, rows_end, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        _store_zeros(first_ptr, second_ptr, rows, rows < rows_end, cols, token_stride, D, BLOCK_D, BLOCK,
                     TWO)


@triton.jit
def zero_tail(first_ptr, second_ptr, offsets_ptr, sequence, segment, head, num_tokens, token_stride,
               head_stride, MAX_LEN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK: tl.constexpr, TWO: tl.constexpr):
    """Write 0 to the tokens of a sequence past its first MAX_LEN (the sequence's own, unattended)."""
    start, end = extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        first = token_ptr(first_ptr, segment, head, start, num_tokens, token_stride, head_stride)
        second = token_ptr(second_ptr, segment, head, start, num_tokens, token_stride, head_stride)
        _zero_rows(first, second, MAX_LEN, end - start, tl.arange(0, BLOCK_D), token_stride, D, BLOCK_D,
                   BLOCK, TWO)


@triton.jit
def zero_uncovered(first_ptr, second_ptr, offsets_ptr, batch, segment, head, chunk, fill_chunk,
                    num_tokens, token_stride, head_stride, MAX_LEN: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TWO: tl.constexpr):
    """Write 0 to the tokens of [chunk * fill_chunk, +fill_chunk) that no sequence covers.

    With sorted offsets those are the tokens before the first sequence and after the last (each
    sequence's programs clear its own tokens past MAX_LEN). With malformed offsets every token is
    checked against every sequence: slow, but right.
    """
    cols = tl.arange(0, BLOCK_D)
    first = chunk.to(tl.int64) * fill_chunk
    last = tl.minimum(first + fill_chunk, num_tokens)
    base_first = token_ptr(first_ptr, segment, head, 0, num_tokens, token_stride, head_stride)
    base_second = token_ptr(second_ptr, segment, head, 0, num_tokens, token_stride, head_stride)
    if _offsets_sorted(offsets_ptr, batch, num_tokens, 256):
        covered_start = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), num_tokens)
        covered_end = tl.minimum(tl.maximum(tl.load(offsets_ptr + batch).to(tl.int64), covered_start),
                                 num_tokens)
        _zero_rows(base_first, base_second, first, tl.minimum(last, covered_start), cols, token_stride, D,
                   BLOCK_D, BLOCK, TWO)
        _zero_rows(base_first, base_second, tl.maximum(first, covered_end), last, cols, token_stride, D,
                   BLOCK_D, BLOCK, TWO)
    else:
        for block_start in range(first, last, BLOCK):
            tokens = block_start + tl.arange(0, BLOCK)
            attended = tokens < 0
            for sequence in range(0, batch):
                start, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
                attended = attended | ((tokens >= start) & (tokens < start + length))
            _store_zeros(base_first, base_second, tokens, (tokens < last) & ~attended, cols, token_stride,
                         D, BLOCK_D, BLOCK, TWO)

