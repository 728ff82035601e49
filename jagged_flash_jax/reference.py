"""Pure-JAX jagged attention: the `xla` backend, and the second opinion of tests and benchmarks.

It pads the batch to [B, H, max_seq_len, D], runs masked softmax attention and scatters back, so it
costs O(B * max_seq_len^2) memory; JAX differentiates it itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .jagged import jagged_to_padded, padded_to_jagged, sequence_bounds


def jagged_attention_reference(q, k, v, offsets, max_seq_len: int, *, allow_tf32: bool = True,
                               layout: str = "HTD") -> jax.Array:
    """softmax(q k^T) v / max_seq_len per sequence and head; zero outside the attended tokens."""
    if layout == "THD":
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    heads, total, dim = q.shape
    high = q.dtype == jnp.float32 and not allow_tf32
    precision = lax.Precision.HIGHEST if high else lax.Precision.DEFAULT
    qp, kp, vp = (jagged_to_padded(x, offsets, max_seq_len) for x in (q, k, v))
    _, lengths = sequence_bounds(offsets, total, max_seq_len)
    key_valid = jnp.arange(max_seq_len)[None, :] < lengths[:, None]  # [B, L]

    scores = jnp.einsum("bhid,bhjd->bhij", qp, kp, precision=precision,
                        preferred_element_type=jnp.float32)
    scores = jnp.where(key_valid[:, None, None, :], scores, -jnp.inf)
    row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows of empty sequences
    weights = jnp.exp(scores - row_max)
    total_weight = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total_weight > 0, total_weight, 1.0)
    out = jnp.einsum("bhij,bhjd->bhid", probs.astype(v.dtype), vp, precision=precision,
                     preferred_element_type=jnp.float32) / max_seq_len
    out = padded_to_jagged(out.astype(q.dtype), offsets, total)
    return jnp.swapaxes(out, 0, 1) if layout == "THD" else out
