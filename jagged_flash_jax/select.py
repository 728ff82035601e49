"""The one place that chooses what runs: which implementation (implementations.py) runs a problem's
forward and its backward, with which configuration. It is also the only reader of the environment
($JAGGED_FLASH_JAX_FORWARD, $JAGGED_FLASH_JAX_BACKWARD, $JAGGED_FLASH_JAX_TUNED_CONFIGS) and of the
device.

A caller asks by `backend` (where: "auto", "triton", "interpret", "xla") or by `implementation` (what:
a name among IMPLEMENTATIONS, or a sequence to fall through, as tokamax's `implementation=`), and
`backward_implementation` for the backward alone. The request (`Request`) is kept in the plan (`Plan`), so
that vmap and partitioning, which change the problem, choose again for the problem they make (`replan`):
an implementation that cannot run it is skipped only where the request allows another, else the call
fails saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import warnings
from collections.abc import Sequence

import jax

from . import _compat, configs
from .configs import BlockSizes
from .implementations import IMPLEMENTATIONS, Context, Device, Implementation
from .problem import Problem

# "portable" keeps the Hopper kernels out where they would run; "hopper": the Hopper kernels wherever they
# can run (short sequences too); "auto" or unset: the Hopper kernels where they can run and are faster.
FORWARD_ENV = "JAGGED_FLASH_JAX_FORWARD"
BACKWARD_ENV = "JAGGED_FLASH_JAX_BACKWARD"
KERNEL_CHOICES = ("auto", "portable", "hopper")
# Path of a JSON tile table written by `python -m benchmarks.tune`, merged over the built-in one.
TUNED_CONFIGS_ENV = "JAGGED_FLASH_JAX_TUNED_CONFIGS"

BACKENDS = ("auto", "triton", "interpret", "xla")
# What each backend asks for: the candidates, in order, of both passes. "auto" on a GPU where the kernels
# run falls through to "xla" for what no kernel supports.
_BACKEND_CANDIDATES = {"triton": ("hopper", "hstu-hopper", "portable"), "interpret": ("interpret",),
                       "xla": ("xla",), "auto": ("hopper", "hstu-hopper", "portable", "xla")}


@dataclasses.dataclass(frozen=True)
class Request:
    """What the caller asked for: each pass's candidates in order, and whether auto's preferences
    (implementations' `preferred`) order them, or only `supports` does."""

    forward: tuple[Implementation, ...]
    backward: tuple[Implementation, ...]
    prefer_forward: bool
    prefer_backward: bool
    block_sizes: BlockSizes | None = None
    table_path: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs a problem: each pass's implementation and its configuration (hashable: a static argument
    of the custom_vjp, custom_vmap and custom_partitioning), and the request and device it was chosen
    from."""

    request: Request
    device: Device
    forward: Implementation
    forward_config: object
    backward: Implementation
    backward_config: object

    @property
    def names(self) -> frozenset[str]:
        return frozenset((self.forward.name, self.backward.name))


# ---------------------------------------------------------------------------------------------------
# The device and the environment
# ---------------------------------------------------------------------------------------------------

_DEVICE: contextvars.ContextVar[Device | None] = contextvars.ContextVar("jagged_flash_jax_device",
                                                                        default=None)


def current_device() -> Device:
    """The device the ops run on (JAX's default), or the one `use_device` sets."""
    device = _DEVICE.get()
    if device is not None:
        return device
    platform = jax.default_backend()
    try:
        first = jax.devices()[0]
        kind = first.device_kind
    except Exception:  # no backend at all
        return Device(platform, configs.FALLBACK_GPU)
    capability = _compat.cuda_capability(first)
    sms = int(getattr(first, "core_count", 0) or 0) or configs.HOPPER_SMS
    return Device(platform, kind, capability, sms)


@contextlib.contextmanager
def use_device(device: Device):
    """Choose as on `device` (tests and probes: a Hopper GPU pretended on the CPU, say)."""
    token = _DEVICE.set(device)
    try:
        yield device
    finally:
        _DEVICE.reset(token)


def _kernel_choice(env: str) -> str:
    value = os.environ.get(env, "").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{env}={value!r}: expected one of {KERNEL_CHOICES}")
    return value


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"jagged_flash_jax: backend='auto' runs the pure-JAX 'xla' backend on this GPU, because "
                  f"the Triton kernels cannot run: {reason}", RuntimeWarning, stacklevel=5)


