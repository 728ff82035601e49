"""The Hopper forward: o and the log-sum-exp on a persistent grid, FlashAttention-3's structure. A 1-warp
producer loads each query block's two query tiles, then its band's key and value tiles into a STAGES-deep
ring that runs on from block to block; two consumer warpgroups (64 query rows each) run S_j = Q K_j^T while
P_{j-1} V_{j-1} is in flight, the softmax of S_j under it, and release each ring slot with one arrival
(the empty barriers count 2): no barrier across the consumers in the loop.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..shared import (
    INF,
    PARAM_BATCH,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
    key_ranges,
)
from .addressing import PARAM_BLOCKS, PARAM_FILL_CHUNK, stat_origin
from .fills import FILL_LSE, zero_fills
from .pipeline import (
    CONSUMER_ROWS,
    init_barriers,
    mbarriers,
    pass_slot,
    publish,
    tma_load,
    wgmma_layout,
    zero_rows,
)
from .scheduler import consumer_loop, item_ring, producer_loop
from .scores import alibi_slope, softmax_step


@gluon.jit
def attention_fwd_kernel(
    q_desc, k_desc, v_desc, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr, params_ptr,
    o_ptr, lse_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """o and the base-2 log-sum-exp, with the portable forward's semantics (see
    portable/forward.attention_fwd_kernel), on a persistent grid of one program per SM. Each program first
    does its share of the zero fills of o and the log-sum-exp (`zero_fills`), then takes blocks of
    BLOCK_M = 128 queries (two warpgroups') from the counter at counter_ptr until none is left, in one
    warp-specialized region. So every row of o (q's strides) and of the log-sum-exp [1, H, q_tokens] is
    written: no memset.

    q, k, v come as TMA descriptors over 2-D views (see addressing.py). Keys past the sequence are
    removed with a `where` on the scores, and the rows of the last value tile past the band's end are
    zeroed in shared memory before P V reads them (P is 0 there, but 0 * NaN is NaN).
    """
    batch = gl.load(params_ptr + PARAM_BATCH)
    q_tokens = gl.load(params_ptr + PARAM_Q_TOKENS)
    kv_tokens = gl.load(params_ptr + PARAM_KV_TOKENS)
    q_token_stride = gl.load(params_ptr + PARAM_Q_TOKEN_STRIDE) * STRIDE_ALIGN
    q_head_stride = gl.load(params_ptr + PARAM_Q_HEAD_STRIDE) * STRIDE_ALIGN
    blocks = gl.load(params_ptr + PARAM_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_FILL_CHUNK)
    q_layout = (q_tokens, q_token_stride, q_head_stride)
    zero_fills((o_ptr, lse_ptr), q_offsets_ptr, batch, blocks, fill_chunk, q_layout, NUM_HEADS, Q_MAX_LEN,
               (D, FILL_BLOCK, FILL_LSE))
    end = batch * NUM_HEADS * blocks

    pipe, ring = forward_pipe((q_desc, k_desc, v_desc), D, D, BLOCK_N, STAGES)
    schedule = (counter_ptr, end, blocks, ring, order_ptr if ORDERED else None)  # (`_take`)
    sequences = (q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens)
    SHAPE: gl.constexpr = (NUM_HEADS, KV_GROUP, D)
    LENGTHS: gl.constexpr = (Q_MAX_LEN, KV_MAX_LEN)
    BAND: gl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    SCORES: gl.constexpr = (SOFTCAP, ALIBI, QK_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    arrays = (slopes_ptr, o_ptr, lse_ptr, q_layout)
    # Two consumer warpgroups (the default partition and a 4-warp worker) and a 1-warp producer. A
    # function among a partition's arguments goes as a constexpr (triton 3.6 flattens them to IR). The
    # workers receive the scalars computed here through shared memory in the order of their arguments,
    # which the PTX follows: end, blocks, q_tokens, kv_tokens, then the strides.
    gl.warp_specialize([
        (consumer_loop, (gl.constexpr(_consume), pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND,
                         SCORES, OUT_SCALE, TILES, 0)),
        (consumer_loop, (gl.constexpr(_consume), pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND,
                         SCORES, OUT_SCALE, TILES, 1)),
        (producer_loop, (gl.constexpr(_produce), (q_desc, k_desc, v_desc, pipe), schedule, sequences,
                         q_layout, params_ptr, SHAPE, LENGTHS, BAND, TILES, STRIDE_ALIGN)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def forward_pipe(descriptors, D: gl.constexpr, V: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """The shared memory and barriers of a forward's warp-specialized region (this one's, HSTU's), set
    up once: (pipe, ring), pipe = (q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty,
    v_empty, tail_bar), the query tiles two warpgroups' [64, D], the ring STAGES tiles of BLOCK_N keys
    (k's of D, v's of V), and the item ring (`item_ring`). descriptors = (q_desc, k_desc, v_desc)."""
    q_desc, k_desc, v_desc = descriptors
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, V], v_desc.layout)
    q_bars = mbarriers(2)
    q_free = mbarriers(2)
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = mbarriers(STAGES)
    v_ready = mbarriers(STAGES)
    k_empty = mbarriers(STAGES)
    v_empty = mbarriers(STAGES)
    ring = item_ring()
    init_barriers((q_bars, q_free), (1, 1), 2)
    mbarrier.init(tail_bar, count=1)
    init_barriers((k_ready, v_ready, k_empty, v_empty), (1, 1, 2, 2), STAGES)  # one arrival per consumer
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before the first copy
    return (q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar), ring


@gluon.jit
def _produce(buffers, q_origin, kv_origin, num_key_blocks, t, qp, TILES: gl.constexpr):
    """The producer's work for one query block (`producer_loop`'s `produce`): `load_block`, k and v
    from one origin (kv_origin: the first key of the band)."""
    load_block(buffers, q_origin, kv_origin, kv_origin, num_key_blocks, t, qp, TILES)


@gluon.jit
def load_block(buffers, q_origin, k_origin, v_origin, num_key_blocks, t, qp, TILES: gl.constexpr):
    """Both query tiles of a block (once the consumers have freed the last block's, q_free's phase
    qp ^ 1), then K_j and V_j (j < num_key_blocks, from k_origin and v_origin: the first key block of
    the band in k's and v's views) into the ring from its position t as slots free."""
    q_desc, k_desc, v_desc, pipe = buffers
    q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, _ = pipe
    q_row, q_col = q_origin
    k_row, k_col = k_origin
    v_row, v_col = v_origin
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    for w in gl.static_range(2):
        mbarrier.wait(q_free.index(w), qp ^ 1)  # fresh barriers: phase 1 counts as complete
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bars.index(w), q_smem.index(w))
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        phase = ((t + j) // STAGES) & 1
        k_tile_row = k_row + j * BLOCK_N
        v_tile_row = v_row + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _issue_kv(k_desc, k_ready.index(slot), k_smem.index(slot), k_tile_row, k_col)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _issue_kv(v_desc, v_ready.index(slot), v_smem.index(slot), v_tile_row, v_col)


@gluon.jit
def _issue_kv(desc, bar, buf, row, col):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma_load(desc, [row, col], bar, buf)


@gluon.jit
def _own_tiles(row0, n_q, n_k, key_first, num_key_blocks, BLOCK_N: gl.constexpr, BAND: gl.constexpr):
    """[lo, hi) of the block's key tiles (from key_first) that some query of one consumer warpgroup's,
    [row0, +64), sees: its own band within the block's (`shared.key_ranges` over its rows), empty when
    its rows are all past n_q."""
    first, _, _, end = key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, BAND)
    lo = gl.minimum((first - key_first) // BLOCK_N, num_key_blocks)
    hi = gl.minimum(gl.maximum(gl.cdiv(end - key_first, BLOCK_N), lo), num_key_blocks)
    hi = gl.where(row0 < n_q, hi, lo)
    return lo, hi


@gluon.jit
def _pass_tiles(pipe, first, end, STAGES: gl.constexpr):
    """`pass_slot` of the key and value tiles [first, end) of the ring, in the producer's order."""
    _, _, _, _, _, k_ready, v_ready, k_empty, v_empty, _ = pipe
    for j in range(first, end):
        pass_slot(k_ready, k_empty, j, STAGES)
        pass_slot(v_ready, v_empty, j, STAGES)


@gluon.jit
def _consume(pipe, arrays, block, position, D: gl.constexpr, BAND: gl.constexpr, SCORES: gl.constexpr,
             OUT_SCALE: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one query block (`query_block`'s tuple): queries
    [start_m + 64 WG, +64) against the key blocks from key_first (a multiple of BLOCK_N) to key_end (the
    block's band, as the producer loads them from ring position t; the query tiles' barrier at phase qp),
    then their o and log-sum-exp (arrays = (slopes_ptr, o_ptr, lse_ptr, q_layout)). A key block is masked
    unless every query of this warpgroup sees every key of it. position = (t, i, tails), tails the count
    of tail-zeroing hand-overs (tail_bar's uses) so far; returns t and tails after the block."""
    q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar = pipe
    slopes_ptr, o_ptr, lse_ptr, q_layout = arrays
    q_tokens, q_token_stride, q_head_stride = q_layout
    _, head, q_start, n_q, _, n_k, start_m, key_first, key_end, num_key_blocks = block
    t, i, tails = position
    slope = alibi_slope(slopes_ptr, head, SCORES[1])
    qp = i & 1  # the phase of the query tiles' barriers
    QK_SCALE: gl.constexpr = SCORES[2]
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]

    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    shift = n_k - n_q
    row0 = start_m + WG * CONSUMER_ROWS
    q = q_smem.index(WG)
    # This warpgroup's clean key blocks (`shared.key_ranges` over its 64 rows).
    _, clean_start, clean_end, _ = key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, BAND)

    # The tiles each warpgroup computes, [lo, hi): under a window a warpgroup's band may start or end a
    # tile from the block's (more often with narrow bands' 64-key tiles), and under causal with key
    # tiles narrower than the block warpgroup 0's ends a tile before the diagonal block's last; it
    # passes the tiles outside, leaving the tensor cores to the other. Warpgroup 1 (the block's last
    # rows) always ends at the block's last tile, which warpgroup 0 computes too unless it ends before.
    # (Elsewhere the code is that of every tile computed by both: no warpgroup's band ends a tile early.)
    OWN_TILES: gl.constexpr = BAND[1] >= 0 or BAND[2] >= 0 or (BAND[0] and BLOCK_N < TILES[0])
    if OWN_TILES:
        lo, hi = _own_tiles(row0, n_q, n_k, key_first, num_key_blocks, BLOCK_N, BAND)
        if WG == 0:  # warpgroup 0's range: its own
            lo0 = lo
            hi0 = hi
        else:
            lo0, hi0 = _own_tiles(start_m, n_q, n_k, key_first, num_key_blocks, BLOCK_N, BAND)
    else:
        lo = 0
        hi = num_key_blocks
        lo0 = 0
        hi0 = num_key_blocks
    # The block's last value tile: its rows past the band's keys (past the sequence's maybe: other
    # tokens, NaN) are zeroed first, by warpgroup 0 when it computes that tile (it hands the tile over
    # on tail_bar, and warpgroup 1 then waits for it, whether it computes the tile or not, so that
    # both count the barrier's uses alike), else by warpgroup 1 when it does.
    tail = key_end - (key_first + (num_key_blocks - 1) * BLOCK_N)
    handed_over = (hi0 == num_key_blocks) & (hi0 > lo0) & (tail < BLOCK_N)

    m_i = gl.full([CONSUMER_ROWS], -INF, gl.float32, layout=row_layout)
    l_i = gl.full([CONSUMER_ROWS], 0.0, gl.float32, layout=row_layout)
    acc = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bars.index(WG), qp)  # always: the load must land before the program may end
    if OWN_TILES:
        _pass_tiles(pipe, t, t + lo, STAGES)
    if hi > lo:
        # S_lo alone; then S_j with P_{j-1} V_{j-1} in flight; then the last P V.
        ks = (t + lo) % STAGES
        key_start = key_first + lo * BLOCK_N
        mbarrier.wait(k_ready.index(ks), ((t + lo) // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, key_start, n_k, (row0, shift, slope),
                                          (key_start < clean_start) | (key_start >= clean_end), BAND, SCORES,
                                          BLOCK_N, s_layout)
        for j in range(lo + 1, hi):
            ks = (t + j) % STAGES
            vs = (t + j - 1) % STAGES
            key_start = key_first + j * BLOCK_N
            mbarrier.wait(k_ready.index(ks), ((t + j) // STAGES) & 1)
            mbarrier.wait(v_ready.index(vs), ((t + j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(ks), count=1)
            p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, key_start, n_k, (row0, shift, slope),
                                              (key_start < clean_start) | (key_start >= clean_end), BAND,
                                              SCORES, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
            mbarrier.arrive(v_empty.index(vs), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if WG == 0:
            mbarrier.arrive(q_free.index(0), count=1)  # the query tile's last product is done
        last = hi - 1
        vs = (t + last) % STAGES
        mbarrier.wait(v_ready.index(vs), ((t + last) // STAGES) & 1)
        if (hi == num_key_blocks) & (tail < BLOCK_N):
            if WG == 0:
                zero_rows(v_smem.index(vs), tail, BLOCK_N)
                publish()
                mbarrier.arrive(tail_bar, count=1)
            elif handed_over:
                mbarrier.wait(tail_bar, tails & 1)
            else:
                zero_rows(v_smem.index(vs), tail, BLOCK_N)
                publish()
        if WG == 1:
            if hi == num_key_blocks:  # (see below)
                mbarrier.arrive(q_free.index(1), count=1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(vs), acc)
        mbarrier.arrive(v_empty.index(vs), count=1)  # the slot's next use (the ring goes on)
    elif WG == 0:
        mbarrier.arrive(q_free.index(0), count=1)
    if OWN_TILES:
        _pass_tiles(pipe, t + hi, t + num_key_blocks, STAGES)
    # Warpgroup 1 frees its query tile only once it is past its wait for a hand-over (above, or here
    # when it did not compute the last tile, after its passes, which warpgroup 0 may need): the producer
    # loads the next block's query tiles before its keys, so warpgroup 0 cannot hand a next tile over,
    # a second phase of tail_bar, before this one has seen the first.
    if WG == 1:
        if (hi <= lo) | (hi < num_key_blocks):
            if handed_over:
                mbarrier.wait(tail_bar, tails & 1)
            mbarrier.arrive(q_free.index(1), count=1)

    # Epilogue: rows < n_q only (the fill programs write the others).
    attended = l_i != 0  # false only for queries with no key; a NaN sum (a NaN input) is true
    o_factor = gl.where(attended, OUT_SCALE / gl.where(attended, l_i, 1.0), 0.0)
    o = acc * gl.expand_dims(gl.convert_layout(o_factor, gl.SliceLayout(1, o_layout)), 1)
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o_rows = (q_start + rows).to(gl.int64) * q_token_stride + head.to(gl.int64) * q_head_stride
    o_ptrs = o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(rows < n_q, 1))
    # In units of the unscaled scores: sum_j exp2((s_j - lse) * QK_SCALE) = 1.
    lse = gl.where(attended, m_i + gl.log2(l_i) * (1.0 / QK_SCALE), INF)
    lse_rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    lse_ptrs = lse_ptr + stat_origin(q_start, head, q_tokens) + lse_rows
    gl.store(lse_ptrs, lse, mask=lse_rows < n_q)
    tails = tails + handed_over.to(gl.int32)
    return t + num_key_blocks, tails
