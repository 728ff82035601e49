"""HSTU attention's portable kernels, on the rules of shared_hstu.py: the forward (o of one block of queries)
and the backward (dq and the per-token scale's gradient of one block of queries, dk and dv of one block of
keys), each program that computes none of these doing a share of the zero fills. No softmax: each key
block's silu weights are final once computed, so there is no running max, no log-sum-exp and no
preprocess. Every output element has one writer and there are no atomics: the results are deterministic.
"""

import triton
import triton.language as tl

from ..shared_hstu import (
    PARAM_HSTU_BATCH,
    PARAM_HSTU_FILL_CHUNK,
    PARAM_HSTU_OFFSETS_STRIDE,
    PARAM_HSTU_QK_HEAD_STRIDE,
    PARAM_HSTU_QK_TOKEN_STRIDE,
    PARAM_HSTU_SLOTS,
    PARAM_HSTU_TARGETS_STRIDE,
    PARAM_HSTU_TOKENS,
    PARAM_HSTU_V_HEAD_STRIDE,
    PARAM_HSTU_V_TOKEN_STRIDE,
    keep,
    key_range,
    position_ids,
    query_spans,
    sequence_rule,
    silu,
    silu_and_grad,
    span_block,
)
from .fills import zero_tail, zero_uncovered
from .memory import aligned, load_tile, program, store_tile, token_ptr


@triton.jit
def _hstu_params(params_ptr, ALIGN: tl.constexpr):
    """(batch, qk_layout, v_layout, row_strides): the sequences per segment, the layouts (tokens,
    token_stride, head_stride) of the arrays of D (q, k, dq, dk) and of V (v, o, do, dv), and the
    distances between the segments' rows of offsets and of num_targets."""
    batch = tl.load(params_ptr + PARAM_HSTU_BATCH)
    tokens = tl.load(params_ptr + PARAM_HSTU_TOKENS)
    qk_layout = (tokens, aligned(tl.load(params_ptr + PARAM_HSTU_QK_TOKEN_STRIDE), ALIGN),
                 aligned(tl.load(params_ptr + PARAM_HSTU_QK_HEAD_STRIDE), ALIGN))
    v_layout = (tokens, aligned(tl.load(params_ptr + PARAM_HSTU_V_TOKEN_STRIDE), ALIGN),
                aligned(tl.load(params_ptr + PARAM_HSTU_V_HEAD_STRIDE), ALIGN))
    return batch, qk_layout, v_layout, (tl.load(params_ptr + PARAM_HSTU_OFFSETS_STRIDE),
                                        tl.load(params_ptr + PARAM_HSTU_TARGETS_STRIDE))


@triton.jit
def _zero_share(out_ptr, offsets_ptr, share, fill_chunk, layout, MAX_LEN: tl.constexpr, FILL: tl.constexpr):
    """A zero-fill program's share of out, share = (batch, segment, sequence, head, chunk): chunk
    `chunk` of the tokens no sequence covers (sequence == batch), or the sequence's tokens past MAX_LEN."""
    batch, segment, sequence, head, chunk = share
    if sequence == batch:
        zero_uncovered((out_ptr, out_ptr), offsets_ptr, batch, segment, head, chunk=chunk,
                       fill_chunk=fill_chunk, layout=layout, MAX_LEN=MAX_LEN, FILL=FILL)
    else:
        zero_tail((out_ptr, out_ptr), offsets_ptr, sequence, segment, head, layout=layout, MAX_LEN=MAX_LEN,
                  FILL=FILL)


@triton.jit
def _view(ptr, segment, head, start, layout):
    """(base, token_stride): an array's rows of one head of a sequence (starting at its token `start`
    of `segment`), rebased once."""
    return token_ptr(ptr, segment, head, start, layout), layout[1]


@triton.jit
def _views(inputs, place, layouts):
    """(q_view, k_view, v_view, do_view, scale_base) of a backward program's sequence and head, inputs =
    (q_ptr, k_ptr, v_ptr, do_ptr, scale_ptr), place = (segment, head, start, first row of the block),
    layouts = (qk_layout, v_layout); scale_base points at the sequence's first token's scale."""
    q_ptr, k_ptr, v_ptr, do_ptr, scale_ptr = inputs
    segment, head, start, _ = place
    qk_layout, v_layout = layouts
    return (_view(q_ptr, segment, head, start, qk_layout), _view(k_ptr, segment, head, start, qk_layout),
            _view(v_ptr, segment, head, start, v_layout), _view(do_ptr, segment, head, start, v_layout),
            scale_ptr + segment.to(tl.int64) * qk_layout[0] + start)


