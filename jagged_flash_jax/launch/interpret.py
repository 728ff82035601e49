"""Runs the kernels of kernels.py with Triton's interpreter on the CPU, called from JAX by pure_callback.

The interpreter executes the same `@triton.jit` source on numpy data. It expects torch-like tensors;
`HostTensor` is the small numpy-backed adapter it needs (no torch). The interpreter gets bfloat16
arithmetic wrong, so bfloat16 arrays are computed in float32 here and rounded back at the end: results
of this launcher are then more precise than the GPU's bfloat16 kernels.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import kernels
from .plan import KernelCall


class _HostStorage:
    """The untyped storage of a HostTensor: the same host memory, so copies back are no-ops."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def cpu(self) -> _HostStorage:
        return self

    def copy_(self, other: _HostStorage) -> None:
        if other is not self and other.data_ptr() != self.data_ptr():
            raise RuntimeError("host tensors are not expected to be copied between storages")


class HostTensor:
    """The part of torch.Tensor's interface that Triton's interpreter uses, over a numpy array."""

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError("HostTensor needs a writeable, C-contiguous array")
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self.array)

    def new_empty(self, *shape, **kwargs) -> HostTensor:
        return HostTensor(self.array)

    def set_(self, storage, offset, size, stride) -> HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype


@functools.cache
def _interpreted_kernels():
    """kernels.py loaded once more with TRITON_INTERPRET=1, so `@triton.jit` gives interpreted functions.

    Triton decides at decoration time whether a function is compiled or interpreted; loading the
    module a second time keeps the compiled kernels of this process untouched.
    """
    name = kernels.__name__ + "_interpreted"
    spec = importlib.util.spec_from_file_location(name, kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    with _interpret_mode():
        spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _interpret_mode():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_LANGUAGE_LOCK = threading.Lock()
_TRITON_PATCH_LANG_TENSOR = interpreter._patch_lang_tensor

try:  # Imported lazily by Triton's argument handling, it must not see the swapped functions below.
    importlib.import_module("triton.experimental.gluon")
except ImportError:
    pass


# One interpreted twin per JITFunction (keyed by id: hashing a JITFunction reads its source's globals).
_INTERPRETED: dict[int, tuple[JITFunction, InterpretedFunction]] = {}


def _interpreted(function: JITFunction) -> InterpretedFunction:
    if id(function) not in _INTERPRETED:
        _INTERPRETED[id(function)] = (function, InterpretedFunction(function.fn))
    return _INTERPRETED[id(function)][1]


def _patch_lang_tensor(tensor, scope):
    """Triton's own patching of tl.tensor for the interpreter, with a scalar's __index__ as in 3.9.

    Triton 3.6 converts a scalar (held as a 1-element array) to an index with int(array), which
    NumPy 2 refuses ("only 0-dimensional arrays can be converted"), so `range(0, n, BLOCK)` over a
    loaded length fails there; Triton 3.9 squeezes the array first.
    """
    _TRITON_PATCH_LANG_TENSOR(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


@contextlib.contextmanager
def _interpreted_language():
    """Swap triton.language's own `@triton.jit` functions (tl.zeros, tl.max, tl.sum, ...) for
    interpreted ones while a kernel runs, as importing triton under TRITON_INTERPRET=1 would have,
    and Triton's tensor patching for the version-independent one above.

    They were compiled-mode functions since this process imported triton without that variable.
    A GPU compilation in another thread during this window would see the interpreted ones.
    """
    with _LANGUAGE_LOCK:
        replacements = [(interpreter, "_patch_lang_tensor", _patch_lang_tensor)]
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
                continue
            replacements += [(module, attr, _interpreted(value)) for attr, value in list(vars(module).items())
                             if isinstance(value, JITFunction)]
        originals = [(module, attr, getattr(module, attr)) for module, attr, _ in replacements]
        for module, attr, replacement in replacements:
            setattr(module, attr, replacement)
        try:
            yield
        finally:
            for module, attr, original in originals:
                setattr(module, attr, original)


def _host_dtype(dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype == jnp.bfloat16 else np.dtype(dtype)


def _fill(dtype):
    return np.nan if np.issubdtype(dtype, np.floating) else -1


class _Guarded:
    """An array in the middle of a buffer three times its size whose two guard zones hold NaN (-1 for
    integers). After a kernel ran, an intact guard shows it wrote nothing outside the array, and a NaN
    in its outputs would show that it read outside; every interpreted launch checks the first."""

    def __init__(self, values: np.ndarray | None, shape, dtype):
        size = int(np.prod(shape))
        self.pad = max(size, 1)
        self.buffer = np.full(2 * self.pad + size, _fill(dtype), dtype)
        self.array = self.buffer[self.pad:self.pad + size].reshape(shape)
        if values is not None:
            self.array[...] = values

    def guards_intact(self) -> bool:
        guards = np.concatenate([self.buffer[:self.pad], self.buffer[self.pad + self.array.size:]])
        return bool(np.all(np.isnan(guards)) if guards.dtype.kind == "f" else np.all(guards == -1))


def _run_on_host(call: KernelCall, *arrays: np.ndarray):
    kernel = getattr(_interpreted_kernels(), call.kernel.__name__)
    inputs = [_Guarded(a, a.shape, _host_dtype(a.dtype)) for a in arrays]
    # Outputs the kernel need not write fully (the log-sum-exp, delta) start as NaN, so tests see leaks.
    outputs = [_Guarded(0 if i in call.zeroed_outputs else None, s.shape, _host_dtype(s.dtype))
               for i, s in enumerate(call.out_shapes)]
    # Lanes that are never stored (keys past a sequence's end in the dk/dv kernel) may overflow exp2,
    # as they do silently on the GPU; stored values are checked by the tests, so numpy's warnings go.
    with _interpreted_language(), np.errstate(all="ignore"):
        kernel[call.grid](*(HostTensor(g.array) for g in inputs), call.num_tokens,
                          *(HostTensor(g.array) for g in outputs), **call.constants)
    if not all(g.guards_intact() for g in inputs + outputs):
        raise RuntimeError(f"{call.kernel.__name__} wrote outside its arrays")
    return tuple(g.array.astype(s.dtype) for g, s in zip(outputs, call.out_shapes))


def run(call: KernelCall, arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    return jax.pure_callback(functools.partial(_run_on_host, call), call.out_shapes, *arrays)
