"""The Hopper (sm_90a) forward, in Gluon: FlashAttention-3's structure, with the portable forward's
contract (see kernels/__init__.py) for what launch/plan.py sends it.

A persistent grid, one program per SM (the kernel's shared memory allows one), each working through
blocks of BLOCK_M = 128 queries of one (sequence, head) that it takes from a global counter, in the
order of the portable forward's grid (each (sequence, head)'s blocks adjacent, the last first): a 1-warp
producer partition takes the next block with queries (an atomic add on the counter, which the launcher
zeroes), hands its number to both consumers through a 2-slot ring in shared memory, and issues its TMA
loads (the two query tiles of 64 rows once the last block's are free, then the keys and values into a
STAGES-deep ring that runs on from block to block, so that a block's first loads overlap the last one's
end); two consumer warpgroups (the default partition and a worker, 64 query rows each, setmaxnreg
CONSUMER_REGS / PRODUCER_REGS) each run S_j = Q K_j^T asynchronously while P_{j-1} V_{j-1} is in flight,
the softmax of S_j under it. No barrier across the consumers in the loop: each releases a ring slot
with one mbarrier arrival (the empty barriers count 2). The per-block structure is the `coop` variant of
a probe kept in benchmarks/results/profile/2026-12-01b_gluon_forward_probe.md; measurements (the
dynamic schedule against one block per program and a static one) in docs/performance.md.

Semantics as the portable forward's (kernels/portable.py, common.py): offsets clamped as
`common._extent`, n_q = min(len_q, Q_MAX_LEN) queries against n_k = min(len_kv, KV_MAX_LEN) keys, the
band bottom-right aligned (`common._band`: query i at key position i + n_k - n_q; causal, and a window
of WINDOW_LEFT / WINDOW_RIGHT keys, -1 for none), the soft cap SOFTCAP * tanh(q.k / SOFTCAP) and the
ALiBi bias -slope * |i + n_k - n_q - j| (`common._scores`, both in units of the unscaled scores; slopes
[1, NUM_HEADS] from slopes_ptr, read only with ALIBI), GQA (kv head = head // KV_GROUP), o scaled by
OUT_SCALE, the online softmax subtracting the running max (of the unscaled scores) before it scales,
and the base-2 log-sum-exp in units of the unscaled scores, +inf for a query with no key. The producer
loads, and both consumers visit, exactly the key blocks of the 128-query block's band
(`common._key_ranges`: blocks outside it are skipped at both ends); a consumer masks a block only when
some of its 64 queries do not see all of it (the band's edges, the sequence's last block). Every other
row is written too, o = 0 and log-sum-exp +inf, by the same programs before their attention (the
portable forward's fills: the tokens of each (sequence, head) past Q_MAX_LEN, and those no sequence
covers, any offsets content; see `attention_fwd_kernel`), so that the outputs need no memset.

Addressing. q, k, v come as TMA descriptors over 2-D views [elements / token_stride, token_stride] of
their arrays (one row per token in "THD", one per (head, token) in "HTD"): token t of head h is at
element t * token_stride + h * head_stride, so at row t + (h * head_stride) // token_stride and column
(h * head_stride) % token_stride. A tile that runs past a sequence reads other tokens (or heads; the
copy engine reads zeros past the array, never outside it): keys past the sequence are removed with a
`where` on the scores, and the rows of the last value tile past the band's end zeroed in shared memory
before P V reads them (P is 0 there, but 0 * NaN is NaN). o is stored from registers with masked stores.
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

from .common import _bounds, _extent, _key_ranges, _tanh  # Gluon calls them: scalars, or elementwise
from .spec import HOPPER_FWD

# Gluon's API moves between Triton versions: gated on what exists. The TMA load is tma.async_load from
# 3.7 on (tma.async_copy_global_to_shared before); the partition's barrier gl.barrier from 3.7 on
# (gl.thread_barrier before).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

INF: gl.constexpr = gl.constexpr(float("inf"))
# Query rows of one consumer warpgroup (a wgmma's M is 64 per warpgroup).
CONSUMER_ROWS: gl.constexpr = gl.constexpr(64)
PARAM_Q_TOKENS: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("q_tokens"))
PARAM_KV_TOKENS: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("kv_tokens"))
PARAM_Q_TOKEN_STRIDE: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("q_token_stride"))
PARAM_Q_HEAD_STRIDE: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("q_head_stride"))
PARAM_KV_TOKEN_STRIDE: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("kv_token_stride"))
PARAM_KV_HEAD_STRIDE: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("kv_head_stride"))
# What the zero fills write besides their first array (see `_fill_rows`).
FILL_NONE: gl.constexpr = gl.constexpr(0)
FILL_LSE: gl.constexpr = gl.constexpr(1)
FILL_ROWS: gl.constexpr = gl.constexpr(2)
PARAM_BATCH: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("batch"))
PARAM_HOPPER_FWD_BLOCKS: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("blocks"))
PARAM_HOPPER_FWD_FILL_CHUNK: gl.constexpr = gl.constexpr(HOPPER_FWD.slot("fill_chunk"))


# ---------------------------------------------------------------------------------------------------
# Zero fill: common._zero_tail and common._zero_uncovered (o = 0, log-sum-exp +inf), on plain stores
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _fill_rows(o_base, lse_base, tokens, keep, token_stride, D: gl.constexpr, BLOCK: gl.constexpr,
               layout: gl.constexpr, SECOND: gl.constexpr):
    """o = 0 on the tokens `tokens` (a [FILL_BLOCK] row slice of `layout`) where `keep`, of one head: o_base
    points at token 0 of the head. SECOND says what lse_base is: FILL_LSE the head's log-sum-exp of token
    0 (set to +inf), FILL_ROWS token 0 of a second array of o's strides (zeroed too: dk and dv),
    FILL_NONE nothing."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims(tokens * token_stride, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(keep, 1) & gl.expand_dims(cols < D, 0)
    zeros = gl.zeros([BLOCK, D], gl.float32, layout=layout)
    gl.store(o_base + offsets, zeros.to(o_base.dtype.element_ty), mask=mask)
    if SECOND == FILL_LSE:
        infs = gl.full([BLOCK], INF, gl.float32, layout=gl.SliceLayout(1, layout))
        gl.store(lse_base + tokens, infs, mask=keep)
    elif SECOND == FILL_ROWS:
        gl.store(lse_base + offsets, zeros.to(lse_base.dtype.element_ty), mask=mask)


