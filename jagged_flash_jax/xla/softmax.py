"""The `xla` implementation of the softmax attention: blockwise pure JAX, with the kernels' semantics and
residuals, on any device (CPU, GPU, TPU).

Flash-style, it cuts each sequence into blocks of queries (keys) and scans over its blocks of keys
(queries) with a running max and sum, so memory is O(T*H*D + T*H*block) whatever the lengths; nothing is
padded to [B, L, L]. Work is about one block per step for every query block, so a batch whose lengths
differ much does some masked work.

Two rules keep it exact where the kernels are. A block reads only its sequence's tokens (the others, past
its end or after the last sequence, are gathered as 0: they may hold inf or nan, and a masked weight of 0
times nan is nan). Scores stay unscaled, as in the kernels: the row max is subtracted before the scale
multiplies, so the top score gets exactly exp(0) = 1 in both passes whatever the scale (a scaled score is
rounded, and at |scores| ~ 1e8 one rounding is worth a factor e^30). So the log-sum-exp residual is the
kernels' too: float32, in units of the unscaled scores (sum_j exp(scale * (s_j - lse)) = 1; the natural
log-sum-exp of the scaled scores is scale * lse), +inf for rows with no key. The soft cap and ALiBi keep
those units: the score is softcap/scale * tanh(scale * q.k / softcap) - slope/scale * |i + n_k - n_q - j|,
and the backward multiplies ds by the cap's derivative (the slopes get no gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import varying_axes
from .._util import cdiv, lse_gradient, slopes_in_score_units
from ..jagged import sequence_bounds

BLOCK = 64  # rows of a query or key block


def _canonical(x, p, tokens):
    """[Z*T, H, D] or [H, Z*T, D] -> [Z, T, H, D] float32."""
    if p.layout == "HTD":
        x = jnp.swapaxes(x, 0, 1)
    return x.reshape(p.num_segments, tokens, *x.shape[1:]).astype(jnp.float32)


def _restore(x, p, dtype):
    """[Z, T, H, D] -> the layout of the problem."""
    x = x.reshape(-1, *x.shape[2:]).astype(dtype)
    return jnp.swapaxes(x, 0, 1) if p.layout == "HTD" else x


def _offsets_rows(offsets, p):
    return jnp.broadcast_to(offsets, (p.num_segments, offsets.shape[-1]))


def _varying_like(values, reference):
    """Scan carries start varying over the manual mesh axes (inside shard_map) that `reference` does."""
    axes = tuple(sorted(varying_axes(reference)))
    return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying") if axes else x, values)


def _precision(p):
    return lax.Precision.HIGHEST if p.input_precision == "ieee" else lax.Precision.DEFAULT


class _Blocks:
    """The blocks of `block` rows of every sequence, listed in a static number of slots
    (ceil(T / block) + B, enough for any lengths); unused slots are masked."""

    def __init__(self, offsets, tokens: int, max_len: int, block: int):
        batch = offsets.shape[0] - 1
        self.starts, self.lengths = sequence_bounds(offsets, tokens, max_len)
        counts = cdiv(self.lengths, block)
        ends = jnp.cumsum(counts)
        slots = jnp.arange(cdiv(tokens, block) + batch)
        self.valid = slots < ends[-1] if batch else jnp.zeros(slots.shape, bool)
        self.sequence = jnp.minimum(jnp.searchsorted(ends, slots, side="right"), max(batch - 1, 0))
        self.first_row = (slots - (ends - counts)[self.sequence]) * block  # within its sequence
        self.rows = self.first_row[:, None] + jnp.arange(block)  # [N, block] positions in the sequence
        self.row_valid = self.valid[:, None] & (self.rows < self.lengths[self.sequence][:, None])
        self.tokens = jnp.where(self.row_valid, self.starts[self.sequence][:, None] + self.rows, tokens)

    def gather(self, x):
        """x [T, ...] -> [N, block, ...]; rows outside read 0."""
        return jnp.take(x, self.tokens, axis=0, mode="fill", fill_value=0)

    def scatter(self, values, tokens: int, fill=0.0):
        """[N, block, ...] -> [T, ...], `fill` outside."""
        out = jnp.full((tokens, *values.shape[2:]), fill, values.dtype)
        return out.at[self.tokens].set(values, mode="drop")


def _other_side(blocks: _Blocks, offsets, tokens: int, max_len: int):
    """(first token, length) [N] of the other side's sequence of each block."""
    starts, lengths = sequence_bounds(offsets, tokens, max_len)
    return starts[blocks.sequence], lengths[blocks.sequence]


