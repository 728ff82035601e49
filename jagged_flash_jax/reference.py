"""Dense pure-JAX references (O(B*H*L^2) memory), which JAX differentiates itself in both modes: for
checking, small problems and forward-mode autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import checks
from ._util import slopes_in_score_units
from .jagged import jagged_to_padded, padded_to_jagged, sequence_bounds
from .xla.hstu import hstu_mask  # noqa: F401 (public here: the rule the reference applies)
from .xla.softmax import allowed, distance


def jagged_attention_reference(q, k, v, offsets, max_seq_len: int, *, kv_offsets=None,
                               kv_max_seq_len: int | None = None, scale: float | None = None,
                               causal: bool = False, layout: str = "THD", out_scale: float = 1.0,
                               window: tuple[int | None, int | None] = (None, None),
                               softcap: float | None = None, alibi_slopes=None):
    """Dense pure-JAX jagged attention with `jagged_attention`'s semantics (O(B * H * L^2) memory).

    Pads every sequence to [B, L, H, D], masks, and lets JAX differentiate (reverse and forward mode).
    `out_scale` multiplies the output (FBGEMM's semantics: scale=1.0, out_scale=1 / max_seq_len).
    `window`, `softcap` and `alibi_slopes` ([H]) are `jagged_attention`'s; as there, no gradient flows to
    the slopes.
    """
    # Checked as the op checks its arguments (checks.py): the same errors for the same mistakes.
    max_seq_len = checks.static_int(max_seq_len, "max_seq_len")
    kv_max_seq_len = (max_seq_len if kv_max_seq_len is None
                      else checks.static_int(kv_max_seq_len, "kv_max_seq_len"))
    offsets = checks.as_offsets(offsets, "offsets")
    self_attention = kv_offsets is None
    kv_offsets = offsets if self_attention else checks.as_offsets(kv_offsets, "kv_offsets")
    if offsets.ndim != 1:
        raise ValueError(f"offsets must be [B+1] here (no data-parallel shards), got shape {offsets.shape}")
    checks.check_array(q, "q", layout if layout in checks.LAYOUTS else "THD")
    scale = checks.static_scale(scale, q.shape[-1])
    causal = checks.static_bool(causal, "causal")
    softcap = checks.static_softcap(softcap, scale)
    heads = checks.split(q.shape, layout if layout in checks.LAYOUTS else "THD")[1]
    alibi_slopes = checks.as_slopes(alibi_slopes, heads, 1, scale)
    problem = checks.attention_problem(
        q, k, v, offsets, kv_offsets, max_seq_len=max_seq_len, kv_max_seq_len=kv_max_seq_len, scale=scale,
        out_scale=out_scale, causal=causal, layout=layout, allow_tf32=False, self_attention=self_attention,
        validate=False, window=window, softcap=softcap, alibi=alibi_slopes is not None,
        dtypes=(*checks.DTYPES, jnp.float64))
    window = problem.window
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes[0]
    if layout == "HTD":
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]

    def pad(x, offs, length):  # [T, H, D] -> [B, length, H, D] float32, and the lengths [B]
        return (jagged_to_padded(x.astype(jnp.float32), offs, length, layout="THD"),
                sequence_bounds(offs, x.shape[0], length)[1])

    qp, n_q = pad(q, offsets, max_seq_len)
    kp, n_k = pad(jnp.repeat(k, group, axis=1), kv_offsets, kv_max_seq_len)
    vp, _ = pad(jnp.repeat(v, group, axis=1), kv_offsets, kv_max_seq_len)
    query_rows, key_rows = jnp.arange(max_seq_len)[None], jnp.arange(kv_max_seq_len)[None]
    keep = allowed(query_rows, key_rows, n_q, n_k, causal, window)
    # Unscaled scores, the max subtracted before the scale, as in the kernels (xla/softmax.py says why).
    scores = jnp.einsum("bqhd,bkhd->bhqk", qp, kp, precision=lax.Precision.HIGHEST)
    if softcap is not None:
        scores = softcap / scale * jnp.tanh(scores * (scale / softcap))
    if alibi_slopes is not None:
        slopes = slopes_in_score_units(lax.stop_gradient(alibi_slopes), scale)
        distances = jnp.abs(distance(query_rows, key_rows, n_q, n_k))  # [B, Q, K]
        scores = scores - slopes[None, :, None, None] * distances[:, None]
    scores = jnp.where(keep[:, None], scores, -jnp.inf)
    row_max = lax.stop_gradient(scores.max(-1, keepdims=True))
    weights = jnp.exp((scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)) * scale)
    total = weights.sum(-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    out = out_scale * jnp.einsum("bhqk,bkhd->bqhd", probs, vp, precision=lax.Precision.HIGHEST)
    o = padded_to_jagged(out, offsets, q.shape[0], layout="THD").astype(q.dtype)
    return jnp.swapaxes(o, 0, 1) if layout == "HTD" else o


# ---------------------------------------------------------------------------------------------------
# HSTU attention (generative-recommenders' `hstu_mha`): the mask and the dense reference
# ---------------------------------------------------------------------------------------------------


def hstu_attention_reference(q, k, v, offsets, max_seq_len: int, *, alpha: float, causal: bool = True,
                             num_targets=None, max_attn_len: int = 0, contextual_seq_len: int = 0,
                             min_full_attn_seq_len: int = 0, attn_scale=None, layout: str = "THD"):
    """Dense pure-JAX HSTU attention (O(B * H * L^2) memory; JAX differentiates it in both modes).

    q, k [T, H, D] and v [T, H, V] ([H, T, .] with layout="HTD"); offsets [B+1]: tokens
    offsets[b]:offsets[b+1] are sequence b, of n_b tokens; num_targets [B] int or None; attn_scale None,
    a scalar, or [T] (one factor per query token). Per sequence and head, for the first
    min(n_b, max_seq_len) tokens (every other token gets output 0, and gradient 0):

        o_i = sum_j mask_ij * silu(alpha * q_i . k_j) * s_i * v_j,   no softmax,

    s_i = 1 / max_seq_len without attn_scale, else attn_scale (or attn_scale[token i]); mask is
    `hstu_mask` on the positions within the sequence, with the full length n_b (targets, the window's
    lift and the context's reach count from the sequence's true end even when it lies past
    max_seq_len). Float32 accumulation (HIGHEST precision); the output has q's dtype.

    This is `pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr=0.0,
    num_targets=num_targets, attn_scale=attn_scale, max_attn_len=max_attn_len,
    contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len)` of
    generative-recommenders (its `hstu_mha` with kernel=PYTORCH), which likewise pads each sequence to
    its first max_seq_len tokens, builds the mask from the full lengths, and multiplies silu by
    attn_scale (or 1 / max_seq_len) and then by the mask. num_targets None and all zeros are the same.
    gr's Triton kernel (`triton_hstu_mha`) is the causal case without attn_scale and
    min_full_attn_seq_len, for lengths at most max_seq_len (past it, it is undefined); it leaves the
    tokens of no sequence unwritten where this gives 0.
    """
    # Checked as hstu_attention checks its arguments (checks.py), float64 accepted.
    max_seq_len = checks.static_int(max_seq_len, "max_seq_len")
    offsets = checks.as_offsets(offsets, "offsets")
    if offsets.ndim != 1:
        raise ValueError(f"offsets must be [B+1] here (no data-parallel shards), got shape {offsets.shape}")
    num_targets = checks.as_num_targets(num_targets, offsets)
    checks.check_array(q, "q", layout if layout in checks.LAYOUTS else "THD")
    checks.hstu_scale(attn_scale, max_seq_len, checks.split(q.shape, layout if layout in checks.LAYOUTS
                                                            else "THD")[0])
    problem = checks.hstu_problem(
        q, k, v, offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha, causal=causal,
        max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len, scale=None, layout=layout, allow_tf32=False,
        validate=False, dtypes=(*checks.DTYPES, jnp.float64))
    alpha = problem.alpha
    if layout == "HTD":
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    tokens = q.shape[0]
    _, lengths = sequence_bounds(offsets, tokens)  # the full lengths: the mask counts ids from them
    inside = jnp.arange(max_seq_len)[None] < jnp.minimum(lengths, max_seq_len)[:, None]  # [B, L]
    qp, kp, vp = (jagged_to_padded(x.astype(jnp.float32), offsets, max_seq_len, layout="THD")
                  for x in (q, k, v))
    positions = jnp.arange(max_seq_len)[None]
    keep = hstu_mask(positions, positions, lengths, num_targets, causal=causal, max_attn_len=max_attn_len,
                     contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len)
    keep &= inside[:, :, None] & inside[:, None, :]  # [B, L, L]
    scores = jax.nn.silu(alpha * jnp.einsum("bqhd,bkhd->bhqk", qp, kp, precision=lax.Precision.HIGHEST))
    if attn_scale is None:
        scores = scores / max_seq_len
    elif jnp.ndim(attn_scale) == 0:
        scores = scores * jnp.asarray(attn_scale, jnp.float32)
    else:  # one factor per query token
        rows = jagged_to_padded(jnp.asarray(attn_scale, jnp.float32)[:, None], offsets, max_seq_len)
        scores = scores * rows[:, None]  # [B, 1, L, 1]
    scores = jnp.where(keep[:, None], scores, 0.0)
    out = jnp.einsum("bhqk,bkhv->bqhv", scores, vp, precision=lax.Precision.HIGHEST)
    o = padded_to_jagged(out, offsets, tokens, layout="THD").astype(q.dtype)
    return jnp.swapaxes(o, 0, 1) if layout == "HTD" else o