@gluon.jit
def _fill_range(o_base, lse_base, first, last, token_stride, D: gl.constexpr, BLOCK: gl.constexpr,
                SECOND: gl.constexpr):
    """`_fill_rows` on tokens [first, last) (int64)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for block_start in range(first, last, BLOCK):
        tokens = block_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout)).to(gl.int64)
        _fill_rows(o_base, lse_base, tokens, tokens < last, token_stride, D, BLOCK, layout, SECOND)


@gluon.jit
def _second_base(lse_ptr, head, num_tokens, head_stride, SECOND: gl.constexpr):
    """The head's token 0 in `_fill_rows`'s second target."""
    if SECOND == FILL_ROWS:
        base = lse_ptr + head.to(gl.int64) * head_stride
    else:
        base = lse_ptr + head.to(gl.int64) * num_tokens
    return base


@gluon.jit
def _offsets_sorted(offsets_ptr, batch, num_tokens, BLOCK: gl.constexpr):
    """common._offsets_sorted: whether the clamped offsets are non-decreasing."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    unsorted = gl.zeros([BLOCK], gl.int32, layout=layout)
    for first in range(0, batch, BLOCK):
        index = first + gl.arange(0, BLOCK, layout=layout)
        valid = index < batch
        lo = gl.load(offsets_ptr + index, mask=valid, other=0).to(gl.int64)
        hi = gl.load(offsets_ptr + index + 1, mask=valid, other=0).to(gl.int64)
        lo = gl.minimum(gl.maximum(lo, 0), num_tokens)
        hi = gl.minimum(gl.maximum(hi, 0), num_tokens)
        unsorted += (valid & (hi < lo)).to(gl.int32)
    return gl.sum(unsorted, axis=0) == 0


@gluon.jit
def _zero_tail(o_ptr, lse_ptr, offsets_ptr, sequence, head, num_tokens, token_stride, head_stride,
               MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr, SECOND: gl.constexpr):
    """common._zero_tail: the tokens of a sequence past its first MAX_LEN (`_fill_rows`' targets)."""
    start, end = _extent(offsets_ptr, sequence, num_tokens)
    if end - start > MAX_LEN:
        o_base = o_ptr + head.to(gl.int64) * head_stride
        lse_base = _second_base(lse_ptr, head, num_tokens, head_stride, SECOND)
        _fill_range(o_base, lse_base, start + MAX_LEN, end, token_stride, D, BLOCK, SECOND)


