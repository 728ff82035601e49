"""HSTU attention on the JAX side: the library's op (`hstu_attention`, on the triton or xla backend, or
"jfa-hstu-hopper": its Hopper forward and backward, named, not in the default list; "jfa-hstu-hopper-longest-
first": the same taking the sequences longest first) and the padded-JAX
baseline (hstu_padded.py), on the cases of hstu_cases.py, forward and forward + backward, timed as
benchmarks/run.py times the softmax ops (benchmarks/timing.py: CUPTI device time, rotating over input
sets). generative-recommenders' own Triton kernel is timed by hstu_torch_bench.py (PyTorch) on the same
batches.

    python -m benchmarks.hstu_run --out DIR [--cases NAME ...] [--impls jfa-triton,jfa-xla,padded]
        [--no-long] [--dtype bfloat16] [--seconds 0.5]

writes DIR/hstu_results.json (one row per case, mode and implementation) and prints each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import traceback

import jax
import jax.numpy as jnp

from benchmarks import hstu_padded, timing
from benchmarks.hstu_cases import MODES, HstuCase, select
from jagged_flash_jax import hstu_attention
from jagged_flash_jax.implementations import HSTU_HOPPER

IMPLS = ("jfa-triton", "jfa-xla", "padded")


def _where(backend: str) -> dict:
    """hstu_attention's backend, or the implementation named: "hstu-hopper" (which backend="auto" does
    not choose), or "hstu-hopper-longest-first" (HstuHopper's longest_first on)."""
    if backend == "hstu-hopper":
        return dict(implementation=backend)
    if backend == "hstu-hopper-longest-first":
        return dict(implementation=dataclasses.replace(HSTU_HOPPER, longest_first=True))
    return dict(backend=backend)


def _library_step(case: HstuCase, mode: str, backend: str):
    where = _where(backend)

    def op(q, k, v, offsets, targets):
        return hstu_attention(q, k, v, offsets, case.max_seq_len, alpha=case.alpha, num_targets=targets,
                              max_attn_len=case.max_attn_len, contextual_seq_len=case.contextual_seq_len,
                              **where)

    if mode == "fwd":
        return lambda q, k, v, do, offsets, targets: op(q, k, v, offsets, targets)

    def forward_backward(q, k, v, do, offsets, targets):
        _, vjp = jax.vjp(lambda q, k, v: op(q, k, v, offsets, targets), q, k, v)
        return vjp(do)

    return forward_backward


def step(case: HstuCase, mode: str, impl: str):
    """The function to time (unjitted): (q, k, v, do, offsets, num_targets) -> outputs."""
    if impl == "padded":
        return hstu_padded.step(case, mode)
    return _library_step(case, mode, impl.removeprefix("jfa-"))


def row(case: HstuCase, mode: str, impl: str, dtype, seconds: float, sets: int = 3) -> dict:
    arg_sets = [hstu_padded.inputs(case, dtype, seed) for seed in range(sets)]
    fn = step(case, mode, impl)
    single = jax.jit(fn).lower(*arg_sets[0]).compile()
    program = timing.every_set(fn) if jax.default_backend() == "gpu" else None
    result = timing.measure(single, program, arg_sets, seconds, iterations=20)
    result.update(case=case.name, mode=mode, impl=impl, dtype=jnp.dtype(dtype).name, **case.describe())
    result["tflops"] = case.flops(mode) / result["ms"] / 1e9
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--no-long", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seconds", type=float, default=0.5)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in select(args.cases, long=not args.no_long):
        for mode in MODES:
            for impl in args.impls.split(","):
                try:
                    result = row(case, mode, impl, jnp.dtype(args.dtype), args.seconds)
                    print(f"[hstu] {case.name:42s} {mode:8s} {impl:11s} {result['ms']:9.3f} ms "
                          f"({result['timer']}) {result['tflops']:6.1f} TF/s", flush=True)
                except Exception as err:  # out of memory (padded, long cases), most likely
                    result = dict(case=case.name, mode=mode, impl=impl, error=f"{type(err).__name__}: "
                                  f"{str(err)[:300]}")
                    print(f"[hstu] {case.name:42s} {mode:8s} {impl:11s} {result['error'][:120]}", flush=True)
                    traceback.print_exc(limit=1)
                rows.append(result)
                (out / "hstu_results.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
