"""Measures every implementation on every case into OUT/results.json, then has benchmarks.report write the
report. `run_cases` (also benchmarks.tune's) runs the cases in a worker process; when it dies, the case it
was in becomes error rows and a new worker goes on with the cases after it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import importlib.metadata
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
import traceback
import types

import jax

from jagged_flash_jax.select import TUNED_CONFIGS_ENV

from . import cases as C
from . import impls, report, timing

NOTES = [timing.DEVICE_NOTE, timing.HOST_NOTE,
         "tflops: useful FLOPs over device_ms (wall_ms without CUPTI): forward 4 H D sum(n_q n_k) over the "
         "attended pairs (causal, window: exactly those kept), forward+backward 3.5 times that.",
         "memory_bytes: XLA's memory analysis of the compiled function (arguments, outputs, temporaries)."]


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The options of every command that measures through run_cases (this one and benchmarks.tune)."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--out", type=pathlib.Path, required=True, help="folder of results.json and the report")
    p.add_argument("--quick", action="store_true", help="tiny shapes; on a CPU only jfa-xla runs")
    p.add_argument("--cases", help="comma-separated case names or groups (default: all)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: each case's)")
    p.add_argument("--iterations", type=int, default=10, help="most CUPTI iterations per row")
    p.add_argument("--seconds", type=float, default=0.3, help="timed seconds per row (about)")
    p.add_argument("--budget-s", type=float, default=0, help="skip cases not started by then (0: no limit)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    return p


def impl_jobs(names: list[str], case: C.Case, dtype: str) -> list[tuple]:
    """(impl, mode, make, needs a GPU) of each row of a case and dtype: impls.IMPLS's; make(case) ->
    (attend, prepare)."""
    return [(name, mode, *impls.IMPLS[name]) for name in names for mode in C.MODES]


def base_row(case: C.Case, impl: str, dtype: str, mode: str) -> dict:
    """The fields every row of a case starts with: what was measured, on what."""
    return dict(case=case.name, impl=impl, dtype=dtype, mode=mode, **case.describe(), flops=case.flops(mode))


def measure_case(case: C.Case, dtype: str, jobs: list[tuple], args, emit) -> None:
    """Compiles every row of a case and dtype (in threads), then times them one after another."""
    todo = []
    for name, mode, make, needs_gpu in jobs:
        row = base_row(case, name, dtype, mode)
        if args.deadline and time.time() > args.deadline:
            emit(dict(row, status="skipped", reason="the --budget-s ran out before this case"))
        elif needs_gpu and jax.default_backend() != "gpu":
            emit(dict(row, status="skipped", reason=f"needs a GPU (backend {jax.default_backend()!r})"))
        else:
            todo.append((row, make))
    if not todo:
        return
    sets = C.input_sets(case, dtype, C.rotation_count(case, dtype, args.quick))

    def compile_job(row, make):
        attend, prepare = make(case)
        arg_sets = [impls.arguments(prepare(s), row["mode"]) for s in sets]
        fn = impls.timed_function(attend, row["mode"])
        program = timing.every_set(fn).lower(arg_sets).compile() if jax.default_backend() == "gpu" else None
        return jax.jit(fn).lower(*arg_sets[0]).compile(), program, arg_sets

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(compile_job, *job) for job in todo]
        concurrent.futures.wait(futures)  # no compiling while timing
    print(f"[bench] {case.name} {dtype}: compiled in {time.perf_counter() - began:.1f} s", flush=True)
    for i, (row, _) in enumerate(todo):
        future, futures[i] = futures[i], None  # so that its executables and inputs go when done
        try:
            row.update(status="ok", **timing.measure(*future.result(), args.seconds, args.iterations))
            row["tflops"] = row["flops"] / row["ms"] / 1e9
        except Exception as err:
            unsupported = isinstance(err, impls.Unsupported) or row["impl"].startswith("cudnn")
            row.update(status="unsupported" if unsupported else "error",
                       error=f"{type(err).__name__}: {err}"[:2000])
            if not unsupported:
                row["traceback"] = traceback.format_exc(limit=8)[-3000:]
        del future
        emit(row)


def probe_options(seconds: float) -> types.SimpleNamespace:
    """`measure_case`'s options for a probe timing rows in its own process: no deadline, every input set,
    `seconds` of timing per row."""
    return types.SimpleNamespace(deadline=0, quick=False, seconds=seconds, iterations=10)


def row_account(row: dict) -> str:
    """A probe's line for a measured row: its status, device time, each kernel's time and any error."""
    kernels = {k: round(v, 4) for k, v in (row.get("kernels") or {}).items()}
    return f"{row['status']:5s} {row.get('ms', float('nan')):.4f} ms {kernels} {row.get('error', '')}"


def _read_rows(path: pathlib.Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the last line of a worker killed while writing it
            pass
    return rows


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def worker(args, selected: list[C.Case], jobs) -> None:
    (args.out / "device.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, platform=jax.default_backend(), device_count=jax.device_count(),
        versions={d: _version(d) for d in ("jax", "jaxlib", "triton", "jax-triton", "jagged-flash-jax")})))
    with open(args.out / "rows.jsonl", "a") as rows:
        def emit(row):
            rows.write(json.dumps(row, default=str) + "\n")
            rows.flush()
            detail = (f"{row['ms']:.4f} ms ({row['timer']}), {row['tflops']:.1f} TFLOP/s"
                      if row["status"] == "ok" else row.get("reason") or row.get("error", ""))
            print(f"[bench] {row['case']:<13} {row['dtype']:<8} {row['mode']:<7} {row['impl']:<12} "
                  f"{row['status']}: {detail[:200]}", flush=True)

        for case in selected:
            for dtype in _dtypes(case, args):
                measure_case(case, dtype, jobs(case, dtype), args, emit)


def _dtypes(case: C.Case, args) -> list[str]:
    return [d for d in case.dtypes if not args.dtypes or d in args.dtypes.split(",")]


def run_cases(args, argv: list[str] | None, jobs, module: str) -> dict | None:
    """Measures the rows jobs(case, dtype) -> [(impl, mode, make, needs a GPU)] of the selected cases in
    workers (`python -m module ARGV --worker`, their stderr in OUT/worker.log) and writes OUT/results.json;
    None in a worker."""
    selected = C.select(args.cases.split(",") if args.cases else None, args.quick)
    if args.worker:
        return worker(args, selected, jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path, log_path, start = args.out / "rows.jsonl", args.out / "worker.log", time.time()
    rows_path.write_text("")
    log_path.write_text("")
    deadline = start + args.budget_s if args.budget_s else 0
    keys = {c.name: [(c.name, job[0], dtype, job[1]) for dtype in _dtypes(c, args) for job in jobs(c, dtype)]
            for c in selected}
    argv = sys.argv[1:] if argv is None else argv
    pending = selected
    while pending:
        command = [sys.executable, "-m", module, *argv, "--worker", "--deadline", str(deadline),
                   "--cases", ",".join(c.name for c in pending)]
        timeout = deadline - time.time() + 120 if deadline else None  # the case in flight may end
        with open(log_path, "a") as log:
            try:
                ended = f"exit code {subprocess.run(command, stderr=log, timeout=timeout).returncode}"
            except subprocess.TimeoutExpired:
                ended = f"killed after {timeout:.0f} s"
        done = {(r["case"], r["impl"], r["dtype"], r["mode"]) for r in _read_rows(rows_path)}
        pending = [c for c in pending if not done.issuperset(keys[c.name])]
        if pending:  # the worker died in pending[0]: its missing rows become errors
            case, pending = pending[0], pending[1:]
            error = f"the worker ended ({ended}) in this case; stderr ends:\n{log_path.read_text()[-2000:]}"
            with open(rows_path, "a") as f:
                f.writelines(json.dumps(dict(base_row(case, *k[1:]), status="error", error=error)) + "\n"
                             for k in keys[case.name] if k not in done)
    device = args.out / "device.json"
    metadata = dict(
        schema="jfa-bench/2", date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command=f"python -m {module} " + shlex.join(argv), quick=args.quick, notes=NOTES,
        elapsed_s=round(time.time() - start, 1),
        tuned_configs=os.environ.get(TUNED_CONFIGS_ENV) or "built-in (jagged_flash_jax/configs.py)",
        **(json.loads(device.read_text()) if device.exists() else {}))
    results = dict(metadata=metadata, rows=_read_rows(rows_path))
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    rows_path.unlink()
    device.unlink(missing_ok=True)
    if not log_path.read_text():
        log_path.unlink()
    return results


def main(argv=None) -> None:
    p = parser("python -m benchmarks.run", __doc__)
    p.add_argument("--impls", default=",".join(impls.IMPLS), help="comma-separated (default: all)")
    p.add_argument("--fbgemm-json", type=pathlib.Path, help="rows of seed_torch_bench.py for the report")
    args = p.parse_args(argv)
    names = args.impls.split(",")
    if unknown := [n for n in names if n not in impls.IMPLS]:
        p.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(impls.IMPLS)}")
    if run_cases(args, argv, functools.partial(impl_jobs, names), "benchmarks.run") is not None:
        fbgemm = ["--fbgemm-json", str(args.fbgemm_json)] if args.fbgemm_json else []
        report.main(["--results", str(args.out), *fbgemm])


if __name__ == "__main__":
    main()
