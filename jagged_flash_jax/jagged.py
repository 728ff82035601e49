"""Offsets and padding helpers for jagged batches: tokens of B sequences packed along one axis.

`sequence_bounds` clamps offsets exactly as the kernels do, so every backend reads the same tokens even
for malformed offsets (which `check_offsets` rejects eagerly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _integer_vector(x, name: str):
    x = jnp.asarray(x)
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {x.shape} and dtype {x.dtype}")
    return x


def offsets_from_lengths(lengths, dtype=jnp.int32) -> jax.Array:
    """Offsets [B+1] (0, len_0, len_0 + len_1, ...) of sequences with the given lengths [B]."""
    lengths = _integer_vector(lengths, "lengths")
    if not isinstance(lengths, jax.core.Tracer) and bool(jnp.any(lengths < 0)):
        raise ValueError(f"lengths must be >= 0, got {np.asarray(lengths).tolist()}")
    return jnp.concatenate([jnp.zeros(1, dtype), jnp.cumsum(lengths, dtype=dtype)])


def check_offsets(offsets, total: int) -> None:
    """Eagerly check that offsets are non-negative, non-decreasing and at most `total`.

    Raises ValueError naming the first bad entry. The attention op itself never reads outside its
    arrays whatever the offsets hold, but its result is only meaningful for offsets that pass.
    """
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError("check_offsets needs concrete offsets: call it outside jax.jit")
    a = np.asarray(offsets)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"offsets must be a 1-D integer array, got shape {a.shape} and dtype {a.dtype}")
    if a.size == 0:
        raise ValueError("offsets must have B+1 >= 1 entries, got an empty array")
    if a[0] < 0:
        raise ValueError(f"offsets must be >= 0, got offsets[0] = {a[0]}")
    drops = np.flatnonzero(np.diff(a) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(f"offsets must be non-decreasing, got offsets[{i}] = {a[i]} > "
                         f"offsets[{i + 1}] = {a[i + 1]}")
    if a[-1] > total:
        raise ValueError(f"offsets must be at most the number of tokens {total}, got offsets[-1] = {a[-1]}")


def sequence_bounds(offsets: jax.Array, total: int, max_seq_len: int | None = None):
    """(starts, lengths) [B] of each sequence, clamped into [0, total]; lengths capped at max_seq_len."""
    starts = jnp.clip(offsets[:-1], 0, total)
    ends = jnp.minimum(jnp.maximum(offsets[1:], starts), total)
    lengths = ends - starts
    if max_seq_len is not None:
        lengths = jnp.minimum(lengths, max_seq_len)
    return starts, lengths


def _padded_index(offsets, total: int, max_seq_len: int):
    """Token index [B, L] of each padded position and whether it holds a token."""
    starts, lengths = sequence_bounds(offsets, total, max_seq_len)
    position = jnp.arange(max_seq_len)
    return starts[:, None] + position, position < lengths[:, None]


def jagged_to_padded(x, offsets, max_seq_len: int, padding_value=0) -> jax.Array:
    """[H, T, D] jagged -> [B, H, max_seq_len, D]; each sequence's first max_seq_len tokens."""
    offsets = _integer_vector(offsets, "offsets")
    heads, total, dim = x.shape
    index, valid = _padded_index(offsets, total, max_seq_len)
    if total == 0:
        return jnp.full((index.shape[0], heads, max_seq_len, dim), padding_value, x.dtype)
    gathered = jnp.take(x, jnp.where(valid, index, 0), axis=1)  # [H, B, L, D]
    gathered = jnp.moveaxis(gathered, 1, 0)
    return jnp.where(valid[:, None, :, None], gathered, jnp.asarray(padding_value, x.dtype))


def padded_to_jagged(x, offsets, total: int) -> jax.Array:
    """[B, H, L, D] padded -> [H, total, D] jagged; tokens outside the first L of a sequence are 0."""
    offsets = _integer_vector(offsets, "offsets")
    batch, heads, max_seq_len, dim = x.shape
    index, valid = _padded_index(offsets, total, max_seq_len)
    index = jnp.where(valid, index, total).reshape(-1)  # index `total` is out of range: dropped
    values = jnp.moveaxis(x, 1, 0).reshape(heads, batch * max_seq_len, dim)
    return jnp.zeros((heads, total, dim), x.dtype).at[:, index].set(values, mode="drop")
