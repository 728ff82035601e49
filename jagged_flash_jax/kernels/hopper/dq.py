"""The Hopper dq kernel: the forward's structure (blocks of 128 queries, a TMA producer streaming the band's
K and V tiles), each consumer warpgroup accumulating dQ = dS K over its 64 queries.
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
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
    band,
    key_ranges,
)
from ..spec import HOPPER_BWD_DQ
from .addressing import stat_origin, store_rows
from .fills import FILL_NONE, zero_fills
from .pipeline import CONSUMER_ROWS, publish, tma_load, zero_rows
from .scheduler import item_ring, producer_loop, query_block, receive
from .scores import alibi_slope, capped_biased

PARAM_HOPPER_BWD_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_BWD_DQ.slot("blocks"))
PARAM_HOPPER_BWD_FILL_CHUNK: gl.constexpr = gl.constexpr(HOPPER_BWD_DQ.slot("fill_chunk"))


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
    stat = stat_origin(q_start, head, q_tokens) + rows
    lse = gl.load(lse_ptr + stat, mask=rows < n_q, other=0.0)
    delta = gl.load(delta_ptr + stat, mask=rows < n_q, other=0.0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    dq = gl.zeros([CONSUMER_ROWS, D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    # This warpgroup's clean key blocks (every key of them seen by every one of its queries, < n_k).
    _, clean_start, clean_end, _ = key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, (CAUSAL, WINDOW_LEFT,
                                               WINDOW_RIGHT))
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
                zero_rows(k, n_k - key_start, BLOCK_N)
                publish()
                mbarrier.arrive(tail_bar, count=1)
            else:
                mbarrier.wait(tail_bar, tails & 1)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        s, tanh_s = capped_biased(s, row0 + (shift - key_start), slope, SOFTCAP, ALIBI, CONSUMER_ROWS,
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
                keep = band(keep, gl.expand_dims(rows + shift, 1), gl.expand_dims(keys, 0), 0, (CAUSAL,
                             WINDOW_LEFT, WINDOW_RIGHT))
            ds = gl.where(keep, ds, 0.0)
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(empty.index(slot), count=1)
    # This warpgroup's Q and dO tiles are free for the next block's (warpgroup 1 only now, past its wait
    # for the hand-over: the producer loads the next block's keys after both tiles, so warpgroup 0
    # cannot hand a next tail over, a second phase of tail_bar, before this one has seen the first).
    mbarrier.arrive(q_free.index(WG), count=1)
    store_rows(dq_ptr, dq, q_start, row0, n_q, head, DS_SCALE, q_token_stride, q_head_stride, D, acc_layout)
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
    item = receive(items, item_full, item_empty, i)
    while item < end:
        _, head, q_start, n_q, _, n_k, start_m, key_first, key_end, num_key_blocks = query_block(
            q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS, Q_MAX_LEN,
            KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        slope = alibi_slope(slopes_ptr, head, ALIBI)
        tails = _dq_consume(q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar, lse_ptr,
                            delta_ptr, dq_ptr, q_tokens, q_start, n_q, n_k, key_first, key_end, slope,
                            start_m, head, q_token_stride, q_head_stride, t, i & 1, tails, D, BLOCK_N,
                            STAGES, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, DS_SCALE,
                            WG)
        t += num_key_blocks
        i += 1
        item = receive(items, item_full, item_empty, i)


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
    zero_fills(dq_ptr, dq_ptr, q_offsets_ptr, batch, blocks, fill_chunk, q_tokens, q_token_stride,
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
    items, item_full, item_empty = item_ring()
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
        (producer_loop, (gl.constexpr(_dq_produce), (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem,
                                                      k_smem, v_smem, q_bar, q_free, ready, empty),
                          items, item_full, item_empty, counter_ptr, q_offsets_ptr, kv_offsets_ptr,
                          params_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                          NUM_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                          BLOCK_M, BLOCK_N, STAGES, STRIDE_ALIGN)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

