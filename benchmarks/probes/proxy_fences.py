"""Where Triton puts async-proxy fences (`fence.proxy.async`, which ptxas makes MEMBAR.ALL.CTA and
FENCE.VIEW.ASYNC.S) in kernels that feed wgmma, under the installed Triton, compiled for sm_90a. No GPU
needed. Run from the repository root: python -m benchmarks.probes.proxy_fences (triton from PYTHONPATH).

1. The portable kernels' launches of `benchmarks.probes.ptx`'s cases: fences in the PTX, and how many
   sit inside a loop (between a label and a later branch back to it). Triton >= 3.7 fences both products
   of every key tile, since their K and V tiles reach shared memory by cp.async, a write of the generic
   proxy, and wgmma reads through the async proxy (triton-lang/triton#9610); 3.6 fenced once per loop.
2. A minimal attention loop (S = Q K^T, an online softmax, O += P V; 64 x 64 tiles, D = 64, 4 warps, 3
   stages) with K and V by pointer loads (cp.async) and by TMA descriptor loads, whose writes are the
   async proxy's: whether the loop keeps its fences.
"""

from __future__ import annotations

import json
import re

import triton
import triton.language as tl

from benchmarks.probes import ptx as ptx_probe

PORTABLE_KERNELS = ("attention_fwd_kernel", "attention_fwd_tma_kernel", "attention_bwd_kernel")
FENCE = "fence.proxy.async"


def fences(ptx: str) -> tuple[int, int]:
    """(fences in the PTX, fences inside a loop)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"(\$L__BB\d+_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line))
             and labels.get(m.group(1), i) < i]
    at = [i for i, line in enumerate(lines) if FENCE in line]
    return len(at), sum(any(lo <= i <= hi for lo, hi in loops) for i in at)


def portable_launches() -> None:
    seen = set()
    for case, launches in ptx_probe.capture().items():
        for launch in launches:
            key = ptx_probe._launch_key(launch)
            if launch["kernel"] not in PORTABLE_KERNELS or key in seen:
                continue
            seen.add(key)
            kernel = ptx_probe._kernel(launch["kernel"])
            signature, attrs = ptx_probe.kernel_signature(kernel, launch)
            ptx, _ = ptx_probe.compile_quietly(kernel, signature, launch["constants"], attrs,
                                               launch["num_warps"], launch["num_stages"],
                                               launch.get("backend_options"))
            total, in_loops = fences(ptx)
            c = launch["constants"]
            tiles = [c.get(name) for name in ("BLOCK_M", "BLOCK_N")]
            tiles += [launch["num_warps"], launch["num_stages"]]
            dtype = launch["arrays"][0]["dtype"]
            print(f"{case:48s} {launch['kernel']:22s} D={c['D']:<3d} {dtype:8s} {json.dumps(tiles):18s} "
                  f"fences {total:2d}, in loops {in_loops:2d}", flush=True)


@triton.jit
def _step(q, k, v, acc, row_max, row_sum):
    s = tl.dot(q, tl.trans(k))
    new_max = tl.maximum(row_max, tl.max(s, 1))
    p = tl.math.exp2(s - new_max[:, None])
    correction = tl.math.exp2(row_max - new_max)
    row_sum = row_sum * correction + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
    return acc, new_max, row_sum


@triton.jit
def attention_loop(q_ptr, k_src, v_src, o_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, TMA: tl.constexpr):
    """o = softmax(q k^T) v of one BLOCK_M x D query tile over n keys, k and v read by pointer loads
    (k_src, v_src pointers: cp.async) or by TMA (descriptors of [BLOCK_N, D] tiles)."""
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + cols[None, :])
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    row_max = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n, BLOCK_N):
        if TMA:
            k, v = k_src.load([start, 0]), v_src.load([start, 0])
        else:
            keys = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_src + keys[:, None] * D + cols[None, :])
            v = tl.load(v_src + keys[:, None] * D + cols[None, :])
        acc, row_max, row_sum = _step(q, k, v, acc, row_max, row_sum)
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], (acc / row_sum[:, None]).to(tl.bfloat16))


def minimal_loops(block_m: int = 64, block_n: int = 64, dim: int = 64, warps: int = 4,
                  stages: int = 3) -> None:
    for tma, kv in ((False, "*bf16"), (True, f"tensordesc<bf16[{block_n},{dim}]>")):
        constants = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=dim, TMA=tma)
        signature = dict(q_ptr="*bf16", k_src=kv, v_src=kv, o_ptr="*bf16", n="i32",
                         **dict.fromkeys(constants, "constexpr"))
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
                 if kind.startswith("*")}
        ptx, _ = ptx_probe.compile_quietly(attention_loop, signature, constants, attrs, warps, stages)
        total, in_loops = fences(ptx)
        name = "loop_by_tma" if tma else "loop_by_pointers"
        print(f"{name:48s} TMA copies {ptx.count('cp.async.bulk.tensor'):2d}, "
              f"fences {total}, in the loop {in_loops}", flush=True)


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    portable_launches()
    minimal_loops()


if __name__ == "__main__":
    main()
