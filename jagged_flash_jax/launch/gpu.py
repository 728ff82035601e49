"""Runs the kernels of kernels.py on the GPU through jax_triton.triton_call.

jax_triton is imported on first use only: its import fails on a machine without a GPU build of jaxlib.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from .plan import KernelCall

INSTALL_HINT = (
    "install the GPU extra: pip install 'jagged-flash-jax[cuda13]' "
    "(JAX's CUDA 13 build, jax-triton==0.3.1 and triton>=3.6,<3.10)"
)


@functools.cache
def jax_triton_module():
    """The jax_triton module, or ImportError with the install command."""
    try:
        import jax_triton
    except ImportError as err:
        raise ImportError(f"backend='triton' needs jax-triton with a GPU build of jax: {INSTALL_HINT}"
                          f" ({err})") from err
    return jax_triton


@functools.cache
def unavailable_reason() -> str | None:
    """Why jax-triton cannot be used here (any exception its import raises), or None."""
    try:
        jax_triton_module()
    except Exception as err:  # not only ImportError: a broken install can raise anything
        return f"{type(err).__name__}: {err}"
    return None


def available() -> bool:
    """Whether the triton backend can run here: a GPU is JAX's default backend and jax-triton imports."""
    return jax.default_backend() in ("gpu", "cuda") and unavailable_reason() is None


def run(call: KernelCall, arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    outputs = jax_triton_module().triton_call(
        *arrays,
        kernel=call.kernel, out_shape=call.out_shapes, grid=call.grid,
        num_warps=call.num_warps, num_stages=call.num_stages,
        zeroed_outputs=call.zeroed_outputs, **call.constants)
    return tuple(outputs)
