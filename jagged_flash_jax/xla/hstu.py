"""HSTU attention's `xla` backend: blockwise pure JAX, flash-style, forward and backward.

The semantics are `reference.hstu_attention_reference`'s (generative-recommenders' `hstu_mha`): per
sequence, o_i = s_i * sum_j mask_ij * silu(alpha * q_i . k_j) * v_j over its first max_seq_len tokens,
mask = `hstu_mask` (below; public as `reference.hstu_mask`), s_i = the problem's constant scale or a
per-token operand (problem.py's HstuProblem). Segments of the token axis (vmap, data-parallel packing)
run side by side (jax.vmap).

The structure is the softmax implementation's (xla/softmax.py): the tokens of each
sequence are cut into blocks of BLOCK rows listed in a static number of slots (ceil(T / BLOCK) + B, see
`_Rows`); the forward and the dq pass scan over key blocks for every query block, the dk/dv pass over
query blocks for every key block. Memory is O(T*H*D + T*H*BLOCK) whatever the lengths: nothing is padded
to [B, L, L]. A block reads only its sequence's first max_seq_len tokens: the others are gathered as 0
and masked with `where`, so inf or nan in tokens that no query attends never reach a result.

No softmax, so no running max and no log-sum-exp: each key block's silu weights are final when computed,
the forward just adds them up (its scan carries the accumulator alone), and the backward needs no
residual but the inputs (q, k, v, do, the scale): it recomputes silu where the softmax backward reads the
log-sum-exp, and needs no delta = rowsum(o * do) pass either, so the forward's output is not kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import varying_axes
from .._util import cdiv
from ..jagged import sequence_bounds
from ..problem import HstuProblem

BLOCK = 64  # rows of a query or key block


def hstu_mask(query_pos, key_pos, lengths, num_targets=None, *, causal: bool = True, max_attn_len: int = 0,
              contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0):
    """HSTU's attention mask: [..., Q, K] bool, whether the query at position `query_pos` [..., Q]
    (within its sequence, 0-based) sees the key at `key_pos` [..., K] of the same sequence, whose full
    length is `lengths` [...] (not capped at max_seq_len) and whose last `num_targets` [...] tokens are
    targets (None: no targets). The leading dimensions broadcast. Positions at or past a sequence's
    (capped) length are the caller's to mask: this is the rule, not the bounds.

    generative-recommenders' arithmetic (`_get_valid_attn_mask`), with c = contextual_seq_len,
    W = max_attn_len, M = min_full_attn_seq_len, n = lengths, t = num_targets:
      id(p) = max(p - c + 1, 0) when c > 0 (the c context tokens share id 0, the first history token
              has id 1), else p;
      m     = n - (c - 1 if c > 0 else 0) - t, the history's end in ids (the id of the first target);
      with targets, id(p) = min(id(p), m): every target has the id m;
      d     = id(i) - id(j), or |id(i) - id(j)| when not causal;
      valid = (i == j) or d > 0                      (the diagonal by position, not by id)
      W > 0: valid and= d <= W, or id(i) >= m - M when M > 0 (lifted for the last M history rows and
              for every target);
      c > 0: valid or= id(i) == 0 and id(j) < m      (the context rows see every context and history
              token, after the window: so the window, not this, decides which rows see the context).
    So equal ids never see each other off the diagonal: the targets see the history and themselves, and
    with c > 1 the context tokens see each other only through the last rule.
    """
    query_pos, key_pos, lengths = (jnp.asarray(x, jnp.int32) for x in (query_pos, key_pos, lengths))
    max_id = lengths
    if contextual_seq_len > 0:
        max_id = max_id - contextual_seq_len + 1
    if num_targets is not None:
        max_id = max_id - jnp.asarray(num_targets, jnp.int32)

    def ids(pos):
        if contextual_seq_len > 0:
            pos = jnp.maximum(pos - contextual_seq_len + 1, 0)
        return jnp.minimum(pos, max_id[..., None]) if num_targets is not None else pos

    row, col = ids(query_pos)[..., :, None], ids(key_pos)[..., None, :]
    max_id = max_id[..., None, None]
    distance = row - col
    if not causal:
        distance = jnp.abs(distance)
    valid = (query_pos[..., :, None] == key_pos[..., None, :]) | (distance > 0)
    if max_attn_len > 0:
        near = distance <= max_attn_len
        if min_full_attn_seq_len > 0:
            near |= row >= max_id - min_full_attn_seq_len
        valid &= near
    if contextual_seq_len > 0:
        valid |= (row == 0) & (col < max_id)
    return valid



def _precision(p):
    return lax.Precision.HIGHEST if p.input_precision == "ieee" else lax.Precision.DEFAULT


def _canonical(x, p):
    """[Z*T, H, .] or [H, Z*T, .] -> [Z, T, H, .] float32."""
    x = jnp.swapaxes(x, 0, 1) if p.layout == "HTD" else x
    return x.reshape(p.num_segments, p.tokens, *x.shape[1:]).astype(jnp.float32)


def _restore(x, p, dtype):
    """[Z, T, H, .] -> the problem's layout."""
    x = x.reshape(-1, *x.shape[2:]).astype(dtype)
    return jnp.swapaxes(x, 0, 1) if p.layout == "HTD" else x


