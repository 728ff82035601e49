"""The Hopper dk/dv kernel: persistent as the forward, on blocks of 128 keys of one (sequence, kv head)
handed out by the scheduler, the first of each first (the costliest under causal). Per block a 1-warp
producer loads K and V (two halves of 64 rows, once both consumers are done with the last block's), then
streams the Q and dO tiles of BLOCK_M queries that see a key of the block (of each query head of the group
in turn; `shared.query_ranges` bounds them, so the cost grows with a window, not with n_q), each with its
log-sum-exp and delta, into a STAGES-deep ring that runs on from block to block. Two consumer warpgroups
own 64 key rows each, dK and dV in float32 registers: per tile S^T = K Q^T and dP^T = V dO^T, P^T (masked
at the band's edges and the sequence's last tile), dV += P^T dO, dS^T = P^T S'^T (dP^T - delta),
dK += dS^T Q. A block that no query sees is a block too: its rows < n_k are stored as zeros.

At D = 256 (SPLIT_D: the table's BLOCK_N = 64) dK and dV of 64 keys x 256 in float32 would need a consumer
thread's 256 registers, so a block is 64 keys, both warpgroups': each computes S^T and dP^T of half of
the query tile (64 keys x BLOCK_M / 2 queries, over all of D), writes its P^T and dS^T to shared memory,
and accumulates dV and dK of its half of D's columns over the whole tile (`_split_products`), as
FlashAttention-3 splits head dimension 256.

`attention_bwd_dkdv_dq_kernel` is the same program with dq fused in (FUSED_DQ), as FlashAttention-2 and 3
do: five products per tile instead of the dk/dv and dq kernels' seven, dq accumulated in float32 by
atomic adds (so not deterministic). dS^T goes to shared memory, where dK's product and the tile's dQ^T =
K^T dS^T over the block's 128 keys read it; each warpgroup adds 64 columns of dQ (at D = 64 one
warpgroup the whole tile, in turn), never holding a third accumulator of D columns beside dK and dV.
`attention_bwd_dkdv_dq_tma_kernel` adds them as FlashAttention-3 does, by an asynchronous TMA reduce-add
of the whole tile from shared memory (Gluon's tma.async_atomic_add, triton >= 3.7) into an accumulator
padded per sequence, where `attention_bwd_dkdv_dq_kernel` adds them from registers by relaxed vector
atomics, masked.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..shared import PARAM_BATCH, band, probability, query_ranges, scaled_down
from .addressing import (
    PARAM_BLOCKS,
    PARAM_FILL_CHUNK,
    STAGE_LAYOUT,
    add_columns,
    read_layout,
    reduce_columns,
    row_base,
    stat_origin,
    store_rows,
    tile_origin,
)
from .fills import FILL_ROWS, zero_fills
from .pipeline import (
    CONSUMER_ROWS,
    init_barriers,
    mbarriers,
    partition_barrier,
    publish,
    tma_load,
    wgmma_layout,
    zero_rows,
    zero_tail_tile,
)
from .scheduler import dkdv_barriers, fetch, hand_out, item_position, key_block, receive
from .scores import alibi_slope, capped_biased

# The dq-fused program's ways of adding a tile's dQ into dq_acc (its FUSED_DQ; 0: dq is not fused).
DQ_ATOMIC_ADDS: gl.constexpr = gl.constexpr(1)  # relaxed vector atomics from registers, masked
DQ_TMA_REDUCE: gl.constexpr = gl.constexpr(2)  # a TMA reduce-add of the tile from shared memory


@gluon.jit
def attention_bwd_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr,
    params_ptr, dk_ptr, dv_ptr, counter_ptr,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    STRIDE_ALIGN: gl.constexpr, FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, ORDERED: gl.constexpr,
):
    """dv = OUT_SCALE * P^T do and dk = DS_SCALE * dS^T q, with the portable backward's semantics (see
    portable/backward.attention_bwd_kernel), on a persistent grid of one program per SM as dq's: each
    program first does its share of the zero fills of dk and dv, then takes blocks of BLOCK_N = 128 keys
    (two warpgroups', 64 each; or of 64 keys whose columns they split, SPLIT_D) from the counter at
    counter_ptr until none is left. Every element of dk, dv (k's strides) is written, by one warpgroup:
    deterministic."""
    SHAPE: gl.constexpr = (NUM_KV_HEADS, KV_GROUP, D)
    LENGTHS: gl.constexpr = (Q_MAX_LEN, KV_MAX_LEN)
    BAND: gl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    SCORES: gl.constexpr = (SOFTCAP, ALIBI, QK_SCALE)
    SCALES: gl.constexpr = (DS_SCALE, OUT_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    BUILD: gl.constexpr = (STRIDE_ALIGN, FILL_BLOCK, CONSUMER_REGS, PRODUCER_REGS)
    _dkdv_program((q_desc, do_desc, k_desc, v_desc),
                  (lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr if ORDERED else None,
                   slopes_ptr, params_ptr),
                  (dk_ptr, dv_ptr, None, counter_ptr), SHAPE, LENGTHS, BAND, SCORES, SCALES, TILES,
                  BUILD, FUSED_DQ=0)


@gluon.jit
def attention_bwd_dkdv_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr,
    params_ptr, dk_ptr, dv_ptr, dq_acc_ptr, counter_ptr,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    STRIDE_ALIGN: gl.constexpr, FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, ORDERED: gl.constexpr,
):
    """`attention_bwd_dkdv_kernel` with dq fused in (FUSED_DQ): each consumer warpgroup also forms
    DS_SCALE * dS k for each query tile it visits and adds it into dq_acc (float32, q's shape and
    strides, zeroed by the launcher) by atomic adds, the rows past n_q masked. Five products per tile
    instead of the two kernels' seven; not deterministic (the order of the adds). The launcher casts
    dq_acc to q's dtype: rows no key block adds to (no key, or no sequence) stay 0."""
    SHAPE: gl.constexpr = (NUM_KV_HEADS, KV_GROUP, D)
    LENGTHS: gl.constexpr = (Q_MAX_LEN, KV_MAX_LEN)
    BAND: gl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    SCORES: gl.constexpr = (SOFTCAP, ALIBI, QK_SCALE)
    SCALES: gl.constexpr = (DS_SCALE, OUT_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    BUILD: gl.constexpr = (STRIDE_ALIGN, FILL_BLOCK, CONSUMER_REGS, PRODUCER_REGS)
    _dkdv_program((q_desc, do_desc, k_desc, v_desc),
                  (lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr if ORDERED else None,
                   slopes_ptr, params_ptr),
                  (dk_ptr, dv_ptr, (dq_acc_ptr, None), counter_ptr), SHAPE, LENGTHS, BAND, SCORES, SCALES,
                  TILES, BUILD, FUSED_DQ=DQ_ATOMIC_ADDS)


@gluon.jit
def attention_bwd_dkdv_dq_tma_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr,
    dq_acc_desc, dq_rows_ptr, params_ptr, dk_ptr, dv_ptr, counter_ptr,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    STRIDE_ALIGN: gl.constexpr, FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, ORDERED: gl.constexpr,
):
    """`attention_bwd_dkdv_dq_kernel` with each warpgroup's dQ tile added whole by a TMA reduce-add from
    shared memory (triton >= 3.7): dq_acc_desc a descriptor of [BLOCK_M, 64] float32 blocks over dq_acc,
    float32 [q_tokens + batch * BLOCK_M, H * D] zeroed by the launcher and updated in place, in which
    sequence b's queries start at row dq_rows_ptr[b] (int32, the launcher's `calls.dq_rows`: its start
    plus BLOCK_M per sequence ordered before it by (start, length)), so that a last tile's rows past n_q
    (0, or NaN where the sequence has an inf key) land in rows of its own, as FlashAttention-3 pads its
    varlen dq accumulator, whatever order the offsets put the sequences in; the launcher gathers each
    sequence's first n_q rows (`calls.unpad_dq`). Not deterministic."""
    SHAPE: gl.constexpr = (NUM_KV_HEADS, KV_GROUP, D)
    LENGTHS: gl.constexpr = (Q_MAX_LEN, KV_MAX_LEN)
    BAND: gl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    SCORES: gl.constexpr = (SOFTCAP, ALIBI, QK_SCALE)
    SCALES: gl.constexpr = (DS_SCALE, OUT_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    BUILD: gl.constexpr = (STRIDE_ALIGN, FILL_BLOCK, CONSUMER_REGS, PRODUCER_REGS)
    _dkdv_program((q_desc, do_desc, k_desc, v_desc),
                  (lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr if ORDERED else None,
                   slopes_ptr, params_ptr),
                  (dk_ptr, dv_ptr, (dq_acc_desc, dq_rows_ptr), counter_ptr), SHAPE, LENGTHS, BAND, SCORES,
                  SCALES, TILES, BUILD, FUSED_DQ=DQ_TMA_REDUCE)


@gluon.jit
def _dkdv_program(descs, inputs, outputs, SHAPE: gl.constexpr, LENGTHS: gl.constexpr, BAND: gl.constexpr,
                  SCORES: gl.constexpr, SCALES: gl.constexpr, TILES: gl.constexpr, BUILD: gl.constexpr,
                  FUSED_DQ: gl.constexpr):
    """Any entry's program: the zero fills of dk and dv, then the warp-specialized region. descs =
    (q_desc, do_desc, k_desc, v_desc); inputs = (lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr,
    slopes_ptr, params_ptr); outputs = (dk_ptr, dv_ptr, dq, counter_ptr), dq None unless FUSED_DQ, else
    (dq_acc, dq_rows) (DQ_ATOMIC_ADDS: a pointer and None; DQ_TMA_REDUCE: a descriptor and the pointer to
    each sequence's first row in it); BUILD = (STRIDE_ALIGN, FILL_BLOCK,
    CONSUMER_REGS, PRODUCER_REGS). Without FUSED_DQ nothing of dq's reaches the partitions (None is a
    constant, which they do not capture), so the unfused kernel compiles as if the option did not
    exist."""
    q_desc, do_desc, k_desc, v_desc = descs
    lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr, params_ptr = inputs
    dk_ptr, dv_ptr, dq, counter_ptr = outputs
    NUM_KV_HEADS: gl.constexpr = SHAPE[0]
    D: gl.constexpr = SHAPE[2]
    BLOCK_M: gl.constexpr = TILES[0]
    STAGES: gl.constexpr = TILES[2]
    STRIDE_ALIGN: gl.constexpr = BUILD[0]
    batch = gl.load(params_ptr + PARAM_BATCH)
    kv_layout = read_layout(params_ptr, KEYS=True, ALIGN=STRIDE_ALIGN)
    kv_tokens, _, _ = kv_layout
    blocks = gl.load(params_ptr + PARAM_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_FILL_CHUNK)
    zero_fills((dk_ptr, dv_ptr), kv_offsets_ptr, batch, blocks, fill_chunk, kv_layout, NUM_KV_HEADS,
               LENGTHS[1], (D, BUILD[1], FILL_ROWS))
    end = batch * NUM_KV_HEADS * blocks
    q_layout = read_layout(params_ptr, KEYS=False, ALIGN=STRIDE_ALIGN)
    q_tokens, _, _ = q_layout

    # The shared memory and barriers of the warp-specialized region, set up once.
    dtype: gl.constexpr = q_desc.dtype
    # The block's tiles of 64 keys: two (one per consumer), or under SPLIT_D one that both consumers read.
    KEY_TILES: gl.constexpr = TILES[1] // CONSUMER_ROWS
    gl.static_assert(FUSED_DQ == 0 or KEY_TILES == 2, "dq is fused into blocks of 128 keys only")
    if FUSED_DQ:  # K as one [BLOCK_N, D] tile: the consumers' halves (`_key_half`), and dQ's A operand
        k_smem = gl.allocate_shared_memory(dtype, [1, TILES[1], D], k_desc.layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [KEY_TILES, CONSUMER_ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KEY_TILES, CONSUMER_ROWS, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], do_desc.layout)
    stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    # ready: the TMA loads' expect and the statistics' arrival.
    barriers, ring = dkdv_barriers(2, STAGES)
    kv_bar, kv_free, ready, empty, tail_bar = barriers

    pipe = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_free, ready, empty, tail_bar)
    schedule = (counter_ptr, end, blocks, ring, order_ptr)
    sequences = (q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens)
    if FUSED_DQ:
        # dS^T of each ring slot's query tile, [BLOCK_N keys, BLOCK_M], each consumer writing its 64 keys'
        # rows, both consumers' dQ products reading all (`_dq_tile`); ds_full[s] counts both written.
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILES[1], BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [STAGES, TILES[1], BLOCK_M], ds_layout)
        ds_full = mbarriers(STAGES)
        init_barriers((ds_full, ), (2, ), STAGES)
        fence_async_shared()
        if FUSED_DQ == DQ_TMA_REDUCE:
            # Each consumer's [BLOCK_M, 64] float32 tile of dQ for its TMA reduce-add (`reduce_columns`).
            stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, CONSUMER_ROWS], dq[0].layout)
        else:
            # Each consumer's [64, BLOCK_M] float32 of dQ^T on its way to the atomic adds (`add_columns`).
            stage = gl.allocate_shared_memory(gl.float32, [2, CONSUMER_ROWS, BLOCK_M], STAGE_LAYOUT)
        arrays = (slopes_ptr, dk_ptr, dv_ptr, kv_layout, (dq[0], q_layout, ds_smem, ds_full, stage, dq[1]))
    elif KEY_TILES == 1:
        # SPLIT_D: P^T and dS^T of the current query tile, [64 keys, BLOCK_M / 2] per consumer (its half
        # of the queries): P^T of halves 0 and 1, then dS^T of both. Both consumers' dV and dK products
        # read all four (`_split_products`). One set, not one per ring slot (at D = 256 shared memory
        # holds no second): pds_bars[0] counts both consumers' tiles written, pds_bars[1] both done
        # reading them.
        half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS, BLOCK_M // 2], dtype)
        pds_smem = gl.allocate_shared_memory(dtype, [4, CONSUMER_ROWS, BLOCK_M // 2], half_layout)
        pds_bars = mbarriers(2)
        init_barriers((pds_bars, ), (2, ), 2)
        fence_async_shared()
        arrays = (slopes_ptr, dk_ptr, dv_ptr, kv_layout, (pds_smem, pds_bars))
    else:
        arrays = (slopes_ptr, dk_ptr, dv_ptr, kv_layout, None)
    # The forward's partitions, their computed scalars in the same order (see forward.py).
    gl.warp_specialize([
        (_dkdv_consumer_loop, (pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND, SCORES, SCALES, TILES,
                               0, FUSED_DQ)),
        (_dkdv_consumer_loop, (pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND, SCORES, SCALES, TILES,
                               1, FUSED_DQ)),
        (_dkdv_producer_loop, ((q_desc, do_desc, k_desc, v_desc, pipe), (lse_ptr, delta_ptr), schedule,
                               sequences, (q_layout, kv_layout), SHAPE, LENGTHS, BAND, SCORES, TILES)),
    ], [4, 1], [BUILD[2], BUILD[3]])


@gluon.jit
def _key_half(k_smem, w):
    """The block's keys [64 w, +64) in k_smem: [2, 64, D] halves (under SPLIT_D [1, 64, D]), or with
    fused dq one [1, BLOCK_N, D] tile, which dQ's product reads whole. (A view of a tile is taken from an
    index of the allocation, never of the allocation itself: Triton 3.6's wgmma pipelining walks a
    product's operand up its views and never ends at a worker partition's argument.)"""
    if k_smem.shape[1] == CONSUMER_ROWS:
        half = k_smem.index(w)
    else:
        half = k_smem.index(0).slice(w * CONSUMER_ROWS, CONSUMER_ROWS, dim=0)
    return half


@gluon.jit
def _query_tiles(key0, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BAND: gl.constexpr):
    """(first, end) query tiles of BLOCK_M that a block of keys [key0, +BLOCK_N) visits, end >= first:
    those holding the queries that see some of its keys (under causal from the first tile with a query
    i + n_k - n_q >= key0; a window bounds them on both sides, `shared.query_ranges`)."""
    if BAND[1] >= 0 or BAND[2] >= 0:
        start, _, _, end = query_ranges(key0, n_q, n_k, BLOCK_M, BLOCK_N, BAND)
        first = start // BLOCK_M
        return first, gl.maximum(gl.cdiv(end, BLOCK_M), first)
    end = gl.cdiv(n_q, BLOCK_M)
    if BAND[0]:
        first = gl.minimum(gl.maximum(key0 - (n_k - n_q), 0) // BLOCK_M, end)
    else:
        first = end * 0
    return first, end


@gluon.jit
def _dkdv_producer_loop(buffers, stats, schedule, sequences, layouts, SHAPE: gl.constexpr,
                        LENGTHS: gl.constexpr, BAND: gl.constexpr, SCORES: gl.constexpr, TILES: gl.constexpr):
    """The load partition: the key blocks with keys that `fetch` takes from the counter (those with no
    query are blocks too: their dk, dv are zeros), each handed out to the consumers and then
    `_dkdv_produce`d, the ring's position and K and V's phase running on; then `end`, which ends the
    consumers."""
    counter_ptr, end, blocks, ring, order_ptr = schedule  # (names, not `_`: a reassigned name is carried)
    q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens = sequences
    q_layout, kv_layout = layouts
    t = 0
    i = 0
    item = fetch(schedule, kv_offsets_ptr, kv_tokens, SHAPE[0], LENGTHS[1], TILES[1], LAST_FIRST=False)
    while item < end:
        hand_out(ring, i, item)
        block = key_block(sequences, item, blocks, SHAPE[0], LENGTHS, TILES[1])
        kv_head, q_start, n_q, kv_start, n_k, key0 = block
        kv_origin = tile_origin(kv_start + key0, kv_head, kv_layout)
        t = _dkdv_produce(buffers, stats, block, kv_origin, q_layout, t, i & 1, SHAPE[1], TILES, BAND,
                          SCORES[2])
        i += 1
        item = fetch(schedule, kv_offsets_ptr, kv_tokens, SHAPE[0], LENGTHS[1], TILES[1], LAST_FIRST=False)
    hand_out(ring, i, end)


@gluon.jit
def _dkdv_produce(buffers, stats, block, kv_origin, q_layout, t, kvp, KV_GROUP: gl.constexpr,
                  TILES: gl.constexpr, BAND: gl.constexpr, QK_SCALE: gl.constexpr):
    """The producer's work for one key block (`key_block`'s tuple): its K and V (two halves of 64 rows
    each, from kv_origin, once both consumers have freed the last block's: kv_free's phase kvp ^ 1), then
    the Q and dO tiles of each query head of the group into the ring from its position t as slots free,
    each with its log-sum-exp (in exp2's units, `scaled_down` by QK_SCALE) and delta (stats = (lse_ptr,
    delta_ptr); plain loads, zero past n_q) in the slot's lse_smem and delta_smem. Returns the ring's
    position after the block."""
    q_desc, do_desc, k_desc, v_desc, pipe = buffers
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_free, ready, empty, _ = pipe
    lse_ptr, delta_ptr = stats
    kv_head, q_start, n_q, _, n_k, key0 = block
    kv_row, kv_col = kv_origin
    q_tokens, _, _ = q_layout
    BLOCK_M: gl.constexpr = TILES[0]
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]

    KEY_TILES: gl.constexpr = BLOCK_N // CONSUMER_ROWS  # 2, or 1 under SPLIT_D
    mbarrier.wait(kv_free, kvp ^ 1)  # fresh barriers: phase 1 counts as complete
    mbarrier.expect(kv_bar, KEY_TILES * k_desc.block_type.nbytes + KEY_TILES * v_desc.block_type.nbytes)
    for w in gl.static_range(KEY_TILES):
        tma_load(k_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, _key_half(k_smem, w))
        tma_load(v_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, v_smem.index(w))
    t0, ntiles = _query_tiles(key0, n_q, n_k, BLOCK_M, BLOCK_N, BAND)
    per_head = ntiles - t0
    # The tile's statistics over the warp's 32 lanes (a tile of fewer queries repeats them on the rest).
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32 if BLOCK_M >= 32 else 1], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=stat_layout)
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        q_row, q_col = tile_origin(q_start, head, q_layout)
        stat_base = stat_origin(q_start, head, q_tokens)
        for tile in range(t0, ntiles):
            i = t + g * per_head + (tile - t0)
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass at parity 1
            bar = ready.index(slot)
            m0 = tile * BLOCK_M
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [q_row + m0, q_col], bar, q_smem.index(slot))
            tma_load(do_desc, [q_row + m0, q_col], bar, do_smem.index(slot))
            # The tile's log-sum-exp and delta (zero past n_q) beside it, under the TMA loads; the
            # barrier's second arrival publishes them (read by plain loads: no proxy fence, as `publish`
            # has for wgmma).
            keep = offs < n_q - m0
            lse = gl.load(lse_ptr + stat_base + m0 + offs, mask=keep, other=0.0)
            lse_smem.index(slot).store(scaled_down(lse, QK_SCALE))
            delta_smem.index(slot).store(gl.load(delta_ptr + stat_base + m0 + offs, mask=keep, other=0.0))
            partition_barrier()
            mbarrier.arrive(bar, count=1)
    return t + KV_GROUP * per_head