@triton.jit
def _load(view, rows, length, DIMS: tl.constexpr):
    """Rows `rows` of a view, [len(rows), DIMS[1]]; rows from `length` on read 0 (see memory.load_tile)."""
    return load_tile(view[0], rows, tl.arange(0, DIMS[1]), length, view[1], DIMS, True)


@triton.jit
def _store(view, rows, length, value, DIMS: tl.constexpr):
    """`value` into the rows `rows` below `length` of a view."""
    store_tile(view[0], rows, tl.arange(0, DIMS[1]), length, value, view[1], DIMS)


@triton.jit
def _row_scales(scale_base, rows, length, SCALE: tl.constexpr, TOKEN_SCALE: tl.constexpr):
    """s_i of the rows (positions) of a sequence, float32, 0 from `length` on: the operand's (scale_base
    points at the sequence's first token) with TOKEN_SCALE, else SCALE."""
    if TOKEN_SCALE:
        return tl.load(scale_base + rows, mask=rows < length, other=0.0)
    else:
        return tl.where(rows < length, SCALE, 0.0)


# ---------------------------------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_block(acc, queries, keys, key_start, rule, MASK: tl.constexpr, SHAPE: tl.constexpr,
               TILE: tl.constexpr, ALPHA: tl.constexpr):
    """acc + sum over the keys j of [key_start, +BLOCK_N) of mask_ij silu(ALPHA q_i . k_j) v_j.
    queries = (q, query_rows, query_ids); keys = (k_view, v_view), see `_view`; SHAPE = (NUM_HEADS,
    (D, BLOCK_D), (V, BLOCK_V)); TILE = (BLOCK_M, BLOCK_N, INPUT_PRECISION)."""
    q, query_rows, query_ids = queries
    key_rows = key_start + tl.arange(0, TILE[1])
    k = _load(keys[0], key_rows, rule[0], SHAPE[1])
    v = _load(keys[1], key_rows, rule[0], SHAPE[2])
    u = tl.dot(q, tl.trans(k), input_precision=TILE[2]) * ALPHA
    seen = keep(query_rows[:, None], key_rows[None, :], query_ids[:, None],
                position_ids(key_rows, rule[1], MASK)[None, :], rule, MASK)
    weights = tl.where(seen, silu(u), 0.0)
    return tl.dot(weights.to(v.dtype), v, acc, input_precision=TILE[2])


