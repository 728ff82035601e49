"""The kernel launches of the forward and the backward, portable and Hopper: which kernel, on which grid,
with which arrays, runtime parameters and constants, each checked against the kernel's spec
(kernels/spec.py). Shared by the launchers: a launcher is a function `run(call, arrays) -> outputs`
that executes one `KernelCall` (gpu.py through jax-triton, interpret.py in Triton's interpreter).

Semantics and array layouts: problem.py. The log-sum-exp residual stays in the kernels' units (base 2
after QK_SCALE, of the unscaled scores; +inf for a query with no key).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat, kernels
from .._util import cdiv, lse_gradient, slopes_in_score_units
from ..configs import (
    HOPPER_CONSUMER_REGS,
    HOPPER_FWD_TRITON_STAGES,
    HOPPER_PRODUCER_REGS,
    MAX_HEAD_DIM,
    BlockSizes,
    KernelConfig,
    head_block,
    hopper_dkdv_triton_stages,
    hopper_dq_triton_stages,
)
from ..jagged import sequence_bounds
from ..kernels import spec
from ..kernels.spec import KernelSpec
from ..problem import Problem

# CUDA's limit on the first grid dimension, which enumerates every program of a launch.
MAX_GRID_X = 2**31 - 1
# Row offsets within one sequence are int32 in the kernels.
MAX_SEQUENCE_ELEMENTS = 2**31 - 1
# Above this many bytes of q, k and v (about half of a Hopper L2), each sequence's programs run next to
# each other (a one-axis grid, see kernels.common._program), so that they share its keys, values and
# queries in L2. Below it every operand stays in L2 anyway, and the two-axis grid, slot-major, balances
# the load better and spares each program two integer divisions.
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
# the kernel gains more than the transposes cost, and whose tiles load asynchronously.
KEY_MAJOR_HEAD_DIMS = {"v": (64, 128, 256), "q_do": (128,)}
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """The portable kernels' configuration: their tiles, whether the forward's v (`v_key_major`) and the
    dk/dv programs' q and do (`qdo_key_major`) come key-major (`key_major`), the size of q, k, v
    above which each sequence's programs run next to each other (`_grid`), and whether the forward loads
    its unmasked key blocks by TMA (`tma_loads`: kernels.attention_fwd_tma_kernel; `tma_loads_error`)."""

    tiles: BlockSizes
    v_key_major: bool
    qdo_key_major: bool
    l2_reuse_bytes: int = L2_REUSE_BYTES
    tma_loads: bool = False


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """The Hopper kernels' configuration: their tiles (configs.hopper_block_sizes), the persistent grid's
    programs (one per SM), the backward preprocess's row block (a portable kernel), and whether the
    backward fuses dq into the dk/dv kernel (`fused_dq`: five products per tile instead of seven, and one
    launch instead of two, but dq accumulated by float32 atomic adds, so not bitwise deterministic), and
    whether the kernels take the sequences with the most work first (`longest_first`, `sequence_order`:
    each item's sequence then read from the order, a load on the producer's path) or in the offsets'
    order (the default): the same numbers either way."""

    tiles: BlockSizes
    programs: int
    preprocess_block_m: int
    fused_dq: bool = False  # (added by a TMA reduce-add where Triton has it: `hopper_backward`)
    longest_first: bool = False


@dataclasses.dataclass(frozen=True)
class KernelCall:
    kernel: Any  # a kernel of the kernels package (the one spec.name names)
    grid: tuple[int, ...]
    out_shapes: tuple[jax.ShapeDtypeStruct, ...]  # in spec.results' order (outputs, then updated inputs)
    params: tuple[int, ...]  # the runtime parameters, in spec.params' order
    constants: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int | None = None  # per thread (Triton's maxnreg), or None
    # (array index, block shape): the arrays the GPU launcher passes as TMA descriptors of that block
    # over the array (2-D), instead of as pointers.
    descriptors: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Outputs the launcher zeroes before the kernel runs (jax-triton's zeroed_outputs).
    zeroed_outputs: tuple[int, ...] = ()
    # (input index, result index) of the inputs the kernel updates in place (jax-triton's
    # input_output_aliases; spec.aliases).
    aliases: tuple[tuple[int, int], ...] = ()
    spec: KernelSpec | None = None  # the contract it was checked against (`kernel_call`)


Runner = Callable[[KernelCall, Sequence[jax.Array]], Sequence[jax.Array]]


def is_gluon(kernel) -> bool:
    """Whether a kernel is Gluon's (the Hopper kernels: no interpreter; TMA descriptors in the NVMMA
    layout their buffers take), not a plain Triton kernel."""
    return type(kernel).__name__ == "GluonJITFunction"


def kernel_call(kernel_spec: KernelSpec, *, grid, outputs: Mapping[str, jax.ShapeDtypeStruct],
                params: Mapping[str, int], constants: Mapping[str, Any], config: KernelConfig | None = None,
                num_stages: int | None = None,
                blocks: Mapping[str, tuple[int, ...]] | None = None) -> KernelCall:
    """A launch of the kernel `kernel_spec` names, checked against it: exactly its results (outputs, then
    the inputs it updates), runtime parameters, constants and descriptors' blocks. `config` gives warps,
    stages (unless `num_stages`) and the register cap."""
    if tuple(outputs) != kernel_spec.results:
        raise ValueError(f"{kernel_spec.name}: outputs {tuple(outputs)}, expected {kernel_spec.results}")
    blocks = dict(blocks or {})
    if set(blocks) != set(kernel_spec.descriptors):
        raise ValueError(f"{kernel_spec.name}: descriptor blocks for {sorted(blocks)}, expected "
                         f"{sorted(kernel_spec.descriptors)}")
    config = config or KernelConfig(16, 16)
    return KernelCall(
        spec=kernel_spec, kernel=getattr(kernels, kernel_spec.name), grid=tuple(grid),
        out_shapes=tuple(outputs.values()), params=kernel_spec.pack(params),
        constants=kernel_spec.check_constants(constants), num_warps=config.num_warps,
        num_stages=config.num_stages if num_stages is None else num_stages,
        max_registers=config.max_registers,
        descriptors=tuple((kernel_spec.index(name), tuple(block)) for name, block in blocks.items()),
        zeroed_outputs=tuple(kernel_spec.outputs.index(name) for name in kernel_spec.zeroed),
        aliases=kernel_spec.aliases)


def launch(run: Runner, call: KernelCall, **arrays) -> tuple[jax.Array, ...]:
    """Run `call` on its inputs by name (the runtime parameters added), results in the spec's order."""
    return tuple(run(call, call.spec.arrays(dict(arrays, params=_params(call)))))


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
    params = dict(
        batch=p.batch, q_tokens=p.q_tokens, kv_tokens=p.kv_tokens, q_token_stride=q_token,
        q_head_stride=q_head, kv_token_stride=kv_token, kv_head_stride=kv_head,
        q_offsets_stride=0 if p.q_offsets_rows == 1 else p.batch + 1,
        kv_offsets_stride=0 if p.kv_offsets_rows == 1 else p.batch + 1)
    constants = dict(
        KV_GROUP=p.num_heads // p.num_kv_heads, D=p.head_dim, Q_MAX_LEN=p.max_seq_len,
        KV_MAX_LEN=p.kv_max_seq_len, CAUSAL=p.causal, WINDOW_LEFT=-1 if p.window[0] is None else p.window[0],
        WINDOW_RIGHT=-1 if p.window[1] is None else p.window[1],
        # In units of the unscaled scores, as the kernels keep them (see kernels.common._scores).
        SOFTCAP=0.0 if p.softcap is None else p.softcap / p.scale, ALIBI=p.alibi, QK_SCALE=p.scale * LOG2E,
        STRIDE_ALIGN=align, FILL_BLOCK=FILL_BLOCK)
    return params, constants