@gluon.jit
def _dkdv_consumer_loop(pipe, schedule, sequences, arrays, SHAPE: gl.constexpr, LENGTHS: gl.constexpr,
                        BAND: gl.constexpr, SCORES: gl.constexpr, SCALES: gl.constexpr, TILES: gl.constexpr,
                        WG: gl.constexpr, FUSED_DQ: gl.constexpr):
    """Consumer warpgroup WG: `_dkdv_consume` for each key block the producer hands out, until `end`."""
    counter_ptr, end, blocks, ring, order_ptr = schedule  # (names, not `_`: a reassigned name is carried)
    t = 0
    tail_phases = gl.to_tensor(0)
    i = 0
    item = receive(ring, i)
    while item < end:
        block = key_block(sequences, item, blocks, SHAPE[0], LENGTHS, TILES[1])
        sequence, _, _ = item_position(item, blocks, SHAPE[0], TILES[1], LAST_FIRST=False)  # dq's padding
        t, tail_phases = _dkdv_consume(pipe, arrays, block, sequence, (t, i & 1, tail_phases), SHAPE, TILES,
                                       BAND, SCORES, SCALES, WG, FUSED_DQ)
        i += 1
        item = receive(ring, i)
    if FUSED_DQ == DQ_TMA_REDUCE:
        tma.store_wait(0)  # the last reduce-add has read its tile before the program's shared memory goes


