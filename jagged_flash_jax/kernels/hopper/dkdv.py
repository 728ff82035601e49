"""The Hopper dk/dv kernel: persistent as the forward, blocks of 128 keys of one (sequence, kv head); a TMA
producer streams the query tiles of every head of the group past the block's K and V.
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
    PARAM_BATCH,
    PARAM_KV_HEAD_STRIDE,
    PARAM_KV_TOKEN_STRIDE,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
    band,
    query_ranges,
)
from ..spec import HOPPER_BWD_DKDV
from .addressing import stat_origin, store_rows, tile_origin
from .fills import FILL_ROWS, zero_fills
from .pipeline import CONSUMER_ROWS, partition_barrier, publish, tma_load, zero_rows
from .scheduler import fetch, hand_out, item_ring, key_block, receive
from .scores import alibi_slope, capped_biased

PARAM_HOPPER_BWD_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_BWD_DKDV.slot("blocks"))
PARAM_HOPPER_BWD_FILL_CHUNK: gl.constexpr = gl.constexpr(HOPPER_BWD_DKDV.slot("fill_chunk"))


@gluon.jit
def _query_tiles(key0, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """(first, end) query tiles of BLOCK_M that a dk/dv program of keys [key0, +BLOCK_N) visits, end >=
    first: those holding the queries that see some of its keys (under causal from the first tile with a
    query i + n_k - n_q >= key0; a window bounds them on both sides, common._query_ranges)."""
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        start, _, _, end = query_ranges(key0, n_q, n_k, BLOCK_M, BLOCK_N, (CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT))
        first = start // BLOCK_M
        return first, gl.maximum(gl.cdiv(end, BLOCK_M), first)
    end = gl.cdiv(n_q, BLOCK_M)
    if CAUSAL:
        first = gl.minimum(gl.maximum(key0 - (n_k - n_q), 0) // BLOCK_M, end)
    else:
        first = end * 0
    return first, end


@gluon.jit
def _dkdv_consume(k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar, lse_smem,
                  delta_smem, slopes_ptr, dk_ptr, dv_ptr, n_q, kv_start, n_k, key0, kv_head, kv_token_stride,
                  kv_head_stride, t, kvp, tail_phases, KV_GROUP: gl.constexpr, D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                  ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
                  OUT_SCALE: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one key block: dK, dV of keys key0 + 64 WG + [0, 64) over the
    query tiles the producer streams into the ring from its position t (the block's K and V behind
    kv_bar at phase kvp), stored (rows < n_k; zero where no query sees them) at the end. A tile is masked
    unless every query of it sees every key of this warpgroup's and it has no row past n_q. Returns the
    ring's position and tail_phases (the per-slot tail barriers' parities, a bit per slot) after the
    block."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, st_layout)
    dtype: gl.constexpr = q_smem.dtype
    BANDED: gl.constexpr = CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    WINDOWED: gl.constexpr = WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    shift = n_k - n_q
    krow0 = key0 + WG * CONSUMER_ROWS
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    dk = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([CONSUMER_ROWS, BLOCK_M], gl.float32, layout=st_layout)
    key_rows = krow0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    t0, ntiles = _query_tiles(key0, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    per_head = ntiles - t0
    last_tile = gl.cdiv(n_q, BLOCK_M) - 1  # the sequence's last query tile, and its rows
    last_rows = n_q - last_tile * BLOCK_M
    if WINDOWED:
        # This warpgroup's clean query tiles, [clean_start, clean_end) (below n_q's last partial tile).
        _, clean_start, clean_end, _ = query_ranges(krow0, n_q, n_k, BLOCK_M, CONSUMER_ROWS, (CAUSAL,
                                                     WINDOW_LEFT, WINDOW_RIGHT))
    mbarrier.wait(kv_bar, kvp)  # always, tiles or none: kv_bar's phase runs on from block to block
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        slope = alibi_slope(slopes_ptr, head, ALIBI)
        for tile in range(t0, ntiles):
            i = t + g * per_head + (tile - t0)
            slot = i % STAGES
            m0 = tile * BLOCK_M
            cols = m0 + gl.arange(0, BLOCK_M, layout=col_layout)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            tail = (tile == last_tile) & (last_rows < BLOCK_M)
            if tail:
                # The tile's rows past n_q are other tokens: zeroed before any product. (A slot's tail
                # barrier is re-armed only after both warpgroups released the slot, the ring running on
                # from block to block, so warpgroup 0 cannot arrive twice before warpgroup 1 waited.)
                if WG == 0:
                    zero_rows(q, last_rows, BLOCK_M)
                    zero_rows(do, last_rows, BLOCK_M)
                    publish()
                    mbarrier.arrive(tail_bar.index(slot), count=1)
                else:
                    mbarrier.wait(tail_bar.index(slot), (tail_phases >> slot) & 1)
                tail_phases = tail_phases ^ (1 << slot)
            st_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            lse = lse_smem.index(slot).load(col_layout)  # the producer's, zero past n_q
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            st, tanh_st = capped_biased(st, krow0 - (m0 + shift), slope, SOFTCAP, ALIBI, CONSUMER_ROWS,
                                         BLOCK_M, st_layout)
            pt = gl.exp2((st - gl.expand_dims(lse, 0)) * QK_SCALE)
            if WINDOWED:
                masked = (m0 < clean_start) | (m0 >= clean_end)
            else:
                masked = tail
                if CAUSAL:  # some query of the tile before some key of this warpgroup's
                    masked = masked | (m0 + shift < krow0 + CONSUMER_ROWS)
            if masked:
                keep = gl.expand_dims(cols < n_q, 0)
                if BANDED:  # common._band of queries cols (at key positions cols + shift), keys key_rows
                    keep = band(keep, gl.expand_dims(cols + shift, 0), gl.expand_dims(key_rows, 1), 0,
                                 (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT))
                pt = gl.where(keep, pt, 0.0)
            p_op = gl.convert_layout(pt.to(dtype), op_layout)
            if SOFTCAP > 0:  # dS^T takes the cap's derivative, 1 - tanh^2: folded into P^T here
                pt = pt * (1.0 - tanh_st * tanh_st)
            dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
            delta = delta_smem.index(slot).load(col_layout)
            dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            if tail:  # past n_q dP^T reads zeroed rows, but keep 0 exactly
                dst = gl.where(gl.expand_dims(cols < n_q, 0), dst, 0.0)
            ds_op = gl.convert_layout(dst.to(dtype), op_layout)
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            dv, dk, ds_op, p_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, ds_op, p_op))
            mbarrier.arrive(empty.index(slot), count=1)
    # K and V are free for the next block's (kv_free counts both warpgroups' arrivals): dK and dV are in
    # registers, and the products that read K and V are done.
    mbarrier.arrive(kv_free, count=1)
    store_rows(dk_ptr, dk, kv_start, krow0, n_k, kv_head, DS_SCALE, kv_token_stride, kv_head_stride, D,
                acc_layout)
    store_rows(dv_ptr, dv, kv_start, krow0, n_k, kv_head, OUT_SCALE, kv_token_stride, kv_head_stride, D,
                acc_layout)
    return t + KV_GROUP * per_head, tail_phases


@gluon.jit
def _dkdv_produce(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                  kv_bar, kv_free, ready, empty, lse_ptr, delta_ptr, q_tokens, q_start, n_q, n_k, key0,
                  kv_row, kv_col, kv_head, q_token_stride, q_head_stride, t, kvp, KV_GROUP: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """The 1-warp load partition's work for one key block: its K and V (two halves of 64 rows each,
    from kv_row, once both consumers have freed the last block's: kv_free's phase kvp ^ 1), then the Q
    and dO tiles of each query head of the group into the ring from its position t as slots free, each
    with its log-sum-exp and delta (plain loads, zero past n_q) in the slot's lse_smem and delta_smem.
    Returns the ring's position after the block."""
    mbarrier.wait(kv_free, kvp ^ 1)  # fresh barriers: phase 1 counts as complete
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma_load(k_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, k_smem.index(w))
        tma_load(v_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, v_smem.index(w))
    t0, ntiles = _query_tiles(key0, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    per_head = ntiles - t0
    # The tile's statistics over the warp's 32 lanes (a tile of fewer queries repeats them on the rest).
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32 if BLOCK_M >= 32 else 1], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=stat_layout)
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        q_row, q_col = tile_origin(q_start, head, q_token_stride, q_head_stride)
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
            lse_smem.index(slot).store(gl.load(lse_ptr + stat_base + m0 + offs, mask=keep, other=0.0))
            delta_smem.index(slot).store(gl.load(delta_ptr + stat_base + m0 + offs, mask=keep, other=0.0))
            partition_barrier()
            mbarrier.arrive(bar, count=1)
    return t + KV_GROUP * per_head


