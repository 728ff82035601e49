"""Triton kernels of multi-head jagged flash attention: forward, backward preprocess, dk/dv and dq.

Pure Triton, no JAX: the same functions are compiled for the GPU (launch/gpu.py) and run by Triton's
interpreter on the CPU (launch/interpret.py). Parameter order is what jax-triton 0.3.1 passes: array
inputs, runtime scalars, outputs, then compile-time constants.

Layout: q, k, v, o and their gradients are [H, T, D] (HEAD_MAJOR) or [T, H, D], contiguous; the
log-sum-exp and delta are float32 [H, T]. A token row of head h is `row * D` elements from the base,
with row = h * T + t (head-major) or t * H + h (token-major), so both layouts share one code path.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _sequence(offsets_ptr, batch, num_tokens, MAX_SEQ_LEN: tl.constexpr):
    """First token and attended length of sequence `batch`.

    Offsets are clamped into [0, num_tokens] and made non-decreasing, so that no content of `offsets`
    (negative, decreasing, past T) can address memory outside the arrays.
    """
    seq_start = tl.load(offsets_ptr + batch).to(tl.int64)
    seq_end = tl.load(offsets_ptr + batch + 1).to(tl.int64)
    seq_start = tl.minimum(tl.maximum(seq_start, 0), num_tokens)
    seq_end = tl.minimum(tl.maximum(seq_end, seq_start), num_tokens)
    seq_len = tl.minimum(seq_end - seq_start, MAX_SEQ_LEN).to(tl.int32)
    return seq_start, seq_len


@triton.jit
def _first_row(head, seq_start, num_tokens, NUM_HEADS: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """Row index (in units of D elements) of the sequence's first token for `head`, as int64."""
    if HEAD_MAJOR:
        return head.to(tl.int64) * num_tokens + seq_start
    else:
        return seq_start * NUM_HEADS + head


@triton.jit
def _tile_ptrs(base_ptr, rows, cols, TOKEN_STRIDE: tl.constexpr):
    return base_ptr + rows[:, None] * TOKEN_STRIDE + cols[None, :]


@triton.jit
def _tile_mask(rows, cols, seq_len, D: tl.constexpr, BLOCK_D: tl.constexpr):
    mask = rows[:, None] < seq_len
    if BLOCK_D != D:
        mask = mask & (cols[None, :] < D)
    return mask