# ---------------------------------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------------------------------


def _implementations(value, argument: str, registry: dict) -> tuple[Implementation, ...]:
    """Implementations by name (in the op's `registry`) or as values, one or a sequence to fall through."""
    one = isinstance(value, (str, Implementation))
    values = (value,) if one else tuple(value) if isinstance(value, Sequence) else ()
    found = tuple(registry.get(v) if isinstance(v, str) else v for v in values)
    if not found or not all(isinstance(v, Implementation) for v in found):
        raise ValueError(f"{argument} must be one of {tuple(registry)} (or an Implementation), or a "
                         f"sequence of them to fall through, got {value!r}")
    return found


def request(backend: str = "auto", implementation=None, backward_implementation=None,
            block_sizes: BlockSizes | None = None, registry: dict = IMPLEMENTATIONS,
            deterministic: bool = True) -> Request:
    """The request of a call's arguments and of the environment: `implementation` (and
    `backward_implementation`) as given, else `backend`'s candidates, which $JAGGED_FLASH_JAX_FORWARD
    and $JAGGED_FLASH_JAX_BACKWARD narrow ("portable": no Hopper kernels; "hopper": the Hopper kernels
    wherever they can run). backend="auto" is "triton" on a GPU where jax-triton works, else "xla" (on a
    GPU, with a warning that says why), falling through to "xla" for what no kernel supports. `registry`:
    the op's implementations by name (implementations.py: IMPLEMENTATIONS, HSTU_IMPLEMENTATIONS).
    deterministic=False puts the dq-fused Hopper backward ("hopper-fused-dq", where the op has one)
    before the Hopper one among the backward's candidates: auto takes it where it is faster, "hopper"
    ($JAGGED_FLASH_JAX_BACKWARD) wherever it can run; a named implementation runs as named, so naming one
    with deterministic=False raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if implementation is not None and backend != "auto":
        raise ValueError(f"pass either backend ({backend!r}) or implementation ({implementation!r}), not "
                         f"both")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    if block_sizes is not None and None in (block_sizes.fwd, block_sizes.dkdv, block_sizes.dq):
        raise TypeError(f"block_sizes needs a KernelConfig for each of fwd, dkdv and dq, got {block_sizes}")
    if block_sizes is not None and block_sizes.fwd_causal is not None:
        raise TypeError("block_sizes.fwd_causal is for the tile table's entries; block_sizes are the tiles "
                        "that run, causal or not: pass a causal call's forward tiles as block_sizes.fwd, got "
                        f"{block_sizes}")
    table_path = os.environ.get(TUNED_CONFIGS_ENV) or None
    if not deterministic and (implementation is not None or backward_implementation is not None):
        raise ValueError("deterministic=False lets the backend's choice take a non-deterministic backward; "
                         "with implementation or backward_implementation named, name the backward instead "
                         "(backward_implementation='hopper-fused-dq') and leave deterministic at True")
    if implementation is not None:
        forward = _implementations(implementation, "implementation", registry)
        backward = forward if backward_implementation is None else _implementations(
            backward_implementation, "backward_implementation", registry)
        return Request(forward, backward, False, False, block_sizes, table_path)
    if backend == "auto" and not _kernels_run_here():
        backend = "xla"
    if backend == "triton":
        _check_triton_runs()
    candidates = tuple(registry[name] for name in _BACKEND_CANDIDATES[backend] if name in registry)
    if not candidates:
        raise ValueError(f"backend={backend!r} has no implementation of this op; it has {tuple(registry)}")
    passes = []
    for env in (FORWARD_ENV, BACKWARD_ENV):
        choice = _kernel_choice(env) if any(c.hopper for c in candidates) else "auto"
        kept = tuple(c for c in candidates if not c.hopper) if choice == "portable" else candidates
        passes.append((kept, choice == "auto"))
    (forward, prefer_forward), (backward, prefer_backward) = passes
    fused = registry.get("hopper-fused-dq")
    if not deterministic and fused is not None and registry.get("hopper") in backward:
        at = backward.index(registry["hopper"])
        backward = (*backward[:at], fused, *backward[at:])
    if backward_implementation is not None:
        backward = _implementations(backward_implementation, "backward_implementation", registry)
        prefer_backward = False
    return Request(forward, backward, prefer_forward, prefer_backward, block_sizes, table_path)


def default_backend() -> str:
    """What backend="auto" runs here: "triton" on a GPU where the kernels run (falling through to "xla"
    for what no kernel supports), else "xla" (on a GPU, with a warning, once, that says why)."""
    return "triton" if _kernels_run_here() else "xla"


def _check_triton_runs() -> None:
    """backend="triton" refused before tracing where the GPU kernels cannot run, saying why."""
    from .implementations import gpu_reason
    from .launch.gpu import INSTALL_HINT

    device = current_device()
    if not device.gpu:
        raise ValueError(f"backend='triton' needs a GPU, but JAX's default backend is {device.platform!r}; "
                         f"use backend='xla' or 'interpret', or {INSTALL_HINT}")
    if (reason := gpu_reason(device)) is not None:
        raise ValueError(f"backend='triton' cannot run: {reason}")


def _kernels_run_here() -> bool:
    """Whether the GPU kernels can run on the current device (for backend="auto"); on a GPU where they
    cannot, warns once with the reason."""
    from .implementations import gpu_reason

    device = current_device()
    if not device.gpu:
        return False
    reason = gpu_reason(device)
    if reason is not None:
        _warn_fallback(reason)
    return reason is None


# ---------------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------------


def _choose_pass(p: Problem, context: Context, candidates: tuple[Implementation, ...], prefer: bool,
                 backward: bool):
    """(implementation, config) of one pass: the first candidate that supports the problem (and, with
    `prefer`, that auto prefers, else the first that supports it); ValueError with every reason where
    none does."""
    reasons, supported = [], []
    for impl in candidates:
        config = impl.config(p, context, backward)
        reason = impl.supports(p, context, config, backward)
        if reason is None:
            supported.append((impl, config))
            if not prefer or (reason := impl.preferred(p, context, backward)) is None:
                return impl, config
        reasons.append(f"{impl.name!r}: {reason}")
    if supported:  # supported, though auto prefers none of them: the first
        return supported[0]
    what = "backward" if backward else "forward"
    names = tuple(impl.name for impl in candidates)
    raise ValueError(f"no implementation among {names} can run this {what}: {'; '.join(reasons)}")


def choose(p: Problem, req: Request, device: Device | None = None) -> Plan:
    """The plan of problem `p` for request `req` on `device` (default: `current_device()`)."""
    device = device or current_device()
    context = Context(device, configs.load_table(req.table_path), req.table_path, req.block_sizes)
    forward, forward_config = _choose_pass(p, context, req.forward, req.prefer_forward, backward=False)
    backward, backward_config = _choose_pass(p, context, req.backward, req.prefer_backward, backward=True)
    return Plan(req, device, forward, forward_config, backward, backward_config)


def replan(plan: Plan, p: Problem) -> Plan:
    """The plan of a problem that vmap or partitioning made from the planned one: chosen again, by the same
    request on the same device."""
    return choose(p, plan.request, plan.device)


def why(p: Problem, implementation: str, backward: bool = False, device: Device | None = None) -> str | None:
    """Why `implementation` would not run the forward (backward) of `p` under backend="auto" here: it does
    not support it, or auto prefers another; None where it would."""
    device = device or current_device()
    table_path = os.environ.get(TUNED_CONFIGS_ENV) or None
    context = Context(device, configs.load_table(table_path), table_path)
    impl = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    return (impl.supports(p, context, impl.config(p, context, backward), backward)
            or impl.preferred(p, context, backward))
