"""The portable forward: per program o and the base-2 log-sum-exp of one block of queries, or a share of
the zero fills.
"""

import triton
import triton.language as tl

from ..shared import INF, band, bounds, key_ranges, query_shift, span, transform_scores
from .fills import zero_tail, zero_uncovered
from .memory import (
    PARAM_FWD_FILL_CHUNK,
    PARAM_FWD_SLOTS,
    PARAM_FWD_V_D_STRIDE,
    aligned,
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


@triton.jit
def _fwd_block(state, queries, keys, tiles, key_start, cols, BAND: tl.constexpr, SCORES: tl.constexpr,
               DIMS: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               MASKED: tl.constexpr, V_KEY_MAJOR: tl.constexpr, TMA: tl.constexpr):
    """The online softmax's state (acc, row_sum, row_max) after keys [key_start, key_start + BLOCK_N).

    queries = (q, query_rows, shift, slope): the block's queries, their rows, their key position shift
    and this head's ALiBi slope. keys = (k_base, v_base, lead, n_k, kv_token_stride, v_d_stride): the
    key window's keys and values, counted from the window's start; its first `lead` keys (before the
    sequence, V_KEY_MAJOR only) and those from n_k on are masked. With TMA an unmasked block's keys and
    values come through tiles = (k_desc, v_desc, row, col), TMA descriptors of [BLOCK_N, D] tiles over
    2-D views of k and v whose row `row` and column `col` are the window's first key.
    """
    acc, row_sum, row_max = state
    q, query_rows, shift, slope = queries
    k_base, v_base, lead, n_k, kv_token_stride, v_d_stride = keys
    key_rows = key_start + tl.arange(0, BLOCK_N)
    BY_TMA: tl.constexpr = TMA and not MASKED
    if BY_TMA:
        k_desc, v_desc, row, col = tiles
        k = k_desc.load([row + key_start, col])
    else:
        k = load_tile(k_base, key_rows, cols, n_k, kv_token_stride, DIMS, MASKED)
    scores, _ = transform_scores(tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION), query_rows[:, None],
                                 key_rows[None, :], shift, slope, SCORES)
    if MASKED:
        # Masked keys must not take part in the row max: a real score far below 0 would underflow.
        keep = key_rows[None, :] < n_k
        if V_KEY_MAJOR:
            keep = keep & (key_rows[None, :] >= lead)
        keep = band(keep, query_rows[:, None], key_rows[None, :], shift, BAND)
        scores = tl.where(keep, scores, -INF)
    p, correction, row_sum, new_max = _online_softmax(
        scores, row_max, row_sum, SCORES[2],
        EMPTY_ROWS=MASKED and (BAND[0] or BAND[1] >= 0 or BAND[2] >= 0))
    if BY_TMA:
        v = v_desc.load([row + key_start, col])
    elif V_KEY_MAJOR:
        v = tl.trans(load_tile_key_major(v_base, key_rows, cols, lead, n_k, v_d_stride, DIMS, MASKED))
    else:
        v = load_tile(v_base, key_rows, cols, n_k, kv_token_stride, DIMS, MASKED)
    acc = acc * correction[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, params_ptr,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, QK_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr, KEY_MAJOR_ALIGN: tl.constexpr,
):
    """o = OUT_SCALE * softmax(scores) v and the base-2 log-sum-exp of one block of BLOCK_M queries of
    one (segment, sequence, head), or a share of the zero fill of o (see memory.program).

    Per sequence n_q = min(len_q, Q_MAX_LEN) queries attend n_k = min(len_kv, KV_MAX_LEN) keys; query i
    sees the keys of its band (`shared.band`: causal, a window) and no others: key blocks outside every
    band of the query block are not visited. Scores as `shared.transform_scores` (a soft cap, ALiBi with
    slopes [segments, NUM_HEADS], read only with ALIBI), in units of the unscaled q.k, as is the
    log-sum-exp; a query with no key gets o = 0 and log-sum-exp +inf. GQA: kv head = head // KV_GROUP.

    With V_KEY_MAJOR, v comes as [H_kv, D, tokens] (see key_major_kernel; D rows PARAM_FWD_V_D_STRIDE
    apart): TF32 products need both operands K-major. The key window then starts at the
    KEY_MAJOR_ALIGN-aligned token at or before the sequence's first (see `key_major_window`); its first
    `lead` keys are masked.
    """
    batch, q_layout, kv_layout, fill_chunk, segment, sequence, head, slot, q_offsets_ptr, kv_offsets_ptr = \
        _forward_program(params_ptr, q_offsets_ptr, kv_offsets_ptr, NUM_HEADS, STRIDE_ALIGN)
    FILL: tl.constexpr = (D, BLOCK_D, FILL_BLOCK, False)
    # The zero-fill programs return without reaching the attention code: ptxas 12.8 (Triton 3.6's)
    # miscompiled programs that zeroed their tail and then went on to a block, clobbering a uniform
    # register that held the offsets pointer.
    if sequence == batch:
        zero_uncovered((o_ptr, o_ptr), q_offsets_ptr, batch, segment, head, chunk=slot, fill_chunk=fill_chunk,
                       layout=q_layout, MAX_LEN=Q_MAX_LEN, FILL=FILL)
        return
    if slot == 0:
        zero_tail((o_ptr, o_ptr), q_offsets_ptr, sequence, segment, head, layout=q_layout, MAX_LEN=Q_MAX_LEN,
                  FILL=FILL)
        return
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_layout[0], Q_MAX_LEN)
    query_start = (slot - 1) * BLOCK_M
    if query_start >= n_q:
        return
    _attend((q_ptr, k_ptr, v_ptr, slopes_ptr, params_ptr, o_ptr, lse_ptr), None,
            (kv_offsets_ptr, q_layout, kv_layout, segment, sequence, head, q_start, n_q, query_start),
            SHAPE=(NUM_HEADS, KV_GROUP, D, BLOCK_D), LENGTHS=(Q_MAX_LEN, KV_MAX_LEN),
            BAND=(CAUSAL, WINDOW_LEFT, WINDOW_RIGHT), SCORES=(SOFTCAP, ALIBI, QK_SCALE),
            OUTPUT=(OUT_SCALE, INPUT_PRECISION), TILES=(BLOCK_M, BLOCK_N),
            MEMORY=(V_KEY_MAJOR, KEY_MAJOR_ALIGN, False))


