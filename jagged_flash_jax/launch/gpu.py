"""Runs the kernels of the kernels package on the GPU through jax_triton.triton_call (the Hopper
forward's q, k, v as host-made TMA descriptors, jax_triton.TensorDescriptor).

jax_triton is imported on first use only: its import fails on a machine without a GPU build of jax, and
needs triton, which the package does not require.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import _compat
from .calls import KernelCall, is_gluon

# What the GPU extra installs and what was tested together (jaxlib >= 0.11.1 allocates the global scratch
# memory of Triton's tensor descriptors, which jax-triton 0.4 passes it; jax-triton 0.4 needs Python 3.12).
JAX_TRITON_SUPPORTED = _compat.requirement("jax-triton")
TRITON_SUPPORTED = _compat.requirement("triton")
INSTALL_HINT = (
    "install the GPU extra (Python >= 3.12): pip install 'jagged-flash-jax[cuda13]' "
    f"(JAX's CUDA 13 build >= 0.11.1, {JAX_TRITON_SUPPORTED} and {TRITON_SUPPORTED})"
)


@functools.cache
def jax_triton_module():
    """The jax_triton module, checked against the supported versions; else ImportError with the install
    command."""
    try:
        import triton
    except ImportError as err:
        raise ImportError(f"backend='triton' needs triton and jax-triton: {INSTALL_HINT} ({err})") from err
    _compat.prepare_jax_triton_import()
    try:
        import jax_triton
    except ImportError as err:
        raise ImportError(f"backend='triton' needs jax-triton with a GPU build of jax: {INSTALL_HINT}"
                          f" ({err})") from err
    found = {"jax-triton": getattr(jax_triton, "__version__", "unknown"),
             "triton": getattr(triton, "__version__", "unknown")}
    outside = [f"{name} {version}" for name, version in found.items()
               if not _compat.version_in(version, name)]
    if outside:
        raise ImportError(f"backend='triton' is tested with {JAX_TRITON_SUPPORTED} and {TRITON_SUPPORTED}; "
                          f"found {' and '.join(outside)}: {INSTALL_HINT}")
    _compat.repair_stubbed_jax_triton(jax_triton)
    _compat.patch_jax_triton(jax_triton)
    _compat.patch_tensordesc_meta(jax_triton)
    return jax_triton


# Triton backend options every kernel compiles with (beside ptx_options' and a call's register cap).
# FP fusion (a multiply and an add into one FMA) is what the kernels were measured and verified with:
# asked for rather than inherited, since Triton 3.9 warns where it is left to the default, which 3.10
# turns off (TRITON_DEFAULT_FP_FUSION; Triton's TRITON_FORCE_DISABLE_FP_FUSION still turns it off).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


@functools.cache
def ptx_options() -> dict:
    """Triton backend options that make the kernels' PTX assemble with the ptxas jaxlib uses
    (`_compat.ptx_version_option`), for this device's compute capability."""
    capability = _compat.cuda_capability(jax.devices()[0])
    arch = 10 * capability[0] + capability[1] if capability else 90
    return _compat.ptx_version_option(_compat.triton_ptx_version(arch))


def _check_kernels_compiled() -> None:
    """Under TRITON_INTERPRET=1 `@triton.jit` makes interpreter functions, which jax-triton cannot compile."""
    import triton

    from .. import kernels

    if not isinstance(kernels.attention_fwd_kernel, triton.runtime.JITFunction):
        raise RuntimeError("TRITON_INTERPRET is set, so Triton made the kernels interpreter functions, which "
                           "cannot be compiled for the GPU: unset TRITON_INTERPRET, or use "
                           "backend='interpret' to run them in Triton's interpreter")


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernels cannot run through jax-triton here (any exception its import raises), or None."""
    try:
        jax_triton_module()
        _check_kernels_compiled()
        if (reason := _compat.ptxas_unsupported_reason()) is not None:
            raise RuntimeError(reason)
    except Exception as err:  # not only ImportError: a broken install can raise anything
        return f"{type(err).__name__}: {err}"
    return None


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() in ("gpu", "cuda")


def available() -> bool:
    """Whether the triton backend can run here: a GPU is JAX's default backend and jax-triton imports."""
    return on_gpu() and unavailable_reason() is None


def _tensor_descriptor(jax_triton, x: jax.Array, block: tuple[int, ...], gluon: bool):
    """A host-made TMA descriptor of `block` tiles over x: for a Gluon kernel in the NVMMA shared layout
    its TMA loads and wgmma take (the kernel allocates its buffers with the descriptor's layout); for a
    Triton kernel without one (Triton chooses it)."""
    if not gluon:
        return jax_triton.TensorDescriptor.from_array(x, block)
    from triton.experimental.gluon import language as gl

    dtype = {jnp.dtype(jnp.bfloat16): gl.bfloat16, jnp.dtype(jnp.float16): gl.float16,
             jnp.dtype(jnp.float32): gl.float32}[jnp.dtype(x.dtype)]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    return jax_triton.TensorDescriptor.from_array(x, block, layout=layout)


def run(call: KernelCall, arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    jax_triton = jax_triton_module()
    backend_options = {**COMPILE_OPTIONS, **ptx_options()}
    if call.max_registers is not None:
        backend_options["maxnreg"] = call.max_registers
    options = {"backend_options": backend_options}
    if call.zeroed_outputs:
        options["zeroed_outputs"] = call.zeroed_outputs
    if call.aliases:
        options["input_output_aliases"] = dict(call.aliases)
    arrays = list(arrays)
    for index, block in call.descriptors:
        arrays[index] = _tensor_descriptor(jax_triton, arrays[index], block, is_gluon(call.kernel))
    with warnings.catch_warnings():
        # jax-triton 0.4 deprecates zeroed_outputs and input_output_aliases (for Refs, which need a newer
        # jax) and still takes them; pyproject pins jax-triton below 0.5.
        warnings.filterwarnings("ignore", "zeroed_outputs is deprecated", DeprecationWarning)
        warnings.filterwarnings("ignore", "input_output_aliases is deprecated", DeprecationWarning)
        outputs = jax_triton.triton_call(
            *arrays,
            kernel=call.kernel, out_type=call.out_shapes, grid=call.grid,
            num_warps=call.num_warps, num_stages=call.num_stages, **options, **call.constants)
    return tuple(outputs)
