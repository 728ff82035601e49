"""The portable forward with its unmasked key blocks loaded by TMA (`jfa-triton-tma-loads`: what a Hopper
GPU takes under triton >= 3.7) against loaded by pointers (cp.async, `jfa-triton-pointer-loads`), under
any Triton, forward only, bfloat16, alternating in one process: `python -m
benchmarks.probes.tma_forward [--cases A,B] [--rounds 2]` (a GPU). Each row prints the device time
(CUPTI) and the kernels that ran.
"""

from __future__ import annotations

import argparse

from benchmarks import cases, impls, run

IMPLS = ("jfa-triton-tma-loads", "jfa-triton-pointer-loads")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.tma_forward", description=__doc__)
    p.add_argument("--cases", default="L4096-D64,L4096-D64-causal,gqa-16x4-L512-D64-causal,rec-long")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.1)
    args = p.parse_args(argv)
    options = run.probe_options(args.seconds)
    for case in cases.select(args.cases.split(","), False):
        for r in range(args.rounds):
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            jobs = [(name, "fwd", impls.IMPLS[name][0], True) for name in order]

            def emit(row, r=r, case=case):
                print(f"[ab] round {r} {case.name:28s} {row['impl']:26s} {run.row_account(row)}", flush=True)

            run.measure_case(case, "bfloat16", jobs, options, emit)


if __name__ == "__main__":
    main()
