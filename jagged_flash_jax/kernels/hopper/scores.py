"""The Hopper kernels' score transform on wgmma tiles (soft cap, ALiBi), a head's ALiBi slope, and the
forward's online-softmax step.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..shared import INF, tanh
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
def capped_biased(s, offset, slope, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, ROWS: gl.constexpr,
                   COLS: gl.constexpr, layout: gl.constexpr):
    """common._scores on a [ROWS, COLS] tile (of `layout`) of unscaled q.k, or of its transpose k.q:
    (x, t), x the scores in units of the unscaled q.k, t the soft cap's tanh (its derivative is 1 - t^2;
    s itself when SOFTCAP is 0). SOFTCAP is the cap divided by the scale (0: none): x = SOFTCAP *
    tanh(s / SOFTCAP). With ALIBI, x -= slope * |offset + r - c| at row r and column c of the tile, the
    slope divided by the scale: offset = row0 + shift - key0 on a [queries, keys] tile (rows from row0,
    keys from key0), key0 - (row0 + shift) on a [keys, queries] one, so that |offset + r - c| =
    |i + shift - j| either way."""
    t = s
    if SOFTCAP > 0:
        t = tanh(s * (1.0 / SOFTCAP))
        s = t * SOFTCAP
    if ALIBI:
        # In float32: the column offsets within the tile are constants of each thread, the distances
        # exact integers (below 2**24).
        col_floats = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout)).to(gl.float32)
        row_floats = (offset + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))).to(gl.float32)
        s = s - slope * gl.abs(gl.expand_dims(row_floats, 1) - gl.expand_dims(col_floats, 0))
    return s, t


@gluon.jit
def softmax_step(s, m_i, l_i, key_start, n_k, row0, shift, slope, masked, QK_SCALE: gl.constexpr,
                  CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                  SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    """common._scores then common._online_softmax on one tile of unscaled q.k: (p, m, l, alpha). The
    scores stay in units of the unscaled q.k (SOFTCAP and the slope divided by the scale); the max is
    subtracted before the scale, so the top score of a row gets exactly 2**0 at any magnitude."""
    BANDED: gl.constexpr = CAUSAL or WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0
    s, _ = capped_biased(s, row0 + (shift - key_start), slope, SOFTCAP, ALIBI, CONSUMER_ROWS, BLOCK_N,
                          s_layout)
    if masked:  # runtime, uniform: the blocks at the band's edges and the last one (common._band)
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

