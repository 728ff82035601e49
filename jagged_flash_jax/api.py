"""The public softmax ops: their arguments checked (checks.py), the plan chosen (select.py), and the one
custom_vjp that serves every implementation.

`jagged_attention` has the standard semantics (scale, causal, GQA/MQA, cross-attention, a sliding
window, logit soft-capping, ALiBi); `multi_head_jagged_flash_attention` is FBGEMM's op (no scale, output
divided by max_seq_len), a thin call into the same path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from . import checks, select, transforms
from .checks import LAYOUTS
from .configs import BlockSizes
from .jagged import attended_tokens
from .problem import Problem
from .select import Plan

# Names of the residuals, for remat policies (jax.checkpoint_policies.save_only_these_names).
RESIDUAL_NAMES = ("jagged_attention_out", "jagged_attention_lse")

FORWARD_MODE_ERROR = (
    "jagged attention has a custom reverse-mode rule (its backward kernels) and does not support "
    "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize); use jax.grad / jax.vjp, or "
    "jagged_flash_jax.jagged_attention_reference (dense, O(L^2) memory) for forward mode")
SECOND_ORDER_ERROR = (
    "jagged attention's kernels have no derivative of their own, so second-order autodiff "
    "(jax.hessian, jax.jacfwd or jax.jvp of jax.grad, jax.grad of jax.grad) is not supported; use "
    "jagged_flash_jax.jagged_attention_reference (dense, O(L^2) memory) for higher derivatives")


# ---------------------------------------------------------------------------------------------------
# The one custom_vjp
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, q_offsets, kv_offsets, slopes, problem: Problem, plan: Plan):
    """o and the log-sum-exp residual [Z, H, T_q] (units of the unscaled scores; see `_user_lse`)."""
    return _forward(problem, plan, q, k, v, q_offsets, kv_offsets, slopes)


def _attention_fwd(q, k, v, q_offsets, kv_offsets, slopes, problem: Problem, plan: Plan):
    # symbolic_zeros=True: the primals come wrapped (CustomVJPPrimal), all but the static problem.
    q, k, v, q_offsets, kv_offsets, slopes = jax.tree.map(lambda x: x.value,
                                                          (q, k, v, q_offsets, kv_offsets, slopes))
    o, lse = _forward(problem, plan, q, k, v, q_offsets, kv_offsets, slopes)
    o = checkpoint_name(o, RESIDUAL_NAMES[0])
    lse = checkpoint_name(lse, RESIDUAL_NAMES[1])
    return (o, lse), (q, k, v, q_offsets, kv_offsets, o, lse, slopes)


def _attention_bwd(problem: Problem, plan: Plan, residuals, cotangents):
    q, k, v, q_offsets, kv_offsets, o, lse, slopes = residuals
    do, dlse = cotangents
    # Symbolic zeros: a caller who never reads the log-sum-exp (return_lse=False, or a loss without
    # it) runs the backward exactly as without it, with no extra operand or subtraction.
    do = jnp.zeros_like(o) if isinstance(do, SymbolicZero) else do.astype(q.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse.astype(jnp.float32)
    dq, dk, dv = _backward(problem, plan, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse)
    # The ALiBi slopes get no gradient (as in FlashAttention): a zero cotangent.
    return dq, dk, dv, None, None, None


# Neither the forward nor the backward implementations have a derivative of their own; only a second
# differentiation reaches them with tangents (the outer one of jax.hessian, jacfwd(grad), grad(grad)
# traces the inner one's forward and backward). A custom_jvp whose rule raises the library's error
# gives them that error, at trace time, under jit too, rather than JAX's missing rule for
# custom_partitioning. Without tangents (first order) the rule is never called.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward(problem: Problem, plan: Plan, q, k, v, q_offsets, kv_offsets, slopes):
    return transforms.forward(transforms.SOFTMAX, problem, plan, q=q, k=k, v=v, q_offsets=q_offsets,
                              kv_offsets=kv_offsets, slopes=slopes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _backward(problem: Problem, plan: Plan, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
    return transforms.backward(transforms.SOFTMAX, problem, plan, q=q, k=k, v=v, q_offsets=q_offsets,
                               kv_offsets=kv_offsets, o=o, lse=lse, do=do, slopes=slopes, dlse=dlse)


def _no_second_order(problem, plan, primals, tangents):
    raise TypeError(SECOND_ORDER_ERROR)


_forward.defjvp(_no_second_order)
_backward.defjvp(_no_second_order)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _call(q, k, v, q_offsets, kv_offsets, problem: Problem, plan: Plan, slopes=None):
    # Offsets as [rows, B+1], the kernels' form (a free reshape).
    q_offsets, kv_offsets = (x if x.ndim == 2 else x[None] for x in (q_offsets, kv_offsets))
    # jax.jvp and jax.jacfwd fail here, as the custom_vjp is traced. Under jax.jit of jax.jvp, and when
    # the function jax.linearize returns is applied, JAX fails later (at lowering, or evaluation) with
    # its own "can't apply forward-mode autodiff (jvp) to a custom_vjp function": no hook reaches that
    # (a linear_call tangent would, but it has no vmap rule in jax 0.10).
    try:
        return _attention(q, k, v, q_offsets, kv_offsets, slopes, problem, plan)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise TypeError(FORWARD_MODE_ERROR) from err


def _user_lse(lse, q_offsets, problem: Problem):
    """The residual [Z, H, T] (unscaled units, +inf without keys, unwritten where no query attends) as
    the natural log-sum-exp of the scaled scores, laid out like q's token and head axes: [Z*T, H]
    ("THD") or [H, Z*T] ("HTD"); -inf, the log of an empty sum, for rows without keys and for tokens no
    query attends; NaN where the inputs made it NaN. Plain JAX after the custom_vjp, so JAX carries the
    cotangent through the scale and the mask (zero where -inf), and the unwritten entries are selected
    away, never read into a value."""
    rows = jnp.broadcast_to(q_offsets.reshape(-1, q_offsets.shape[-1]),
                            (problem.num_segments, q_offsets.shape[-1]))
    attended = jax.vmap(lambda o: attended_tokens(o, problem.q_tokens, problem.max_seq_len))(rows)
    keep = attended[:, None, :] & (lse != jnp.inf)  # [Z, H, T]
    lse = jnp.where(keep, problem.scale * lse, -jnp.inf)
    if problem.layout == "THD":
        return jnp.swapaxes(lse, 1, 2).reshape(-1, problem.num_heads)
    return jnp.swapaxes(lse, 0, 1).reshape(problem.num_heads, -1)


def _plan(problem: Problem, backend, implementation, backward_implementation, block_sizes,
          deterministic) -> Plan:
    request = select.request(backend, implementation, backward_implementation, block_sizes,
                             deterministic=checks.static_bool(deterministic, "deterministic"))
    return select.choose(problem, request)


# ---------------------------------------------------------------------------------------------------
# The public ops
# ---------------------------------------------------------------------------------------------------


def jagged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets,
    max_seq_len: int,
    *,
    kv_offsets=None,
    kv_max_seq_len: int | None = None,
    scale: float | None = None,
    causal: bool = False,
    layout: str = "THD",
    backend: str = "auto",
    allow_tf32: bool = True,
    block_sizes: BlockSizes | None = None,
    validate: bool = False,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    backward_implementation: str | tuple[str, ...] | None = None,
    deterministic: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Variable-length (jagged) multi-head attention with the standard semantics.

    Sequence b has queries offsets[b]:offsets[b+1] and keys kv_offsets[b]:kv_offsets[b+1]. With
    n_q = min(len_q, max_seq_len) and n_k = min(len_kv, kv_max_seq_len), query i < n_q gets
    softmax(scale * q_i k^T) v over the keys j < n_k (causal: j <= i + n_k - n_q, bottom-right
    aligned as in FlashAttention 2.1+ and cuDNN). A query with no key to attend gets 0; tokens past
    n_q, or outside offsets, get output 0 and gradient 0.

    Args:
      q: [T_q, H, D] (layout "THD", as projections give) or [H, T_q, D] ("HTD").
      k, v: [T_kv, H_kv, D] (or [H_kv, T_kv, D]); H a multiple of H_kv (GQA; H_kv = 1 is MQA). One
        dtype among float32, bfloat16, float16; D <= 256 for the kernels (the "xla" implementation
        takes any D).
      offsets: [B+1] int32 or int64 (a list or NumPy array works), non-decreasing within [0, T_q].
        [shards, B+1] offsets, local to each of `shards` equal slices of the token axis, describe a
        data-parallel batch (see `pack_data_parallel`). Concrete offsets (not traced) are checked
        here, and raise ValueError if malformed; traced ones are checked only with `validate=True`
        (malformed traced offsets never make a kernel leave its arrays: they give finite values). With
        x64 disabled, int64 values outside int32 raise when concrete; traced offsets are already int32
        then, as JAX converted them.
      max_seq_len: static int >= 1: queries past it in a sequence are not attended. Under jax.jit,
        mark it static (static_argnums / static_argnames, or functools.partial).
      kv_offsets: offsets of k and v (cross-attention); None means `offsets` (self-attention).
      kv_max_seq_len: static bound on attended keys; None means max_seq_len.
      scale: static float multiplying q k^T, a normal float32 with scale * log2(e) finite
        (1.18e-38 <= scale <= 2.36e38); None means 1 / sqrt(D).
      causal: bottom-right aligned causal mask.
      layout: "THD" (default) or "HTD".
      backend: where it runs: "triton" (the GPU kernels via jax-triton: the Hopper kernels where they
        run and are faster, else the portable ones), "interpret" (the portable kernels in Triton's
        interpreter on the CPU), "xla" (blockwise pure JAX, any device), or "auto" ("triton" on a GPU
        with jax-triton, falling through to "xla" for what no kernel supports; else "xla").
      allow_tf32: float32 only: whether the GPU matrix products may use TF32 (with D > 32 the
        forward then reads a transposed copy of v, made once per call, and at D in (64, 128] the
        backward transposed copies of q and the output gradient).
      block_sizes: tile configuration of the portable Triton kernels; None picks a tuned default, its
        blocks cut to the sequence lengths. dq and dk/dv tiles with different warps or stages run in
        separate launches. The Hopper kernels take theirs from the table's "hopper" entries
        (configs.py; $JAGGED_FLASH_JAX_TUNED_CONFIGS overrides entries).
      validate: also check traced offsets (non-decreasing within [0, T]), with
        `jax.experimental.checkify.check`. The caller functionalizes the check, as for any checkify
        check: `err, out = checkify.checkify(jax.jit(f))(...)`, then `err.throw()` or `err.get()`.
        The op does not wrap itself, so that the error composes with the caller's jit, vmap, grad
        and other checks, and stays a value under their control; without the wrapper, jax.jit
        refuses the unfunctionalized check at trace time, which says so.
      window: (left, right), static ints >= 0 or None: a sliding window. Query i, at key position
        i + n_k - n_q (bottom-right aligned, as causal), sees the keys j with
        i + n_k - n_q - left <= j <= i + n_k - n_q + right; None is no bound on that side. With
        causal=True the right bound is 0 (the intersection). The kernels skip the key blocks outside
        every query's band, so the cost grows with the window, not with the sequence length.
      softcap: static float > 0 or None: logit soft-capping, as in FlashAttention (Gemma 2): the scaled
        scores s = scale * q k^T become softcap * tanh(s / softcap) before the softmax (and ALiBi).
      alibi_slopes: [H] float array (float32 in the kernels) or None: ALiBi, adding
        -alibi_slopes[h] * |i + n_k - n_q - j| to the (scaled, capped) scores of query head h. An
        operand (it may be traced), but not differentiated, as in FlashAttention: its gradient is 0.
      return_lse: also return the log-sum-exp of each query's scaled scores (see Returns).
      implementation: what runs, instead of `backend`'s choice: "hopper" (the Hopper kernels),
        "portable" (the portable kernels on the GPU), "interpret" or "xla", or a sequence of them, the
        first that supports the problem running (jagged_flash_jax.select); one name that cannot run
        the problem raises ValueError saying why. Also the backward's, unless
        `backward_implementation` names the backward's.
      backward_implementation: the backward's, as `implementation`; also "hopper-fused-dq", the Hopper
        backward with dq added from the dk/dv kernel by float32 atomics (one launch instead of two; dq's
        last bits vary run to run). Every other backward writes each gradient element once (bitwise
        reproducible).
      deterministic: static bool. True (the default): the backward is bitwise reproducible. False, as
        FlashAttention's deterministic=False: `backend`'s choice may take "hopper-fused-dq", which it
        does where that measured faster (Triton >= 3.7, sequences of 8192 tokens or more, D = 128: on
        the H200 about 5% off a training step). Not with `implementation` or
        `backward_implementation` (ValueError): name the backward there instead.

    Returns:
      The output, with the shape and dtype of q. Differentiable (reverse mode) in q, k and v; forward
      mode and second order raise TypeError. With return_lse=True, the pair (output, lse): lse is
      float32 [T_q, H] ("THD") or [H, T_q] ("HTD"), the natural log of sum_j exp(scale * q_i . k_j)
      over the keys query i attends, -inf (the log of an empty sum) for a query with no key and for
      the tokens no query attends (past max_seq_len, outside offsets). It is differentiable too (its
      cotangent flows into the backward), and merges partial results: see `merge_attention`.
    """
    max_seq_len = checks.static_int(max_seq_len, "max_seq_len")
    return_lse = checks.static_bool(return_lse, "return_lse")
    kv_max_seq_len = (max_seq_len if kv_max_seq_len is None
                      else checks.static_int(kv_max_seq_len, "kv_max_seq_len"))
    offsets = checks.as_offsets(offsets, "offsets")
    self_attention = kv_offsets is None
    kv_offsets = offsets if self_attention else checks.as_offsets(kv_offsets, "kv_offsets")
    checks.check_array(q, "q", layout if layout in LAYOUTS else "THD")
    heads = checks.split(q.shape, layout if layout in LAYOUTS else "THD")[1]
    scale = checks.static_scale(scale, q.shape[-1])
    slopes = checks.as_slopes(alibi_slopes, heads, offsets.shape[0] if offsets.ndim == 2 else 1, scale)
    problem = checks.attention_problem(
        q, k, v, offsets, kv_offsets, max_seq_len=max_seq_len, kv_max_seq_len=kv_max_seq_len, scale=scale,
        out_scale=1.0, causal=checks.static_bool(causal, "causal"), layout=layout,
        allow_tf32=checks.static_bool(allow_tf32, "allow_tf32"), self_attention=self_attention,
        validate=checks.static_bool(validate, "validate"), window=window,
        softcap=checks.static_softcap(softcap, scale), alibi=slopes is not None)
    plan = _plan(problem, backend, implementation, backward_implementation, block_sizes, deterministic)
    o, lse = _call(q, k, v, offsets, kv_offsets, problem, plan, slopes)
    if return_lse:
        return o, _user_lse(lse, offsets, problem)
    return o