def _slopes(p: Problem, slopes) -> jax.Array:
    """The kernels' ALiBi operand: the slopes [Z, H] in units of the unscaled scores (divided by the
    scale, clamped to float32), float32; without ALiBi a one-element placeholder they never read."""
    if not p.alibi:
        return jnp.zeros((1,), jnp.float32)
    return jnp.broadcast_to(slopes_in_score_units(slopes, p.scale), (p.num_segments, p.num_heads))


# ---------------------------------------------------------------------------------------------------
# The portable kernels (kernels/portable/): a program per (segment, sequence or fill, head, slot)
# ---------------------------------------------------------------------------------------------------


def blocks(rows: int, tokens: int, max_len: int) -> int:
    """Blocks of `rows` covering the longest attended sequence (at most min(max_len, tokens))."""
    return cdiv(min(max_len, tokens), rows)


def sequence_heads(p: Problem) -> int:
    """(segment, sequence or zero fill, head) triples: the programs of one slot."""
    return p.num_segments * (p.batch + 1) * p.num_heads


def forward_slots(p: Problem, tiles: BlockSizes) -> int:
    """The forward's programs per sequence and head: its row blocks, then the tail-zeroing one."""
    return blocks(tiles.fwd.block_m, p.q_tokens, p.max_seq_len) + 1