def _index_within(starts, rows, lengths, tokens: int):
    """[N, block] token index of rows of each block's sequence; `tokens` (out of range, so a gather
    fills it) for rows past the sequence's length."""
    return jnp.where(rows[None, :] < lengths[:, None], starts[:, None] + rows, tokens)


def distance(query_rows, key_rows, n_q, n_k):
    """[N, Q, K]: i + n_k - n_q - j, query i's key position (bottom-right aligned) less key j."""
    return query_rows[:, :, None] + (n_k - n_q)[:, None, None] - key_rows[:, None, :]


def allowed(query_rows, key_rows, n_q, n_k, causal, window=(None, None)):
    """[N, Q, K]: key j < n_k, and j <= i + n_k - n_q when causal (bottom-right aligned), and within the
    window (left, right): -right <= i + n_k - n_q - j <= left, a None bound being none."""
    keep = key_rows[:, None, :] < n_k[:, None, None]
    distances = distance(query_rows, key_rows, n_q, n_k)
    left, right = window
    if causal:
        keep &= key_rows[:, None, :] <= query_rows[:, :, None] + (n_k - n_q)[:, None, None]
    if right is not None:
        keep &= distances >= -right
    if left is not None:
        keep &= distances <= left
    return keep


def _transform(p, scores, distances, slopes):
    """(x, t): the scores the softmax takes, in units of the unscaled ones (see the module docstring),
    and the tanh of the soft cap (the cap's derivative is 1 - t^2). scores [N, Q, G, R, K], distances
    [N, Q, K], slopes [G, R] already divided by the scale."""
    t = x = scores
    if p.softcap is not None:
        cap = p.softcap / p.scale
        t = jnp.tanh(scores / cap)
        x = cap * t
    if p.alibi:
        x = x - slopes[None, None, :, :, None] * jnp.abs(distances)[:, :, None, None, :]
    return x, t


class _QueryBlocks:
    """The query blocks of one segment and, block of keys by block of keys, the scores they see: what
    the forward and dq passes share."""

    def __init__(self, p, q, k, v, q_offsets, kv_offsets, slopes):
        self.p, self.k, self.v, self.slopes = p, k, v, slopes
        self.blocks = _Blocks(q_offsets, p.q_tokens, p.max_seq_len, BLOCK)
        self.kv_start, self.n_k = _other_side(self.blocks, kv_offsets, p.kv_tokens, p.kv_max_seq_len)
        self.n_q = self.blocks.lengths[self.blocks.sequence]
        self.split = (*self.blocks.tokens.shape, p.num_kv_heads, p.num_heads // p.num_kv_heads)  # N Q G R
        self.q = self.gather(q)
        self.key_blocks = jnp.arange(cdiv(min(p.kv_max_seq_len, p.kv_tokens), BLOCK))

    def gather(self, x):
        """x [T_q, H, D] -> [N, Q, G, R, D]."""
        return self.blocks.gather(x).reshape(*self.split, self.p.head_dim)

    def scores(self, key_block):
        """(k, v blocks [N, K, G, D], scores [N, Q, G, R, K] and their cap's tanh (see `_transform`),
        which scores count) of a key block; keys past the sequence's n_k read 0."""
        key_rows = key_block * BLOCK + jnp.arange(BLOCK)
        index = _index_within(self.kv_start, key_rows, self.n_k, self.p.kv_tokens)
        kb, vb = (jnp.take(x, index, axis=0, mode="fill", fill_value=0) for x in (self.k, self.v))
        scores = jnp.einsum("nqgrd,nkgd->nqgrk", self.q, kb, precision=_precision(self.p))
        key_rows = jnp.broadcast_to(key_rows, (self.n_q.shape[0], BLOCK))
        scores, t = _transform(self.p, scores, distance(self.blocks.rows, key_rows, self.n_q, self.n_k),
                               self.slopes)
        keep = allowed(self.blocks.rows, key_rows, self.n_q, self.n_k, self.p.causal, self.p.window)
        return kb, vb, scores, t, keep[:, :, None, None, :]

    def scatter(self, x, fill=0.0):
        """[N, Q, G, R, ...] -> [T_q, H, ...]."""
        return self.blocks.scatter(x.reshape(*self.blocks.tokens.shape, self.p.num_heads, *x.shape[4:]),
                                   self.p.q_tokens, fill)


def _segment_forward(p, q, k, v, q_offsets, kv_offsets, slopes):
    """One segment: q [T_q, H, D], k, v [T_kv, Hk, D] float32, ALiBi's slopes [G, R] divided by the
    scale -> o [T_q, H, D], lse [H, T_q]."""
    side = _QueryBlocks(p, q, k, v, q_offsets, kv_offsets, slopes)

    def step(carry, key_block):
        acc, row_sum, row_max = carry
        _, vb, scores, _, keep = side.scores(key_block)
        scores = jnp.where(keep, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, scores.max(-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.exp((scores - safe_max[..., None]) * p.scale)
        correction = jnp.exp((row_max - safe_max) * p.scale)
        row_sum = row_sum * correction + weights.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("nqgrk,nkgd->nqgrd", weights, vb,
                                                       precision=_precision(p))
        return (acc, row_sum, new_max), None

    f32 = jnp.float32  # also under jax_enable_x64, whose default float is float64
    init = (jnp.zeros((*side.split, p.head_dim), f32), jnp.zeros(side.split, f32),
            jnp.full(side.split, -jnp.inf, f32))
    (acc, row_sum, row_max), _ = lax.scan(step, _varying_like(init, side.q), side.key_blocks)
    seen = row_sum != 0  # a NaN sum (NaN inputs) is seen: its lse is NaN, not the +inf of no key
    o = acc * (p.out_scale / jnp.where(seen, row_sum, 1.0))[..., None]
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)) / p.scale, jnp.inf)
    return side.scatter(o), side.scatter(lse, jnp.inf).T


