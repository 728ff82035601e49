"""HSTU attention's Hopper forward: o of each query block on the softmax forward's persistent grid and
pipeline (forward.py's structure, scheduler.py's loops, pipeline.py's ring), with HSTU's pointwise score in
the place of the online softmax: each key tile's weights silu(ALPHA q.k) under HSTU's mask are final once
computed, so there is no running max, no rescale of the accumulator and no log-sum-exp. The semantics,
the mask and the key blocks a query block visits are shared_hstu.py's (portable/hstu.py's forward is the
reference this one mirrors).

A 1-warp producer loads each query block's two query tiles, then the key and value tiles of its key
range (`shared_hstu.key_range`) into a STAGES-deep ring; two consumer warpgroups (64 query rows each)
run S_j = Q K_j^T while P_{j-1} V_{j-1} is in flight, the weights of S_j under it. Both warpgroups
visit every tile of the block's range (the softmax forward's per-warpgroup ranges under a window are
not taken here: a window's tiles past one warpgroup's rows are computed and masked).
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
    key_range,
    position_ids,
    sequence_rule,
    silu,
)
from ..spec import HOPPER_HSTU_FWD
from .addressing import store_rows, tile_origin
from .fills import FILL_NONE, zero_fills
from .forward import forward_pipe, load_block
from .pipeline import (
    CONSUMER_ROWS,
    hand_over_zeroed,
    wgmma_layout,
)
from .scheduler import consume_items, item_position, produce_items

# The slot of the query blocks of each (sequence, head) (kernels/spec.py's HOPPER_HSTU_PARAMS).
PARAM_HSTU_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_HSTU_FWD.slot("blocks"))


@gluon.jit
def hstu_fwd_kernel(
    q_desc, k_desc, v_desc, offsets_ptr, num_targets_ptr, order_ptr, scale_ptr, params_ptr,
    o_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, D: gl.constexpr, V: gl.constexpr, MAX_LEN: gl.constexpr, ALPHA: gl.constexpr,
    SCALE: gl.constexpr, TOKEN_SCALE: gl.constexpr, CAUSAL: gl.constexpr, MAX_ATTN_LEN: gl.constexpr,
    CONTEXT_LEN: gl.constexpr, MIN_FULL_LEN: gl.constexpr, HAS_TARGETS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """o_i = s_i sum_j mask_ij silu(ALPHA q_i . k_j) v_j, with the portable forward's semantics (see
    portable/hstu.hstu_fwd_kernel), on a persistent grid of one program per SM, for one offsets segment
    (offsets [1, B+1], num_targets [1, B] with HAS_TARGETS). Each program first does its share of the
    zero fills of o (`zero_fills`: each sequence's tokens past MAX_LEN and the tokens no sequence
    covers), then takes blocks of BLOCK_M = 128 queries (two warpgroups') of a (sequence, head) from
    the counter at counter_ptr until none is left, in one warp-specialized region: every row of o is
    written, no memset. s_i is SCALE, or with TOKEN_SCALE the float32 operand scale[token].

    q, k (of D) and v (of V) come as TMA descriptors over 2-D views (addressing.py), q's tile one
    warpgroup's 64 rows, k's and v's BLOCK_N keys. Keys and queries past the sequence are removed by
    the mask (`shared_hstu.keep`, a `where` on the weights), and the rows of the last value tile past
    the block's key range are zeroed in shared memory before P V reads them (P is 0 there, but 0 * NaN
    is NaN).
    """
    batch = gl.load(params_ptr + PARAM_HSTU_BATCH)
    tokens = gl.load(params_ptr + PARAM_HSTU_TOKENS)
    qk_layout = (tokens, gl.load(params_ptr + PARAM_HSTU_QK_TOKEN_STRIDE) * STRIDE_ALIGN,
                 gl.load(params_ptr + PARAM_HSTU_QK_HEAD_STRIDE) * STRIDE_ALIGN)
    v_layout = (tokens, gl.load(params_ptr + PARAM_HSTU_V_TOKEN_STRIDE) * STRIDE_ALIGN,
                gl.load(params_ptr + PARAM_HSTU_V_HEAD_STRIDE) * STRIDE_ALIGN)
    blocks = gl.load(params_ptr + PARAM_HSTU_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_HSTU_FILL_CHUNK)
    zero_fills((o_ptr, o_ptr), offsets_ptr, batch, blocks, fill_chunk, v_layout, NUM_HEADS, MAX_LEN,
               (V, FILL_BLOCK, FILL_NONE))
    end = batch * NUM_HEADS * blocks

    pipe, ring = forward_pipe((q_desc, k_desc, v_desc), D, V, BLOCK_N, STAGES)  # forward.py's
    schedule = (counter_ptr, end, blocks, ring, order_ptr if ORDERED else None)  # (`_take`)
    # The scheduler's bundles, HSTU's way: the queries' offsets and tokens first (what `fetch` reads),
    # num_targets in the place of the keys' offsets; SHAPE = (NUM_HEADS, D, V), the last the output's
    # width; LENGTHS the queries' and the keys' MAX_LEN; MASK in the place of the band.
    sequences = (offsets_ptr, num_targets_ptr, tokens, tokens)
    SHAPE: gl.constexpr = (NUM_HEADS, D, V)
    LENGTHS: gl.constexpr = (MAX_LEN, MAX_LEN)
    MASK: gl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    SCORES: gl.constexpr = (ALPHA, TOKEN_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    arrays = (scale_ptr, o_ptr, v_layout)
    # Two consumer warpgroups (the default partition and a 4-warp worker) and a 1-warp producer, as the
    # softmax forward's (functions among a partition's arguments go as constexprs).
    gl.warp_specialize([
        (consume_items, (gl.constexpr(_consume), gl.constexpr(describe_query_block), pipe, schedule,
                         sequences, arrays, SHAPE, LENGTHS, MASK, SCORES, SCALE, TILES, 0)),
        (consume_items, (gl.constexpr(_consume), gl.constexpr(describe_query_block), pipe, schedule,
                         sequences, arrays, SHAPE, LENGTHS, MASK, SCORES, SCALE, TILES, 1)),
        (produce_items, (gl.constexpr(_produce), gl.constexpr(_origins), (q_desc, k_desc, v_desc, pipe),
                         schedule, sequences, (qk_layout, v_layout), SHAPE, LENGTHS, MASK, TILES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def describe_query_block(sequences, item, blocks, NUM_HEADS: gl.constexpr, LENGTHS: gl.constexpr,
                         MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query block `item` (the last of each (sequence, head) first; `consume_items`' `describe`):
    (sequence, head, start, rule, start_m, key_first, key_end, num_key_blocks), start the sequence's
    first token, rule `shared_hstu.sequence_rule`'s, and the keys [key_first, key_end) that some query of
    the block may see (`shared_hstu.key_range`, key_first a multiple of BLOCK_N), which the producer
    loads and both consumers visit, in blocks of BLOCK_N. `fetch` hands out only blocks with queries
    (start_m < L), whose range holds at least their own diagonal: num_key_blocks >= 1."""
    offsets_ptr, num_targets_ptr, tokens, _ = sequences
    sequence, head, start_m = item_position(item, blocks, NUM_HEADS, BLOCK_M, LAST_FIRST=True)
    start, rule = sequence_rule(offsets_ptr, num_targets_ptr, sequence, tokens, LENGTHS[0], MASK)
    key_first, key_end = key_range(start_m, rule, BLOCK_M, BLOCK_N, MASK)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    return sequence, head, start, rule, start_m, key_first, key_end, num_key_blocks