@gluon.jit
def _zero_uncovered(o_ptr, lse_ptr, offsets_ptr, batch, head, chunk, fill_chunk, num_tokens, token_stride,
                    head_stride, MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr,
                    SECOND: gl.constexpr):
    """common._zero_uncovered: the tokens of [chunk * fill_chunk, +fill_chunk) that no sequence covers
    (with sorted offsets those before the first sequence and after the last; else every token checked
    against every sequence's first n_q)."""
    first = chunk.to(gl.int64) * fill_chunk
    last = gl.minimum(first + fill_chunk, num_tokens)
    o_base = o_ptr + head.to(gl.int64) * head_stride
    lse_base = _second_base(lse_ptr, head, num_tokens, head_stride, SECOND)
    if _offsets_sorted(offsets_ptr, batch, num_tokens, 128):
        covered_start = gl.minimum(gl.maximum(gl.load(offsets_ptr).to(gl.int64), 0), num_tokens)
        covered_end = gl.minimum(gl.maximum(gl.load(offsets_ptr + batch).to(gl.int64), covered_start),
                                 num_tokens)
        _fill_range(o_base, lse_base, first, gl.minimum(last, covered_start), token_stride, D, BLOCK,
                    SECOND)
        _fill_range(o_base, lse_base, gl.maximum(first, covered_end), last, token_stride, D, BLOCK, SECOND)
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for block_start in range(first, last, BLOCK):
            tokens = block_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout)).to(gl.int64)
            attended = tokens < 0
            for sequence in range(0, batch):
                start, length = _bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
                attended = attended | ((tokens >= start) & (tokens < start + length))
            _fill_rows(o_base, lse_base, tokens, (tokens < last) & ~attended, token_stride, D, BLOCK,
                       layout, SECOND)


@gluon.jit
def _zero_fills(o_ptr, lse_ptr, offsets_ptr, batch, blocks, fill_chunk, num_tokens, token_stride, head_stride,
                NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr,
                SECOND: gl.constexpr):
    """A persistent program's share of the zero fills (fill i, i + programs, ...), before its blocks:
    per (sequence, head) `_zero_tail`, then per head the blocks + 1 chunks of fill_chunk tokens of
    `_zero_uncovered` (fill_chunk * (blocks + 1) >= num_tokens). Plain stores of the default partition's
    4 warps, before the partitions start."""
    for fill in range(gl.program_id(0), (batch + blocks + 1) * NUM_HEADS, gl.num_programs(0)):
        sequence = fill // NUM_HEADS
        head = fill % NUM_HEADS
        if sequence < batch:
            _zero_tail(o_ptr, lse_ptr, offsets_ptr, sequence, head, num_tokens, token_stride, head_stride,
                       MAX_LEN, D, BLOCK, SECOND)
        else:  # chunk sequence - batch of the uncovered tokens
            _zero_uncovered(o_ptr, lse_ptr, offsets_ptr, batch, head, sequence - batch, fill_chunk,
                            num_tokens, token_stride, head_stride, MAX_LEN, D, BLOCK, SECOND)


@gluon.jit
def _tile_origin(first_token, head, token_stride, head_stride):
    """(row, column) of a sequence's first token of `head` in the descriptors' 2-D view (see the
    module's docstring), int32 as TMA takes them."""
    head_offset = head.to(gl.int64) * head_stride
    row = first_token + head_offset // token_stride
    return row.to(gl.int32), (head_offset % token_stride).to(gl.int32)


@gluon.jit
def _stat_origin(first_token, head, q_tokens):
    """Where a sequence's first query of `head` sits in the float32 per-query statistics (the
    log-sum-exp, delta: [1, H, q_tokens])."""
    return head.to(gl.int64) * q_tokens + first_token


@gluon.jit
def _capped_biased(s, offset, slope, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, ROWS: gl.constexpr,
                   COLS: gl.constexpr, layout: gl.constexpr):
    """common._scores on a [ROWS, COLS] tile (of `layout`) of unscaled q.k, or of its transpose k.q:
    (x, t), x the scores in units of the unscaled q.k, t the soft cap's tanh (its derivative is 1 - t^2;
    s itself when SOFTCAP is 0). SOFTCAP is the cap divided by the scale (0: none): x = SOFTCAP *
    tanh(s / SOFTCAP). With ALIBI, x -= slope * |offset + r - c| at row r and column c of the tile, the
    slope divided by the scale: offset = row0 + shift - key0 on a [queries, keys] tile (rows from row0,
    keys from key0), key0 - (row0 + shift) on a [keys, queries] one, so that |offset + r - c| =
    |i + shift - j| either way."""
    t = s
    if SOFTCAP > 0:
        t = _tanh(s * (1.0 / SOFTCAP))
        s = t * SOFTCAP
    if ALIBI:
        # In float32: the column offsets within the tile are constants of each thread, the distances
        # exact integers (below 2**24).
        col_floats = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)).to(gl.float32)
        row_floats = (offset + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))).to(gl.float32)
        s = s - slope * gl.abs(gl.expand_dims(row_floats, 1) - gl.expand_dims(col_floats, 0))
    return s, t


