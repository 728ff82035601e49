"""The argument checks of the public ops and of the dense reference, at trace time: each error names the
argument, what was expected and, where there is one, the fix. `attention_problem` turns checked
arguments into the Problem (problem.py) the implementations run.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from .jagged import order_error
from .problem import HstuProblem, Problem

LAYOUTS = ("THD", "HTD")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_F32 = np.finfo(np.float32)
# The kernels compute exp2(scale * log2(e) * q k^T): that product of constants must be a finite float32,
# and the scale a normal one (a subnormal scale loses its digits, and 1 / scale overflows).
MAX_SCALE = float(_F32.max) / math.log2(math.e)
MIN_SCALE = float(_F32.tiny)


def static_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python int, got a traced value ({type(value).__name__}): "
                        f"it sets the kernels' grid, so mark it static where the op is jitted "
                        f"(jax.jit(f, static_argnums=...) or static_argnames=...), or bind it with "
                        f"functools.partial(f, {name}=...) before jax.jit")
    integer_scalar = isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0
    if integer_scalar and jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be a static Python int, got a {type(value).__name__} scalar: pass "
                        f"int({name})")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def static_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _static_float(value, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a static Python float{what}, got {type(value).__name__}")
    return float(value)


def static_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _static_float(scale, "scale", " or None")
    if not MIN_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"scale must be a finite, normal float32 in [{MIN_SCALE:.4g}, {MAX_SCALE:.4g}] (the "
                         f"kernels' scale * log2(e) must be a finite float32), got {scale}")
    return scale


def static_window(window, causal: bool, max_q: int, max_k: int) -> tuple[int | None, int | None]:
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
            raise ValueError(f"window's {side} bound must be >= 0 or None (None: no bound, FlashAttention's "
                             f"-1), got {value}")
    left, right = (None if value is None or value >= bound else int(value)
                   for value, bound in zip(window, (max_k, max_q)))
    return left, None if causal else right


def static_softcap(softcap, scale: float) -> float | None:
    """The soft cap, whose ratio to the scale (the cap in units of the unscaled scores, as the kernels
    take it, and its inverse) must be a finite float32."""
    if softcap is None:
        return None
    softcap = _static_float(softcap, "softcap", " > 0 or None")
    if not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    ratio = softcap / scale
    if not 1 / float(_F32.max) <= ratio <= float(_F32.max):
        raise ValueError(f"softcap / scale must lie within float32's range [{1 / float(_F32.max):.3g}, "
                         f"{float(_F32.max):.3g}] (the kernels cap the unscaled scores at it), got softcap "
                         f"{softcap} / scale {scale} = {ratio:.4g}")
    return softcap


def as_slopes(slopes, heads: int, rows: int, scale: float):
    """ALiBi's slopes [H] (any float dtype; a list works) as float32 [rows, H], or None. Concrete slopes
    must keep slope / scale within float32 (the kernels take the slopes in units of the unscaled
    scores); traced ones are clamped there."""
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
    if not isinstance(slopes, jax.core.Tracer):
        ratios = np.abs(np.asarray(slopes, np.float64)) / scale
        if not np.all(ratios <= float(_F32.max)):
            worst = int(np.argmax(np.where(np.isfinite(ratios), ratios, np.inf)))
            raise ValueError(f"alibi_slopes / scale must be finite in float32 (the kernels take the slopes "
                             f"in units of the unscaled scores), got alibi_slopes[{worst}] = "
                             f"{float(np.asarray(slopes)[worst])} with scale {scale}")
    return jnp.broadcast_to(jnp.asarray(slopes, jnp.float32), (rows, heads))


def as_offsets(offsets, name: str):
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


def check_array(x, name: str, layout: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 3:
        dims = "[T, H, D]" if layout == "THD" else "[H, T, D]"
        hint = ""
        if x.ndim == 4:
            hint = ("; for padded [B, L, H, D] arrays, jagged_flash_jax.padded_to_jagged packs them into "
                    "[T, H, D] (and jagged_to_padded unpacks the output)")
        raise ValueError(f"{name} must have rank 3 {dims} (layout={layout!r}), got shape {x.shape}{hint}")


def check_dtype(x, name: str, dtypes=DTYPES) -> None:
    if x.dtype not in dtypes:
        hint = f": cast it, e.g. {name}.astype(jnp.float32)" if x.dtype == jnp.float64 else ""
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be one of {names}, got {x.dtype}{hint}")


def split(shape, layout):
    """(tokens, heads, D) of a rank-3 shape in `layout`."""
    return (shape[0], shape[1], shape[2]) if layout == "THD" else (shape[1], shape[0], shape[2])


def check_offsets_content(offsets, name: str, tokens: int, layout: str, validate: bool) -> None:
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


def attention_problem(q, k, v, offsets, kv_offsets, *, max_seq_len, kv_max_seq_len, scale, out_scale, causal,
                      layout, allow_tf32, self_attention: bool, validate: bool, window=(None, None),
                      softcap=None, alibi=False, dtypes=DTYPES) -> Problem:
    """The Problem of checked arguments; offsets as `as_offsets` gives them, the statics already checked
    (scale, softcap as `static_scale` and `static_softcap` give them). `dtypes`: those q may have (the
    dense reference takes float64 too)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(x, name, layout)
    check_dtype(q, "q", dtypes)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    q_tokens, heads, dim = split(q.shape, layout)
    kv_tokens, kv_heads, kv_dim = split(k.shape, layout)
    if kv_dim != dim:
        raise ValueError(f"k and v must have the head dimension of q (D={dim}), got D={kv_dim}")
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
            check_offsets_content(x, name, tokens // rows, layout, validate)
    window = static_window(window, causal, min(max_seq_len, q_tokens // rows),
                           min(kv_max_seq_len, kv_tokens // rows))
    return Problem(
        layout=layout, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, batch=offsets.shape[-1] - 1,
        num_segments=rows, q_tokens=q_tokens // rows, kv_tokens=kv_tokens // rows, q_offsets_rows=rows,
        kv_offsets_rows=rows, max_seq_len=max_seq_len, kv_max_seq_len=kv_max_seq_len, causal=causal,
        scale=scale, out_scale=out_scale, dtype=jnp.dtype(q.dtype).name,
        input_precision="tf32" if allow_tf32 else "ieee", window=window, softcap=softcap, alibi=alibi)


def _static_nonnegative_int(value, name: str) -> int:
    return static_int(value, name, minimum=0)


def as_num_targets(num_targets, offsets):
    """num_targets [B] (or [shards, B], as offsets [shards, B+1]) as int32, or None; concrete ones must
    lie in [0, each sequence's length]."""
    if num_targets is None:
        return None
    if not hasattr(num_targets, "dtype"):
        if not isinstance(num_targets, (list, tuple)):
            raise TypeError(f"num_targets must be an integer array [B] or None, got "
                            f"{type(num_targets).__name__}")
        num_targets = np.asarray(num_targets)
    if not jnp.issubdtype(num_targets.dtype, jnp.integer) or num_targets.dtype == bool:
        raise TypeError(f"num_targets must be an integer array [B], got dtype {num_targets.dtype}")
    expected = offsets.shape[:-1] + (offsets.shape[-1] - 1,)
    if num_targets.shape != expected:
        raise ValueError(f"num_targets must have one entry per sequence, shape {expected} (offsets' "
                         f"{offsets.shape} less one), got {num_targets.shape}")
    if not isinstance(num_targets, jax.core.Tracer) and not isinstance(offsets, jax.core.Tracer):
        targets, lengths = np.asarray(num_targets), np.diff(np.asarray(offsets), axis=-1)
        bad = np.argwhere((targets < 0) | (targets > lengths))
        if bad.size:
            at = tuple(int(i) for i in bad[0])
            raise ValueError(f"num_targets must lie in [0, the sequence's length]: num_targets{list(at)} = "
                             f"{int(targets[at])} for a sequence of {int(lengths[at])} tokens")
    return jnp.asarray(num_targets, jnp.int32)


def hstu_problem(q, k, v, offsets, num_targets, *, max_seq_len, alpha, causal, max_attn_len,
                 contextual_seq_len, min_full_attn_seq_len, scale, layout, allow_tf32, validate: bool,
                 dtypes=DTYPES):
    """The HstuProblem of checked arguments (offsets as `as_offsets`, num_targets as `as_num_targets`
    give them; `scale` the constant s_i, or None for a per-token operand)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(x, name, layout)
    check_dtype(q, "q", dtypes)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {q.shape}, got {k.shape}")
    tokens, heads, dim = split(q.shape, layout)
    v_tokens, v_heads, value_dim = split(v.shape, layout)
    if (v_tokens, v_heads) != (tokens, heads):
        raise ValueError(f"v must have q's tokens and heads ({tokens}, {heads}) in layout {layout!r}, got "
                         f"shape {v.shape}")
    alpha = _static_float(alpha, "alpha", "")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    rows = offsets.shape[0] if offsets.ndim == 2 else 1
    if tokens % rows:
        raise ValueError(f"offsets [{rows}, B+1] splits the token axis into {rows} equal shards, but q has "
                         f"{tokens} tokens")
    check_offsets_content(offsets, "offsets", tokens // rows, layout, validate)
    if validate and num_targets is not None and isinstance(num_targets, jax.core.Tracer):
        checkify.check(jnp.all(num_targets >= 0), "num_targets must be >= 0")
        checkify.check(jnp.all(num_targets <= jnp.diff(offsets, axis=-1)),
                       "num_targets must be at most each sequence's length")
    return HstuProblem(
        layout=layout, num_heads=heads, head_dim=dim, value_dim=value_dim, batch=offsets.shape[-1] - 1,
        num_segments=rows, tokens=tokens // rows, offsets_rows=rows, max_seq_len=max_seq_len, alpha=alpha,
        scale=scale, causal=static_bool(causal, "causal"),
        max_attn_len=_static_nonnegative_int(max_attn_len, "max_attn_len"),
        contextual_seq_len=_static_nonnegative_int(contextual_seq_len, "contextual_seq_len"),
        min_full_attn_seq_len=_static_nonnegative_int(min_full_attn_seq_len, "min_full_attn_seq_len"),
        has_targets=num_targets is not None, dtype=jnp.dtype(q.dtype).name,
        input_precision="tf32" if allow_tf32 else "ieee")


def hstu_scale(attn_scale, max_seq_len: int, tokens: int):
    """(the constant s_i or None, the per-token operand [tokens] float32 or None) of attn_scale: None is
    1 / max_seq_len, a Python float a constant, an array (a scalar, or one factor per token [T]) the
    operand (a scalar broadcast: its gradient is the operand's, summed)."""
    if attn_scale is None:
        return 1.0 / max_seq_len, None
    if isinstance(attn_scale, (int, float, np.floating, np.integer)) and not isinstance(attn_scale, bool):
        scale = float(attn_scale)
        if not math.isfinite(scale):
            raise ValueError(f"attn_scale must be finite, got {scale}")
        return scale, None
    if not hasattr(attn_scale, "dtype") or not jnp.issubdtype(attn_scale.dtype, jnp.floating):
        raise TypeError(f"attn_scale must be None, a float, or a float array (a scalar or [T]), got "
                        f"{type(attn_scale).__name__}")
    if attn_scale.shape not in ((), (tokens,)):
        raise ValueError(f"attn_scale must be a scalar or one factor per token [T] = ({tokens},), got shape "
                         f"{attn_scale.shape}")
    return None, jnp.broadcast_to(jnp.asarray(attn_scale, jnp.float32), (tokens,))
