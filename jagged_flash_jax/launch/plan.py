"""Which kernels the forward and backward run, on which grid, with which arguments: shared by launchers.

A launcher is a function `run(call, arrays) -> outputs` that executes one `KernelCall`; gpu.py does it
with jax-triton, interpret.py with Triton's interpreter. A kernel's parameters are the call's arrays
(the last one the int32 array of its runtime sizes, `params`, built by the slots' names in
kernels.common), its outputs, then `constants` by keyword. The Hopper forward (kernels/hopper.py, on
the triton backend only, where launch/hopper.py chose it for the Problem) takes q, k, v as TMA
descriptors (KernelCall.descriptors), and so do the Hopper backward's dk/dv and dq kernels
(kernels/hopper_backward.py, chosen on their own) with q, do, k, v.

Arrays at this level: q, o, do, dq are [Z*T_q, H, D] ("THD") or [H, Z*T_q, D] ("HTD"), k, v, dk, dv
the same with H_kv and T_kv: Z segments of T tokens each along the token axis, every segment with its
own row of offsets (or all with one shared row). The log-sum-exp is float32 [Z, H, T_q].
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import kernels
from .._util import cdiv, lse_gradient
from ..configs import (
    HOPPER_BWD_TRITON_STAGES,
    HOPPER_CONSUMER_REGS,
    HOPPER_FWD_TRITON_STAGES,
    HOPPER_PRODUCER_REGS,
    HOPPER_SMS,
    BlockSizes,
    KernelConfig,
    head_block,
)
from ..kernels import spec

# CUDA's limit on the first grid dimension, which enumerates every program of a launch.
MAX_GRID_X = 2**31 - 1
# Above this many bytes of q, k and v (about half of a Hopper L2), each sequence's programs run next to
# each other (a one-axis grid, see kernels.common._program), so that they share its keys, values and
# queries in L2. Below it every operand stays in L2 anyway, and the two-axis grid, slot-major, balances
# the load better and spares each program two integer divisions. docs/performance.md ("Program order")
# has the measurements.
L2_REUSE_BYTES = 32 << 20
# CUDA's limit on the second grid dimension (slots, in the two-axis grid).
MAX_GRID_Y = 65535
# Tokens the zero-fill programs clear at a time.
FILL_BLOCK = 32
# Alignment, in tokens, of the rows of key-major operands (the forward's V_KEY_MAJOR, the backward's
# QDO_KEY_MAJOR), and the tokens each program of kernels.key_major_kernel transposes.
KEY_MAJOR_ALIGN = 16
KEY_MAJOR_BLOCK = 64
# The padded head dimensions at which float32 inputs (TF32 products) take key-major operands: those where
# the kernel gains more than the transposes cost, and whose tiles load asynchronously (measured:
# docs/performance.md, "Float32: key-major operands").
KEY_MAJOR_HEAD_DIMS = {"v": (64, 128, 256), "q_do": (128,)}
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static description of one kernel-level call (hashable: a static argument of custom_vjp,
    custom_vmap and custom_partitioning)."""

    layout: str  # "THD" or "HTD"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    batch: int
    num_segments: int
    q_tokens: int  # per segment
    kv_tokens: int
    q_offsets_rows: int  # 1 (shared by every segment) or num_segments
    kv_offsets_rows: int
    max_seq_len: int
    kv_max_seq_len: int
    causal: bool
    scale: float
    out_scale: float
    input_precision: str
    block_sizes: BlockSizes
    backend: str  # "triton", "interpret" or "xla"
    # (left, right): query i (at key position i + n_k - n_q) sees keys from i + n_k - n_q - left to
    # i + n_k - n_q + right; None is no bound (right is None under causal, which bounds it at 0).
    window: tuple[int | None, int | None] = (None, None)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap), on the scaled scores
    alibi: bool = False  # the slopes [Z, H] come as an operand (transforms.ForwardArgs.slopes)
    # The Hopper kernels' tiles (configs.hopper_block_sizes), None where the table has none; set with
    # the kernels below by launch/hopper.py when the problem is built.
    hopper_tiles: BlockSizes | None = None
    # "hopper" (kernels/hopper.py) or "portable": chosen by launch/hopper.py when the problem is built.
    # The Hopper kernel takes one offsets segment: a problem that vmap or partitioning gives several
    # runs the portable one (see `hopper_forward`).
    forward_kernel: str = "portable"
    # The same for the backward (kernels/hopper_backward.py), chosen on its own (launch/hopper.py).
    backward_kernel: str = "portable"
    # The Hopper kernels' persistent grid: one program per SM of the device (launch/hopper.py).
    hopper_programs: int = HOPPER_SMS

    # -- shapes ------------------------------------------------------------------------------------
    def shape(self, heads: int, tokens: int) -> tuple[int, int, int]:
        total = self.num_segments * tokens
        return (total, heads, self.head_dim) if self.layout == "THD" else (heads, total, self.head_dim)

    @property
    def q_shape(self) -> tuple[int, int, int]:
        return self.shape(self.num_heads, self.q_tokens)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.shape(self.num_kv_heads, self.kv_tokens)

    @property
    def stats_shape(self) -> tuple[int, int, int]:
        return (self.num_segments, self.num_heads, self.q_tokens)

    def strides(self, heads: int, tokens: int) -> tuple[int, int]:
        """(token stride, head stride) in elements."""
        d = self.head_dim
        if self.layout == "THD":
            return heads * d, d
        return d, self.num_segments * tokens * d

    # -- grid ----------------------------------------------------------------------------------------
    def blocks(self, rows: int, tokens: int, max_len: int) -> int:
        """Blocks of `rows` covering the longest attended sequence (at most min(max_len, tokens))."""
        return cdiv(min(max_len, tokens), rows)

    @property
    def sequence_heads(self) -> int:
        """(segment, sequence or zero fill, head) triples: the programs of one slot."""
        return self.num_segments * (self.batch + 1) * self.num_heads

    @property
    def forward_slots(self) -> int:
        """The forward's programs per sequence and head: its row blocks, then the tail-zeroing one."""
        return self.blocks(self.block_sizes.fwd.block_m, self.q_tokens, self.max_seq_len) + 1

    @property
    def backward_launches(self) -> tuple[BackwardLaunch, ...]:
        """The backward's launches: dq and dk/dv programs together (in even and odd slots), or apart when
        their tiles' warps or stages differ. Each kind has, per sequence and head, its row blocks and a
        tail-zeroing program."""
        bs = self.block_sizes
        dq = self.blocks(bs.dq.block_m, self.q_tokens, self.max_seq_len) + 1
        dkdv = self.blocks(bs.dkdv.block_n, self.kv_tokens, self.kv_max_seq_len) + 1
        if bs.one_backward_launch:
            pairs = max(dq, dkdv)
            return (BackwardLaunch(("dq", "dk", "dv"), 2 * pairs, pairs, bs.dkdv),)
        return BackwardLaunch(("dq",), dq, dq, bs.dq), BackwardLaunch(("dk", "dv"), dkdv, dkdv, bs.dkdv)

    @property
    def hopper_forward(self) -> bool:
        """Whether the forward runs the Hopper kernel."""
        return self.forward_kernel == "hopper" and self.num_segments == 1

    @property
    def hopper_backward(self) -> bool:
        """Whether the backward runs the Hopper kernels."""
        return self.backward_kernel == "hopper" and self.num_segments == 1

    @property
    def empty(self) -> bool:
        return self.num_segments * self.num_heads * self.q_tokens * self.head_dim == 0

    def with_(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class BackwardLaunch:
    """One launch of kernels.attention_bwd_kernel: the gradients its programs compute, its slots per
    (segment, sequence or fill, head), how many of those belong to each kind of program (the zero-fill
    "sequence" splits the uncovered tokens into that many chunks), and its tile's warps and stages."""

    grads: tuple[str, ...]
    slots: int
    programs_per_kind: int
    config: KernelConfig


@dataclasses.dataclass(frozen=True)
class KernelCall:
    kernel: Any  # a @triton.jit kernel of the kernels package
    grid: tuple[int, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    # Runtime sizes, passed as an int32 array rather than as scalar arguments: jax-triton turns a
    # scalar equal to 1 into a compile-time constant, so each pattern of ones would compile a kernel.
    params: tuple[int, ...]
    constants: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int | None = None  # per thread (Triton's maxnreg), or None
    # (array index, block shape): arrays the GPU launcher passes as TMA descriptors of that block over
    # the array (2-D), instead of as pointers (the Hopper forward's).
    descriptors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Outputs the launcher zeroes before the kernel runs (jax-triton's zeroed_outputs).
    zeroed_outputs: tuple[int, ...] = ()


Runner = Callable[[KernelCall, Sequence[jax.Array]], Sequence[jax.Array]]


def _params(call: KernelCall) -> jax.Array:
    # Stacked from scalars, which a trace inlines: an array constant would be captured as a constant of
    # the jaxpr, which custom_partitioning refuses.
    return jnp.stack([jnp.int32(value) for value in call.params])


def _in_units(*strides: int) -> tuple[int, tuple[int, ...]]:
    """The largest power of two up to 16 dividing every stride, and the strides in its units: the form
    in which kernels get strides (see kernels.common._aligned)."""
    align = math.gcd(16, *strides)
    return align, tuple(s // align for s in strides)


def _common(p: Problem):
    """The runtime parameters (kernels/spec.py's ATTENTION_PARAMS) and constants every attention kernel
    shares."""
    align, (q_token, q_head, kv_token, kv_head) = _in_units(*p.strides(p.num_heads, p.q_tokens),
                                                            *p.strides(p.num_kv_heads, p.kv_tokens))
    params = {
        "batch": p.batch, "q_tokens": p.q_tokens, "kv_tokens": p.kv_tokens,
        "q_token_stride": q_token, "q_head_stride": q_head, "kv_token_stride": kv_token,
        "kv_head_stride": kv_head,
        "q_offsets_stride": 0 if p.q_offsets_rows == 1 else p.batch + 1,
        "kv_offsets_stride": 0 if p.kv_offsets_rows == 1 else p.batch + 1}
    constants = dict(
        NUM_HEADS=p.num_heads, KV_GROUP=p.num_heads // p.num_kv_heads, D=p.head_dim,
        BLOCK_D=head_block(p.head_dim), Q_MAX_LEN=p.max_seq_len, KV_MAX_LEN=p.kv_max_seq_len,
        CAUSAL=p.causal, WINDOW_LEFT=-1 if p.window[0] is None else p.window[0],
        WINDOW_RIGHT=-1 if p.window[1] is None else p.window[1],
        # In units of the unscaled scores, as the kernels keep them (see kernels.common._scores).
        SOFTCAP=0.0 if p.softcap is None else p.softcap / p.scale, ALIBI=p.alibi,
        QK_SCALE=p.scale * LOG2E, INPUT_PRECISION=p.input_precision,
        STRIDE_ALIGN=align, FILL_BLOCK=FILL_BLOCK)
    return params, constants


def _grid(p: Problem, itemsize: int, slots: int) -> tuple[int, ...]:
    """The grid of an attention kernel with `slots` programs per (segment, sequence or fill, head)."""
    elements = (p.num_heads * p.q_tokens + 2 * p.num_kv_heads * p.kv_tokens) * p.num_segments * p.head_dim
    if elements * itemsize > L2_REUSE_BYTES or slots > MAX_GRID_Y:
        return (p.sequence_heads * slots,)
    return (p.sequence_heads, slots)


def _fill_chunk(tokens: int, programs: int) -> int:
    return max(1, cdiv(tokens, programs))


def _hopper_fill_chunk(tokens: int, blocks: int) -> int:
    """A persistent Hopper kernel's zero-fill chunk: its fills cover the tokens no sequence covers in
    blocks + 1 chunks per head (kernels/hopper.py, `_zero_fills`)."""
    return _fill_chunk(tokens, blocks + 1)


def key_major(p: Problem, dtype, operands: str) -> bool:
    """Whether the kernels take `operands` ("v": the forward's v; "q_do": the dk/dv programs' q and
    do), which TF32 products read along D, as [H, D, tokens]: TF32 products (float32 inputs) need both
    operands K-major in shared memory (see kernels.attention_fwd_kernel). Only at the padded head
    dimensions of KEY_MAJOR_HEAD_DIMS."""
    return (p.input_precision == "tf32" and jnp.dtype(dtype).itemsize == 4
            and head_block(p.head_dim) in KEY_MAJOR_HEAD_DIMS[operands])


def _tokens_contiguous(run: Runner, p: Problem, x, heads: int, tokens: int) -> jax.Array:
    """x ([*, heads, D] with `tokens` tokens per segment, in p's layout) as [heads, D, all tokens], the
    token axis padded with 0 to a multiple of KEY_MAJOR_ALIGN."""
    align, (token_stride, head_stride) = _in_units(*p.strides(heads, tokens))
    tokens *= p.num_segments
    padded = cdiv(tokens, KEY_MAJOR_ALIGN) * KEY_MAJOR_ALIGN
    call = KernelCall(
        kernels.key_major_kernel, grid=(cdiv(padded, KEY_MAJOR_BLOCK), heads),
        out_shapes=(jax.ShapeDtypeStruct((heads, p.head_dim, padded), x.dtype),),
        params=spec.KEY_MAJOR.pack(dict(tokens=tokens, token_stride=token_stride, head_stride=head_stride,
                                        padded=padded // KEY_MAJOR_ALIGN)),
        constants=dict(D=p.head_dim, BLOCK_D=head_block(p.head_dim), BLOCK_T=KEY_MAJOR_BLOCK,
                       STRIDE_ALIGN=align, KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN))
    (out,) = run(call, (x, _params(call)))
    return out


def _slopes(p: Problem, slopes) -> jax.Array:
    """The kernels' ALiBi operand: the slopes [Z, H] in units of the unscaled scores (divided by the
    scale), float32; without ALiBi a one-element placeholder they never read."""
    if not p.alibi:
        return jnp.zeros((1,), jnp.float32)
    return jnp.broadcast_to(slopes.astype(jnp.float32) / p.scale, (p.num_segments, p.num_heads))


def forward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets, slopes=None):
    """o (zero where no query is attended) and the float32 base-2 log-sum-exp [Z, H, T_q]."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.full(p.stats_shape, jnp.inf, jnp.float32)
    if p.hopper_forward:
        return _hopper_forward(run, p, q, k, v, q_offsets, kv_offsets, slopes)
    cfg = p.block_sizes.fwd
    params, constants = _common(p)
    slots = p.forward_slots
    v_key_major = key_major(p, v.dtype, "v")
    if v_key_major:
        v = _tokens_contiguous(run, p, v, p.num_kv_heads, p.kv_tokens)
    call = KernelCall(
        kernels.attention_fwd_kernel,
        grid=_grid(p, q.dtype.itemsize, slots),
        out_shapes=(jax.ShapeDtypeStruct(p.q_shape, q.dtype),
                    jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
        params=spec.ATTENTION_FWD.pack(dict(
            params, fill_chunk=_fill_chunk(p.q_tokens, slots), slots=slots,
            v_d_stride=v.shape[-1] // KEY_MAJOR_ALIGN if v_key_major else 0)),
        constants=dict(constants, OUT_SCALE=p.out_scale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       V_KEY_MAJOR=v_key_major, KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, max_registers=cfg.max_registers)
    o, lse = run(call, (q, k, v, q_offsets, kv_offsets, _slopes(p, slopes), _params(call)))
    return o, lse


def _tma_views(p: Problem, q_like, kv_like) -> tuple:
    """The 2-D views the Hopper kernels' TMA descriptors cover, rows one token stride long (a token in
    "THD", a (head, token) in "HTD"): the arrays shaped as q, then those shaped as k."""
    q_token_stride = p.strides(p.num_heads, p.q_tokens)[0]
    kv_token_stride = p.strides(p.num_kv_heads, p.kv_tokens)[0]
    return (*(x.reshape(-1, q_token_stride) for x in q_like),
            *(x.reshape(-1, kv_token_stride) for x in kv_like))


def _persistent(p: Problem, *outputs: jax.ShapeDtypeStruct) -> dict:
    """A Hopper kernel's persistent launch (KernelCall's grid, out_shapes, zeroed_outputs): p.hopper_programs
    programs, the kernel's `outputs` and last the int32 counter its programs take their blocks from, the
    one output the launcher zeroes (the run returns it too)."""
    return dict(grid=(p.hopper_programs,), out_shapes=(*outputs, jax.ShapeDtypeStruct((1,), jnp.int32)),
                zeroed_outputs=(len(outputs),))


def _hopper_forward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets, slopes=None):
    """The Hopper forward (kernels/hopper.py): q, k, v as TMA descriptors over 2-D views whose rows are
    one token stride long; a persistent grid of p.hopper_programs programs, which take the query blocks
    (the portable forward's, Problem.blocks per (sequence, head)) from a counter the launch zeroes."""
    tiles = p.hopper_tiles.fwd
    params, constants = _common(p)
    blocks = p.blocks(tiles.block_m, p.q_tokens, p.max_seq_len)
    views = _tma_views(p, (q,), (k, v))
    call = KernelCall(
        kernels.hopper_attention_fwd_kernel,
        **_persistent(p, jax.ShapeDtypeStruct(p.q_shape, q.dtype),
                      jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
        params=spec.HOPPER_FWD.pack(dict(params, blocks=blocks,
                                         fill_chunk=_hopper_fill_chunk(p.q_tokens, blocks))),
        constants={**{name: constants[name] for name in (
            "NUM_HEADS", "KV_GROUP", "D", "Q_MAX_LEN", "KV_MAX_LEN", "CAUSAL", "WINDOW_LEFT", "WINDOW_RIGHT",
            "SOFTCAP", "ALIBI", "QK_SCALE", "STRIDE_ALIGN", "FILL_BLOCK")},
            "OUT_SCALE": p.out_scale, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
            "STAGES": tiles.num_stages, "CONSUMER_REGS": HOPPER_CONSUMER_REGS,
            "PRODUCER_REGS": HOPPER_PRODUCER_REGS},
        num_warps=tiles.num_warps, num_stages=HOPPER_FWD_TRITON_STAGES, max_registers=tiles.max_registers,
        # The query tile is one consumer warpgroup's 64 rows.
        descriptors=((0, (tiles.block_m // 2, p.head_dim)), (1, (tiles.block_n, p.head_dim)),
                     (2, (tiles.block_n, p.head_dim))))
    o, lse, _ = run(call, (*views, q_offsets, kv_offsets, _slopes(p, slopes), _params(call)))
    return o, lse


def backward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes=None,
             dlse=None):
    """dq, dk, dv: the preprocess (delta = rowsum(o * do)), then the dq and dk/dv programs (in one launch
    or two, see Problem.backward_launches). `dlse`, the gradient of the log-sum-exp [Z, H, T_q] (in its
    units), or None."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.zeros(p.kv_shape, k.dtype), jnp.zeros(p.kv_shape, v.dtype)
    bs = p.block_sizes
    params, constants = _common(p)
    align, (token_stride, head_stride) = _in_units(*p.strides(p.num_heads, p.q_tokens))
    preprocess = KernelCall(
        kernels.attention_bwd_preprocess_kernel,
        grid=(cdiv(p.q_tokens, bs.preprocess_block_m), p.num_segments * p.num_heads),
        out_shapes=(jax.ShapeDtypeStruct(p.stats_shape, jnp.float32),),
        params=spec.ATTENTION_BWD_PREPROCESS.pack(dict(tokens=p.q_tokens, token_stride=token_stride,
                                                       head_stride=head_stride)),
        constants=dict(NUM_HEADS=p.num_heads, D=p.head_dim, BLOCK_D=constants["BLOCK_D"],
                       OUT_SCALE=p.out_scale, BLOCK_M=bs.preprocess_block_m,
                       STRIDE_ALIGN=align))
    (delta,) = run(preprocess, (o, do, _params(preprocess)))
    if dlse is not None:
        delta = delta - lse_gradient(lse, dlse, p.scale * p.out_scale)
    if p.hopper_backward:
        return _hopper_backward(run, p, q, k, v, q_offsets, kv_offsets, lse, delta, do, slopes)
    # The dk/dv programs' q and do, key-major, for TF32 products; else q and do again (unused).
    qdo_key_major = key_major(p, q.dtype, "q_do")
    q_km, do_km = ([_tokens_contiguous(run, p, x, p.num_heads, p.q_tokens) for x in (q, do)]
                   if qdo_key_major else (q, do))
    constants = dict(constants, OUT_SCALE=p.out_scale, DS_SCALE=p.scale * p.out_scale,
                     DKDV_BLOCK_M=bs.dkdv.block_m, DKDV_BLOCK_N=bs.dkdv.block_n,
                     DQ_BLOCK_M=bs.dq.block_m, DQ_BLOCK_N=bs.dq.block_n, QDO_KEY_MAJOR=qdo_key_major,
                     KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN)
    shapes = dict(dq=jax.ShapeDtypeStruct(p.q_shape, q.dtype), dk=jax.ShapeDtypeStruct(p.kv_shape, k.dtype),
                  dv=jax.ShapeDtypeStruct(p.kv_shape, v.dtype))
    grads = {}
    for launch in p.backward_launches:
        call = KernelCall(
            kernels.attention_bwd_kernel, grid=_grid(p, q.dtype.itemsize, launch.slots),
            # The outputs a launch does not compute are one-element placeholders it never touches.
            out_shapes=tuple(shape if name in launch.grads else jax.ShapeDtypeStruct((1,), shape.dtype)
                             for name, shape in shapes.items()),
            params=spec.ATTENTION_BWD.pack(dict(
                params, q_fill_chunk=_fill_chunk(p.q_tokens, launch.programs_per_kind),
                kv_fill_chunk=_fill_chunk(p.kv_tokens, launch.programs_per_kind), slots=launch.slots,
                km_d_stride=q_km.shape[-1] // KEY_MAJOR_ALIGN if qdo_key_major else 0)),
            constants=dict(constants, DQ_PROGRAMS="dq" in launch.grads, DKDV_PROGRAMS="dk" in launch.grads),
            num_warps=launch.config.num_warps, num_stages=launch.config.num_stages,
            max_registers=launch.config.max_registers)
        arrays = (q, k, v, do, lse, delta, q_offsets, kv_offsets, q_km, do_km, _slopes(p, slopes),
                  _params(call))
        grads.update((name, x) for name, x in zip(shapes, run(call, arrays)) if name in launch.grads)
    return grads["dq"], grads["dk"], grads["dv"]


def _hopper_backward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets, lse, delta, do, slopes=None):
    """The Hopper backward (kernels/hopper_backward.py): a dk/dv launch and a dq launch, each on a
    persistent grid as the Hopper forward's (p.hopper_programs programs taking the blocks of 128 keys, or
    of 128 queries, from a counter the launch zeroes, after their share of the zero fills), q, do, k, v
    as TMA descriptors over the forward's 2-D views, and the window, soft cap and ALiBi slopes as the
    forward takes them (see `_hopper_forward`)."""
    tiles = p.hopper_tiles
    params, constants = _common(p)
    views = _tma_views(p, (q, do), (k, v))
    shared = {name: constants[name] for name in (
        "KV_GROUP", "D", "Q_MAX_LEN", "KV_MAX_LEN", "CAUSAL", "WINDOW_LEFT", "WINDOW_RIGHT", "SOFTCAP",
        "ALIBI", "QK_SCALE", "STRIDE_ALIGN", "FILL_BLOCK")}
    shared.update(DS_SCALE=p.scale * p.out_scale, CONSUMER_REGS=HOPPER_CONSUMER_REGS,
                  PRODUCER_REGS=HOPPER_PRODUCER_REGS)
    arrays = (*views, lse, delta, q_offsets, kv_offsets, _slopes(p, slopes))
    # Two consumer warpgroups of 64 rows: the dk/dv program's keys, the dq program's queries.
    dkdv, dq = tiles.dkdv, tiles.dq
    blocks = p.blocks(dkdv.block_n, p.kv_tokens, p.kv_max_seq_len)
    dkdv_call = KernelCall(
        kernels.hopper_attention_bwd_dkdv_kernel,
        **_persistent(p, jax.ShapeDtypeStruct(p.kv_shape, k.dtype),
                      jax.ShapeDtypeStruct(p.kv_shape, v.dtype)),
        params=spec.HOPPER_BWD_DKDV.pack(dict(params, blocks=blocks,
                                              fill_chunk=_hopper_fill_chunk(p.kv_tokens, blocks))),
        constants=dict(shared, NUM_KV_HEADS=p.num_kv_heads, OUT_SCALE=p.out_scale, BLOCK_M=dkdv.block_m,
                       BLOCK_N=dkdv.block_n, STAGES=dkdv.num_stages),
        num_warps=dkdv.num_warps, num_stages=HOPPER_BWD_TRITON_STAGES, max_registers=dkdv.max_registers,
        descriptors=((0, (dkdv.block_m, p.head_dim)), (1, (dkdv.block_m, p.head_dim)),
                     (2, (dkdv.block_n // 2, p.head_dim)), (3, (dkdv.block_n // 2, p.head_dim))))
    dk, dv, _ = run(dkdv_call, (*arrays, _params(dkdv_call)))
    blocks = p.blocks(dq.block_m, p.q_tokens, p.max_seq_len)
    dq_call = KernelCall(
        kernels.hopper_attention_bwd_dq_kernel, **_persistent(p, jax.ShapeDtypeStruct(p.q_shape, q.dtype)),
        params=spec.HOPPER_BWD_DQ.pack(dict(params, blocks=blocks,
                                            fill_chunk=_hopper_fill_chunk(p.q_tokens, blocks))),
        constants=dict(shared, NUM_HEADS=p.num_heads, BLOCK_M=dq.block_m, BLOCK_N=dq.block_n,
                       STAGES=dq.num_stages),
        num_warps=dq.num_warps, num_stages=HOPPER_BWD_TRITON_STAGES, max_registers=dq.max_registers,
        descriptors=((0, (dq.block_m // 2, p.head_dim)), (1, (dq.block_m // 2, p.head_dim)),
                     (2, (dq.block_n, p.head_dim)), (3, (dq.block_n, p.head_dim))))
    dq_out, _ = run(dq_call, (*arrays, _params(dq_call)))
    return dq_out, dk, dv


def check_grid(p: Problem) -> None:
    """Raise ValueError when a launch would need more programs than CUDA's grid allows."""
    sequences = p.sequence_heads
    launches = [("forward", p.forward_slots)]
    launches += [("backward", launch.slots) for launch in p.backward_launches]
    for name, count in launches:
        if sequences * count > MAX_GRID_X:
            raise ValueError(
                f"the {name} would need {sequences * count} programs ({sequences // p.num_heads} sequences "
                f"and fills x {p.num_heads} heads x {count} slots); at most {MAX_GRID_X} are supported "
                "(use a smaller max_seq_len or split the batch)")