def _rows(x, p, rows: int):
    """A per-sequence operand [rows, n] as [Z, n] (one shared row broadcast)."""
    return None if x is None else jnp.broadcast_to(x, (p.num_segments, x.shape[-1]))


def _varying_like(values, reference):
    """Scan carries start varying over the manual mesh axes (inside shard_map) that `reference` does."""
    axes = tuple(sorted(varying_axes(reference)))
    return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying") if axes else x, values)


class _Rows:
    """The blocks of BLOCK rows of every sequence's first max_seq_len tokens, in ceil(T / BLOCK) + B
    slots (enough for any lengths; unused slots are masked), as reference._Blocks; and, per slot, its
    sequence's first token, full length n (the mask's), attended length min(n, max_seq_len) and targets."""

    def __init__(self, p: HstuProblem, offsets, num_targets):
        self.p = p
        starts, lengths = sequence_bounds(offsets, p.tokens)
        attended = jnp.minimum(lengths, p.max_seq_len)
        counts = cdiv(attended, BLOCK)
        ends = jnp.cumsum(counts)
        slots = jnp.arange(cdiv(p.tokens, BLOCK) + p.batch)
        valid = slots < ends[-1]
        sequence = jnp.minimum(jnp.searchsorted(ends, slots, side="right"), p.batch - 1)
        self.rows = ((slots - (ends - counts)[sequence]) * BLOCK)[:, None] + jnp.arange(BLOCK)  # [N, BLOCK]
        self.start, self.length, self.attended = starts[sequence], lengths[sequence], attended[sequence]
        self.targets = jnp.asarray(num_targets, jnp.int32)[sequence] if p.has_targets else None
        self.tokens = self.index(self.rows, valid[:, None])
        self.other_blocks = jnp.arange(cdiv(min(p.max_seq_len, p.tokens), BLOCK))  # what a slot scans

    def index(self, rows, valid=True):
        """[N, R] token of each row (a position in each slot's sequence); T (gathered as 0) outside."""
        inside = valid & (rows < self.attended[:, None])
        return jnp.where(inside, self.start[:, None] + rows, self.p.tokens)

    def other(self, block):
        """(positions [N, BLOCK], tokens [N, BLOCK]) of block `block` of each slot's sequence."""
        rows = jnp.broadcast_to(block * BLOCK + jnp.arange(BLOCK), self.rows.shape)
        return rows, self.index(rows)

    def mask(self, query_rows, key_rows, query_tokens, key_tokens):
        """[N, Q, 1, K]: hstu_mask, and both tokens attended."""
        keep = hstu_mask(query_rows, key_rows, self.length, self.targets, **self.p.mask_options())
        keep &= (query_tokens < self.p.tokens)[:, :, None] & (key_tokens < self.p.tokens)[:, None, :]
        return keep[:, :, None, :]

    def scatter(self, values, fill=0.0):
        """[N, BLOCK, ...] of the slots' rows -> [T, ...], `fill` outside."""
        out = jnp.full((self.p.tokens, *values.shape[2:]), fill, values.dtype)
        return out.at[self.tokens].set(values, mode="drop")


