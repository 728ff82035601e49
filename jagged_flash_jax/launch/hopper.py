"""Which forward and backward kernels a problem of the triton backend runs: the Hopper ones
(kernels/hopper.py, kernels/hopper_backward.py, Gluon) or the portable ones, each chosen on its own.
Chosen once, when api.py builds the Problem (`with_kernels`: its static `hopper_tiles`,
`forward_kernel` and `backward_kernel` fields), so that jit caches one trace per choice.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from ..configs import (
    BACKWARD_KERNEL_ENV,
    FORWARD_KERNEL_ENV,
    HOPPER_BACKWARD_AUTO_HEAD_DIMS,
    HOPPER_BACKWARD_MIN_LENGTH,
    HOPPER_BITS,
    HOPPER_FORWARD_MIN_LENGTH,
    HOPPER_FORWARD_MIN_QUERIES,
    HOPPER_SMS,
    KERNEL_CHOICES,
    band_width,
    hopper_block_sizes,
    hopper_head_dims,
    table_bits,
)
from .plan import Problem

# The byte alignment TMA needs of every stride but the innermost.
TMA_ALIGN = 16


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper module (triton.experimental.gluon, 3.6 on) and the
    kernel module imports with it."""
    try:
        from ..kernels import hopper, hopper_backward  # noqa: F401
    except Exception:  # ImportError, or an API the kernel module needs that this Triton lacks
        return False
    return True


def device_capability() -> tuple[int, int] | None:
    """(major, minor) of the first device's CUDA compute capability, or None (not a CUDA device)."""
    try:
        text = jax.devices()[0].compute_capability
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return None


def device_sms() -> int:
    """The first device's streaming multiprocessors (jax's `core_count`), HOPPER_SMS where it has none."""
    try:
        return int(jax.devices()[0].core_count) or HOPPER_SMS
    except Exception:
        return HOPPER_SMS


def requested(env: str = FORWARD_KERNEL_ENV) -> str:
    """$JAGGED_FLASH_JAX_FORWARD (or `env`: $JAGGED_FLASH_JAX_BACKWARD), checked: "auto" (also when
    unset or empty), "portable" (always the portable kernel) or "hopper" (the Hopper kernel wherever it
    can run, short sequences included)."""
    value = os.environ.get(env, "").strip().lower() or "auto"
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{env}={value!r}: expected one of {KERNEL_CHOICES}")
    return value


def _device_reason(p: Problem, dtype) -> str | None:
    """What both Hopper kernels need of the problem and the machine beyond their own limits: one
    offsets segment, key tokens, TMA-aligned strides, a Hopper device and Gluon."""
    if p.num_segments != 1:
        return f"{p.num_segments} offsets segments (only one)"
    if p.kv_tokens == 0:
        return "no key tokens (no TMA descriptor over an empty array)"
    itemsize = np.dtype(dtype).itemsize
    strides = (*p.strides(p.num_heads, p.q_tokens), *p.strides(p.num_kv_heads, p.kv_tokens))
    if any(stride * itemsize % TMA_ALIGN for stride in strides):
        return f"strides {strides} not {TMA_ALIGN}-byte aligned (TMA)"
    capability = device_capability()
    if capability is None or capability[0] != 9:
        return f"compute capability {capability} (Hopper's wgmma needs 9.x)"
    if not gluon_available():
        return "no triton.experimental.gluon with Hopper support"
    return None


def _tiles_reason(p: Problem, dtype, *kernels: str) -> str | None:
    """Why the problem has no Hopper tiles of `kernels` ("fwd"; "dkdv" and "dq"), or None. The tiles
    (`with_kernels`, from the table) decide; the table's rules only word the reason."""
    tiles = p.hopper_tiles
    if tiles is not None and None not in (getattr(tiles, kernel) for kernel in kernels):
        return None
    if table_bits(dtype) != HOPPER_BITS:
        return f"{np.dtype(dtype).name} inputs (the Hopper kernels take {HOPPER_BITS}-bit inputs only)"
    return (f"head dimension {p.head_dim} (the tile table has Hopper {'/'.join(kernels)} tiles at head "
            f"dimensions {hopper_head_dims(*kernels)})")


def portable_reason(p: Problem, dtype) -> str | None:
    """Why the problem's forward runs the portable kernel on the triton backend, or None: it runs the
    Hopper one."""
    if requested() == "portable":
        return f"{FORWARD_KERNEL_ENV}=portable"
    if p.backend != "triton":
        return f"backend {p.backend!r}"
    if reason := _tiles_reason(p, dtype, "fwd"):
        return reason
    if requested() == "auto" and max(p.max_seq_len, p.kv_max_seq_len) < HOPPER_FORWARD_MIN_LENGTH:
        return f"sequences of at most {HOPPER_FORWARD_MIN_LENGTH - 1} tokens (the portable forward is faster)"
    if requested() == "auto" and p.max_seq_len < HOPPER_FORWARD_MIN_QUERIES:
        return (f"at most {p.max_seq_len} queries per sequence, fewer than a Hopper query block's "
                f"{HOPPER_FORWARD_MIN_QUERIES} (the portable forward is faster)")
    if requested() == "auto" and p.softcap is not None and p.causal:
        return "a soft cap with causal masking (the portable forward is faster)"
    return _device_reason(p, dtype)


def forward_kernel(p: Problem, dtype) -> str:
    """"hopper" or "portable": see `portable_reason`."""
    return "portable" if portable_reason(p, dtype) else "hopper"


def backward_portable_reason(p: Problem, dtype) -> str | None:
    """Why the problem's backward runs the portable kernel on the triton backend, or None: it runs the
    Hopper one (kernels/hopper_backward.py), whichever forward ran, with every option the portable one
    takes (causal, a window, a soft cap, ALiBi). A causal soft cap takes it too: `portable_reason`'s
    rule against the Hopper kernel there was measured on the forward only."""
    if requested(BACKWARD_KERNEL_ENV) == "portable":
        return f"{BACKWARD_KERNEL_ENV}=portable"
    if p.backend != "triton":
        return f"backend {p.backend!r}"
    if reason := _tiles_reason(p, dtype, "dkdv", "dq"):
        return reason
    if requested(BACKWARD_KERNEL_ENV) == "auto":
        if max(p.max_seq_len, p.kv_max_seq_len) < HOPPER_BACKWARD_MIN_LENGTH:
            shortest = HOPPER_BACKWARD_MIN_LENGTH
            return f"sequences of at most {shortest - 1} tokens (the portable backward is faster)"
        if p.head_dim not in HOPPER_BACKWARD_AUTO_HEAD_DIMS:
            return f"head dimension {p.head_dim} (the portable backward is faster)"
    return _device_reason(p, dtype)


def backward_kernel(p: Problem, dtype) -> str:
    """"hopper" or "portable": see `backward_portable_reason`."""
    return "portable" if backward_portable_reason(p, dtype) else "hopper"


def with_kernels(p: Problem, dtype) -> Problem:
    """`p` with the table's Hopper tiles for it (configs.hopper_block_sizes), its forward and backward
    kernels chosen, and for the Hopper kernels their persistent grid (the device's SMs)."""
    p = p.with_(hopper_tiles=hopper_block_sizes(p.head_dim, dtype, p.max_seq_len, p.kv_max_seq_len,
                                                band_width(p.window, p.causal)))
    p = p.with_(forward_kernel=forward_kernel(p, dtype), backward_kernel=backward_kernel(p, dtype))
    hopper = "hopper" in (p.forward_kernel, p.backward_kernel)
    return p.with_(hopper_programs=device_sms()) if hopper else p
