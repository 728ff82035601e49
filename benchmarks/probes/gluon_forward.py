# ruff: noqa: E501 (a probe, kept as it ran on the GPU)
"""Probe: the jagged attention forward's hot loop in Gluon (TMA + wgmma, optionally warp-specialized).

Standalone, not wired into the package. Layout [T, H, D] for q, k, v, o; offsets [B + 1] int32; sequence b
is tokens offsets[b]..offsets[b+1], truncated to max_seq_len; o = softmax(scale q k^T) v per sequence and
the natural-log log-sum-exp, float32 [H, T]. bfloat16 in and out, float32 accumulation.

Variants (all one kernel, `VARIANT` constexpr):
  basic: no warp specialization; the compute warps issue the TMA loads of a STAGES-deep ring of K and V
         tiles; S = Q K^T, softmax, O += P V one after the other (synchronous wgmma).
  pipe:  the same ring, with FA3's intra-warpgroup overlap: S_j = Q K_j^T is issued asynchronously, then
         O += P_{j-1} V_{j-1}; the softmax of S_j runs while the second product is in flight.
  ws:    `pipe`'s compute in the default partition (NUM_WARPS warps, two warpgroups for 128 query rows),
         and a 1-warp producer partition issuing every TMA load into the ring (ready/empty mbarriers).
         The 8 compute warps share one partition: 3-4 partition-wide bar.sync per key block keep the two
         warpgroups in lock step (both softmax at once, both GEMMs at once).
  coop:  FA3's structure: two consumer warpgroups as separate partitions (the default one and a worker),
         64 query rows and its own Q tile each, `pipe`'s overlap in each, setmaxnreg 240 / 240 / 24 with a
         1-warp producer; no barrier across warpgroups in the loop (each releases a K/V slot with one
         mbarrier arrival; the empty barriers count 2); 3 stages of 128-key tiles at D <= 128.
  pingpong: coop, with FA3's ping-pong: the warpgroups take turns (a ring of mbarriers) issuing their
         QK_j and P_{j-1} V_{j-1}, so one's softmax runs under the other's GEMMs.
  pingpong-fold: pingpong with the max on the raw scores and exp2(s * c - m * c) (one FMA per score, not
         a multiply and a subtract; the package's numerics subtract first, exact at huge logits).
  Modifiers: +bnN +sN +cN +rN +fold (see --variant).

Descriptors are host-made (jax_triton.TensorDescriptor over the [T, H * D] view; no global scratch). A tile
that runs past a sequence reads the next sequence's tokens (TMA clips only at T): keys past the end are
removed with a where on the scores, and the rows of the last V tile past the end are zeroed in shared
memory before P V reads them (P is 0 there, but 0 * NaN is NaN). o is stored with masked plain stores from
registers, the log-sum-exp likewise.

  python benchmarks/probes/gluon_forward.py --compile-only [--causal]   # no GPU: sm_90a, ptxas -v figures
  PYTHONPATH=/tmp/site:$PWD python benchmarks/probes/gluon_forward.py   # on the H200, from the repo root
      [--variant basic,pipe,ws,coop,pingpong,pingpong-fold] [--cases jagged,uniform,d64,nan,causal,d256]
      [--no-time]
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import sys
import time
import traceback

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

VARIANTS = {"basic": 0, "pipe": 1, "ws": 2, "pingpong": 3, "coop": 3, "pingpong-fold": 3}
PP_VARIANTS = ("pingpong", "coop", "pingpong-fold")
# Gluon's API moves between Triton versions: gate on what exists, not on version strings.
# The TMA load is tma.async_load from 3.7 on (async_copy_global_to_shared then raises), before that
# tma.async_copy_global_to_shared.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# The CTA (or, inside a warp_specialize partition, the partition's) barrier: gl.barrier() from 3.7 on,
# _cta_barrier() before.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
LOG2E = 1.4426950408889634


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _scores_to_p(s, m_i, l_i, qk_scale, col0, n_k, row0, NEEDS_MASK, CAUSAL: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one score tile (log2 domain): (p, m_new, l_new, alpha)."""
    s = s * qk_scale
    if NEEDS_MASK:  # runtime, uniform: only the last key block (and the diagonal ones when causal)
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < n_k, 0)
        if CAUSAL:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _zero_tail_rows(v_buf, n_rows, BLOCK_N: gl.constexpr, D: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Zero the rows >= n_rows of a V tile in shared memory (tokens of the next sequence, maybe NaN)."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    tile = v_buf.load(blocked)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
    tile = gl.where(gl.expand_dims(rows < n_rows, 1), tile, gl.zeros_like(tile))
    v_buf.store(tile)
    fence_async_shared()  # generic-proxy writes, read next by wgmma (async proxy)
    _cta_barrier()  # every warp's rows written before any warpgroup's wgmma reads them


@gluon.jit
def _needs_mask(j, n_k, start_m, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    end = (j + 1) * BLOCK_N
    if CAUSAL:
        return (end > n_k) | (end > start_m + 1)
    else:
        return end > n_k


@gluon.jit
def _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, T, seq_start, n, start_m, h,
              H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, o_layout: gl.constexpr,
              row_layout: gl.constexpr):
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / gl.expand_dims(l_o, 1)
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows < n
    tok = (seq_start + rows).to(gl.int64)
    ptrs = o_ptr + gl.expand_dims(tok * (H * D) + h * D, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, o.to(gl.bfloat16), mask=gl.expand_dims(row_ok, 1))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    rows_s = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    gl.store(lse_ptr + h * T + seq_start + rows_s, lse, mask=rows_s < n)


@gluon.jit
def _issue_kv(desc, bar, buf, row, col, pred):
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [row, col], bar, buf, pred=pred)


