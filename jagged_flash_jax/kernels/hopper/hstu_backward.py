"""HSTU attention's Hopper backward: a dk/dv kernel and a dq kernel, persistent and warp-specialized as the
softmax Hopper backward's (dkdv.py, dq.py: a 1-warp TMA producer, two consumer warpgroups of 64 rows), on
its scheduler (scheduler.py), ring helpers (pipeline.py), addressing and zero fills, with HSTU's pointwise
score in the place of the softmax: no log-sum-exp, no delta preprocess. The semantics, the mask, the key
blocks a query block visits and the query blocks a key block visits are shared_hstu.py's
(portable/hstu.hstu_bwd_kernel is the reference these mirror, product for product).

With u = ALPHA q.k, w = silu(u) and dp = do . v, per tile under the mask m and the query's scale s_i:
dv_j += m s_i w_ij do_i, dk_j += m s_i dp_ij silu'(u_ij) q_i (times ALPHA), and
dq_i += m dp_ij silu'(u_ij) k_j (times ALPHA s_i), the per-token scale's ds_i += m w_ij dp_ij. dk/dv and
dq are separate kernels, each gradient row written by one program: deterministic, no atomics.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..shared_hstu import (
    PARAM_HSTU_BATCH,
    PARAM_HSTU_FILL_CHUNK,
    PARAM_HSTU_QK_HEAD_STRIDE,
    PARAM_HSTU_QK_TOKEN_STRIDE,
    PARAM_HSTU_TOKENS,
    PARAM_HSTU_V_HEAD_STRIDE,
    PARAM_HSTU_V_TOKEN_STRIDE,
    keep,
    position_ids,
    query_spans,
    sequence_rule,
    silu_and_grad,
    span_block,
)
from ..spec import HOPPER_HSTU_BWD_DKDV, HOPPER_HSTU_BWD_DQ
from .addressing import store_rows, tile_origin
from .fills import FILL_NONE, zero_fills
from .hstu_forward import describe_query_block  # the forward's query blocks: dq's too
from .pipeline import (
    CONSUMER_ROWS,
    hand_over_zeroed,
    tma_load,
    wgmma_layout,
    zero_tail_tile,
)
from .scheduler import (
    consume_items,
    dkdv_barriers,
    dq_buffers,
    fetch,
    hand_out,
    item_position,
    produce_items,
    receive,
)

# The slot of the blocks of each (sequence, head) (kernels/spec.py's HOPPER_HSTU_PARAMS, both kernels'):
# key blocks of BLOCK_N for dk/dv, query blocks of BLOCK_M for dq.
PARAM_HSTU_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_HSTU_BWD_DKDV.slot("blocks"))
assert HOPPER_HSTU_BWD_DQ.slot("blocks") == HOPPER_HSTU_BWD_DKDV.slot("blocks")


@gluon.jit
def _read_params(params_ptr, STRIDE_ALIGN: gl.constexpr):
    """(batch, tokens, qk_layout, v_layout, blocks, fill_chunk) from the runtime parameters: the layouts
    (tokens, token_stride, head_stride) of the arrays of D (q, k, dq, dk) and of V (v, do, dv)."""
    batch = gl.load(params_ptr + PARAM_HSTU_BATCH)
    tokens = gl.load(params_ptr + PARAM_HSTU_TOKENS)
    qk_layout = (tokens, gl.load(params_ptr + PARAM_HSTU_QK_TOKEN_STRIDE) * STRIDE_ALIGN,
                 gl.load(params_ptr + PARAM_HSTU_QK_HEAD_STRIDE) * STRIDE_ALIGN)
    v_layout = (tokens, gl.load(params_ptr + PARAM_HSTU_V_TOKEN_STRIDE) * STRIDE_ALIGN,
                gl.load(params_ptr + PARAM_HSTU_V_HEAD_STRIDE) * STRIDE_ALIGN)
    blocks = gl.load(params_ptr + PARAM_HSTU_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_HSTU_FILL_CHUNK)
    return batch, tokens, qk_layout, v_layout, blocks, fill_chunk


# ---------------------------------------------------------------------------------------------------
# dk and dv: blocks of 128 keys, streaming the query tiles of `shared_hstu.query_spans`
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def hstu_bwd_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, offsets_ptr, num_targets_ptr, order_ptr, scale_ptr, params_ptr,
    dk_ptr, dv_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, D: gl.constexpr, V: gl.constexpr, MAX_LEN: gl.constexpr, ALPHA: gl.constexpr,
    SCALE: gl.constexpr, TOKEN_SCALE: gl.constexpr, CAUSAL: gl.constexpr, MAX_ATTN_LEN: gl.constexpr,
    CONTEXT_LEN: gl.constexpr, MIN_FULL_LEN: gl.constexpr, HAS_TARGETS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """dk and dv with the portable backward's semantics (portable/hstu._dkdv_program), on a persistent grid
    of one program per SM, for one offsets segment: each program first does its share of the zero fills
    of dk and dv (each sequence's tokens past MAX_LEN, the tokens no sequence covers), then takes blocks
    of BLOCK_N = 128 keys (two warpgroups' 64) of a (sequence, head), the first of each first (the
    costliest under causal), from the counter at counter_ptr until none is left. Every row of dk and dv
    is written, by one program: deterministic.

    Per block the producer loads K and V (two halves of 64 rows, once both consumers are done with the
    last block's), then the Q and dO tiles of BLOCK_M queries of every query block that may see a key of
    the block (`shared_hstu.query_spans`, up to three spans: the context rows, the band, the lifted
    rows) into a STAGES-deep ring that runs on from block to block. q and k (of D) and do and v (of V)
    come as TMA descriptors over 2-D views (addressing.py). The sequence's last query tile, where it runs
    past the attended length L, has its rows there (other tokens, maybe NaN) zeroed in shared memory by
    warpgroup 0 before any product reads it (its weights are 0 there, but 0 * NaN is NaN)."""
    batch, tokens, qk_layout, v_layout, blocks, fill_chunk = _read_params(params_ptr, STRIDE_ALIGN)
    zero_fills((dk_ptr, dk_ptr), offsets_ptr, batch, blocks, fill_chunk, qk_layout, NUM_HEADS, MAX_LEN,
               (D, FILL_BLOCK, FILL_NONE))
    zero_fills((dv_ptr, dv_ptr), offsets_ptr, batch, blocks, fill_chunk, v_layout, NUM_HEADS, MAX_LEN,
               (V, FILL_BLOCK, FILL_NONE))
    end = batch * NUM_HEADS * blocks

    # The shared memory and barriers of the warp-specialized region, set up once.
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, V], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, V], do_desc.layout)
    barriers, ring = dkdv_barriers(1, STAGES)
    kv_bar, kv_free, ready, empty, tail_bar = barriers

    pipe = (k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar)
    schedule = (counter_ptr, end, blocks, ring, order_ptr if ORDERED else None)  # (`_take`)
    sequences = (offsets_ptr, num_targets_ptr, tokens)
    MASK: gl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    SCORES: gl.constexpr = (ALPHA, SCALE, TOKEN_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    arrays = (scale_ptr, dk_ptr, dv_ptr, qk_layout, v_layout)
    gl.warp_specialize([
        (_dkdv_consumer_loop, (pipe, schedule, sequences, arrays, NUM_HEADS, MAX_LEN, MASK, SCORES, TILES,
                               0)),
        (_dkdv_consumer_loop, (pipe, schedule, sequences, arrays, NUM_HEADS, MAX_LEN, MASK, SCORES, TILES,
                               1)),
        (_dkdv_producer_loop, ((q_desc, do_desc, k_desc, v_desc, pipe), schedule, sequences,
                               (qk_layout, v_layout), NUM_HEADS, MAX_LEN, MASK, TILES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _key_block(sequences, item, blocks, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr, MASK: gl.constexpr,
               TILES: gl.constexpr):
    """Key block `item` (the first of each (sequence, head) first): (head, start, rule, key0, spans,
    num_tiles), start the sequence's first token, rule `shared_hstu.sequence_rule`'s, spans the query
    blocks that may see a key of [key0, +BLOCK_N) (`shared_hstu.query_spans`), num_tiles their count.
    `fetch` hands out only blocks with keys (key0 < L)."""
    offsets_ptr, num_targets_ptr, tokens = sequences
    sequence, head, key0 = item_position(item, blocks, NUM_HEADS, TILES[1], LAST_FIRST=False)
    start, rule = sequence_rule(offsets_ptr, num_targets_ptr, sequence, tokens, MAX_LEN, MASK)
    spans = query_spans(key0, rule, TILES[0], TILES[1], MASK)
    return head, start, rule, key0, spans, spans[0] + spans[2] + spans[4]


@gluon.jit
def _dkdv_producer_loop(buffers, schedule, sequences, layouts, NUM_HEADS: gl.constexpr,
                        MAX_LEN: gl.constexpr, MASK: gl.constexpr, TILES: gl.constexpr):
    """The load partition: the key blocks `fetch` takes from the counter, each handed out to the
    consumers and then loaded (`_dkdv_produce`), the ring's position and K and V's phase running on;
    then `end`, which ends the consumers."""
    counter_ptr, end, blocks, ring, order_ptr = schedule  # (names, not `_`: a reassigned name is carried)
    offsets_ptr, num_targets_ptr, tokens = sequences
    t = 0
    i = 0
    item = fetch(schedule, offsets_ptr, tokens, NUM_HEADS, MAX_LEN, TILES[1], LAST_FIRST=False)
    while item < end:
        hand_out(ring, i, item)
        block = _key_block(sequences, item, blocks, NUM_HEADS, MAX_LEN, MASK, TILES)
        t = _dkdv_produce(buffers, block, layouts, t, i & 1, TILES)
        i += 1
        item = fetch(schedule, offsets_ptr, tokens, NUM_HEADS, MAX_LEN, TILES[1], LAST_FIRST=False)
    hand_out(ring, i, end)


@gluon.jit
def _dkdv_produce(buffers, block, layouts, t, kvp, TILES: gl.constexpr):
    """The producer's work for one key block (`_key_block`'s tuple): its K and V halves (once both
    consumers have freed the last block's: kv_free's phase kvp ^ 1), then the Q and dO tiles of its query
    spans, in order, into the ring from its position t as slots free. layouts = (qk_layout, v_layout).
    Returns the ring's position after the block."""
    q_desc, do_desc, k_desc, v_desc, pipe = buffers
    k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, _ = pipe
    head, start, _, key0, spans, num_tiles = block
    qk_layout, v_layout = layouts
    BLOCK_M: gl.constexpr = TILES[0]
    STAGES: gl.constexpr = TILES[2]
    qk_row, qk_col = tile_origin(start, head, qk_layout)
    v_row, v_col = tile_origin(start, head, v_layout)

    mbarrier.wait(kv_free, kvp ^ 1)  # fresh barriers: phase 1 counts as complete
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma_load(k_desc, [qk_row + key0 + w * CONSUMER_ROWS, qk_col], kv_bar, k_smem.index(w))
        tma_load(v_desc, [v_row + key0 + w * CONSUMER_ROWS, v_col], kv_bar, v_smem.index(w))
    for b in range(num_tiles):
        i = t + b
        slot = i % STAGES
        m0 = span_block(b, spans, BLOCK_M)
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [qk_row + m0, qk_col], bar, q_smem.index(slot))
        tma_load(do_desc, [v_row + m0, v_col], bar, do_smem.index(slot))
    return t + num_tiles


