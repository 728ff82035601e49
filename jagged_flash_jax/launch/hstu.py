"""HSTU attention's kernel launches (kernels/portable/hstu.py, the Hopper forward of
kernels/hopper/hstu_forward.py and the Hopper backward of kernels/hopper/hstu_backward.py), built as
calls.py builds the softmax ones: each checked against its spec (kernels/spec.py's HSTU_FWD, HSTU_BWD,
HOPPER_HSTU_FWD, HOPPER_HSTU_BWD_DKDV, HOPPER_HSTU_BWD_DQ), runtime sizes in the params array by slot
name, constants by keyword; the portable kernels a program per (segment, sequence or zero fill, head,
slot), the Hopper kernels a persistent grid. `run` is a launcher (gpu.run, interpret.run). Semantics and array
layouts: problem.HstuProblem.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..configs import (
    HOPPER_BWD_TRITON_STAGES,
    HOPPER_CONSUMER_REGS,
    HOPPER_FWD_TRITON_STAGES,
    HOPPER_PRODUCER_REGS,
    INTERPRET_BLOCK_SIZES,
    MAX_HEAD_DIM,
    BlockSizes,
    KernelConfig,
    default_block_sizes,
    head_block,
)
from ..jagged import sequence_bounds
from ..kernels import spec
from ..problem import HstuProblem
from . import calls
from .calls import Runner, _fill_chunk, _in_units


def tiles(p: HstuProblem, interpret: bool) -> BlockSizes:
    """The default tiles: in the interpreter small, unequal ones (configs.INTERPRET_BLOCK_SIZES), so that
    tests walk several blocks in every loop; on the GPU the portable softmax kernels' tiles at the
    padded head dimension max(D, V), the inputs' bits and max_seq_len (configs.default_block_sizes).
    Those were measured for the softmax kernels (H200), not for these: a first choice until HSTU has
    entries of its own. Their programs hold tiles of the same shapes (q, k, v, do, an accumulator per
    output, three [BLOCK_M, BLOCK_N] float32 score tiles in the backward, as the softmax's p, dp, ds)."""
    if interpret:
        return INTERPRET_BLOCK_SIZES
    return default_block_sizes(max(p.head_dim, p.value_dim), jnp.dtype(p.dtype), p.max_seq_len)


def forward_slots(p: HstuProblem, tiles: BlockSizes) -> int:
    """The forward's programs per (segment, sequence or fill, head): its query blocks, then the
    tail-zeroing one."""
    return calls.blocks(tiles.fwd.block_m, p.tokens, p.max_seq_len) + 1


def backward_launches(p: HstuProblem, tiles: BlockSizes) -> tuple[calls.BackwardLaunch, ...]:
    """The backward's launches, as the softmax backward's (calls.paired_launches)."""
    return calls.paired_launches(tiles, dq=calls.blocks(tiles.dq.block_m, p.tokens, p.max_seq_len) + 1,
                                 dkdv=calls.blocks(tiles.dkdv.block_n, p.tokens, p.max_seq_len) + 1)


def _sequence_heads(p: HstuProblem) -> int:
    return p.num_segments * (p.batch + 1) * p.num_heads


def grid_error(p: HstuProblem, tiles: BlockSizes) -> str | None:
    """Why a launch would need more programs than CUDA's grid allows, or None."""
    launches = [("forward", forward_slots(p, tiles))]
    launches += [("backward", launch.slots) for launch in backward_launches(p, tiles)]
    return calls.programs_error(launches, _sequence_heads(p), p.num_heads)


def addressing_error(p: HstuProblem) -> str | None:
    """Why the kernels cannot address the problem's sequences (row offsets within one are int32: up to
    the longest attended sequence and a block more, a token stride apart), or None."""
    longest = min(p.max_seq_len, p.tokens)
    for name, dim in (("D", p.head_dim), ("V", p.value_dim)):
        stride = p.strides(dim)[0]
        if (longest + MAX_HEAD_DIM) * stride > calls.MAX_SEQUENCE_ELEMENTS:
            return (f"max_seq_len * {'H * ' if p.layout == 'THD' else ''}{name} = {longest * stride} "
                    "elements in one sequence (at most its tokens) is more than the kernels address "
                    "(< 2**31)")
    return None


def _grid(p: HstuProblem, slots: int) -> tuple[int, ...]:
    """The grid of a kernel with `slots` programs per (segment, sequence or fill, head): one axis (each
    sequence's programs next to each other, see kernels.portable.memory.program) when q, k, v outgrow
    half of an L2 or the slots CUDA's second grid dimension, else two."""
    elements = p.num_segments * p.tokens * p.num_heads * (2 * p.head_dim + p.value_dim)
    if elements * p.itemsize > calls.L2_REUSE_BYTES or slots > calls.MAX_GRID_Y:
        return (_sequence_heads(p) * slots,)
    return (_sequence_heads(p), slots)


def _common(p: HstuProblem, slots: int, programs_per_kind: int) -> tuple[dict, dict]:
    """The runtime parameters (kernels/spec.py's HSTU_PARAMS) and the constants both kernels share, for a
    launch of `slots` programs per (segment, sequence or fill, head), `programs_per_kind` of each kind."""
    align, (qk_token, qk_head, v_token, v_head) = _in_units(*p.strides(p.head_dim), *p.strides(p.value_dim))
    shared_rows = p.offsets_rows == 1
    params = dict(
        batch=p.batch, tokens=p.tokens, qk_token_stride=qk_token, qk_head_stride=qk_head,
        v_token_stride=v_token, v_head_stride=v_head, offsets_stride=0 if shared_rows else p.batch + 1,
        targets_stride=0 if shared_rows else p.batch, fill_chunk=_fill_chunk(p.tokens, programs_per_kind),
        slots=slots)
    constants = dict(
        NUM_HEADS=p.num_heads, D=p.head_dim, BLOCK_D=head_block(p.head_dim), V=p.value_dim,
        BLOCK_V=head_block(p.value_dim), MAX_LEN=p.max_seq_len, ALPHA=float(p.alpha),
        SCALE=1.0 if p.scale is None else float(p.scale), TOKEN_SCALE=p.scale is None, CAUSAL=p.causal,
        MAX_ATTN_LEN=p.max_attn_len, CONTEXT_LEN=p.contextual_seq_len, MIN_FULL_LEN=p.min_full_attn_seq_len,
        HAS_TARGETS=p.has_targets, INPUT_PRECISION=p.input_precision, STRIDE_ALIGN=align,
        FILL_BLOCK=calls.FILL_BLOCK)
    return params, constants


def _rows(p: HstuProblem, offsets, num_targets, scale_tokens) -> dict:
    """The kernels' offsets, num_targets and scale operands: a one-element placeholder, never read, for
    num_targets without targets and for the scale when it is a constant."""
    if (num_targets is None) == p.has_targets:
        raise ValueError(f"num_targets must be given exactly when has_targets ({p.has_targets})")
    if (scale_tokens is None) == (p.scale is None):
        raise ValueError(f"scale_tokens must be given exactly when the problem's scale is None ({p.scale})")
    return dict(offsets=offsets,
                num_targets=num_targets if p.has_targets else jnp.zeros((1,), jnp.int32),
                scale=jnp.zeros((1,), jnp.float32) if scale_tokens is None else scale_tokens)


def forward(run: Runner, p: HstuProblem, tiles: BlockSizes, q, k, v, offsets, num_targets, scale_tokens):
    """o (p.shape(V), q's dtype, zero where no query is attended) by kernels.hstu_fwd_kernel. offsets
    [rows, B+1] int32 or int64, num_targets [rows, B] int32 (None without targets), scale_tokens [Z*T]
    float32 (None when p.scale is a constant)."""
    if p.empty:
        return jnp.zeros(p.shape(p.value_dim), q.dtype)
    rows = _rows(p, offsets, num_targets, scale_tokens)
    slots = forward_slots(p, tiles)
    params, constants = _common(p, slots, slots)
    call = calls.kernel_call(
        spec.HSTU_FWD, grid=_grid(p, slots),
        outputs=dict(o=jax.ShapeDtypeStruct(p.shape(p.value_dim), q.dtype)), params=params,
        constants=dict(constants, BLOCK_M=tiles.fwd.block_m, BLOCK_N=tiles.fwd.block_n), config=tiles.fwd)
    (o,) = calls.launch(run, call, q=q, k=k, v=v, **rows)
    return o


def _empty_gradients(p: HstuProblem, q, k, v) -> tuple:
    """(dq, dk, dv, dscale) of a problem without tokens: zeros (dscale None with a constant scale)."""
    grads = (jnp.zeros(p.shape(p.head_dim), q.dtype), jnp.zeros(p.shape(p.head_dim), k.dtype),
             jnp.zeros(p.shape(p.value_dim), v.dtype))
    return (*grads, jnp.zeros((p.num_segments, p.num_heads, p.tokens), jnp.float32) if p.scale is None
            else None)


def backward(run: Runner, p: HstuProblem, tiles: BlockSizes, q, k, v, offsets, num_targets, scale_tokens, do):
    """(dq, dk, dv, dscale) by kernels.hstu_bwd_kernel (dq and dk/dv programs in one launch or two, see
    `backward_launches`), in q's, k's and v's dtypes; dscale float32 [Z, H, T], each head's share of
    the per-token scale's gradient, which the op sums (None when p.scale is a constant). Operands as
    `forward`'s, do as o."""
    token_scale = p.scale is None
    if p.empty:
        return _empty_gradients(p, q, k, v)
    rows = _rows(p, offsets, num_targets, scale_tokens)
    shapes = dict(dq=jax.ShapeDtypeStruct(p.shape(p.head_dim), q.dtype),
                  dk=jax.ShapeDtypeStruct(p.shape(p.head_dim), k.dtype),
                  dv=jax.ShapeDtypeStruct(p.shape(p.value_dim), v.dtype),
                  dscale=jax.ShapeDtypeStruct((p.num_segments * p.tokens, p.num_heads), jnp.float32))
    grads = {}
    for one in backward_launches(p, tiles):
        written = set(one.grads) | ({"dscale"} if token_scale and "dq" in one.grads else set())
        params, constants = _common(p, one.slots, one.programs_per_kind)
        call = calls.kernel_call(
            spec.HSTU_BWD, grid=_grid(p, one.slots),
            # The outputs a launch does not write are one-element placeholders it never touches.
            outputs={name: shape if name in written else jax.ShapeDtypeStruct((1,), shape.dtype)
                     for name, shape in shapes.items()},
            params=params,
            constants=dict(constants, DKDV_BLOCK_M=tiles.dkdv.block_m, DKDV_BLOCK_N=tiles.dkdv.block_n,
                           DQ_BLOCK_M=tiles.dq.block_m, DQ_BLOCK_N=tiles.dq.block_n,
                           DQ_PROGRAMS="dq" in one.grads, DKDV_PROGRAMS="dk" in one.grads),
            config=one.config)
        outputs = calls.launch(run, call, q=q, k=k, v=v, do=do, **rows)
        grads.update((name, x) for name, x in zip(shapes, outputs) if name in written)
    d_scale = None
    if token_scale:  # [Z*T, H] -> [Z, H, T], as the other implementations give it
        d_scale = jnp.swapaxes(grads["dscale"].reshape(p.num_segments, p.tokens, p.num_heads), 1, 2)
    return grads["dq"], grads["dk"], grads["dv"], d_scale


# ---------------------------------------------------------------------------------------------------
# The Hopper kernels (kernels/hopper/hstu_forward.py, hstu_backward.py): persistent, TMA descriptors, one
# offsets segment
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperHstuConfig:
    """The Hopper forward's configuration: its tile (configs.HSTU_HOPPER_FWD_TILE: BLOCK_M = 128 queries,
    two consumer warpgroups', BLOCK_N keys, num_stages the depth of its key and value ring,
    max_registers the cap setmaxnreg redistributes), the persistent grid's programs (one per SM) and
    whether the kernel takes the sequences longest first (`sequence_order`; else in the offsets' order)."""

    tile: KernelConfig
    programs: int
    longest_first: bool = False


@dataclasses.dataclass(frozen=True)
class HopperHstuBackwardConfig:
    """The Hopper backward's configuration: the dk/dv kernel's tile (configs.HSTU_HOPPER_BWD_DKDV_TILE:
    BLOCK_N = 128 keys, two consumer warpgroups', BLOCK_M queries per ring tile, num_stages the ring's
    depth), the dq kernel's (configs.HSTU_HOPPER_BWD_DQ_TILE, as the forward's), the persistent grids'
    programs (one per SM) and whether they take the sequences longest first (`sequence_order`)."""

    dkdv: KernelConfig
    dq: KernelConfig
    programs: int
    longest_first: bool = False


def _hopper_call(kernel_spec: spec.KernelSpec, p: HstuProblem, config, tile: KernelConfig, blocks_: int,
                 outputs: dict, triton_stages: int, descriptor_blocks: dict) -> calls.KernelCall:
    """A persistent Hopper HSTU launch of one offsets segment: config.programs programs (config a
    HopperHstuConfig or HopperHstuBackwardConfig), which take the `blocks_` blocks per (sequence, head)
    from a counter (the last output, which the launch zeroes) after their share of the zero fills (the
    tokens no sequence covers in blocks + 1 chunks per head), the sequences longest first with
    config.longest_first (ORDERED), with the portable kernels' parameters and constants (`_common`) less
    the padded dimensions and the precision."""
    params, constants = _common(p, blocks_, blocks_ + 1)
    return calls.kernel_call(
        kernel_spec, grid=(config.programs,),
        outputs=dict(outputs, counter=jax.ShapeDtypeStruct((1,), jnp.int32)),
        params={name: blocks_ if name == "blocks" else params[name] for name in kernel_spec.params},
        constants=dict({name: constants[name] for name in kernel_spec.constants if name in constants},
                       BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, STAGES=tile.num_stages,
                       CONSUMER_REGS=HOPPER_CONSUMER_REGS, PRODUCER_REGS=HOPPER_PRODUCER_REGS,
                       ORDERED=config.longest_first),
        config=tile, num_stages=triton_stages, blocks=descriptor_blocks)


def sequence_order(p: HstuProblem, longest_first: bool, offsets) -> jax.Array:
    """The order the Hopper HSTU kernels take the sequences in (their `order` input, as the softmax
    ones'): with longest_first calls.work_order of their lengths n, clamped as the kernels clamp them,
    each n x n; else calls.no_order, the lengths not computed."""
    if not longest_first:
        return calls.no_order()
    _, n = sequence_bounds(offsets.reshape(-1)[:p.batch + 1], p.tokens, p.max_seq_len)
    return calls.work_order(n, n)


def _one_segment(p: HstuProblem, what: str) -> None:
    if p.num_segments != 1:
        raise ValueError(f"the Hopper HSTU {what} takes one offsets segment, got {p.num_segments}")


def _views(p: HstuProblem, qk_like, v_like) -> tuple:
    """The 2-D views the TMA descriptors cover, rows one token stride long (a token in "THD", a (head,
    token) in "HTD"): the arrays of D (q, k), then those of V (v, do)."""
    qk_token_stride, v_token_stride = p.strides(p.head_dim)[0], p.strides(p.value_dim)[0]
    return (*(x.reshape(-1, qk_token_stride) for x in qk_like),
            *(x.reshape(-1, v_token_stride) for x in v_like))


def hopper_forward(run: Runner, p: HstuProblem, config: HopperHstuConfig, q, k, v, offsets, num_targets,
                   scale_tokens):
    """o (p.shape(V), q's dtype, zero where no query is attended) by kernels.hopper_hstu_fwd_kernel: q,
    k, v as TMA descriptors over 2-D views whose rows are one token stride long (calls.py's Hopper
    launches'), the query blocks of the portable forward (`blocks` per (sequence, head)) on a persistent
    grid, with the portable forward's parameters and constants (`_common`) for one offsets segment.
    Operands as `forward`'s."""
    if p.empty:
        return jnp.zeros(p.shape(p.value_dim), q.dtype)
    _one_segment(p, "forward")
    rows = _rows(p, offsets, num_targets, scale_tokens)
    tile = config.tile
    call = _hopper_call(
        spec.HOPPER_HSTU_FWD, p, config, tile, calls.blocks(tile.block_m, p.tokens, p.max_seq_len),
        dict(o=jax.ShapeDtypeStruct(p.shape(p.value_dim), q.dtype)), HOPPER_FWD_TRITON_STAGES,
        # The query tile is one consumer warpgroup's 64 rows.
        dict(q=(tile.block_m // 2, p.head_dim), k=(tile.block_n, p.head_dim), v=(tile.block_n, p.value_dim)))
    q_view, k_view, v_view = _views(p, (q, k), (v,))
    o, _ = calls.launch(run, call, q=q_view, k=k_view, v=v_view,
                        order=sequence_order(p, config.longest_first, offsets), **rows)
    return o


def hopper_backward(run: Runner, p: HstuProblem, config: HopperHstuBackwardConfig, q, k, v, offsets,
                    num_targets, scale_tokens, do):
    """(dq, dk, dv, dscale) as `backward` gives them, by the Hopper backward: a launch of
    kernels.hopper_hstu_bwd_dkdv_kernel (blocks of 128 keys, each over the query tiles that may see them)
    and one of kernels.hopper_hstu_bwd_dq_kernel (blocks of 128 queries, and with a per-token scale each
    head's share of its gradient, dscale [T, H] float32 zeroed by the launch), each persistent, q, do, k,
    v as TMA descriptors over the forward's 2-D views. Operands as `forward`'s, do as o."""
    if p.empty:
        return _empty_gradients(p, q, k, v)
    _one_segment(p, "backward")
    rows = _rows(p, offsets, num_targets, scale_tokens)
    q_view, k_view, do_view, v_view = _views(p, (q, k), (do, v))
    inputs = dict(q=q_view, do=do_view, k=k_view, v=v_view,
                  order=sequence_order(p, config.longest_first, offsets), **rows)
    dkdv, dq = config.dkdv, config.dq
    # Two consumer warpgroups of 64 rows: the dk/dv kernel's keys (K and V loaded in halves), the dq
    # kernel's queries (Q and dO likewise).
    dkdv_call = _hopper_call(
        spec.HOPPER_HSTU_BWD_DKDV, p, config, dkdv,
        calls.blocks(dkdv.block_n, p.tokens, p.max_seq_len),
        dict(dk=jax.ShapeDtypeStruct(p.shape(p.head_dim), k.dtype),
             dv=jax.ShapeDtypeStruct(p.shape(p.value_dim), v.dtype)), HOPPER_BWD_TRITON_STAGES,
        dict(q=(dkdv.block_m, p.head_dim), do=(dkdv.block_m, p.value_dim), k=(dkdv.block_n // 2, p.head_dim),
             v=(dkdv.block_n // 2, p.value_dim)))
    dk, dv, _ = calls.launch(run, dkdv_call, **inputs)
    token_scale = p.scale is None
    dq_call = _hopper_call(
        spec.HOPPER_HSTU_BWD_DQ, p, config, dq, calls.blocks(dq.block_m, p.tokens, p.max_seq_len),
        dict(dq=jax.ShapeDtypeStruct(p.shape(p.head_dim), q.dtype),
             # (a one-element placeholder without a per-token scale, never touched)
             dscale=jax.ShapeDtypeStruct((p.tokens, p.num_heads) if token_scale else (1,), jnp.float32)),
        HOPPER_BWD_TRITON_STAGES,
        dict(q=(dq.block_m // 2, p.head_dim), do=(dq.block_m // 2, p.value_dim), k=(dq.block_n, p.head_dim),
             v=(dq.block_n, p.value_dim)))
    dq_out, d_scale, _ = calls.launch(run, dq_call, **inputs)
    if token_scale:  # [T, H] -> [1, H, T], as the other implementations give it
        d_scale = jnp.swapaxes(d_scale.reshape(1, p.tokens, p.num_heads), 1, 2)
    else:
        d_scale = None
    return dq_out, dk, dv, d_scale