@triton.jit
def attention_fwd_tma_kernel(
    q_ptr, k_ptr, v_ptr, k_tiles_desc, v_tiles_desc, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, params_ptr,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, QK_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """`attention_fwd_kernel` with the keys and values of its unmasked key blocks loaded by TMA:
    k_tiles_desc and v_tiles_desc are descriptors of [BLOCK_N, D] tiles over 2-D views of k and v (the
    arrays k_ptr and v_ptr point at) whose rows are one token stride long. TMA writes shared memory
    through the async proxy, which wgmma reads: the products need no proxy fence per key block, where
    Triton >= 3.7 fences both products of every block loaded by cp.async. The masked blocks (a
    sequence's last, the diagonal's) load as `attention_fwd_kernel`'s do: a TMA tile past the sequence
    would read the next one's keys, whose values may be NaN under a probability of 0. A power-of-two D
    (BLOCK_D = D), v token-major."""
    batch, q_layout, kv_layout, fill_chunk, segment, sequence, head, slot, q_offsets_ptr, kv_offsets_ptr = \
        _forward_program(params_ptr, q_offsets_ptr, kv_offsets_ptr, NUM_HEADS, STRIDE_ALIGN)
    FILL: tl.constexpr = (D, D, FILL_BLOCK, False)
    if sequence == batch:  # (the zero fills return first, as attention_fwd_kernel's)
        zero_uncovered((o_ptr, o_ptr), q_offsets_ptr, batch, segment, head, chunk=slot, fill_chunk=fill_chunk,
                       layout=q_layout, MAX_LEN=Q_MAX_LEN, FILL=FILL)
        return
    if slot == 0:
        zero_tail((o_ptr, o_ptr), q_offsets_ptr, sequence, segment, head, layout=q_layout, MAX_LEN=Q_MAX_LEN,
                  FILL=FILL)
        return
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_layout[0], Q_MAX_LEN)
    query_start = (slot - 1) * BLOCK_M
    if query_start >= n_q:
        return
    _attend((q_ptr, k_ptr, v_ptr, slopes_ptr, params_ptr, o_ptr, lse_ptr), (k_tiles_desc, v_tiles_desc),
            (kv_offsets_ptr, q_layout, kv_layout, segment, sequence, head, q_start, n_q, query_start),
            SHAPE=(NUM_HEADS, KV_GROUP, D, D), LENGTHS=(Q_MAX_LEN, KV_MAX_LEN),
            BAND=(CAUSAL, WINDOW_LEFT, WINDOW_RIGHT), SCORES=(SOFTCAP, ALIBI, QK_SCALE),
            OUTPUT=(OUT_SCALE, INPUT_PRECISION), TILES=(BLOCK_M, BLOCK_N), MEMORY=(False, 16, True))