@dataclasses.dataclass(frozen=True)
class BackwardLaunch:
    """One launch of kernels.attention_bwd_kernel: the gradients its programs compute, its slots per
    (segment, sequence or fill, head), how many of those belong to each kind of program (the zero-fill
    "sequence" splits the uncovered tokens into that many chunks), and its tile's warps and stages."""

    grads: tuple[str, ...]
    slots: int
    programs_per_kind: int
    config: KernelConfig


def backward_launches(p: Problem, tiles: BlockSizes) -> tuple[BackwardLaunch, ...]:
    """The backward's launches: dq and dk/dv programs together (in even and odd slots), or apart when their
    tiles' warps or stages differ. Each kind has, per sequence and head, its row blocks and a
    tail-zeroing program."""
    return paired_launches(tiles, dq=blocks(tiles.dq.block_m, p.q_tokens, p.max_seq_len) + 1,
                           dkdv=blocks(tiles.dkdv.block_n, p.kv_tokens, p.kv_max_seq_len) + 1)


def paired_launches(tiles: BlockSizes, dq: int, dkdv: int) -> tuple[BackwardLaunch, ...]:
    """The launches of a backward kernel with `dq` slots of dq programs and `dkdv` of dk/dv programs per
    (segment, sequence or fill, head): one launch when their tiles' warps, stages and register caps
    agree (`BlockSizes.one_backward_launch`), else one launch of each kind."""
    if tiles.one_backward_launch:
        pairs = max(dq, dkdv)
        return (BackwardLaunch(("dq", "dk", "dv"), 2 * pairs, pairs, tiles.dkdv),)
    return BackwardLaunch(("dq",), dq, dq, tiles.dq), BackwardLaunch(("dk", "dv"), dkdv, dkdv, tiles.dkdv)


def addressing_error(p: Problem) -> str | None:
    """Why the kernels cannot address the problem's sequences (row offsets within one are int32: up to
    the longest attended sequence and a block more, a token stride apart), or None."""
    bounds = (("max_seq_len", p.num_heads, min(p.max_seq_len, p.q_tokens)),
              ("kv_max_seq_len", p.num_kv_heads, min(p.kv_max_seq_len, p.kv_tokens)))
    for name, heads, longest in bounds:
        stride = heads * p.head_dim if p.layout == "THD" else p.head_dim
        if (longest + MAX_HEAD_DIM) * stride > MAX_SEQUENCE_ELEMENTS:
            return (f"{name} * {'H * D' if p.layout == 'THD' else 'D'} = {longest * stride} elements in one "
                    f"sequence (at most its tokens) is more than the kernels address (< 2**31)")
    return None


def grid_error(p: Problem, tiles: BlockSizes) -> str | None:
    """Why a portable launch would need more programs than CUDA's grid allows, or None."""
    launches = [("forward", forward_slots(p, tiles))]
    launches += [("backward", launch.slots) for launch in backward_launches(p, tiles)]
    return programs_error(launches, sequence_heads(p), p.num_heads)


def programs_error(launches, sequences: int, heads: int) -> str | None:
    """Why one of `launches` ((name, slots) each) would need more programs than CUDA's grid allows,
    with `sequences` (segment, sequence or fill, head) triples of `heads` heads per slot, or None."""
    for name, count in launches:
        if sequences * count > MAX_GRID_X:
            return (f"the {name} would need {sequences * count} programs ({sequences // heads} "
                    f"sequences and fills x {heads} heads x {count} slots); at most {MAX_GRID_X} are "
                    "supported (use a smaller max_seq_len or split the batch)")
    return None


def _grid(p: Problem, config: PortableConfig, slots: int) -> tuple[int, ...]:
    """The grid of an attention kernel with `slots` programs per (segment, sequence or fill, head)."""
    elements = (p.num_heads * p.q_tokens + 2 * p.num_kv_heads * p.kv_tokens) * p.num_segments * p.head_dim
    if elements * p.itemsize > config.l2_reuse_bytes or slots > MAX_GRID_Y:
        return (sequence_heads(p) * slots,)
    return (sequence_heads(p), slots)


def _fill_chunk(tokens: int, programs: int) -> int:
    return max(1, cdiv(tokens, programs))


def key_major(p: Problem, operands: str) -> bool:
    """Whether the kernels take `operands` ("v": the forward's v; "q_do": the dk/dv programs' q and
    do), which TF32 products read along D, as [H, D, tokens]: TF32 products (float32 inputs) need both
    operands K-major in shared memory (see kernels.attention_fwd_kernel). Only at the padded head
    dimensions of KEY_MAJOR_HEAD_DIMS."""
    return (p.input_precision == "tf32" and p.itemsize == 4
            and head_block(p.head_dim) in KEY_MAJOR_HEAD_DIMS[operands])


