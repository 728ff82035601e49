"""Probe: a forward with TMA descriptors and Triton's Hopper warp specialization (`tl.range(...,
warp_specialize=True)`), against the package's forward and cuDNN, over tile variants, on a few cases
(bfloat16). Prints the difference to the package's output and log-sum-exp, and CUPTI device times.
A variant is BMxBNxWARPSxSTAGES, with ":ws" for warp specialization (":wsN": diagnostic bits N of
ws_fwd_kernel); without ":ws" the same straight-line kernel runs unspecialized.

    python -m benchmarks.probes.hopper_fwd --cases long,L16384 --variants 128x64x4x3,128x128x8x2:ws
"""

# The closures below run inside the loop iteration that makes them.
# ruff: noqa: B023

import argparse
import dataclasses
import math
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from jagged_flash_jax import api, configs
from jagged_flash_jax.kernels import params as param
from jagged_flash_jax.kernels.common import (
    INF,
    _bounds,
    _causal_shift,
    _key_ranges,
    _params,
    _program,
    _rows,
    _stats,
    _store,
    _zero_tail,
    _zero_uncovered,
)
from jagged_flash_jax.launch import gpu, plan

from .. import cases, impls, timing

# ---------------------------------------------------------------------------------------------------
# The experiment's kernels (not the package's): a forward whose key loop Triton's Hopper warp
# specialization can take (one loop, straight-line code: no early return, every block masked), and the
# zero fill it then needs in a launch of its own, aliased to the output.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _sequence_descriptor(ptr, segment, head, seq_start, length, num_tokens, token_stride, head_stride,
                         D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A device-made TMA descriptor of the `length` rows of one head of a sequence ([length, D]); an
    empty sequence's has one row, at its segment's first token, never read."""
    first = tl.where(length > 0, seq_start, 0)
    return tl.make_tensor_descriptor(_rows(ptr, segment, head, first, num_tokens, token_stride, head_stride),
                                     shape=[tl.maximum(length, 1), D], strides=[token_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])



@triton.jit
def _fwd_tile(acc, row_sum, row_max, q, k_desc, v_desc, key_start, query_rows, n_k, shift,
              QK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """One online-softmax step over the keys [key_start, +BLOCK_N) (see kernels._fwd_block)."""
    k = k_desc.load([key_start, 0])
    scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if MASKED:
        key_rows = key_start + tl.arange(0, BLOCK_N)
        keep = key_rows[None, :] < n_k
        if CAUSAL:
            keep = keep & (key_rows[None, :] <= query_rows[:, None] + shift)
        scores = tl.where(keep, scores, -INF)
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    if MASKED and CAUSAL:
        new_max_safe = tl.where(new_max == -INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    p = tl.math.exp2((scores - new_max_safe[:, None]) * QK_SCALE)
    correction = tl.math.exp2((row_max - new_max_safe) * QK_SCALE)
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    v = v_desc.load([key_start, 0])
    acc = acc * correction[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    return acc, row_sum, new_max


@triton.jit
def _attention_program(batch, slots, NUM_HEADS: tl.constexpr):
    """(segment, sequence, head, block) of a program of a grid with no zero-fill programs (two axes,
    or one with a sequence's blocks adjacent; see kernels._program). Blocks count down."""
    if tl.num_programs(1) == 1:
        pid = tl.program_id(0)
        slot = pid % slots
        head_sequence = pid // slots
    else:
        slot = tl.program_id(1)
        head_sequence = tl.program_id(0)
    head = head_sequence % NUM_HEADS
    segment_sequence = head_sequence // NUM_HEADS
    return segment_sequence // batch, segment_sequence % batch, head, slots - 1 - slot


@triton.jit
def zero_fill_kernel(
    offsets_ptr, params_ptr, x_ptr,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, MAX_LEN: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    (batch, tokens, _, token_stride, head_stride, _, _, offsets_stride, _) = _params(params_ptr, STRIDE_ALIGN)
    fill_chunk = tl.load(params_ptr + 9)
    segment, sequence, head, slot = _program(batch, tl.load(params_ptr + 10), NUM_HEADS)
    offsets_ptr += segment * offsets_stride
    if sequence == batch:
        _zero_uncovered(x_ptr, x_ptr, offsets_ptr, batch, segment, head, slot, fill_chunk, tokens,
                        token_stride, head_stride, MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=False)
    elif slot == 0:
        _zero_tail(x_ptr, x_ptr, offsets_ptr, sequence, segment, head, tokens, token_stride, head_stride,
                   MAX_LEN, D, BLOCK_D, FILL_BLOCK, TWO=False)


@triton.jit
def ws_fwd_kernel(
    q_ptr, k_ptr, v_ptr, q_offsets_ptr, kv_offsets_ptr, params_ptr,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, DIAG: tl.constexpr,
):
    """DIAG bits: 1 = no mask in the loop, 2 = o stored through a descriptor, 4 = no lse store."""
    (batch, q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
     q_offsets_stride, kv_offsets_stride) = _params(params_ptr, STRIDE_ALIGN)
    pid = tl.program_id(0)
    slots = tl.load(params_ptr + 10)
    one_axis = tl.num_programs(1) == 1
    slot = tl.where(one_axis, pid % slots, tl.program_id(1))
    head_sequence = tl.where(one_axis, pid // slots, pid)
    head = head_sequence % NUM_HEADS
    segment = head_sequence // NUM_HEADS // batch
    sequence = head_sequence // NUM_HEADS % batch
    block = slots - 1 - slot
    q_offsets_ptr += segment * q_offsets_stride
    kv_offsets_ptr += segment * kv_offsets_stride
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    kv_head = head // KV_GROUP
    query_start = block * BLOCK_M
    k_desc = _sequence_descriptor(k_ptr, segment, kv_head, kv_start, n_k, kv_tokens, kv_token_stride,
                                  kv_head_stride, D=D, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = _sequence_descriptor(v_ptr, segment, kv_head, kv_start, n_k, kv_tokens, kv_token_stride,
                                  kv_head_stride, D=D, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    q_desc = _sequence_descriptor(q_ptr, segment, head, q_start, n_q, q_tokens, q_token_stride,
                                  q_head_stride, D=D, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    cols = tl.arange(0, BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = q_desc.load([query_start, 0])
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -INF, dtype=tl.float32)
    shift = _causal_shift(n_q, n_k, CAUSAL)
    clean_end, end = _key_ranges(query_start, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    end = tl.where(query_start < n_q, end, 0)
    for key_start in tl.range(0, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, row_sum, row_max = _fwd_tile(acc, row_sum, row_max, q, k_desc, v_desc, key_start, query_rows,
                                          n_k, shift, QK_SCALE=QK_SCALE, BLOCK_N=BLOCK_N,
                                          INPUT_PRECISION=INPUT_PRECISION, MASKED=DIAG % 2 == 0,
                                          CAUSAL=CAUSAL)
    attended = row_sum > 0
    acc = acc * (OUT_SCALE / tl.where(attended, row_sum, 1.0))[:, None]
    if DIAG // 2 % 2 == 1:
        o_desc = tl.make_tensor_descriptor(
            _rows(o_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride),
            shape=[n_q, D], strides=[q_token_stride, 1], block_shape=[BLOCK_M, BLOCK_D])
        o_desc.store([query_start, 0], acc.to(o_desc.dtype))
    else:
        _store(_rows(o_ptr, segment, head, q_start, q_tokens, q_token_stride, q_head_stride), query_rows,
               cols, n_q, acc, q_token_stride, D, BLOCK_D)
    lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), INF)
    lse_base = _stats(lse_ptr, segment, head, q_start, q_tokens, NUM_HEADS)
    if DIAG // 4 % 2 == 0:
        tl.store(lse_base + query_rows, lse, mask=query_rows < n_q)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="long")
    ap.add_argument("--variants", default="128x64x4x3,128x128x8x2,128x64x4x2:ws,128x128x4x2:ws")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--cudnn", action="store_true")
    ap.add_argument("--uniform", action="store_true", help="every sequence max_seq_len long")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", DeprecationWarning)  # jax-triton's input_output_aliases
    jt = gpu.jax_triton_module()  # with the package's shims for jax-triton 0.4.1
    run = gpu.run

    def hopper(p, q, k, v, off, kv_off, cfg, ws, diag=0):
        common, constants = plan._common(p)
        blocks = p.blocks(cfg.block_m, p.q_tokens, p.max_seq_len)
        slots = p.forward_slots

        def params(fill_chunk, slots):
            return plan._pack({**common, param.FWD_FILL_CHUNK: fill_chunk, param.FWD_SLOTS: slots,
                               param.FWD_V_D_STRIDE: 0})

        heads = p.num_segments * p.batch * p.num_heads
        one_axis = plan._grid(p, q.dtype.itemsize, blocks)
        grid = (heads * blocks,) if len(one_axis) == 1 else (heads, blocks)
        call = plan.KernelCall(
            ws_fwd_kernel, grid=grid,
            out_shapes=(jax.ShapeDtypeStruct(p.q_shape, q.dtype),
                        jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
            params=params(0, blocks),
            constants=dict(constants, OUT_SCALE=p.out_scale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           WARP_SPECIALIZE=ws, DIAG=diag),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        o, lse = run(call, (q, k, v, off, kv_off, plan._params(call)))
        fill_params = jnp.asarray(params(plan._fill_chunk(p.q_tokens, slots), slots), jnp.int32)
        c = constants
        (o,) = jt.triton_call(off, fill_params, o, kernel=zero_fill_kernel,
                              out_type=(jax.ShapeDtypeStruct(p.q_shape, q.dtype),),
                              grid=(p.sequence_heads, slots), input_output_aliases={2: 0}, num_warps=4,
                              num_stages=1, NUM_HEADS=c["NUM_HEADS"], D=c["D"], BLOCK_D=c["BLOCK_D"],
                              MAX_LEN=c["Q_MAX_LEN"], STRIDE_ALIGN=c["STRIDE_ALIGN"],
                              FILL_BLOCK=c["FILL_BLOCK"])
        return o, lse

    rows = []
    for case in cases.select(args.cases.split(","), quick=False):
        if args.uniform:
            case = dataclasses.replace(case, min_len=case.max_seq_len)
        sets = cases.input_sets(case, "bfloat16", 2)
        s = sets[0]
        scale = 1 / math.sqrt(case.head_dim)
        base = api._problem(s.q, s.k, s.v, s.offsets, s.kv_offsets, max_seq_len=case.max_seq_len,
                            kv_max_seq_len=case.kv_max_seq_len, scale=scale, out_scale=1.0,
                            causal=case.causal, layout="THD", allow_tf32=True, backend="xla",
                            block_sizes=None, self_attention=case.kv_len is None, validate=False)
        base = base.with_(backend="triton")
        flops = case.flops("fwd")

        def timed(fn, label, extra=""):
            prog = timing.every_set(fn)
            t = timing.device_ms(prog, [(x.q, x.k, x.v, x.offsets[None], x.kv_offsets[None]) for x in sets],
                                 args.iterations)
            ms = t.get("device_ms", float("nan"))
            rows.append((case.name, label, ms, flops / ms / 1e9 if ms == ms else 0, extra))
            print(f"{case.name:14s} {label:22s} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TF/s {extra} "
                  f"{t.get('timer_note', '')}", flush=True)

        ref_o, ref_lse = jax.jit(lambda *a: plan.forward(run, base, *a))(
            s.q, s.k, s.v, s.offsets[None], s.kv_offsets[None])
        timed(lambda *a: plan.forward(run, base, *a)[0], f"portable {base.block_sizes.fwd}")
        for variant in args.variants.split(","):
            spec, _, flag = variant.partition(":")
            bm, bn, w, st = (int(x) for x in spec.split("x"))
            cfg = configs.KernelConfig(bm, bn, w, st)
            p = base.with_(block_sizes=configs.fit_to_lengths(
                configs.BlockSizes(cfg, base.block_sizes.dkdv, base.block_sizes.dq),
                case.max_seq_len, case.kv_max_seq_len))
            cfg = p.block_sizes.fwd
            ws = flag.startswith("ws")
            diag = int(flag[2:] or 0) if ws else 0
            try:
                fn = jax.jit(lambda *a: hopper(p, *a, cfg=cfg, ws=ws, diag=diag))
                o, lse = fn(s.q, s.k, s.v, s.offsets[None], s.kv_offsets[None])
                err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref_o.astype(jnp.float32))))
                fin = np.isfinite(np.asarray(ref_lse))
                lse_err = float(np.max(np.abs(np.where(fin, np.asarray(lse) - np.asarray(ref_lse), 0))))
                same_inf = bool(np.all(fin == np.isfinite(np.asarray(lse))))
                timed(lambda *a: hopper(p, *a, cfg=cfg, ws=ws, diag=diag)[0], f"hopper {variant}",
                      f"max|o-o_portable| {err:.2e} lse {lse_err:.2e} inf-same {same_inf}")
            except Exception as e:
                print(f"{case.name:14s} hopper {variant} FAILED {type(e).__name__}: {str(e)[:400]}",
                      flush=True)
                traceback.print_exc(limit=2)
        if args.cudnn:
            for name in ("cudnn-packed", "cudnn-padded"):
                try:
                    attend, prepare = impls.IMPLS[name][0](case)
                    prepared = [prepare(x) for x in sets]
                    prog = timing.every_set(lambda q, k, v, aux: attend(q, k, v, *aux))
                    t = timing.device_ms(prog, [(a[0], a[1], a[2], a[4]) for a in prepared], args.iterations)
                    ms = t.get("device_ms", float("nan"))
                    print(f"{case.name:14s} {name:22s} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TF/s", flush=True)
                except Exception as e:
                    print(f"{case.name:14s} {name} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
