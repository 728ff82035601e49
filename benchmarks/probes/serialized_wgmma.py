"""Which Hopper launches ptxas serializes: every Gluon kernel's launch (the forward, dk/dv, dq, the dq-fused
dk/dv, HSTU's three) at D = 64, 128 and 256, plain, causal, with a window and with every option, compiled
for sm_90a as jax-triton 0.4.1 compiles them (tests/test_hopper.compile_for_sm90), assembled by Triton's own
ptxas and, with --ptxas PATH, by another (its PTX version lowered to 9.0, as `_compat` asks of CUDA 13.0's):
ptxas's "wgmma.mma_async instructions are serialized" notes (C7512, C7513; "ok" without), bytes of spill
stores, and the PTX's waits for all of a warpgroup's products. No GPU needed. Run from the repository root:
python -m benchmarks.probes.serialized_wgmma [--ptxas PATH] (triton from PYTHONPATH)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

import jax.numpy as jnp
import triton
from triton.backends.nvidia.compiler import get_ptxas

from benchmarks.probes import ptx as ptx_probe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_hopper as th  # noqa: E402
import test_hstu_hopper as hh  # noqa: E402

OPTIONS = [(False, {}), (True, {}), (False, dict(window=(64, 0))),
           (True, dict(window=(16, 4), softcap=5.0, alibi=True))]


def assemble(ptxas: str, ptx: str) -> str:
    """`ptx` assembled for sm_90a by `ptxas`: its serialization notes and spill stores."""
    report, _ = ptx_probe.assemble_sm90a(ptx, ptxas)
    notes = sorted(set(re.findall(r"\((C75\d\d)\)[^\n]*serialized", report)))
    spills = re.findall(r"(\d+) bytes spill stores", report)
    return f"{','.join(notes) or 'ok':11s} spill stores {'/'.join(spills)} B"


def report(name: str, call, arrays, other: str | None) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        ptx, _ = th.compile_for_sm90(call, arrays)
    waits = ptx.count("wgmma.wait_group.sync.aligned 0")
    line = f"{name:64s} PTX waits for all {waits:2d} | triton's ptxas: "
    line += assemble(get_ptxas(90).path, ptx)
    if other:
        line += " | other: " + assemble(other, re.sub(r"^\.version 9\.\d+", ".version 9.0", ptx, flags=re.M))
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ptxas", help="a second ptxas to assemble each launch with (e.g. CUDA 13.0's)")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90a, bfloat16, THD")
    for dim in (64, 128, 256):
        for causal, options in OPTIONS:
            tag = f"D{dim} {'causal ' if causal else ''}{options or ''}"
            if dim != 64:  # the Hopper forward has no D = 64 tiles
                call, arrays = th.hopper_call(dim, causal, "THD", jnp.bfloat16, **options)
                report("forward " + tag, call, arrays, args.ptxas)
            launches = th.hopper_backward_calls(dim, causal, "THD", jnp.bfloat16, **options)
            if dim != 256:  # dq is not fused into D = 256's blocks of 64 keys
                launches += th.hopper_backward_calls(dim, causal, "THD", jnp.bfloat16, fused_dq=True,
                                                     **options)
            for call, arrays in launches:
                report(call.kernel.__name__ + " " + tag, call, arrays, args.ptxas)
    for dim, value_dim, layout, dtype, token_scale, mask in hh.BACKWARD_COMPILE_CASES:
        tag = f"D{dim} V{value_dim} {mask}"
        call, arrays = hh.hstu_hopper_call(dim, value_dim, layout, dtype, token_scale, **mask)
        report("hstu forward " + tag, call, arrays, args.ptxas)
        for call, arrays in hh.hstu_hopper_backward_calls(dim, value_dim, layout, dtype, token_scale, **mask):
            report(call.kernel.__name__ + " " + tag, call, arrays, args.ptxas)


if __name__ == "__main__":
    main()
