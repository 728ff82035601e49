"""Sweep kernel tiles on the GPU and report the fastest per case, dtype and kernel.

    python -m benchmarks.tune --out results/tune.json --write-table tuned_configs.json

One worker process per (case, dtype) compiles its candidates in parallel with the others; timing is
serialized by a file lock so that only one worker uses the GPU at a time. Times are CUPTI device
times per kernel (jax.experimental.mosaic.gpu.profiler), medians over iterations. The table file is
what $JAGGED_FLASH_JAX_TUNED_CONFIGS takes (configs.py); the built-in table is the one chosen on an H200.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.cases import CASES, CASES_BY_NAME

# Forward tiles: (block_m, block_n, num_warps, num_stages). Backward (one launch of dk/dv and dq
# programs): (dkdv_block_m, dkdv_block_n, dq_block_m, dq_block_n, num_warps, num_stages). All compile for
# sm_90; a few are there to answer a question (spill-free alternatives to the fastest tiles).
CANDIDATES = {
    "narrow": {  # 16-bit inputs
        64: {
            "fwd": [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
            "bwd": [(32, 64, 64, 32, 4, 3), (32, 64, 64, 32, 4, 2), (64, 64, 64, 64, 4, 2),
                    (32, 32, 32, 32, 4, 3), (16, 64, 64, 16, 4, 3), (32, 64, 64, 32, 8, 3)],
        },
        128: {
            "fwd": [(128, 64, 8, 3), (128, 32, 8, 3)],
            "bwd": [(32, 64, 128, 32, 4, 3), (32, 64, 64, 32, 4, 3), (32, 64, 128, 32, 8, 3),
                    (64, 64, 128, 32, 8, 3), (32, 128, 128, 32, 8, 3), (32, 64, 64, 64, 4, 3),
                    (32, 64, 128, 16, 4, 3), (64, 64, 64, 64, 4, 2)],
        },
    },
    "wide": {  # float32 (tf32)
        64: {
            "fwd": [(64, 32, 4, 2), (128, 32, 8, 2)],
            "bwd": [(32, 64, 64, 32, 4, 2), (32, 128, 128, 32, 8, 2)],
        },
        128: {
            "fwd": [(128, 32, 8, 2), (64, 32, 4, 2)],
            "bwd": [(16, 128, 128, 16, 8, 2), (32, 64, 64, 32, 4, 2)],
        },
    },
}


def _configs(dtype: str, dim: int):
    table = CANDIDATES["wide" if dtype == "float32" else "narrow"]
    return table[64 if dim <= 64 else 128]


def _bwd_tiles(cfg):
    dkdv_m, dkdv_n, dq_m, dq_n, warps, stages = cfg
    return (dkdv_m, dkdv_n, warps, stages), (dq_m, dq_n, warps, stages)


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
    for cfg in cands["bwd"]:
        dkdv, dq = _bwd_tiles(cfg)
        bs = BlockSizes(default.fwd, KernelConfig(*dkdv), KernelConfig(*dq), default.preprocess_block_m)
        jobs.append(("bwd", {"bwd": cfg}, backward(bs), (q, k, v, do)))

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


def _kernel_ms(row) -> float | None:
    """Device time of the kernel the row tunes: the forward, or the backward launch."""
    if "kernels_ms" not in row:
        return None
    suffix = "fwd_kernel" if row["mode"] == "fwd" else "bwd_kernel"
    return sum(t for n, t in row["kernels_ms"].items() if suffix in n) or None


def best(rows: list[dict]) -> dict:
    """Fastest config per (case, dtype, mode)."""
    out = {}
    for row in rows:
        ms = _kernel_ms(row)
        key = f"{row['case']}/{row['dtype']}/{row['mode']}"
        if ms and (key not in out or ms < out[key]["ms"]):
            out[key] = {"config": row["config"][row["mode"]], "ms": ms}
    return out


def table(rows: list[dict]) -> dict:
    """Entries for configs.TUNED_CONFIGS_ENV: per table entry, the forward and backward configs with
    the least total time relative to each case's best, over the cases that map to the entry."""
    from jagged_flash_jax.configs import key_to_text, table_key

    scores: dict = {}
    fastest = {}
    for row in rows:
        ms = _kernel_ms(row)
        if ms:
            case_key = (row["case"], row["dtype"], row["mode"])
            fastest[case_key] = min(ms, fastest.get(case_key, ms))
    for row in rows:
        ms = _kernel_ms(row)
        if not ms:
            continue
        case = CASES_BY_NAME[row["case"]]
        key = table_key(case.head_dim, np.dtype(row["dtype"]), case.max_seq_len)
        if key is None:
            continue
        config = tuple(row["config"][row["mode"]])
        slot = scores.setdefault((key_to_text(key), row["mode"]), {})
        slot.setdefault(config, []).append(ms / fastest[(row["case"], row["dtype"], row["mode"])])
    entries: dict = {}
    for (text, mode), by_config in scores.items():
        count = max(len(v) for v in by_config.values())
        complete = {c: sum(v) for c, v in by_config.items() if len(v) == count}
        choice = min(complete, key=complete.get)
        entry = entries.setdefault(text, {})
        if mode == "fwd":
            entry["fwd"] = list(choice)
        else:
            dkdv, dq = _bwd_tiles(choice)
            entry["dkdv"], entry["dq"] = list(dkdv), list(dq)
    return {text: entry for text, entry in entries.items() if len(entry) == 3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/tune.json")
    ap.add_argument("--write-table", help="write the chosen tiles here, for $JAGGED_FLASH_JAX_TUNED_CONFIGS")
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
    result = {"rows": rows, "best": best(rows), "table": table(rows)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.write_table:
        with open(args.write_table, "w") as f:
            json.dump(result["table"], f, indent=1)
        print("table:", json.dumps(result["table"]))
    for key, value in sorted(result["best"].items()):
        print(f"{key:35s} {value['ms']:.4f} ms {value['config']}")


if __name__ == "__main__":
    main()
