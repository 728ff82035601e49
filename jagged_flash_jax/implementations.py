"""The implementations of the softmax attention, as values: each says which problems it supports (and why
not), chooses its configuration, and runs the forward and the backward. select.py picks among them.

- "xla": blockwise pure JAX (xla/softmax.py), any device.
- "portable": the portable Triton kernels (kernels/portable/) on a GPU, through jax-triton.
- "interpret": the same kernels in Triton's interpreter on the CPU.
- "hopper": the Hopper kernels in Gluon (kernels/hopper/), sm_90a.
- "hopper-fused-dq": the same, whose backward adds dq from the dk/dv kernel by float32 atomics (TMA
  reduce-adds where Triton's Gluon has them, 3.7 on): not bitwise reproducible, so named, or taken by
  auto with deterministic=False where it is faster (`Hopper.preferred`).

HSTU attention's (HSTU_IMPLEMENTATIONS, below): "portable", "interpret", "xla", and "hstu-hopper", its
Hopper forward and backward (auto's from configs.HSTU_HOPPER_AUTO_MIN_LENGTH tokens; the backward falls
back to the portable one's where the Hopper kernels cannot take the problem).

All four share one residual convention (the log-sum-exp in units of the unscaled scores, launch/calls.py),
so a forward of one and a backward of another compose.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import numpy as np

from . import _compat, configs
from .configs import (
    FUSED_DQ_MIN_LENGTH,
    HOPPER_BACKWARD_AUTO_HEAD_DIMS,
    HOPPER_BACKWARD_MIN_LENGTH,
    HOPPER_BITS,
    HOPPER_FORWARD_MIN_LENGTH,
    HOPPER_FORWARD_MIN_QUERIES,
    INTERPRET_BLOCK_SIZES,
    BlockSizes,
    band_width,
)
from .launch import calls
from .launch import hstu as launch_hstu
from .launch.calls import HopperConfig, PortableConfig
from .problem import Problem
from .xla import hstu as xla_hstu
from .xla import softmax as xla_softmax

# The byte alignment TMA needs of every stride but the innermost.
TMA_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Device:
    """What the choice needs to know of the device the op runs on (select.py reads it from JAX)."""

    platform: str  # JAX's default backend: "gpu", "cpu", "tpu", ...
    kind: str  # jax.devices()[0].device_kind, e.g. "NVIDIA H200"; the tile table's GPU key
    capability: tuple[int, int] | None = None  # CUDA compute capability
    sms: int = configs.HOPPER_SMS  # streaming multiprocessors: the persistent kernels' programs

    @property
    def gpu(self) -> bool:
        return self.platform in ("gpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Context:
    """What an implementation's choices read besides the problem: the device, the tile table (configs'
    BUILTIN_TABLE with the tuned entries merged), and the caller's portable tiles, if any."""

    device: Device
    table: dict = dataclasses.field(hash=False, compare=False)
    table_path: str | None = None  # what `table` was loaded from (its identity in hashes)
    block_sizes: BlockSizes | None = None