def _probabilities(p, scores, lse):
    """The backward's probabilities from the forward's log-sum-exp, bounded by 1: its scores are formed
    again, and at large logits a rounding other than the forward's would put exp(s - lse) past 1 (a NaN
    stays NaN)."""
    return jnp.exp(jnp.minimum((scores - lse[..., None]) * p.scale, 0.0))


def _segment_dq(p, q, k, v, do, lse, delta, q_offsets, kv_offsets, slopes):
    side = _QueryBlocks(p, q, k, v, q_offsets, kv_offsets, slopes)
    dob = side.gather(do)
    lseb, deltab = (jnp.take(x.T, side.blocks.tokens, axis=0, mode="fill", fill_value=fill)
                    .reshape(side.split) for x, fill in ((lse, jnp.inf), (delta, 0.0)))

    def step(dq, key_block):
        kb, vb, scores, t, keep = side.scores(key_block)
        probs = jnp.where(keep, _probabilities(p, scores, lseb), 0.0)
        dp = p.out_scale * jnp.einsum("nqgrd,nkgd->nqgrk", dob, vb, precision=_precision(p))
        ds = probs * (dp - deltab[..., None])
        if p.softcap is not None:
            ds = ds * (1 - t * t)
        return dq + jnp.einsum("nqgrk,nkgd->nqgrd", ds, kb, precision=_precision(p)), None

    dq, _ = lax.scan(step, _varying_like(jnp.zeros(side.q.shape, jnp.float32), side.q), side.key_blocks)
    return side.scatter(p.scale * dq)


