"""How a kernel runs: `gpu` through jax-triton, `interpret` through Triton's interpreter on the CPU."""

from __future__ import annotations

from .plan import Runner


def runner(launcher: str) -> Runner:
    """The `run(call, arrays)` function of a launcher, imported on first use. Its dependencies are checked
    here, before the plan first reads the kernels (which import triton), so that a missing one is named
    with the extra that installs it."""
    if launcher == "triton":
        from . import gpu

        gpu.jax_triton_module()
        return gpu.run
    if launcher == "interpret":
        from .. import _compat
        from . import interpret

        _compat.triton_internals()
        return interpret.run
    raise ValueError(f"unknown launcher {launcher!r}")