@gluon.jit
def _compute(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
             o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h,
             H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr, PIPE: gl.constexpr,
             INLINE_LOADS: gl.constexpr):
    """The consumer: every warpgroup_mma and the softmax; with INLINE_LOADS it also issues the loads
    (no producer partition), else it signals the empty barriers of a producer partition."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    nblocks = gl.cdiv(n_k, BLOCK_N)
    col = h * D
    if INLINE_LOADS:
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [seq_start + start_m, col], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            _issue_kv(k_desc, k_ready.index(i), k_smem.index(i), seq_start + i * BLOCK_N, col, i < nblocks)
            _issue_kv(v_desc, v_ready.index(i), v_smem.index(i), seq_start + i * BLOCK_N, col, i < nblocks)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    tail = n_k - (nblocks - 1) * BLOCK_N  # valid rows of the last key block
    mbarrier.wait(q_bar, 0)

    if not PIPE:
        for j in range(nblocks):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            p, m_i, l_i, alpha = _scores_to_p(s, m_i, l_i, qk_scale, j * BLOCK_N, n_k, start_m,
                                              _needs_mask(j, n_k, start_m, BLOCK_N, CAUSAL), CAUSAL,
                                              BLOCK_M, BLOCK_N, s_layout)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            mbarrier.wait(v_ready.index(slot), phase)
            if (j == nblocks - 1) & (tail < BLOCK_N):
                _zero_tail_rows(v_smem.index(slot), tail, BLOCK_N, D, NUM_WARPS)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(slot), acc)
            _cta_barrier()  # both warpgroups done with the slot
            if INLINE_LOADS:
                nxt = j + STAGES
                _issue_kv(k_desc, k_ready.index(slot), k_smem.index(slot), seq_start + nxt * BLOCK_N, col,
                          nxt < nblocks)
                _issue_kv(v_desc, v_ready.index(slot), v_smem.index(slot), seq_start + nxt * BLOCK_N, col,
                          nxt < nblocks)
            else:
                mbarrier.arrive(k_empty.index(slot), count=1)
                mbarrier.arrive(v_empty.index(slot), count=1)
    else:
        # Block 0: S_0 alone.
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        _cta_barrier()
        if INLINE_LOADS:
            _issue_kv(k_desc, k_ready.index(0), k_smem.index(0), seq_start + STAGES * BLOCK_N, col,
                      STAGES < nblocks)
        else:
            mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, alpha = _scores_to_p(s, m_i, l_i, qk_scale, 0, n_k, start_m,
                                          _needs_mask(0, n_k, start_m, BLOCK_N, CAUSAL), CAUSAL,
                                          BLOCK_M, BLOCK_N, s_layout)
        for j in range(1, nblocks):
            ks = j % STAGES
            vs = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(ks), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_ready.index(vs), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p, m_i, l_i, alpha = _scores_to_p(s, m_i, l_i, qk_scale, j * BLOCK_N, n_k, start_m,
                                              _needs_mask(j, n_k, start_m, BLOCK_N, CAUSAL), CAUSAL,
                                              BLOCK_M, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
            _cta_barrier()  # both warpgroups done with K_j and V_{j-1}
            if INLINE_LOADS:
                _issue_kv(k_desc, k_ready.index(ks), k_smem.index(ks), seq_start + (j + STAGES) * BLOCK_N, col,
                          j + STAGES < nblocks)
                _issue_kv(v_desc, v_ready.index(vs), v_smem.index(vs),
                          seq_start + (j - 1 + STAGES) * BLOCK_N, col, j - 1 + STAGES < nblocks)
            else:
                mbarrier.arrive(k_empty.index(ks), count=1)
                mbarrier.arrive(v_empty.index(vs), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        # The last P V.
        last = nblocks - 1
        vs = last % STAGES
        mbarrier.wait(v_ready.index(vs), (last // STAGES) & 1)
        if tail < BLOCK_N:
            _zero_tail_rows(v_smem.index(vs), tail, BLOCK_N, D, NUM_WARPS)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(vs), acc)

    _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, T, seq_start, n, start_m, h, H, D, BLOCK_M, o_layout, row_layout)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              seq_start, n_k, start_m, h, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The 1-warp load partition: Q once, then K_j and V_j into the ring as slots come free."""
    col = h * D
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [seq_start + start_m, col], q_bar, q_smem)
    nblocks = gl.cdiv(n_k, BLOCK_N)
    for j in range(nblocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        row = seq_start + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase ^ 1)  # fresh barriers: phase 1 counts as complete
        _issue_kv(k_desc, k_ready.index(slot), k_smem.index(slot), row, col, True)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _issue_kv(v_desc, v_ready.index(slot), v_smem.index(slot), row, col, True)


