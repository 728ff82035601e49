"""Times jagged flash attention (Triton and XLA backends) against cuDNN and XLA on padded inputs.

For each case and dtype every (implementation, mode) is compiled once (in a thread pool, before any
timing), then timed with CUPTI over rotating random inputs, then by the wall clock. Every row is written
to results.json as soon as it exists; results.md and results.png are made at the end (and by
`python -m benchmarks.plot`). One implementation's failure is recorded in its row and never stops the run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from . import plot, timing
from .cases import CASES, CASES_BY_NAME, DTYPES, MODES, Case, make_input_sets, num_rotation_sets
from .impls import IMPLS, IMPLS_BY_NAME, Impl

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"
SEED_TIMER = "cuda-events (triton.testing.do_bench median, L2 flushed)"


def parse_args(argv=None) -> argparse.Namespace:
    def names(valid):
        def parse(text: str) -> list[str]:
            chosen = [name.strip() for name in text.split(",") if name.strip()]
            unknown = [name for name in chosen if name not in valid]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(valid)}")
            return chosen
        return parse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--cases", type=names(CASES_BY_NAME), default=[c.name for c in CASES])
    parser.add_argument("--dtypes", type=names(DTYPES), default=list(DTYPES))
    parser.add_argument("--impls", type=names(IMPLS_BY_NAME), default=[i.name for i in IMPLS])
    parser.add_argument("--modes", type=names(MODES), default=list(MODES))
    parser.add_argument("--iterations", type=int, default=20, help="timed calls (CUPTI) per row")
    parser.add_argument("--wall-iterations", type=int, default=10, help="wall-clock calls per row")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--seed-json", type=pathlib.Path,
                        help="rows of .seed_shared/tools/seed_torch_bench.py to merge (impl seed-pytorch)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (B/8, max_seq_len/8) for a smoke run")
    parser.add_argument("--compile-workers", type=int, default=8,
                        help="threads compiling one case and dtype's functions before they are timed")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="skip the cases and dtypes not started after this many seconds (0: no limit)")
    parser.add_argument("--no-plot", action="store_true", help="skip results.png")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.wall_iterations < 1:
        parser.error("--iterations and --wall-iterations must be >= 1")
    return args


def _version(distribution: str, module: str | None = None) -> str | None:
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:  # not installed as a distribution: ask the module
        try:
            return getattr(__import__(module or distribution), "__version__", None)
        except Exception:
            return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=pathlib.Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:
        return None


def _tuned_configs():
    """The tile table the triton rows ran with: a $JAGGED_FLASH_JAX_TUNED_CONFIGS file, or built-in."""
    from jagged_flash_jax.configs import TUNED_CONFIGS_ENV

    path = os.environ.get(TUNED_CONFIGS_ENV)
    if not path:
        return "built-in (jagged_flash_jax/configs.py)"
    return {"path": path, "table": json.loads(pathlib.Path(path).read_text())}


def metadata(args, argv) -> dict:
    device = jax.devices()[0]
    import jagged_flash_jax

    argv = sys.argv[1:] if argv is None else list(argv)
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command="python -m benchmarks.run " + shlex.join(argv),
        device=getattr(device, "device_kind", str(device)), platform=jax.default_backend(),
        device_count=jax.device_count(), python=platform.python_version(),
        jax_version=jax.__version__, jaxlib_version=_version("jaxlib"),
        triton_version=_version("triton"), jax_triton_version=_version("jax-triton", "jax_triton"),
        numpy_version=np.__version__, jagged_flash_jax_version=jagged_flash_jax.__version__,
        git_commit=_git_commit(), iterations=args.iterations, wall_iterations=args.wall_iterations,
        quick=args.quick, compile_workers=args.compile_workers,
        tuned_configs=_tuned_configs(),
        timing_note=timing.__doc__.strip().replace("\n", " "),
        memory_note=("memory: XLA's memory_analysis of the jitted function; total_bytes = argument + "
                     "output + temp; memory_ratio = total_bytes / minimal_bytes, minimal = q, k, v, o (fwd) "
                     "plus do, dq, dk, dv and a float32 [H, T] log-sum-exp (fwd+bwd), in the impl's own "
                     "layout (padded impls: [B, L, H, Dp]); device_memory is the allocator's process-wide "
                     "high-water mark, not this row's own peak."),
    )


def load_seed_rows(path: pathlib.Path | None) -> list[dict]:
    if path is None:
        return []
    try:
        data = json.loads(path.read_text())
    except Exception as err:
        print(f"[bench] could not read the seed rows {path}: {err!r}", flush=True)
        return []
    rows = data.get("rows", []) if isinstance(data, dict) else data
    merged = []
    for row in rows:
        if not all(key in row for key in ("case", "dtype", "mode", "ms")):
            continue
        merged.append(dict(row, impl=row.get("impl", plot.SEED), status="ok", timer=SEED_TIMER,
                           source=str(path)))
    print(f"[bench] merged {len(merged)} seed rows from {path}", flush=True)
    return merged


def minimal_bytes(case: Case, dtype: str, mode: str, padded: bool) -> int:
    """Bytes of q, k, v, o (fwd), plus do, dq, dk, dv and a float32 [H, T] log-sum-exp (fwd+bwd)."""
    itemsize = np.dtype(dtype).itemsize
    if padded:
        rows, dim = case.batch * case.max_seq_len, case.padded_head_dim
    else:
        rows, dim = case.num_tokens, case.head_dim
    tensor = case.heads * rows * dim * itemsize
    return 4 * tensor if mode == "fwd" else 8 * tensor + 4 * case.heads * rows


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _all_finite(outputs) -> bool:
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(outputs))


class Runner:
    def __init__(self, args, argv):
        self.args = args
        self.out = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
        self.results = dict(metadata=metadata(args, argv), rows=load_seed_rows(args.seed_json))
        self.start = time.perf_counter()

    def save(self) -> None:
        self.results["metadata"]["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        path = self.out / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(path)

    def add(self, row: dict) -> None:
        self.results["rows"].append(row)
        self.save()
        status = row["status"]
        if status == "ok":
            detail = (f"{row['ms']:.4f} ms device ({row['timer']}), {row['wall_ms']:.4f} ms wall, "
                      f"{row['pipelined_ms']:.4f} ms pipelined, "
                      f"{row['tflops']:.1f} TFLOP/s, compile {row.get('compile_s', 0):.1f} s")
        else:
            detail = row.get("reason") or row.get("error", "")
        print(f"[bench] {row['case']:<16} {row['dtype']:<8} {row['mode']:<7} {row['impl']:<13} {status}: "
              f"{detail[:300]}", flush=True)

    def base_row(self, case: Case, impl: Impl, dtype: str, mode: str) -> dict:
        flops = case.flops(mode)
        return dict(case=case.name, impl=impl.name, dtype=dtype, mode=mode, **case.describe(),
                    flops=flops, status="ok")

    def run_group(self, case: Case, dtype: str) -> None:
        """Every chosen (impl, mode) of one case and dtype: compile all, then time one after another."""
        impls = [IMPLS_BY_NAME[name] for name in self.args.impls]
        combos = []
        over_budget = bool(self.args.budget_s) and time.perf_counter() - self.start > self.args.budget_s
        for impl in impls:
            for mode in self.args.modes:
                reason = impl.skip_reason(dtype, self.platform)
                if reason is None and over_budget:
                    reason = f"time budget of {self.args.budget_s:.0f} s spent before it started"
                if reason is not None:
                    self.add(dict(self.base_row(case, impl, dtype, mode), status="skipped", reason=reason))
                else:
                    combos.append((impl, mode))
        if not combos:
            return
        sets_count = num_rotation_sets(case, dtype)
        group_began = time.perf_counter()
        try:
            input_sets = make_input_sets(case, dtype, sets_count)
        except Exception as err:
            for impl, mode in combos:
                self.add(dict(self.base_row(case, impl, dtype, mode), status="error",
                              error="making inputs: " + _error_text(err)))
            return

        prepared = {}  # (impl, mode) -> arg sets, or the error
        for impl, mode in combos:
            try:
                prepared[impl.name, mode] = [s.padded_args(case, mode) if impl.padded_inputs
                                             else s.jagged_args(mode) for s in input_sets]
            except Exception as err:
                prepared[impl.name, mode] = err

        def compile_one(impl: Impl, mode: str, args: tuple):
            began = time.perf_counter()
            compiled = jax.jit(impl.function(case, mode)).lower(*args).compile()
            return compiled, time.perf_counter() - began

        began = time.perf_counter()
        inputs_s = began - group_began
        with concurrent.futures.ThreadPoolExecutor(max(1, self.args.compile_workers)) as pool:
            futures = {(impl.name, mode): pool.submit(compile_one, impl, mode, prepared[impl.name, mode][0])
                       for impl, mode in combos if not isinstance(prepared[impl.name, mode], Exception)}
            concurrent.futures.wait(futures.values())
        print(f"[bench] {case.name} {dtype}: compiled {len(futures)} functions in "
              f"{time.perf_counter() - began:.1f} s; {sets_count} input sets made in {inputs_s:.1f} s",
              flush=True)

        for impl, mode in combos:
            row = self.base_row(case, impl, dtype, mode)
            row["rotation_sets"] = sets_count
            try:
                arg_sets = prepared[impl.name, mode]
                if isinstance(arg_sets, Exception):
                    raise RuntimeError("preparing inputs: " + _error_text(arg_sets))
                compiled, row["compile_s"] = futures[impl.name, mode].result()
                row["compile_s"] = round(row["compile_s"], 2)
                self.measure(compiled, arg_sets, case, dtype, mode, impl, row)
            except Exception as err:
                row.update(status="error", error=_error_text(err))
                if not isinstance(err, (jax.errors.JaxRuntimeError, MemoryError)):
                    row["traceback"] = traceback.format_exc(limit=6)[-3000:]
            self.add(row)
            futures.pop((impl.name, mode), None)  # frees the executable
        del input_sets, prepared, futures
        gc.collect()
        print(f"[bench] {case.name} {dtype}: done in {time.perf_counter() - group_began:.1f} s", flush=True)

    def measure(self, compiled, arg_sets, case: Case, dtype: str, mode: str, impl: Impl, row: dict) -> None:
        try:
            row["memory"] = timing.compiled_memory(compiled)
        except Exception as err:
            row["memory"] = {"error": _error_text(err)}
        total = row["memory"].get("total_bytes")
        row["minimal_bytes"] = minimal_bytes(case, dtype, mode, impl.padded_inputs)
        if total:
            row["memory_ratio"] = round(total / row["minimal_bytes"], 3)

        began = time.perf_counter()
        for args in arg_sets:  # warm-up: module loads, cuDNN plans, first-touch allocations
            outputs = compiled(*args)
        jax.block_until_ready(outputs)
        row["finite"] = _all_finite(outputs)
        del outputs

        warmed = time.perf_counter()
        try:
            timings, row["timer"] = timing.device_times(compiled, arg_sets, self.args.iterations)
            row.update(timing.summarize_kernels(timings))
        except RuntimeError as err:
            if timing.CUPTI_UNAVAILABLE is None:  # CUPTI works here but failed on this function
                row["timer_error"] = _error_text(err)
            else:
                row["timer_note"] = timing.CUPTI_UNAVAILABLE
            row["timer"] = "wall"
        timed = time.perf_counter()
        walls = timing.wall_times(compiled, arg_sets, self.args.wall_iterations)
        row["wall_ms"] = statistics.median(walls)
        row["wall_ms_min"] = min(walls)
        row["pipelined_ms"] = timing.pipelined_time(compiled, arg_sets, 2 * self.args.wall_iterations)
        if row["timer"] == "wall":
            row["ms"] = row["wall_ms"]
        row["tflops"] = row["flops"] / row["ms"] / 1e9
        row["device_memory"] = timing.device_memory_stats()
        row["seconds"] = dict(warmup=round(warmed - began, 3), cupti=round(timed - warmed, 3),
                              wall=round(time.perf_counter() - timed, 3))

    def run(self) -> str:
        cases = [CASES_BY_NAME[name] for name in self.args.cases]
        if self.args.quick:
            cases = [case.quick() for case in cases]
        print(f"[bench] {self.results['metadata']['device']} ({self.platform}), jax "
              f"{jax.__version__}; cases {[c.name for c in cases]}, dtypes {self.args.dtypes}, impls "
              f"{self.args.impls}, modes {self.args.modes}", flush=True)
        for case in cases:
            for dtype in self.args.dtypes:
                self.run_group(case, dtype)
        plot.add_speedups(self.results)
        self.save()
        text = plot.write_report(self.results, self.out, figure=not self.args.no_plot)
        print(f"[bench] wrote {self.out}/results.json, results.md"
              f"{'' if self.args.no_plot else ', results.png'} in "
              f"{time.perf_counter() - self.start:.0f} s", flush=True)
        return text


def main(argv=None) -> None:
    args = parse_args(argv)
    text = Runner(args, argv).run()
    print()
    print(text, flush=True)


if __name__ == "__main__":
    main()
