"""Which kernels the forward and backward run, on which grid, with which arguments: shared by launchers.

A launcher is a function `run(call, arrays) -> outputs` that executes one `KernelCall`; gpu.py does it
with jax-triton, interpret.py with Triton's interpreter. A kernel's parameters are the call's arrays
(the last one the int32 array of its runtime sizes, `params`), its outputs, then `constants` by keyword.

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
from ..configs import BlockSizes, head_block

# CUDA's limit on the first grid dimension, which enumerates every program of a launch.
MAX_GRID_X = 2**31 - 1
# Above this many bytes of q, k and v, each sequence's programs run next to each other (a one-axis
# grid, see kernels._program), so that they share its keys, values and queries in L2 (about half of a
# Hopper L2). Below it every operand stays in L2 anyway, and the two-axis grid, slot-major, balances the
# load better and spares each program two integer divisions.
L2_REUSE_BYTES = 32 << 20
# CUDA's limit on the second grid dimension (slots, in the two-axis grid).
MAX_GRID_Y = 65535
# Tokens the zero-fill programs clear at a time.
FILL_BLOCK = 32
# Alignment, in tokens, of the rows of key-major operands (the forward's V_KEY_MAJOR, the backward's
# QDO_KEY_MAJOR), and the tokens each program of kernels.key_major_kernel transposes.
KEY_MAJOR_ALIGN = 16
KEY_MAJOR_BLOCK = 64
# The padded head dimensions at which float32 inputs (TF32 products) take key-major operands, as measured
# on an H200: the forward's v gained nothing at D = 32; the backward's q and do lost on rec-mid (D = 64,
# where two transposes cost more than the kernel gained), and its D = 256 tiles load synchronously.
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
        return -(-min(max_len, tokens) // rows)

    @property
    def sequence_heads(self) -> int:
        """(segment, sequence or zero fill, head) triples: the programs of one slot."""
        return self.num_segments * (self.batch + 1) * self.num_heads

    @property
    def forward_slots(self) -> int:
        """The forward's programs per sequence and head: its row blocks, then the tail-zeroing one."""
        return self.blocks(self.block_sizes.fwd.block_m, self.q_tokens, self.max_seq_len) + 1

    @property
    def backward_launches(self) -> tuple[tuple[str, ...], ...]:
        """The backward's launches, each as the gradients its programs compute: dq and dk/dv together
        (in even and odd slots), or ("dq",) and ("dk", "dv") apart, when their tiles' warps or stages
        differ."""
        return ((("dq", "dk", "dv"),) if self.block_sizes.one_backward_launch
                else (("dq",), ("dk", "dv")))

    def backward_slots(self, grads: tuple[str, ...]) -> int:
        """A backward launch's slots per sequence and head: a sequence's row blocks and then its
        tail-zeroing slot, of each kind of program (in pairs when both share the launch)."""
        bs = self.block_sizes
        dq = self.blocks(bs.dq.block_m, self.q_tokens, self.max_seq_len) + 1
        dkdv = self.blocks(bs.dkdv.block_n, self.kv_tokens, self.kv_max_seq_len) + 1
        if grads == ("dq",):
            return dq
        if grads == ("dk", "dv"):
            return dkdv
        return 2 * max(dq, dkdv)

    @property
    def empty(self) -> bool:
        return self.num_segments * self.num_heads * self.q_tokens * self.head_dim == 0

    def with_(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    kernel: Any  # a @triton.jit function of kernels.py
    grid: tuple[int, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]
    # Runtime sizes, passed as an int32 array rather than as scalar arguments: jax-triton turns a
    # scalar equal to 1 into a compile-time constant, so each pattern of ones would compile a kernel.
    params: tuple[int, ...]
    constants: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    # Outputs a launcher must zero first (none: the kernels write every element they own).
    zeroed_outputs: tuple[int, ...] = ()


Runner = Callable[[KernelCall, Sequence[jax.Array]], Sequence[jax.Array]]


def _params(call: KernelCall) -> jax.Array:
    # Stacked from scalars, which a trace inlines: an array constant would be captured as a constant of
    # the jaxpr, which custom_partitioning refuses.
    return jnp.stack([jnp.int32(value) for value in call.params])


def _stride_align(*strides: int) -> int:
    """The largest power of two up to 16 dividing every stride: kernels get strides in these units."""
    return math.gcd(16, *strides)


def _common(p: Problem):
    """The params and constants every attention kernel shares."""
    q_strides = p.strides(p.num_heads, p.q_tokens)
    kv_strides = p.strides(p.num_kv_heads, p.kv_tokens)
    align = _stride_align(*q_strides, *kv_strides)
    params = (p.batch, p.q_tokens, p.kv_tokens, *(s // align for s in (*q_strides, *kv_strides)),
              0 if p.q_offsets_rows == 1 else p.batch + 1,
              0 if p.kv_offsets_rows == 1 else p.batch + 1)
    constants = dict(
        NUM_HEADS=p.num_heads, KV_GROUP=p.num_heads // p.num_kv_heads, D=p.head_dim,
        BLOCK_D=head_block(p.head_dim), Q_MAX_LEN=p.max_seq_len, KV_MAX_LEN=p.kv_max_seq_len,
        CAUSAL=p.causal, QK_SCALE=p.scale * LOG2E, INPUT_PRECISION=p.input_precision,
        STRIDE_ALIGN=align, FILL_BLOCK=FILL_BLOCK)
    return params, constants


def _grid(p: Problem, itemsize: int, slots: int) -> tuple[int, ...]:
    """The grid of an attention kernel with `slots` programs per (segment, sequence or fill, head)."""
    elements = (p.num_heads * p.q_tokens + 2 * p.num_kv_heads * p.kv_tokens) * p.num_segments * p.head_dim
    if elements * itemsize > L2_REUSE_BYTES or slots > MAX_GRID_Y:
        return (p.sequence_heads * slots,)
    return (p.sequence_heads, slots)


def _fill_chunk(tokens: int, programs: int) -> int:
    return max(1, -(-tokens // programs))


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
    tokens, strides = p.num_segments * tokens, p.strides(heads, tokens)
    padded = -(-tokens // KEY_MAJOR_ALIGN) * KEY_MAJOR_ALIGN
    align = _stride_align(*strides)
    call = KernelCall(
        kernels.key_major_kernel, grid=(-(-padded // KEY_MAJOR_BLOCK), heads),
        out_shapes=(jax.ShapeDtypeStruct((heads, p.head_dim, padded), x.dtype),),
        params=(tokens, *(s // align for s in strides), padded // KEY_MAJOR_ALIGN),
        constants=dict(D=p.head_dim, BLOCK_D=head_block(p.head_dim), BLOCK_T=KEY_MAJOR_BLOCK,
                       STRIDE_ALIGN=align, KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN))
    (out,) = run(call, (x, _params(call)))
    return out


def forward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets):
    """o (zero where no query is attended) and the float32 base-2 log-sum-exp [Z, H, T_q]."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.full(p.stats_shape, jnp.inf, jnp.float32)
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
        params=(*params, _fill_chunk(p.q_tokens, slots), slots,
                v.shape[-1] // KEY_MAJOR_ALIGN if v_key_major else 0),
        constants=dict(constants, OUT_SCALE=p.out_scale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                       V_KEY_MAJOR=v_key_major, KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    o, lse = run(call, (q, k, v, q_offsets, kv_offsets, _params(call)))
    return o, lse


def backward(run: Runner, p: Problem, q, k, v, q_offsets, kv_offsets, o, lse, do):
    """dq, dk, dv: the preprocess (delta = rowsum(o * do)), then the dq and dk/dv programs (in one launch
    or two, see Problem.backward_launches)."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.zeros(p.kv_shape, k.dtype), jnp.zeros(p.kv_shape, v.dtype)
    bs = p.block_sizes
    params, constants = _common(p)
    token_stride, head_stride = p.strides(p.num_heads, p.q_tokens)
    align = _stride_align(token_stride, head_stride)
    preprocess = KernelCall(
        kernels.attention_bwd_preprocess_kernel,
        grid=(-(-p.q_tokens // bs.preprocess_block_m), p.num_segments * p.num_heads),
        out_shapes=(jax.ShapeDtypeStruct(p.stats_shape, jnp.float32),),
        params=(p.q_tokens, token_stride // align, head_stride // align),
        constants=dict(NUM_HEADS=p.num_heads, D=p.head_dim, BLOCK_D=constants["BLOCK_D"],
                       OUT_SCALE=p.out_scale, BLOCK_M=bs.preprocess_block_m,
                       STRIDE_ALIGN=align))
    (delta,) = run(preprocess, (o, do, _params(preprocess)))
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
    for names in p.backward_launches:
        slots = p.backward_slots(names)
        # A shared launch's programs come in (dq, dk/dv) pairs: each kind fills its chunk per pair.
        programs = slots // 2 if len(names) == 3 else slots
        cfg = bs.dq if names == ("dq",) else bs.dkdv
        call = KernelCall(
            kernels.attention_bwd_kernel, grid=_grid(p, q.dtype.itemsize, slots),
            # The outputs a launch does not compute are one-element placeholders it never touches.
            out_shapes=tuple(shapes[name] if name in names else jax.ShapeDtypeStruct((1,), shapes[name].dtype)
                             for name in ("dq", "dk", "dv")),
            params=(*params, _fill_chunk(p.q_tokens, programs), _fill_chunk(p.kv_tokens, programs), slots,
                    q_km.shape[-1] // KEY_MAJOR_ALIGN if qdo_key_major else 0),
            constants=dict(constants, DQ_PROGRAMS="dq" in names, DKDV_PROGRAMS="dk" in names),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        arrays = (q, k, v, do, lse, delta, q_offsets, kv_offsets, q_km, do_km, _params(call))
        grads.update((name, x) for name, x in zip(("dq", "dk", "dv"), run(call, arrays)) if name in names)
    return grads["dq"], grads["dk"], grads["dv"]


def check_grid(p: Problem) -> None:
    """Raise ValueError when a launch would need more programs than CUDA's grid allows."""
    sequences = p.sequence_heads
    launches = [("forward", p.forward_slots)]
    launches += [("backward", p.backward_slots(grads)) for grads in p.backward_launches]
    for name, count in launches:
        if sequences * count > MAX_GRID_X:
            raise ValueError(
                f"the {name} would need {sequences * count} programs ({sequences // p.num_heads} sequences "
                f"and fills x {p.num_heads} heads x {count} slots); at most {MAX_GRID_X} are supported "
                "(use a smaller max_seq_len or split the batch)")
