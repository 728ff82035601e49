"""The portable backward: delta (the preprocess), then dq programs and dk/dv programs, in one launch or two,
each kind with its share of the zero fills. Every output element has one writer and there are no atomics:
the result is deterministic.
"""

import triton
import triton.language as tl

from ..shared import INF, band, bounds, key_ranges, query_ranges, query_shift, span, transform_scores
from .fills import zero_tail, zero_uncovered
from .memory import (
    PARAM_BWD_KM_D_STRIDE,
    PARAM_BWD_KV_FILL_CHUNK,
    PARAM_BWD_Q_FILL_CHUNK,
    PARAM_BWD_SLOTS,
    aligned,
    array_layout,
    attention_params,
    key_major_window,
    load_tile,
    load_tile_key_major,
    program,
    stat_ptr,
    store_tile,
    token_ptr,
)


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
    layout = array_layout(params_ptr, STRIDE_ALIGN)
    tokens, token_stride, _ = layout
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = load_tile(token_ptr(o_ptr, segment, head, 0, layout), rows, cols, tokens, token_stride,
                  (D, BLOCK_D), True)
    do = load_tile(token_ptr(do_ptr, segment, head, 0, layout), rows, cols, tokens, token_stride,
                   (D, BLOCK_D), True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1) * (1.0 / OUT_SCALE)
    tl.store(stat_ptr(delta_ptr, segment, head, 0, tokens, NUM_HEADS) + rows, delta, mask=rows < tokens)