@triton.jit
def hstu_fwd_kernel(
    q_ptr, k_ptr, v_ptr, offsets_ptr, num_targets_ptr, scale_ptr, params_ptr,
    o_ptr,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    MAX_LEN: tl.constexpr, ALPHA: tl.constexpr, SCALE: tl.constexpr, TOKEN_SCALE: tl.constexpr,
    CAUSAL: tl.constexpr, MAX_ATTN_LEN: tl.constexpr, CONTEXT_LEN: tl.constexpr, MIN_FULL_LEN: tl.constexpr,
    HAS_TARGETS: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """o_i = s_i sum_j mask_ij silu(ALPHA q_i . k_j) v_j for one block of BLOCK_M queries of one
    (segment, sequence, head), or a share of the zero fill of o (see memory.program: slot 0 of a
    sequence clears its tokens past MAX_LEN, the fill "sequence" the tokens no sequence covers).

    Per sequence its first L = min(n, MAX_LEN) tokens attend one another under `shared_hstu.keep`
    (HAS_TARGETS: num_targets [segments or 1, batch]); the key blocks no query of the block sees
    (`shared_hstu.key_range`) are skipped. s_i is SCALE, or with TOKEN_SCALE the operand scale[token]
    (float32, one per token of every segment).
    """
    batch, qk_layout, v_layout, row_strides = _hstu_params(params_ptr, STRIDE_ALIGN)
    tokens = qk_layout[0]
    MASK: tl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    segment, sequence, head, slot = program(batch, tl.load(params_ptr + PARAM_HSTU_SLOTS), NUM_HEADS)
    offsets_ptr += segment * row_strides[0]
    num_targets_ptr += segment * row_strides[1]
    # As the softmax forward's, the zero-fill programs return before any attention code (ptxas 12.8).
    if (sequence == batch) | (slot == 0):
        _zero_share(o_ptr, offsets_ptr, (batch, segment, sequence, head, slot),
                    tl.load(params_ptr + PARAM_HSTU_FILL_CHUNK), v_layout, MAX_LEN=MAX_LEN,
                    FILL=(V, BLOCK_V, FILL_BLOCK, False))
        return
    start, rule = sequence_rule(offsets_ptr, num_targets_ptr, sequence, tokens, MAX_LEN, MASK)
    query_start = (slot - 1) * BLOCK_M
    if query_start >= rule[0]:
        return
    SHAPE: tl.constexpr = (NUM_HEADS, (D, BLOCK_D), (V, BLOCK_V))
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = _load(_view(q_ptr, segment, head, start, qk_layout), query_rows, rule[0], SHAPE[1])
    queries = (q, query_rows, position_ids(query_rows, rule[1], MASK))
    keys = (_view(k_ptr, segment, head, start, qk_layout), _view(v_ptr, segment, head, start, v_layout))
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    lo, hi = key_range(query_start, rule, BLOCK_M, BLOCK_N, MASK)
    for key_start in range(lo, hi, BLOCK_N):
        acc = _fwd_block(acc, queries, keys, key_start, rule, MASK, SHAPE,
                         TILE=(BLOCK_M, BLOCK_N, INPUT_PRECISION), ALPHA=ALPHA)
    # s_i is one factor per row: applied once, here.
    scales = _row_scales(scale_ptr + segment.to(tl.int64) * tokens + start, query_rows, rule[0], SCALE,
                         TOKEN_SCALE)
    _store(_view(o_ptr, segment, head, start, v_layout), query_rows, rule[0], acc * scales[:, None], SHAPE[2])


# ---------------------------------------------------------------------------------------------------
# The backward: with u = ALPHA q.k and dp_ij = do_i . v_j, dv_j = sum_i m s_i silu(u_ij) do_i,
# dq_i = ALPHA s_i sum_j m dp_ij silu'(u_ij) k_j, dk_j = ALPHA sum_i m s_i dp_ij silu'(u_ij) q_i, and
# the per-token scale's d s_i = sum_h sum_j m silu(u_ij) dp_ij.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _dq_block(grads, queries, keys, key_start, rule, MASK: tl.constexpr, SHAPE: tl.constexpr,
              TILE: tl.constexpr, SCALES: tl.constexpr):
    """grads = (dq, dscale), unscaled, with the keys [key_start, +BLOCK_N) added: dq_i += sum_j m dp_ij
    silu'(u_ij) k_j and, with TOKEN_SCALE, dscale_i += sum_j m silu(u_ij) dp_ij. queries = (q, do,
    query_rows, query_ids); keys = (k_view, v_view); SCALES = (ALPHA, SCALE, TOKEN_SCALE)."""
    dq, dscale = grads
    q, do, query_rows, query_ids = queries
    key_rows = key_start + tl.arange(0, TILE[1])
    k = _load(keys[0], key_rows, rule[0], SHAPE[1])
    v = _load(keys[1], key_rows, rule[0], SHAPE[2])
    value, slope = silu_and_grad(tl.dot(q, tl.trans(k), input_precision=TILE[2]) * SCALES[0])
    seen = keep(query_rows[:, None], key_rows[None, :], query_ids[:, None],
                position_ids(key_rows, rule[1], MASK)[None, :], rule, MASK)
    dp = tl.dot(do, tl.trans(v), input_precision=TILE[2])
    dq = tl.dot(tl.where(seen, dp * slope, 0.0).to(k.dtype), k, dq, input_precision=TILE[2])
    if SCALES[2]:
        dscale += tl.sum(tl.where(seen, value * dp, 0.0), axis=1)
    return dq, dscale


@triton.jit
def _dq_program(inputs, outputs, place, layouts, rule, MASK: tl.constexpr, SHAPE: tl.constexpr,
                TILE: tl.constexpr, SCALES: tl.constexpr):
    """dq, and with TOKEN_SCALE this head's share of the scale's gradient, of the queries
    [query_start, +BLOCK_M) of one head, walking their key blocks. inputs = (q_ptr, k_ptr, v_ptr, do_ptr,
    scale_ptr); outputs = (dq_ptr, dscale_ptr); place = (segment, head, start, query_start), start the
    sequence's first token; layouts = (qk_layout, v_layout)."""
    q_view, k_view, v_view, do_view, scale_base = _views(inputs, place, layouts)
    segment, head, start, query_start = place
    length = rule[0]
    query_rows = query_start + tl.arange(0, TILE[0])
    queries = (_load(q_view, query_rows, length, SHAPE[1]), _load(do_view, query_rows, length, SHAPE[2]),
               query_rows, position_ids(query_rows, rule[1], MASK))
    dq = tl.zeros([TILE[0], SHAPE[1][1]], dtype=tl.float32)
    dscale = tl.zeros([TILE[0]], dtype=tl.float32)
    lo, hi = key_range(query_start, rule, TILE[0], TILE[1], MASK)
    for key_start in range(lo, hi, TILE[1]):
        dq, dscale = _dq_block((dq, dscale), queries, (k_view, v_view), key_start, rule, MASK, SHAPE, TILE,
                               SCALES)
    scales = _row_scales(scale_base, query_rows, length, SCALES[1], SCALES[2])
    _store(_view(outputs[0], segment, head, start, layouts[0]), query_rows, length,
           dq * (SCALES[0] * scales)[:, None], SHAPE[1])
    if SCALES[2]:  # dscale is [all tokens, NUM_HEADS]
        first = segment.to(tl.int64) * layouts[0][0] + start  # the sequence's first token, over the segments
        tl.store(outputs[1] + (first + query_rows) * SHAPE[0] + head, dscale, mask=query_rows < length)