# ---------------------------------------------------------------------------------------------------
# pingpong / coop: FA3's structure. NUM_CONS consumer warpgroups (4 warps each, 64 query rows each, its
# own Q tile), one as the default partition and the others as workers, plus a 1-warp TMA producer.
# No CTA-wide barrier in the loop: each consumer releases a K or V slot with one mbarrier arrival
# (the empty barriers count NUM_CONS). With PINGPONG the consumers take turns issuing their wgmmas
# (QK_j and P_{j-1} V_{j-1}) through a ring of `turn` mbarriers, so that one warpgroup's softmax runs
# while the next one's GEMMs occupy the tensor cores; coop is the same kernel without the turns.
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _softmax_fold(s, m_i, l_i, qk_scale, col0, n_k, row0, NEEDS_MASK, CAUSAL: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, FOLD: gl.constexpr):
    """_scores_to_p, or with FOLD the max taken on the raw scores and the scale folded into one FMA per
    score (exp2(s * c - m * c)); m_i is then in raw-score units (the epilogue scales it)."""
    if FOLD:
        if NEEDS_MASK:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(cols < n_k, 0)
            if CAUSAL:
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(keep, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2((m_i - m_new) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new * qk_scale, 1))  # contracted to one FMA (fp fusion)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_new, alpha
    else:
        return _scores_to_p(s, m_i, l_i, qk_scale, col0, n_k, row0, NEEDS_MASK, CAUSAL, BLOCK_M, BLOCK_N,
                            s_layout)


@gluon.jit
def _turn_wait(turn, WG: gl.constexpr, i, PINGPONG: gl.constexpr):
    if PINGPONG:  # WG 0 goes first (a fresh barrier's parity-1 wait passes), then waits for the last WG
        if WG == 0:
            mbarrier.wait(turn.index(0), (i & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WG), i & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, NUM_CONS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % NUM_CONS), count=1)


@gluon.jit
def _pp_consumer(q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                 o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h,
                 H: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, WG: gl.constexpr, NUM_CONS: gl.constexpr, PINGPONG: gl.constexpr,
                 FOLD: gl.constexpr):
    WG_M: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    row0 = start_m + WG * WG_M
    q = q_smem.index(WG)
    nblocks = gl.cdiv(n_k, BLOCK_N)
    tail = n_k - (nblocks - 1) * BLOCK_N

    m_i = gl.full([WG_M], -float("inf"), gl.float32, layout=row_layout)
    l_i = gl.full([WG_M], 0.0, gl.float32, layout=row_layout)
    acc = gl.zeros([WG_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bars.index(WG), 0)

    # Turn 0: S_0 alone.
    mbarrier.wait(k_ready.index(0), 0)
    _turn_wait(turn, WG, 0, PINGPONG)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _turn_pass(turn, WG, NUM_CONS, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_fold(s, m_i, l_i, qk_scale, 0, n_k, row0,
                                       _needs_mask(0, n_k, row0, BLOCK_N, CAUSAL), CAUSAL, WG_M, BLOCK_N,
                                       s_layout, FOLD)
    for j in range(1, nblocks):
        ks = j % STAGES
        vs = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(ks), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(vs), ((j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        _turn_wait(turn, WG, j, PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
        _turn_pass(turn, WG, NUM_CONS, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(ks), count=1)
        p, m_i, l_i, alpha = _softmax_fold(s, m_i, l_i, qk_scale, j * BLOCK_N, n_k, row0,
                                           _needs_mask(j, n_k, row0, BLOCK_N, CAUSAL), CAUSAL, WG_M, BLOCK_N,
                                           s_layout, FOLD)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        mbarrier.arrive(v_empty.index(vs), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    # The last P V; warpgroup 0 zeroes the rows of the last V tile past the keys (the next sequence's
    # tokens, maybe NaN) and signals the others through tail_bar.
    last = nblocks - 1
    vs = last % STAGES
    mbarrier.wait(v_ready.index(vs), (last // STAGES) & 1)
    if tail < BLOCK_N:
        if WG == 0:
            _zero_tail_rows(v_smem.index(vs), tail, BLOCK_N, D, 4)
            mbarrier.arrive(tail_bar, count=1)
        else:
            mbarrier.wait(tail_bar, 0)
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(vs), acc)
    if FOLD:
        m_i = m_i * qk_scale
    _epilogue(acc, m_i, l_i, o_ptr, lse_ptr, T, seq_start, n, row0, h, H, D, WG_M, o_layout, row_layout)


@gluon.jit
def _pp_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty,
                 seq_start, n_k, start_m, h, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 NUM_CONS: gl.constexpr):
    col = h * D
    for w in gl.static_range(NUM_CONS):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        _tma_load(q_desc, [seq_start + start_m + w * 64, col], q_bars.index(w), q_smem.index(w))
    nblocks = gl.cdiv(n_k, BLOCK_N)
    for j in range(nblocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        row = seq_start + j * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _issue_kv(k_desc, k_ready.index(slot), k_smem.index(slot), row, col, True)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _issue_kv(v_desc, v_ready.index(slot), v_smem.index(slot), row, col, True)


@gluon.jit
def _pingpong(q_desc, k_desc, v_desc, o_ptr, lse_ptr, T, qk_scale, seq_start, n, start_m, h,
              H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, NUM_CONS: gl.constexpr, PINGPONG: gl.constexpr,
              FOLD: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONS_REGS: gl.constexpr):
    if CAUSAL:
        n_k = gl.minimum(n, start_m + BLOCK_M)
    else:
        n_k = n
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CONS, 64, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_CONS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONS, 1], mbarrier.MBarrierLayout())
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_CONS):
        mbarrier.init(q_bars.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    mbarrier.init(tail_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONS)
        mbarrier.init(v_empty.index(i), count=NUM_CONS)
    fence_async_shared()

    # (tuples written out: concatenating them in the kernel turns their constexprs into tensors)
    if NUM_CONS == 2:
        gl.warp_specialize([
            (_pp_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                            o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_N, STAGES,
                            CAUSAL, 0, NUM_CONS, PINGPONG, FOLD)),
            (_pp_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                            o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_N, STAGES,
                            CAUSAL, 1, NUM_CONS, PINGPONG, FOLD)),
            (_pp_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty,
                            v_empty, seq_start, n_k, start_m, h, D, BLOCK_N, STAGES, NUM_CONS)),
        ], [4, 1], [CONS_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_pp_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                            o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_N, STAGES,
                            CAUSAL, 0, NUM_CONS, PINGPONG, FOLD)),
            (_pp_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                            o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_N, STAGES,
                            CAUSAL, 1, NUM_CONS, PINGPONG, FOLD)),
            (_pp_consumer, (q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty, v_empty, turn, tail_bar,
                            o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_N, STAGES,
                            CAUSAL, 2, NUM_CONS, PINGPONG, FOLD)),
            (_pp_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, k_empty,
                            v_empty, seq_start, n_k, start_m, h, D, BLOCK_N, STAGES, NUM_CONS)),
        ], [4, 4, 1], [CONS_REGS, CONS_REGS, PRODUCER_REGS])