@gluon.jit
def _origins(sequences, item, blocks, layouts, SHAPE: gl.constexpr, LENGTHS: gl.constexpr,
             MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where query block `item` loads from in the descriptors' 2-D views (`produce_items`' `origins`):
    (q_origin, (k_origin, v_origin), num_key_blocks), the (row, column) of the block's first query and
    of the first key of its range in k's and in v's views (layouts = (qk_layout, v_layout): v's columns
    differ from k's where V != D)."""
    qk_layout, v_layout = layouts
    _, head, start, _, start_m, key_first, _, num_key_blocks = describe_query_block(
        sequences, item, blocks, SHAPE[0], LENGTHS, MASK, BLOCK_M, BLOCK_N)
    qk_row, qk_col = tile_origin(start, head, qk_layout)
    v_row, v_col = tile_origin(start, head, v_layout)
    kv_origin = ((qk_row + key_first, qk_col), (v_row + key_first, v_col))
    return (qk_row + start_m, qk_col), kv_origin, num_key_blocks


@gluon.jit
def _produce(buffers, q_origin, kv_origin, num_key_blocks, t, qp, TILES: gl.constexpr):
    """The producer's work for one query block (`produce_items`' `produce`): forward.py's `load_block`,
    k and v each from its own origin."""
    k_origin, v_origin = kv_origin
    load_block(buffers, q_origin, k_origin, v_origin, num_key_blocks, t, qp, TILES)


@gluon.jit
def _weights(s, key_start, queries, rule, MASK: gl.constexpr, ALPHA: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr):
    """The weights of a [64, BLOCK_N] tile of q.k (keys [key_start, +BLOCK_N)): silu(ALPHA q.k) where
    `shared_hstu.keep` sees the pair, else 0 (also where q.k is not finite: tokens outside the
    sequence). queries = (rows, ids), the warpgroup's query positions and ids as [64, 1] columns."""
    query_rows, query_ids = queries
    cols = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    key_ids = position_ids(cols, rule[1], MASK)
    seen = keep(query_rows, gl.expand_dims(cols, 0), query_ids, gl.expand_dims(key_ids, 0), rule, MASK)
    return gl.where(seen, silu(s * ALPHA), 0.0)


@gluon.jit
def _consume(pipe, arrays, block, position, V: gl.constexpr, MASK: gl.constexpr, SCORES: gl.constexpr,
             SCALE: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one query block (`describe_query_block`'s tuple): queries
    [start_m + 64 WG, +64) against the key tiles of the block's range, as the producer loads them from
    ring position t (the query tiles' barrier at phase i & 1), then their o (arrays = (scale_ptr, o_ptr,
    v_layout); SCORES = (ALPHA, TOKEN_SCALE)). position = (t, i, tails), tails the count of
    tail-zeroing hand-overs (tail_bar's uses) so far; returns t and tails after the block.

    The block's last value tile, where the range ends inside it, has its rows past the range (other
    tokens, maybe NaN) zeroed by warpgroup 0, which hands it over on tail_bar; warpgroup 1 frees its
    query tile only after that wait, so that warpgroup 0 cannot hand over a next block's tile (a second
    phase of tail_bar) before warpgroup 1 has seen this one (the producer loads a block's query tiles
    before its keys)."""
    q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar = pipe
    scale_ptr, o_ptr, v_layout = arrays
    _, head, start, rule, start_m, key_first, key_end, num_key_blocks = block
    t, i, tails = position
    ALPHA: gl.constexpr = SCORES[0]
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]

    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(V)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    row0 = start_m + WG * CONSUMER_ROWS
    q = q_smem.index(WG)
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, s_layout))
    queries = (gl.expand_dims(rows, 1), gl.expand_dims(position_ids(rows, rule[1], MASK), 1))
    tail = key_end - (key_first + (num_key_blocks - 1) * BLOCK_N)

    acc = gl.zeros([CONSUMER_ROWS, V], gl.float32, layout=o_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bars.index(WG), i & 1)
    # S_0 alone; then S_j with P_{j-1} V_{j-1} in flight; then the last P V.
    ks = t % STAGES
    mbarrier.wait(k_ready.index(ks), (t // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(ks), count=1)
    p = _weights(s, key_first, queries, rule, MASK, ALPHA, BLOCK_N, s_layout)
    for j in range(1, num_key_blocks):
        ks = (t + j) % STAGES
        vs = (t + j - 1) % STAGES
        mbarrier.wait(k_ready.index(ks), ((t + j) // STAGES) & 1)
        mbarrier.wait(v_ready.index(vs), ((t + j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        p = _weights(s, key_first + j * BLOCK_N, queries, rule, MASK, ALPHA, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        mbarrier.arrive(v_empty.index(vs), count=1)
    if WG == 0:
        mbarrier.arrive(q_free.index(0), count=1)  # the query tile's last product is done
    vs = (t + num_key_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(vs), ((t + num_key_blocks - 1) // STAGES) & 1)
    handed_over = tail < BLOCK_N
    if handed_over:
        hand_over_zeroed(v_smem.index(vs), tail, tail_bar, tails & 1, BLOCK_N, WG)
    if WG == 1:
        mbarrier.arrive(q_free.index(1), count=1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(vs), acc)
    mbarrier.arrive(v_empty.index(vs), count=1)  # the slot's next use (the ring goes on)

    # Epilogue: rows < L only (the fill programs write the others); s_i once per row, here.
    length = rule[0]
    if SCORES[1]:
        scale_rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, o_layout))
        scales = gl.load(scale_ptr + start + scale_rows, mask=scale_rows < length, other=0.0)
        store_rows(o_ptr, acc, gl.expand_dims(scales, 1), start, head, row0, length, v_layout, V, o_layout)
    else:
        store_rows(o_ptr, acc, SCALE, start, head, row0, length, v_layout, V, o_layout)
    return t + num_key_blocks, tails + handed_over.to(gl.int32)