@triton.jit
def _dkdv_block(grads, keys, queries, query_start, rule, MASK: tl.constexpr, SHAPE: tl.constexpr,
                TILE: tl.constexpr, SCALES: tl.constexpr):
    """grads = (dk, dv), dk without ALPHA and both without a constant SCALE, with the queries
    [query_start, +BLOCK_M) added. keys = (k, v, key_rows, key_ids), the program's; queries = (q_view,
    do_view, scale_base), the sequence's. On transposed scores [keys, queries], so that no operand of dk
    and dv needs a transpose."""
    dk, dv = grads
    k, v, key_rows, key_ids = keys
    q_view, do_view, scale_base = queries
    query_rows = query_start + tl.arange(0, TILE[0])
    q = _load(q_view, query_rows, rule[0], SHAPE[1])
    do = _load(do_view, query_rows, rule[0], SHAPE[2])
    value_t, slope_t = silu_and_grad(tl.dot(k, tl.trans(q), input_precision=TILE[2]) * SCALES[0])
    seen_t = keep(query_rows[None, :], key_rows[:, None], position_ids(query_rows, rule[1], MASK)[None, :],
                  key_ids[:, None], rule, MASK)
    dp_t = tl.dot(v, tl.trans(do), input_precision=TILE[2])
    weights_t = tl.where(seen_t, value_t, 0.0)
    du_t = tl.where(seen_t, dp_t * slope_t, 0.0)
    if SCALES[2]:
        scales = _row_scales(scale_base, query_rows, rule[0], SCALES[1], SCALES[2])
        weights_t = weights_t * scales[None, :]
        du_t = du_t * scales[None, :]
    dv = tl.dot(weights_t.to(do.dtype), do, dv, input_precision=TILE[2])
    dk = tl.dot(du_t.to(q.dtype), q, dk, input_precision=TILE[2])
    return dk, dv


@triton.jit
def _dkdv_program(inputs, outputs, place, layouts, rule, MASK: tl.constexpr, SHAPE: tl.constexpr,
                  TILE: tl.constexpr, SCALES: tl.constexpr):
    """dk and dv of the keys [key_start, +BLOCK_N) of one head: every query block of `query_spans`, in
    order (deterministic). inputs and layouts as `_dq_program`'s; outputs = (dk_ptr, dv_ptr); place =
    (segment, head, start, key_start)."""
    q_view, k_view, v_view, do_view, scale_base = _views(inputs, place, layouts)
    segment, head, start, key_start = place
    length = rule[0]
    key_rows = key_start + tl.arange(0, TILE[1])
    # Keys past L load as 0; their rows of dk, dv are computed but never stored.
    keys = (_load(k_view, key_rows, length, SHAPE[1]), _load(v_view, key_rows, length, SHAPE[2]), key_rows,
            position_ids(key_rows, rule[1], MASK))
    dk = tl.zeros([TILE[1], SHAPE[1][1]], dtype=tl.float32)
    dv = tl.zeros([TILE[1], SHAPE[2][1]], dtype=tl.float32)
    spans = query_spans(key_start, rule, TILE[0], TILE[1], MASK)
    for block in range(0, spans[0] + spans[2] + spans[4]):
        dk, dv = _dkdv_block((dk, dv), keys, (q_view, do_view, scale_base), span_block(block, spans, TILE[0]),
                             rule, MASK, SHAPE, TILE, SCALES)
    if SCALES[2]:
        dk = dk * SCALES[0]
    else:
        dk = dk * (SCALES[0] * SCALES[1])
        dv = dv * SCALES[1]
    _store(_view(outputs[0], segment, head, start, layouts[0]), key_rows, length, dk, SHAPE[1])
    _store(_view(outputs[1], segment, head, start, layouts[1]), key_rows, length, dv, SHAPE[2])


