"""The Hopper kernels' scores on wgmma tiles: a head's ALiBi slope, the soft cap and ALiBi bias
(`shared.transform_scores` in a tile's layout), and the forward's online-softmax step. SCORES =
(SOFTCAP, ALIBI, QK_SCALE), BAND = (CAUSAL, WINDOW_LEFT, WINDOW_RIGHT), as shared.py's.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..shared import INF, soft_cap
from .pipeline import CONSUMER_ROWS


@gluon.jit
def alibi_slope(slopes_ptr, head, ALIBI: gl.constexpr):
    """ALiBi's slope of query head `head` (slopes [1, H] in units of the unscaled scores), 0 without."""
    if ALIBI:
        slope = gl.load(slopes_ptr + head)
    else:
        slope = 0.0
    return slope


@gluon.jit
def capped_biased(s, offset, slope, SCORES: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                  layout: gl.constexpr):
    """`shared.transform_scores` on a [ROWS, COLS] tile (of `layout`) of unscaled q.k, or of its
    transpose k.q: (x, t), x the scores in units of the unscaled q.k, t the soft cap's tanh (s itself
    without a cap). The ALiBi bias is slope * |offset + r - c| at row r and column c of the tile: offset =
    row0 + shift - key0 on a [queries, keys] tile (rows from row0, keys from key0), key0 - (row0 + shift)
    on a [keys, queries] one, so that |offset + r - c| = |i + shift - j| either way."""
    s, t = soft_cap(s, SCORES)
    if SCORES[1]:
        # In float32: the column offsets within the tile are constants of each thread, the distances
        # exact integers (below 2**24).
        col_floats = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)).to(gl.float32)
        row_floats = (offset + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))).to(gl.float32)
        s = s - slope * gl.abs(gl.expand_dims(row_floats, 1) - gl.expand_dims(col_floats, 0))
    return s, t


@gluon.jit
def softmax_step(s, m_i, l_i, key_start, n_k, queries, masked, BAND: gl.constexpr, SCORES: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """`capped_biased`, then one step of the online softmax, on a tile of unscaled q.k of keys
    [key_start, +BLOCK_N): (p, m, l, alpha). queries = (row0, shift, slope): the warpgroup's first query
    row, the queries' key position shift, the head's ALiBi slope. The scores stay in units of the
    unscaled q.k; the max is subtracted before the scale, so the top score of a row gets exactly 2**0
    at any magnitude."""
    row0, shift, slope = queries
    CAUSAL: gl.constexpr = BAND[0]
    WINDOW_LEFT: gl.constexpr = BAND[1]
    WINDOW_RIGHT: gl.constexpr = BAND[2]
    QK_SCALE: gl.constexpr = SCORES[2]
    BANDED: gl.constexpr = CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    s, _ = capped_biased(s, row0 + (shift - key_start), slope, SCORES, CONSUMER_ROWS, BLOCK_N, s_layout)
    if masked:  # runtime, uniform: the blocks at the band's edges and the last one
        cols = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols < n_k, 0)
        if BANDED:
            rows = row0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, s_layout))
            distance = gl.expand_dims(rows + shift, 1) - gl.expand_dims(cols, 0)  # i + shift - j
            if CAUSAL:
                keep = keep & (distance >= 0)
            if WINDOW_RIGHT >= 0:
                keep = keep & (distance >= -WINDOW_RIGHT)
            if WINDOW_LEFT >= 0:
                keep = keep & (distance <= WINDOW_LEFT)
        s = gl.where(keep, s, -INF)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    if BANDED:  # a row may have seen no key yet (max -inf): subtract 0 there, not -inf
        m_safe = gl.where(m_new == -INF, 0.0, m_new)
    else:
        m_safe = m_new
    alpha = gl.exp2((m_i - m_safe) * QK_SCALE)
    p = gl.exp2((s - gl.expand_dims(m_safe, 1)) * QK_SCALE)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha
