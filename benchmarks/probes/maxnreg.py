"""Probe: a register cap (Triton's `maxnreg`, which jax-triton >= 0.4 passes as a backend option) on
every kernel of the op, for short sequences whose float32 forward is latency-bound at 3 programs per SM
(147 registers). CUPTI device times, forward and forward + backward, per cap.

    python -m benchmarks.probes.maxnreg --cases rec-mid,rec-small --dtypes float32 --caps 0,128,96
"""

import argparse

import jax

from jagged_flash_jax import transforms
from jagged_flash_jax.launch import gpu

from .. import cases, impls, timing


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.maxnreg", description=__doc__)
    p.add_argument("--cases", default="rec-mid")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--caps", default="0,128,96", help="registers per thread; 0: no cap")
    p.add_argument("--iterations", type=int, default=10)
    args = p.parse_args(argv)
    jax_triton = gpu.jax_triton_module()
    plain = gpu.run
    for case in cases.select(args.cases.split(","), quick=False):
        for dtype in args.dtypes.split(","):
            sets = cases.input_sets(case, dtype, 3)
            for cap in (int(c) for c in args.caps.split(",")):
                def run(call, arrays, cap=cap):
                    if not cap:
                        return plain(call, arrays)
                    return tuple(jax_triton.triton_call(
                        *arrays, kernel=call.kernel, out_type=call.out_shapes, grid=call.grid,
                        num_warps=call.num_warps, num_stages=call.num_stages,
                        backend_options={"maxnreg": cap}, **call.constants))

                gpu.run = run
                transforms._forward_fn.cache_clear()
                transforms._backward_fn.cache_clear()
                jax.clear_caches()
                attend, prepare = impls.jfa(case, "triton")
                for mode in cases.MODES:
                    fn = impls.timed_function(attend, mode)
                    arg_sets = [impls.arguments(prepare(s), mode) for s in sets]
                    t = timing.device_ms(timing.every_set(fn), arg_sets, args.iterations)
                    ms = t.get("device_ms", float("nan"))
                    print(f"{case.name:10s} {dtype:9s} {mode:8s} maxnreg={cap or 'none':5} {ms:8.4f} ms "
                          f"{case.flops(mode) / ms / 1e9:6.1f} TF/s {t.get('timer_note', '')}", flush=True)
    gpu.run = plain


if __name__ == "__main__":
    main()