def _tokens_contiguous(run: Runner, p: Problem, x, heads: int, tokens: int) -> jax.Array:
    """x ([*, heads, D] with `tokens` tokens per segment, in p's layout) as [heads, D, all tokens], the
    token axis padded with 0 to a multiple of KEY_MAJOR_ALIGN."""
    align, (token_stride, head_stride) = _in_units(*p.strides(heads, tokens))
    tokens *= p.num_segments
    padded = cdiv(tokens, KEY_MAJOR_ALIGN) * KEY_MAJOR_ALIGN
    call = kernel_call(
        spec.KEY_MAJOR, grid=(cdiv(padded, KEY_MAJOR_BLOCK), heads),
        outputs=dict(out=jax.ShapeDtypeStruct((heads, p.head_dim, padded), x.dtype)),
        params=dict(tokens=tokens, token_stride=token_stride, head_stride=head_stride,
                    padded=padded // KEY_MAJOR_ALIGN),
        constants=dict(D=p.head_dim, BLOCK_D=head_block(p.head_dim), BLOCK_T=KEY_MAJOR_BLOCK,
                       STRIDE_ALIGN=align, KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN))
    (out,) = launch(run, call, x=x)
    return out


def tma_loads_error(p: Problem, config: PortableConfig) -> str | None:
    """Why the portable forward cannot load its unmasked key blocks by TMA (attention_fwd_tma_kernel) for
    `p` with `config`'s other choices, or None: it takes token-major v, a power-of-two head dimension
    of at least 16 (the kernels' least, head_block), 16-bit inputs, key tokens (a TMA descriptor has no
    empty dimension), and TMA coordinates (int32) within its 2-D views."""
    if p.kv_tokens == 0:
        return "no key tokens (no TMA descriptor over an empty array)"
    if config.v_key_major:
        return "v comes key-major"
    if p.itemsize != 2:
        return f"{p.dtype} inputs (TMA loads: 16-bit)"
    if head_block(p.head_dim) != p.head_dim:
        return f"head dimension D={p.head_dim} (TMA loads: a power of two, at least 16)"
    kv_token_stride = p.strides(p.num_kv_heads, p.kv_tokens)[0]
    rows = p.num_segments * p.num_kv_heads * p.kv_tokens * p.head_dim // kv_token_stride
    if rows > MAX_SEQUENCE_ELEMENTS:
        return f"{rows} rows of k (TMA coordinates are int32)"
    return None


def forward(run: Runner, p: Problem, config: PortableConfig, q, k, v, q_offsets, kv_offsets, slopes=None):
    """o (zero where no query is attended) and the float32 base-2 log-sum-exp [Z, H, T_q], by the portable
    forward (its unmasked key blocks loaded by TMA with config.tma_loads)."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.full(p.stats_shape, jnp.inf, jnp.float32)
    tiles = config.tiles
    params, constants = _common(p)
    slots = forward_slots(p, tiles)
    v_key_major = config.v_key_major
    if v_key_major:
        v = _tokens_contiguous(run, p, v, p.num_kv_heads, p.kv_tokens)
    constants = dict(constants, NUM_HEADS=p.num_heads, OUT_SCALE=p.out_scale,
                     INPUT_PRECISION=p.input_precision, BLOCK_M=tiles.fwd.block_m, BLOCK_N=tiles.fwd.block_n)
    arrays = dict(q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=kv_offsets, slopes=_slopes(p, slopes))
    if config.tma_loads:
        if (reason := tma_loads_error(p, config)) is not None:
            raise ValueError(f"the portable forward cannot load by TMA: {reason}")
        kernel_spec, tile = spec.ATTENTION_FWD_TMA, (tiles.fwd.block_n, p.head_dim)
        arrays.update(zip(("k_tiles", "v_tiles"), _tma_views(p, (), (k, v))))
        blocks_ = dict(k_tiles=tile, v_tiles=tile)
    else:
        kernel_spec, blocks_ = spec.ATTENTION_FWD, None
        constants.update(BLOCK_D=head_block(p.head_dim), V_KEY_MAJOR=v_key_major,
                         KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN)
    call = kernel_call(
        kernel_spec, grid=_grid(p, config, slots),
        outputs=dict(o=jax.ShapeDtypeStruct(p.q_shape, q.dtype),
                     lse=jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
        params=dict(params, fill_chunk=_fill_chunk(p.q_tokens, slots), slots=slots,
                    v_d_stride=v.shape[-1] // KEY_MAJOR_ALIGN if v_key_major else 0),
        constants=constants, config=tiles.fwd, blocks=blocks_)
    return launch(run, call, **arrays)


def delta(run: Runner, p: Problem, block_m: int, o, do, lse, dlse=None):
    """The backward's delta = rowsum(o * do) / out_scale, float32 [Z, H, T_q] (the preprocess kernel, in
    blocks of `block_m` tokens), less the log-sum-exp's own gradient `dlse` (in its units) when given."""
    align, (token_stride, head_stride) = _in_units(*p.strides(p.num_heads, p.q_tokens))
    call = kernel_call(
        spec.ATTENTION_BWD_PREPROCESS, grid=(cdiv(p.q_tokens, block_m), p.num_segments * p.num_heads),
        outputs=dict(delta=jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
        params=dict(tokens=p.q_tokens, token_stride=token_stride, head_stride=head_stride),
        constants=dict(NUM_HEADS=p.num_heads, D=p.head_dim, BLOCK_D=head_block(p.head_dim),
                       OUT_SCALE=p.out_scale, BLOCK_M=block_m, STRIDE_ALIGN=align))
    (result,) = launch(run, call, o=o, do=do)
    if dlse is not None:
        result = result - lse_gradient(lse, dlse, p.scale * p.out_scale)
    return result


def _zero_gradients(p: Problem, q, k, v):
    return jnp.zeros(p.q_shape, q.dtype), jnp.zeros(p.kv_shape, k.dtype), jnp.zeros(p.kv_shape, v.dtype)


def backward(run: Runner, p: Problem, config: PortableConfig, q, k, v, q_offsets, kv_offsets, o, lse, do,
             slopes=None, dlse=None):
    """dq, dk, dv by the portable backward: the preprocess (`delta`), then the dq and dk/dv programs (in one
    launch or two, see `backward_launches`). `dlse`, the gradient of the log-sum-exp [Z, H, T_q] (in its
    units), or None."""
    if p.empty:
        return _zero_gradients(p, q, k, v)
    tiles = config.tiles
    delta_ = delta(run, p, tiles.preprocess_block_m, o, do, lse, dlse)
    params, constants = _common(p)
    # The dk/dv programs' q and do, key-major, for TF32 products; else q and do again (unused).
    qdo_key_major = config.qdo_key_major
    q_km, do_km = ([_tokens_contiguous(run, p, x, p.num_heads, p.q_tokens) for x in (q, do)]
                   if qdo_key_major else (q, do))
    constants = dict(constants, NUM_HEADS=p.num_heads, BLOCK_D=head_block(p.head_dim),
                     INPUT_PRECISION=p.input_precision, OUT_SCALE=p.out_scale, DS_SCALE=p.scale * p.out_scale,
                     DKDV_BLOCK_M=tiles.dkdv.block_m, DKDV_BLOCK_N=tiles.dkdv.block_n,
                     DQ_BLOCK_M=tiles.dq.block_m, DQ_BLOCK_N=tiles.dq.block_n, QDO_KEY_MAJOR=qdo_key_major,
                     KEY_MAJOR_ALIGN=KEY_MAJOR_ALIGN)
    shapes = dict(dq=jax.ShapeDtypeStruct(p.q_shape, q.dtype), dk=jax.ShapeDtypeStruct(p.kv_shape, k.dtype),
                  dv=jax.ShapeDtypeStruct(p.kv_shape, v.dtype))
    grads = {}
    for one in backward_launches(p, tiles):
        call = kernel_call(
            spec.ATTENTION_BWD, grid=_grid(p, config, one.slots),
            # The outputs a launch does not compute are one-element placeholders it never touches.
            outputs={name: shape if name in one.grads else jax.ShapeDtypeStruct((1,), shape.dtype)
                     for name, shape in shapes.items()},
            params=dict(params, q_fill_chunk=_fill_chunk(p.q_tokens, one.programs_per_kind),
                        kv_fill_chunk=_fill_chunk(p.kv_tokens, one.programs_per_kind), slots=one.slots,
                        km_d_stride=q_km.shape[-1] // KEY_MAJOR_ALIGN if qdo_key_major else 0),
            constants=dict(constants, DQ_PROGRAMS="dq" in one.grads, DKDV_PROGRAMS="dk" in one.grads),
            config=one.config)
        outputs = launch(run, call, q=q, k=k, v=v, do=do, lse=lse, delta=delta_, q_offsets=q_offsets,
                         kv_offsets=kv_offsets, q_km=q_km, do_km=do_km, slopes=_slopes(p, slopes))
        grads.update((name, x) for name, x in zip(shapes, outputs) if name in one.grads)
    return grads["dq"], grads["dk"], grads["dv"]


# ---------------------------------------------------------------------------------------------------
# The Hopper kernels (kernels/hopper/: forward.py, dkdv.py, dq.py): persistent, TMA descriptors
# ---------------------------------------------------------------------------------------------------


def _tma_views(p: Problem, q_like, kv_like) -> tuple:
    """The 2-D views the Hopper kernels' TMA descriptors cover, rows one token stride long (a token in
    "THD", a (head, token) in "HTD"): the arrays shaped as q, then those shaped as k."""
    q_token_stride = p.strides(p.num_heads, p.q_tokens)[0]
    kv_token_stride = p.strides(p.num_kv_heads, p.kv_tokens)[0]
    return (*(x.reshape(-1, q_token_stride) for x in q_like),
            *(x.reshape(-1, kv_token_stride) for x in kv_like))


def _hopper_call(kernel_spec: KernelSpec, p: Problem, config: HopperConfig, tiles: KernelConfig,
                 outputs: dict, blocks_: int, tokens: int, constants: dict, triton_stages: int,
                 descriptor_blocks: dict, updated: dict | None = None) -> KernelCall:
    """A persistent Hopper launch: config.programs programs, which take the `blocks_` blocks per (sequence,
    head) from a counter the launch zeroes (the last output, before the `updated` inputs' results), after
    their share of the zero fills (the tokens no sequence covers in blocks + 1 chunks per head)."""
    params, common = _common(p)
    return kernel_call(
        kernel_spec, grid=(config.programs,),
        outputs=dict(outputs, counter=jax.ShapeDtypeStruct((1,), jnp.int32), **(updated or {})),
        params=dict(params, blocks=blocks_, fill_chunk=_fill_chunk(tokens, blocks_ + 1)),
        constants=dict(common, **constants, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       STAGES=tiles.num_stages, CONSUMER_REGS=HOPPER_CONSUMER_REGS,
                       PRODUCER_REGS=HOPPER_PRODUCER_REGS, ORDERED=config.longest_first),
        config=tiles, num_stages=triton_stages, blocks=descriptor_blocks)


def hopper_forward(run: Runner, p: Problem, config: HopperConfig, q, k, v, q_offsets, kv_offsets,
                   slopes=None):
    """The Hopper forward: q, k, v as TMA descriptors over 2-D views whose rows are one token stride long;
    the query blocks of the portable forward (`blocks` per (sequence, head)) on a persistent grid."""
    if p.empty:
        return jnp.zeros(p.q_shape, q.dtype), jnp.full(p.stats_shape, jnp.inf, jnp.float32)
    tiles = config.tiles.fwd
    q_view, k_view, v_view = _tma_views(p, (q,), (k, v))
    call = _hopper_call(
        spec.HOPPER_FWD, p, config, tiles,
        dict(o=jax.ShapeDtypeStruct(p.q_shape, q.dtype),
             lse=jax.ShapeDtypeStruct(p.stats_shape, jnp.float32)),
        blocks(tiles.block_m, p.q_tokens, p.max_seq_len), p.q_tokens,
        dict(NUM_HEADS=p.num_heads, OUT_SCALE=p.out_scale), HOPPER_FWD_TRITON_STAGES,
        # The query tile is one consumer warpgroup's 64 rows.
        dict(q=(tiles.block_m // 2, p.head_dim), k=(tiles.block_n, p.head_dim),
             v=(tiles.block_n, p.head_dim)))
    o, lse, _ = launch(run, call, q=q_view, k=k_view, v=v_view, q_offsets=q_offsets, kv_offsets=kv_offsets,
                       order=sequence_order(p, config, q_offsets, kv_offsets), slopes=_slopes(p, slopes))
    return o, lse


def sequence_order(p: Problem, config: HopperConfig, q_offsets, kv_offsets) -> jax.Array:
    """The order the Hopper kernels take the sequences in (their `order` input): with
    config.longest_first `work_order` of their lengths, clamped as the kernels clamp them
    (`jagged.sequence_bounds`); else `no_order`, the lengths not computed."""
    if not config.longest_first:
        return no_order()
    _, n_q = sequence_bounds(q_offsets.reshape(-1)[:p.batch + 1], p.q_tokens, p.max_seq_len)
    _, n_k = sequence_bounds(kv_offsets.reshape(-1)[:p.batch + 1], p.kv_tokens, p.kv_max_seq_len)
    return work_order(n_q, n_k)


def no_order() -> jax.Array:
    """The `order` input of a persistent Hopper launch whose kernels take the sequences in the offsets'
    order (compiled without ORDERED), or that has no sequence: one element, never read."""
    return jnp.zeros((1,), jnp.int32)


def work_order(n_q, n_k) -> jax.Array:
    """The order the persistent Hopper kernels hand out B sequences of n_q queries and n_k keys ([B]
    each) in (their `order` input, kernels/hopper/scheduler._take: the softmax kernels', `sequence_order`,
    and HSTU's, launch/hstu.sequence_order) when they take them longest first (their ORDERED): int32 [B],
    a permutation of 0..B-1 by their work n_q * n_k, the most first and equal work in the given order, so
    that the launch's last items are short sequences' (longest processing time first); `no_order`
    without sequences."""
    if n_q.shape[0] == 0:
        return no_order()
    work = n_q.astype(jnp.float32) * n_k.astype(jnp.float32)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)


def padded_dq_rows(p: Problem, block_m: int) -> int:
    """Rows of the TMA dq-fused kernel's dq accumulator: the queries, each sequence's padded by a query
    tile of block_m rows (`dq_rows`)."""
    return p.q_tokens + p.batch * block_m


def dq_rows(p: Problem, q_offsets, block_m: int):
    """(rows, starts, lengths, order), [B]: rows[b] the row of the TMA dq-fused kernel's accumulator
    where sequence b's queries start, starts[b] + rank * block_m, rank its place in `order`, the
    sequences ordered by (start, length) (clamped, as the kernels clamp them: `jagged.sequence_bounds`).
    Whatever order the offsets give them, sequences whose tokens do not overlap get rows that do not
    overlap, each with the block_m rows after it that its last query tile reaches into; all within
    `padded_dq_rows` (which the implementation bounds), so rows are int32 whatever the offsets' dtype,
    as the kernel's TMA coordinates are."""
    starts, lengths = sequence_bounds(q_offsets.reshape(-1)[:p.batch + 1], p.q_tokens, p.max_seq_len)
    order = jnp.lexsort((lengths, starts)).astype(jnp.int32)
    rank = jnp.zeros(p.batch, jnp.int32).at[order].set(jnp.arange(p.batch, dtype=jnp.int32))
    return (starts + rank * block_m).astype(jnp.int32), starts, lengths, order


def unpad_dq(p: Problem, dq_acc, placement):
    """dq, float32 of q's shape, from the TMA dq-fused kernel's accumulator dq_acc, [padded_dq_rows,
    H * D], laid out by `placement` (`dq_rows`' tuple, whose rows the kernel took: sequence b's queries
    start at row rows[b]): token t takes its row of the last sequence with tokens in `dq_rows`' order
    that starts at or before t, when t is among that sequence's first min(length, max_seq_len) tokens;
    every other token takes 0 (so do the rows past each sequence, 0 or NaN where the sequence has an inf
    key)."""
    if p.batch == 0:
        return jnp.zeros(p.q_shape, jnp.float32)
    rows, starts, lengths, order = placement
    tokens = jnp.arange(p.q_tokens, dtype=jnp.int32)
    ranks = jnp.arange(p.batch, dtype=jnp.int32)
    owners = jnp.full(p.q_tokens + 1, -1, jnp.int32).at[starts[order]].max(
        jnp.where(lengths[order] > 0, ranks, -1))
    owners = jax.lax.cummax(owners[:p.q_tokens])  # the rank of that sequence, -1 where none
    owner = order[jnp.maximum(owners, 0)]
    keep = (owners >= 0) & (tokens - starts[owner] < lengths[owner])
    picked = dq_acc[tokens + rows[owner] - starts[owner]].reshape(p.q_tokens, p.num_heads, p.head_dim)
    dq = jnp.where(keep[:, None, None], picked, 0.0)
    return dq if p.layout == "THD" else dq.transpose(1, 0, 2)


def hopper_backward(run: Runner, p: Problem, config: HopperConfig, q, k, v, q_offsets, kv_offsets, o, lse, do,
                    slopes=None, dlse=None):
    """The Hopper backward: the portable preprocess (`delta`), then a dk/dv launch and a dq launch, each
    persistent as the Hopper forward (blocks of 128 keys, or of 128 queries), q, do, k, v as TMA
    descriptors over the forward's 2-D views, the window, soft cap and ALiBi slopes as the forward takes
    them. With config.fused_dq, the dk/dv launch alone, of its dq-fused kernel, which adds dq into a
    float32 array of q's shape, zeroed, then cast to q's dtype: the tokens no sequence attends, and the
    queries that see no key, stay 0 (nothing, or zeros, add there). Where Triton's Gluon has the TMA
    reduce-add (`_compat.gluon_tma_reduce`), the kernel adding dq by it from shared memory in whole tiles,
    dq_acc float32 zeros of [padded_dq_rows, H * D] passed as a descriptor of [dk/dv's query tile, 64]
    blocks (a warpgroup's columns) and updated in place, the sequences' rows then gathered from it
    (`unpad_dq`); else the kernel adding it by atomics, dq_acc an output the launch zeroes."""
    if p.empty:
        return _zero_gradients(p, q, k, v)
    delta_ = delta(run, p, config.preprocess_block_m, o, do, lse, dlse)
    dkdv, dq = config.tiles.dkdv, config.tiles.dq
    q_view, do_view, k_view, v_view = _tma_views(p, (q, do), (k, v))
    inputs = dict(q=q_view, do=do_view, k=k_view, v=v_view, lse=lse, delta=delta_, q_offsets=q_offsets,
                  kv_offsets=kv_offsets, order=sequence_order(p, config, q_offsets, kv_offsets),
                  slopes=_slopes(p, slopes))
    scales = dict(DS_SCALE=p.scale * p.out_scale)
    dkdv_outputs = dict(dk=jax.ShapeDtypeStruct(p.kv_shape, k.dtype),
                        dv=jax.ShapeDtypeStruct(p.kv_shape, v.dtype))
    # Two consumer warpgroups of 64 rows: the dk/dv program's keys (a block of 128 keys, a half each; of
    # 64 keys at D = 256, whose columns they split), the dq program's queries. K and V load by 64 rows.
    dkdv_spec, updated = spec.HOPPER_BWD_DKDV, {}
    descriptor_blocks = dict(q=(dkdv.block_m, p.head_dim), do=(dkdv.block_m, p.head_dim),
                             k=(64, p.head_dim), v=(64, p.head_dim))
    if config.fused_dq and _compat.gluon_tma_reduce():
        dkdv_spec = spec.HOPPER_BWD_DKDV_DQ_TMA
        padded = (padded_dq_rows(p, dkdv.block_m), p.num_heads * p.head_dim)
        inputs["dq_acc"] = jnp.zeros(padded, jnp.float32)
        placement = dq_rows(p, q_offsets, dkdv.block_m)
        inputs["dq_rows"] = placement[0]
        updated["dq_acc"] = jax.ShapeDtypeStruct(padded, jnp.float32)
        descriptor_blocks["dq_acc"] = (dkdv.block_m, dkdv.block_n // 2)  # a warpgroup's 64 columns of dQ
    elif config.fused_dq:
        dkdv_spec = spec.HOPPER_BWD_DKDV_DQ
        dkdv_outputs["dq_acc"] = jax.ShapeDtypeStruct(p.q_shape, jnp.float32)
    dkdv_call = _hopper_call(
        dkdv_spec, p, config, dkdv, dkdv_outputs, blocks(dkdv.block_n, p.kv_tokens, p.kv_max_seq_len),
        p.kv_tokens, dict(scales, NUM_KV_HEADS=p.num_kv_heads, OUT_SCALE=p.out_scale),
        hopper_dkdv_triton_stages(p.banded, _compat.triton_release()), descriptor_blocks, updated)
    if config.fused_dq:
        results = dict(zip(dkdv_spec.results, launch(run, dkdv_call, **inputs)))
        dq_acc = results["dq_acc"]
        if dkdv_spec is spec.HOPPER_BWD_DKDV_DQ_TMA:
            dq_acc = unpad_dq(p, dq_acc, placement)
        return dq_acc.reshape(p.q_shape).astype(q.dtype), results["dk"], results["dv"]
    dk, dv, _ = launch(run, dkdv_call, **inputs)
    dq_call = _hopper_call(
        spec.HOPPER_BWD_DQ, p, config, dq, dict(dq=jax.ShapeDtypeStruct(p.q_shape, q.dtype)),
        blocks(dq.block_m, p.q_tokens, p.max_seq_len), p.q_tokens, dict(scales, NUM_HEADS=p.num_heads),
        hopper_dq_triton_stages(p.head_dim),
        dict(q=(dq.block_m // 2, p.head_dim), do=(dq.block_m // 2, p.head_dim), k=(dq.block_n, p.head_dim),
             v=(dq.block_n, p.head_dim)))
    dq_out, _ = launch(run, dq_call, **inputs)
    return dq_out, dk, dv
