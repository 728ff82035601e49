"""Two steps of one benchmark case on the triton backend (default: `long`, bfloat16, forward + backward),
for a profiler:

    ncu --clock-control none --target-processes all \
        --kernel-name 'regex:^attention_(fwd|bwd|bwd_dkdv|bwd_dq)_kernel$' --launch-count 3 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python -m benchmarks.probes.one_step [--case rec-mid --dtype float32 --mode fwd]
"""

import argparse

import jax

from .. import cases, impls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.one_step", description=__doc__)
    p.add_argument("--case", default="long")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="fwd+bwd", choices=cases.MODES)
    args = p.parse_args(argv)
    (case,) = cases.select([args.case], quick=False)
    s = cases.input_sets(case, args.dtype, 1)[0]
    attend, prepare = impls.jfa(case, "triton")
    q, k, v, do, aux = prepare(s)
    step = jax.jit(impls.timed_function(attend, args.mode))
    for _ in range(2):
        jax.block_until_ready(step(q, k, v, aux, do) if args.mode == "fwd+bwd" else step(q, k, v, aux))


if __name__ == "__main__":
    main()
