"""Triton kernels of jagged flash attention: the forward, the backward preprocess and the backward.

Pure Triton, no JAX: the same functions are compiled for the GPU (launch/gpu.py) and run by Triton's
interpreter on the CPU (launch/interpret.py). Parameters come in the order jax-triton passes them:
input arrays (the last an int32 array of runtime sizes, see `_params`), outputs, then compile-time
constants (always given by keyword).

Addressing. q, o, do, dq share one layout and k, v, dk, dv another; the launcher passes each family's
token and head strides (in units of STRIDE_ALIGN elements, see `_aligned`), so "THD" and "HTD" (and
anything else with unit stride along D) share one code path. The token axis may hold several
independent segments of `*_tokens` tokens, each with its own row of offsets (data-parallel shards, or
vmapped problems); offsets rows are `*_offsets_stride` apart (0 when every segment shares one row). The
float32 log-sum-exp and delta are [segments, H, q_tokens]. Every pointer is rebased once per program by
`_rows`.

Grid. (segment, sequence, head) and slot, on two axes or one (see `_program`). There is one extra
"sequence" per segment whose programs zero the tokens that no sequence covers. A sequence's slots are
its row blocks, the last ones first so that the costly blocks of long sequences start early, and last a
program that zeroes the sequence's own tokens past the maximum length. So every output element is
written by the kernels: no memset is needed. The zeroing programs return without touching the
attention code: ptxas 12.8 (Triton 3.6's) miscompiled programs that zeroed the tail and then went on
to their block, clobbering a uniform register that held the offsets pointer.

Semantics per sequence: n_q = min(len_q, Q_MAX_LEN) queries attend n_k = min(len_kv, KV_MAX_LEN) keys
(causal: key j <= query i + n_k - n_q), o = OUT_SCALE * softmax(scale * q k^T) v. The float32
log-sum-exp is kept in units of the unscaled scores (base 2 after scaling), and both passes subtract
before they scale: at large logits the top score of a row gets probability exactly 1 in both. Rows with
no key get o = 0 and log-sum-exp +inf.
"""

import triton
import triton.language as tl

INF: tl.constexpr = tl.constexpr(float("inf"))


# ---------------------------------------------------------------------------------------------------
# Addressing, shared by every kernel
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
    """The runtime sizes of a launch, read from the int32 array the launcher passes (not as scalar
    arguments, whose values jax-triton specializes): batch, q and kv tokens per segment, q token and
    head strides, kv token and head strides (in units of ALIGN elements), offsets row strides."""
    batch = tl.load(params_ptr)
    q_tokens = tl.load(params_ptr + 1)
    kv_tokens = tl.load(params_ptr + 2)
    q_token_stride = _aligned(tl.load(params_ptr + 3), ALIGN)
    q_head_stride = _aligned(tl.load(params_ptr + 4), ALIGN)
    kv_token_stride = _aligned(tl.load(params_ptr + 5), ALIGN)
    kv_head_stride = _aligned(tl.load(params_ptr + 6), ALIGN)
    q_offsets_stride = tl.load(params_ptr + 7)
    kv_offsets_stride = tl.load(params_ptr + 8)
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
    """Rows `rows` of a [D, tokens] view (tokens contiguous, D rows `d_stride` apart), as [BLOCK_D,
    len(rows)]; rows outside [first_row, num_rows) and cols >= D read 0."""
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


@triton.jit
def _causal_shift(n_q, n_k, CAUSAL: tl.constexpr):
    """Query i attends key j <= i + shift (bottom-right aligned)."""
    if CAUSAL:
        return n_k - n_q
    else:
        return 0