@gluon.jit
def gluon_attention_fwd_kernel(q_desc, k_desc, v_desc, offsets_ptr, max_seq_len, T, qk_scale, o_ptr, lse_ptr,
                               H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, VARIANT: gl.constexpr,
                               NUM_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, NUM_CONS: gl.constexpr,
                               PINGPONG: gl.constexpr, FOLD: gl.constexpr, CONS_REGS: gl.constexpr):
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    seq_start = gl.load(offsets_ptr + b)
    n = gl.minimum(gl.load(offsets_ptr + b + 1) - seq_start, max_seq_len)
    start_m = pid_m * BLOCK_M
    if VARIANT == 3:
        if start_m < n:
            _pingpong(q_desc, k_desc, v_desc, o_ptr, lse_ptr, T, qk_scale, seq_start, n, start_m, h, H, D, BLOCK_M,
                      BLOCK_N, STAGES, CAUSAL, NUM_CONS, PINGPONG, FOLD, PRODUCER_REGS, CONS_REGS)
    elif start_m < n:
        if CAUSAL:
            n_k = gl.minimum(n, start_m + BLOCK_M)
        else:
            n_k = n
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)
        fence_async_shared()  # barrier inits visible to the async proxy (TMA) before the first copy

        if VARIANT == 2:
            gl.warp_specialize(
                [
                    (_compute, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                                v_empty, o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D,
                                BLOCK_M, BLOCK_N, STAGES, CAUSAL, NUM_WARPS, True, False)),
                    (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                                 v_empty, seq_start, n_k, start_m, h, D, BLOCK_N, STAGES)),
                ],
                [1],
                [PRODUCER_REGS],
            )
        else:
            _compute(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     o_ptr, lse_ptr, T, qk_scale, seq_start, n, n_k, start_m, h, H, D, BLOCK_M, BLOCK_N, STAGES,
                     CAUSAL, NUM_WARPS, VARIANT == 1, True)


# ---------------------------------------------------------------------------------------------------
# Configuration shared by the launcher and the compile check
# ---------------------------------------------------------------------------------------------------

SMEM_LIMIT = 232448  # H100/H200 dynamic shared memory per block