@triton.jit
def _forward_program(params_ptr, q_offsets_ptr, kv_offsets_ptr, NUM_HEADS: tl.constexpr,
                     STRIDE_ALIGN: tl.constexpr):
    """(batch, q_layout, kv_layout, fill_chunk, segment, sequence, head, slot, q_offsets_ptr,
    kv_offsets_ptr): the forward program's runtime sizes, its place (memory.program) and its segment's
    rows of offsets."""
    batch, q_layout, kv_layout, offsets_strides = attention_params(params_ptr, STRIDE_ALIGN)
    fill_chunk = tl.load(params_ptr + PARAM_FWD_FILL_CHUNK)
    segment, sequence, head, slot = program(batch, tl.load(params_ptr + PARAM_FWD_SLOTS), NUM_HEADS)
    q_offsets_ptr += segment * offsets_strides[0]
    kv_offsets_ptr += segment * offsets_strides[1]
    return (batch, q_layout, kv_layout, fill_chunk, segment, sequence, head, slot, q_offsets_ptr,
            kv_offsets_ptr)


@triton.jit
def _attend(arrays, descriptors, block, SHAPE: tl.constexpr, LENGTHS: tl.constexpr, BAND: tl.constexpr,
            SCORES: tl.constexpr, OUTPUT: tl.constexpr, TILES: tl.constexpr, MEMORY: tl.constexpr):
    """o and the log-sum-exp of one query block (see attention_fwd_kernel). arrays = (q_ptr, k_ptr,
    v_ptr, slopes_ptr, params_ptr, o_ptr, lse_ptr); descriptors = (k_tiles_desc, v_tiles_desc) with TMA
    (MEMORY[2]: attention_fwd_tma_kernel), else None; block = (kv_offsets_ptr, q_layout, kv_layout,
    segment, sequence, head, q_start, n_q, query_start). The constants, grouped: SHAPE (NUM_HEADS,
    KV_GROUP, D, BLOCK_D), LENGTHS (Q_MAX_LEN, KV_MAX_LEN), BAND (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT),
    SCORES (SOFTCAP, ALIBI, QK_SCALE), OUTPUT (OUT_SCALE, INPUT_PRECISION), TILES (BLOCK_M, BLOCK_N),
    MEMORY (V_KEY_MAJOR, KEY_MAJOR_ALIGN, TMA)."""
    q_ptr, k_ptr, v_ptr, slopes_ptr, params_ptr, o_ptr, lse_ptr = arrays
    kv_offsets_ptr, q_layout, kv_layout, segment, sequence, head, q_start, n_q, query_start = block
    NUM_HEADS: tl.constexpr = SHAPE[0]
    KV_GROUP: tl.constexpr = SHAPE[1]
    D: tl.constexpr = SHAPE[2]
    BLOCK_D: tl.constexpr = SHAPE[3]
    KV_MAX_LEN: tl.constexpr = LENGTHS[1]
    CAUSAL: tl.constexpr = BAND[0]
    WINDOW_LEFT: tl.constexpr = BAND[1]
    WINDOW_RIGHT: tl.constexpr = BAND[2]
    ALIBI: tl.constexpr = SCORES[1]
    QK_SCALE: tl.constexpr = SCORES[2]
    OUT_SCALE: tl.constexpr = OUTPUT[0]
    INPUT_PRECISION: tl.constexpr = OUTPUT[1]
    BLOCK_M: tl.constexpr = TILES[0]
    BLOCK_N: tl.constexpr = TILES[1]
    V_KEY_MAJOR: tl.constexpr = MEMORY[0]
    KEY_MAJOR_ALIGN: tl.constexpr = MEMORY[1]
    TMA: tl.constexpr = MEMORY[2]
    q_tokens, q_token_stride, _ = q_layout
    kv_tokens, kv_token_stride, _ = kv_layout
    DIMS: tl.constexpr = (D, BLOCK_D)
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    kv_head = head // KV_GROUP
    if V_KEY_MAJOR:
        v_d_stride = aligned(tl.load(params_ptr + PARAM_FWD_V_D_STRIDE), KEY_MAJOR_ALIGN)
        window, lead = key_major_window(segment, kv_start, n_k, kv_tokens, KEY_MAJOR_ALIGN)
        v_base = v_ptr + kv_head.to(tl.int64) * D * v_d_stride + window
    else:
        v_d_stride = 0
        lead = 0
        v_base = token_ptr(v_ptr, segment, kv_head, kv_start, kv_layout)
    n_window = n_k + lead
    q_base = token_ptr(q_ptr, segment, head, q_start, q_layout)
    k_base = token_ptr(k_ptr, segment, kv_head, kv_start - lead, kv_layout)
    if TMA:  # the window's first key in the descriptors' 2-D views, rows one token stride long
        first = ((segment.to(tl.int64) * kv_tokens + kv_start) * kv_token_stride
                 + kv_head.to(tl.int64) * kv_layout[2])
        tiles = (descriptors[0], descriptors[1], (first // kv_token_stride).to(tl.int32),
                 (first % kv_token_stride).to(tl.int32))
    else:
        tiles = None
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)

    q = load_tile(q_base, query_rows, cols, n_q, q_token_stride, DIMS, True)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -INF, dtype=tl.float32)
    shift = query_shift(n_q, n_window,
                        ALIGNED=CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0 or ALIBI)
    if ALIBI:
        slope = tl.load(slopes_ptr + segment * NUM_HEADS + head)
    else:
        slope = 0.0
    start, clean_start, clean_end, end = key_ranges(query_start, n_q, n_window, BLOCK_M, BLOCK_N, BAND)
    if V_KEY_MAJOR:  # a first block with keys before the sequence is masked
        clean_start = tl.maximum(clean_start, (lead > 0).to(tl.int32) * BLOCK_N)
        clean_end = tl.maximum(clean_end, clean_start)
    for SPAN in tl.static_range(3):  # without a window or key-major v, no masked blocks come first
        if SPAN != 0 or V_KEY_MAJOR or WINDOW_LEFT >= 0:
            lo, hi = span(SPAN, (start, clean_start, clean_end, end), CLIP_FIRST=True)
            for key_start in range(lo, hi, BLOCK_N):
                acc, row_sum, row_max = _fwd_block(
                    (acc, row_sum, row_max), (q, query_rows, shift, slope),
                    (k_base, v_base, lead, n_window, kv_token_stride, v_d_stride), tiles, key_start, cols,
                    BAND, SCORES=SCORES, DIMS=DIMS, BLOCK_N=BLOCK_N,
                    INPUT_PRECISION=INPUT_PRECISION, MASKED=SPAN != 1, V_KEY_MAJOR=V_KEY_MAJOR, TMA=TMA)

    attended = row_sum != 0  # false only for queries with no key (empty key sequence, or band); NaN: true
    acc = acc * (OUT_SCALE / tl.where(attended, row_sum, 1.0))[:, None]
    o_base = token_ptr(o_ptr, segment, head, q_start, q_layout)
    store_tile(o_base, query_rows, cols, n_q, acc, q_token_stride, DIMS)
    # In units of the unscaled scores: sum_j exp2((s_j - lse) * QK_SCALE) = 1.
    lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), INF)
    lse_base = stat_ptr(lse_ptr, segment, head, q_start, q_tokens, NUM_HEADS)
    tl.store(lse_base + query_rows, lse, mask=query_rows < n_q)
