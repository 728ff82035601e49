"""What every family of kernels shares: the runtime-parameter layout, the grid, a sequence's extent, the
addressing of tokens and heads, the masked loads and stores, the key and query ranges a block attends,
the online-softmax step and the zero fills of the tokens no sequence attends.

Pure Triton, no JAX. A kernel module imports the helpers it calls; each runs with this module's
globals, in compiled code and in the interpreter (see _compat._twin_namespace).
"""

import triton
import triton.language as tl

from .spec import ATTENTION_BWD, ATTENTION_BWD_PREPROCESS, ATTENTION_FWD, ATTENTION_PARAMS, KEY_MAJOR

INF: tl.constexpr = tl.constexpr(float("inf"))

# The slots of the runtime-parameter arrays (kernels/spec.py), as constants the kernels can read: those
# every attention kernel starts with, then each kernel's own.
PARAM_BATCH: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("batch"))
PARAM_Q_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_tokens"))
PARAM_KV_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_tokens"))
PARAM_Q_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_token_stride"))
PARAM_Q_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_head_stride"))
PARAM_KV_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_token_stride"))
PARAM_KV_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_head_stride"))
PARAM_Q_OFFSETS_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_offsets_stride"))
PARAM_KV_OFFSETS_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_offsets_stride"))
PARAM_FWD_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("fill_chunk"))
PARAM_FWD_SLOTS: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("slots"))
PARAM_FWD_V_D_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("v_d_stride"))
PARAM_BWD_Q_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("q_fill_chunk"))
PARAM_BWD_KV_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("kv_fill_chunk"))
PARAM_BWD_SLOTS: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("slots"))
PARAM_BWD_KM_D_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("km_d_stride"))
# The kernels over one array's tokens (the preprocess, the key-major transpose) share their first slots.
PARAM_ARRAY_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("tokens"))
PARAM_ARRAY_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("token_stride"))
PARAM_ARRAY_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("head_stride"))
PARAM_KEY_MAJOR_PADDED: tl.constexpr = tl.constexpr(KEY_MAJOR.slot("padded"))


# ---------------------------------------------------------------------------------------------------
# Addressing
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _program(batch, slots, NUM_HEADS: tl.constexpr):
    """(segment, sequence, head, slot) of this program: sequence == batch is the zero-fill program.

    Two grids, chosen by the launcher. A two-axis grid [(segment, sequence, head), slot] runs every
    sequence's first slot, then every second one, and so on. A one-axis grid keeps each sequence's
    slots adjacent, for launches whose operands outgrow L2: the programs running at one time then share
    a few heads' keys and values (forward, dq) or queries (dk/dv) in L2, instead of each streaming its
    own head from memory. Slots count down, so slot 0 (the tail-zeroing program) runs last.
    """
    if tl.num_programs(1) == 1:
        pid = tl.program_id(0)
        slot = pid % slots
        head_sequence = pid // slots
    else:
        slot = tl.program_id(1)
        head_sequence = tl.program_id(0)
    head = head_sequence % NUM_HEADS
    segment_sequence = head_sequence // NUM_HEADS
    return segment_sequence // (batch + 1), segment_sequence % (batch + 1), head, slots - 1 - slot


@triton.jit
def _aligned(stride, ALIGN: tl.constexpr):
    """A stride given in units of ALIGN elements, in elements. The constant factor tells the compiler
    that rows are ALIGN-aligned: without it every load falls back to single elements, with no
    asynchronous copies (tl.multiple_of on a runtime scalar did not do this)."""
    return stride * ALIGN


@triton.jit
def _params(params_ptr, ALIGN: tl.constexpr):
    """The runtime sizes an attention kernel shares (slots PARAM_BATCH to PARAM_KV_OFFSETS_STRIDE), read
    from the int32 array the launcher passes (not as scalar arguments, whose values jax-triton
    specializes), the strides in elements."""
    batch = tl.load(params_ptr + PARAM_BATCH)
    q_tokens = tl.load(params_ptr + PARAM_Q_TOKENS)
    kv_tokens = tl.load(params_ptr + PARAM_KV_TOKENS)
    q_token_stride = _aligned(tl.load(params_ptr + PARAM_Q_TOKEN_STRIDE), ALIGN)
    q_head_stride = _aligned(tl.load(params_ptr + PARAM_Q_HEAD_STRIDE), ALIGN)
    kv_token_stride = _aligned(tl.load(params_ptr + PARAM_KV_TOKEN_STRIDE), ALIGN)
    kv_head_stride = _aligned(tl.load(params_ptr + PARAM_KV_HEAD_STRIDE), ALIGN)
    q_offsets_stride = tl.load(params_ptr + PARAM_Q_OFFSETS_STRIDE)
    kv_offsets_stride = tl.load(params_ptr + PARAM_KV_OFFSETS_STRIDE)
    return (batch, q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
            q_offsets_stride, kv_offsets_stride)


