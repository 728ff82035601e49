"""The public ops: argument checks, backend choice, and the one custom_vjp that serves every backend.

`jagged_attention` has the standard semantics (scale, causal, GQA/MQA, cross-attention, a sliding
window, logit soft-capping, ALiBi);
`multi_head_jagged_flash_attention` is FBGEMM's op (no scale, output divided by max_seq_len), a thin
call into the same path.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jax.experimental import checkify

from . import transforms
from .configs import INTERPRET_BLOCK_SIZES, MAX_HEAD_DIM, BlockSizes, band_width, default_block_sizes
from .jagged import attended_tokens, order_error
from .launch import plan

BACKENDS = ("auto", "triton", "interpret", "xla")
LAYOUTS = ("THD", "HTD")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Row offsets inside one sequence are int32 in the kernels: (max_seq_len + a block) rows of a stride.
_MAX_SEQUENCE_ELEMENTS = 2**31 - 1
# Names of the residuals, for remat policies (jax.checkpoint_policies.save_only_these_names).
RESIDUAL_NAMES = ("jagged_attention_out", "jagged_attention_lse")
# The kernels compute exp2(scale * log2(e) * q k^T): that product of constants must be a finite float32.
_MAX_SCALE = float(np.finfo(np.float32).max) / math.log2(math.e)

FORWARD_MODE_ERROR = (
    "jagged attention has a custom reverse-mode rule (its backward kernels) and does not support "
    "forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize); use jax.grad / jax.vjp, or "
    "jagged_flash_jax.jagged_attention_reference (dense, O(L^2) memory) for forward mode")
SECOND_ORDER_ERROR = (
    "jagged attention's kernels have no derivative of their own, so second-order autodiff "
    "(jax.hessian, jax.jacfwd or jax.jvp of jax.grad, jax.grad of jax.grad) is not supported; use "
    "jagged_flash_jax.jagged_attention_reference (dense, O(L^2) memory) for higher derivatives")


# ---------------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------------


def default_backend() -> str:
    """"triton" when JAX's default backend is a GPU and jax-triton imports, else "xla".

    On a GPU without a working jax-triton this warns once, with the reason, and picks "xla".
    """
    from .launch import gpu

    if not gpu.on_gpu():
        return "xla"
    reason = gpu.unavailable_reason()
    if reason is None:
        return "triton"
    _warn_fallback(reason)
    return "xla"


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"jagged_flash_jax: backend='auto' runs the pure-JAX 'xla' backend on this GPU, "
                  f"because the Triton kernels cannot run: {reason}", RuntimeWarning, stacklevel=4)


def _resolve_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return default_backend()
    if backend == "triton":
        from .launch import gpu

        if not gpu.on_gpu():
            raise ValueError(f"backend='triton' needs a GPU, but JAX's default backend is "
                             f"{jax.default_backend()!r}; use backend='xla' or 'interpret', or "
                             f"{gpu.INSTALL_HINT}")
        reason = gpu.unavailable_reason()
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run: {reason}")
    return backend


# ---------------------------------------------------------------------------------------------------
# Argument checks (trace time)
# ---------------------------------------------------------------------------------------------------


def _static_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python int, got a traced value ({type(value).__name__}): "
                        f"it sets the kernels' grid, so mark it static where the op is jitted "
                        f"(jax.jit(f, static_argnums=...) or static_argnames=...), or bind it with "
                        f"functools.partial(f, {name}=...) before jax.jit")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _static_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _static_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a static Python float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not 0 < scale <= _MAX_SCALE:
        raise ValueError(f"scale must be finite and positive, at most {_MAX_SCALE:.4g} (the kernels' "
                         f"scale * log2(e) must be a finite float32), got {scale}")
    return scale


def _static_window(window, causal: bool, max_q: int, max_k: int) -> tuple[int | None, int | None]:
    """(left, right) checked and normalized: a bound no query-key distance reaches (left >= the longest
    key sequence, right >= the longest query sequence) is none, and so is right under causal (which
    bounds it at 0): one problem, and one compiled kernel, per distinct band."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of static ints >= 0 or None, got {window!r}")
    for side, value in zip(("left", "right"), window):
        if value is None:
            continue
        if isinstance(value, (jax.core.Tracer, bool)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"window's {side} bound must be a static Python int >= 0 or None, got "
                            f"{type(value).__name__}")
        if value < 0:
            raise ValueError(f"window's {side} bound must be >= 0 or None, got {value}")
    left, right = (None if value is None or value >= bound else int(value)
                   for value, bound in zip(window, (max_k, max_q)))
    return left, None if causal else right