@triton.jit
def _key_ranges(query_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """For queries [query_start, +BLOCK_M): keys [0, clean_end) need no mask, [clean_end, end) do."""
    end = n_k
    clean_end = n_k
    if CAUSAL:
        shift = n_k - n_q
        end = tl.minimum(n_k, query_start + BLOCK_M + shift)
        clean_end = tl.minimum(n_k, query_start + shift + 1)
    end = tl.maximum(end, 0)
    clean_end = tl.maximum(clean_end, 0) // BLOCK_N * BLOCK_N
    return clean_end, end


@triton.jit
def _query_ranges(key_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr):
    """For keys [key_start, +BLOCK_N): the query blocks [start, n_q) that see them, of which
    [clean_start, clean_end) need no mask. All but n_q are multiples of BLOCK_M."""
    clean_end = n_q // BLOCK_M * BLOCK_M
    if CAUSAL:
        shift = n_k - n_q
        start = tl.maximum(key_start - shift, 0) // BLOCK_M * BLOCK_M
        # The first block whose first query sees the block's last key.
        diagonal_end = (tl.maximum(key_start + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        clean_start = tl.minimum(tl.maximum(diagonal_end, start), tl.maximum(clean_end, start))
        return start, clean_start, tl.maximum(clean_start, clean_end)
    else:
        return 0, 0, clean_end


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


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def key_major_kernel(
    x_ptr, params_ptr,
    out_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    KEY_MAJOR_ALIGN: tl.constexpr,
):
    """out[h, d, t] = x[t, h, d] for BLOCK_T tokens (axis 0) of one head (axis 1), out's token axis
    padded to params[3] * KEY_MAJOR_ALIGN tokens with 0: the forward's key-major v, in one pass. Params:
    tokens, token and head strides of x (in units of STRIDE_ALIGN elements), padded tokens."""
    tokens = tl.load(params_ptr)
    token_stride = _aligned(tl.load(params_ptr + 1), STRIDE_ALIGN)
    head_stride = _aligned(tl.load(params_ptr + 2), STRIDE_ALIGN)
    padded = _aligned(tl.load(params_ptr + 3), KEY_MAJOR_ALIGN)
    head = tl.program_id(1)
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    x_base = x_ptr + first * token_stride + head.to(tl.int64) * head_stride
    x = _load(x_base, rows, cols, tokens - first, token_stride, D, BLOCK_D, True)
    out = out_ptr + head.to(tl.int64) * D * padded + first
    tl.store(out + cols[:, None].to(tl.int64) * padded + rows[None, :], tl.trans(x),
             mask=(cols[:, None] < D) & (rows[None, :] < padded - first))


@triton.jit
def _fwd_block(acc, row_sum, row_max, q, k_base, v_base, key_start, query_rows, cols, lead, n_k, shift,
               kv_token_stride, v_d_stride, QK_SCALE: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, V_KEY_MAJOR: tl.constexpr):
    """One step of the online softmax over keys [key_start, key_start + BLOCK_N), in base 2. row_max is
    the running maximum of the unscaled scores. Keys are counted from the start of the key window:
    the first `lead` ones (before the sequence, V_KEY_MAJOR only) and those from n_k on are masked."""
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k = _load(k_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, MASKED)
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if MASKED:
        # Masked keys must not take part in the row max: a real score far below 0 would underflow.
        keep = key_rows[None, :] < n_k
        if V_KEY_MAJOR:
            keep = keep & (key_rows[None, :] >= lead)
        if CAUSAL:
            keep = keep & (key_rows[None, :] <= query_rows[:, None] + shift)
        scores = tl.where(keep, scores, -INF)
    # The max is subtracted before the scale (QK_SCALE > 0, so they commute): the top score gets
    # exactly 2**0, which no rounding of a scaled max could guarantee once |scores| pass 2**24.
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if MASKED and CAUSAL:
        # A row whose keys are all masked so far keeps max -inf; subtract 0 there, not -inf.
        new_max_safe = tl.where(new_max == -INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    p = tl.math.exp2((scores - new_max_safe[:, None]) * QK_SCALE)
    correction = tl.math.exp2((row_max - new_max_safe) * QK_SCALE)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    if V_KEY_MAJOR:
        v = tl.trans(_load_key_major(v_base, key_rows, cols, lead, n_k, v_d_stride, D, BLOCK_D, MASKED))
    else:
        v = _load(v_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, MASKED)
    acc = acc * correction[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, q_offsets_ptr, kv_offsets_ptr, params_ptr,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr, KEY_MAJOR_ALIGN: tl.constexpr,
):
    """o and the base-2 log-sum-exp for one block of BLOCK_M queries, or the zero fill of o.

    With V_KEY_MAJOR, v comes as [H_kv, D, tokens] (tokens contiguous, D rows params[11] *
    KEY_MAJOR_ALIGN apart), so that the B operand of p @ v is K-major: TF32 matrix products need that
    of both operands, and Triton otherwise copies v into shared memory one element at a time. The key
    window then starts at the KEY_MAJOR_ALIGN-aligned token at or before the sequence's first, so that
    its rows load in 16-byte pieces; its first `lead` keys are masked.
    """
    (batch, q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
     q_offsets_stride, kv_offsets_stride) = _params(params_ptr, STRIDE_ALIGN)
    fill_chunk = tl.load(params_ptr + 9)
    segment, sequence, head, slot = _program(batch, tl.load(params_ptr + 10), NUM_HEADS)
    q_offsets_ptr += segment * q_offsets_stride
    kv_offsets_ptr += segment * kv_offsets_stride
    if sequence == batch:
        _zero_uncovered(o_ptr, o_ptr, q_offsets_ptr, batch, segment, head, slot, fill_chunk, q_tokens,
                        q_token_stride, q_head_stride, Q_MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=False)
        return
    if slot == 0:
        _zero_tail(o_ptr, o_ptr, q_offsets_ptr, sequence, segment, head, q_tokens, q_token_stride,
                   q_head_stride, Q_MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=False)
        return
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    query_start = (slot - 1) * BLOCK_M
    if query_start >= n_q:
        return
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    kv_head = head // KV_GROUP
    if V_KEY_MAJOR:
        v_d_stride = _aligned(tl.load(params_ptr + 11), KEY_MAJOR_ALIGN)
        first = segment.to(tl.int64) * kv_tokens + kv_start
        window = first // KEY_MAJOR_ALIGN * KEY_MAJOR_ALIGN
        # No window for no keys: a block of only masked keys would give non-causal rows a max of -inf.
        lead = tl.where(n_k > 0, first - window, 0).to(tl.int32)
        v_base = v_ptr + kv_head.to(tl.int64) * D * v_d_stride + window
    else:
        v_d_stride = 0
        lead = 0
        v_base = _rows(v_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    n_window = n_k + lead
    q_base = _rows(q_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride)
    k_base = _rows(k_ptr, segment, kv_head, kv_start - lead, kv_tokens, kv_token_stride, kv_head_stride)
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)

    q = _load(q_base, query_rows, cols, n_q, q_token_stride, D, BLOCK_D, True)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -INF, dtype=tl.float32)
    shift = _causal_shift(n_q, n_window, CAUSAL)
    clean_end, end = _key_ranges(query_start, n_q, n_window, BLOCK_M, BLOCK_N, CAUSAL)
    clean_start = 0
    tail_start = clean_end
    if V_KEY_MAJOR:  # a first block with keys before the sequence is masked
        clean_start = (lead > 0).to(tl.int32) * BLOCK_N
        tail_start = tl.maximum(clean_end, clean_start)
        for key_start in range(0, tl.minimum(clean_start, end), BLOCK_N):
            acc, row_sum, row_max = _fwd_block(
                acc, row_sum, row_max, q, k_base, v_base, key_start, query_rows, cols, lead, n_window,
                shift, kv_token_stride, v_d_stride, QK_SCALE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION,
                MASKED=True, CAUSAL=CAUSAL, V_KEY_MAJOR=V_KEY_MAJOR)
    for key_start in range(clean_start, clean_end, BLOCK_N):
        acc, row_sum, row_max = _fwd_block(
            acc, row_sum, row_max, q, k_base, v_base, key_start, query_rows, cols, lead, n_window, shift,
            kv_token_stride, v_d_stride, QK_SCALE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, MASKED=False,
            CAUSAL=CAUSAL, V_KEY_MAJOR=V_KEY_MAJOR)
    for key_start in range(tail_start, end, BLOCK_N):
        acc, row_sum, row_max = _fwd_block(
            acc, row_sum, row_max, q, k_base, v_base, key_start, query_rows, cols, lead, n_window, shift,
            kv_token_stride, v_d_stride, QK_SCALE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, MASKED=True,
            CAUSAL=CAUSAL, V_KEY_MAJOR=V_KEY_MAJOR)

    attended = row_sum > 0  # false only for queries with no key (empty key sequence, or causal)
    acc = acc * (OUT_SCALE / tl.where(attended, row_sum, 1.0))[:, None]
    o_base = _rows(o_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride)
    _store(o_base, query_rows, cols, n_q, acc, q_token_stride, D, BLOCK_D)
    # In units of the unscaled scores: sum_j exp2((s_j - lse) * QK_SCALE) = 1.
    lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), INF)
    lse_base = _stats(lse_ptr, segment, head, q_start, q_tokens, NUM_HEADS)
    tl.store(lse_base + query_rows, lse, mask=query_rows < n_q)


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def attention_bwd_preprocess_kernel(
    o_ptr, do_ptr, params_ptr,
    delta_ptr,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, OUT_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
):
    """delta = rowsum(o * do) / OUT_SCALE in float32 for BLOCK_M tokens (axis 0) of one segment and head
    (axis 1). Every token: unattended ones have o = 0, hence delta = 0."""
    segment = tl.program_id(1) // NUM_HEADS
    head = tl.program_id(1) % NUM_HEADS
    tokens = tl.load(params_ptr)
    token_stride = _aligned(tl.load(params_ptr + 1), STRIDE_ALIGN)
    head_stride = _aligned(tl.load(params_ptr + 2), STRIDE_ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = _load(_rows(o_ptr, segment, head, 0, tokens, token_stride, head_stride), rows, cols, tokens,
              token_stride, D, BLOCK_D, True)
    do = _load(_rows(do_ptr, segment, head, 0, tokens, token_stride, head_stride), rows, cols, tokens,
               token_stride, D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1) * (1.0 / OUT_SCALE)
    tl.store(_stats(delta_ptr, segment, head, 0, tokens, NUM_HEADS) + rows, delta, mask=rows < tokens)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, q_km_base, do_km_base, lse_base, delta_base, query_start,
                key_rows, cols, lead, n_q, shift, q_token_stride, km_d_stride, QK_SCALE: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                QDO_KEY_MAJOR: tl.constexpr):
    """Accumulate into dk, dv (unscaled) the queries [query_start, +BLOCK_M) of one query head.

    Works on transposed scores [keys, queries], so that no operand of dk and dv needs a transpose.
    Queries are counted from the start of the query window: the first `lead` ones (before the sequence,
    QDO_KEY_MAJOR only) and those from n_q on are masked; past n_q they read a log-sum-exp of +inf,
    hence probability 0. With QDO_KEY_MAJOR the B operands of dv and dk (do and q, read along the
    queries) come from the key-major copies, so that both operands of those TF32 products are K-major.
    """
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = _load(q_base, query_rows, cols, n_q, q_token_stride, D, BLOCK_D, MASKED)
    do = _load(do_base, query_rows, cols, n_q, q_token_stride, D, BLOCK_D, MASKED)
    if MASKED:
        valid = (query_rows >= lead) & (query_rows < n_q)
        lse = tl.load(lse_base + query_rows, mask=valid, other=INF)
        delta = tl.load(delta_base + query_rows, mask=valid, other=0.0)
    else:
        lse = tl.load(lse_base + query_rows)
        delta = tl.load(delta_base + query_rows)
    if QDO_KEY_MAJOR:
        q_b = tl.trans(_load_key_major(q_km_base, query_rows, cols, lead, n_q, km_d_stride, D, BLOCK_D,
                                       MASKED))
        do_b = tl.trans(_load_key_major(do_km_base, query_rows, cols, lead, n_q, km_d_stride, D, BLOCK_D,
                                        MASKED))
    else:
        q_b = q
        do_b = do
    scores_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    p_t = tl.math.exp2((scores_t - lse[None, :]) * QK_SCALE)
    if MASKED and (CAUSAL or QDO_KEY_MAJOR):
        # The tokens before the sequence (QDO_KEY_MAJOR) may hold anything, inf and nan included.
        if CAUSAL and QDO_KEY_MAJOR:
            keep = (key_rows[:, None] <= query_rows[None, :] + shift) & (query_rows[None, :] >= lead)
        elif CAUSAL:
            keep = key_rows[:, None] <= query_rows[None, :] + shift
        else:
            keep = query_rows[None, :] >= lead
        p_t = tl.where(keep, p_t, 0.0)
    dv = tl.dot(p_t.to(do_b.dtype), do_b, dv, input_precision=INPUT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if MASKED and QDO_KEY_MAJOR:
        ds_t = tl.where(keep, ds_t, 0.0)
    dk = tl.dot(ds_t.to(q_b.dtype), q_b, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_km_ptr, do_km_ptr, dk_ptr, dv_ptr,
                  q_offsets_ptr, kv_offsets_ptr, segment, sequence, kv_head, key_start, q_tokens,
                  kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride, km_d_stride,
                  NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr,
                  CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr, DS_SCALE: tl.constexpr,
                  OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, QDO_KEY_MAJOR: tl.constexpr, KEY_MAJOR_ALIGN: tl.constexpr):
    """dk and dv of keys [key_start, +BLOCK_N) of one kv head: every query block of every query head
    of its group, in order (deterministic). With QDO_KEY_MAJOR the query window starts at the
    KEY_MAJOR_ALIGN-aligned token at or before the sequence's first (as the forward's key window)."""
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    if key_start >= n_k:
        return
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    if QDO_KEY_MAJOR:
        first = segment.to(tl.int64) * q_tokens + q_start
        window = first // KEY_MAJOR_ALIGN * KEY_MAJOR_ALIGN
        lead = tl.where(n_q > 0, first - window, 0).to(tl.int32)
    else:
        window = 0
        lead = 0
    n_window = n_q + lead
    cols = tl.arange(0, BLOCK_D)
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k_base = _rows(k_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    v_base = _rows(v_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    # Keys past n_k load as 0; their rows of dk, dv are computed but never stored.
    k = _load(k_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, True)
    v = _load(v_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    shift = _causal_shift(n_window, n_k, CAUSAL)
    start, clean_start, clean_end = _query_ranges(key_start, n_window, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    if QDO_KEY_MAJOR:
        # A first block with queries before the sequence is masked. Every bound stays a visible
        # multiple of BLOCK_M, so that the compiler knows the key-major rows 16-byte aligned.
        clean_start = tl.maximum(clean_start, (lead > 0).to(tl.int32) * BLOCK_M) // BLOCK_M * BLOCK_M
        clean_end = tl.maximum(clean_end, clean_start) // BLOCK_M * BLOCK_M
    for member in range(0, KV_GROUP):
        head = kv_head * KV_GROUP + member
        q_base = _rows(q_ptr, segment, head, q_start - lead, q_tokens, q_token_stride, q_head_stride)
        do_base = _rows(do_ptr, segment, head, q_start - lead, q_tokens, q_token_stride, q_head_stride)
        lse_base = _stats(lse_ptr, segment, head, q_start - lead, q_tokens, NUM_HEADS)
        delta_base = _stats(delta_ptr, segment, head, q_start - lead, q_tokens, NUM_HEADS)
        q_km_base = q_km_ptr + head.to(tl.int64) * D * km_d_stride + window
        do_km_base = do_km_ptr + head.to(tl.int64) * D * km_d_stride + window
        for query_start in range(start, clean_start, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_km_base, do_km_base, lse_base,
                                 delta_base, query_start, key_rows, cols, lead, n_window, shift,
                                 q_token_stride, km_d_stride, QK_SCALE, D, BLOCK_M, BLOCK_D,
                                 INPUT_PRECISION, MASKED=True, CAUSAL=CAUSAL, QDO_KEY_MAJOR=QDO_KEY_MAJOR)
        for query_start in range(clean_start, clean_end, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_km_base, do_km_base, lse_base,
                                 delta_base, query_start, key_rows, cols, lead, n_window, shift,
                                 q_token_stride, km_d_stride, QK_SCALE, D, BLOCK_M, BLOCK_D,
                                 INPUT_PRECISION, MASKED=False, CAUSAL=CAUSAL, QDO_KEY_MAJOR=QDO_KEY_MAJOR)
        for query_start in range(clean_end, n_window, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, q_km_base, do_km_base, lse_base,
                                 delta_base, query_start, key_rows, cols, lead, n_window, shift,
                                 q_token_stride, km_d_stride, QK_SCALE, D, BLOCK_M, BLOCK_D,
                                 INPUT_PRECISION, MASKED=True, CAUSAL=CAUSAL, QDO_KEY_MAJOR=QDO_KEY_MAJOR)
    dk_base = _rows(dk_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    dv_base = _rows(dv_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    _store(dk_base, key_rows, cols, n_k, dk * DS_SCALE, kv_token_stride, D, BLOCK_D)
    _store(dv_base, key_rows, cols, n_k, dv * OUT_SCALE, kv_token_stride, D, BLOCK_D)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_base, v_base, key_start, query_rows, cols, n_k, shift,
              kv_token_stride, QK_SCALE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr):
    """Accumulate into dq (unscaled) the keys [key_start, key_start + BLOCK_N)."""
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k = _load(k_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, MASKED)
    v = _load(v_base, key_rows, cols, n_k, kv_token_stride, D, BLOCK_D, MASKED)
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    p = tl.math.exp2((scores - lse[:, None]) * QK_SCALE)
    if MASKED:
        keep = key_rows[None, :] < n_k
        if CAUSAL:
            keep = keep & (key_rows[None, :] <= query_rows[:, None] + shift)
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)


@triton.jit
def _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr,
                kv_offsets_ptr, segment, sequence, head, query_start, q_tokens, kv_tokens,
                q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
                NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr,
                CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr, DS_SCALE: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of the queries [query_start, query_start + BLOCK_M), walking their key blocks."""
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    if query_start >= n_q:
        return
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    kv_head = head // KV_GROUP
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q_base = _rows(q_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride)
    do_base = _rows(do_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride)
    q = _load(q_base, query_rows, cols, n_q, q_token_stride, D, BLOCK_D, True)
    do = _load(do_base, query_rows, cols, n_q, q_token_stride, D, BLOCK_D, True)
    query_valid = query_rows < n_q
    lse = tl.load(_stats(lse_ptr, segment, head, q_start, q_tokens, NUM_HEADS) + query_rows,
                  mask=query_valid, other=INF)
    delta = tl.load(_stats(delta_ptr, segment, head, q_start, q_tokens, NUM_HEADS) + query_rows,
                    mask=query_valid, other=0.0)
    k_base = _rows(k_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    v_base = _rows(v_ptr, segment, kv_head, kv_start, kv_tokens, kv_token_stride, kv_head_stride)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift = _causal_shift(n_q, n_k, CAUSAL)
    clean_end, end = _key_ranges(query_start, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    for key_start in range(0, clean_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, key_start, query_rows, cols, n_k, shift,
                       kv_token_stride, QK_SCALE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, MASKED=False,
                       CAUSAL=CAUSAL)
    for key_start in range(clean_end, end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_base, v_base, key_start, query_rows, cols, n_k, shift,
                       kv_token_stride, QK_SCALE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, MASKED=True,
                       CAUSAL=CAUSAL)
    dq_base = _rows(dq_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride)
    _store(dq_base, query_rows, cols, n_q, dq * DS_SCALE, q_token_stride, D, BLOCK_D)


@triton.jit
def attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, q_km_ptr, do_km_ptr,
    params_ptr, dq_ptr, dk_ptr, dv_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr,
    DS_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr,
    DQ_BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
    QDO_KEY_MAJOR: tl.constexpr, KEY_MAJOR_ALIGN: tl.constexpr, DQ_PROGRAMS: tl.constexpr,
    DKDV_PROGRAMS: tl.constexpr,
):
    """One program of a backward launch of dq programs, dk/dv programs or both (then even slots are dq
    programs and odd slots dk/dv ones): both kinds share a launch when they share warps and stages. A
    dq program takes DQ_BLOCK_M queries of one head, a dk/dv program DKDV_BLOCK_N keys of one kv head
    (only the first head of each group runs one). The zero-fill programs and each sequence's last slot
    (of each kind) clear dq, and dk and dv, where no sequence attends. A launch of one kind never
    touches the other kind's outputs (one-element placeholders).

    With QDO_KEY_MAJOR, q_km and do_km are q and do as [H, D, tokens] (see key_major_kernel; D rows
    params[12] * KEY_MAJOR_ALIGN apart), for the dk/dv programs (see `_dkdv_block`); otherwise they are
    q and do again, unused.

    Every output element has one writer and there are no atomics: the result is deterministic.
    """
    (batch, q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
     q_offsets_stride, kv_offsets_stride) = _params(params_ptr, STRIDE_ALIGN)
    q_fill_chunk = tl.load(params_ptr + 9)
    kv_fill_chunk = tl.load(params_ptr + 10)
    segment, sequence, head, slot = _program(batch, tl.load(params_ptr + 11), NUM_HEADS)
    q_offsets_ptr += segment * q_offsets_stride
    kv_offsets_ptr += segment * kv_offsets_stride
    if DQ_PROGRAMS and DKDV_PROGRAMS:
        is_dq = slot % 2 == 0
        block = slot // 2
    else:
        is_dq = DQ_PROGRAMS
        block = slot
    if sequence == batch:
        if is_dq:
            _zero_uncovered(dq_ptr, dq_ptr, q_offsets_ptr, batch, segment, head, block, q_fill_chunk,
                            q_tokens, q_token_stride, q_head_stride, Q_MAX_LEN, D, BLOCK_D, FILL_BLOCK,
                            TWO=False)
        elif head % KV_GROUP == 0:
            _zero_uncovered(dk_ptr, dv_ptr, kv_offsets_ptr, batch, segment, head // KV_GROUP, block,
                            kv_fill_chunk, kv_tokens, kv_token_stride, kv_head_stride, KV_MAX_LEN, D,
                            BLOCK_D, FILL_BLOCK, TWO=True)
        return
    if block == 0:
        if is_dq:
            _zero_tail(dq_ptr, dq_ptr, q_offsets_ptr, sequence, segment, head, q_tokens, q_token_stride,
                       q_head_stride, Q_MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=False)
        elif head % KV_GROUP == 0:
            _zero_tail(dk_ptr, dv_ptr, kv_offsets_ptr, sequence, segment, head // KV_GROUP, kv_tokens,
                       kv_token_stride, kv_head_stride, KV_MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=True)
        return
    block -= 1
    if is_dq:
        _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr,
                    kv_offsets_ptr, segment, sequence, head, block * DQ_BLOCK_M, q_tokens,
                    kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
                    NUM_HEADS, KV_GROUP, D, BLOCK_D, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, QK_SCALE,
                    DS_SCALE, INPUT_PRECISION, DQ_BLOCK_M, DQ_BLOCK_N)
    elif head % KV_GROUP == 0:
        if QDO_KEY_MAJOR:
            km_d_stride = _aligned(tl.load(params_ptr + 12), KEY_MAJOR_ALIGN)
        else:
            km_d_stride = 0
        _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_km_ptr, do_km_ptr, dk_ptr, dv_ptr,
                      q_offsets_ptr, kv_offsets_ptr, segment, sequence, head // KV_GROUP,
                      block * DKDV_BLOCK_N, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                      kv_token_stride, kv_head_stride, km_d_stride, NUM_HEADS, KV_GROUP, D, BLOCK_D,
                      Q_MAX_LEN, KV_MAX_LEN, CAUSAL, QK_SCALE, DS_SCALE, OUT_SCALE, INPUT_PRECISION,
                      DKDV_BLOCK_M, DKDV_BLOCK_N, QDO_KEY_MAJOR, KEY_MAJOR_ALIGN)