@gluon.jit
def _softmax_step(s, m_i, l_i, key_start, n_k, row0, shift, slope, masked, QK_SCALE: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    """common._scores then common._online_softmax on one tile of unscaled q.k: (p, m, l, alpha). The
    scores stay in units of the unscaled q.k (SOFTCAP and the slope divided by the scale); the max is
    subtracted before the scale, so the top score of a row gets exactly 2**0 at any magnitude."""
    BANDED: gl.constexpr = CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    s, _ = _capped_biased(s, row0 + (shift - key_start), slope, SOFTCAP, ALIBI, CONSUMER_ROWS, BLOCK_N,
                          s_layout)
    if masked:  # runtime, uniform: the blocks at the band's edges and the last one (common._band)
        cols = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < n_k, 0)
        if BANDED:
            rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, s_layout))
            distance = gl.expand_dims(rows + shift, 1) - gl.expand_dims(cols, 0)  # i + shift - j
            if CAUSAL:
                keep = keep & (distance >= 0)
            if WINDOW_RIGHT >= 0:
                keep = keep & (distance >= -WINDOW_RIGHT)
            if WINDOW_LEFT >= 0:
                keep = keep & (distance <= WINDOW_LEFT)
        s = gl.where(keep, s, -INF)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    if BANDED:  # a row may have seen no key yet (max -inf): subtract 0 there, not -inf
        m_safe = gl.where(m_new == -INF, 0.0, m_new)
    else:
        m_safe = m_new
    alpha = gl.exp2((m_i - m_safe) * QK_SCALE)
    p = gl.exp2((s - gl.expand_dims(m_safe, 1)) * QK_SCALE)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _zero_rows(buf, n_rows, ROWS: gl.constexpr):
    """Zero the rows >= n_rows of a [ROWS, D] tile in shared memory (other tokens, maybe NaN), by one
    warpgroup (4 warps); `_publish` then makes the writes visible to the wgmma products."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile = buf.load(blocked)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
    tile = gl.where(gl.expand_dims(rows < n_rows, 1), tile, gl.zeros_like(tile))
    buf.store(tile)


@gluon.jit
def _publish():
    """After `_zero_rows`: the generic-proxy writes visible to wgmma (the async proxy), and every warp's
    rows written before the mbarrier arrival that hands the tile to the other warpgroup."""
    fence_async_shared()
    _partition_barrier()


@gluon.jit
def _pass_slot(ready, empty, j, STAGES: gl.constexpr):
    """Release ring tile j, which this consumer warpgroup skips, once it is loaded: so that the arrival
    never counts toward the slot's next use, which needs the other consumer's too."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def _pass_tiles(k_ready, v_ready, k_empty, v_empty, first, end, STAGES: gl.constexpr):
    """`_pass_slot` of the key and value tiles [first, end) of the ring, in the producer's order."""
    for j in range(first, end):
        _pass_slot(k_ready, k_empty, j, STAGES)
        _pass_slot(v_ready, v_empty, j, STAGES)