@triton.jit
def _dkdv_block(grads, keys, queries, query_start, cols, BAND: tl.constexpr, SCORES: tl.constexpr,
                DIMS: tl.constexpr, BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                MASKED: tl.constexpr, QDO_KEY_MAJOR: tl.constexpr):
    """grads = (dk, dv), unscaled, with the queries [query_start, +BLOCK_M) of one query head added.

    keys = (k, v, key_rows, shift, slope): the program's keys and values, their rows, the queries' key
    position shift and the head's ALiBi slope. queries = (q_base, do_base, q_km_base, do_km_base,
    lse_base, delta_base, lead, n_q, q_token_stride, km_d_stride): the head's query window, counted from
    its start; its first `lead` queries (before the sequence, QDO_KEY_MAJOR only) and those from n_q on
    are masked, and read a log-sum-exp of +inf past n_q, hence probability 0.

    Works on transposed scores [keys, queries], so that no operand of dk and dv needs a transpose. With
    QDO_KEY_MAJOR the B operands of dv and dk (do and q, read along the queries) come from the key-major
    copies, so that both operands of those TF32 products are K-major.
    """
    dk, dv = grads
    k, v, key_rows, shift, slope = keys
    q_base, do_base, q_km_base, do_km_base, lse_base, delta_base, lead, n_q, q_token_stride, km_d_stride = (
        queries)
    SOFTCAP: tl.constexpr = SCORES[0]
    QK_SCALE: tl.constexpr = SCORES[2]
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = load_tile(q_base, query_rows, cols, n_q, q_token_stride, DIMS, MASKED)
    do = load_tile(do_base, query_rows, cols, n_q, q_token_stride, DIMS, MASKED)
    if MASKED:
        valid = (query_rows >= lead) & (query_rows < n_q)
        lse = tl.load(lse_base + query_rows, mask=valid, other=INF)
        delta = tl.load(delta_base + query_rows, mask=valid, other=0.0)
    else:
        lse = tl.load(lse_base + query_rows)
        delta = tl.load(delta_base + query_rows)
    if QDO_KEY_MAJOR:
        q_b = tl.trans(load_tile_key_major(q_km_base, query_rows, cols, lead, n_q, km_d_stride, DIMS, MASKED))
        do_b = tl.trans(load_tile_key_major(do_km_base, query_rows, cols, lead, n_q, km_d_stride, DIMS,
                                            MASKED))
    else:
        q_b = q
        do_b = do
    scores_t, t_t = transform_scores(tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION),
                                     query_rows[None, :], key_rows[:, None], shift, slope, SCORES)
    p_t = tl.math.exp2((scores_t - lse[None, :]) * QK_SCALE)
    if MASKED and (BAND[0] or BAND[1] >= 0 or BAND[2] >= 0 or QDO_KEY_MAJOR):
        # The tokens before the sequence (QDO_KEY_MAJOR) may hold anything, inf and nan included.
        keep = (query_rows[None, :] >= lead) if QDO_KEY_MAJOR else True
        keep = band(keep, query_rows[None, :], key_rows[:, None], shift, BAND)
        p_t = tl.where(keep, p_t, 0.0)
    dv = tl.dot(p_t.to(do_b.dtype), do_b, dv, input_precision=INPUT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP > 0:
        ds_t = ds_t * (1.0 - t_t * t_t)
    if MASKED and QDO_KEY_MAJOR:
        ds_t = tl.where(keep, ds_t, 0.0)
    dk = tl.dot(ds_t.to(q_b.dtype), q_b, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(inputs, key_major, outputs, offsets, block, layouts, SHAPE: tl.constexpr,
                  LENGTHS: tl.constexpr, BAND: tl.constexpr, SCORES: tl.constexpr, TILE: tl.constexpr,
                  SCALES: tl.constexpr, KEY_MAJOR: tl.constexpr):
    """dk and dv of keys [key_start, +BLOCK_N) of one kv head, block = (segment, sequence, kv_head,
    key_start): every query block of every query head of its group, in order (deterministic).
    key_major = (q_km_ptr, do_km_ptr, km_d_stride), used with QDO_KEY_MAJOR (KEY_MAJOR = (QDO_KEY_MAJOR,
    KEY_MAJOR_ALIGN)): the query window then starts at the KEY_MAJOR_ALIGN-aligned token at or before
    the sequence's first (see `key_major_window`)."""
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, slopes_ptr = inputs
    q_km_ptr, do_km_ptr, km_d_stride = key_major
    dk_ptr, dv_ptr = outputs
    q_offsets_ptr, kv_offsets_ptr = offsets
    segment, sequence, kv_head, key_start = block
    q_layout, kv_layout = layouts
    q_tokens, q_token_stride, _ = q_layout
    kv_tokens, kv_token_stride, _ = kv_layout
    NUM_HEADS: tl.constexpr = SHAPE[0]
    KV_GROUP: tl.constexpr = SHAPE[1]
    D: tl.constexpr = SHAPE[2]
    DIMS: tl.constexpr = (SHAPE[2], SHAPE[3])
    BLOCK_M: tl.constexpr = TILE[0]
    BLOCK_N: tl.constexpr = TILE[1]
    ALIBI: tl.constexpr = SCORES[1]
    DS_SCALE: tl.constexpr = SCALES[0]
    OUT_SCALE: tl.constexpr = SCALES[1]
    QDO_KEY_MAJOR: tl.constexpr = KEY_MAJOR[0]
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, LENGTHS[1])
    if key_start >= n_k:
        return
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_tokens, LENGTHS[0])
    if QDO_KEY_MAJOR:
        window, lead = key_major_window(segment, q_start, n_q, q_tokens, KEY_MAJOR[1])
    else:
        window = 0
        lead = 0
    n_window = n_q + lead
    cols = tl.arange(0, SHAPE[3])
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k_base = token_ptr(k_ptr, segment, kv_head, kv_start, kv_layout)
    v_base = token_ptr(v_ptr, segment, kv_head, kv_start, kv_layout)
    # Keys past n_k load as 0; their rows of dk, dv are computed but never stored.
    k = load_tile(k_base, key_rows, cols, n_k, kv_token_stride, DIMS, True)
    v = load_tile(v_base, key_rows, cols, n_k, kv_token_stride, DIMS, True)
    dk = tl.zeros([BLOCK_N, SHAPE[3]], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, SHAPE[3]], dtype=tl.float32)
    shift = query_shift(n_window, n_k, ALIGNED=BAND[0] or BAND[1] >= 0 or BAND[2] >= 0 or ALIBI)
    start, clean_start, clean_end, end = query_ranges(key_start, n_window, n_k, BLOCK_M, BLOCK_N, BAND)
    if QDO_KEY_MAJOR:
        # A first block with queries before the sequence is masked. Every bound stays a visible
        # multiple of BLOCK_M, so that the compiler knows the key-major rows 16-byte aligned.
        clean_start = tl.maximum(clean_start, (lead > 0).to(tl.int32) * BLOCK_M) // BLOCK_M * BLOCK_M
        clean_end = tl.maximum(clean_end, clean_start) // BLOCK_M * BLOCK_M
    for member in range(0, KV_GROUP):
        head = kv_head * KV_GROUP + member
        q_base = token_ptr(q_ptr, segment, head, q_start - lead, q_layout)
        do_base = token_ptr(do_ptr, segment, head, q_start - lead, q_layout)
        lse_base = stat_ptr(lse_ptr, segment, head, q_start - lead, q_tokens, NUM_HEADS)
        delta_base = stat_ptr(delta_ptr, segment, head, q_start - lead, q_tokens, NUM_HEADS)
        q_km_base = q_km_ptr + head.to(tl.int64) * D * km_d_stride + window
        do_km_base = do_km_ptr + head.to(tl.int64) * D * km_d_stride + window
        if ALIBI:
            slope = tl.load(slopes_ptr + segment * NUM_HEADS + head)
        else:
            slope = 0.0
        # Without a window, clean_start <= end already (the first form of query_ranges).
        for SPAN in tl.static_range(3):
            lo, hi = span(SPAN, (start, clean_start, clean_end, end),
                          CLIP_FIRST=BAND[1] >= 0 or BAND[2] >= 0)
            for query_start in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_block(
                    (dk, dv), (k, v, key_rows, shift, slope),
                    (q_base, do_base, q_km_base, do_km_base, lse_base, delta_base, lead, n_window,
                     q_token_stride, km_d_stride),
                    query_start, cols, BAND, SCORES, DIMS, BLOCK_M, INPUT_PRECISION=TILE[2], MASKED=SPAN != 1,
                    QDO_KEY_MAJOR=QDO_KEY_MAJOR)
    dk_base = token_ptr(dk_ptr, segment, kv_head, kv_start, kv_layout)
    dv_base = token_ptr(dv_ptr, segment, kv_head, kv_start, kv_layout)
    store_tile(dk_base, key_rows, cols, n_k, dk * DS_SCALE, kv_token_stride, DIMS)
    store_tile(dv_base, key_rows, cols, n_k, dv * OUT_SCALE, kv_token_stride, DIMS)