def _gather(x, tokens):
    return jnp.take(x, tokens, axis=0, mode="fill", fill_value=0)


def _row_scale(p, scale, tokens):
    """s_i of the rows `tokens` [N, R]: [N, R, 1, 1], or the constant p.scale."""
    if p.scale is not None:
        return jnp.float32(p.scale)
    return _gather(scale, tokens)[:, :, None, None]


def _silu_parts(p, qb, kb):
    """(u, sigmoid(u)) of u = alpha * q . k: [N, Q, H, K]."""
    u = p.alpha * jnp.einsum("nqhd,nkhd->nqhk", qb, kb, precision=_precision(p))
    return u, jax.nn.sigmoid(u)


def forward(p: HstuProblem, q, k, v, offsets, num_targets=None, scale=None):
    """o (in p.layout, q's dtype): the `xla` implementation's forward. offsets [rows, B+1], num_targets
    [rows, B] when p.has_targets, scale [Z*T] float32 when p.scale is None."""
    dtype = q.dtype
    if p.empty:
        return jnp.zeros(p.shape(p.value_dim), dtype)
    q, k, v = (_canonical(x, p) for x in (q, k, v))
    scale = None if scale is None else scale.reshape(p.num_segments, p.tokens)
    o = jax.vmap(lambda *a: _segment_forward(p, *a))(q, k, v, _rows(offsets, p, p.offsets_rows),
                                                       _rows(num_targets, p, p.offsets_rows), scale)
    return _restore(o, p, dtype)


def _segment_forward(p, q, k, v, offsets, num_targets, scale):
    side = _Rows(p, offsets, num_targets)
    qb = _gather(q, side.tokens)  # [N, Q, H, D]

    def step(acc, key_block):
        key_rows, key_tokens = side.other(key_block)
        kb, vb = _gather(k, key_tokens), _gather(v, key_tokens)
        u, sig = _silu_parts(p, qb, kb)
        weights = jnp.where(side.mask(side.rows, key_rows, side.tokens, key_tokens), u * sig, 0.0)
        return acc + jnp.einsum("nqhk,nkhv->nqhv", weights, vb, precision=_precision(p)), None

    init = jnp.zeros((*side.tokens.shape, p.num_heads, p.value_dim), jnp.float32)
    acc, _ = lax.scan(step, _varying_like(init, qb), side.other_blocks)
    o = acc * _row_scale(p, scale, side.tokens)  # s_i is one factor per row: applied once, here
    return side.scatter(o)