def merge_attention(outputs, lses) -> tuple[jax.Array, jax.Array]:
    """Merge attentions over disjoint key sets into the attention over their union: (o, lse).

    Each part k is an output o_k (any layout, [..., D]) and its log-sum-exp lse_k (o_k's shape less
    D, float32), as `jagged_attention(..., return_lse=True)` gives: o_k is softmax-weighted over the
    keys of part k, and exp(lse_k) is their sum of exp(scale * q . k). The union's are
        lse = log sum_k exp(lse_k),    o = sum_k exp(lse_k - lse) o_k.
    A part with lse_k = -inf (no key) counts for nothing; where every part has none, o = 0 and
    lse = -inf, as `jagged_attention` gives for a query with no key. Pure JAX, differentiable.

    Uses: the keys of a KV cache and of the new tokens attended in two calls (with their own
    kv_offsets), or context parallelism, where each device attends its slice of the keys and the
    partial results are gathered and merged. Causal masks are the caller's to split: each part's
    mask must be the union's restricted to its keys.

    Args:
      outputs: a sequence of arrays of one shape [..., D] (float32, bfloat16 or float16).
      lses: a sequence, as long, of float32 arrays of shape outputs[k].shape[:-1].

    Returns:
      (o, lse): o with the shape and dtype of outputs[0], lse float32.
    """
    outputs, lses = list(outputs), list(lses)
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses must be two non-empty sequences of one length, got "
                         f"{len(outputs)} outputs and {len(lses)} lses")
    for i, (o, lse) in enumerate(zip(outputs, lses)):
        if o.shape != outputs[0].shape or o.dtype != outputs[0].dtype:
            raise ValueError(f"outputs[{i}] must have the shape and dtype of outputs[0] "
                             f"({outputs[0].shape}, {outputs[0].dtype}), got {o.shape}, {o.dtype}")
        if lse.shape != o.shape[:-1]:
            raise ValueError(f"lses[{i}] must have the shape of outputs[{i}] less its last axis "
                             f"{o.shape[:-1]}, got {lse.shape}")
    stacked = jnp.stack([lse.astype(jnp.float32) for lse in lses])
    # Not jax.nn.logsumexp: its gradient is nan where every part is -inf. The max shifts the exponents
    # only (the result does not depend on it), and where no part has a key every weight is exp(-inf) = 0.
    top = jax.lax.stop_gradient(stacked.max(axis=0))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(stacked - top)
    total = weights.sum(axis=0)
    seen = total != 0  # a NaN part (NaN inputs) makes the union NaN, not "no key"
    total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)
    o = sum((w / total)[..., None] * x.astype(jnp.float32) for w, x in zip(weights, outputs))
    return o.astype(outputs[0].dtype), lse