@triton.jit
def _dq_block(dq, queries, keys, key_start, cols, BAND: tl.constexpr, SCORES: tl.constexpr,
              DIMS: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """dq (unscaled) with the keys [key_start, key_start + BLOCK_N) added. queries = (q, do, lse, delta,
    query_rows, shift, slope); keys = (k_base, v_base, n_k, kv_token_stride)."""
    q, do, lse, delta, query_rows, shift, slope = queries
    k_base, v_base, n_k, kv_token_stride = keys
    SOFTCAP: tl.constexpr = SCORES[0]
    QK_SCALE: tl.constexpr = SCORES[2]
    key_rows = key_start + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, key_rows, cols, n_k, kv_token_stride, DIMS, MASKED)
    v = load_tile(v_base, key_rows, cols, n_k, kv_token_stride, DIMS, MASKED)
    scores, t = transform_scores(tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION), query_rows[:, None],
                                 key_rows[None, :], shift, slope, SCORES)
    p = tl.math.exp2((scores - lse[:, None]) * QK_SCALE)
    if MASKED:
        keep = band(key_rows[None, :] < n_k, query_rows[:, None], key_rows[None, :], shift, BAND)
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0:
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)


@triton.jit
def _dq_program(inputs, dq_ptr, offsets, block, layouts, SHAPE: tl.constexpr, LENGTHS: tl.constexpr,
                BAND: tl.constexpr, SCORES: tl.constexpr, TILE: tl.constexpr, DS_SCALE: tl.constexpr):
    """dq of the queries [query_start, +BLOCK_M) of one head, block = (segment, sequence, head,
    query_start), walking their key blocks."""
    NUM_HEADS: tl.constexpr = SHAPE[0]
    DIMS: tl.constexpr = (SHAPE[2], SHAPE[3])
    BLOCK_M: tl.constexpr = TILE[0]
    BLOCK_N: tl.constexpr = TILE[1]
    ALIBI: tl.constexpr = SCORES[1]
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, slopes_ptr = inputs
    segment, sequence, head, query_start = block
    q_layout, kv_layout = layouts
    q_tokens, q_token_stride, _ = q_layout
    q_start, n_q = bounds(offsets[0], sequence, q_tokens, LENGTHS[0])
    if query_start >= n_q:
        return
    kv_tokens, kv_token_stride, _ = kv_layout
    kv_start, n_k = bounds(offsets[1], sequence, kv_tokens, LENGTHS[1])
    kv_head = head // SHAPE[1]
    cols = tl.arange(0, SHAPE[3])
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q_base = token_ptr(q_ptr, segment, head, q_start, q_layout)
    do_base = token_ptr(do_ptr, segment, head, q_start, q_layout)
    q = load_tile(q_base, query_rows, cols, n_q, q_token_stride, DIMS, True)
    do = load_tile(do_base, query_rows, cols, n_q, q_token_stride, DIMS, True)
    query_valid = query_rows < n_q
    lse = tl.load(stat_ptr(lse_ptr, segment, head, q_start, q_tokens, NUM_HEADS) + query_rows,
                  mask=query_valid, other=INF)
    delta = tl.load(stat_ptr(delta_ptr, segment, head, q_start, q_tokens, NUM_HEADS) + query_rows,
                    mask=query_valid, other=0.0)
    k_base = token_ptr(k_ptr, segment, kv_head, kv_start, kv_layout)
    v_base = token_ptr(v_ptr, segment, kv_head, kv_start, kv_layout)
    dq = tl.zeros([BLOCK_M, SHAPE[3]], dtype=tl.float32)
    shift = query_shift(n_q, n_k, ALIGNED=BAND[0] or BAND[1] >= 0 or BAND[2] >= 0 or ALIBI)
    if ALIBI:
        slope = tl.load(slopes_ptr + segment * NUM_HEADS + head)
    else:
        slope = 0.0
    start, clean_start, clean_end, end = key_ranges(query_start, n_q, n_k, BLOCK_M, BLOCK_N, BAND)
    for SPAN in tl.static_range(3):  # without a left window, no masked blocks come first
        if SPAN != 0 or BAND[1] >= 0:
            lo, hi = span(SPAN, (start, clean_start, clean_end, end), CLIP_FIRST=True)
            for key_start in range(lo, hi, BLOCK_N):
                dq = _dq_block(dq, (q, do, lse, delta, query_rows, shift, slope),
                               (k_base, v_base, n_k, kv_token_stride), key_start, cols, BAND, SCORES, DIMS,
                               BLOCK_N, INPUT_PRECISION=TILE[2], MASKED=SPAN != 1)
    dq_base = token_ptr(dq_ptr, segment, head, q_start, q_layout)
    store_tile(dq_base, query_rows, cols, n_q, dq * DS_SCALE, q_token_stride, DIMS)