def backward(p: HstuProblem, q, k, v, offsets, num_targets, scale, do):
    """(dq, dk, dv, dscale) from the inputs and the output's cotangent do: the `xla` implementation's
    backward. With u = alpha q.k, silu'(u) = sigmoid(u) (1 + u (1 - sigmoid(u))) and dp_ij = do_i . v_j:
    dv_j = sum_i m s_i silu(u_ij) do_i, dq_i = alpha s_i sum_j m dp_ij silu'(u_ij) k_j, dk_j likewise
    over i, and the per-token scale's gradient of each head, sum_j m silu(u_ij) dp_ij ([Z, H, T]
    float32, which the op sums over the heads; None when the scale is the constant p.scale)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if p.empty:
        grads = (jnp.zeros(p.shape(p.head_dim), dtypes[0]), jnp.zeros(p.shape(p.head_dim), dtypes[1]),
                 jnp.zeros(p.shape(p.value_dim), dtypes[2]))
        return (*grads, None if scale is None else jnp.zeros(
            (p.num_segments, p.num_heads, p.tokens), jnp.float32))
    q, k, v, do = (_canonical(x, p) for x in (q, k, v, do))
    rows = (_rows(offsets, p, p.offsets_rows), _rows(num_targets, p, p.offsets_rows))
    scale_rows = None if scale is None else scale.reshape(p.num_segments, p.tokens)
    dq, dscale = jax.vmap(lambda *a: _segment_dq(p, *a))(q, k, v, do, *rows, scale_rows)
    dk, dv = jax.vmap(lambda *a: _segment_dkdv(p, *a))(q, k, v, do, *rows, scale_rows)
    grads = (_restore(g, p, dtype) for g, dtype in zip((dq, dk, dv), dtypes))
    return (*grads, None if scale is None else jnp.swapaxes(dscale, 1, 2))  # [Z, H, T]


def _segment_dq(p, q, k, v, do, offsets, num_targets, scale):
    """dq [T, H, D] and the per-token scale's gradient of each head [T, H] (None with a constant scale) of
    one segment:
    the query blocks scan the key blocks, as the forward."""
    side = _Rows(p, offsets, num_targets)
    qb, dob = _gather(q, side.tokens), _gather(do, side.tokens)
    with_scale = p.scale is None

    def step(carry, key_block):
        dq, d_scale = carry
        key_rows, key_tokens = side.other(key_block)
        kb, vb = _gather(k, key_tokens), _gather(v, key_tokens)
        u, sig = _silu_parts(p, qb, kb)
        keep = side.mask(side.rows, key_rows, side.tokens, key_tokens)
        dp = jnp.einsum("nqhv,nkhv->nqhk", dob, vb, precision=_precision(p))
        du = jnp.where(keep, dp * sig * (1 + u * (1 - sig)), 0.0)
        dq = dq + jnp.einsum("nqhk,nkhd->nqhd", du, kb, precision=_precision(p))
        if with_scale:
            d_scale = d_scale + jnp.where(keep, u * sig * dp, 0.0).sum(-1)
        return (dq, d_scale), None

    init = (jnp.zeros(qb.shape, jnp.float32),
            jnp.zeros((*side.tokens.shape, p.num_heads), jnp.float32) if with_scale else None)
    (dq, d_scale), _ = lax.scan(step, _varying_like(init, qb), side.other_blocks)
    dq = dq * (p.alpha * _row_scale(p, scale, side.tokens))
    return side.scatter(dq), side.scatter(d_scale) if with_scale else None


def _segment_dkdv(p, q, k, v, do, offsets, num_targets, scale):
    """dk [T, H, D], dv [T, H, V] of one segment: the key blocks (the same slots) scan the query
    blocks."""
    side = _Rows(p, offsets, num_targets)
    kb, vb = _gather(k, side.tokens), _gather(v, side.tokens)

    def step(carry, query_block):
        dk, dv = carry
        query_rows, query_tokens = side.other(query_block)
        qb, dob = _gather(q, query_tokens), _gather(do, query_tokens)
        row_scale = _row_scale(p, scale, query_tokens)
        u, sig = _silu_parts(p, qb, kb)
        keep = side.mask(query_rows, side.rows, query_tokens, side.tokens)
        weights = jnp.where(keep, u * sig * row_scale, 0.0)
        dv = dv + jnp.einsum("nqhk,nqhv->nkhv", weights, dob, precision=_precision(p))
        dp = jnp.einsum("nqhv,nkhv->nqhk", dob, vb, precision=_precision(p))
        du = jnp.where(keep, dp * sig * (1 + u * (1 - sig)) * row_scale, 0.0)
        dk = dk + jnp.einsum("nqhk,nqhd->nkhd", du, qb, precision=_precision(p))
        return (dk, dv), None

    init = _varying_like((jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32)), kb)
    (dk, dv), _ = lax.scan(step, init, side.other_blocks)
    return side.scatter(p.alpha * dk), side.scatter(dv)
