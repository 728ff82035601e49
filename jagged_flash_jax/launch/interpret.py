"""Runs the kernels (the kernels package) in Triton's interpreter on the CPU, called from JAX by
pure_callback: the interpreter driven through its private internals (triton>=3.6,<3.10), and the host
arrays, each between guard zones that prove the kernel wrote nothing outside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import threading
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .calls import KernelCall, is_gluon

# ---------------------------------------------------------------------------------------------------
# Triton's interpreter
#
# Triton decides when `@triton.jit` runs whether a function is compiled (JITFunction) or interpreted
# (InterpretedFunction), from TRITON_INTERPRET; the kernels serve the GPU too, so they are usually
# JITFunctions. So an interpreted twin is made of each kernel, with every `@triton.jit` function it calls
# by global name twinned too, and triton.language's own `@triton.jit` functions are swapped for twins
# while a kernel runs. Kernels made under TRITON_INTERPRET=1 (Triton's documented way to debug) are
# twinned the same way, so both run. Nothing here touches os.environ: a process-wide toggle cannot be
# made safe for other threads.
# ---------------------------------------------------------------------------------------------------

TRITON_SUPPORTED = _compat.requirement("triton")


class UnsupportedTritonError(RuntimeError):
    """Triton is outside the supported range, or lacks an interpreter internal this package uses."""


@dataclasses.dataclass(frozen=True)
class _Internals:
    interpreter: types.ModuleType  # triton.runtime.interpreter
    interpreted_function: type  # InterpretedFunction: what `@triton.jit` gives under TRITON_INTERPRET=1
    jit_function: type  # JITFunction: what it gives otherwise
    patch_lang_tensor: object  # interpreter._patch_lang_tensor, replaced while a kernel runs
    patch_lang: object  # interpreter._patch_lang, replaced while a kernel runs
    get_np_dtype: object  # interpreter._get_np_dtype, replaced while a kernel runs


def triton_internals() -> _Internals:
    """The interpreter internals, checked each call (cheap) against the installed Triton.

    Raises UnsupportedTritonError naming the supported range when Triton is outside it or an internal
    is missing.
    """
    try:
        import triton
    except ImportError as err:
        raise ImportError(f"backend='interpret' runs the kernels in Triton's interpreter, and triton is not "
                          f"installed: pip install 'jagged-flash-jax[interpret]' ({err})") from err

    found = getattr(triton, "__version__", "unknown")
    if not _compat.version_in(found, "triton"):
        raise UnsupportedTritonError(
            f"backend='interpret' runs the kernels with Triton's interpreter, whose internals this "
            f"package uses for {TRITON_SUPPORTED}; found triton {found}: pip install '{TRITON_SUPPORTED}'")
    try:
        interpreter = importlib.import_module("triton.runtime.interpreter")
        jit = importlib.import_module("triton.runtime.jit")
        return _Internals(interpreter, interpreter.InterpretedFunction, jit.JITFunction,
                          interpreter._patch_lang_tensor, interpreter._patch_lang, interpreter._get_np_dtype)
    except (ImportError, AttributeError) as err:
        raise UnsupportedTritonError(
            f"backend='interpret' needs an internal of Triton's interpreter that triton {found} lacks "
            f"({err}); this package supports {TRITON_SUPPORTED}") from err


class HostTensor:
    """The part of torch.Tensor's interface that Triton's interpreter uses, over a numpy array.

    The interpreter copies tensors to a "host" storage and back; here they already are on the host, so
    both copies are the same memory.
    """

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


class _HostStorage:
    def __init__(self, array: np.ndarray):
        self._array = array

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def cpu(self) -> _HostStorage:
        return self

    def copy_(self, other: _HostStorage) -> None:
        if other is not self and other.data_ptr() != self.data_ptr():
            raise RuntimeError("host tensors are not expected to be copied between storages")


# Held for every use of the interpreter: building twins, swapping triton.language, running a kernel.
# The interpreter keeps the grid position in one global builder, so two kernels cannot run at once anyway.
_LOCK = threading.RLock()
# id(module globals) -> (those globals, {id(JITFunction): (JITFunction, its twin)}); the globals and
# the JITFunctions are kept alive so that their ids are not reused.
_MODULE_TWINS: dict[int, tuple[dict, dict[int, tuple[object, object]]]] = {}
# Twins of triton.language's functions, keyed by id (hashing a JITFunction reads its source's globals).
_LANGUAGE_TWINS: dict[int, tuple[object, object]] = {}
_gluon_imported = False


def _twin_namespace(internals: _Internals, namespace: dict) -> dict[int, tuple[object, object]]:
    """Twins of the `@triton.jit` functions among a module's globals, living in a copy of those globals
    in which every such function is its twin (so that the twins call each other). A function imported
    from another module is that module's twin, which runs with its own module's globals, as compiled
    code does."""
    twin_globals = dict(namespace)
    twins = {}
    for name, value in namespace.items():
        if isinstance(value, (internals.jit_function, internals.interpreted_function)):
            fn = value.fn
            if fn.__globals__ is not namespace:
                twin_globals[name] = _module_twins(internals, fn.__globals__, value)[id(value)][1]
            else:
                copy = types.FunctionType(fn.__code__, twin_globals, fn.__name__, fn.__defaults__,
                                          fn.__closure__)
                copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
                twin_globals[name] = internals.interpreted_function(copy)
            twins[id(value)] = (value, twin_globals[name])
    return twins


def _module_twins(internals: _Internals, namespace: dict, function) -> dict[int, tuple[object, object]]:
    """The twins of a module's namespace, made again when `function` is not among them (a new module, or
    a function defined since)."""
    entry = _MODULE_TWINS.get(id(namespace))
    if entry is None or id(function) not in entry[1]:
        entry = _MODULE_TWINS[id(namespace)] = (namespace, _twin_namespace(internals, namespace))
    if id(function) not in entry[1]:
        raise ValueError(f"{function.fn.__name__} must be a module-level @triton.jit function")
    return entry[1]


def _kernel_twin(internals: _Internals, kernel):
    if not isinstance(kernel, (internals.jit_function, internals.interpreted_function)):
        raise TypeError(f"expected a @triton.jit function, got {type(kernel).__name__}")
    return _module_twins(internals, kernel.fn.__globals__, kernel)[id(kernel)][1]


def _import_gluon_once() -> None:
    """Import gluon before the first swap: Triton imports it lazily, and it would then keep the twins."""
    global _gluon_imported
    if not _gluon_imported:
        with contextlib.suppress(ImportError):
            importlib.import_module("triton.experimental.gluon")
        _gluon_imported = True


@contextlib.contextmanager
def _interpreted_language(internals: _Internals):
    """triton.language's `@triton.jit` functions (tl.max, tl.sum, ...) swapped for twins, as importing
    triton under TRITON_INTERPRET=1 would have made them, and Triton's patching of tl.tensor for a
    version-independent one. Only under _LOCK; a GPU compilation in another thread during this window
    would still see the twins, which is why the window covers one kernel run only."""
    original_patch = internals.patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        # Triton 3.6 converts a scalar (a 1-element array) to an index with int(array), which NumPy 2
        # refuses, so `range(0, n, BLOCK)` over a loaded length fails; 3.9 squeezes the array first.
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    original_patch_lang = internals.patch_lang
    patched = set()  # id(globals) of the functions whose triton.language modules this run has patched

    def patch_lang(fn):
        # Triton patches triton.language anew at every call of a `@triton.jit` function inside a kernel
        # (inspect.getmembers over tl, tl.math and tl.tensor: some 40% of an interpreted kernel's time)
        # and never undoes those patches. A patch depends only on the language modules in fn's globals,
        # and nothing undoes it before the grid's end: once per globals in a run does the same. The
        # grid's own call (the first) patches, and its scope undoes that at the grid's end as before.
        if id(fn.__globals__) in patched:
            return _NoPatches()
        patched.add(id(fn.__globals__))
        return original_patch_lang(fn)

    original_np_dtype = internals.get_np_dtype
    language = importlib.import_module("triton.language")
    np_dtypes = {}

    def np_dtype(tt_dtype):
        # Triton builds a dict of its 19 scalar types at every call (for each operand of each operation):
        # the answer depends on the scalar type alone (a block's is its element's), kept here by it.
        # Pointer types (not hashable) go to Triton's function as before.
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, language.block_type) else tt_dtype
        if type(scalar) is not language.dtype:
            return original_np_dtype(tt_dtype)
        found = np_dtypes.get(scalar)
        if found is None:
            found = np_dtypes[scalar] = original_np_dtype(scalar)
        return found

    state = _language_state()  # the twins go with everything else the interpreter changes there
    internals.interpreter._patch_lang_tensor = patch_lang_tensor
    internals.interpreter._patch_lang = patch_lang
    internals.interpreter._get_np_dtype = np_dtype
    for module in _language_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, internals.jit_function):
                if id(value) not in _LANGUAGE_TWINS:
                    _LANGUAGE_TWINS[id(value)] = (value, internals.interpreted_function(value.fn))
                setattr(module, attr, _LANGUAGE_TWINS[id(value)][1])
    try:
        yield
    finally:
        internals.interpreter._patch_lang_tensor = original_patch
        internals.interpreter._patch_lang = original_patch_lang
        internals.interpreter._get_np_dtype = original_np_dtype
        _restore_language(state)


class _NoPatches:
    """The scope of a patch already made (the interpreter's _LangPatchScope's interface)."""

    def restore(self) -> None:
        pass


_MISSING = object()


def _language_modules() -> list:
    """triton.language and its submodules, as imported so far."""
    return [module for name, module in list(sys.modules.items()) if module is not None
            and (name == "triton.language" or name.startswith("triton.language."))]


def _language_state() -> list[tuple[object, dict]]:
    """The attributes of triton.language's modules and classes. The interpreter patches them for good
    (tl.where, tl.store, tl.tensor's operators, ...): left so, a GPU compilation later in the process
    fails inside the code generator."""
    modules = _language_modules()
    classes = {value for module in modules for value in vars(module).values()
               if isinstance(value, type) and value.__module__.startswith("triton.language")}
    return [(owner, dict(vars(owner))) for owner in [*modules, *classes]]


def _restore_language(state: list[tuple[object, dict]]) -> None:
    """Put back every attribute `_language_state` saw, and drop what the interpreter added to classes.
    Names it adds to modules stay: it puts them in once and counts on them (interpreter_semantic in
    triton.language.standard), and compiled code does not look them up."""
    for owner, saved in state:
        current = vars(owner)
        for attr, value in saved.items():
            if current.get(attr, _MISSING) is not value:
                setattr(owner, attr, value)
        if isinstance(owner, type):
            for attr in [attr for attr in current if attr not in saved]:
                delattr(owner, attr)


def interpret(kernel, grid: tuple[int, ...], *args, **constants) -> None:
    """Run a module-level `@triton.jit` kernel of this process in Triton's interpreter, in place.

    numpy arrays among `args` are passed as pointers (they must be C-contiguous and writeable); other
    arguments as they are. Thread-safe: kernels run one at a time.
    """
    with _LOCK:
        internals = triton_internals()
        _import_gluon_once()
        twin = _kernel_twin(internals, kernel)
        args = [HostTensor(a) if isinstance(a, np.ndarray) else a for a in args]
        with _interpreted_language(internals):
            twin[grid](*args, **constants)


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


def _descriptor(array: np.ndarray, block: tuple[int, ...]):
    """Triton's host tensor descriptor of `block` tiles over a 2-D array (the interpreter reads zeros past
    its ends, as TMA does)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(HostTensor(array), list(array.shape), [array.shape[1], 1], list(block))


