"""Every reliance on a dependency's changing or private surface, in one place (but Triton's interpreter
internals, which launch/interpret.py drives), and the supported versions.

Versions: the supported ranges and the one version parser. JAX: how an abstract value names the manual
mesh axes it varies over, and a device's CUDA compute capability. jax-triton (0.4.1): four shims, for its
import under triton 3.6 (before it, and repaired after it), its launch of warp-specialized kernels, and
the TMA descriptors' metadata of triton < 3.7. jaxlib: which ptxas assembles the kernels' PTX, and the
PTX version that ptxas accepts. Triton's Gluon: whether it has the TMA reduce-add.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import math
import os
import re
import subprocess
import types

import jax

# ---------------------------------------------------------------------------------------------------
# Versions: the supported ranges, stated for pip by pyproject.toml (tests/test_install.py holds the two
# alike), and the one parser of version strings
# ---------------------------------------------------------------------------------------------------

# [low, high) of each dependency whose surface this module relies on.
SUPPORTED = {"jax": ((0, 10, 2), (0, 12)), "triton": ((3, 6), (3, 10)), "jax-triton": ((0, 4, 1), (0, 5))}


def release(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string, missing parts 0; () when it does not start with one."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(part or 0) for part in match.groups()) if match else ()


def version_in(version: str, bounds) -> bool:
    """Whether a version string lies in [low, high) (bounds, or SUPPORTED's entry of that name), compared
    on as many parts as `low` has."""
    low, high = SUPPORTED[bounds] if isinstance(bounds, str) else bounds
    found = release(version)[:len(low)]
    return bool(found) and low <= found < high


def requirement(name: str) -> str:
    """The pip requirement of a supported range, e.g. "triton>=3.6,<3.10"."""
    low, high = SUPPORTED[name]
    return f"{name}>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


# ---------------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------------


def cuda_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a JAX device's CUDA compute capability (its `compute_capability` string), or
    None (not a CUDA device)."""
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return None


def varying_axes(x) -> frozenset:
    """The manual mesh axes (inside shard_map) that x varies over; empty outside shard_map."""
    # `.vma` up to JAX 0.9, `.mat.varying` from 0.10.
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
        vma = mat.varying if mat is not None else ()
    return frozenset(vma)


# ---------------------------------------------------------------------------------------------------
# Triton's Gluon
# ---------------------------------------------------------------------------------------------------


@functools.cache
def gluon_tma_reduce() -> bool:
    """Whether this Triton's Gluon has the TMA reduce-add (tma.async_atomic_add, triton >= 3.7; 3.6 has
    only its builder call): the dq-fused Hopper backward then adds dq through it
    (kernels/hopper/dkdv.attention_bwd_dkdv_dq_tma_kernel), else by atomics from registers."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except Exception:  # no triton, or no Gluon (ImportError, or whatever a broken install raises)
        return False
    return hasattr(tma, "async_atomic_add")


@functools.cache
def triton_release() -> tuple[int, ...]:
    """(major, minor, patch) of the installed Triton, () without one (from its package metadata: no
    import)."""
    try:
        return release(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:
        return ()


# ---------------------------------------------------------------------------------------------------
# jax-triton
# ---------------------------------------------------------------------------------------------------

# CUDA's CU_TENSOR_MAP_DATA_TYPE_TFLOAT32, which triton>=3.7 names TMA_TF32 in its NVIDIA driver module
# (the host-side TMA descriptor dtype of float32 rounded to TF32).
_TMA_TF32 = 11


def prepare_jax_triton_import() -> None:
    """Call before `import jax_triton`. jax-triton 0.4 imports TMA_TF32 from triton>=3.7's NVIDIA driver;
    under triton 3.6 that import fails and jax-triton takes the machine for one without the NVIDIA
    backend, and breaks. Defining the constant, CUDA's value (the map type of float32 rounded to TF32,
    which jax-triton gives a descriptor over float32 with `round_f32_to_tf32`), makes the import succeed.
    Where jax_triton was imported before this ran, `repair_stubbed_jax_triton` mends it afterwards."""
    try:
        jax_triton_version = release(importlib.metadata.version("jax-triton"))
        import triton
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return
    if not ((0, 4) <= jax_triton_version < (0, 5) and (3, 6) <= release(triton.__version__) < (3, 7)):
        return
    try:
        driver = importlib.import_module("triton.backends.nvidia.driver")
    except ImportError:  # no NVIDIA backend: jax-triton's own fallback is right then
        return
    if not hasattr(driver, "TMA_TF32"):
        driver.TMA_TF32 = _TMA_TF32


def _stubbed_nvidia_backend(triton_lib) -> bool:
    """Whether jax-triton's triton_lib put stubs in place of Triton's NVIDIA backend (its `cb` a namespace
    whose classes are its `_Stub`), as its import does when importing that backend fails."""
    cb = getattr(triton_lib, "cb", None)
    stub = getattr(triton_lib, "_Stub", None)
    return (isinstance(cb, types.SimpleNamespace) and stub is not None
            and getattr(cb, "CUDABackend", None) is stub)


def repair_stubbed_jax_triton(jax_triton) -> bool:
    """Put Triton's NVIDIA backend back into a jax_triton imported before `prepare_jax_triton_import` ran.

    jax-triton 0.4.1's triton_lib imports `triton.backends.nvidia.compiler` as `cb` and the driver's
    TMA_DTYPE_DEVICE_TO_HOST and TMA_TF32 at its import. Under triton 3.6, which lacks TMA_TF32, that
    import fails and it puts stubs there (`cb.GPUTarget` and the rest `_Stub`, an empty dtype map, a
    TF32 type 0): every triton_call then dies with `AttributeError: '_Stub' object has no attribute
    'backend'`. That happens whenever jax_triton is imported first (by a user, or by a library such as
    tokamax). Where the NVIDIA backend imports, this puts back the real module, the driver's dtype map and
    the TF32 map type (triton's own, else `_TMA_TF32`); triton_lib's functions look those names up when
    called, so they work from then on. Idempotent; nothing happens where nothing is stubbed or the
    backend does not import (no NVIDIA backend: jax-triton's stubs are right then). Returns whether it
    repaired."""
    triton_lib = getattr(jax_triton, "triton_lib", None)
    if triton_lib is None or not _stubbed_nvidia_backend(triton_lib):
        return False
    try:
        compiler = importlib.import_module("triton.backends.nvidia.compiler")
        driver = importlib.import_module("triton.backends.nvidia.driver")
        dtype_map = driver.TMA_DTYPE_DEVICE_TO_HOST
    except (ImportError, AttributeError):
        return False
    triton_lib._TMA_DTYPE_DEVICE_TO_HOST = dtype_map
    triton_lib._TMA_TF32 = getattr(driver, "TMA_TF32", _TMA_TF32)
    triton_lib.cb = compiler
    return True


# jax-triton versions that launch a kernel with the num_warps it was asked for rather than the count that
# Triton compiled, which warp specialization (`tl.range(..., warp_specialize=True)`) raises; such a
# kernel then fails to launch. Measured on 0.4.1.
JAX_TRITON_LAUNCHING_REQUESTED_WARPS = frozenset({(0, 4, 1)})


def ptx_warps(binary: str | bytes) -> int | None:
    """The warps a compiled kernel needs: its PTX's `.reqntid` or `.maxntid` (threads per block; Triton
    writes `.reqntid`, a warp-specialized kernel's count included) over 32, or None."""
    text = binary.decode(errors="replace") if isinstance(binary, bytes) else str(binary)
    match = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", text)
    if match is None:
        return None
    return math.prod(int(size) for size in match.groups() if size) // 32


class _KernelLibWithCompiledWarps:
    """jaxlib's Triton kernel-call module as jax-triton sees it, except that TritonKernel(name, num_warps,
    num_ctas, shared_mem, binary, ...) takes the warps from the PTX (`ptx_warps`) when that asks for more."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def TritonKernel(self, name, num_warps, num_ctas, shared_mem, binary, *rest):  # noqa: N802 (its name)
        num_warps = max(num_warps, ptx_warps(binary) or 0)
        return self.lib.TritonKernel(name, num_warps, num_ctas, shared_mem, binary, *rest)


def patch_jax_triton(jax_triton) -> None:
    """Make an imported jax_triton launch warp-specialized kernels, on the versions that need it (once)."""
    if release(getattr(jax_triton, "__version__", "")) not in JAX_TRITON_LAUNCHING_REQUESTED_WARPS:
        return
    triton_lib = getattr(jax_triton, "triton_lib", None)
    lib = getattr(triton_lib, "triton_kernel_call_lib", None)
    if lib is None or isinstance(lib, _KernelLibWithCompiledWarps):  # no GPU support, or done already
        return
    triton_lib.triton_kernel_call_lib = _KernelLibWithCompiledWarps(lib)


def patch_tensordesc_meta(jax_triton) -> None:
    """jax-triton 0.4.1 requires an `is_im2col` key in every entry of a compiled kernel's
    `tensordesc_meta` (its CompilationResult checks the keys of TensorDescMeta); triton < 3.7 writes no
    such key, so every kernel taking a TMA descriptor fails there. Entries without it get False (im2col
    descriptors came with 3.7). Only where jax-triton asks for the key and triton lacks it; once."""
    triton_lib = getattr(jax_triton, "triton_lib", None)
    result = getattr(triton_lib, "CompilationResult", None)
    meta = getattr(triton_lib, "TensorDescMeta", None)
    if result is None or "is_im2col" not in getattr(meta, "__annotations__", {}):
        return
    try:
        import triton
    except ImportError:
        return
    if release(getattr(triton, "__version__", "")) >= (3, 7):
        return
    original = result.__post_init__
    if getattr(original, "adds_is_im2col", False):
        return

    def __post_init__(self):  # noqa: N807 (the dataclass hook's name)
        if self.tensordesc_meta is not None:
            self.tensordesc_meta = [entry if "is_im2col" in entry else dict(entry, is_im2col=False)
                                    for entry in self.tensordesc_meta]
        original(self)

    __post_init__.adds_is_im2col = True
    result.__post_init__ = __post_init__


# ---------------------------------------------------------------------------------------------------
# jaxlib's ptxas
#
# jax-triton compiles a kernel to PTX with Triton and hands the PTX to jaxlib, which assembles it with a
# ptxas that it looks for itself. Triton writes the PTX version its own bundled ptxas accepts (`.version
# 9.4` from triton 3.9's CUDA 13.4), which an older ptxas refuses at the first launch: `ptxas fatal :
# Unsupported .version 9.4; current version is '9.0'` (CUDA 13.0's). Triton's `ptx_version` option
# writes an older version instead (its code generation is capped at PTX 9.0's features anyway).
# ---------------------------------------------------------------------------------------------------

# PTX 8.7 (CUDA 12.8's ptxas, what triton 3.6 writes for sm_90): the oldest the kernels were tested at.
OLDEST_TESTED_PTX = 87
# XLA's FindPtxAsExecutable skips a ptxas older than 11.8.0, and 12.3.103 (a release with a known bug).
_XLA_MINIMUM_PTXAS = (11, 8, 0)
_XLA_EXCLUDED_PTXAS = frozenset({(12, 3, 103)})
# XLA's generic CUDA roots after $CUDA_HOME (a module attribute so that the tests can point it elsewhere).
_XLA_FIXED_CUDA_ROOTS = ("/usr/local/cuda", "/opt/cuda")
# jaxlib's plugins in the order jaxlib.plugin_support imports them, with the folder of the pip CUDA
# packages holding ptxas that XLA looks for beside them (by the CUDA version the plugin was built with).
_JAX_CUDA_PLUGINS = (("jax_cuda13_plugin", "nvidia/cu13"), ("jax_cuda12_plugin", "nvidia/cuda_nvcc"))


def _jax_cuda_plugin() -> tuple[str, str] | None:
    """(the folder of the installed jax CUDA plugin, which holds jaxlib's Triton kernel call, and the
    folder of its pip nvcc package relative to site-packages), or None without a plugin. Not imported."""
    for name, nvcc in _JAX_CUDA_PLUGINS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)[0], nvcc
    return None


def _xla_cuda_roots() -> list[str]:
    """tsl::CandidateCudaRoots() of a pip jaxlib, in order (Bazel's runfiles folders and the build's
    TF_CUDA_TOOLKIT_PATH left out)."""
    roots = [os.environ["CUDA_HOME"]] if os.environ.get("CUDA_HOME") else []
    roots += _XLA_FIXED_CUDA_ROOTS
    plugin = _jax_cuda_plugin()
    if plugin is not None:  # relative to the library holding the code (dladdr): the plugin's folder
        folder, nvcc = plugin
        roots += [os.path.join(folder, "..", nvcc), os.path.join(folder, "..", "..", nvcc),
                  os.path.join(folder, "cuda"),
                  os.path.join(folder, "..", "..", "..", ".."),  # a conda environment's prefix
                  os.path.join(folder, "..", "..", "..", "..", "..")]
    return roots


def xla_ptxas_candidates() -> list[str]:
    """Where jaxlib looks for the ptxas that assembles jax-triton's kernels, in its order.

    Read from the sources (jax-ml/jax and openxla/xla): jaxlib/gpu/triton_kernels.cc's GetModuleImage
    assembles a kernel with stream_executor::CompileGpuAsm and `GpuAsmOpts(..., preferred_cuda_dir="",
    ...)`, so XLA_FLAGS' --xla_gpu_cuda_data_dir, which XLA's own compiler passes there, does not reach
    these kernels. CompileGpuAsm runs ptxas as a subprocess unless the build links libnvptxcompiler (the
    GPU machine's jax 0.11.2 runs ptxas: a ptxas put first on PATH changed what it accepted), found by
    FindPtxAsExecutable -> FindCudaExecutable
    (xla/stream_executor/cuda/subprocess_compilation.cc; cuda_asm_compiler.cc before), whose candidates
    are, with tsl::PreferPtxasFromPath() true (xla/tsl/platform/default/cuda_root_path.cc):
      1. the preferred CUDA folder's bin/ptxas: with "" there, `bin/ptxas` relative to the working folder;
      2. every folder of PATH, in order (an empty entry: the working folder);
      3. the CUDA roots of tsl::CandidateCudaRoots(), each's bin/ptxas: Bazel's runfiles folders, $CUDA_HOME
         (newer XLA), the build's TF_CUDA_TOOLKIT_PATH, /usr/local/cuda, /opt/cuda, then beside the library
         holding the code (site-packages/jax_cuda13_plugin): ../nvidia/cu13 and ../../nvidia/cu13 for a
         CUDA 13 build (the pip `nvidia-cuda-nvcc` 13 package, which `jax[cuda13]` installs, puts ptxas
         in site-packages/nvidia/cu13/bin; nvidia/cuda_nvcc for CUDA 12), its cuda/ folder, and the
         prefix four and five folders up (conda).
    The first that runs `--version` with exit status 0, prints a version `V<major>.<minor>.<patch>` of at
    least 11.8.0 and is not 12.3.103 is taken (a pip nvcc is therefore found only after PATH and
    /usr/local/cuda). Runfiles and TF_CUDA_TOOLKIT_PATH are left out here: neither exists outside Bazel.
    """
    candidates = [os.path.join("bin", "ptxas")]
    candidates += [os.path.join(folder, "ptxas") for folder in os.environ.get("PATH", "").split(os.pathsep)]
    candidates += [os.path.join(root, "bin", "ptxas") for root in _xla_cuda_roots()]
    return candidates


def _version_text(path: str) -> str | None:
    """What the file `path --version` prints when it exits with status 0, else None."""
    path = os.path.abspath(path)
    return _run_version(path) if os.path.isfile(path) else None


@functools.cache
def _run_version(path: str) -> str | None:
    # Cached by path, as XLA's GetToolVersion caches (a file that appears later is still seen).
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def _tool_version(path: str) -> tuple[int, int, int] | None:
    text = _version_text(path)
    match = re.search(r"\bV(\d+)\.(\d+)\.(\d+)\b", text or "")
    return tuple(int(part) for part in match.groups()) if match else None


def xla_ptxas() -> str | None:
    """The ptxas jaxlib will assemble the kernels with (the absolute path), found as jaxlib finds it
    (`xla_ptxas_candidates`), or None where it finds none."""
    for candidate in xla_ptxas_candidates():
        version = _tool_version(candidate)
        if version is not None and version >= _XLA_MINIMUM_PTXAS and version not in _XLA_EXCLUDED_PTXAS:
            return os.path.abspath(candidate)
    return None


def _cudarelease(path: str) -> tuple[int, int] | None:
    """The CUDA release of a ptxas ("Cuda compilation tools, release 13.0, V13.0.88": (13, 0))."""
    text = _version_text(path) or ""
    match = re.search(r"release (\d+)\.(\d+)", text) or re.search(r"\bV(\d+)\.(\d+)\.\d+\b", text)
    return (int(match[1]), int(match[2])) if match else None


def ptxas_ptx_version(path: str) -> int | None:
    """The newest PTX version a ptxas accepts, as Triton counts it (90 for PTX 9.0, CUDA 13.0's), by
    Triton's own mapping from the CUDA release; None when it does not run or Triton is missing."""
    release = _cudarelease(path)
    if release is None:
        return None
    try:
        from triton.backends.nvidia.compiler import ptx_get_version
    except ImportError:
        return None
    try:
        return ptx_get_version(f"{release[0]}.{release[1]}")
    except (RuntimeError, ValueError):  # a release older than Triton knows
        return None


@functools.cache
def triton_ptx_version(arch: int = 90) -> int | None:
    """The PTX version Triton writes for a compute capability (major * 10 + minor) when not told one:
    its bundled ptxas's (94 from triton 3.9 for sm_90, whose ptxas-blackwell is CUDA 13.4's; 87 from
    triton 3.6, whose ptxas for sm_90 is CUDA 12.8's). None without Triton's NVIDIA backend."""
    try:
        from triton.backends.nvidia import compiler
    except ImportError:
        return None
    try:  # triton 3.6 to 3.9: the options' ptx_version, else their ptxas's (3.9 takes ptxas-blackwell
        # from sm_90 on, 3.6 from sm_100 on)
        return compiler.get_ptx_version_from_options(compiler.CUDAOptions(), arch)
    except Exception:  # another Triton: the same from its parts
        try:
            return compiler.ptx_get_version(compiler.get_ptxas(arch).version)
        except Exception:
            return None


def ptx_version_option(triton_default: int | None) -> dict:
    """Triton backend options that make the kernels' PTX assemble with jaxlib's ptxas: `{"ptx_version":
    N}` where that ptxas accepts at most N, lower than `triton_default` (`triton_ptx_version(arch)`),
    else {} (Triton's own version is fine, or no ptxas was found). Pass it in jax_triton.triton_call's
    backend_options."""
    ptxas = xla_ptxas()
    accepted = None if ptxas is None else ptxas_ptx_version(ptxas)
    if triton_default is None or accepted is None or accepted >= triton_default:
        return {}
    return {"ptx_version": accepted}


def _pip_nvcc_bin() -> str | None:
    plugin = _jax_cuda_plugin()
    if plugin is None:
        return None
    return os.path.normpath(os.path.join(plugin[0], "..", plugin[1], "bin"))


def ptxas_unsupported_reason() -> str | None:
    """Why jaxlib's ptxas cannot assemble the kernels (it accepts only PTX older than
    OLDEST_TESTED_PTX, 8.7), with what to install; None when it can, or where none is found (jaxlib then
    says where it looked)."""
    ptxas = xla_ptxas()
    accepted = None if ptxas is None else ptxas_ptx_version(ptxas)
    if accepted is None or accepted >= OLDEST_TESTED_PTX:
        return None
    release = ".".join(map(str, _cudarelease(ptxas)))
    pip_bin = _pip_nvcc_bin() or "<site-packages>/nvidia/cu13/bin"
    return (f"jaxlib assembles the kernels' PTX with {ptxas} (CUDA {release}), which accepts PTX up to "
            f"{accepted // 10}.{accepted % 10}; the kernels need PTX {OLDEST_TESTED_PTX // 10}."
            f"{OLDEST_TESTED_PTX % 10} (CUDA 12.8) or newer. jaxlib takes the first ptxas on PATH (before "
            f"/usr/local/cuda and pip's CUDA packages; XLA_FLAGS' --xla_gpu_cuda_data_dir does not reach "
            f"it): put a newer one first, e.g. pip install -U 'nvidia-cuda-nvcc>=13' && export "
            f"PATH={pip_bin}:$PATH, or a CUDA toolkit >= 12.8's bin folder")