def _static_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap must be a static Python float > 0 or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    return softcap


def _as_slopes(slopes, heads: int, rows: int):
    """ALiBi's slopes [H] (any float dtype; a list works) as float32 [rows, H], or None."""
    if slopes is None:
        return None
    if not hasattr(slopes, "dtype"):
        if not isinstance(slopes, (list, tuple)):
            raise TypeError(f"alibi_slopes must be a float array [H] or None, got {type(slopes).__name__}")
        slopes = np.asarray(slopes, np.float32)
    if not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise TypeError(f"alibi_slopes must be a float array [H], got dtype {slopes.dtype}")
    if slopes.shape != (heads,):
        raise ValueError(f"alibi_slopes must have shape [H] = ({heads},), one slope per query head, got "
                         f"shape {slopes.shape}")
    return jnp.broadcast_to(jnp.asarray(slopes, jnp.float32), (rows, heads))


def _as_offsets(offsets, name: str):
    """offsets as an int32/int64 JAX array; Python lists and NumPy integer arrays are accepted."""
    if not hasattr(offsets, "dtype"):
        if not isinstance(offsets, (list, tuple)):
            raise TypeError(f"{name} must be an integer array [B+1], got {type(offsets).__name__}")
        offsets = np.asarray(offsets)
    if not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.dtype == bool:
        raise TypeError(f"{name} must be an integer array (int32 or int64), got dtype {offsets.dtype}")
    if isinstance(offsets, np.ndarray) and not jax.config.jax_enable_x64 and offsets.size:
        # Without x64, JAX would convert these to int32 and wrap values past 2**31 silently.
        info = np.iinfo(np.int32)
        if offsets.min() < info.min or offsets.max() > info.max:
            raise ValueError(f"{name} holds values outside int32 ({offsets.min()} to {offsets.max()}), "
                             f"which JAX would wrap with x64 disabled; enable jax_enable_x64 for int64 "
                             f"offsets")
    if offsets.dtype not in (jnp.int32, jnp.int64):
        offsets = offsets.astype(np.int32)
    offsets = jnp.asarray(offsets)
    if offsets.ndim not in (1, 2) or offsets.shape[-1] < 1:
        raise ValueError(f"{name} must be [B+1] with B >= 0 (or [shards, B+1] for data-parallel packing), "
                         f"got shape {offsets.shape}")
    return offsets


