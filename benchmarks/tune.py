"""Sweep kernel tiles on the GPU and report the fastest per case, dtype and kernel.

    python -m benchmarks.tune --out results/tune.json

One worker process per (case, dtype) compiles its candidates in parallel with the others; timing is
serialized by a file lock so that only one worker uses the GPU at a time. Times are CUPTI device
times per kernel (jax.experimental.mosaic.gpu.profiler), medians over iterations. The chosen tiles
go into jagged_flash_jax/configs.py by hand, with the JSON committed beside them.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.cases import CASES, CASES_BY_NAME

# (block_m, block_n, num_warps, num_stages), pruned to those that compile for sm_90 without spills.
CANDIDATES = {
    "narrow": {  # 16-bit inputs
        64: {
            "fwd": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
                    (64, 32, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2)],
            "dkdv": [(32, 64, 4, 2), (32, 128, 4, 2), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 3),
                     (16, 64, 4, 2), (32, 128, 8, 2), (64, 64, 8, 2)],
            "dq": [(64, 32, 4, 2), (128, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3),
                   (64, 16, 4, 2), (128, 32, 8, 2), (128, 64, 4, 2)],
        },
        128: {
            "fwd": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                    (64, 128, 4, 2), (128, 64, 4, 3), (64, 64, 4, 2)],
            "dkdv": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 4, 3),
                     (16, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 3)],
            "dq": [(128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 4, 3),
                   (128, 16, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)],
        },
    },
    "wide": {  # float32 (tf32)
        64: {
            "fwd": [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
            "dkdv": [(32, 64, 4, 2), (64, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2), (16, 64, 4, 2)],
            "dq": [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 16, 4, 2)],
        },
        128: {
            "fwd": [(64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 64, 4, 2)],
            "dkdv": [(32, 64, 4, 2), (16, 64, 4, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 128, 8, 2)],
            "dq": [(64, 32, 4, 2), (64, 16, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 16, 8, 2)],
        },
    },
}


def _configs(dtype: str, dim: int):
    table = CANDIDATES["wide" if dtype == "float32" else "narrow"]
    return table[64 if dim <= 64 else 128]


def worker(case_name: str, dtype_name: str, iterations: int, lock_path: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    from jagged_flash_jax import BlockSizes, KernelConfig, multi_head_jagged_flash_attention
    from jagged_flash_jax.configs import default_block_sizes

    case = CASES_BY_NAME[case_name]
    name, heads, dim, max_seq_len = case.name, case.heads, case.head_dim, case.max_seq_len
    lengths = case.lengths()
    dtype = jnp.dtype(dtype_name)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    total = int(lengths.sum())
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (heads, total, dim), dtype) for key in keys)
    default = default_block_sizes(dim, dtype, max_seq_len)
    cands = _configs(dtype_name, dim)

    def forward(bs):
        return jax.jit(lambda q, k, v: multi_head_jagged_flash_attention(
            q, k, v, offsets, max_seq_len, block_sizes=bs, backend="triton"))

    def backward(bs):
        def f(q, k, v, do):
            _, vjp = jax.vjp(lambda q, k, v: multi_head_jagged_flash_attention(
                q, k, v, offsets, max_seq_len, block_sizes=bs, backend="triton"), q, k, v)
            return vjp(do)
        return jax.jit(f)

    jobs = []
    for cfg in cands["fwd"]:
        bs = BlockSizes(KernelConfig(*cfg), default.dkdv, default.dq, default.preprocess_block_m)
        jobs.append(("fwd", {"fwd": cfg}, forward(bs), (q, k, v)))
    pairs = itertools.zip_longest(cands["dkdv"], cands["dq"])
    for dkdv, dq in pairs:
        dkdv, dq = dkdv or cands["dkdv"][0], dq or cands["dq"][0]
        bs = BlockSizes(default.fwd, KernelConfig(*dkdv), KernelConfig(*dq), default.preprocess_block_m)
        jobs.append(("bwd", {"dkdv": dkdv, "dq": dq}, backward(bs), (q, k, v, do)))

    compiled = []
    start = time.time()
    for mode, cfg, fn, args in jobs:
        try:
            compiled.append((mode, cfg, fn.lower(*args).compile(), args))
        except Exception as err:  # a tile that does not fit is a result, not a failure
            compiled.append((mode, cfg, None, repr(err)[:300]))
    compile_s = time.time() - start

    rows = []
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for mode, cfg, exe, args in compiled:
            row = dict(case=name, dtype=dtype_name, mode=mode, config=cfg)
            if exe is None:
                rows.append(dict(row, error=args))
                continue
            try:
                _, timings = profiler.measure(exe, aggregate=False, iterations=iterations)(*args)
                per_kernel = {}
                for iteration in timings:
                    for kernel_name, ms in iteration:
                        per_kernel.setdefault(kernel_name, []).append(ms)
                row["kernels_ms"] = {n: float(np.median(t)) for n, t in per_kernel.items()}
            except Exception as err:
                row["error"] = repr(err)[:300]
            rows.append(row)
        fcntl.flock(lock, fcntl.LOCK_UN)
    print(f"{name} {dtype_name}: {len(jobs)} configs, compile {compile_s:.0f}s", flush=True)
    return rows


def best(rows: list[dict]) -> dict:
    """Fastest config per (case, dtype, kernel)."""
    kernel_of = {"fwd": ("fwd", "fwd_kernel"), "dkdv": ("bwd", "dkdv_kernel"), "dq": ("bwd", "dq_kernel")}
    out = {}
    for row in rows:
        for kernel, (mode, suffix) in kernel_of.items():
            if row["mode"] != mode or "kernels_ms" not in row:
                continue
            ms = sum(t for n, t in row["kernels_ms"].items() if suffix in n)
            key = f"{row['case']}/{row['dtype']}/{kernel}"
            if ms and (key not in out or ms < out[key]["ms"]):
                out[key] = {"config": row["config"][kernel], "ms": ms}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/tune.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lock_path = "/tmp/jagged_flash_jax_tune.lock"
    if args.worker:
        case, dtype, path = args.worker.split(":")
        rows = worker(case, dtype, args.iterations, lock_path)
        with open(path, "w") as f:
            json.dump(rows, f)
        return
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    procs = []
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            part = f"/tmp/tune_{case}_{dtype}.json"
            cmd = [sys.executable, "-m", "benchmarks.tune", "--iterations", str(args.iterations),
                   "--worker", f"{case}:{dtype}:{part}"]
            procs.append((part, subprocess.Popen(cmd, env=env)))
    rows = []
    for part, proc in procs:
        proc.wait()
        if os.path.exists(part):
            with open(part) as f:
                rows += json.load(f)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = {"rows": rows, "best": best(rows)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for key, value in sorted(result["best"].items()):
        print(f"{key:35s} {value['ms']:.4f} ms {value['config']}")


if __name__ == "__main__":
    main()