@triton.jit
def attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, q_km_ptr, do_km_ptr,
    slopes_ptr, params_ptr, dq_ptr, dk_ptr, dv_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, QK_SCALE: tl.constexpr,
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

    With P = exp2((S - lse) * QK_SCALE) and dS = P (dP - delta) S' (S' the soft cap's derivative),
    dv = OUT_SCALE * P^T do, dk = DS_SCALE * dS^T q, dq = DS_SCALE * dS k. The band, the soft cap and
    ALiBi are the forward's (see attention_fwd_kernel); the slopes get no gradient. With QDO_KEY_MAJOR,
    q_km and do_km are q and do as [H, D, tokens] (see key_major_kernel; D rows PARAM_BWD_KM_D_STRIDE
    apart), for the dk/dv programs (see `_dkdv_block`); otherwise they are q and do again, unused.
    """
    batch, q_layout, kv_layout, offsets_strides = attention_params(params_ptr, STRIDE_ALIGN)
    q_fill_chunk = tl.load(params_ptr + PARAM_BWD_Q_FILL_CHUNK)
    kv_fill_chunk = tl.load(params_ptr + PARAM_BWD_KV_FILL_CHUNK)
    segment, sequence, head, slot = program(batch, tl.load(params_ptr + PARAM_BWD_SLOTS), NUM_HEADS)
    q_offsets_ptr += segment * offsets_strides[0]
    kv_offsets_ptr += segment * offsets_strides[1]
    if DQ_PROGRAMS and DKDV_PROGRAMS:
        is_dq = slot % 2 == 0
        block = slot // 2
    else:
        is_dq = DQ_PROGRAMS
        block = slot
    Q_FILL: tl.constexpr = (D, BLOCK_D, FILL_BLOCK, False)
    KV_FILL: tl.constexpr = (D, BLOCK_D, FILL_BLOCK, True)
    # As the forward's, the zero-fill programs return before any attention code (ptxas 12.8).
    if sequence == batch:
        if is_dq:
            zero_uncovered((dq_ptr, dq_ptr), q_offsets_ptr, batch, segment, head, chunk=block,
                           fill_chunk=q_fill_chunk, layout=q_layout, MAX_LEN=Q_MAX_LEN, FILL=Q_FILL)
        elif head % KV_GROUP == 0:
            zero_uncovered((dk_ptr, dv_ptr), kv_offsets_ptr, batch, segment, head // KV_GROUP, chunk=block,
                           fill_chunk=kv_fill_chunk, layout=kv_layout, MAX_LEN=KV_MAX_LEN, FILL=KV_FILL)
        return
    if block == 0:
        if is_dq:
            zero_tail((dq_ptr, dq_ptr), q_offsets_ptr, sequence, segment, head, layout=q_layout,
                      MAX_LEN=Q_MAX_LEN, FILL=Q_FILL)
        elif head % KV_GROUP == 0:
            zero_tail((dk_ptr, dv_ptr), kv_offsets_ptr, sequence, segment, head // KV_GROUP, layout=kv_layout,
                      MAX_LEN=KV_MAX_LEN, FILL=KV_FILL)
        return
    block -= 1
    SHAPE: tl.constexpr = (NUM_HEADS, KV_GROUP, D, BLOCK_D)
    BAND: tl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    if is_dq:
        _dq_program((q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, slopes_ptr), dq_ptr,
                    (q_offsets_ptr, kv_offsets_ptr), (segment, sequence, head, block * DQ_BLOCK_M),
                    (q_layout, kv_layout), SHAPE, (Q_MAX_LEN, KV_MAX_LEN), BAND, (SOFTCAP, ALIBI, QK_SCALE),
                    TILE=(DQ_BLOCK_M, DQ_BLOCK_N, INPUT_PRECISION), DS_SCALE=DS_SCALE)
    elif head % KV_GROUP == 0:
        if QDO_KEY_MAJOR:
            km_d_stride = aligned(tl.load(params_ptr + PARAM_BWD_KM_D_STRIDE), KEY_MAJOR_ALIGN)
        else:
            km_d_stride = 0
        _dkdv_program((q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, slopes_ptr),
                      (q_km_ptr, do_km_ptr, km_d_stride), (dk_ptr, dv_ptr), (q_offsets_ptr, kv_offsets_ptr),
                      (segment, sequence, head // KV_GROUP, block * DKDV_BLOCK_N), (q_layout, kv_layout),
                      SHAPE, (Q_MAX_LEN, KV_MAX_LEN), BAND, (SOFTCAP, ALIBI, QK_SCALE),
                      TILE=(DKDV_BLOCK_M, DKDV_BLOCK_N, INPUT_PRECISION), SCALES=(DS_SCALE, OUT_SCALE),
                      KEY_MAJOR=(QDO_KEY_MAJOR, KEY_MAJOR_ALIGN))
