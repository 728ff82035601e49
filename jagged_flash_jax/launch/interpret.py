"""Runs the kernels (the kernels package) in Triton's interpreter on the CPU, called from JAX by
pure_callback.

It owns the host arrays, each between guard zones that prove the kernel wrote nothing outside them;
how the interpreter is driven (private Triton internals) lives in `_compat.interpret`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .calls import KernelCall


def _host_dtype(dtype) -> np.dtype:
    # The interpreter gets bfloat16 arithmetic wrong: bfloat16 is computed in float32 and rounded back
    # at the end, so this launcher is then more precise than the GPU's bfloat16 kernels.
    return np.dtype(np.float32) if dtype == jnp.bfloat16 else np.dtype(dtype)


def sentinel(dtype) -> np.ndarray:
    """The guard element of a dtype, as a 0-d array: most significant byte 0xFF, every other 0xA5.

    Compared bytewise, so any write changes it, NaN included. Read as float32 it is a signalling NaN
    (float16: a NaN), so an output computed from a read outside the arrays comes out NaN, and an
    output element the kernel never wrote stays NaN; integers read it as a large negative number.
    """
    dtype = np.dtype(dtype)
    bits = int.from_bytes(b"\xff" + b"\xa5" * (dtype.itemsize - 1), "big")
    return np.array(bits, f"u{dtype.itemsize}").view(dtype)


class Guarded:
    """An array in the middle of a buffer three times its size, every other element the sentinel."""

    def __init__(self, values: np.ndarray | None, shape, dtype):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        self.pad = max(size, 1)
        self.buffer = np.empty(2 * self.pad + size, dtype)
        bits = f"u{dtype.itemsize}"
        self.buffer.view(bits)[...] = sentinel(dtype).view(bits)  # bit-exact, even for a signalling NaN
        self.array = self.buffer[self.pad:self.pad + size].reshape(shape)
        if values is not None:
            self.array[...] = values

    def guards_intact(self) -> bool:
        guards = np.concatenate([self.buffer[:self.pad], self.buffer[self.pad + self.array.size:]])
        bits = f"u{guards.itemsize}"
        return bool(np.all(guards.view(bits) == sentinel(guards.dtype).view(bits)))


def _run_on_host(call: KernelCall, *arrays: np.ndarray):
    inputs = [Guarded(a, a.shape, _host_dtype(a.dtype)) for a in arrays]
    # Outputs start as the sentinel, not zeros: an element the kernel should have written shows up.
    outputs = [Guarded(None, s.shape, _host_dtype(s.dtype)) for s in call.out_shapes]
    # Lanes that are never stored (keys past a sequence's end in the dk/dv kernel) may overflow exp2,
    # as they do silently on the GPU; stored values are checked by the tests, so numpy's warnings go.
    # A sentinel left in an output is a NaN that rounding to bfloat16 warns about: the tests look for it.
    with np.errstate(all="ignore"):
        _compat.interpret(call.kernel, call.grid, *(g.array for g in inputs),
                          *(g.array for g in outputs), **call.constants)
        if not all(g.guards_intact() for g in inputs + outputs):
            raise RuntimeError(f"{call.kernel.__name__} wrote outside its arrays")
        return tuple(g.array.astype(s.dtype) for g, s in zip(outputs, call.out_shapes))


def run(call: KernelCall, arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    if call.descriptors:  # the Hopper kernels': Gluon kernels have no interpreter
        raise ValueError(f"{call.kernel.__name__} runs on the GPU only (TMA descriptors)")
    _compat.triton_internals()  # an unsupported Triton fails here, at trace time, with its own message
    return jax.pure_callback(functools.partial(_run_on_host, call), call.out_shapes, *arrays)
