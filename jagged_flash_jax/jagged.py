"""Offsets, padding and data-parallel packing helpers for jagged batches (tokens of B sequences packed
along one axis).

`sequence_bounds` clamps offsets exactly as the kernels do, so every backend reads the same tokens even
for malformed offsets (which `check_offsets` rejects eagerly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._util import cdiv


def explicit_mesh(x):
    """The mesh of x's type when some of its axes are Explicit (sharding in types), else None."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh if mesh is not None and not mesh.empty and mesh.explicit_axes else None


def _integer_vector(x, name: str):
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {x.shape} and dtype {x.dtype}")
    return x


def offsets_from_lengths(lengths, dtype=jnp.int32) -> jax.Array:
    """Offsets [B+1] (0, len_0, len_0 + len_1, ...) of sequences with the given lengths [B]."""
    lengths = _integer_vector(lengths, "lengths")
    if not isinstance(lengths, jax.core.Tracer) and bool(jnp.any(lengths < 0)):
        raise ValueError(f"lengths must be >= 0, got {np.asarray(lengths).tolist()}")
    return jnp.concatenate([jnp.zeros(1, dtype), jnp.cumsum(lengths, dtype=dtype)])


def lengths_hint(row: np.ndarray, name: str) -> str:
    """For an error about a concrete row of offsets `name`: a pointer to `offsets_from_lengths` when the
    row reads as sequence lengths (no entry below 0, and a first entry other than 0 or an entry below its
    predecessor), else ""."""
    row = np.asarray(row)
    if row.size == 0 or np.any(row < 0) or (row[0] == 0 and not np.any(np.diff(row) < 0)):
        return ""
    return (f"; if {name} holds the sequences' lengths, pass offsets_from_lengths(lengths) instead "
            f"(offsets are [0, len_0, len_0 + len_1, ...], B+1 entries)")


def order_error(row: np.ndarray, name: str) -> str | None:
    """Why a concrete row of offsets `name` does not rise from 0 without falling, or None."""
    if row[0] < 0:
        return f"{name} must be >= 0, got {name}[0] = {row[0]}"
    drops = np.flatnonzero(np.diff(row) < 0)
    if drops.size:
        i = int(drops[0])
        return (f"{name} must be non-decreasing, got {name}[{i}] = {row[i]} > {name}[{i + 1}] = {row[i + 1]}"
                + lengths_hint(row, name))
    return None


def check_offsets(offsets, total: int) -> None:
    """Eagerly check that offsets are non-negative, non-decreasing and at most `total`.

    Raises ValueError naming the first bad entry. The attention ops never read outside their arrays
    whatever the offsets hold, but their result is only meaningful for offsets that pass.
    """
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError("check_offsets needs concrete offsets: call it outside jax.jit")
    a = np.asarray(offsets)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"offsets must be a 1-D integer array, got shape {a.shape} and dtype {a.dtype}")
    if a.size == 0:
        raise ValueError("offsets must have B+1 >= 1 entries, got an empty array")
    error = order_error(a, "offsets")
    if error:
        raise ValueError(error)
    if a[-1] > total:
        raise ValueError(f"offsets must be at most the number of tokens {total}, got offsets[-1] = {a[-1]}"
                         + lengths_hint(a, "offsets"))


def sequence_bounds(offsets: jax.Array, total: int, max_seq_len: int | None = None):
    """(starts, lengths) [B] of each sequence, clamped into [0, total]; lengths capped at max_seq_len."""
    starts = jnp.clip(offsets[:-1], 0, total)
    ends = jnp.minimum(jnp.maximum(offsets[1:], starts), total)
    lengths = ends - starts
    if max_seq_len is not None:
        lengths = jnp.minimum(lengths, max_seq_len)
    return starts, lengths


def attended_tokens(offsets: jax.Array, total: int, max_seq_len: int) -> jax.Array:
    """Boolean [T]: whether token t is among the first max_seq_len tokens of some sequence (the union of
    the clamped sequences, so malformed offsets give the tokens the kernels write)."""
    starts, lengths = sequence_bounds(offsets, total, max_seq_len)
    edges = jnp.zeros(total + 1, jnp.int32).at[starts].add(1).at[starts + lengths].add(-1)
    return jnp.cumsum(edges[:total]) > 0


def _token_axis(x, layout: str | None, name: str) -> int:
    """The token axis of a jagged array: [T, F] (rank 2), or rank 3 with an explicit layout."""
    if x.ndim == 2 and layout in (None, "THD"):
        return 0
    if x.ndim == 3 and layout in ("THD", "HTD"):
        return 0 if layout == "THD" else 1
    if x.ndim == 3:
        raise ValueError(f"{name} has rank 3: pass layout='THD' ([T, H, D]) or layout='HTD' ([H, T, D])")
    raise ValueError(f"{name} must be [T, F] or, with a layout, [T, H, D] / [H, T, D]; got shape {x.shape}")


def _padded_index(offsets, total: int, max_seq_len: int):
    """Token index [B, L] of each padded position and whether it holds a token."""
    starts, lengths = sequence_bounds(offsets, total, max_seq_len)
    position = jnp.arange(max_seq_len)
    return starts[:, None] + position, position < lengths[:, None]


def jagged_to_padded(x, offsets, max_seq_len: int, padding_value=0, *, layout: str | None = None):
    """Each sequence's first max_seq_len tokens, padded: [T, F] -> [B, L, F]; with layout="THD",
    [T, H, D] -> [B, L, H, D]; with layout="HTD", [H, T, D] -> [B, H, L, D]."""
    offsets = _integer_vector(offsets, "offsets")
    axis = _token_axis(x, layout, "x")
    index, valid = _padded_index(offsets, x.shape[axis], max_seq_len)
    gathered = jnp.take(x, jnp.where(valid, index, x.shape[axis]), axis=axis, mode="fill",
                        fill_value=padding_value)  # [B, L] in place of the token axis
    return jnp.moveaxis(gathered, axis, 0) if axis else gathered