@gluon.jit
def _dkdv_consume(pipe, arrays, block, sequence, position, SHAPE: gl.constexpr, TILES: gl.constexpr,
                  BAND: gl.constexpr, SCORES: gl.constexpr, SCALES: gl.constexpr, WG: gl.constexpr,
                  FUSED_DQ: gl.constexpr):
    """One consumer warpgroup's work for one key block (`key_block`'s tuple): dK, dV of keys
    key0 + 64 WG + [0, 64) over the query tiles the producer streams into the ring from its position t
    (the block's K and V behind kv_bar at phase kvp), stored (rows < n_k; zero where no query sees them)
    at the end; arrays = (slopes_ptr, dk_ptr, dv_ptr, kv_layout, fused), SCALES = (DS_SCALE, OUT_SCALE). A
    tile is masked unless every query of it sees every key of this warpgroup's and it has no row past n_q.
    With FUSED_DQ (fused = (dq_acc, q_layout, ds_smem, ds_full, stage, dq_rows), else None) also each tile's
    DS_SCALE * dS K into dq_acc (`_dq_tile`): this warpgroup's dS^T rows, masked past n_k (where K's rows,
    zeroed here, are other tokens), go to the slot's ds_smem tile, which dK's product then reads;
    `sequence` (the block's) finds its rows in the TMA dq-fused kernel's padded dq_acc (dq_rows).
    position = (t, kvp, tail_phases), tail_phases the per-slot tail barriers' parities (a bit per slot);
    returns the ring's position and tail_phases after the block."""
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, kv_free, ready, empty, tail_bar = pipe
    slopes_ptr, dk_ptr, dv_ptr, kv_layout, fused = arrays
    kv_head, q_start, n_q, kv_start, n_k, key0 = block
    t, kvp, tail_phases = position
    KV_GROUP: gl.constexpr = SHAPE[1]
    D: gl.constexpr = SHAPE[2]
    BLOCK_M: gl.constexpr = TILES[0]
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    # SPLIT_D (a block of 64 keys, both warpgroups'): this warpgroup's S^T and dP^T are of half the
    # tile's queries, COLS of them, and its dK and dV of half of D's columns, from D0. Else COLS =
    # BLOCK_M, D_COLS = D and the block's keys are two halves, this warpgroup's from krow0.
    SPLIT_D: gl.constexpr = BLOCK_N == CONSUMER_ROWS
    KEY_TILES: gl.constexpr = BLOCK_N // CONSUMER_ROWS
    COLS: gl.constexpr = BLOCK_M * KEY_TILES // 2
    D_COLS: gl.constexpr = D * KEY_TILES // 2
    KEY_HALF: gl.constexpr = WG * (KEY_TILES - 1)
    C0: gl.constexpr = WG * COLS  # (SPLIT_D) this warpgroup's first query of a tile

    st_layout: gl.constexpr = wgmma_layout(COLS)
    acc_layout: gl.constexpr = wgmma_layout(D_COLS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    BANDED: gl.constexpr = BAND[0] or BAND[1] >= 0 or BAND[2] >= 0
    WINDOWED: gl.constexpr = BAND[1] >= 0 or BAND[2] >= 0
    shift = n_k - n_q
    krow0 = key0 + KEY_HALF * CONSUMER_ROWS
    k = _key_half(k_smem, KEY_HALF)
    v = v_smem.index(KEY_HALF)
    dk = gl.zeros([CONSUMER_ROWS, D_COLS], gl.float32, layout=acc_layout)
    dv = gl.zeros([CONSUMER_ROWS, D_COLS], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([CONSUMER_ROWS, COLS], gl.float32, layout=st_layout)
    key_rows = krow0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    t0, ntiles = _query_tiles(key0, n_q, n_k, BLOCK_M, BLOCK_N, BAND)
    per_head = ntiles - t0
    last_tile = gl.cdiv(n_q, BLOCK_M) - 1  # the sequence's last query tile, and its rows
    last_rows = n_q - last_tile * BLOCK_M
    if WINDOWED:
        # This warpgroup's clean query tiles, [clean_start, clean_end) (below n_q's last partial tile).
        _, clean_start, clean_end, _ = query_ranges(krow0, n_q, n_k, BLOCK_M, CONSUMER_ROWS, BAND)
    mbarrier.wait(kv_bar, kvp)  # always, tiles or none: kv_bar's phase runs on from block to block
    if FUSED_DQ:
        dq_acc, q_layout, ds_smem, ds_full, _, dq_rows = fused
        if FUSED_DQ == DQ_TMA_REDUCE:  # the row of dq_acc where the sequence's queries start
            dq_row = gl.load(dq_rows + sequence)
        if krow0 + CONSUMER_ROWS > n_k:
            # K's rows past n_k (other tokens, maybe NaN), which dS K reads: zeroed by the warpgroup whose
            # half they are, before its first dS^T is published to the other (ds_full). The proxy fence
            # in `publish` also orders these writes before the producer's next TMA load into the half.
            zero_rows(k, n_k - krow0, CONSUMER_ROWS)
            publish()
    # S^T's A operand at D = 64: K from registers (16 a thread), read once a block, so that each tile's
    # S^T reads only Q from shared memory; ptxas (sm_90a): spills as before under triton 3.9, no more
    # under 3.6, every product asynchronous. At D = 128 ptxas serializes every wgmma with it (C7512, too
    # few registers), under 3.6 and 3.9, banded or not. SPLIT_D's halves of the queries and the dq-fused
    # kernels (K zeroed past n_k above, and dQ's operand) keep K in shared memory.
    k_op = k
    if not SPLIT_D and not FUSED_DQ and D <= CONSUMER_ROWS:
        k_op = k.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        slope = alibi_slope(slopes_ptr, head, SCORES[1])
        if FUSED_DQ == DQ_TMA_REDUCE:  # the head's first query in the padded dq_acc, (row, column)
            dq_base = (dq_row, (head * D).to(gl.int32))
        elif FUSED_DQ:
            dq_base = row_base(dq_acc, q_start, head, q_layout)
        for tile in range(t0, ntiles):
            i = t + g * per_head + (tile - t0)
            slot = i % STAGES
            m0 = tile * BLOCK_M
            cols = m0 + gl.arange(0, COLS, layout=col_layout)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            tail = (tile == last_tile) & (last_rows < BLOCK_M)
            if tail:  # the tile's rows past n_q are other tokens: zeroed before any product
                tail_phases = zero_tail_tile(q, do, slot, tail_bar, tail_phases, last_rows, BLOCK_M, WG)
            if SPLIT_D:  # this warpgroup's queries, [m0 + C0, +COLS)
                cols = cols + C0
                st_tok = warpgroup_mma(k, q.slice(C0, COLS, dim=0).permute((1, 0)), st_zero, use_acc=False,
                                       is_async=True)
                dpt_tok = warpgroup_mma(v, do.slice(C0, COLS, dim=0).permute((1, 0)), st_zero, use_acc=False,
                                        is_async=True)
                lse = lse_smem.index(slot).slice(C0, COLS).load(col_layout)
                q0 = m0 + C0
            else:
                q0 = m0
                st_tok = warpgroup_mma(k_op, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
                lse = lse_smem.index(slot).load(col_layout)  # the producer's, scaled, zero past n_q
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            st, tanh_st = capped_biased(st, krow0 - (q0 + shift), slope, SCORES, CONSUMER_ROWS, COLS,
                                        st_layout)
            pt = probability(st * SCORES[2] - gl.expand_dims(lse, 0))  # one FFMA a score
            if WINDOWED:
                masked = (m0 < clean_start) | (m0 >= clean_end)
            else:
                masked = tail
                if BAND[0]:  # (causal) some query of the tile before some key of this warpgroup's
                    masked = masked | (m0 + shift < krow0 + CONSUMER_ROWS)
            if masked:
                keep = gl.expand_dims(cols < n_q, 0)
                if BANDED:  # the band of queries cols (at key positions cols + shift), keys key_rows
                    keep = band(keep, gl.expand_dims(cols + shift, 0), gl.expand_dims(key_rows, 1), 0, BAND)
                pt = gl.where(keep, pt, 0.0)
            if SPLIT_D:
                dv, dk = _split_products(pt, tanh_st, (cols, n_q, tail), (q, do, delta_smem, dpt_tok),
                                         (dv, dk), arrays[4], (slot, i), SCORES, TILES, D_COLS, WG)
                mbarrier.arrive(empty.index(slot), count=1)
            else:
                p_op = gl.convert_layout(pt.to(dtype), op_layout)
                if SCORES[0] > 0:  # dS^T takes the cap's derivative, 1 - tanh^2: folded into P^T here
                    pt = pt * (1.0 - tanh_st * tanh_st)
                dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
                delta = delta_smem.index(slot).load(col_layout)
                dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
                dst = pt * (dpt - gl.expand_dims(delta, 0))
                if tail:  # past n_q dP^T reads zeroed rows, but keep 0 exactly
                    dst = gl.where(gl.expand_dims(cols < n_q, 0), dst, 0.0)
                if FUSED_DQ:
                    # Keys past n_k (other tokens; dK's rows there are never stored): 0 for dQ, by a select
                    # (P^T and dP^T there may be NaN). dS^T goes to shared memory, where dK's product reads
                    # it too, then the tile's dQ (`_dq_tile`).
                    dst = gl.where(gl.expand_dims(key_rows < n_k, 1), dst, 0.0)
                    ds_tile = ds_smem.index(slot).slice(WG * CONSUMER_ROWS, CONSUMER_ROWS, dim=0)
                    ds_tile.store(dst.to(dtype))
                    publish()
                    mbarrier.arrive(ds_full.index(slot), count=1)
                    dk_tok = warpgroup_mma(ds_tile, q, dk, is_async=True)
                    dv, dk = _dq_tile(fused, (k_smem, ds_smem, empty), (dv_tok, dk_tok, p_op),
                                      (dq_base, m0, n_q, i), SCALES[0], D, TILES, WG, FUSED_DQ)
                else:
                    ds_op = gl.convert_layout(dst.to(dtype), op_layout)
                    dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
                    dv, dk, ds_op, p_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, ds_op, p_op))
                    mbarrier.arrive(empty.index(slot), count=1)
    # K and V are free for the next block's (kv_free counts both warpgroups' arrivals): dK and dV are in
    # registers, and the products that read K and V are done.
    mbarrier.arrive(kv_free, count=1)
    if SPLIT_D:  # this warpgroup's columns of the block's rows
        D0: gl.constexpr = WG * D_COLS
        store_rows(dk_ptr + D0, dk, SCALES[0], kv_start, kv_head, krow0, n_k, kv_layout, D_COLS, acc_layout)
        store_rows(dv_ptr + D0, dv, SCALES[1], kv_start, kv_head, krow0, n_k, kv_layout, D_COLS, acc_layout)
    else:
        store_rows(dk_ptr, dk, SCALES[0], kv_start, kv_head, krow0, n_k, kv_layout, D, acc_layout)
        store_rows(dv_ptr, dv, SCALES[1], kv_start, kv_head, krow0, n_k, kv_layout, D, acc_layout)
    return t + KV_GROUP * per_head, tail_phases


@gluon.jit
def _split_products(pt, tanh_st, columns, operands, acc, split, ring, SCORES: gl.constexpr,
                    TILES: gl.constexpr, D_COLS: gl.constexpr, WG: gl.constexpr):
    """SPLIT_D: warpgroup WG's dV and dK products of one ring tile, returned waited for (acc = (dv, dk),
    each [64 keys, D_COLS] of the columns from WG D_COLS). pt is P^T of its half of the tile's queries,
    [64, COLS] (columns = (cols, n_q, tail): their positions, masked), tanh_st the soft cap's tanh;
    operands = (q, do, delta_smem, dpt_tok), dpt_tok dP^T's product in flight. dS^T = P^T S'^T (dP^T -
    delta), 0 past n_q. P^T and dS^T go to pds_smem (split = (pds_smem, pds_bars); ring = (slot, i), i
    the tile's place in the ring's run) once pds_bars[1] says both warpgroups are done with the last
    tile's; once pds_bars[0] says both wrote theirs, dV += P^T dO and dK += dS^T Q over the tile's
    queries, two products each (one per half), B the slot's dO and Q at this warpgroup's columns, then
    this warpgroup arrives on pds_bars[1]. Each barrier completes once per tile."""
    cols, n_q, tail = columns
    q, do, delta_smem, dpt_tok = operands
    dv, dk = acc
    pds_smem, pds_bars = split
    slot, i = ring
    COLS: gl.constexpr = TILES[0] // 2
    col_layout: gl.constexpr = gl.SliceLayout(0, wgmma_layout(COLS))
    dtype: gl.constexpr = pds_smem.dtype
    mbarrier.wait(pds_bars.index(1), (i & 1) ^ 1)  # fresh barriers: phase 1 counts as complete
    pds_smem.index(WG).store(pt.to(dtype))
    if SCORES[0] > 0:  # dS^T takes the cap's derivative, 1 - tanh^2: folded into P^T here
        pt = pt * (1.0 - tanh_st * tanh_st)
    delta = delta_smem.index(slot).slice(WG * COLS, COLS).load(col_layout)
    dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    if tail:  # past n_q dP^T reads zeroed rows, but keep 0 exactly
        dst = gl.where(gl.expand_dims(cols < n_q, 0), dst, 0.0)
    pds_smem.index(2 + WG).store(dst.to(dtype))
    publish()
    mbarrier.arrive(pds_bars.index(0), count=1)
    mbarrier.wait(pds_bars.index(0), i & 1)
    D0: gl.constexpr = WG * D_COLS
    for half in gl.static_range(2):
        do_half = do.slice(half * COLS, COLS, dim=0).slice(D0, D_COLS, dim=1)
        q_half = q.slice(half * COLS, COLS, dim=0).slice(D0, D_COLS, dim=1)
        dv = warpgroup_mma(pds_smem.index(half), do_half, dv, is_async=True)
        dk = warpgroup_mma(pds_smem.index(2 + half), q_half, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    mbarrier.arrive(pds_bars.index(1), count=1)
    return dv, dk


@gluon.jit
def _dq_tile(fused, smem, products, rows, DS_SCALE: gl.constexpr, D: gl.constexpr, TILES: gl.constexpr,
             WG: gl.constexpr, FUSED_DQ: gl.constexpr):
    """Warpgroup WG's share of the fused dQ of ring tile i, once its dV and dK products (products =
    (dv_tok, dk_tok, p_op)) are issued; returns dV and dK, waited for. rows = (dq_base, m0, n_q, i): the
    tile's rows m0 + [0, BLOCK_M) of dq_acc from dq_base (`row_base`), those at or past n_q masked. The
    tile's dQ over the block's 128 keys is dS K = (K^T dS^T)^T (`_dq_product`), once ds_full says both
    consumers wrote their dS^T rows: at D = 128 each warpgroup takes 64 columns d, at D = 64 one takes
    the whole tile, warpgroup i % 2 (the other only releases the slot). [64, BLOCK_M] float32 of dQ^T in
    registers, added into dq_acc after the ring slot is released: by atomics (`add_columns`; dq_base a
    pointer from `row_base`), or under DQ_TMA_REDUCE by a TMA reduce-add of the whole tile
    (`reduce_columns`; dq_base the head's (row, column) in the padded dq_acc, where the rows at or past
    n_q land in the sequence's padding). Both warpgroups
    release it only after their products that read its dS^T, and write the slot's dS^T again only once
    the producer has loaded its next tile, which waits for both releases: no other barrier guards
    ds_smem."""
    dq_acc, q_layout, _, ds_full, stage, _ = fused
    token_stride = q_layout[1]
    k_smem, ds_smem, empty = smem
    dv_tok, dk_tok, p_op = products
    dq_base, m0, n_q, i = rows
    BLOCK_M: gl.constexpr = TILES[0]
    STAGES: gl.constexpr = TILES[2]
    SPLIT: gl.constexpr = D // CONSUMER_ROWS  # warpgroups sharing a tile's dQ: 2 at D = 128, 1 at D = 64
    layout: gl.constexpr = wgmma_layout(BLOCK_M)
    slot = i % STAGES
    if SPLIT == 2:
        D0: gl.constexpr = WG * CONSUMER_ROWS
        mbarrier.wait(ds_full.index(slot), (i // STAGES) & 1)
        dqt = _dq_product(k_smem, ds_smem, slot, D0, D, layout)
        dv, dk, p_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op))
        dqt = warpgroup_mma_wait(0, deps=(dqt, ))
        mbarrier.arrive(empty.index(slot), count=1)
        if FUSED_DQ == DQ_TMA_REDUCE:
            reduce_columns(dq_acc, dq_base, dqt * DS_SCALE, stage.index(WG), m0, D0)
        else:
            add_columns(dq_base + D0, token_stride, dqt * DS_SCALE, stage.index(WG), m0, n_q)
    else:
        dv, dk, p_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op))
        if i % 2 == WG:
            mbarrier.wait(ds_full.index(slot), (i // STAGES) & 1)
            dqt = _dq_product(k_smem, ds_smem, slot, 0, D, layout)
            dqt = warpgroup_mma_wait(0, deps=(dqt, ))
            mbarrier.arrive(empty.index(slot), count=1)
            if FUSED_DQ == DQ_TMA_REDUCE:
                reduce_columns(dq_acc, dq_base, dqt * DS_SCALE, stage.index(WG), m0, 0)
            else:
                add_columns(dq_base, token_stride, dqt * DS_SCALE, stage.index(WG), m0, n_q)
        else:
            mbarrier.arrive(empty.index(slot), count=1)
    return dv, dk


@gluon.jit
def _dq_product(k_smem, ds_smem, slot, D0: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    """The asynchronous product of dQ^T's rows [D0, D0 + 64) for ring slot `slot`: K^T dS^T over the
    block's 128 keys, A the K tile read transposed (k_smem one [1, BLOCK_N, D] tile), B the slot's dS^T,
    into a [64, BLOCK_M] float32 accumulator of the wgmma layout `layout`. One product over both
    warpgroups' keys, not one per half: a second chained onto the first's accumulator costs ptxas a
    second copy of it (hundreds of bytes of spills)."""
    BLOCK_M: gl.constexpr = ds_smem.shape[2]
    k_t = k_smem.index(0)
    if D > CONSUMER_ROWS:
        k_t = k_t.slice(D0, CONSUMER_ROWS, dim=1)
    return warpgroup_mma(k_t.permute((1, 0)), ds_smem.index(slot),
                         gl.zeros([CONSUMER_ROWS, BLOCK_M], gl.float32, layout=layout), use_acc=False,
                         is_async=True)
