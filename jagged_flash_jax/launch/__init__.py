"""How a kernel runs: `gpu` through jax-triton, `interpret` through Triton's interpreter on the CPU."""

from __future__ import annotations

from .plan import Runner


def runner(launcher: str) -> Runner:
    """The `run(call, arrays)` function of a launcher, imported on first use."""
    if launcher == "triton":
        from . import gpu

        return gpu.run
    if launcher == "interpret":
        from . import interpret

        return interpret.run
    raise ValueError(f"unknown launcher {launcher!r}")
