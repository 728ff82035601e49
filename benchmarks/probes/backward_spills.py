"""ptxas's registers and spill bytes per thread of the Hopper backward's kernels (dk/dv and dq, and dk/dv
with dq fused in: by atomics, and by TMA reduce-adds where Triton's Gluon has them), compiled for sm_90a
as jax-triton 0.4.1 compiles them (tests/test_hopper.compile_for_sm90), in the configurations the tests
use, and with `--sass` the counts of the softmax's arithmetic opcodes in their SASS; `--ordered`: the
kernels reading the sequences' order (HopperConfig.longest_first); no GPU needed. Run from the
repository root: python -m benchmarks.probes.backward_spills [--sass] [--ordered] [--only NAME] (triton
from PYTHONPATH: the GPU machine's is 3.6; Triton's own ptxas for sm_90)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys

import jax.numpy as jnp
import triton

from benchmarks.probes import ptx as ptx_probe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_hopper as th  # noqa: E402

from jagged_flash_jax import _compat  # noqa: E402

CONFIGS = [
    ("D128", 128, False, {}),
    ("D128 causal", 128, True, {}),
    ("D128 window (64, 0)", 128, False, dict(window=(64, 0))),
    ("D128 causal, window, softcap, ALiBi", 128, True, dict(window=(16, 4), softcap=5.0, alibi=True)),
    ("D64 causal", 64, True, {}),
    ("D64 causal, window, softcap, ALiBi", 64, True, dict(window=(16, 4), softcap=5.0, alibi=True)),
]


# The SASS opcodes `--sass` counts (the per-score arithmetic of the softmax and its gradient), then the
# total: static counts over the whole kernel, not the instructions a tile executes (ncu counts those).
SASS_OPCODES = ("FFMA", "FADD", "FMUL", "FMNMX", "MUFU.EX2", "FSEL", "F2FP")


def ptxas_report(ptx: str, sass: bool = False) -> tuple[str, str, str, dict | None]:
    """(registers, spill store bytes, spill load bytes, the SASS opcode counts or None) of `ptx`
    assembled for sm_90a by the ptxas Triton compiles sm_90 with."""
    report, listing = ptx_probe.assemble_sm90a(ptx, sass=sass)
    (regs,) = re.findall(r"Used (\d+) registers", report)
    (stores, loads) = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)[0]
    return regs, stores, loads, None if listing is None else sass_counts(listing)


def sass_counts(listing: str) -> dict:
    """SASS_OPCODES' counts in a cuobjdump SASS listing, and "total"."""
    # Instruction lines: /*0a30*/  @!P0 FFMA.FTZ R3, R4, R5, -R6 ;
    opcodes = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", listing, re.M)
    counts = {name: sum(op == name or op.startswith(name + ".") for op in opcodes) for name in SASS_OPCODES}
    counts["total"] = len(opcodes)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sass", action="store_true", help="count SASS_OPCODES in each kernel too")
    parser.add_argument("--only", help="the CONFIGS whose name contains this")
    parser.add_argument("--ordered", action="store_true", help="the kernels reading the sequences' order")
    args = parser.parse_args()
    if args.ordered:  # the tests' problems, their configs taking the sequences longest first
        problem = th._problem

        def ordered(*args_, **options):
            p, config, *rest = problem(*args_, **options)
            return (p, dataclasses.replace(config, longest_first=True), *rest)

        th._problem = ordered
    print(f"triton {triton.__version__}, sm_90a, bfloat16, THD{', ordered' if args.ordered else ''}")
    # (fused_dq, TMA reduce-adds): the unfused kernels, then dq fused by atomics, then by TMA (if any)
    paths = [(False, False), (True, False)] + ([(True, True)] if _compat.gluon_tma_reduce() else [])
    for name, dim, causal, options in CONFIGS:
        if args.only and args.only not in name:
            continue
        launches = []
        for fused_dq, tma in paths:
            _compat.gluon_tma_reduce = lambda tma=tma: tma
            launches += th.hopper_backward_calls(dim, causal, "THD", jnp.bfloat16, fused_dq=fused_dq,
                                                 **options)
        for call, arrays in launches:
            with contextlib.redirect_stdout(io.StringIO()):
                ptx, _ = th.compile_for_sm90(call, arrays)
            regs, stores, loads, counts = ptxas_report(ptx, args.sass)
            mix = "" if counts is None else "; SASS " + ", ".join(f"{k} {v}" for k, v in counts.items())
            print(f"{call.kernel.__name__:34s} {name:38s} registers {regs}, spill stores {stores:>5s} B, "
                  f"loads {loads:>5s} B{mix}", flush=True)


if __name__ == "__main__":
    main()