def _run_on_host(call: KernelCall, *arrays: np.ndarray):
    inputs = [Guarded(a, a.shape, _host_dtype(a.dtype)) for a in arrays]
    # Outputs start as the sentinel, not zeros: an element the kernel should have written shows up.
    outputs = [Guarded(None, s.shape, _host_dtype(s.dtype)) for s in call.out_shapes]
    blocks = dict(call.descriptors)
    args = [_descriptor(g.array, blocks[i]) if i in blocks else g.array for i, g in enumerate(inputs)]
    # Lanes that are never stored (keys past a sequence's end in the dk/dv kernel) may overflow exp2,
    # as they do silently on the GPU; stored values are checked by the tests, so numpy's warnings go.
    # A sentinel left in an output is a NaN that rounding to bfloat16 warns about: the tests look for it.
    with np.errstate(all="ignore"):
        interpret(call.kernel, call.grid, *args, *(g.array for g in outputs), **call.constants)
        if not all(g.guards_intact() for g in inputs + outputs):
            raise RuntimeError(f"{call.kernel.__name__} wrote outside its arrays")
        return tuple(g.array.astype(s.dtype) for g, s in zip(outputs, call.out_shapes))


def run(call: KernelCall, arrays: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    if is_gluon(call.kernel):  # the Hopper kernels
        raise ValueError(f"{call.kernel.__name__} runs on the GPU only (a Gluon kernel)")
    triton_internals()  # an unsupported Triton fails here, at trace time, with its own message
    return jax.pure_callback(functools.partial(_run_on_host, call), call.out_shapes, *arrays)