@triton.jit
def _load_tile(base_ptr, rows, cols, seq_len, TOKEN_STRIDE: tl.constexpr, D: tl.constexpr,
               BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows `rows` of one sequence and head, [len(rows), BLOCK_D]; masked lanes read 0."""
    ptrs = _tile_ptrs(base_ptr, rows, cols, TOKEN_STRIDE)
    if MASK_ROWS:
        return tl.load(ptrs, mask=_tile_mask(rows, cols, seq_len, D, BLOCK_D), other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(base_ptr, rows, cols, seq_len, value, TOKEN_STRIDE: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr):
    ptrs = _tile_ptrs(base_ptr, rows, cols, TOKEN_STRIDE)
    tl.store(ptrs, value.to(base_ptr.dtype.element_ty), mask=_tile_mask(rows, cols, seq_len, D, BLOCK_D))


@triton.jit
def _program_ids(NUM_HEADS: tl.constexpr):
    """(batch, head, block) of this program. Axis 1 enumerates blocks in reverse, so that the programs
    of the last blocks, which only long sequences have and which cost the most, start first."""
    pid_bh = tl.program_id(0)
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    return pid_bh // NUM_HEADS, pid_bh % NUM_HEADS, block


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_block(acc, row_sum, row_max, q, k_base, v_base, key_start, cols, seq_len,
                   TOKEN_STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASK_KEYS: tl.constexpr):
    """One step of the online softmax over keys [key_start, key_start + BLOCK_N), in base 2."""
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k = _load_tile(k_base, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_KEYS)
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * LOG2E
    if MASK_KEYS:
        # Padded keys must not take part in the row max: a real score far below 0 would underflow.
        scores = tl.where(key_rows[None, :] < seq_len, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    p = tl.math.exp2(scores - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    v = _load_tile(v_base, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_KEYS)
    acc = acc * correction[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def jagged_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, offsets_ptr,
    num_tokens,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, MAX_SEQ_LEN: tl.constexpr, D: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """o = softmax(q k^T) v / MAX_SEQ_LEN for one block of BLOCK_M queries; also lse = log-sum-exp."""
    batch, head, block = _program_ids(NUM_HEADS)
    seq_start, seq_len = _sequence(offsets_ptr, batch, num_tokens, MAX_SEQ_LEN)
    query_start = block * BLOCK_M
    if query_start >= seq_len:
        return
    TOKEN_STRIDE: tl.constexpr = D if HEAD_MAJOR else NUM_HEADS * D
    first_row = _first_row(head, seq_start, num_tokens, NUM_HEADS, HEAD_MAJOR)
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)

    q = _load_tile(q_ptr + first_row * D, query_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    k_base = k_ptr + first_row * D
    v_base = v_ptr + first_row * D
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    full_keys = seq_len - seq_len % BLOCK_N
    for key_start in range(0, full_keys, BLOCK_N):
        acc, row_sum, row_max = _fwd_key_block(
            acc, row_sum, row_max, q, k_base, v_base, key_start, cols, seq_len,
            TOKEN_STRIDE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, False)
    if full_keys < seq_len:
        acc, row_sum, row_max = _fwd_key_block(
            acc, row_sum, row_max, q, k_base, v_base, full_keys, cols, seq_len,
            TOKEN_STRIDE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, True)

    # Every query row saw at least one real key (seq_len >= 1), so row_sum > 0 and row_max is finite.
    acc = acc / (row_sum * MAX_SEQ_LEN)[:, None]
    _store_tile(o_ptr + first_row * D, query_rows, cols, seq_len, acc, TOKEN_STRIDE, D, BLOCK_D)
    lse = (row_max + tl.math.log2(row_sum)) * LN2
    lse_ptrs = lse_ptr + head.to(tl.int64) * num_tokens + seq_start + query_rows
    tl.store(lse_ptrs, lse, mask=query_rows < seq_len)


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def jagged_attention_bwd_preprocess_kernel(
    o_ptr, do_ptr, offsets_ptr,
    num_tokens,
    delta_ptr,
    NUM_HEADS: tl.constexpr, MAX_SEQ_LEN: tl.constexpr, D: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta = rowsum(o * do), in float32, for one block of BLOCK_M tokens."""
    batch, head, block = _program_ids(NUM_HEADS)
    seq_start, seq_len = _sequence(offsets_ptr, batch, num_tokens, MAX_SEQ_LEN)
    row_start = block * BLOCK_M
    if row_start >= seq_len:
        return
    TOKEN_STRIDE: tl.constexpr = D if HEAD_MAJOR else NUM_HEADS * D
    first_row = _first_row(head, seq_start, num_tokens, NUM_HEADS, HEAD_MAJOR)
    cols = tl.arange(0, BLOCK_D)
    rows = row_start + tl.arange(0, BLOCK_M)
    o = _load_tile(o_ptr + first_row * D, rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    do = _load_tile(do_ptr + first_row * D, rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + head.to(tl.int64) * num_tokens + seq_start + rows, delta, mask=rows < seq_len)


@triton.jit
def _dkdv_query_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, query_start, key_rows, cols,
                      seq_len, MAX_SEQ_LEN: tl.constexpr, TOKEN_STRIDE: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      MASK_QUERIES: tl.constexpr):
    """Accumulate into dk, dv (unscaled by 1/MAX_SEQ_LEN) the queries [query_start, +BLOCK_M).

    Works on transposed scores [keys, queries], so that no operand of dk and dv needs a transpose.
    """
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = _load_tile(q_base, query_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_QUERIES)
    do = _load_tile(do_base, query_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_QUERIES)
    if MASK_QUERIES:
        query_mask = query_rows < seq_len
        lse = tl.load(lse_base + query_rows, mask=query_mask, other=0.0)
        delta = tl.load(delta_base + query_rows, mask=query_mask, other=0.0)
    else:
        lse = tl.load(lse_base + query_rows)
        delta = tl.load(delta_base + query_rows)
    # Scaled once per block of queries, so that the [BLOCK_N, BLOCK_M] tiles below take one FMA each.
    lse_log2 = lse * LOG2E
    delta_scaled = delta * MAX_SEQ_LEN
    scores_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    p_t = tl.math.exp2(scores_t * LOG2E - lse_log2[None, :])
    if MASK_QUERIES:
        p_t = tl.where(query_mask[None, :], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    # d(scores) = P * (dO V^T / L - delta) = P * (dO V^T - L * delta) / L; the 1/L is applied at the end.
    ds_t = p_t * (dp_t - delta_scaled[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, head, seq_start,
                  seq_len, first_row, num_tokens, key_start, MAX_SEQ_LEN: tl.constexpr,
                  TOKEN_STRIDE: tl.constexpr, D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dk and dv of the keys [key_start, key_start + BLOCK_N), walking every query block."""
    cols = tl.arange(0, BLOCK_D)
    key_rows = key_start + tl.arange(0, BLOCK_N)
    # Keys past the sequence load as 0; their dk, dv rows are computed but never stored.
    k = _load_tile(k_ptr + first_row * D, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    v = _load_tile(v_ptr + first_row * D, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    q_base = q_ptr + first_row * D
    do_base = do_ptr + first_row * D
    lse_base = lse_ptr + head.to(tl.int64) * num_tokens + seq_start
    delta_base = delta_ptr + head.to(tl.int64) * num_tokens + seq_start
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    full_queries = seq_len - seq_len % BLOCK_M
    for query_start in range(0, full_queries, BLOCK_M):
        dk, dv = _dkdv_query_block(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, query_start, key_rows, cols, seq_len,
            MAX_SEQ_LEN, TOKEN_STRIDE, D, BLOCK_M, BLOCK_D, INPUT_PRECISION, False)
    if full_queries < seq_len:
        dk, dv = _dkdv_query_block(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, full_queries, key_rows, cols, seq_len,
            MAX_SEQ_LEN, TOKEN_STRIDE, D, BLOCK_M, BLOCK_D, INPUT_PRECISION, True)

    _store_tile(dk_ptr + first_row * D, key_rows, cols, seq_len, dk * (1.0 / MAX_SEQ_LEN),
                TOKEN_STRIDE, D, BLOCK_D)
    _store_tile(dv_ptr + first_row * D, key_rows, cols, seq_len, dv * (1.0 / MAX_SEQ_LEN),
                TOKEN_STRIDE, D, BLOCK_D)


@triton.jit
def _dq_key_block(dq, q, do, lse_log2, delta_scaled, k_base, v_base, key_start, cols, seq_len,
                  TOKEN_STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASK_KEYS: tl.constexpr):
    """Accumulate into dq (unscaled by 1/MAX_SEQ_LEN) the keys [key_start, key_start + BLOCK_N)."""
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k = _load_tile(k_base, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_KEYS)
    v = _load_tile(v_base, key_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, MASK_KEYS)
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    p = tl.math.exp2(scores * LOG2E - lse_log2[:, None])
    if MASK_KEYS:
        p = tl.where(key_rows[None, :] < seq_len, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    ds = p * (dp - delta_scaled[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)


@triton.jit
def _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, head, seq_start, seq_len,
                first_row, num_tokens, query_start, MAX_SEQ_LEN: tl.constexpr,
                TOKEN_STRIDE: tl.constexpr, D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq of the queries [query_start, query_start + BLOCK_M), walking every key block."""
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)
    query_mask = query_rows < seq_len
    q = _load_tile(q_ptr + first_row * D, query_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    do = _load_tile(do_ptr + first_row * D, query_rows, cols, seq_len, TOKEN_STRIDE, D, BLOCK_D, True)
    stats_offset = head.to(tl.int64) * num_tokens + seq_start + query_rows
    lse_log2 = tl.load(lse_ptr + stats_offset, mask=query_mask, other=0.0) * LOG2E
    delta_scaled = tl.load(delta_ptr + stats_offset, mask=query_mask, other=0.0) * MAX_SEQ_LEN
    k_base = k_ptr + first_row * D
    v_base = v_ptr + first_row * D
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_keys = seq_len - seq_len % BLOCK_N
    for key_start in range(0, full_keys, BLOCK_N):
        dq = _dq_key_block(dq, q, do, lse_log2, delta_scaled, k_base, v_base, key_start, cols, seq_len,
                           TOKEN_STRIDE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, False)
    if full_keys < seq_len:
        dq = _dq_key_block(dq, q, do, lse_log2, delta_scaled, k_base, v_base, full_keys, cols, seq_len,
                           TOKEN_STRIDE, D, BLOCK_N, BLOCK_D, INPUT_PRECISION, True)

    _store_tile(dq_ptr + first_row * D, query_rows, cols, seq_len, dq * (1.0 / MAX_SEQ_LEN),
                TOKEN_STRIDE, D, BLOCK_D)


@triton.jit
def jagged_attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, offsets_ptr,
    num_tokens,
    dq_ptr, dk_ptr, dv_ptr,
    NUM_HEADS: tl.constexpr, MAX_SEQ_LEN: tl.constexpr, D: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dq, dk and dv in one launch: even blocks are dk/dv programs (one block of DKDV_BLOCK_N keys),
    odd blocks dq programs (one block of DQ_BLOCK_M queries).

    The two kinds are independent (each output element has one writer, no atomics, deterministic);
    sharing a launch lets them fill the GPU together and saves a launch on small batches. dq has its
    own tiles, so nothing assumes DQ_BLOCK_M == DKDV_BLOCK_N (the seed did).
    """
    batch, head, block = _program_ids(NUM_HEADS)
    seq_start, seq_len = _sequence(offsets_ptr, batch, num_tokens, MAX_SEQ_LEN)
    TOKEN_STRIDE: tl.constexpr = D if HEAD_MAJOR else NUM_HEADS * D
    first_row = _first_row(head, seq_start, num_tokens, NUM_HEADS, HEAD_MAJOR)
    if block % 2 == 0:
        key_start = (block // 2) * DKDV_BLOCK_N
        if key_start < seq_len:
            _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, head,
                          seq_start, seq_len, first_row, num_tokens, key_start, MAX_SEQ_LEN,
                          TOKEN_STRIDE, D, INPUT_PRECISION, DKDV_BLOCK_M, DKDV_BLOCK_N, BLOCK_D)
    else:
        query_start = (block // 2) * DQ_BLOCK_M
        if query_start < seq_len:
            _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, head, seq_start,
                        seq_len, first_row, num_tokens, query_start, MAX_SEQ_LEN, TOKEN_STRIDE, D,
                        INPUT_PRECISION, DQ_BLOCK_M, DQ_BLOCK_N, BLOCK_D)