def _segment_dkdv(p, q, k, v, do, lse, delta, q_offsets, kv_offsets, slopes):
    group = p.num_heads // p.num_kv_heads
    blocks = _Blocks(kv_offsets, p.kv_tokens, p.kv_max_seq_len, BLOCK)
    q_start, n_q = _other_side(blocks, q_offsets, p.q_tokens, p.max_seq_len)
    n_k = blocks.lengths[blocks.sequence]
    kb, vb = blocks.gather(k), blocks.gather(v)  # [N, K, G, D]
    split = (p.q_tokens, p.num_kv_heads, group)
    q, do = q.reshape(*split, p.head_dim), do.reshape(*split, p.head_dim)
    lse, delta = lse.T.reshape(split), delta.T.reshape(split)

    def step(carry, query_block):
        dk, dv = carry
        query_rows = query_block * BLOCK + jnp.arange(BLOCK)
        index = _index_within(q_start, query_rows, n_q, p.q_tokens)  # queries past n_q read 0, lse inf
        qb, dob, deltab = (jnp.take(x, index, axis=0, mode="fill", fill_value=0) for x in (q, do, delta))
        lseb = jnp.take(lse, index, axis=0, mode="fill", fill_value=jnp.inf)
        scores = jnp.einsum("nqgrd,nkgd->nqgrk", qb, kb, precision=_precision(p))
        query_rows = jnp.broadcast_to(query_rows, (n_q.shape[0], BLOCK))
        scores, t = _transform(p, scores, distance(query_rows, blocks.rows, n_q, n_k), slopes)
        keep = allowed(query_rows, blocks.rows, n_q, n_k, p.causal, p.window)[:, :, None, None, :]
        probs = jnp.where(keep, _probabilities(p, scores, lseb), 0.0)
        dv = dv + p.out_scale * jnp.einsum("nqgrk,nqgrd->nkgd", probs, dob, precision=_precision(p))
        dp = p.out_scale * jnp.einsum("nqgrd,nkgd->nqgrk", dob, vb, precision=_precision(p))
        ds = probs * (dp - deltab[..., None])
        if p.softcap is not None:
            ds = ds * (1 - t * t)
        dk = dk + p.scale * jnp.einsum("nqgrk,nqgrd->nkgd", ds, qb, precision=_precision(p))
        return (dk, dv), None

    query_blocks = cdiv(min(p.max_seq_len, p.q_tokens), BLOCK)
    init = _varying_like((jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32)), kb)
    (dk, dv), _ = lax.scan(step, init, jnp.arange(query_blocks))
    return blocks.scatter(dk, p.kv_tokens), blocks.scatter(dv, p.kv_tokens)


def _slopes(p, slopes):
    """ALiBi's slopes [Z, H] as [Z, G, R] float32 in units of the unscaled scores (zeros without),
    clamped to float32's range (see `slopes_in_score_units`)."""
    split = (p.num_segments, p.num_kv_heads, p.num_heads // p.num_kv_heads)
    if not p.alibi:
        return jnp.zeros(split, jnp.float32)
    return jnp.broadcast_to(slopes_in_score_units(slopes, p.scale), split[:1] + (p.num_heads,)).reshape(split)


def forward(p, q, k, v, q_offsets, kv_offsets, slopes=None):
    """The `xla` backend's forward: o and the log-sum-exp [Z, H, T_q] (in units of the unscaled
    scores, as the kernels', +inf where no key). slopes: ALiBi's [Z, H] when p.alibi."""
    if p.empty or p.kv_tokens == 0 or p.batch == 0:
        return jnp.zeros(p.q_shape, q.dtype), jnp.full(p.stats_shape, jnp.inf, jnp.float32)
    q32, k32, v32 = _canonical(q, p, p.q_tokens), _canonical(k, p, p.kv_tokens), _canonical(v, p, p.kv_tokens)
    o, lse = jax.vmap(lambda *a: _segment_forward(p, *a))(
        q32, k32, v32, _offsets_rows(q_offsets, p), _offsets_rows(kv_offsets, p), _slopes(p, slopes))
    return _restore(o, p, q.dtype), lse


def backward(p, q, k, v, q_offsets, kv_offsets, o, lse, do, slopes=None, dlse=None):
    """The `xla` backend's backward: dq, dk, dv from the residuals of `forward`, the output gradient and,
    unless None, the log-sum-exp's gradient [Z, H, T_q] (in its units)."""
    if p.empty or p.kv_tokens == 0 or p.batch == 0:
        return jnp.zeros(p.q_shape, q.dtype), jnp.zeros(p.kv_shape, k.dtype), jnp.zeros(p.kv_shape, v.dtype)
    q32, do32, o32 = (_canonical(x, p, p.q_tokens) for x in (q, do, o))
    k32, v32 = _canonical(k, p, p.kv_tokens), _canonical(v, p, p.kv_tokens)
    delta = jnp.swapaxes(jnp.sum(o32 * do32, axis=-1), 1, 2)  # [Z, H, T_q]
    if dlse is not None:  # here dL/ds = scale * p * (dp - delta), dp with the output scale
        delta = delta - lse_gradient(lse, dlse, p.scale)
    offsets = (_offsets_rows(q_offsets, p), _offsets_rows(kv_offsets, p))
    args = (q32, k32, v32, do32, lse, delta, *offsets, _slopes(p, slopes))
    dq = jax.vmap(lambda *a: _segment_dq(p, *a))(*args)
    dk, dv = jax.vmap(lambda *a: _segment_dkdv(p, *a))(*args)
    return _restore(dq, p, q.dtype), _restore(dk, p, k.dtype), _restore(dv, p, v.dtype)