def multi_head_jagged_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets,
    max_seq_len: int,
    *,
    allow_tf32: bool = True,
    backend: str = "auto",
    layout: str = "HTD",
    block_sizes: BlockSizes | None = None,
    validate: bool = False,
    implementation: str | tuple[str, ...] | None = None,
    backward_implementation: str | tuple[str, ...] | None = None,
    deterministic: bool = True,
) -> jax.Array:
    """FBGEMM's multi-head jagged flash attention: softmax(q k^T) v / max_seq_len, no scale.

    Its default layout is "HTD" ([H, T, D], as FBGEMM), unlike `jagged_attention`'s "THD": pass
    layout="THD" for [T, H, D] arrays (concrete offsets past the token axis of the layout raise).

    For sequence b (tokens offsets[b] to offsets[b+1]) and head h, with n_b = min(len_b, max_seq_len),
    the first n_b tokens get softmax(q k^T) v / max_seq_len over those n_b keys (no 1/sqrt(D) scale).
    Every other token (past n_b, or outside offsets) gets output 0 and gradient 0.

    Args:
      q, k, v: [H, T, D] (layout "HTD", the default) or [T, H, D] ("THD"), one shape; one dtype among
        float32, bfloat16, float16; D <= 256.
      offsets: [B+1] int32 or int64, non-decreasing, within [0, T]: checked as for `jagged_attention`
        (malformed traced offsets are clamped, never unsafe).
      max_seq_len: static Python int >= 1.
      allow_tf32, backend, layout, block_sizes, validate, implementation, backward_implementation,
        deterministic: as for `jagged_attention`.

    Returns:
      The output, with the shape and dtype of q. Differentiable (reverse mode) in q, k and v.
    """
    max_seq_len = checks.static_int(max_seq_len, "max_seq_len")
    offsets = checks.as_offsets(offsets, "offsets")
    if layout in LAYOUTS:
        for name, x in (("q", q), ("k", k), ("v", v)):
            checks.check_array(x, name, layout)
        for name, x in (("k", k), ("v", v)):
            if x.shape != q.shape:
                raise ValueError(f"{name} must have the shape of q {q.shape}, got {x.shape}")
    problem = checks.attention_problem(
        q, k, v, offsets, offsets, max_seq_len=max_seq_len, kv_max_seq_len=max_seq_len, scale=1.0,
        out_scale=1.0 / max_seq_len, causal=False, layout=layout,
        allow_tf32=checks.static_bool(allow_tf32, "allow_tf32"), self_attention=True,
        validate=checks.static_bool(validate, "validate"))
    plan = _plan(problem, backend, implementation, backward_implementation, block_sizes, deterministic)
    return _call(q, k, v, offsets, offsets, problem, plan)[0]