@gluon.jit
def _dkdv_producer_loop(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                        delta_smem, kv_bar, kv_free, ready, empty, lse_ptr, delta_ptr, items, item_full,
                        item_empty, counter_ptr, q_offsets_ptr, kv_offsets_ptr, end, blocks, q_tokens,
                        kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
                        NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, Q_MAX_LEN: gl.constexpr,
                        KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                        WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr):
    """The load partition: the key blocks with keys that `fetch` takes from the counter (those with no
    query are blocks too: their dk, dv are zeros), each handed out to the consumers and then
    `_dkdv_produce`d, the ring's position and K and V's phase running on; then `end`, which ends the
    consumers."""
    t = 0
    i = 0
    item = fetch(counter_ptr, kv_offsets_ptr, end, blocks, kv_tokens, NUM_KV_HEADS, KV_MAX_LEN, BLOCK_N,
                  LAST_FIRST=False)
    while item < end:
        hand_out(items, item_full, item_empty, i, item)
        kv_head, q_start, n_q, kv_start, n_k, key0 = key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks,
                                                                q_tokens, kv_tokens, NUM_KV_HEADS, Q_MAX_LEN,
                                                                KV_MAX_LEN, BLOCK_N)
        kv_row, kv_col = tile_origin(kv_start + key0, kv_head, kv_token_stride, kv_head_stride)
        t = _dkdv_produce(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                          delta_smem, kv_bar, kv_free, ready, empty, lse_ptr, delta_ptr, q_tokens, q_start,
                          n_q, n_k, key0, kv_row, kv_col, kv_head, q_token_stride, q_head_stride, t, i & 1,
                          KV_GROUP, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
        i += 1
        item = fetch(counter_ptr, kv_offsets_ptr, end, blocks, kv_tokens, NUM_KV_HEADS, KV_MAX_LEN, BLOCK_N,
                      LAST_FIRST=False)
    hand_out(items, item_full, item_empty, i, end)


@gluon.jit
def _dkdv_consumer_loop(k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar, items,
                        item_full, item_empty, lse_smem, delta_smem, slopes_ptr, dk_ptr, dv_ptr,
                        q_offsets_ptr, kv_offsets_ptr, end, blocks, q_tokens, kv_tokens, kv_token_stride,
                        kv_head_stride, NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr,
                        Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                        ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
                        OUT_SCALE: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup: `_dkdv_consume` for the key blocks `_dkdv_producer_loop` hands out, until
    `end`."""
    t = 0
    tail_phases = gl.to_tensor(0)
    i = 0
    item = receive(items, item_full, item_empty, i)
    while item < end:
        kv_head, q_start, n_q, kv_start, n_k, key0 = key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks,
                                                                q_tokens, kv_tokens, NUM_KV_HEADS, Q_MAX_LEN,
                                                                KV_MAX_LEN, BLOCK_N)
        t, tail_phases = _dkdv_consume(k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty,
                                       tail_bar, lse_smem, delta_smem, slopes_ptr, dk_ptr, dv_ptr, n_q,
                                       kv_start, n_k, key0, kv_head, kv_token_stride, kv_head_stride, t,
                                       i & 1, tail_phases, KV_GROUP, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                                       WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE,
                                       OUT_SCALE, WG)
        i += 1
        item = receive(items, item_full, item_empty, i)


@gluon.jit
def attention_bwd_dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
    params_ptr, dk_ptr, dv_ptr, counter_ptr,
    NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    STRIDE_ALIGN: gl.constexpr, FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """dk and dv on a persistent grid (one program per SM), as dq: each program first does its share of
    the zero fills of dk and dv (fill i, i + programs, ...: per (sequence, kv head) the tokens past
    KV_MAX_LEN, then per kv head the PARAM_HOPPER_BWD_FILL_CHUNK chunks of the tokens no sequence
    covers), then takes blocks of BLOCK_N (= 128, two warpgroups') keys from the counter at counter_ptr
    (zeroed by the launcher), each (sequence, kv head)'s blocks adjacent and the first first (the
    costliest under causal), until none is left. Every row of dk, dv (k's strides) is written."""
    batch = gl.load(params_ptr + PARAM_BATCH)
    kv_tokens = gl.load(params_ptr + PARAM_KV_TOKENS)
    kv_token_stride = gl.load(params_ptr + PARAM_KV_TOKEN_STRIDE) * STRIDE_ALIGN
    kv_head_stride = gl.load(params_ptr + PARAM_KV_HEAD_STRIDE) * STRIDE_ALIGN
    blocks = gl.load(params_ptr + PARAM_HOPPER_BWD_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_HOPPER_BWD_FILL_CHUNK)
    zero_fills(dk_ptr, dv_ptr, kv_offsets_ptr, batch, blocks, fill_chunk, kv_tokens, kv_token_stride,
                kv_head_stride, NUM_KV_HEADS, KV_MAX_LEN, D, FILL_BLOCK, FILL_ROWS)
    _dkdv(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
          params_ptr, dk_ptr, dv_ptr, counter_ptr, batch * NUM_KV_HEADS * blocks, blocks, kv_tokens,
          kv_token_stride, kv_head_stride, NUM_KV_HEADS, KV_GROUP, D, Q_MAX_LEN, KV_MAX_LEN, CAUSAL,
          WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, OUT_SCALE, BLOCK_M, BLOCK_N, STAGES,
          STRIDE_ALIGN, CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def _dkdv(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
          params_ptr, dk_ptr, dv_ptr, counter_ptr, end, blocks, kv_tokens, kv_token_stride, kv_head_stride,
          NUM_KV_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
          KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
          WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr,
          DS_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr, CONSUMER_REGS: gl.constexpr,
          PRODUCER_REGS: gl.constexpr):
    """The key blocks taken from the counter (items < end, see `key_block`): the warp-specialized dk/dv
    (rows < n_k only), its shared memory and barriers set up once."""
    q_tokens = gl.load(params_ptr + PARAM_Q_TOKENS)
    q_token_stride = gl.load(params_ptr + PARAM_Q_TOKEN_STRIDE) * STRIDE_ALIGN
    q_head_stride = gl.load(params_ptr + PARAM_Q_HEAD_STRIDE) * STRIDE_ALIGN
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], do_desc.layout)
    stat_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_smem_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    items, item_full, item_empty = item_ring()
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_free, count=2)  # one arrival per consumer
    for s in gl.static_range(STAGES):
        mbarrier.init(tail_bar.index(s), count=1)
        mbarrier.init(ready.index(s), count=2)  # the TMA loads' expect and the statistics' arrival
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before the first copy

    # (argument tuples written out: concatenating them in the kernel turns constexprs into tensors)
    gl.warp_specialize([
        (_dkdv_consumer_loop, (k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar,
                               items, item_full, item_empty, lse_smem, delta_smem, slopes_ptr, dk_ptr, dv_ptr,
                               q_offsets_ptr, kv_offsets_ptr, end, blocks, q_tokens, kv_tokens,
                               kv_token_stride, kv_head_stride, NUM_KV_HEADS, KV_GROUP, D, Q_MAX_LEN,
                               KV_MAX_LEN, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                               SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, OUT_SCALE, 0)),
        (_dkdv_consumer_loop, (k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty, tail_bar,
                               items, item_full, item_empty, lse_smem, delta_smem, slopes_ptr, dk_ptr, dv_ptr,
                               q_offsets_ptr, kv_offsets_ptr, end, blocks, q_tokens, kv_tokens,
                               kv_token_stride, kv_head_stride, NUM_KV_HEADS, KV_GROUP, D, Q_MAX_LEN,
                               KV_MAX_LEN, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                               SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, OUT_SCALE, 1)),
        (_dkdv_producer_loop, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                               delta_smem, kv_bar, kv_free, ready, empty, lse_ptr, delta_ptr, items,
                               item_full, item_empty, counter_ptr, q_offsets_ptr, kv_offsets_ptr, end, blocks,
                               q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride,
                               kv_head_stride, NUM_KV_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL,
                               WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