def parse_variant(variant: str) -> tuple[str, dict]:
    """'pingpong+bn64+s2+c3+fold' -> ('pingpong', {block_n: 64, stages: 2, cons: 3, fold: True})."""
    base, *mods = variant.split("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; bases {sorted(VARIANTS)}")
    out = {}
    for mod in mods:
        m = re.fullmatch(r"(bn|bm|s|c|r)(\d+)", mod)
        if mod == "fold":
            out["fold"] = True
        elif m:
            out[dict(bn="block_n", bm="block_m", s="stages", c="cons", r="regs")[m[1]]] = int(m[2])
        else:
            raise ValueError(f"unknown modifier {mod!r} in {variant!r} (bnN, bmN, sN, cN, rN, fold)")
    return base, out


def config(variant: str, D: int, block_m: int = 128, block_n: int | None = None, stages: int | None = None,
           causal: bool = False, cons: int | None = None, fold: bool = False, regs: int | None = None) -> dict:
    """Tiles, warps and registers of one variant at head dimension D."""
    base, mods = parse_variant(variant)
    block_m = mods.get("block_m", block_m)
    block_n = mods.get("block_n", block_n)
    stages = mods.get("stages", stages)
    cons = mods.get("cons", cons)
    fold = mods.get("fold", fold or base == "pingpong-fold")
    regs = mods.get("regs", regs)
    if base in PP_VARIANTS:
        # 64 query rows per consumer warpgroup, 2 consumers (+c3: 3 consumers, BLOCK_M 192, 160 registers
        # each; spills on 3.6 and 3.9 at D = 64 and D = 128, so not the default)
        if cons is None:
            cons = 2
        block_m = 64 * cons
        if block_n is None:
            block_n = 128 if D <= 128 else 64
        if stages is None:
            tile = 2 * block_n * D * 2
            stages = max(2, min(4, (SMEM_LIMIT - 2048 - block_m * D * 2) // tile))
        producer_regs = 24
        if regs is None:  # setmaxnreg: 24 for the producer, the rest split among the consumers, <= 240
            regs = min(240, (65536 - 128 * producer_regs) // (128 * cons) // 8 * 8)
        total_warps = 4 * (cons + 1)
        meta = dict(H=None, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                    VARIANT=VARIANTS[base], NUM_WARPS=4, PRODUCER_REGS=producer_regs, NUM_CONS=cons,
                    PINGPONG=base != "coop", FOLD=bool(fold), CONS_REGS=regs)
        options = dict(num_warps=4, num_stages=1, maxnreg=(65536 // (total_warps * 32)) // 8 * 8)
        return dict(meta=meta, options=options)
    if block_n is None:
        block_n = 64 if D > 128 else 128
    if stages is None:  # as deep as shared memory allows, 2 to 4
        tile = 2 * block_n * D * 2  # one K and one V tile, bfloat16
        stages = max(2, min(4, (SMEM_LIMIT - 8192 - block_m * D * 2) // tile))
    num_warps = block_m // 16  # one 16-row wgmma slice per warp: 8 warps = 2 warpgroups for 128 rows
    meta = dict(H=None, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                VARIANT=VARIANTS[base], NUM_WARPS=num_warps, PRODUCER_REGS=24, NUM_CONS=1, PINGPONG=False,
                FOLD=False, CONS_REGS=0)
    options = dict(num_warps=num_warps, num_stages=1)
    if base == "ws":
        # 1 producer warp rounds to a warpgroup: 4 * (num_warps / 4 + 1) warps in all; registers are given
        # per warpgroup (setmaxnreg), from maxnreg over all of them: producer 24, compute the rest.
        total = num_warps + 4
        options["maxnreg"] = (65536 // (total * 32)) // 8 * 8
    return dict(meta=meta, options=options)


def q_rows(meta: dict) -> int:
    """Rows of the Q descriptor's box: one consumer's 64 in the pingpong kernels, else BLOCK_M."""
    return 64 if meta["VARIANT"] == 3 else meta["BLOCK_M"]


def smem_bytes(meta: dict) -> int:
    return 2 * meta["D"] * (meta["BLOCK_M"] + 2 * meta["STAGES"] * meta["BLOCK_N"])


# ---------------------------------------------------------------------------------------------------
# JAX launcher (jax-triton 0.4.1)
# ---------------------------------------------------------------------------------------------------


def gluon_forward(q, k, v, offsets, max_seq_len: int, scale: float, variant: str = "pipe",
                  causal: bool = False, zero_fill: bool = True, **tiles):
    """(o [T, H, D] bf16, lse [H, T] f32). Tokens no sequence covers are 0 when zero_fill (jax-triton's
    memset of the outputs), else undefined."""
    import jax
    import jax.numpy as jnp

    from jagged_flash_jax.launch import gpu

    jt = gpu.jax_triton_module()  # the project's shims first (TMA_TF32 under triton 3.6, launch warps)
    patch_is_im2col(jt)
    T, H, D = q.shape
    B = offsets.shape[0] - 1
    cfg = config(variant, D, causal=causal, **tiles)
    meta = dict(cfg["meta"], H=H)
    bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
    descs = []
    for x, rows in ((q, q_rows(meta)), (k, bn), (v, bn)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(jt.TensorDescriptor.from_array(x.reshape(T, H * D), (rows, D), layout=layout))
    options = dict(cfg["options"])
    num_warps = options.pop("num_warps")
    num_stages = options.pop("num_stages")
    out_type = (jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((H, T), jnp.float32))
    o, lse = jt.triton_call(
        *descs, offsets.astype(jnp.int32), int(max_seq_len), int(T), float(scale * LOG2E),
        kernel=gluon_attention_fwd_kernel, out_type=out_type,
        grid=(triton.cdiv(max_seq_len, bm), H, B), num_warps=num_warps, num_stages=num_stages,
        backend_options=options or None, zeroed_outputs=(0, 1) if zero_fill else (), **meta)
    return o, lse


# ---------------------------------------------------------------------------------------------------
# Compile check without a GPU
# ---------------------------------------------------------------------------------------------------


def compile_only(variant: str, D: int, causal: bool = False, H: int = 8, **tiles) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config(variant, D, causal=causal, **tiles)
    meta = dict(cfg["meta"], H=H)
    bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        return f"tensordesc<bf16[{rows},{D}],{layout!r}>"  # the string jax-triton 0.4.1 builds

    signature = dict(q_desc=desc(q_rows(meta)), k_desc=desc(bn), v_desc=desc(bn), offsets_ptr="*i32", max_seq_len="i32",
                     T="i32", qk_scale="fp32", o_ptr="*bf16", lse_ptr="*fp32")
    signature.update({name: "constexpr" for name in meta})
    attrs = {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name.endswith("_ptr")}
    src = GluonASTSource(gluon_attention_fwd_kernel, signature, meta, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=cfg["options"])
    ptx = compiled.asm["ptx"]
    md = compiled.metadata
    reqntid = re.search(r"\.reqntid\s+(\d+)", ptx)
    info = dict(variant=variant, D=D, causal=causal, BLOCK_M=bm, BLOCK_N=bn, STAGES=meta["STAGES"],
                NUM_CONS=meta["NUM_CONS"], CONS_REGS=meta["CONS_REGS"],
                num_warps=cfg["options"]["num_warps"], maxnreg=cfg["options"].get("maxnreg"),
                threads=int(reqntid[1]) if reqntid else None, n_regs=getattr(md, "n_regs", None),
                n_spills=getattr(md, "n_spills", None), shared=md.shared,
                setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                bar_sync=len(re.findall(r"\bbar(?:rier)?\.sync", ptx)),
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                wait_groups=sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))))
    info.update(ptxas_v(compiled))
    return info


def ptxas_v(compiled) -> dict:
    """Registers, spills and stack from `ptxas -v` on the PTX (the cubin metadata lacks spills on 3.6)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler as nv

    try:  # the ptxas Triton itself used for sm_90 (3.9: ptxas-blackwell; 3.6: ptxas)
        ptxas = nv.get_ptxas(90).path
    except Exception:
        ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        maxnreg = getattr(compiled.metadata, "maxnreg", None)
        cmd = [ptxas, "-v", "-arch=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")]
        if maxnreg:
            cmd += [f"--maxrregcount={maxnreg}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return dict(ptxas_regs=int(regs[1]) if regs else None,
                ptxas_spill_stores=int(spill[1]) if spill else None,
                ptxas_spill_loads=int(spill[2]) if spill else None, ptxas_stack=int(stack[1]) if stack else None,
                **({} if regs else {"ptxas_out": text[-800:]}))


def describe(err: BaseException) -> str:
    """The exception, and the innermost cause (a Gluon CompilationError wraps the real message)."""
    root = err
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(err).__name__}: {str(err)[-1500:]}"
    if root is not err:
        text += f"\n  root cause {type(root).__name__}: {str(root)[-1500:]}"
    return text


def run_compile_only(variants, dims, causal_too: bool) -> int:
    log(f"triton {triton.__version__}; gl.warp_specialize{inspect.signature(gl.warp_specialize)}")
    failures = 0
    for variant in variants:
        for D in dims:
            for causal in ((False, True) if causal_too else (False, )):
                start = time.perf_counter()
                try:
                    info = compile_only(variant, D, causal=causal)
                    info["seconds"] = round(time.perf_counter() - start, 1)
                    log("OK  ", info)
                except Exception as err:
                    failures += 1
                    log(f"FAIL {variant} D={D} causal={causal}: {describe(err)}")
    return failures


# ---------------------------------------------------------------------------------------------------
# GPU: correctness against a float32 reference, then CUPTI times against the package and cuDNN
# ---------------------------------------------------------------------------------------------------

CASES = {
    # name: (D, lengths: "random" | "full", max_seq_len, NaN in the tokens no sequence covers[, causal])
    "jagged": (128, "random", 4096, False),
    "uniform": (128, "full", 4096, False),
    "d64": (64, "full", 4096, False),
    "d256": (256, "full", 4096, False),
    "causal": (128, "random", 4096, False, True),
    # lengths up to 4096 truncated to 3000: the tokens of each long sequence past 3000 (read by that
    # sequence's last tiles) hold NaN, and so do 512 tokens after the last sequence
    "nan": (128, "random", 3000, True),
}
B, H, L, PAD = 16, 8, 4096, 512


def make_case(name: str, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    D, kind, max_seq_len, nan, *rest = CASES[name]
    causal = bool(rest and rest[0])
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, L + 1, size=B) if kind == "random" else np.full(B, L)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(offsets[-1]) + (PAD if nan else 0)
    q, k, v = (rng.standard_normal((T, H, D), dtype=np.float32) for _ in range(3))
    n = np.minimum(lengths, max_seq_len)
    covered = np.zeros(T, bool)
    for b in range(B):
        covered[offsets[b]:offsets[b] + n[b]] = True
    if nan:
        for x in (q, k, v):
            x[~covered] = np.nan
    to = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    flops = 4.0 * H * D * float(np.sum(n.astype(np.float64) ** 2))
    if causal:
        flops = 2.0 * H * D * float(np.sum(n.astype(np.float64) * (n + 1)))
    return dict(q=to(q), k=to(k), v=to(v), offsets=jnp.asarray(offsets), max_seq_len=max_seq_len, causal=causal,
                n=n, offsets_np=offsets, covered=covered, D=D, T=T, scale=1.0 / math.sqrt(D),
                flops=flops)


def padded(case, x):
    """[T, H, D] -> [B, L, H, D] (zeros past each sequence's n), and the mask [B, L]."""
    import jax.numpy as jnp
    import numpy as np

    idx = case["offsets_np"][:-1, None] + np.arange(L)[None, :]
    valid = np.arange(L)[None, :] < case["n"][:, None]
    idx = np.where(valid, idx, 0)
    xp = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=0).reshape(B, L, *x.shape[1:])
    return jnp.where(jnp.asarray(valid)[:, :, None, None], xp, 0), valid


def reference(case):
    """(o [B, L, H, D] f32, lse [B, H, L] f32) per sequence, float32 throughout."""
    import jax
    import jax.numpy as jnp

    qp, valid = padded(case, case["q"])
    kp, _ = padded(case, case["k"])
    vp, _ = padded(case, case["v"])
    scale, causal = case["scale"], case["causal"]

    def one(args):
        q, k, v, m = args
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGH) * scale
        keep = m[None, None, :]
        if causal:
            keep = keep & (jnp.arange(L)[None, None, :] <= jnp.arange(L)[None, :, None])
        s = jnp.where(keep, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        o = jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGH)
        return o, lse

    return jax.jit(lambda a: jax.lax.map(one, a))((qp, kp, vp, jnp.asarray(valid)))


def check(case, o, lse, ref) -> str:
    import jax.numpy as jnp
    import numpy as np

    o_ref, lse_ref = ref
    op, valid = padded(case, o.astype(jnp.float32))
    vmask = jnp.asarray(valid)[:, :, None, None]
    diff = jnp.where(vmask, op - o_ref, 0)
    want = jnp.where(vmask, o_ref, 0)
    rel = float(jnp.linalg.norm(diff) / jnp.linalg.norm(want))
    # lse [H, T] -> [B, H, L]
    lse_bt, _ = padded(case, jnp.transpose(lse)[:, :, None])
    lse_bt = jnp.transpose(lse_bt[..., 0], (0, 2, 1))
    lmask = jnp.asarray(valid)[:, None, :]
    lse_err = float(jnp.max(jnp.where(lmask, jnp.abs(lse_bt - lse_ref), 0)))
    covered = case["covered"]
    o_np = np.asarray(o.astype(jnp.float32))
    finite = bool(np.isfinite(o_np[covered]).all()) and bool(np.isfinite(np.asarray(lse)[:, covered]).all())
    uncovered_zero = bool((o_np[~covered] == 0).all()) if (~covered).any() else True
    ok = rel < 1e-2 and lse_err < 1e-2 and finite and uncovered_zero
    return (f"{'PASS' if ok else 'FAIL'} rel_err(o)={rel:.2e} max|lse-ref|={lse_err:.2e} finite={finite} "
            f"uncovered_tokens_zero={uncovered_zero}")


def patch_is_im2col(jt) -> None:
    """jax-triton 0.4.1 requires an `is_im2col` key in every tensordesc_meta entry (CompilationResult's
    __post_init__); triton 3.6's metadata has none. Entries missing it get False; idempotent."""
    cls = jt.triton_lib.CompilationResult
    if getattr(cls.__post_init__, "_adds_is_im2col", False):
        return
    original = cls.__post_init__

    def __post_init__(self):
        if self.tensordesc_meta is not None:
            self.tensordesc_meta = [m if "is_im2col" in m else dict(m, is_im2col=False)
                                    for m in self.tensordesc_meta]
        original(self)

    __post_init__._adds_is_im2col = True
    cls.__post_init__ = __post_init__


def gpu_main(args, variants) -> int:
    t0 = time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - t0:6.1f}s]"  # noqa: E731
    import jax
    import jax.numpy as jnp

    from jagged_flash_jax.launch import gpu

    try:
        jt = gpu.jax_triton_module()  # applies the project's shims before anything else imports jax_triton
    except Exception as err:
        log(stamp(), f"jax_triton unavailable: {describe(err)}")
        return 2
    patch_is_im2col(jt)
    log(stamp(), f"jax {jax.__version__} {jax.devices()[0].device_kind}; triton {triton.__version__}; "
        f"jax_triton {getattr(jt, '__version__', '?')}; variants {variants}")
    try:
        from benchmarks import timing
    except Exception as err:
        timing = None
        log("no benchmarks.timing:", describe(err))
    failures = 0
    for name in [c for c in args.cases.split(",") if c]:
        try:
            case = make_case(name)
            ref = jax.block_until_ready(reference(case))
            log(stamp(), f"case {name}: T={case['T']} D={case['D']} max_seq_len={case['max_seq_len']} "
                f"sum(n)={int(case['n'].sum())} GFLOP={case['flops'] / 1e9:.1f}")
        except Exception as err:
            failures += 1
            log(stamp(), f"case {name}: setup FAILED {describe(err)}")
            traceback.print_exc()
            continue
        q, k, v, offsets, msl, scale, causal = (case[x] for x in ("q", "k", "v", "offsets", "max_seq_len", "scale",
                                                                 "causal"))
        fns = {}
        for variant in variants:
            fn = jax.jit(lambda q, k, v, off, variant=variant, msl=msl, scale=scale, causal=causal: gluon_forward(
                q, k, v, off, msl, scale, variant, causal=causal))
            log(stamp(), f"  gluon {variant} launching (a hang here is this variant's)")
            try:
                o, lse = jax.block_until_ready(fn(q, k, v, offsets))
                verdict = check(case, o, lse, ref)
                failures += verdict.startswith("FAIL")
                log(stamp(), f"  gluon {variant:5s} {verdict}")
                fns[f"gluon-{variant}"] = fn
            except Exception as err:
                failures += 1
                log(stamp(), f"  gluon {variant:5s} FAILED {describe(err)}")
                traceback.print_exc()
        if args.no_time or timing is None:
            continue
        import jagged_flash_jax

        fns["package-triton"] = jax.jit(lambda q, k, v, off, msl=msl, scale=scale, causal=causal: (
            jagged_flash_jax.jagged_attention(
                q, k, v, off, msl, scale=scale, causal=causal, backend="triton")))
        if not CASES[name][3]:
            qp, _ = padded(case, q)
            kp, _ = padded(case, k)
            vp, _ = padded(case, v)
            lens = jnp.asarray(case["n"], jnp.int32)
            cudnn = jax.jit(lambda qp, kp, vp, lens, scale=scale, causal=causal: jax.nn.dot_product_attention(
                qp, kp, vp, scale=scale, is_causal=causal, implementation="cudnn", query_seq_lengths=lens,
                key_value_seq_lengths=lens))
        for label, fn in list(fns.items()) + ([("cudnn", None)] if not CASES[name][3] else []):
            try:
                if label == "cudnn":
                    program, arg_sets = timing.every_set(cudnn), [(qp, kp, vp, lens)]
                else:
                    program, arg_sets = timing.every_set(fn), [(q, k, v, offsets)]
                jax.block_until_ready(program(arg_sets))  # compile and warm up
                row = timing.device_ms(program, arg_sets, iterations=5)
                if "device_ms" not in row:
                    log(stamp(), f"  time {label:15s} {row}")
                    continue
                ms = row["device_ms"]
                log(stamp(), f"  time {label:15s} {ms:8.3f} ms  {case['flops'] / ms / 1e9:6.1f} TF/s  "
                    f"kernels {row['kernels']}")
            except Exception as err:
                log(stamp(), f"  time {label:15s} FAILED {describe(err)}")
    log(stamp(), f"done, {failures} failure(s)")
    return 1 if failures else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a here, no GPU")
    parser.add_argument("--variant", default="basic,pipe,ws,coop,pingpong,pingpong-fold",
                        help="comma-separated: basic, pipe, ws, coop, pingpong, pingpong-fold, each with optional "
                             "modifiers +bnN (BLOCK_N) +sN (stages) +cN (consumer warpgroups, pingpong kinds) "
                             "+rN (consumer registers) +fold, e.g. pingpong+bn64+s4")
    parser.add_argument("--dims", default="64,128,256", help="head dimensions for --compile-only")
    parser.add_argument("--causal", action="store_true", help="also the causal kernels")
    parser.add_argument("--cases", default="jagged,uniform,d64,nan,causal,d256", help="GPU cases")
    parser.add_argument("--no-time", action="store_true", help="correctness only")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = [v for v in args.variant.split(",") if v]
    if args.compile_only:
        return 1 if run_compile_only(variants, [int(d) for d in args.dims.split(",")], args.causal) else 0
    return gpu_main(args, variants)


if __name__ == "__main__":
    sys.exit(main())
