"""HSTU attention (the attention of generative recommenders' HSTU layers): its arguments checked
(checks.py), its plan chosen (select.py), and its one custom_vjp over every implementation.

No softmax: o_i = s_i * sum_j mask_ij * silu(alpha * q_i . k_j) * v_j, with HSTU's mask (causal, targets,
a local window, a contextual prefix). Without a running max or a log-sum-exp to keep, the backward needs
only the inputs (and the output's cotangent): the forward saves no residual of its own.
"""

from __future__ import annotations

import functools

import jax

from . import checks, select, transforms
from ._compat import varying_axes
from .checks import LAYOUTS
from .configs import BlockSizes
from .implementations import HSTU_IMPLEMENTATIONS
from .problem import HstuProblem
from .select import Plan

FORWARD_MODE_ERROR = (
    "hstu_attention has a custom reverse-mode rule (its backward kernels) and does not support "
    "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize); use jax.grad / jax.vjp, or "
    "jagged_flash_jax.hstu_attention_reference (dense, O(L^2) memory) for forward mode")
SECOND_ORDER_ERROR = (
    "hstu_attention's kernels have no derivative of their own, so second-order autodiff (jax.hessian, "
    "jax.jacfwd or jax.jvp of jax.grad, jax.grad of jax.grad) is not supported; use "
    "jagged_flash_jax.hstu_attention_reference (dense, O(L^2) memory) for higher derivatives")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _hstu(q, k, v, offsets, num_targets, scale, problem: HstuProblem, plan: Plan):
    return _forward(problem, plan, q, k, v, offsets, num_targets, scale)


def _hstu_fwd(q, k, v, offsets, num_targets, scale, problem: HstuProblem, plan: Plan):
    o = _forward(problem, plan, q, k, v, offsets, num_targets, scale)
    return o, (q, k, v, offsets, num_targets, scale)


def _hstu_bwd(problem: HstuProblem, plan: Plan, residuals, do):
    q, k, v, offsets, num_targets, scale = residuals
    dq, dk, dv, dscale = _backward(problem, plan, q, k, v, offsets, num_targets, scale, do.astype(q.dtype))
    if dscale is not None:  # each head's share [Z, H, T], summed here (where partitioning left the heads)
        dscale = dscale.sum(axis=1).reshape(-1)
        # Under shard_map with the heads split, each device holds its heads' share: the scale's, replicated
        # there, is their sum.
        split = tuple(sorted(varying_axes(dscale) - varying_axes(scale)))
        if split:
            dscale = jax.lax.psum(dscale, split)
    return dq, dk, dv, None, None, dscale


# As api.py's: neither pass has a derivative of its own, and a second differentiation says so.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(problem: HstuProblem, plan: Plan, q, k, v, offsets, num_targets, scale):
    (o,) = transforms.forward(transforms.HSTU, problem, plan, q=q, k=k, v=v, offsets=offsets,
                              num_targets=num_targets, scale=scale)
    return o


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _backward(problem: HstuProblem, plan: Plan, q, k, v, offsets, num_targets, scale, do):
    return transforms.backward(transforms.HSTU, problem, plan, q=q, k=k, v=v, offsets=offsets,
                               num_targets=num_targets, scale=scale, do=do)


def _no_second_order(problem, plan, primals, tangents):
    raise TypeError(SECOND_ORDER_ERROR)


_forward.defjvp(_no_second_order)
_backward.defjvp(_no_second_order)
_hstu.defvjp(_hstu_fwd, _hstu_bwd)