@gluon.jit
def _dkdv_consumer_loop(pipe, schedule, sequences, arrays, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
                        MASK: gl.constexpr, SCORES: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG: `_dkdv_consume` for each key block the producer hands out, until `end`."""
    counter_ptr, end, blocks, ring, order_ptr = schedule  # (names, not `_`: a reassigned name is carried)
    t = 0
    tail_phases = gl.to_tensor(0)
    i = 0
    item = receive(ring, i)
    while item < end:
        block = _key_block(sequences, item, blocks, NUM_HEADS, MAX_LEN, MASK, TILES)
        t, tail_phases = _dkdv_consume(pipe, arrays, block, (t, i & 1, tail_phases), MASK, SCORES, TILES, WG)
        i += 1
        item = receive(ring, i)


@gluon.jit
def _dkdv_consume(pipe, arrays, block, position, MASK: gl.constexpr, SCORES: gl.constexpr,
                  TILES: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one key block (`_key_block`'s tuple): dK, dV of keys
    key0 + 64 WG + [0, 64) over the query tiles the producer streams into the ring from its position t
    (the block's K and V behind kv_bar at phase kvp), stored (rows < L; zero where no query sees them) at
    the end. Per tile, on transposed scores [keys, queries] (so that no operand needs a transpose):
    U^T = K Q^T and dP^T = V dO^T, then dV += W^T dO, dK += dU^T Q with W^T = m silu(ALPHA U^T) and
    dU^T = m dP^T silu'(ALPHA U^T), the mask's `where` on every element (selects: U^T and dP^T are NaN
    where a key or query is another token). arrays = (scale_ptr, dk_ptr, dv_ptr, qk_layout, v_layout);
    SCORES = (ALPHA, SCALE, TOKEN_SCALE): with TOKEN_SCALE each query's scale multiplies W^T and dU^T
    before they are rounded to the inputs' type (the portable kernel's order), else SCALE multiplies dK
    and dV once, at the end. position = (t, kvp, tail_phases), tail_phases the per-slot tail barriers'
    parities (a bit per slot); returns the ring's position and tail_phases after the block."""
    k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar = pipe
    scale_ptr, dk_ptr, dv_ptr, qk_layout, v_layout = arrays
    head, start, rule, key0, spans, num_tiles = block
    t, kvp, tail_phases = position
    ALPHA: gl.constexpr = SCORES[0]
    BLOCK_M: gl.constexpr = TILES[0]
    STAGES: gl.constexpr = TILES[2]
    D: gl.constexpr = q_smem.shape[2]
    V: gl.constexpr = do_smem.shape[2]

    st_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    dk_layout: gl.constexpr = wgmma_layout(D)
    dv_layout: gl.constexpr = wgmma_layout(V)
    dk_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
    dv_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    length = rule[0]
    krow0 = key0 + WG * CONSUMER_ROWS
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    dk = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=dk_layout)
    dv = gl.zeros([CONSUMER_ROWS, V], gl.float32, layout=dv_layout)
    st_zero = gl.zeros([CONSUMER_ROWS, BLOCK_M], gl.float32, layout=st_layout)
    key_rows = krow0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    keys = (gl.expand_dims(key_rows, 1), gl.expand_dims(position_ids(key_rows, rule[1], MASK), 1))
    last_m0 = (gl.cdiv(length, BLOCK_M) - 1) * BLOCK_M  # the sequence's last query tile, and its rows
    last_rows = length - last_m0
    mbarrier.wait(kv_bar, kvp)  # always, tiles or none: kv_bar's phase runs on from block to block
    for b in range(num_tiles):
        i = t + b
        slot = i % STAGES
        m0 = span_block(b, spans, BLOCK_M)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        tail = (m0 == last_m0) & (last_rows < BLOCK_M)
        if tail:  # the tile's rows past L are other tokens: zeroed before any product
            tail_phases = zero_tail_tile(q, do, slot, tail_bar, tail_phases, last_rows, BLOCK_M, WG)
        ut_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        seen = _seen_t(keys, m0, rule, MASK, BLOCK_M, col_layout)
        ut = warpgroup_mma_wait(1, deps=(ut_tok, ))
        value_t, slope_t = silu_and_grad(ut * ALPHA)
        weights_t = gl.where(seen, value_t, 0.0)
        if SCORES[2]:
            cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
            scales = gl.expand_dims(gl.load(scale_ptr + start + cols, mask=cols < length, other=0.0), 0)
            weights_t = weights_t * scales
        w_op = gl.convert_layout(weights_t.to(dtype), dv_op_layout)
        dv_tok = warpgroup_mma(w_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
        du_t = gl.where(seen, dpt * slope_t, 0.0)
        if SCORES[2]:
            du_t = du_t * scales
        du_op = gl.convert_layout(du_t.to(dtype), dk_op_layout)
        dk_tok = warpgroup_mma(du_op, q, dk, is_async=True)
        # One wait per product (Triton 3.6 fails on one wait over both where V != D: its layout
        # conversions pass destroys the wait over the two operands' different layouts).
        dv, w_op = warpgroup_mma_wait(1, deps=(dv_tok, w_op))
        dk, du_op = warpgroup_mma_wait(0, deps=(dk_tok, du_op))
        mbarrier.arrive(empty.index(slot), count=1)
    # K and V are free for the next block's (kv_free counts both warpgroups' arrivals): dK and dV are in
    # registers, and the products that read K and V are done.
    mbarrier.arrive(kv_free, count=1)
    if SCORES[2]:
        store_rows(dk_ptr, dk, ALPHA, start, head, krow0, length, qk_layout, D, dk_layout)
        store_rows(dv_ptr, dv, 1.0, start, head, krow0, length, v_layout, V, dv_layout)
    else:
        store_rows(dk_ptr, dk, ALPHA * SCORES[1], start, head, krow0, length, qk_layout, D, dk_layout)
        store_rows(dv_ptr, dv, SCORES[1], start, head, krow0, length, v_layout, V, dv_layout)
    return t + num_tiles, tail_phases


@gluon.jit
def _seen_t(keys, m0, rule, MASK: gl.constexpr, BLOCK_M: gl.constexpr, col_layout: gl.constexpr):
    """`shared_hstu.keep` of a [64 keys, BLOCK_M queries] tile, the queries [m0, +BLOCK_M): keys =
    (rows, ids), the warpgroup's key positions and ids as [64, 1] columns."""
    key_rows, key_ids = keys
    cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
    query_ids = position_ids(cols, rule[1], MASK)
    return keep(gl.expand_dims(cols, 0), key_rows, gl.expand_dims(query_ids, 0), key_ids, rule, MASK)


# ---------------------------------------------------------------------------------------------------
# dq and the per-token scale's gradient: the forward's query blocks (scheduler.py's loops)
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def hstu_bwd_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, offsets_ptr, num_targets_ptr, order_ptr, scale_ptr, params_ptr,
    dq_ptr, dscale_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, D: gl.constexpr, V: gl.constexpr, MAX_LEN: gl.constexpr, ALPHA: gl.constexpr,
    SCALE: gl.constexpr, TOKEN_SCALE: gl.constexpr, CAUSAL: gl.constexpr, MAX_ATTN_LEN: gl.constexpr,
    CONTEXT_LEN: gl.constexpr, MIN_FULL_LEN: gl.constexpr, HAS_TARGETS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """dq and, with TOKEN_SCALE, each head's share of the per-token scale's gradient (dscale [tokens,
    NUM_HEADS] float32, zeroed by the launcher, which sums the heads), with the portable backward's
    semantics (portable/hstu._dq_program), on the Hopper forward's persistent schedule: each program does
    its share of the zero fills of dq, then takes blocks of BLOCK_M = 128 queries (two warpgroups') of a
    (sequence, head), the last of each first, until none is left. Per block the producer loads both
    warpgroups' Q and dO tiles, then the K and V tiles of the block's key range
    (`shared_hstu.key_range`, the forward's) into a STAGES-deep ring. The block's last K tile, where the
    range ends inside it, has its rows past the range (other tokens, maybe NaN) zeroed in shared memory
    by warpgroup 0 before dU K reads them. Every row of dq (and of dscale's attended tokens) is written
    by one program: deterministic."""
    batch, tokens, qk_layout, v_layout, blocks, fill_chunk = _read_params(params_ptr, STRIDE_ALIGN)
    zero_fills((dq_ptr, dq_ptr), offsets_ptr, batch, blocks, fill_chunk, qk_layout, NUM_HEADS, MAX_LEN,
               (D, FILL_BLOCK, FILL_NONE))
    end = batch * NUM_HEADS * blocks

    pipe, ring = dq_buffers(q_desc, do_desc, k_desc, v_desc, (D, V, BLOCK_N, STAGES))
    schedule = (counter_ptr, end, blocks, ring, order_ptr if ORDERED else None)  # (`_take`)
    # The scheduler's bundles, HSTU's way (as hstu_forward.py's): the offsets and tokens first (what
    # `fetch` reads), num_targets in the place of the keys' offsets; SHAPE = (NUM_HEADS, D, V); MASK in
    # the place of the band; SCORES = (ALPHA, TOKEN_SCALE, NUM_HEADS), the last dscale's row length.
    sequences = (offsets_ptr, num_targets_ptr, tokens, tokens)
    SHAPE: gl.constexpr = (NUM_HEADS, D, V)
    LENGTHS: gl.constexpr = (MAX_LEN, MAX_LEN)
    MASK: gl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    SCORES: gl.constexpr = (ALPHA, TOKEN_SCALE, NUM_HEADS)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    arrays = (scale_ptr, dq_ptr, dscale_ptr, qk_layout)
    gl.warp_specialize([
        (consume_items, (gl.constexpr(_dq_consume), gl.constexpr(describe_query_block), pipe, schedule,
                         sequences, arrays, SHAPE, LENGTHS, MASK, SCORES, SCALE, TILES, 0)),
        (consume_items, (gl.constexpr(_dq_consume), gl.constexpr(describe_query_block), pipe, schedule,
                         sequences, arrays, SHAPE, LENGTHS, MASK, SCORES, SCALE, TILES, 1)),
        (produce_items, (gl.constexpr(_dq_produce), gl.constexpr(_dq_origins),
                         (q_desc, do_desc, k_desc, v_desc, pipe), schedule, sequences, (qk_layout, v_layout),
                         SHAPE, LENGTHS, MASK, TILES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dq_origins(sequences, item, blocks, layouts, SHAPE: gl.constexpr, LENGTHS: gl.constexpr,
                MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where query block `item` loads from in the descriptors' 2-D views (`produce_items`' `origins`):
    ((q_origin, do_origin), (k_origin, v_origin), num_key_blocks), the (row, column) of the block's first
    query in q's and do's views and of the first key of its range in k's and v's (layouts = (qk_layout,
    v_layout): do's and v's columns differ from q's and k's where V != D)."""
    qk_layout, v_layout = layouts
    _, head, start, _, start_m, key_first, _, num_key_blocks = describe_query_block(
        sequences, item, blocks, SHAPE[0], LENGTHS, MASK, BLOCK_M, BLOCK_N)
    qk_row, qk_col = tile_origin(start, head, qk_layout)
    v_row, v_col = tile_origin(start, head, v_layout)
    query_origins = ((qk_row + start_m, qk_col), (v_row + start_m, v_col))
    key_origins = ((qk_row + key_first, qk_col), (v_row + key_first, v_col))
    return query_origins, key_origins, num_key_blocks


@gluon.jit
def _dq_produce(buffers, query_origins, key_origins, num_key_blocks, t, qp, TILES: gl.constexpr):
    """The producer's work for one query block (`produce_items`' `produce`): both warpgroups' Q and dO
    tiles (once the consumers have freed the last block's, q_free's phase qp ^ 1), then K_j, V_j of its
    key range into the ring from its position t as slots free; origins from `_dq_origins`."""
    q_desc, do_desc, k_desc, v_desc, pipe = buffers
    q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, _ = pipe
    q_origin, do_origin = query_origins
    k_origin, v_origin = key_origins
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    for w in gl.static_range(2):
        mbarrier.wait(q_free.index(w), qp ^ 1)  # fresh barriers: phase 1 counts as complete
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [q_origin[0] + w * CONSUMER_ROWS, q_origin[1]], q_bar.index(w), q_smem.index(w))
        tma_load(do_desc, [do_origin[0] + w * CONSUMER_ROWS, do_origin[1]], q_bar.index(w), do_smem.index(w))
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        mbarrier.wait(empty.index(slot), (((t + j) // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [k_origin[0] + j * BLOCK_N, k_origin[1]], bar, k_smem.index(slot))
        tma_load(v_desc, [v_origin[0] + j * BLOCK_N, v_origin[1]], bar, v_smem.index(slot))


@gluon.jit
def _dq_consume(pipe, arrays, block, position, V: gl.constexpr, MASK: gl.constexpr, SCORES: gl.constexpr,
                SCALE: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one query block (`describe_query_block`'s tuple): dQ of queries
    start_m + 64 WG + [0, 64) over the key tiles of the block's range, as the producer loads them from
    ring position t (the query tiles' barrier at phase i & 1), stored (rows < L) at the end, times
    ALPHA s_i. Per tile U = Q K^T and dP = dO V^T, dU = m dP silu'(ALPHA U) (a select), dQ += dU K; with
    TOKEN_SCALE (SCORES = (ALPHA, TOKEN_SCALE, NUM_HEADS)) also ds_i += sum_j m silu(ALPHA U) dP, stored
    into dscale's column of this head. arrays = (scale_ptr, dq_ptr, dscale_ptr, qk_layout). position =
    (t, i, tails), tails the count of tail hand-overs (tail_bar's uses) so far; returns t and tails after
    the block."""
    q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar = pipe
    scale_ptr, dq_ptr, dscale_ptr, qk_layout = arrays
    _, head, start, rule, start_m, key_first, key_end, num_key_blocks = block
    t, i, tails = position
    ALPHA: gl.constexpr = SCORES[0]
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    D: gl.constexpr = q_smem.shape[2]

    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    dq_layout: gl.constexpr = wgmma_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    length = rule[0]
    row0 = start_m + WG * CONSUMER_ROWS
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    query_rows = gl.expand_dims(rows, 1)
    query_ids = gl.expand_dims(position_ids(rows, rule[1], MASK), 1)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    dq = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=dq_layout)
    dscale = gl.zeros([CONSUMER_ROWS], gl.float32, layout=row_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    # The block's last K tile runs past its key range: warpgroup 0 zeroes its rows there and hands it over.
    last_start = key_first + (num_key_blocks - 1) * BLOCK_N
    has_tail = key_end - last_start < BLOCK_N
    mbarrier.wait(q_bar.index(WG), i & 1)  # always: the load must land before the program may end
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        key_start = key_first + j * BLOCK_N
        mbarrier.wait(ready.index(slot), ((t + j) // STAGES) & 1)
        k = k_smem.index(slot)
        v = v_smem.index(slot)
        if (j == num_key_blocks - 1) & has_tail:
            # K rows past the range (other tokens, maybe NaN): zeroed before dU K reads them.
            hand_over_zeroed(k, key_end - key_start, tail_bar, tails & 1, BLOCK_N, WG)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        cols = key_start + gl.arange(0, BLOCK_N, layout=col_layout)
        seen = keep(query_rows, gl.expand_dims(cols, 0), query_ids,
                    gl.expand_dims(position_ids(cols, rule[1], MASK), 0), rule, MASK)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        value, slope = silu_and_grad(s * ALPHA)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        du = gl.where(seen, dp * slope, 0.0)
        du_op = gl.convert_layout(du.to(dtype), op_layout)
        dq_tok = warpgroup_mma(du_op, k, dq, is_async=True)
        if SCORES[1]:
            dscale += gl.sum(gl.where(seen, value * dp, 0.0), axis=1)
        dq, du_op = warpgroup_mma_wait(0, deps=(dq_tok, du_op))
        mbarrier.arrive(empty.index(slot), count=1)
    # This warpgroup's Q and dO tiles are free for the next block's (warpgroup 1 only now, past its wait
    # for the hand-over: the producer loads the next block's keys after both tiles, so warpgroup 0
    # cannot hand a next tail over, a second phase of tail_bar, before this one has seen the first).
    mbarrier.arrive(q_free.index(WG), count=1)

    # Epilogue: rows < L only (the fill programs write dq's others; dscale's are the launcher's zeros).
    if SCORES[1]:
        scale_rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, dq_layout))
        scales = gl.load(scale_ptr + start + scale_rows, mask=scale_rows < length, other=0.0)
        store_rows(dq_ptr, dq, gl.expand_dims(scales * ALPHA, 1), start, head, row0, length, qk_layout, D,
                   dq_layout)
        NUM_HEADS: gl.constexpr = SCORES[2]
        gl.store(dscale_ptr + (start + rows) * NUM_HEADS + head, dscale, mask=rows < length)
    else:
        store_rows(dq_ptr, dq, ALPHA * SCALE, start, head, row0, length, qk_layout, D, dq_layout)
    return t + num_key_blocks, tails + has_tail.to(gl.int32)