def _check_array(x, name: str, layout: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 3:
        dims = "[T, H, D]" if layout == "THD" else "[H, T, D]"
        raise ValueError(f"{name} must have rank 3 {dims} (layout={layout!r}), got shape {x.shape}")


def _split(shape, layout):
    """(tokens, heads, D) of a rank-3 shape in `layout`."""
    return (shape[0], shape[1], shape[2]) if layout == "THD" else (shape[1], shape[0], shape[2])


def _check_offsets_content(offsets, name: str, tokens: int, layout: str, validate: bool) -> None:
    """Offsets must be non-decreasing within [0, tokens] (each row, for [shards, B+1]). Checked eagerly
    when concrete; when traced, with checkify.check if `validate` (the caller functionalizes it)."""
    where = f"the {tokens} tokens of the token axis (axis {layout.index('T')} in layout {layout!r})"
    if not isinstance(offsets, jax.core.Tracer):
        rows = np.asarray(offsets).reshape(-1, offsets.shape[-1])
        for r, row in enumerate(rows):
            at = f"{name}[{r}]" if offsets.ndim == 2 else name
            error = order_error(row, at)
            if error:
                raise ValueError(error)
            if row[-1] > tokens:
                hint = ""
                if offsets.ndim == 1 and layout == "HTD":
                    hint = "; if q, k, v are [T, H, D], pass layout='THD'"
                elif offsets.ndim == 1:
                    hint = "; if q, k, v are [H, T, D], pass layout='HTD'"
                raise ValueError(f"{at} must be at most the number of tokens: {at}[-1] = {row[-1]} is "
                                 f"past {where}{hint}")
    elif validate:
        checkify.check(jnp.all(offsets[..., 0] >= 0), f"{name} must be >= 0")
        checkify.check(jnp.all(jnp.diff(offsets, axis=-1) >= 0), f"{name} must be non-decreasing")
        checkify.check(jnp.all(offsets[..., -1] <= tokens), f"{name} must be at most {where}")


def _problem(q, k, v, offsets, kv_offsets, *, max_seq_len, kv_max_seq_len, scale, out_scale, causal,
             layout, allow_tf32, backend, block_sizes, self_attention: bool,
             validate: bool, window=(None, None), softcap=None, alibi=False) -> plan.Problem:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(x, name, layout)
    if q.dtype not in DTYPES:
        raise TypeError(f"q, k, v must be float32, bfloat16 or float16, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    q_tokens, heads, dim = _split(q.shape, layout)
    kv_tokens, kv_heads, kv_dim = _split(k.shape, layout)
    if kv_dim != dim:
        raise ValueError(f"k and v must have the head dimension of q (D={dim}), got D={kv_dim}")
    if dim > MAX_HEAD_DIM:
        raise ValueError(f"head dimension D must be at most {MAX_HEAD_DIM}, got D={dim}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the number of kv "
                         f"heads ({kv_heads}) in k and v")
    if self_attention and kv_tokens != q_tokens:
        raise ValueError(f"k and v have {kv_tokens} tokens but q has {q_tokens}; with kv_offsets=None "
                         f"they share q's offsets (pass kv_offsets for cross-attention)")
    rows = offsets.shape[0] if offsets.ndim == 2 else 1
    for name, x in (("offsets", offsets), ("kv_offsets", kv_offsets)):
        if x.shape[-1] != offsets.shape[-1] or x.ndim != offsets.ndim or (x.ndim == 2 and x.shape[0] != rows):
            raise ValueError(f"kv_offsets must have the shape of offsets {offsets.shape}, got {x.shape}")
        tokens = q_tokens if name == "offsets" else kv_tokens
        if tokens % rows:
            raise ValueError(f"{name} [{rows}, B+1] splits the token axis into {rows} equal shards, but "
                             f"the arrays it indexes have {tokens} tokens")
        if name == "offsets" or not self_attention:
            _check_offsets_content(x, name, tokens // rows, layout, validate)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    if block_sizes is not None and None in (block_sizes.fwd, block_sizes.dkdv, block_sizes.dq):
        raise TypeError(f"block_sizes needs a KernelConfig for each of fwd, dkdv and dq, got {block_sizes}")
    # A sequence never attends more than its segment's tokens, whatever max_seq_len says.
    bounds = (("max_seq_len", heads, min(max_seq_len, q_tokens // rows)),
              ("kv_max_seq_len", kv_heads, min(kv_max_seq_len, kv_tokens // rows)))
    for name, h, max_len in bounds:
        stride = h * dim if layout == "THD" else dim
        if (max_len + MAX_HEAD_DIM) * stride > _MAX_SEQUENCE_ELEMENTS:
            raise ValueError(f"{name} * {'H * D' if layout == 'THD' else 'D'} = {max_len * stride} "
                             f"elements in one sequence (at most its tokens) is more than the kernels "
                             f"address (< 2**31)")
    backend = _resolve_backend(backend)
    window = _static_window(window, causal, bounds[0][2], bounds[1][2])
    if block_sizes is None:
        block_sizes = (INTERPRET_BLOCK_SIZES if backend == "interpret"
                       else default_block_sizes(dim, q.dtype, max_seq_len, kv_max_seq_len,
                                                band_width(window, causal)))
    problem = plan.Problem(
        layout=layout, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        batch=offsets.shape[-1] - 1, num_segments=rows, q_tokens=q_tokens // rows,
        kv_tokens=kv_tokens // rows, q_offsets_rows=rows, kv_offsets_rows=rows, max_seq_len=max_seq_len,
        kv_max_seq_len=kv_max_seq_len, causal=causal, scale=scale, out_scale=out_scale,
        input_precision="tf32" if allow_tf32 else "ieee", block_sizes=block_sizes, backend=backend,
        window=window, softcap=softcap, alibi=alibi)
    if backend == "triton":
        from .launch import hopper

        problem = hopper.with_kernels(problem, q.dtype)
    if backend != "xla":
        plan.check_grid(problem)
    return problem


# ---------------------------------------------------------------------------------------------------
# The one custom_vjp
# ---------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_offsets, kv_offsets, slopes, problem: plan.Problem):
    """o and the log-sum-exp residual [Z, H, T_q] (units of the unscaled scores; see `_user_lse`)."""
    return _forward(problem, q, k, v, q_offsets, kv_offsets, slopes)


def _attention_fwd(q, k, v, q_offsets, kv_offsets, slopes, problem: plan.Problem):
    # symbolic_zeros=True: the primals come wrapped (CustomVJPPrimal), all but the static problem.
    q, k, v, q_offsets, kv_offsets, slopes = jax.tree.map(lambda x: x.value,
                                                          (q, k, v, q_offsets, kv_offsets, slopes))
    o, lse = _forward(problem, q, k, v, q_offsets, kv_offsets, slopes)
    o = checkpoint_name(o, RESIDUAL_NAMES[0])
    lse = checkpoint_name(lse, RESIDUAL_NAMES[1])
    return (o, lse), (q, k, v, q_offsets, kv_offsets, o, lse, slopes)


def _attention_bwd(problem: plan.Problem, residuals, cotangents):
    q, k, v, q_offsets, kv_offsets, o, lse, slopes = residuals
    do, dlse = cotangents
    # Symbolic zeros: a caller who never reads the log-sum-exp (return_lse=False, or a loss without
    # it) runs the backward exactly as without it, with no extra operand or subtraction.
    do = jnp.zeros_like(o) if isinstance(do, SymbolicZero) else do.astype(q.dtype)
    dlse = None if isinstance(dlse, SymbolicZero) else dlse.astype(jnp.float32)
    dq, dk, dv = _backward(problem, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse)
    # The ALiBi slopes get no gradient (as in FlashAttention): a zero cotangent.
    return dq, dk, dv, None, None, None


# Neither the forward nor the backward kernels have a derivative of their own; only a second
# differentiation reaches them with tangents (the outer one of jax.hessian, jacfwd(grad), grad(grad)
# traces the inner one's forward and backward). A custom_jvp whose rule raises the library's error
# gives them that error, at trace time, under jit too, rather than JAX's missing rule for
# custom_partitioning. Without tangents (first order) the rule is never called.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward(problem: plan.Problem, q, k, v, q_offsets, kv_offsets, slopes):
    return transforms.forward(problem, q, k, v, q_offsets, kv_offsets, slopes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _backward(problem: plan.Problem, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse):
    return transforms.backward(problem, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes, dlse)


def _no_second_order(problem, primals, tangents):
    raise TypeError(SECOND_ORDER_ERROR)


_forward.defjvp(_no_second_order)
_backward.defjvp(_no_second_order)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _call(q, k, v, q_offsets, kv_offsets, problem, slopes=None):
    # Offsets as [rows, B+1], the kernels' form (a free reshape).
    q_offsets, kv_offsets = (x if x.ndim == 2 else x[None] for x in (q_offsets, kv_offsets))
    # jax.jvp and jax.jacfwd fail here, as the custom_vjp is traced. Under jax.jit of jax.jvp, and when
    # the function jax.linearize returns is applied, JAX fails later (at lowering, or evaluation) with
    # its own "can't apply forward-mode autodiff (jvp) to a custom_vjp function": no hook reaches that
    # (a linear_call tangent would, but it has no vmap rule in jax 0.10).
    try:
        return _attention(q, k, v, q_offsets, kv_offsets, slopes, problem)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise TypeError(FORWARD_MODE_ERROR) from err


def _user_lse(lse, q_offsets, problem: plan.Problem):
    """The residual [Z, H, T] (unscaled units, +inf without keys, unwritten where no query attends) as
    the natural log-sum-exp of the scaled scores, laid out like q's token and head axes: [Z*T, H]
    ("THD") or [H, Z*T] ("HTD"); -inf, the log of an empty sum, for rows without keys and for tokens no
    query attends. Plain JAX after the custom_vjp, so JAX carries the cotangent through the scale and
    the mask (zero where -inf), and the unwritten entries are selected away, never read into a value."""
    rows = jnp.broadcast_to(q_offsets.reshape(-1, q_offsets.shape[-1]),
                            (problem.num_segments, q_offsets.shape[-1]))
    attended = jax.vmap(lambda o: attended_tokens(o, problem.q_tokens, problem.max_seq_len))(rows)
    keep = attended[:, None, :] & (lse < jnp.inf)  # [Z, H, T]
    lse = jnp.where(keep, problem.scale * lse, -jnp.inf)
    if problem.layout == "THD":
        return jnp.swapaxes(lse, 1, 2).reshape(-1, problem.num_heads)
    return jnp.swapaxes(lse, 0, 1).reshape(problem.num_heads, -1)


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
        dtype among float32, bfloat16, float16; D <= 256.
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
      scale: static float multiplying q k^T, with 0 < scale <= 2.3e38 (scale * log2(e) must be a
        finite float32); None means 1 / sqrt(D).
      causal: bottom-right aligned causal mask.
      layout: "THD" (default) or "HTD".
      backend: "triton" (GPU kernels via jax-triton), "interpret" (the same kernels in Triton's
        interpreter on the CPU), "xla" (blockwise pure JAX, any device), or "auto" ("triton" on a GPU
        with jax-triton, else "xla").
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

    Returns:
      The output, with the shape and dtype of q. Differentiable (reverse mode) in q, k and v; forward
      mode and second order raise TypeError. With return_lse=True, the pair (output, lse): lse is
      float32 [T_q, H] ("THD") or [H, T_q] ("HTD"), the natural log of sum_j exp(scale * q_i . k_j)
      over the keys query i attends, -inf (the log of an empty sum) for a query with no key and for
      the tokens no query attends (past max_seq_len, outside offsets). It is differentiable too (its
      cotangent flows into the backward), and merges partial results: see `merge_attention`.
    """
    max_seq_len = _static_int(max_seq_len, "max_seq_len")
    return_lse = _static_bool(return_lse, "return_lse")
    kv_max_seq_len = max_seq_len if kv_max_seq_len is None else _static_int(kv_max_seq_len,
                                                                             "kv_max_seq_len")
    offsets = _as_offsets(offsets, "offsets")
    self_attention = kv_offsets is None
    kv_offsets = offsets if self_attention else _as_offsets(kv_offsets, "kv_offsets")
    _check_array(q, "q", layout if layout in LAYOUTS else "THD")
    heads = _split(q.shape, layout if layout in LAYOUTS else "THD")[1]
    slopes = _as_slopes(alibi_slopes, heads, offsets.shape[0] if offsets.ndim == 2 else 1)
    problem = _problem(
        q, k, v, offsets, kv_offsets, max_seq_len=max_seq_len, kv_max_seq_len=kv_max_seq_len,
        scale=_static_scale(scale, q.shape[-1]), out_scale=1.0, causal=_static_bool(causal, "causal"),
        layout=layout, allow_tf32=_static_bool(allow_tf32, "allow_tf32"), backend=backend,
        block_sizes=block_sizes, self_attention=self_attention, validate=_static_bool(validate, "validate"),
        window=window, softcap=_static_softcap(softcap), alibi=slopes is not None)
    o, lse = _call(q, k, v, offsets, kv_offsets, problem, slopes)
    if _static_bool(return_lse, "return_lse"):
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
    seen = total > 0
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
      allow_tf32, backend, layout, block_sizes, validate: as for `jagged_attention`.

    Returns:
      The output, with the shape and dtype of q. Differentiable (reverse mode) in q, k and v.
    """
    max_seq_len = _static_int(max_seq_len, "max_seq_len")
    offsets = _as_offsets(offsets, "offsets")
    if layout in LAYOUTS:
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_array(x, name, layout)
        for name, x in (("k", k), ("v", v)):
            if x.shape != q.shape:
                raise ValueError(f"{name} must have the shape of q {q.shape}, got {x.shape}")
    problem = _problem(
        q, k, v, offsets, offsets, max_seq_len=max_seq_len, kv_max_seq_len=max_seq_len, scale=1.0,
        out_scale=1.0 / max_seq_len, causal=False, layout=layout,
        allow_tf32=_static_bool(allow_tf32, "allow_tf32"), backend=backend, block_sizes=block_sizes,
        self_attention=True, validate=_static_bool(validate, "validate"))
    return _call(q, k, v, offsets, offsets, problem)[0]