@gluon.jit
def _own_tiles(row0, n_q, n_k, key_first, num_key_blocks, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """[lo, hi) of the program's key tiles (from key_first) that some query of one consumer warpgroup's,
    [row0, +64), sees: its own band within the block's (common._key_ranges over its rows), empty when
    its rows are all past n_q."""
    first, _, _, end = _key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    lo = gl.minimum((first - key_first) // BLOCK_N, num_key_blocks)
    hi = gl.minimum(gl.maximum(gl.cdiv(end - key_first, BLOCK_N), lo), num_key_blocks)
    hi = gl.where(row0 < n_q, hi, lo)
    return lo, hi


@gluon.jit
def _issue_kv(desc, bar, buf, row, col):
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [row, col], bar, buf)


@gluon.jit
def _produce(buffers, q_row, q_col, kv_row, kv_col, num_key_blocks, t, qp, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr):
    """The 1-warp load partition's work for one query block (`_producer_loop`'s `produce`): both query
    tiles (once the consumers have freed the last block's, q_free's phase qp ^ 1), then K_j and V_j
    (j < num_key_blocks, from kv_row: the first key block of the band) into the ring from its position t
    as slots free."""
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty = (
        buffers)
    for w in gl.static_range(2):
        mbarrier.wait(q_free.index(w), qp ^ 1)  # fresh barriers: phase 1 counts as complete
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row + w * CONSUMER_ROWS, q_col], q_bars.index(w), q_smem.index(w))
    for j in range(num_key_blocks):
        slot = (t + j) % STAGES
        phase = ((t + j) // STAGES) & 1
        row = kv_row + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _issue_kv(k_desc, k_ready.index(slot), k_smem.index(slot), row, kv_col)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _issue_kv(v_desc, v_ready.index(slot), v_smem.index(slot), row, kv_col)


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar, o_ptr,
             lse_ptr, q_start, n_q, n_k, key_first, key_end, slope, start_m, head, q_tokens, q_token_stride,
             q_head_stride, t, qp, tails, D: gl.constexpr, QK_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr,
             CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
             SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             WG: gl.constexpr):
    """One consumer warpgroup's work for one query block: queries [start_m + 64 WG, +64) against the key
    blocks from key_first (a multiple of BLOCK_N) to key_end (the block's band, as the producer loads
    them, from ring position t; the query tiles' barrier at phase qp), then their o and log-sum-exp. A
    block is masked unless every query of this warpgroup sees every key of it. Returns the count of
    tail-zeroing hand-overs (tail_bar's uses) after this block's: `tails` before it."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    shift = n_k - n_q
    row0 = start_m + WG * CONSUMER_ROWS
    q = q_smem.index(WG)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    # This warpgroup's clean key blocks (common._key_ranges over its 64 rows).
    _, clean_start, clean_end, _ = _key_ranges(row0, n_q, n_k, CONSUMER_ROWS, BLOCK_N, CAUSAL, WINDOW_LEFT,
                                               WINDOW_RIGHT)

    # The tiles each warpgroup computes, [lo, hi): under a window a warpgroup's band may start or end a
    # tile from the block's (more often with narrow bands' 64-key tiles); it passes the tiles outside,
    # leaving the tensor cores to the other. Warpgroup 1 (the block's last rows) always ends at the
    # block's last tile, which warpgroup 0 computes too unless it ends before. (Without a window the
    # code is that of every tile computed by both.)
    WINDOWED: gl.constexpr = WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    if WINDOWED:
        lo, hi = _own_tiles(row0, n_q, n_k, key_first, num_key_blocks, BLOCK_N, CAUSAL, WINDOW_LEFT,
                            WINDOW_RIGHT)
        if WG == 0:  # warpgroup 0's range: its own
            lo0 = lo
            hi0 = hi
        else:
            lo0, hi0 = _own_tiles(start_m, n_q, n_k, key_first, num_key_blocks, BLOCK_N, CAUSAL, WINDOW_LEFT,
                                  WINDOW_RIGHT)
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
    if WINDOWED:
        _pass_tiles(k_ready, v_ready, k_empty, v_empty, t, t + lo, STAGES)
    if hi > lo:
        # S_lo alone; then S_j with P_{j-1} V_{j-1} in flight; then the last P V.
        ks = (t + lo) % STAGES
        key_start = key_first + lo * BLOCK_N
        mbarrier.wait(k_ready.index(ks), ((t + lo) // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, key_start, n_k, row0, shift, slope,
                                           (key_start < clean_start) | (key_start >= clean_end), QK_SCALE,
                                           CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_N,
                                           s_layout)
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
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, key_start, n_k, row0, shift, slope,
                                               (key_start < clean_start) | (key_start >= clean_end), QK_SCALE,
                                               CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_N,
                                               s_layout)
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
                _zero_rows(v_smem.index(vs), tail, BLOCK_N)
                _publish()
                mbarrier.arrive(tail_bar, count=1)
            elif handed_over:
                mbarrier.wait(tail_bar, tails & 1)
            else:
                _zero_rows(v_smem.index(vs), tail, BLOCK_N)
                _publish()
        if WG == 1:
            if hi == num_key_blocks:  # (see below)
                mbarrier.arrive(q_free.index(1), count=1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(vs), acc)
        mbarrier.arrive(v_empty.index(vs), count=1)  # the slot's next use (the ring goes on)
    elif WG == 0:
        mbarrier.arrive(q_free.index(0), count=1)
    if WINDOWED:
        _pass_tiles(k_ready, v_ready, k_empty, v_empty, t + hi, t + num_key_blocks, STAGES)
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
    attended = l_i > 0  # false only for queries with no key
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
    lse_ptrs = lse_ptr + _stat_origin(q_start, head, q_tokens) + lse_rows
    gl.store(lse_ptrs, lse, mask=lse_rows < n_q)
    return tails + handed_over.to(gl.int32)


@gluon.jit
def attention_fwd_kernel(
    q_desc, k_desc, v_desc, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, params_ptr,
    o_ptr, lse_ptr, counter_ptr,
    NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
    KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
    FILL_BLOCK: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """o and the base-2 log-sum-exp, on a persistent grid (one program per SM): each program first
    does its share of the zero fills (fill i, i + programs, ...: per (sequence, head) the tokens past
    Q_MAX_LEN, then per head the PARAM_HOPPER_FWD_FILL_CHUNK chunks of the tokens no sequence covers),
    then takes query blocks of BLOCK_M (= 128, two warpgroups') queries from the counter at counter_ptr
    (zeroed by the launcher) until none is left, in one warp-specialized region (`_attention`). So
    every row of o [tokens, H, D] or [H, tokens, D] (q's strides) and of the log-sum-exp
    [1, H, q_tokens] is written: no memset."""
    batch = gl.load(params_ptr + PARAM_BATCH)
    q_tokens = gl.load(params_ptr + PARAM_Q_TOKENS)
    kv_tokens = gl.load(params_ptr + PARAM_KV_TOKENS)
    q_token_stride = gl.load(params_ptr + PARAM_Q_TOKEN_STRIDE) * STRIDE_ALIGN
    q_head_stride = gl.load(params_ptr + PARAM_Q_HEAD_STRIDE) * STRIDE_ALIGN
    blocks = gl.load(params_ptr + PARAM_HOPPER_FWD_BLOCKS)
    fill_chunk = gl.load(params_ptr + PARAM_HOPPER_FWD_FILL_CHUNK)
    _zero_fills(o_ptr, lse_ptr, q_offsets_ptr, batch, blocks, fill_chunk, q_tokens, q_token_stride,
                q_head_stride, NUM_HEADS, Q_MAX_LEN, D, FILL_BLOCK, FILL_LSE)
    _attention(q_desc, k_desc, v_desc, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, params_ptr, o_ptr,
               lse_ptr, counter_ptr, batch * NUM_HEADS * blocks, blocks, q_tokens, kv_tokens, q_token_stride,
               q_head_stride, NUM_HEADS, KV_GROUP, D, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT,
               WINDOW_RIGHT, SOFTCAP, ALIBI, QK_SCALE, OUT_SCALE, BLOCK_M, BLOCK_N, STAGES, STRIDE_ALIGN,
               CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def _block(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS: gl.constexpr,
           Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr,
           WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr):
    """Query block `item` of the (sequence, head, block) items, each (sequence, head)'s blocks adjacent
    and the last first: (sequence, head, q_start, n_q, kv_start, n_k, start_m, key_first, key_end,
    num_key_blocks), the key blocks some query of the block sees (common._key_ranges, bottom-right
    aligned: the producer loads and both consumers visit exactly [key_first, key_end) in blocks of
    BLOCK_N). A block past the sequence's n_q has no work: `_fetch` never hands one out."""
    sequence, head, start_m = _item(item, blocks, NUM_HEADS, BLOCK_M, LAST_FIRST=True)
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    key_first, _, _, key_end = _key_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_LEFT,
                                           WINDOW_RIGHT)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    return sequence, head, q_start, n_q, kv_start, n_k, start_m, key_first, key_end, num_key_blocks


@gluon.jit
def _item(item, blocks, NUM_HEADS: gl.constexpr, BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """(sequence, head, start) of block `item` of the (sequence, head, block) items, each (sequence,
    head)'s `blocks` blocks of BLOCK rows adjacent, the last first (LAST_FIRST: the query blocks, see
    `_block`) or the first first: start the block's first row in its sequence."""
    index = item % blocks
    if LAST_FIRST:
        index = blocks - 1 - index
    return item // (NUM_HEADS * blocks), (item // blocks) % NUM_HEADS, index * BLOCK


@gluon.jit
def _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
                 BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """Whether block `item` (see `_item`) starts at or past its sequence's length (n_q of a query
    block, n_k of a key block: offsets, tokens and MAX_LEN theirs)."""
    sequence, _, start = _item(item, blocks, NUM_HEADS, BLOCK, LAST_FIRST)
    _, length = _bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
    return start >= length


@gluon.jit
def _fetch(counter_ptr, offsets_ptr, end, blocks, num_tokens, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
           BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """The next block with rows (see `_empty_block`) from the launch's counter (zeroed by the launcher),
    or a number >= end when none is left. A block's offsets are read only when it is one (< end): with
    no sequence, offsets has one entry."""
    item = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    skip = item < end
    if skip:
        skip = _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    while skip:
        item = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        skip = item < end
        if skip:
            skip = _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    return item


@gluon.jit
def _item_ring():
    """The 2-slot ring in shared memory through which a persistent kernel's producer hands its items to
    the two consumer warpgroups (`_hand_out`, `_receive`): (items, item_full, item_empty), the barriers
    initialized (item_empty counting one arrival per consumer). The caller fences the inits."""
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    item_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(item_full.index(w), count=1)
        mbarrier.init(item_empty.index(w), count=2)  # one arrival per consumer
    return items, item_full, item_empty


@gluon.jit
def _hand_out(items, item_full, item_empty, i, item):
    """The producer's i-th item into the 2-slot ring the consumers read it from."""
    slot = i % 2
    mbarrier.wait(item_empty.index(slot), ((i // 2) & 1) ^ 1)  # fresh barriers: phase 1 counts as complete
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], item, gl.int32, layout))
    _partition_barrier()
    mbarrier.arrive(item_full.index(slot), count=1)


@gluon.jit
def _receive(items, item_full, item_empty, i):
    """A consumer's i-th item, from the ring `_hand_out` fills."""
    slot = i % 2
    mbarrier.wait(item_full.index(slot), (i // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    item = gl.max(items.index(slot).load(layout), axis=0)
    _partition_barrier()
    mbarrier.arrive(item_empty.index(slot), count=1)
    return item


@gluon.jit
def _block_origins(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, q_token_stride,
                   q_head_stride, kv_token_stride, kv_head_stride, NUM_HEADS: gl.constexpr,
                   KV_GROUP: gl.constexpr, Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where query block `item` (see `_block`) loads from, in the descriptors' 2-D views: (q_row, q_col,
    kv_row, kv_col, num_key_blocks), the block's first query and the first key of its band, and the
    band's key blocks (the forward's and dq's producers)."""
    _, head, q_start, _, kv_start, _, start_m, key_first, _, num_key_blocks = _block(
        q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS, Q_MAX_LEN,
        KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    q_row, q_col = _tile_origin(q_start + start_m, head, q_token_stride, q_head_stride)
    kv_row, kv_col = _tile_origin(kv_start, head // KV_GROUP, kv_token_stride, kv_head_stride)
    return q_row, q_col, kv_row + key_first, kv_col, num_key_blocks


@gluon.jit
def _slope(slopes_ptr, head, ALIBI: gl.constexpr):
    """ALiBi's slope of query head `head` (slopes [1, H] in units of the unscaled scores), 0 without."""
    if ALIBI:
        slope = gl.load(slopes_ptr + head)
    else:
        slope = 0.0
    return slope


@gluon.jit
def _producer_loop(produce: gl.constexpr, buffers, items, item_full, item_empty, counter_ptr,
                   q_offsets_ptr, kv_offsets_ptr, params_ptr, end, blocks, q_tokens, kv_tokens,
                   q_token_stride, q_head_stride, NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr,
                   Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr):
    """The load partition of the forward and of dq: the query blocks `_fetch` takes from the counter,
    each handed out to the consumers and then loaded by `produce(buffers, q_row, q_col, kv_row, kv_col,
    num_key_blocks, t, phase, BLOCK_N, STAGES)` (`_produce`, `hopper_backward._dq_produce`: the block's
    query tiles, then its band's key tiles from the ring's position t), the ring's position and the query
    tiles' phase running on; then `end`, which ends the consumers."""
    kv_token_stride = gl.load(params_ptr + PARAM_KV_TOKEN_STRIDE) * STRIDE_ALIGN
    kv_head_stride = gl.load(params_ptr + PARAM_KV_HEAD_STRIDE) * STRIDE_ALIGN
    t = 0
    i = 0
    item = _fetch(counter_ptr, q_offsets_ptr, end, blocks, q_tokens, NUM_HEADS, Q_MAX_LEN, BLOCK_M,
                  LAST_FIRST=True)
    while item < end:
        _hand_out(items, item_full, item_empty, i, item)
        q_row, q_col, kv_row, kv_col, num_key_blocks = _block_origins(
            q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
            kv_token_stride, kv_head_stride, NUM_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        produce(buffers, q_row, q_col, kv_row, kv_col, num_key_blocks, t, i & 1, BLOCK_N, STAGES)
        t += num_key_blocks
        i += 1
        item = _fetch(counter_ptr, q_offsets_ptr, end, blocks, q_tokens, NUM_HEADS, Q_MAX_LEN, BLOCK_M,
                      LAST_FIRST=True)
    _hand_out(items, item_full, item_empty, i, end)


@gluon.jit
def _consume_item(q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar, o_ptr,
                  lse_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, item, blocks, q_tokens, kv_tokens,
                  q_token_stride, q_head_stride, t, i, tails, NUM_HEADS: gl.constexpr, D: gl.constexpr,
                  Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, QK_SCALE: gl.constexpr,
                  OUT_SCALE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
                  WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr):
    """`_consume` for query block `item`, the program's i-th (`_fetch` hands out only blocks with
    queries): (t, tails) after it."""
    _, head, q_start, n_q, _, n_k, start_m, key_first, key_end, num_key_blocks = _block(
        q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS, Q_MAX_LEN,
        KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    slope = _slope(slopes_ptr, head, ALIBI)
    tails = _consume(q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar,
                     o_ptr, lse_ptr, q_start, n_q, n_k, key_first, key_end, slope, start_m, head, q_tokens,
                     q_token_stride, q_head_stride, t, i & 1, tails, D, QK_SCALE, OUT_SCALE, CAUSAL,
                     WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_N, STAGES, WG)
    return t + num_key_blocks, tails


@gluon.jit
def _consumer_loop(q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar,
                   o_ptr, lse_ptr, items, item_full, item_empty, q_offsets_ptr, kv_offsets_ptr, slopes_ptr,
                   end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                   NUM_HEADS: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
                   KV_MAX_LEN: gl.constexpr, QK_SCALE: gl.constexpr, OUT_SCALE: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                   SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup: `_consume` for the query blocks `_producer_loop` hands out, until `end`."""
    t = 0
    tails = 0
    i = 0
    item = _receive(items, item_full, item_empty, i)
    while item < end:
        t, tails = _consume_item(
            q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty, tail_bar, o_ptr,
            lse_ptr, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, item, blocks, q_tokens, kv_tokens,
            q_token_stride, q_head_stride, t, i, tails, NUM_HEADS, D, Q_MAX_LEN, KV_MAX_LEN, QK_SCALE,
            OUT_SCALE, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_M, BLOCK_N, STAGES, WG)
        i += 1
        item = _receive(items, item_full, item_empty, i)


@gluon.jit
def _attention(q_desc, k_desc, v_desc, q_offsets_ptr, kv_offsets_ptr, slopes_ptr, params_ptr, o_ptr, lse_ptr,
               counter_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
               NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr, D: gl.constexpr, Q_MAX_LEN: gl.constexpr,
               KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
               WINDOW_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, QK_SCALE: gl.constexpr,
               OUT_SCALE: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """The query blocks taken from the counter (items < end, see `_block`): the warp-specialized
    attention (rows < n_q only), its shared memory and barriers set up once."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    items, item_full, item_empty = _item_ring()
    for w in gl.static_range(2):
        mbarrier.init(q_bars.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    mbarrier.init(tail_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before the first copy

    # (argument tuples written out: concatenating them in the kernel turns constexprs into tensors)
    gl.warp_specialize([
        (_consumer_loop, (q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                          tail_bar, o_ptr, lse_ptr, items, item_full, item_empty, q_offsets_ptr,
                          kv_offsets_ptr, slopes_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride,
                          q_head_stride, NUM_HEADS, D, Q_MAX_LEN, KV_MAX_LEN, QK_SCALE, OUT_SCALE, CAUSAL,
                          WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_M, BLOCK_N, STAGES, 0)),
        (_consumer_loop, (q_smem, k_smem, v_smem, q_bars, q_free, k_ready, v_ready, k_empty, v_empty,
                          tail_bar, o_ptr, lse_ptr, items, item_full, item_empty, q_offsets_ptr,
                          kv_offsets_ptr, slopes_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride,
                          q_head_stride, NUM_HEADS, D, Q_MAX_LEN, KV_MAX_LEN, QK_SCALE, OUT_SCALE, CAUSAL,
                          WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, BLOCK_M, BLOCK_N, STAGES, 1)),
        # (a function among a partition's arguments goes as a constexpr: triton 3.6 flattens them to IR)
        (_producer_loop, (gl.constexpr(_produce), (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars,
                                                   q_free, k_ready, v_ready, k_empty, v_empty),
                          items, item_full, item_empty, counter_ptr, q_offsets_ptr, kv_offsets_ptr,
                          params_ptr, end, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
                          NUM_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT,
                          BLOCK_M, BLOCK_N, STAGES, STRIDE_ALIGN)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
