"""Two forward + backward steps of the `long` case (bfloat16) on the triton backend, for a profiler:

    ncu --clock-control none --target-processes all --kernel-name 'regex:^attention_(fwd|bwd)_kernel$' \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python -m benchmarks.probes.one_step
"""

import jax

from .. import cases, impls


def main() -> None:
    (case,) = cases.select(["long"], quick=False)
    s = cases.input_sets(case, "bfloat16", 1)[0]
    attend, prepare = impls.jfa(case, "triton")
    q, k, v, do, aux = prepare(s)
    step = jax.jit(impls.timed_function(attend, "fwd+bwd"))
    for _ in range(2):
        jax.block_until_ready(step(q, k, v, aux, do))


if __name__ == "__main__":
    main()