@triton.jit
def _extent(offsets_ptr, sequence, num_tokens):
    """First and end token (int64) of a sequence.

    Offsets are clamped into [0, num_tokens] and each end to at least its start, so that no content of
    `offsets` (negative, decreasing, past the end) can address memory outside the arrays.
    """
    start = tl.load(offsets_ptr + sequence).to(tl.int64)
    end = tl.load(offsets_ptr + sequence + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    return start, tl.minimum(tl.maximum(end, start), num_tokens)


@triton.jit
def _bounds(offsets_ptr, sequence, num_tokens, MAX_LEN: tl.constexpr):
    """First token (int64) and attended length (int32) of a sequence (see `_extent`)."""
    start, end = _extent(offsets_ptr, sequence, num_tokens)
    return start, tl.minimum(end - start, MAX_LEN).to(tl.int32)


@triton.jit
def _rows(ptr, segment, head, first_token, num_tokens, token_stride, head_stride):
    """Pointer to token `first_token` of `head` in `segment` (int64 arithmetic)."""
    token = segment.to(tl.int64) * num_tokens + first_token
    return ptr + token * token_stride + head.to(tl.int64) * head_stride


@triton.jit
def _stats(ptr, segment, head, first_token, num_tokens, NUM_HEADS: tl.constexpr):
    """Pointer to the float32 statistic [segments, H, tokens] of `first_token`."""
    return ptr + (segment.to(tl.int64) * NUM_HEADS + head) * num_tokens + first_token


@triton.jit
def _key_major_window(segment, seq_start, length, num_tokens, ALIGN: tl.constexpr):
    """(window, lead) of a sequence in a key-major [D, tokens] copy, whose token axis runs over every
    segment: the ALIGN-aligned token at or before the sequence's first (so that its rows load in 16-byte
    pieces), and the tokens from there to the sequence, which the kernels mask."""
    first = segment.to(tl.int64) * num_tokens + seq_start
    window = first // ALIGN * ALIGN
    # No window for no tokens: a block of only masked keys would give non-causal rows a max of -inf.
    lead = tl.where(length > 0, first - window, 0).to(tl.int32)
    return window, lead


# ---------------------------------------------------------------------------------------------------
# Loads and stores, masked
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _load(base, rows, cols, num_rows, token_stride, D: tl.constexpr, BLOCK_D: tl.constexpr,
          MASK_ROWS: tl.constexpr):
    """Rows `rows` of a [tokens, D] view, [len(rows), BLOCK_D]; rows >= num_rows and cols >= D read 0."""
    ptrs = base + rows[:, None] * token_stride + cols[None, :]
    if MASK_ROWS:
        mask = rows[:, None] < num_rows
        if BLOCK_D != D:
            mask = mask & (cols[None, :] < D)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_key_major(base, rows, cols, first_row, num_rows, d_stride, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """`_load` of a [D, tokens] view (tokens contiguous, D rows `d_stride` apart): rows `rows` as
    [BLOCK_D, len(rows)]; rows outside [first_row, num_rows) (a window's lead, see `_key_major_window`)
    and cols >= D read 0."""
    ptrs = base + rows[None, :] + cols[:, None] * d_stride
    if MASKED:
        mask = (rows[None, :] >= first_row) & (rows[None, :] < num_rows)
        if BLOCK_D != D:
            mask = mask & (cols[:, None] < D)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=cols[:, None] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store(base, rows, cols, num_rows, value, token_stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    mask = rows[:, None] < num_rows
    if BLOCK_D != D:
        mask = mask & (cols[None, :] < D)
    tl.store(base + rows[:, None] * token_stride + cols[None, :], value.to(base.dtype.element_ty),
             mask=mask)


# ---------------------------------------------------------------------------------------------------
# What a block attends, and the online softmax
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _query_shift(n_q, n_k, ALIGNED: tl.constexpr):
    """Query i sits at key position i + shift, bottom-right aligned (0 where nothing reads it: ALIGNED is
    whether a mask or a bias does)."""
    if ALIGNED:
        return n_k - n_q
    else:
        return 0


@triton.jit
def _band(keep, query_rows, key_rows, shift, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
          WINDOW_RIGHT: tl.constexpr):
    """keep, and whether each key (key_rows, broadcast against query_rows) is in its query's band:
    i + shift - WINDOW_LEFT <= j <= i + shift + WINDOW_RIGHT (a bound of -1 is none), and j <= i + shift
    when CAUSAL."""
    if CAUSAL:
        keep = (key_rows <= query_rows + shift) & keep
    if WINDOW_RIGHT >= 0:
        keep = (key_rows <= query_rows + (shift + WINDOW_RIGHT)) & keep
    if WINDOW_LEFT >= 0:
        keep = (key_rows >= query_rows + (shift - WINDOW_LEFT)) & keep
    return keep


@triton.jit
def _ceil_to(x, BLOCK: tl.constexpr):
    return (x + BLOCK - 1) // BLOCK * BLOCK


@triton.jit
def _key_ranges(query_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """For queries [query_start, +BLOCK_M): (start, clean_start, clean_end, end), the keys [start, end)
    some query of the block sees (the blocks outside are skipped: a window's cost grows with its width,
    not with n_k), of which the key blocks in [clean_start, clean_end) need no mask (every query of the
    block sees every key). start and the clean bounds are multiples of BLOCK_N, clean_start <= clean_end,
    and a first loop over [start, min(clean_start, end)) covers the masked keys before the clean ones."""
    shift = n_k - n_q
    last = query_start + BLOCK_M - 1
    start = n_k * 0
    clean_start = n_k * 0
    end = n_k
    clean_end = n_k
    if WINDOW_LEFT >= 0:
        start = tl.maximum(query_start + shift - WINDOW_LEFT, 0)
        clean_start = tl.maximum(last + shift - WINDOW_LEFT, 0)
    if CAUSAL:
        end = tl.minimum(end, last + shift + 1)
        clean_end = tl.minimum(clean_end, query_start + shift + 1)
    if WINDOW_RIGHT >= 0:
        end = tl.minimum(end, last + shift + WINDOW_RIGHT + 1)
        clean_end = tl.minimum(clean_end, query_start + shift + WINDOW_RIGHT + 1)
    start = start // BLOCK_N * BLOCK_N
    clean_start = _ceil_to(clean_start, BLOCK_N)
    clean_end = tl.maximum(tl.maximum(clean_end, 0) // BLOCK_N * BLOCK_N, clean_start)
    return start, clean_start, clean_end, tl.maximum(end, 0)


@triton.jit
def _span(SPAN: tl.constexpr, start, clean_start, clean_end, end, CLIP_FIRST: tl.constexpr):
    """[lo, hi) of span SPAN of the ranges `_key_ranges` / `_query_ranges` give: 0 the masked blocks
    before the clean ones (clipped at `end` when CLIP_FIRST: only a window's first span may pass it),
    1 the clean blocks, 2 the masked blocks after them. A loop walks SPAN over tl.static_range(3), with
    MASKED=SPAN != 1: one call site, three specialized loops."""
    if SPAN == 0:
        if CLIP_FIRST:
            return start, tl.minimum(clean_start, end)
        else:
            return start, clean_start
    elif SPAN == 1:
        return clean_start, clean_end
    else:
        return clean_end, end


@triton.jit
def _query_ranges(key_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """For keys [key_start, +BLOCK_N): (start, clean_start, clean_end, end), the queries [start, end)
    that see some of them, of which the query blocks in [clean_start, clean_end) see all of them
    (unmasked), as `_key_ranges` (multiples of BLOCK_M but end)."""
    if WINDOW_LEFT < 0 and WINDOW_RIGHT < 0:
        # No window: the form ptxas spills least with in the causal backward (116 bytes of spill stores
        # against 644 with the general form below, at 64 x 128 dk/dv and 128 x 128 dq tiles, 8 warps).
        clean_end = n_q // BLOCK_M * BLOCK_M
        if CAUSAL:
            start = tl.maximum(key_start - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
            diagonal_end = _ceil_to(tl.maximum(key_start + BLOCK_N - 1 - (n_k - n_q), 0), BLOCK_M)
            clean_start = tl.minimum(tl.maximum(diagonal_end, start), tl.maximum(clean_end, start))
            return start, clean_start, tl.maximum(clean_start, clean_end), n_q
        return n_q * 0, n_q * 0, clean_end, n_q
    shift = n_k - n_q
    last = key_start + BLOCK_N - 1
    start = n_q * 0
    clean_start = n_q * 0
    end = n_q
    clean_end = n_q
    # Query i sees key j when j - shift - right <= i <= j - shift + left.
    if CAUSAL:
        start = tl.maximum(start, key_start - shift)
        clean_start = tl.maximum(clean_start, last - shift)
    if WINDOW_RIGHT >= 0:
        start = tl.maximum(start, key_start - shift - WINDOW_RIGHT)
        clean_start = tl.maximum(clean_start, last - shift - WINDOW_RIGHT)
    if WINDOW_LEFT >= 0:
        end = tl.minimum(n_q, last - shift + WINDOW_LEFT + 1)
        clean_end = tl.minimum(n_q, key_start - shift + WINDOW_LEFT + 1)
    start = start // BLOCK_M * BLOCK_M
    clean_start = _ceil_to(clean_start, BLOCK_M)
    clean_end = tl.maximum(tl.maximum(clean_end, 0) // BLOCK_M * BLOCK_M, clean_start)
    return start, clean_start, clean_end, tl.maximum(end, 0)


@triton.jit
def _tanh(y):
    """tanh on exp2 (tl.math has no tanh on every Triton this package supports): +-1 exactly once |y|
    passes 9, never NaN for a finite or infinite y."""
    e = tl.math.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|), in [0, 1]
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


@triton.jit
def _scores(dots, query_rows, key_rows, shift, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """(x, t): the scores the softmax takes, in units of the unscaled q.k (so that the online softmax,
    the log-sum-exp and delta keep theirs), and the tanh of the soft cap (its derivative is 1 - t^2).
    SOFTCAP is the cap divided by the scale (0: none): x = SOFTCAP * tanh(dots / SOFTCAP). With ALIBI,
    x -= slope * |i + shift - j|, the slope (of this head) divided by the scale."""
    t = dots
    x = dots
    if SOFTCAP > 0:
        t = _tanh(dots * (1.0 / SOFTCAP))
        x = t * SOFTCAP
    if ALIBI:
        x = x - slope * tl.abs(query_rows + shift - key_rows).to(tl.float32)
    return x, t


@triton.jit
def _online_softmax(scores, row_max, row_sum, QK_SCALE: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """One step of the online softmax, in base 2, over the scores [rows, keys] of a key block (masked
    ones -inf): (p, correction, row_sum, row_max) with p the block's probabilities against the new
    running max, correction the factor for what was accumulated before. row_max is the running maximum
    of the unscaled scores. EMPTY_ROWS: a row may have had no unmasked key so far (max -inf)."""
    # The max is subtracted before the scale (QK_SCALE > 0, so they commute): the top score gets
    # exactly 2**0, which no rounding of a scaled max could guarantee once |scores| pass 2**24.
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if EMPTY_ROWS:
        # A row whose keys are all masked so far keeps max -inf; subtract 0 there, not -inf.
        new_max_safe = tl.where(new_max == -INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    p = tl.math.exp2((scores - new_max_safe[:, None]) * QK_SCALE)
    correction = tl.math.exp2((row_max - new_max_safe) * QK_SCALE)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    return p, correction, row_sum, new_max


# ---------------------------------------------------------------------------------------------------
# Zero fill: the tokens no sequence attends
# ---------------------------------------------------------------------------------------------------


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
def _zero_tail(first_ptr, second_ptr, offsets_ptr, sequence, segment, head, num_tokens, token_stride,
               head_stride, MAX_LEN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK: tl.constexpr, TWO: tl.constexpr):
    """Write 0 to the tokens of a sequence past its first MAX_LEN (the sequence's own, unattended)."""
    start, end = _extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        first = _rows(first_ptr, segment, head, start, num_tokens, token_stride, head_stride)
        second = _rows(second_ptr, segment, head, start, num_tokens, token_stride, head_stride)
        _zero_rows(first, second, MAX_LEN, end - start, tl.arange(0, BLOCK_D), token_stride, D, BLOCK_D,
                   BLOCK, TWO)


@triton.jit
def _zero_uncovered(first_ptr, second_ptr, offsets_ptr, batch, segment, head, chunk, fill_chunk,
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
    base_first = _rows(first_ptr, segment, head, 0, num_tokens, token_stride, head_stride)
    base_second = _rows(second_ptr, segment, head, 0, num_tokens, token_stride, head_stride)
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
                start, length = _bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
                attended = attended | ((tokens >= start) & (tokens < start + length))
            _store_zeros(base_first, base_second, tokens, (tokens < last) & ~attended, cols, token_stride,
                         D, BLOCK_D, BLOCK, TWO)
