"""ptxas's registers and spill bytes per thread, and the shared memory, of HSTU's Hopper backward kernels
(kernels/hopper/hstu_backward.py: dk/dv and dq), compiled for sm_90a as jax-triton 0.4.1 compiles them
(tests/test_hopper.compile_for_sm90) in the configurations of tests/test_hstu_hopper.py's compile tests;
no GPU needed. Run from the repository root: python -m benchmarks.probes.hstu_backward_spills (Triton's
own ptxas for sm_90)."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_hopper as th  # noqa: E402
import test_hstu_hopper as thh  # noqa: E402

from .backward_spills import ptxas_report  # noqa: E402


def main() -> None:
    print(f"triton {triton.__version__}, sm_90a")
    for case in thh.BACKWARD_COMPILE_CASES:
        *shape, mask = case
        for call, arrays in thh.hstu_hopper_backward_calls(*shape, **mask):
            with contextlib.redirect_stdout(io.StringIO()):
                ptx, metadata = th.compile_for_sm90(call, arrays)
            regs, stores, loads, _ = ptxas_report(ptx)
            print(f"{call.kernel.__name__:22s} {thh._compile_id(case)} registers {regs}, spill stores "
                  f"{stores} B, loads {loads} B, shared {metadata['shared']} B", flush=True)


if __name__ == "__main__":
    main()