class Implementation:
    """The interface: `supports` and `preferred` answer with a reason (None: yes). Implementations are
    frozen dataclasses, hashable values in a plan; a caller may pass one of its own (a variant with other
    settings) where a name is taken."""

    name: str
    # Whether it runs Hopper kernels: $JAGGED_FLASH_JAX_FORWARD / _BACKWARD "portable" leaves it out of
    # backend="auto"'s candidates, "hopper" runs it wherever it can (select.request).
    hopper = False

    def config(self, p: Problem, context: Context, backward: bool):
        """The configuration the pass runs with (hashable), or None where it has none for `p`."""
        return None

    def supports(self, p: Problem, context: Context, config, backward: bool) -> str | None:
        """Why this implementation cannot run the forward (backward) of `p` here, or None."""
        return None

    def preferred(self, p: Problem, context: Context, backward: bool) -> str | None:
        """Why, among implementations that support `p`, auto would rather run another, or None."""
        return None

    def forward(self, p: Problem, config, q, k, v, q_offsets, kv_offsets, slopes):
        raise NotImplementedError

    def backward(self, p: Problem, config, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Xla(Implementation):
    name: str = "xla"

    def forward(self, p, config, q, k, v, q_offsets, kv_offsets, slopes):
        return xla_softmax.forward(p, q, k, v, q_offsets, kv_offsets, slopes)

    def backward(self, p, config, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
        return xla_softmax.backward(p, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes=slopes, dlse=dlse)


def _runner(launcher: str):
    """The `run(call, arrays)` of a launcher, imported on first use; its dependencies are checked there,
    so that a missing one is named with the extra that installs it."""
    if launcher == "gpu":
        from .launch import gpu

        gpu.jax_triton_module()
        return gpu.run
    from .launch import interpret

    interpret.triton_internals()
    return interpret.run


def gpu_reason(device: Device) -> str | None:
    """Why the Triton kernels cannot run on `device` through jax-triton, or None."""
    from .launch import gpu

    if not device.gpu:
        return f"it needs a GPU, and JAX's default backend is {device.platform!r}"
    return gpu.unavailable_reason()


def _kernels_reason(p: Problem) -> str | None:
    """What every kernel family needs of the problem: a head dimension within the tiles, sequences within
    int32 addressing."""
    if p.head_dim > configs.MAX_HEAD_DIM:
        return (f"head dimension D={p.head_dim} (the kernels take D <= {configs.MAX_HEAD_DIM}; the 'xla' "
                f"implementation takes any)")
    return calls.addressing_error(p)


@dataclasses.dataclass(frozen=True)
class Portable(Implementation):
    """The portable kernels, on the GPU ("portable") or in Triton's interpreter ("interpret").
    `key_major` forces the key-major operands on (True) or off (False) instead of taking them where TF32
    products need them; `l2_reuse_bytes` is the size of q, k, v above which each sequence's programs run
    next to each other (launch/calls.py); `tma_loads` forces the forward's TMA loads of its unmasked key
    blocks on (True, wherever the problem allows: calls.tma_loads_error) or off (False) instead of taking
    them on Hopper GPUs under triton >= configs.PORTABLE_TMA_LOADS_FROM at the head dimensions where they
    measured faster (configs.PORTABLE_TMA_LOADS_HEAD_DIMS)."""

    name: str = "portable"
    launcher: str = "gpu"
    key_major: bool | None = None
    l2_reuse_bytes: int = calls.L2_REUSE_BYTES
    tma_loads: bool | None = None

    def config(self, p, context, backward):
        tiles = context.block_sizes
        if tiles is None and p.head_dim > configs.MAX_HEAD_DIM:
            return None
        if tiles is None and self.launcher == "interpret":
            tiles = INTERPRET_BLOCK_SIZES
        elif tiles is None:
            tiles = configs.default_block_sizes(p.head_dim, p.dtype, p.max_seq_len, p.kv_max_seq_len,
                                                band_width(p.window, p.causal), causal=p.causal,
                                                table=context.table, gpu=context.device.kind)
        v_key_major, qdo_key_major = (self.key_major if self.key_major is not None
                                      else calls.key_major(p, operands) for operands in ("v", "q_do"))
        config = PortableConfig(tiles, v_key_major, qdo_key_major, self.l2_reuse_bytes)
        wanted = self.tma_loads if self.tma_loads is not None else (
            self.launcher == "gpu" and _wgmma_reason(context.device) is None
            and _compat.triton_release() >= configs.PORTABLE_TMA_LOADS_FROM
            and p.head_dim in configs.PORTABLE_TMA_LOADS_HEAD_DIMS)
        return dataclasses.replace(config,
                                   tma_loads=bool(wanted) and calls.tma_loads_error(p, config) is None)

    def supports(self, p, context, config, backward):
        if self.launcher == "gpu" and (reason := gpu_reason(context.device)):
            return reason
        return _kernels_reason(p) or calls.grid_error(p, config.tiles)

    def forward(self, p, config, q, k, v, q_offsets, kv_offsets, slopes):
        return calls.forward(_runner(self.launcher), p, config, q, k, v, q_offsets, kv_offsets, slopes)

    def backward(self, p, config, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
        return calls.backward(_runner(self.launcher), p, config, q, k, v, q_offsets, kv_offsets, o, lse, do,
                              slopes=slopes, dlse=dlse)


def _hopper_modules_import(*modules: str) -> bool:
    """Whether these kernel modules of kernels/hopper/ import with this Triton (Gluon's Hopper module,
    triton.experimental.gluon, is 3.6 on)."""
    try:
        for module in modules:
            importlib.import_module(f".kernels.hopper.{module}", __package__)
    except Exception:  # ImportError, or an API the kernel module needs that this Triton lacks
        return False
    return True


@functools.cache
def gluon_available() -> bool:
    """Whether the softmax Hopper kernels' modules import with this Triton."""
    return _hopper_modules_import("dkdv", "dq", "forward")


def _segments_reason(p) -> str | None:
    """Why a Hopper kernel cannot take p's offsets segments (it takes one), or None."""
    if p.num_segments != 1:
        return (f"{p.num_segments} offsets segments (it takes one: vmap and data-parallel packing make "
                f"more)")
    return None


def _tma_reason(strides: tuple[int, ...], dtype) -> str | None:
    """Why TMA descriptors cannot cover arrays of these strides (in elements of `dtype`), or None."""
    itemsize = np.dtype(dtype).itemsize
    if any(stride * itemsize % TMA_ALIGN for stride in strides):
        return f"strides {strides} not {TMA_ALIGN}-byte aligned (TMA)"
    return None


def _wgmma_reason(device: Device) -> str | None:
    """Why the Hopper kernels' wgmma cannot run on `device`, or None."""
    capability = device.capability
    if capability is None or capability[0] != 9:
        return f"compute capability {capability} (Hopper's wgmma needs 9.x)"
    return None


@dataclasses.dataclass(frozen=True)
class Hopper(Implementation):
    """The Hopper kernels: 16-bit inputs, one offsets segment, the head dimensions of the tile table's
    "hopper" entries (each pass its own)."""

    name: str = "hopper"
    hopper = True
    # The backward adds dq from the dk/dv kernel by float32 atomics (one launch and five products per
    # tile instead of seven; TMA reduce-adds from shared memory where Triton's Gluon has them, else
    # atomics from registers: launch/calls.hopper_backward) instead of its own dq kernel: not bitwise
    # reproducible, so only a caller who names it, or asks for deterministic=False, gets it; auto then
    # where it measured faster (configs.FUSED_DQ_MIN_LENGTH).
    fused_dq: bool = False
    # True: the kernels hand out the sequences with the most work first (launch/calls.sequence_order), so
    # that short ones fill the launch's tail, each item's sequence read from that order; False (the
    # default): in the offsets' order. The numbers are the same. Measured on an H100 (docs/performance.md,
    # 2026-12-07, session 7): 3-7% off `long`'s kernels, 1-5% onto rec-long's and L8192's.
    longest_first: bool = False

    def _kernels(self, backward: bool) -> tuple[str, ...]:
        return ("dkdv", "dq") if backward else ("fwd",)

    def config(self, p, context, backward):
        if p.head_dim > configs.MAX_HEAD_DIM:
            return None
        tiles = configs.hopper_block_sizes(p.head_dim, p.dtype, p.max_seq_len, p.kv_max_seq_len,
                                           band_width(p.window, p.causal), causal=p.causal,
                                           table=context.table, gpu=context.device.kind)
        if tiles is None or None in (getattr(tiles, kernel) for kernel in self._kernels(backward)):
            return None
        # The backward's preprocess is the portable kernel: its row block is the portable table's.
        portable = PORTABLE.config(p, dataclasses.replace(context, block_sizes=None), backward)
        return HopperConfig(tiles, context.device.sms, portable.tiles.preprocess_block_m,
                            fused_dq=backward and self.fused_dq, longest_first=self.longest_first)

    def supports(self, p, context, config, backward):
        if config is None:
            if reason := _kernels_reason(p):
                return reason
            if configs.table_bits(p.dtype) != HOPPER_BITS:
                return f"{p.dtype} inputs (the Hopper kernels take {HOPPER_BITS}-bit inputs only)"
            kernels = self._kernels(backward)
            dims = configs.hopper_head_dims(context.table, context.device.kind, *kernels)
            return (f"head dimension {p.head_dim} (the tile table has Hopper {'/'.join(kernels)} tiles at "
                    f"head dimensions {dims})")
        if reason := gpu_reason(context.device) or _kernels_reason(p):
            return reason
        if reason := _segments_reason(p):
            return reason
        if config.fused_dq and config.tiles.dkdv.block_n != 128:
            return (f"head dimension {p.head_dim}: its dk/dv tiles are blocks of {config.tiles.dkdv.block_n} "
                    f"keys, whose columns the two warpgroups split (dq is fused into blocks of 128 keys)")
        if (config.fused_dq and _compat.gluon_tma_reduce()
                and (rows := calls.padded_dq_rows(p, config.tiles.dkdv.block_m)) > _INT32_LIMIT):
            return (f"{rows} rows of the dq-fused kernel's padded dq ({p.q_tokens} queries and a query tile "
                    f"per sequence; at most {_INT32_LIMIT}: int32 coordinates)")
        if p.kv_tokens == 0:
            return "no key tokens (no TMA descriptor over an empty array)"
        strides = (*p.strides(p.num_heads, p.q_tokens), *p.strides(p.num_kv_heads, p.kv_tokens))
        if reason := _tma_reason(strides, p.dtype) or _wgmma_reason(context.device):
            return reason
        if not gluon_available():
            return "no triton.experimental.gluon with Hopper support"
        return None

    def preferred(self, p, context, backward):
        longest = max(p.max_seq_len, p.kv_max_seq_len)
        if backward and self.fused_dq:
            if not _compat.gluon_tma_reduce():
                return ("no TMA reduce-add in this Triton's Gluon (triton < 3.7: dq added by atomics from "
                        "registers, slower than the deterministic backward)")
            if p.head_dim not in FUSED_DQ_MIN_LENGTH:
                return (f"head dimension {p.head_dim} (the dq-fused backward is measured faster at "
                        f"{tuple(FUSED_DQ_MIN_LENGTH)} only)")
            if longest < (shortest := FUSED_DQ_MIN_LENGTH[p.head_dim]):
                return (f"sequences of at most {shortest - 1} tokens at head dimension {p.head_dim} (the "
                        f"deterministic backward is as fast or faster)")
            return None
        if backward:
            if longest < HOPPER_BACKWARD_MIN_LENGTH:
                return (f"sequences of at most {HOPPER_BACKWARD_MIN_LENGTH - 1} tokens (the portable "
                        f"backward is faster)")
            if p.head_dim not in HOPPER_BACKWARD_AUTO_HEAD_DIMS:
                return f"head dimension {p.head_dim} (the portable backward is faster)"
            return None
        if longest < HOPPER_FORWARD_MIN_LENGTH:
            return (f"sequences of at most {HOPPER_FORWARD_MIN_LENGTH - 1} tokens (the portable forward is "
                    f"faster)")
        if p.max_seq_len < HOPPER_FORWARD_MIN_QUERIES:
            return (f"at most {p.max_seq_len} queries per sequence, fewer than a Hopper query block's "
                    f"{HOPPER_FORWARD_MIN_QUERIES} (the portable forward is faster)")
        if p.softcap is not None and p.causal:
            return "a soft cap with causal masking (the portable forward is faster)"
        return None

    def forward(self, p, config, q, k, v, q_offsets, kv_offsets, slopes):
        return calls.hopper_forward(_runner("gpu"), p, config, q, k, v, q_offsets, kv_offsets, slopes)

    def backward(self, p, config, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
        return calls.hopper_backward(_runner("gpu"), p, config, q, k, v, q_offsets, kv_offsets, o, lse, do,
                                     slopes=slopes, dlse=dlse)


XLA = Xla()
PORTABLE = Portable()
INTERPRET = Portable("interpret", "interpret")
HOPPER = Hopper()
HOPPER_FUSED_DQ = Hopper("hopper-fused-dq", fused_dq=True)
IMPLEMENTATIONS = {impl.name: impl for impl in (HOPPER, HOPPER_FUSED_DQ, PORTABLE, INTERPRET, XLA)}


# ---------------------------------------------------------------------------------------------------
# HSTU attention's (problem.HstuProblem): forward(p, config, q, k, v, offsets, num_targets, scale) ->
# (o,), backward(..., do) -> (dq, dk, dv, dscale)
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HstuXla(Implementation):
    name: str = "xla"

    def forward(self, p, config, q, k, v, offsets, num_targets, scale):
        return (xla_hstu.forward(p, q, k, v, offsets, num_targets, scale),)

    def backward(self, p, config, q, k, v, offsets, num_targets, scale, do):
        return xla_hstu.backward(p, q, k, v, offsets, num_targets, scale, do)


@dataclasses.dataclass(frozen=True)
class HstuPortable(Implementation):
    """HSTU's portable kernels (kernels/portable/hstu.py), on the GPU ("portable") or in Triton's
    interpreter ("interpret"); its config is the tiles (`block_sizes`, else launch/hstu.py's defaults)."""

    name: str = "portable"
    launcher: str = "gpu"

    def config(self, p, context, backward):
        return context.block_sizes or launch_hstu.tiles(p, self.launcher == "interpret")

    def supports(self, p, context, config, backward):
        if self.launcher == "gpu" and (reason := gpu_reason(context.device)):
            return reason
        if max(p.head_dim, p.value_dim) > configs.MAX_HEAD_DIM:
            return (f"head dimensions D={p.head_dim}, V={p.value_dim} (the kernels take both <= "
                    f"{configs.MAX_HEAD_DIM}; the 'xla' implementation takes any)")
        return launch_hstu.addressing_error(p) or launch_hstu.grid_error(p, config)

    def forward(self, p, config, q, k, v, offsets, num_targets, scale):
        return (launch_hstu.forward(_runner(self.launcher), p, config, q, k, v, offsets, num_targets, scale),)

    def backward(self, p, config, q, k, v, offsets, num_targets, scale, do):
        return launch_hstu.backward(_runner(self.launcher), p, config, q, k, v, offsets, num_targets, scale,
                                    do)


HSTU_XLA = HstuXla()
HSTU_PORTABLE = HstuPortable()
HSTU_INTERPRET = HstuPortable("interpret", "interpret")

# The most rows a TMA coordinate (int32) and the persistent kernels' item counter (int32) reach.
_INT32_LIMIT = 2**31 - 1


@functools.cache
def hstu_gluon_available() -> bool:
    """Whether HSTU's Hopper forward imports with this Triton."""
    return _hopper_modules_import("hstu_forward")


@functools.cache
def hstu_backward_gluon_available() -> bool:
    """Whether HSTU's Hopper backward imports with this Triton."""
    return _hopper_modules_import("hstu_backward")


@dataclasses.dataclass(frozen=True)
class HstuHopper(Implementation):
    """HSTU's Hopper kernels (kernels/hopper/hstu_forward.py, hstu_backward.py): 16-bit inputs, D and V
    among configs.HSTU_HOPPER_HEAD_DIMS, one offsets segment, sm_90a; their fixed tiles
    (configs.HSTU_HOPPER_FWD_TILE, HSTU_HOPPER_BWD_DKDV_TILE and HSTU_HOPPER_BWD_DQ_TILE, not the caller's
    block_sizes). The backward runs the Hopper dk/dv and dq kernels where they take the problem (its
    config a launch_hstu.HopperHstuBackwardConfig), else the portable HSTU backward (HSTU_PORTABLE's
    config, supports and run), which needs nothing the forward saves either. backend="auto" takes it
    where it supports the problem, from configs.HSTU_HOPPER_AUTO_MIN_LENGTH tokens."""

    name: str = "hstu-hopper"
    hopper = True
    # As Hopper's: True, the kernels hand out the sequences longest first (launch/hstu.sequence_order);
    # False (the default), in the offsets' order. The numbers are the same.
    longest_first: bool = False

    def preferred(self, p, context, backward):
        if p.max_seq_len < configs.HSTU_HOPPER_AUTO_MIN_LENGTH:
            return (f"sequences of at most {configs.HSTU_HOPPER_AUTO_MIN_LENGTH - 1} tokens (not measured "
                    f"faster than the portable kernels there)")
        return None

    def config(self, p, context, backward):
        if not backward:
            return launch_hstu.HopperHstuConfig(configs.HSTU_HOPPER_FWD_TILE, context.device.sms,
                                                longest_first=self.longest_first)
        hopper = launch_hstu.HopperHstuBackwardConfig(configs.HSTU_HOPPER_BWD_DKDV_TILE,
                                                      configs.HSTU_HOPPER_BWD_DQ_TILE, context.device.sms,
                                                      longest_first=self.longest_first)
        if self._hopper_reason(p, context, hopper) is None:
            return hopper
        return HSTU_PORTABLE.config(p, context, backward)  # where the Hopper backward cannot run

    def supports(self, p, context, config, backward):
        if backward and not isinstance(config, launch_hstu.HopperHstuBackwardConfig):
            return HSTU_PORTABLE.supports(p, context, config, backward)
        return self._hopper_reason(p, context, config)

    def _hopper_reason(self, p, context, config) -> str | None:
        """Why the Hopper forward (config a HopperHstuConfig) or backward (a HopperHstuBackwardConfig)
        cannot run p here, or None."""
        backward = isinstance(config, launch_hstu.HopperHstuBackwardConfig)
        what = f"the Hopper HSTU {'backward' if backward else 'forward'}"
        if reason := gpu_reason(context.device) or _wgmma_reason(context.device):
            return reason
        if configs.table_bits(p.dtype) != HOPPER_BITS:
            return f"{p.dtype} inputs ({what} takes {HOPPER_BITS}-bit inputs only)"
        dims = configs.HSTU_HOPPER_HEAD_DIMS
        if p.head_dim not in dims or p.value_dim not in dims:
            return f"head dimensions D={p.head_dim}, V={p.value_dim} ({what} takes each in {dims})"
        if reason := _segments_reason(p):
            return reason
        if reason := _tma_reason((*p.strides(p.head_dim), *p.strides(p.value_dim)), p.dtype):
            return reason
        view_rows = p.tokens * (1 if p.layout == "THD" else p.num_heads)
        # Each kernel's blocks per (sequence, head): the query blocks, and the backward's key blocks.
        block_rows = (config.dkdv.block_n, config.dq.block_m) if backward else (config.tile.block_m,)
        blocks = max(calls.blocks(rows, p.tokens, p.max_seq_len) for rows in block_rows)
        items = p.batch * p.num_heads * blocks
        if max(view_rows, items) > _INT32_LIMIT:
            return (f"{view_rows} rows of the TMA views and {items} blocks (each at most "
                    f"{_INT32_LIMIT}: int32 coordinates and counter)")
        if reason := launch_hstu.addressing_error(p):
            return reason
        if not (hstu_backward_gluon_available() if backward else hstu_gluon_available()):
            return "no triton.experimental.gluon with Hopper support"
        return None

    def forward(self, p, config, q, k, v, offsets, num_targets, scale):
        return (launch_hstu.hopper_forward(_runner("gpu"), p, config, q, k, v, offsets, num_targets, scale),)

    def backward(self, p, config, q, k, v, offsets, num_targets, scale, do):
        if isinstance(config, launch_hstu.HopperHstuBackwardConfig):
            run = _runner("gpu")
            return launch_hstu.hopper_backward(run, p, config, q, k, v, offsets, num_targets, scale, do)
        return HSTU_PORTABLE.backward(p, config, q, k, v, offsets, num_targets, scale, do)


HSTU_HOPPER = HstuHopper()
HSTU_IMPLEMENTATIONS = {impl.name: impl for impl in (HSTU_PORTABLE, HSTU_INTERPRET, HSTU_XLA, HSTU_HOPPER)}