def hstu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets,
    max_seq_len: int,
    *,
    alpha: float,
    causal: bool = True,
    num_targets=None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
    attn_scale=None,
    layout: str = "THD",
    backend: str = "auto",
    implementation: str | tuple[str, ...] | None = None,
    backward_implementation: str | tuple[str, ...] | None = None,
    allow_tf32: bool = True,
    block_sizes: BlockSizes | None = None,
    validate: bool = False,
) -> jax.Array:
    """HSTU attention over jagged sequences: generative-recommenders' `hstu_mha` (its PyTorch reference
    `pytorch_hstu_mha`), forward and backward.

    Sequence b is the tokens offsets[b]:offsets[b+1], n_b of them. Its first min(n_b, max_seq_len) tokens
    get o_i = s_i * sum_j m_ij * silu(alpha * q_i . k_j) * v_j (no softmax, no normalisation), where s_i
    is 1 / max_seq_len, or attn_scale, and m_ij HSTU's mask on positions within the sequence
    (`jagged_flash_jax.reference.hstu_mask` says it exactly): the diagonal; causal, j < i (else every
    j); the last num_targets[b] tokens are targets, whose position ids are clamped to the history's end
    (each sees the history and itself, not the other targets); max_attn_len > 0, a local window on the
    clamped ids, lifted for the last min_full_attn_seq_len rows; contextual_seq_len, a prefix that every
    row sees and that sees every row. Every other token gets output 0 and gradient 0.

    Args:
      q, k: [T, H, D] (layout "THD") or [H, T, D] ("HTD"); v: [T, H, V] (or [H, T, V]), V may differ
        from D. One dtype among float32, bfloat16, float16.
      offsets: [B+1] int32 or int64, non-decreasing within [0, T] (checked when concrete; traced ones
        with validate=True, as jagged_attention's); [shards, B+1] for a data-parallel batch.
      max_seq_len: static int >= 1.
      alpha: static float, multiplying q . k before silu.
      causal: HSTU's causal mask (True, as hstu_mha requires) or every key of the sequence.
      num_targets: None or int [B] (per sequence, [shards, B] with sharded offsets): each sequence's
        trailing target tokens, in [0, n_b].
      max_attn_len, contextual_seq_len, min_full_attn_seq_len: static ints >= 0, as hstu_mha's.
      attn_scale: None (1 / max_seq_len), a static float, or an array: a scalar or [T] (one factor per
        query token), differentiated.
      layout, backend, implementation, backward_implementation, allow_tf32, block_sizes, validate: as for
        `jagged_attention`; the implementations are "portable", "interpret", "xla" and "hstu-hopper"
        (the Hopper forward for 16-bit inputs, D and V in (64, 128) and one offsets segment, on sm_90a;
        backend="auto" chooses it there from 1024 tokens; its backward runs the Hopper dk/dv and dq
        kernels where they take the problem, else the portable one's).

    Returns:
      o: [T, H, V] (or [H, T, V]), q's dtype. Differentiable (reverse mode) in q, k, v and an array
      attn_scale; forward mode and second order raise TypeError.
    """
    max_seq_len = checks.static_int(max_seq_len, "max_seq_len")
    offsets = checks.as_offsets(offsets, "offsets")
    num_targets = checks.as_num_targets(num_targets, offsets)
    checks.check_array(q, "q", layout if layout in LAYOUTS else "THD")
    tokens = checks.split(q.shape, layout if layout in LAYOUTS else "THD")[0]
    scale, scale_tokens = checks.hstu_scale(attn_scale, max_seq_len, tokens)
    problem = checks.hstu_problem(
        q, k, v, offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha, causal=causal,
        max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len, scale=scale, layout=layout,
        allow_tf32=checks.static_bool(allow_tf32, "allow_tf32"),
        validate=checks.static_bool(validate, "validate"))
    request = select.request(backend, implementation, backward_implementation, block_sizes,
                             registry=HSTU_IMPLEMENTATIONS)
    plan = select.choose(problem, request)
    # Offsets (and targets) as [rows, ...], the kernels' form (a free reshape).
    offsets = offsets if offsets.ndim == 2 else offsets[None]
    if num_targets is not None:
        num_targets = num_targets if num_targets.ndim == 2 else num_targets[None]
    try:
        return _hstu(q, k, v, offsets, num_targets, scale_tokens, problem, plan)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise TypeError(FORWARD_MODE_ERROR) from err