@triton.jit
def hstu_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, offsets_ptr, num_targets_ptr, scale_ptr, params_ptr,
    dq_ptr, dk_ptr, dv_ptr, dscale_ptr,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
    MAX_LEN: tl.constexpr, ALPHA: tl.constexpr, SCALE: tl.constexpr, TOKEN_SCALE: tl.constexpr,
    CAUSAL: tl.constexpr, MAX_ATTN_LEN: tl.constexpr, CONTEXT_LEN: tl.constexpr, MIN_FULL_LEN: tl.constexpr,
    HAS_TARGETS: tl.constexpr, INPUT_PRECISION: tl.constexpr, DKDV_BLOCK_M: tl.constexpr,
    DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr, DQ_PROGRAMS: tl.constexpr,
    DKDV_PROGRAMS: tl.constexpr,
):
    """One program of a backward launch of dq programs, dk/dv programs or both (then even slots are dq
    programs and odd slots dk/dv ones), as the softmax backward's: a dq program takes DQ_BLOCK_M queries
    of one head (and with TOKEN_SCALE writes that head's share of the scale's gradient, dscale [all
    tokens, NUM_HEADS], which the launcher sums over the heads), a dk/dv program DKDV_BLOCK_N keys of
    one head. The zero-fill programs and each sequence's last slot (of each kind) clear dq and dscale,
    and dk and dv, where no sequence attends. A launch of one kind never touches the other kind's
    outputs, nor dscale without TOKEN_SCALE (one-element placeholders). The rest is the forward's."""
    batch, qk_layout, v_layout, row_strides = _hstu_params(params_ptr, STRIDE_ALIGN)
    MASK: tl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    segment, sequence, head, slot = program(batch, tl.load(params_ptr + PARAM_HSTU_SLOTS), NUM_HEADS)
    offsets_ptr += segment * row_strides[0]
    num_targets_ptr += segment * row_strides[1]
    PAIRED: tl.constexpr = DQ_PROGRAMS and DKDV_PROGRAMS  # dq programs in even slots, dk/dv in odd ones
    is_dq = slot % 2 == 0 if PAIRED else DQ_PROGRAMS
    block = slot // 2 if PAIRED else slot
    if (sequence == batch) | (block == 0):
        share = (batch, segment, sequence, head, block)
        fill_chunk = tl.load(params_ptr + PARAM_HSTU_FILL_CHUNK)
        if is_dq:
            _zero_share(dq_ptr, offsets_ptr, share, fill_chunk, qk_layout, MAX_LEN=MAX_LEN,
                        FILL=(D, BLOCK_D, FILL_BLOCK, False))
            if TOKEN_SCALE:  # [all tokens, NUM_HEADS]: a head's column as an array of one element per token
                _zero_share(dscale_ptr, offsets_ptr, share, fill_chunk, (qk_layout[0], NUM_HEADS, 1),
                            MAX_LEN=MAX_LEN, FILL=(1, 1, FILL_BLOCK, False))
        else:
            _zero_share(dk_ptr, offsets_ptr, share, fill_chunk, qk_layout, MAX_LEN=MAX_LEN,
                        FILL=(D, BLOCK_D, FILL_BLOCK, False))
            _zero_share(dv_ptr, offsets_ptr, share, fill_chunk, v_layout, MAX_LEN=MAX_LEN,
                        FILL=(V, BLOCK_V, FILL_BLOCK, False))
        return
    start, rule = sequence_rule(offsets_ptr, num_targets_ptr, sequence, qk_layout[0], MAX_LEN, MASK)
    inputs = (q_ptr, k_ptr, v_ptr, do_ptr, scale_ptr)
    SHAPE: tl.constexpr = (NUM_HEADS, (D, BLOCK_D), (V, BLOCK_V))
    SCALES: tl.constexpr = (ALPHA, SCALE, TOKEN_SCALE)
    if is_dq:
        query_start = (block - 1) * DQ_BLOCK_M
        if query_start < rule[0]:
            _dq_program(inputs, (dq_ptr, dscale_ptr), (segment, head, start, query_start),
                        (qk_layout, v_layout), rule, MASK, SHAPE,
                        TILE=(DQ_BLOCK_M, DQ_BLOCK_N, INPUT_PRECISION), SCALES=SCALES)
    else:
        key_start = (block - 1) * DKDV_BLOCK_N
        if key_start < rule[0]:
            _dkdv_program(inputs, (dk_ptr, dv_ptr), (segment, head, start, key_start), (qk_layout, v_layout),
                          rule, MASK, SHAPE, TILE=(DKDV_BLOCK_M, DKDV_BLOCK_N, INPUT_PRECISION),
                          SCALES=SCALES)
