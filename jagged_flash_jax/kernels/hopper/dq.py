"""The Hopper dq kernel: the forward's structure (blocks of 128 queries handed out by the scheduler, a
1-warp producer loading each block's Q and dO tiles, then its band's K and V tiles into a STAGES-deep
ring), each consumer warpgroup computing per key tile S = Q K^T and dP = dO V^T, P, dS = P S' (dP - delta)
and dQ += dS K over its 64 queries. The last K tile's rows past n_k are zeroed in shared memory first (dS
is 0 there, K maybe NaN).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..shared import (
    PARAM_BATCH,
    PARAM_KV_TOKENS,
    band,
    key_ranges,
    probability,
    scaled_down,
)
from .addressing import PARAM_BLOCKS, PARAM_FILL_CHUNK, read_layout, stat_origin, store_rows
from .fills import FILL_NONE, zero_fills
from .pipeline import CONSUMER_ROWS, hand_over_zeroed, tma_load, wgmma_layout
from .scheduler import consumer_loop, dq_buffers, producer_loop
from .scores import alibi_slope, capped_biased


@gluon.jit
def attention_bwd_dq_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_offsets_ptr, kv_offsets_ptr, order_ptr, slopes_ptr,
    params_ptr, dq_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, DS_SCALE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ORDERED: gl.constexpr,
):
    """dq = DS_SCALE * dS k, with the portable backward's semantics (see
    portable/backward.attention_bwd_kernel), on a persistent grid of one program per SM as the Hopper
    forward's: each program first does its share of the zero fills of dq, then takes blocks of BLOCK_M
    = 128 queries (two warpgroups') from the counter at counter_ptr until none is left. lse (base 2, in
    units of the unscaled scores) and delta are [1, H, q_tokens]. Every row of dq (q's strides) is
    written, by one program: deterministic."""
    batch = gl.load(params_ptr + PARAM_BATCH)
    q_layout = read_layout(params_ptr, KEYS=False, ALIGN=STRIDE_ALIGN)
    q_tokens, _, _ = q_layout
    blocks = gl.load(params_ptr + PARAM_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_FILL_CHUNK)
    zero_fills((dq_ptr, dq_ptr), q_offsets_ptr, batch, blocks, fill_chunk, q_layout, NUM_HEADS, Q_MAX_LEN,
               (D, FILL_BLOCK, FILL_NONE))
    end = batch * NUM_HEADS * blocks
    kv_tokens = gl.load(params_ptr + PARAM_KV_TOKENS)

    # The shared memory and barriers of the warp-specialized region, set up once.
    pipe, ring = dq_buffers(q_desc, do_desc, k_desc, v_desc, (D, D, BLOCK_N, STAGES))
    schedule = (counter_ptr, end, blocks, ring, order_ptr if ORDERED else None)  # (`_take`)
    sequences = (q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens)
    SHAPE: gl.constexpr = (NUM_HEADS, KV_GROUP, D)
    LENGTHS: gl.constexpr = (Q_MAX_LEN, KV_MAX_LEN)
    BAND: gl.constexpr = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    SCORES: gl.constexpr = (SOFTCAP, ALIBI, QK_SCALE)
    TILES: gl.constexpr = (BLOCK_M, BLOCK_N, STAGES)
    arrays = (slopes_ptr, lse_ptr, delta_ptr, dq_ptr, q_layout)
    # The forward's partitions, their computed scalars in the same order (see forward.py).
    gl.warp_specialize([
        (consumer_loop, (gl.constexpr(_dq_consume), pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND,
                         SCORES, DS_SCALE, TILES, 0)),
        (consumer_loop, (gl.constexpr(_dq_consume), pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND,
                         SCORES, DS_SCALE, TILES, 1)),
        (producer_loop, (gl.constexpr(_dq_produce), (q_desc, do_desc, k_desc, v_desc, pipe), schedule,
                         sequences, q_layout, params_ptr, SHAPE, LENGTHS, BAND, TILES, STRIDE_ALIGN)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _dq_produce(buffers, q_origin, kv_origin, num_key_blocks, t, qp, TILES: gl.constexpr):
    """The producer's work for one query block (`producer_loop`'s `produce`): both warpgroups' Q and dO
    tiles (once the consumers have freed the last block's, q_free's phase qp ^ 1), then K_j, V_j (from
    kv_origin: the band's first key block) into the ring from its position t as slots free."""
    q_desc, do_desc, k_desc, v_desc, pipe = buffers
    q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, _ = pipe
    q_row, q_col = q_origin
    kv_row, kv_col = kv_origin
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    for w in gl.static_range(2):
        mbarrier.wait(q_free.index(w), qp ^ 1)  # fresh barriers: phase 1 counts as complete
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bar.index(w), q_smem.index(w))
        tma_load(do_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bar.index(w), do_smem.index(w))
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        mbarrier.wait(empty.index(slot), (((t + j) // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, kv_col], bar, k_smem.index(slot))
        tma_load(v_desc, [kv_row + j * BLOCK_N, kv_col], bar, v_smem.index(slot))


@gluon.jit
def _dq_consume(pipe, arrays, block, position, D: gl.constexpr, BAND: gl.constexpr,
                SCORES: gl.constexpr, DS_SCALE: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """One consumer warpgroup's work for one query block (`query_block`'s tuple): dQ of queries
    start_m + 64 WG + [0, 64) over the key tiles from key_first to key_end (the block's band, as the
    producer loads them from ring position t; the Q and dO tiles' barrier at phase qp), stored (rows < n_q)
    at the end. arrays = (slopes_ptr, lse_ptr, delta_ptr, dq_ptr, q_layout). A tile is masked unless every
    query of this warpgroup sees every key of it (the band's edges, the sequence's last tile). position =
    (t, i, tails), tails the count of tail hand-overs (tail_bar's uses) so far; returns t and tails after
    the block."""
    q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar = pipe
    slopes_ptr, lse_ptr, delta_ptr, dq_ptr, q_layout = arrays
    q_tokens, _, _ = q_layout
    _, head, q_start, n_q, _, n_k, start_m, key_first, key_end, num_key_blocks = block
    t, i, tails = position
    slope = alibi_slope(slopes_ptr, head, SCORES[1])
    qp = i & 1  # the phase of the query tiles' barriers
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]

    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    acc_layout: gl.constexpr = wgmma_layout(D)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    shift = n_k - n_q
    row0 = start_m + WG * CONSUMER_ROWS
    rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=row_layout)
    stat = stat_origin(q_start, head, q_tokens) + rows
    lse_scaled = scaled_down(gl.load(lse_ptr + stat, mask=rows < n_q, other=0.0), SCORES[2])
    delta = gl.load(delta_ptr + stat, mask=rows < n_q, other=0.0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    dq = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    # This warpgroup's clean key blocks (every key of them seen by every one of its queries, < n_k).
    _, clean_start, clean_end, _ = key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, BAND)
    # The block's last K tile runs past n_k: warpgroup 0 zeroes its rows there and hands it over.
    has_tail = (num_key_blocks > 0) & (key_first + num_key_blocks * BLOCK_N > n_k)
    mbarrier.wait(q_bar.index(WG), qp)  # always: the load must land before the program may end
    where = (t, num_key_blocks, has_tail, tails, key_first, n_k)
    scores = (slope, lse_scaled, delta, rows, row0, shift, clean_start, clean_end)
    if D <= CONSUMER_ROWS:
        dq = _tiles_ahead(q, do, pipe, where, scores, s_zero, BAND, SCORES, TILES, D, WG)
    else:
        for j in range(num_key_blocks):
            slot = (t + j) % STAGES
            key_start = key_first + j * BLOCK_N
            s_tok, dp_tok = _issue_products((q, do), pipe, where, (j, key_start), s_zero, BLOCK_N, STAGES, WG)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p = _probabilities(s, key_start, scores, SCORES, BLOCK_N)
            dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
            ds_op = _scores_gradient(p, dp, (key_start, n_k), scores, BAND, BLOCK_N, D, dtype)
            dq_tok = warpgroup_mma(ds_op, k_smem.index(slot), dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
            mbarrier.arrive(empty.index(slot), count=1)
    # This warpgroup's Q and dO tiles are free for the next block's (warpgroup 1 only now, past its wait
    # for the hand-over: the producer loads the next block's keys after both tiles, so warpgroup 0
    # cannot hand a next tail over, a second phase of tail_bar, before this one has seen the first).
    mbarrier.arrive(q_free.index(WG), count=1)
    store_rows(dq_ptr, dq, DS_SCALE, q_start, head, row0, n_q, q_layout, D, acc_layout)
    tails = tails + has_tail.to(gl.int32)
    return t + num_key_blocks, tails


@gluon.jit
def _tiles_ahead(q, do, pipe, where, scores, s_zero, BAND: gl.constexpr, SCORES: gl.constexpr,
                 TILES: gl.constexpr, D: gl.constexpr, WG: gl.constexpr):
    """`_dq_consume`'s key tiles at D = 64, software-pipelined: S_{j+1} and dP_{j+1} are issued ahead of
    dQ_j += dS_j K_j, so P_{j+1} and dS_{j+1} are computed while dQ_j runs. Every product is waited for
    within its turn of the loop (dQ_j last, before tile j's slot is released), so no accumulator is in
    flight across the loop's back edge, only dS (registers): one that is makes ptxas serialize every
    wgmma (C7514). At D = 128 S, dP, dQ and dS in registers at once spill (524 B): D = 128 keeps one
    tile's products at a time. Returns dQ."""
    _, _, k_smem, v_smem, _, _, ready, empty, tail_bar = pipe
    BLOCK_N: gl.constexpr = TILES[1]
    STAGES: gl.constexpr = TILES[2]
    dtype: gl.constexpr = q.dtype
    t, num_key_blocks, _, _, key_first, n_k = where
    dq = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=wgmma_layout(D))
    if num_key_blocks > 0:
        s_tok, dp_tok = _issue_products((q, do), pipe, where, (0, key_first), s_zero, BLOCK_N, STAGES, WG)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = _probabilities(s, key_first, scores, SCORES, BLOCK_N)
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        ds_op = _scores_gradient(p, dp, (key_first, n_k), scores, BAND, BLOCK_N, D, dtype)
        for j in range(num_key_blocks - 1):
            slot = (t + j) % STAGES
            key_start = key_first + (j + 1) * BLOCK_N
            s_tok, dp_tok = _issue_products((q, do), pipe, where, (j + 1, key_start), s_zero, BLOCK_N, STAGES,
                                            WG)
            dq_tok = warpgroup_mma(ds_op, k_smem.index(slot), dq, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s_tok, ))
            p = _probabilities(s, key_start, scores, SCORES, BLOCK_N)
            dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
            ds_next = _scores_gradient(p, dp, (key_start, n_k), scores, BAND, BLOCK_N, D, dtype)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
            mbarrier.arrive(empty.index(slot), count=1)
            ds_op = ds_next
        slot = (t + num_key_blocks - 1) % STAGES
        dq_tok = warpgroup_mma(ds_op, k_smem.index(slot), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(empty.index(slot), count=1)
    return dq



@gluon.jit
def _issue_products(query, pipe, where, tile, s_zero, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    WG: gl.constexpr):
    """Once key tile j of the block (tile = (j, its first key)) is in its ring slot (where = (t,
    num_key_blocks, has_tail, tails, key_first, n_k): the block's first slot t), the block's last tile
    handed over with its rows past n_k zeroed (`hand_over_zeroed`, where has_tail), issues S_j = Q K_j^T
    and dP_j = dO V_j^T (query = (Q, dO)); returns both in flight."""
    q, do = query
    _, _, k_smem, v_smem, _, _, ready, _, tail_bar = pipe
    t, num_key_blocks, has_tail, tails, _, n_k = where
    j, key_start = tile
    slot = (t + j) % STAGES
    mbarrier.wait(ready.index(slot), ((t + j) // STAGES) & 1)
    k = k_smem.index(slot)
    v = v_smem.index(slot)
    if (j == num_key_blocks - 1) & has_tail:
        # K rows past n_k (other tokens, maybe NaN): zeroed before dS K reads them.
        hand_over_zeroed(k, n_k - key_start, tail_bar, tails & 1, BLOCK_N, WG)
    s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s_tok, dp_tok


@gluon.jit
def _probabilities(s, key_start, scores, SCORES: gl.constexpr, BLOCK_N: gl.constexpr):
    """P of the key tile from key_start, from its S (scores: `_dq_consume`'s), with the soft cap's
    derivative folded in."""
    slope, lse_scaled, _, _, row0, shift, _, _ = scores
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    s, tanh_s = capped_biased(s, row0 + (shift - key_start), slope, SCORES, CONSUMER_ROWS, BLOCK_N, s_layout)
    p = probability(s * SCORES[2] - gl.expand_dims(lse_scaled, 1))  # one FFMA a score
    if SCORES[0] > 0:  # dS takes the cap's derivative, 1 - tanh^2: folded into P here
        p = p * (1.0 - tanh_s * tanh_s)
    return p


@gluon.jit
def _scores_gradient(p, dp, keys, scores, BAND: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     dtype: gl.constexpr):
    """dS = P (dP - delta) of the key tile from keys[0] (keys = (its first key, n_k)), masked where the
    tile is (`_dq_consume`), as dQ's A operand (dtype)."""
    key_start, n_k = keys
    _, _, delta, rows, _, shift, clean_start, clean_end = scores
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wgmma_layout(D), k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    BANDED: gl.constexpr = BAND[0] or BAND[1] >= 0 or BAND[2] >= 0
    ds = p * (dp - gl.expand_dims(delta, 1))
    masked = key_start >= clean_end  # the band's right edge and the sequence's last tile
    if BAND[1] >= 0:  # and its left edge
        masked = masked | (key_start < clean_start)
    if masked:  # select, not multiply: outside the band P may be inf, and dP NaN past n_k
        key_ids = key_start + gl.arange(0, BLOCK_N, layout=col_layout)
        keep = gl.expand_dims(key_ids < n_k, 0)
        if BANDED:  # the band of queries rows (at key positions rows + shift), keys `key_ids`
            keep = band(keep, gl.expand_dims(rows + shift, 1), gl.expand_dims(key_ids, 0), 0, BAND)
        ds = gl.where(keep, ds, 0.0)
    return gl.convert_layout(ds.to(dtype), op_layout)