def padded_to_jagged(x, offsets, total: int, *, layout: str | None = None) -> jax.Array:
    """The inverse of `jagged_to_padded`: [B, L, F] -> [T, F] ([B, L, H, D] -> [T, H, D] with
    layout="THD", [B, H, L, D] -> [H, T, D] with "HTD"); tokens not among the first L of a sequence
    are 0."""
    offsets = _integer_vector(offsets, "offsets")
    if x.ndim == 3 and layout in (None, "THD"):
        axis = 0
    elif x.ndim == 4 and layout in ("THD", "HTD"):
        axis = 0 if layout == "THD" else 1
    else:
        raise ValueError(f"x must be [B, L, F] or, with a layout, [B, L, H, D] / [B, H, L, D]; got shape "
                         f"{x.shape} with layout={layout!r}")
    if axis:
        x = jnp.moveaxis(x, 0, 1)  # [H, B, L, D]
    max_seq_len = x.shape[axis + 1]
    index, valid = _padded_index(offsets, total, max_seq_len)
    index = jnp.where(valid, index, total).reshape(-1)  # index `total` is out of range: dropped
    values = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
    out = jnp.zeros((*x.shape[:axis], total, *x.shape[axis + 2:]), x.dtype)
    return out.at[(slice(None),) * axis + (index,)].set(values, mode="drop")


class DataParallelBatch(NamedTuple):
    """A jagged batch split into equal shards along the token axis, one per device.

    values: the packed token-major arrays, [shards * tokens_per_shard, ...] each.
    offsets: [shards, B_local + 1] int32, local to each shard (what the ops take as `offsets`).
    token_index: [shards * tokens_per_shard] int32: the original token of each packed row; -1 for the
      padding at the end of a shard, which no sequence covers.
    """

    values: tuple[jax.Array, ...]
    offsets: jax.Array
    token_index: jax.Array

    def unpack(self, packed: jax.Array, total: int) -> jax.Array:
        """A packed token-major array back in the original token order, [total, ...] (0 elsewhere).

        A gather by an index made on the host from token_index; the result is replicated when `packed`
        is sharded on an explicit mesh (a sharded gather's output sharding is otherwise ambiguous).
        """
        token_index = np.asarray(self.token_index)
        source = np.full(total, token_index.size, np.int64)  # past the end: filled with 0
        kept = token_index >= 0
        source[token_index[kept]] = np.flatnonzero(kept)
        mesh = explicit_mesh(packed)
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return packed.at[jnp.asarray(source)].get(mode="fill", fill_value=0, out_sharding=replicated)


def pack_data_parallel(arrays: jax.Array | Sequence[jax.Array], offsets, num_shards: int, *,
                       tokens_per_shard: int | None = None) -> DataParallelBatch:
    """Split a jagged batch into `num_shards` shards of equal token counts, for data parallelism.

    Shard s takes the consecutive sequences [s * B_local, (s + 1) * B_local), B_local = ceil(B /
    num_shards) (missing ones are empty), and pads its tokens with uncovered ones up to
    `tokens_per_shard` (default: the largest shard's count rounded up to a multiple of 8; give it to
    keep shapes fixed from step to step under jax.jit). Shard the packed arrays and offsets along
    their first axis, e.g. with PartitionSpec("data"), for a sharded jax.jit or a shard_map. Eager:
    it reads the offsets.

    arrays: token-major [T, ...] arrays (one or several) sharing `offsets` [B+1].
    """
    single = isinstance(arrays, jax.Array | np.ndarray)
    arrays = (arrays,) if single else tuple(arrays)
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError("pack_data_parallel reads the offsets: call it outside jax.jit")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    total = arrays[0].shape[0]
    check_offsets(offsets, total)
    for x in arrays:
        if x.shape[0] != total:
            raise ValueError(f"every array must have the {total} tokens of the first, got shape {x.shape}")
    offsets = np.asarray(offsets, np.int64)
    batch = offsets.size - 1
    local_batch = max(1, cdiv(batch, num_shards))
    bounds = np.minimum(np.arange(num_shards + 1) * local_batch, batch)
    firsts, lasts = offsets[bounds[:-1]], offsets[bounds[1:]]
    needed = int((lasts - firsts).max()) if num_shards else 0
    if tokens_per_shard is None:
        tokens_per_shard = max(8, cdiv(needed, 8) * 8)
    elif tokens_per_shard < needed:
        raise ValueError(f"tokens_per_shard={tokens_per_shard} is less than the {needed} tokens of the "
                         f"largest shard")
    local = np.zeros((num_shards, local_batch + 1), np.int64)
    token_index = np.full((num_shards, tokens_per_shard), -1, np.int64)
    for s in range(num_shards):
        own = offsets[bounds[s]:bounds[s + 1] + 1] - firsts[s]
        local[s, :own.size] = own
        local[s, own.size:] = own[-1] if own.size else 0
        count = int(lasts[s] - firsts[s])
        token_index[s, :count] = np.arange(firsts[s], lasts[s])
    token_index = token_index.reshape(-1)
    gather = np.where(token_index >= 0, token_index, total)
    values = tuple(jnp.take(jnp.asarray(x), jnp.asarray(gather), axis=0, mode="fill", fill_value=0)
                   for x in arrays)
    return DataParallelBatch(values, jnp.asarray(local, jnp.int32), jnp.asarray(token_index, jnp.int32))
