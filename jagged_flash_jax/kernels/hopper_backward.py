"""The Hopper (sm_90a) backward, in Gluon: dk/dv and dq kernels with the portable backward's contract
(kernels/portable.py's attention_bwd_kernel: causal, windows, soft caps and ALiBi included), next to the
Hopper forward (kernels/hopper.py, whose addressing, bounds, zero fills and score transform these
share).

Both take q, do, k, v as TMA descriptors over the forward's 2-D views (one row per token in "THD", per
(head, token) in "HTD": see kernels/hopper.py), the float32 log-sum-exp (base 2, in units of the unscaled
scores, +inf for a query with no key) and delta = rowsum(o * do) / OUT_SCALE (minus the log-sum-exp's
own gradient, see _util.lse_gradient), both [1, H, q_tokens], by plain loads (dk/dv's producer stages
each query tile's in shared memory beside its Q and dO). With P = exp2((S - lse) *
QK_SCALE), S the scores of q k^T unscaled and dS = P (dP - delta) S', dP = do v^T: dv = OUT_SCALE *
P^T do, dk = DS_SCALE * dS^T q, dq = DS_SCALE * dS k (DS_SCALE = scale * OUT_SCALE). S and S' are
common._scores' (in units of the unscaled scores, as lse): S = SOFTCAP * tanh(q k^T / SOFTCAP) -
slope * |i + n_k - n_q - j| and S' = 1 - tanh^2 with a soft cap (SOFTCAP, the cap divided by the scale;
0 none), 1 without; the ALiBi slopes [1, H] from slopes_ptr (divided by the scale, read only with
ALIBI), each query head its own. Per sequence n_q = min(len_q, Q_MAX_LEN) queries against n_k =
min(len_kv, KV_MAX_LEN) keys, the band bottom-right aligned (common._band: query i at key position
i + n_k - n_q; causal, and a window of WINDOW_LEFT / WINDOW_RIGHT keys, -1 for none), GQA (kv head =
head // KV_GROUP). Every output element has one writer and there are no atomics: bitwise
deterministic.

dk/dv (`attention_bwd_dkdv_kernel`): persistent as the forward is (one program per SM taking blocks of 128
keys of one (sequence, kv head) from a counter the launch zeroes, each (sequence, kv head)'s blocks
adjacent and the first first, handed to the consumers through a 2-slot ring in shared memory; see
kernels/hopper.py). Per block a 1-warp producer partition loads the block's K and V (two halves of 64
rows, once both consumers are done with the last block's: the kv_free mbarrier), then streams the Q and dO
tiles (with their log-sum-exp and delta, zero past n_q; the ready mbarrier counts their arrival as a
second) of BLOCK_M queries that see a key of the block (of each of the KV_GROUP query heads in turn; under
causal from the first such tile, and a window bounds them on both sides, common._query_ranges: the cost
grows with the window, not with n_q) into a STAGES-deep ring (ready / empty mbarriers, the empty ones
counting 2) that runs on from block to block. Two consumer warpgroups (the default partition and a worker,
setmaxnreg CONSUMER_REGS / PRODUCER_REGS) own 64 key rows each, dK and dV in float32 registers, zeroed per
block. Per query tile: S^T = K Q^T and dP^T = V dO^T issued together; P^T = exp2((S^T - lse) * QK_SCALE)
while dP^T is in flight (masked, by a select, in the tiles where some query of the tile misses some key of
the warpgroup's or is past n_q: the band's edges and the sequence's last tile); dV += P^T dO (async); dS^T
= P^T S'^T (dP^T - delta); dK += dS^T Q; wait; release the slot. A tile's rows past n_q are other tokens
(maybe NaN, and 0 * NaN is NaN in the products): warpgroup 0 zeroes them in Q and dO in shared memory and
signals warpgroup 1 through the slot's tail mbarrier, and P^T, dS^T are masked there. Rows of K and V past
n_k only reach their own rows of dK and dV, which are not stored. A block that no query sees (n_q = 0, or
outside a window) is a block too: its rows < n_k are stored as zeros.

dq (`attention_bwd_dq_kernel`): the forward's structure, persistent as the forward is (one program per
SM taking blocks of 128 queries of one (sequence, head) from a counter the launch zeroes, handed to the
consumers through a 2-slot ring in shared memory; see kernels/hopper.py). Per block the producer loads
the two warpgroups' Q and dO tiles (64 rows each, once the last block's are free), then K_j, V_j of
BLOCK_N keys (the block's band, `common._key_ranges`) into the ring, which runs on from block to block;
per key tile each consumer computes S = Q K^T and dP = dO V^T (async), P, dS = P S' (dP - delta) (selected
in the band's edge tiles and the sequence's last one: P may be inf outside the band, and V rows past n_k
make dP NaN), dQ += dS K. The last K tile's rows past n_k are zeroed in shared memory first (dS is 0
there, K maybe NaN).

The options cost nothing when off (constexpr branches): without a window, the tile ranges and the
dk/dv programs' mask test are those of plain and causal attention alone.

Both kernels' programs first share out the zero fills of their outputs (as the forward's: per (sequence,
head) the tokens past the maximum length, then per head, in chunks of PARAM_HOPPER_BWD_FILL_CHUNK tokens,
those no sequence covers, any offsets content; stores masked, TMA clips), then take their blocks. So dq,
dk, dv need no memset.

These are the `dkdv base+ld` and `dq base+bn128` variants of the probe kept in
benchmarks/results/profile/2026-12-01d_gluon_backward_probe.md (self-attention, outputs pre-zeroed),
with cross-attention, strides, the zero fills and the options added; measured in
docs/performance.md.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import _band, _bounds, _key_ranges, _query_ranges
from .hopper import (
    CONSUMER_ROWS,
    FILL_NONE,
    FILL_ROWS,
    PARAM_BATCH,
    PARAM_KV_HEAD_STRIDE,
    PARAM_KV_TOKEN_STRIDE,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
    _block,
    _capped_biased,
    _fetch,
    _hand_out,
    _item,
    _item_ring,
    _partition_barrier,
    _producer_loop,
    _publish,
    _receive,
    _slope,
    _stat_origin,
    _tile_origin,
    _tma_load,
    _zero_fills,
    _zero_rows,
)
from .spec import HOPPER_BWD_DKDV

PARAM_HOPPER_BWD_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_BWD_DKDV.slot("blocks"))
PARAM_HOPPER_BWD_FILL_CHUNK: gl.constexpr = gl.constexpr(HOPPER_BWD_DKDV.slot("fill_chunk"))


@gluon.jit
def _store_rows(ptr, acc, first_token, row0, n, head, factor, token_stride, head_stride, D: gl.constexpr,
                acc_layout: gl.constexpr):
    """Rows row0 + [0, 64) < n of one head (tokens from first_token), from a float32 [64, D] accumulator
    times `factor`."""
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offsets = (first_token + rows).to(gl.int64) * token_stride + head.to(gl.int64) * head_stride
    ptrs = ptr + gl.expand_dims(offsets, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, (acc * factor).to(ptr.dtype.element_ty), mask=gl.expand_dims(rows < n, 1))


@gluon.jit
def _query_tiles(key0, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """(first, end) query tiles of BLOCK_M that a dk/dv program of keys [key0, +BLOCK_N) visits, end >=
    first: those holding the queries that see some of its keys (under causal from the first tile with a
    query i + n_k - n_q >= key0; a window bounds them on both sides, common._query_ranges)."""
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        start, _, _, end = _query_ranges(key0, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT,
                                         WINDOW_RIGHT)
        first = start // BLOCK_M
        return first, gl.maximum(gl.cdiv(end, BLOCK_M), first)
    end = gl.cdiv(n_q, BLOCK_M)
    if CAUSAL:
        first = gl.minimum(gl.maximum(key0 - (n_k - n_q), 0) // BLOCK_M, end)
    else:
        first = end * 0
    return first, end


# ---------------------------------------------------------------------------------------------------
# dk / dv
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_KV_HEADS: gl.constexpr,
               Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block `item` of the (sequence, kv head, block) items, each (sequence, kv head)'s blocks
    adjacent and the first first (the costliest under causal): (kv_head, q_start, n_q, kv_start, n_k,
    key0)."""
    sequence, kv_head, key0 = _item(item, blocks, NUM_KV_HEADS, BLOCK_N, LAST_FIRST=False)
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    return kv_head, q_start, n_q, kv_start, n_k, key0


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
        _, clean_start, clean_end, _ = _query_ranges(krow0, n_q, n_k, BLOCK_M, CONSUMER_ROWS, CAUSAL,
                                                     WINDOW_LEFT, WINDOW_RIGHT)
    mbarrier.wait(kv_bar, kvp)  # always, tiles or none: kv_bar's phase runs on from block to block
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        slope = _slope(slopes_ptr, head, ALIBI)
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
                    _zero_rows(q, last_rows, BLOCK_M)
                    _zero_rows(do, last_rows, BLOCK_M)
                    _publish()
                    mbarrier.arrive(tail_bar.index(slot), count=1)
                else:
                    mbarrier.wait(tail_bar.index(slot), (tail_phases >> slot) & 1)
                tail_phases = tail_phases ^ (1 << slot)
            st_tok = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            lse = lse_smem.index(slot).load(col_layout)  # the producer's, zero past n_q
            st = warpgroup_mma_wait(1, deps=(st_tok, ))
            st, tanh_st = _capped_biased(st, krow0 - (m0 + shift), slope, SOFTCAP, ALIBI, CONSUMER_ROWS,
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
                    keep = _band(keep, gl.expand_dims(cols + shift, 0), gl.expand_dims(key_rows, 1), 0,
                                 CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
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
    _store_rows(dk_ptr, dk, kv_start, krow0, n_k, kv_head, DS_SCALE, kv_token_stride, kv_head_stride, D,
                acc_layout)
    _store_rows(dv_ptr, dv, kv_start, krow0, n_k, kv_head, OUT_SCALE, kv_token_stride, kv_head_stride, D,
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
        _tma_load(k_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, k_smem.index(w))
        _tma_load(v_desc, [kv_row + w * CONSUMER_ROWS, kv_col], kv_bar, v_smem.index(w))
    t0, ntiles = _query_tiles(key0, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    per_head = ntiles - t0
    # The tile's statistics over the warp's 32 lanes (a tile of fewer queries repeats them on the rest).
    stat_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32 if BLOCK_M >= 32 else 1], [32], [1], [0])
    offs = gl.arange(0, BLOCK_M, layout=stat_layout)
    for g in range(KV_GROUP):
        head = kv_head * KV_GROUP + g
        q_row, q_col = _tile_origin(q_start, head, q_token_stride, q_head_stride)
        stat_base = _stat_origin(q_start, head, q_tokens)
        for tile in range(t0, ntiles):
            i = t + g * per_head + (tile - t0)
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass at parity 1
            bar = ready.index(slot)
            m0 = tile * BLOCK_M
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row + m0, q_col], bar, q_smem.index(slot))
            _tma_load(do_desc, [q_row + m0, q_col], bar, do_smem.index(slot))
            # The tile's log-sum-exp and delta (zero past n_q) beside it, under the TMA loads; the
            # barrier's second arrival publishes them (read by plain loads: no proxy fence, as `_publish`
            # has for wgmma).
            keep = offs < n_q - m0
            lse_smem.index(slot).store(gl.load(lse_ptr + stat_base + m0 + offs, mask=keep, other=0.0))
            delta_smem.index(slot).store(gl.load(delta_ptr + stat_base + m0 + offs, mask=keep, other=0.0))
            _partition_barrier()
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
    """The load partition: the key blocks with keys that `_fetch` takes from the counter (those with no
    query are blocks too: their dk, dv are zeros), each handed out to the consumers and then
    `_dkdv_produce`d, the ring's position and K and V's phase running on; then `end`, which ends the
    consumers."""
    t = 0
    i = 0
    item = _fetch(counter_ptr, kv_offsets_ptr, end, blocks, kv_tokens, NUM_KV_HEADS, KV_MAX_LEN, BLOCK_N,
                  LAST_FIRST=False)
    while item < end:
        _hand_out(items, item_full, item_empty, i, item)
        kv_head, q_start, n_q, kv_start, n_k, key0 = _key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks,
                                                                q_tokens, kv_tokens, NUM_KV_HEADS, Q_MAX_LEN,
                                                                KV_MAX_LEN, BLOCK_N)
        kv_row, kv_col = _tile_origin(kv_start + key0, kv_head, kv_token_stride, kv_head_stride)
        t = _dkdv_produce(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                          delta_smem, kv_bar, kv_free, ready, empty, lse_ptr, delta_ptr, q_tokens, q_start,
                          n_q, n_k, key0, kv_row, kv_col, kv_head, q_token_stride, q_head_stride, t, i & 1,
                          KV_GROUP, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
        i += 1
        item = _fetch(counter_ptr, kv_offsets_ptr, end, blocks, kv_tokens, NUM_KV_HEADS, KV_MAX_LEN, BLOCK_N,
                      LAST_FIRST=False)
    _hand_out(items, item_full, item_empty, i, end)


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
    item = _receive(items, item_full, item_empty, i)
    while item < end:
        kv_head, q_start, n_q, kv_start, n_k, key0 = _key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks,
                                                                q_tokens, kv_tokens, NUM_KV_HEADS, Q_MAX_LEN,
                                                                KV_MAX_LEN, BLOCK_N)
        t, tail_phases = _dkdv_consume(k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, ready, empty,
                                       tail_bar, lse_smem, delta_smem, slopes_ptr, dk_ptr, dv_ptr, n_q,
                                       kv_start, n_k, key0, kv_head, kv_token_stride, kv_head_stride, t,
                                       i & 1, tail_phases, KV_GROUP, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                                       WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE,
                                       OUT_SCALE, WG)
        i += 1
        item = _receive(items, item_full, item_empty, i)


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
    _zero_fills(dk_ptr, dv_ptr, kv_offsets_ptr, batch, blocks, fill_chunk, kv_tokens, kv_token_stride,
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
    """The key blocks taken from the counter (items < end, see `_key_block`): the warp-specialized dk/dv
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
    items, item_full, item_empty = _item_ring()
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


# ---------------------------------------------------------------------------------------------------
# dq
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _dq_consume(q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, lse_ptr, delta_ptr,
                dq_ptr, q_tokens, q_start, n_q, n_k, key_first, key_end, slope, start_m, head, q_token_stride,
                q_head_stride, t, qp, tails, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr,
                DS_SCALE: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one query block: dQ of queries start_m + 64 WG + [0, 64) over
    the key tiles from key_first to key_end (the block's band, as the producer loads them from ring
    position t; the Q and dO tiles' barrier at phase qp), stored (rows < n_q) at the end. A tile is
    masked unless every query of this warpgroup's sees every key of it (the band's edges, the
    sequence's last tile). Returns the count of tail hand-overs (tail_bar's uses) after this block's:
    `tails` before it."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    BANDED: gl.constexpr = CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    shift = n_k - n_q
    row0 = start_m + WG * CONSUMER_ROWS
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    stat = _stat_origin(q_start, head, q_tokens) + rows
    lse = gl.load(lse_ptr + stat, mask=rows < n_q, other=0.0)
    delta = gl.load(delta_ptr + stat, mask=rows < n_q, other=0.0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    dq = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    # This warpgroup's clean key blocks (every key of them seen by every one of its queries, < n_k).
    _, clean_start, clean_end, _ = _key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, CAUSAL, WINDOW_LEFT,
                                               WINDOW_RIGHT)
    # The block's last K tile runs past n_k: warpgroup 0 zeroes its rows there and hands it over.
    has_tail = (num_key_blocks > 0) & (key_first + num_key_blocks * BLOCK_N > n_k)
    mbarrier.wait(q_bar.index(WG), qp)  # always: the load must land before the program may end
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        key_start = key_first + j * BLOCK_N
        mbarrier.wait(ready.index(slot), ((t + j) // STAGES) & 1)
        k = k_smem.index(slot)
        v = v_smem.index(slot)
        if (j == num_key_blocks - 1) & has_tail:
            # K rows past n_k (other tokens, maybe NaN): zeroed before dS K reads them.
            if WG == 0:
                _zero_rows(k, n_k - key_start, BLOCK_N)
                _publish()
                mbarrier.arrive(tail_bar, count=1)
            else:
                mbarrier.wait(tail_bar, tails & 1)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        s, tanh_s = _capped_biased(s, row0 + (shift - key_start), slope, SOFTCAP, ALIBI, CONSUMER_ROWS,
                                   BLOCK_N, s_layout)
        p = gl.exp2((s - gl.expand_dims(lse, 1)) * QK_SCALE)
        if SOFTCAP > 0:  # dS takes the cap's derivative, 1 - tanh^2: folded into P here
            p = p * (1.0 - tanh_s * tanh_s)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds = p * (dp - gl.expand_dims(delta, 1))
        masked = key_start >= clean_end  # the band's right edge and the sequence's last tile
        if WINDOW_LEFT >= 0:  # and its left edge
            masked = masked | (key_start < clean_start)
        if masked:  # select, not multiply: outside the band P may be inf, and dP NaN past n_k
            keys = key_start + gl.arange(0, BLOCK_N, layout=col_layout)
            keep = gl.expand_dims(keys < n_k, 0)
            if BANDED:  # common._band of queries rows (at key positions rows + shift), keys `keys`
                keep = _band(keep, gl.expand_dims(rows + shift, 1), gl.expand_dims(keys, 0), 0, CAUSAL,
                             WINDOW_LEFT, WINDOW_RIGHT)
            ds = gl.where(keep, ds, 0.0)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(empty.index(slot), count=1)
    # This warpgroup's Q and dO tiles are free for the next block's (warpgroup 1 only now, past its wait
    # for the hand-over: the producer loads the next block's keys after both tiles, so warpgroup 0
    # cannot hand a next tail over, a second phase of tail_bar, before this one has seen the first).
    mbarrier.arrive(q_free.index(WG), count=1)
    _store_rows(dq_ptr, dq, q_start, row0, n_q, head, DS_SCALE, q_token_stride, q_head_stride, D, acc_layout)
    return tails + has_tail.to(gl.int32)


@gluon.jit
def _dq_produce(buffers, q_row, q_col, kv_row, kv_col, num_key_blocks, t, qp, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr):
    """The 1-warp load partition's work for one query block (`hopper._producer_loop`'s `produce`): both
    warpgroups' Q and dO tiles (once the consumers have freed the last block's, q_free's phase qp ^ 1),
    then K_j, V_j (from kv_row: the band's first key block) into the ring from its position t as slots
    free."""
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty = buffers
    for w in gl.static_range(2):
        mbarrier.wait(q_free.index(w), qp ^ 1)  # fresh barriers: phase 1 counts as complete
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bar.index(w), q_smem.index(w))
        _tma_load(do_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bar.index(w), do_smem.index(w))
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        mbarrier.wait(empty.index(slot), (((t + j) // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + j * BLOCK_N, kv_col], bar, k_smem.index(slot))
        _tma_load(v_desc, [kv_row + j * BLOCK_N, kv_col], bar, v_smem.index(slot))


@gluon.jit
def _dq_consumer_loop(q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, items,
                      item_full, item_empty, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr,
                      slopes_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                      NUM_HEADS: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
                      KV_MAX_LEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                      WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                      QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup: `_dq_consume` for the query blocks `hopper._producer_loop` hands out, until
    `end`."""
    t = 0
    tails = 0
    i = 0
    item = _receive(items, item_full, item_empty, i)
    while item < end:
        _, head, q_start, n_q, _, n_k, start_m, key_first, key_end, num_key_blocks = _block(
            q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS, Q_MAX_LEN,
            KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        slope = _slope(slopes_ptr, head, ALIBI)
        tails = _dq_consume(q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, lse_ptr,
                            delta_ptr, dq_ptr, q_tokens, q_start, n_q, n_k, key_first, key_end, slope,
                            start_m, head, q_token_stride, q_head_stride, t, i & 1, tails, D, BLOCK_N,
                            STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE,
                            WG)
        t += num_key_blocks
        i += 1
        item = _receive(items, item_full, item_empty, i)


@gluon.jit
def attention_bwd_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
    params_ptr, dq_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """dq on a persistent grid (one program per SM), as the Hopper forward: each program first does its
    share of the zero fills of dq (fill i, i + programs, ...: per (sequence, head) the tokens past
    Q_MAX_LEN, then per head the PARAM_HOPPER_BWD_FILL_CHUNK chunks of the tokens no sequence covers),
    then takes query blocks of BLOCK_M (= 128, two warpgroups') queries from the counter at counter_ptr
    (zeroed by the launcher), each (sequence, head)'s blocks adjacent and the last first (the costliest
    under causal), until none is left. Every row of dq (q's strides) is written."""
    batch = gl.load(params_ptr + PARAM_BATCH)
    q_tokens = gl.load(params_ptr + PARAM_Q_TOKENS)
    q_token_stride = gl.load(params_ptr + PARAM_Q_TOKEN_STRIDE) * STRIDE_ALIGN
    q_head_stride = gl.load(params_ptr + PARAM_Q_HEAD_STRIDE) * STRIDE_ALIGN
    blocks = gl.load(params_ptr + PARAM_HOPPER_BWD_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_HOPPER_BWD_FILL_CHUNK)
    _zero_fills(dq_ptr, dq_ptr, q_offsets_ptr, batch, blocks, fill_chunk, q_tokens, q_token_stride,
                q_head_stride, NUM_HEADS, Q_MAX_LEN, D, FILL_BLOCK, FILL_NONE)
    _dq(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
        params_ptr, dq_ptr, counter_ptr, batch * NUM_HEADS * blocks, blocks, q_tokens, q_token_stride,
        q_head_stride, NUM_HEADS, KV_GROUP, D, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
        SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, BLOCK_M, BLOCK_N, STAGES, STRIDE_ALIGN, CONSUMER_REGS,
        PRODUCER_REGS)


@gluon.jit
def _dq(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
        params_ptr, dq_ptr, counter_ptr, end, blocks, q_tokens, q_token_stride, q_head_stride,
        NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
        KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
        WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr,
        DS_SCALE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        STRIDE_ALIGN: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """The query blocks taken from the counter (items < end, see hopper._block): the warp-specialized
    dq (rows < n_q only), its shared memory and barriers set up once."""
    kv_tokens = gl.load(params_ptr + PARAM_KV_TOKENS)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    items, item_full, item_empty = _item_ring()
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    mbarrier.init(tail_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_dq_consumer_loop, (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, items,
                             item_full, item_empty, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr,
                             slopes_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                             NUM_HEADS, D, Q_MAX_LEN, KV_MAX_LEN, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                             WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, 0)),
        (_dq_consumer_loop, (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, items,
                             item_full, item_empty, lse_ptr, delta_ptr, dq_ptr, q_offsets_ptr, kv_offsets_ptr,
                             slopes_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                             NUM_HEADS, D, Q_MAX_LEN, KV_MAX_LEN, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                             WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE, 1)),
        (_producer_loop, (gl.constexpr(_dq_produce), (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem,
                                                      k_smem, v_smem, q_bar, q_free, ready, empty),
                          items, item_full, item_empty, counter_ptr, q_offsets_ptr, kv_offsets_ptr,
                          params_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                          NUM_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                          BLOCK_M, BLOCK_N, STAGES, STRIDE_ALIGN)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
