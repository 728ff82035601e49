"""The semantics both kernel families share, in pure Triton: a sequence's extent and attended length, the
tokens the zero fills write, the band of keys each query sees (one mask), the key blocks a query block
visits and the query blocks a key block visits, the score transform (soft cap, ALiBi), and the
runtime-parameter slots every attention kernel starts with. Scalars and elementwise code only, so that
Gluon code calls it on its own layouts.

Compile-time options travel as tuples of constexprs, named in capitals: BAND = (CAUSAL, WINDOW_LEFT,
WINDOW_RIGHT), SCORES = (SOFTCAP, ALIBI, QK_SCALE). Bind one to a name as `BAND: tl.constexpr = (...)`
and read it by index or as `CAUSAL: tl.constexpr = BAND[0]`: names assigned otherwise become tensors.
"""

import triton
import triton.language as tl

from .spec import ATTENTION_PARAMS

INF: tl.constexpr = tl.constexpr(float("inf"))

# The slots every attention kernel's runtime parameters start with (kernels/spec.py's ATTENTION_PARAMS).
PARAM_BATCH: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("batch"))
PARAM_Q_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_tokens"))
PARAM_KV_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_tokens"))
PARAM_Q_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_token_stride"))
PARAM_Q_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_head_stride"))
PARAM_KV_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_token_stride"))
PARAM_KV_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_head_stride"))
PARAM_Q_OFFSETS_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("q_offsets_stride"))
PARAM_KV_OFFSETS_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_PARAMS.index("kv_offsets_stride"))


# ---------------------------------------------------------------------------------------------------
# A sequence
# ---------------------------------------------------------------------------------------------------


@triton.jit
def extent(offsets_ptr, sequence, num_tokens):
    """First and end token (int64) of a sequence.

    Offsets are clamped into [0, num_tokens] and each end to at least its start, so that no content of
    `offsets` (negative, decreasing, past the end) can address memory outside the arrays.
    """
    start = tl.load(offsets_ptr + sequence).to(tl.int64)
    end = tl.load(offsets_ptr + sequence + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    return start, tl.minimum(tl.maximum(end, start), num_tokens)


@triton.jit
def bounds(offsets_ptr, sequence, num_tokens, MAX_LEN: tl.constexpr):
    """First token (int64) and attended length (int32) of a sequence: its first MAX_LEN tokens attend
    and are attended, the rest are zero-filled."""
    start, end = extent(offsets_ptr, sequence, num_tokens)
    return start, tl.minimum(end - start, MAX_LEN).to(tl.int32)


# ---------------------------------------------------------------------------------------------------
# The zero fills' decisions: which tokens no sequence attends. Each family keeps its own store loops:
# Gluon tensors need explicit layouts, which a `tl` routine cannot give them.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def chunk_tokens(chunk, fill_chunk, num_tokens):
    """Tokens [first, last) (int64) of fill chunk `chunk`, of fill_chunk tokens each."""
    first = chunk.to(tl.int64) * fill_chunk
    return first, tl.minimum(first + fill_chunk, num_tokens)


@triton.jit
def decreasing(offsets_ptr, index, batch, num_tokens):
    """Whether sequence `index` (elementwise; < batch, else false) ends before it starts, its offsets
    clamped as `extent` clamps them: then the offsets are malformed."""
    valid = index < batch
    lo = tl.load(offsets_ptr + index, mask=valid, other=0).to(tl.int64)
    hi = tl.load(offsets_ptr + index + 1, mask=valid, other=0).to(tl.int64)
    lo = tl.minimum(tl.maximum(lo, 0), num_tokens)
    hi = tl.minimum(tl.maximum(hi, 0), num_tokens)
    return valid & (hi < lo)


@triton.jit
def covered_range(offsets_ptr, batch, num_tokens):
    """[start, end) (int64) of the tokens the sequences cover when the offsets are sorted: the tokens
    outside are no sequence's."""
    covered_start = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), num_tokens)
    covered_end = tl.minimum(tl.maximum(tl.load(offsets_ptr + batch).to(tl.int64), covered_start), num_tokens)
    return covered_start, covered_end


@triton.jit
def attended(tokens, offsets_ptr, batch, num_tokens, MAX_LEN: tl.constexpr):
    """Whether each token is among some sequence's first MAX_LEN, checked against every sequence: for
    malformed offsets (slow, but right)."""
    covered = tokens < 0
    for sequence in range(0, batch):
        start, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
        covered = covered | ((tokens >= start) & (tokens < start + length))
    return covered


# ---------------------------------------------------------------------------------------------------
# The band: which keys each query sees
# ---------------------------------------------------------------------------------------------------


@triton.jit
def query_shift(n_q, n_k, ALIGNED: tl.constexpr):
    """Query i sits at key position i + shift, bottom-right aligned (0 where nothing reads it: ALIGNED is
    whether a mask or a bias does)."""
    if ALIGNED:
        return n_k - n_q
    else:
        return 0


@triton.jit
def band(keep, query_rows, key_rows, shift, BAND: tl.constexpr):
    """keep, and whether each key (key_rows, broadcast against query_rows) is in its query's band:
    i + shift - WINDOW_LEFT <= j <= i + shift + WINDOW_RIGHT (a bound of -1 is none), and j <= i + shift
    when CAUSAL."""
    CAUSAL: tl.constexpr = BAND[0]
    WINDOW_LEFT: tl.constexpr = BAND[1]
    WINDOW_RIGHT: tl.constexpr = BAND[2]
    if CAUSAL:
        keep = (key_rows <= query_rows + shift) & keep
    if WINDOW_RIGHT >= 0:
        keep = (key_rows <= query_rows + (shift + WINDOW_RIGHT)) & keep
    if WINDOW_LEFT >= 0:
        keep = (key_rows >= query_rows + (shift - WINDOW_LEFT)) & keep
    return keep


@triton.jit
def ceil_to(x, BLOCK: tl.constexpr):
    return (x + BLOCK - 1) // BLOCK * BLOCK


@triton.jit
def key_ranges(query_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr):
    """For queries [query_start, +BLOCK_M): (start, clean_start, clean_end, end), the keys [start, end)
    some query of the block sees (the blocks outside are skipped: a window's cost grows with its width,
    not with n_k), of which the key blocks in [clean_start, clean_end) need no mask (every query of the
    block sees every key). start and the clean bounds are multiples of BLOCK_N, clean_start <= clean_end,
    and a first loop over [start, min(clean_start, end)) covers the masked keys before the clean ones."""
    CAUSAL: tl.constexpr = BAND[0]
    WINDOW_LEFT: tl.constexpr = BAND[1]
    WINDOW_RIGHT: tl.constexpr = BAND[2]
    shift = n_k - n_q
    last = query_start + BLOCK_M - 1
    start = n_k * 0
    clean_start = n_k * 0
    end = n_k
    clean_end = n_k
    if WINDOW_LEFT >= 0:
        start = tl.maximum(query_start + shift - WINDOW_LEFT, 0)
        clean_start = tl.maximum(last + shift - WINDOW_LEFT, 0)
    if CAUSAL:
        end = tl.minimum(end, last + shift + 1)
        clean_end = tl.minimum(clean_end, query_start + shift + 1)
    if WINDOW_RIGHT >= 0:
        end = tl.minimum(end, last + shift + WINDOW_RIGHT + 1)
        clean_end = tl.minimum(clean_end, query_start + shift + WINDOW_RIGHT + 1)
    start = start // BLOCK_N * BLOCK_N
    clean_start = ceil_to(clean_start, BLOCK_N)
    clean_end = tl.maximum(tl.maximum(clean_end, 0) // BLOCK_N * BLOCK_N, clean_start)
    return start, clean_start, clean_end, tl.maximum(end, 0)


@triton.jit
def query_ranges(key_start, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BAND: tl.constexpr):
    """For keys [key_start, +BLOCK_N): (start, clean_start, clean_end, end), the queries [start, end)
    that see some of them, of which the query blocks in [clean_start, clean_end) see all of them
    (unmasked), as `key_ranges` (multiples of BLOCK_M but end)."""
    CAUSAL: tl.constexpr = BAND[0]
    WINDOW_LEFT: tl.constexpr = BAND[1]
    WINDOW_RIGHT: tl.constexpr = BAND[2]
    if WINDOW_LEFT < 0 and WINDOW_RIGHT < 0:
        # No window: the form ptxas spills least with in the causal backward (the general form below
        # spills several times more bytes at 64 x 128 dk/dv and 128 x 128 dq tiles, 8 warps).
        clean_end = n_q // BLOCK_M * BLOCK_M
        if CAUSAL:
            start = tl.maximum(key_start - (n_k - n_q), 0) // BLOCK_M * BLOCK_M
            diagonal_end = ceil_to(tl.maximum(key_start + BLOCK_N - 1 - (n_k - n_q), 0), BLOCK_M)
            clean_start = tl.minimum(tl.maximum(diagonal_end, start), tl.maximum(clean_end, start))
            return start, clean_start, tl.maximum(clean_start, clean_end), n_q
        return n_q * 0, n_q * 0, clean_end, n_q
    shift = n_k - n_q
    last = key_start + BLOCK_N - 1
    start = n_q * 0
    clean_start = n_q * 0
    end = n_q
    clean_end = n_q
    # Query i sees key j when j - shift - right <= i <= j - shift + left.
    if CAUSAL:
        start = tl.maximum(start, key_start - shift)
        clean_start = tl.maximum(clean_start, last - shift)
    if WINDOW_RIGHT >= 0:
        start = tl.maximum(start, key_start - shift - WINDOW_RIGHT)
        clean_start = tl.maximum(clean_start, last - shift - WINDOW_RIGHT)
    if WINDOW_LEFT >= 0:
        end = tl.minimum(n_q, last - shift + WINDOW_LEFT + 1)
        clean_end = tl.minimum(n_q, key_start - shift + WINDOW_LEFT + 1)
    start = start // BLOCK_M * BLOCK_M
    clean_start = ceil_to(clean_start, BLOCK_M)
    clean_end = tl.maximum(tl.maximum(clean_end, 0) // BLOCK_M * BLOCK_M, clean_start)
    return start, clean_start, clean_end, tl.maximum(end, 0)


@triton.jit
def span(SPAN: tl.constexpr, ranges, CLIP_FIRST: tl.constexpr):
    """[lo, hi) of span SPAN of the ranges (start, clean_start, clean_end, end) that `key_ranges` and
    `query_ranges` give: 0 the masked blocks before the clean ones (clipped at `end` when CLIP_FIRST: only
    a window's first span may pass it), 1 the clean blocks, 2 the masked blocks after them. A loop walks
    SPAN over tl.static_range(3) with MASKED=SPAN != 1: one call site, three specialized loops."""
    start, clean_start, clean_end, end = ranges
    if SPAN == 0:
        if CLIP_FIRST:
            return start, tl.minimum(clean_start, end)
        else:
            return start, clean_start
    elif SPAN == 1:
        return clean_start, clean_end
    else:
        return clean_end, end


# ---------------------------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------------------------


# The soft cap above which its tanh takes the series near 0, times log2(e) (a cap in the kernels' units,
# SOFTCAP * QK_SCALE). Below |y| = 0.3 the quotient (1 - e) / (1 + e) keeps e's rounding as an absolute
# error of about 2^-23 in tanh, so of cap * 2^-23 in the capped score: the probabilities stay within
# 8e-6 of exact up to a cap of 64. Above it the series keeps them exact, at an ALU cost per score
# (a cap of 50 at L = 4096 on the H200: the forward took 4.2 ms with the series, 2.9 without).
SERIES_CAP_LOG2 = tl.constexpr(64.0 * 1.4426950408889634)


@triton.jit
def tanh(y, SERIES: tl.constexpr):
    """tanh on exp2 (tl.math has no tanh on every Triton this package supports): +-1 exactly once |y|
    passes 9; never NaN for a finite or infinite y. With SERIES, to a few float32 ulps everywhere: below
    |y| = 0.3, where (1 - e) / (1 + e) cancels, its odd series to y^11 (the next term is under 2e-9 of
    y). Without, within about 2^-23 of tanh (see SERIES_CAP_LOG2)."""
    e = tl.math.exp2(tl.abs(y) * -2.8853900817779268)  # exp(-2|y|), in [0, 1]
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(y < 0, -t, t)
    if SERIES:
        y2 = y * y
        series = y * (1.0 + y2 * (-0.3333333333333333 + y2 * (0.13333333333333333 + y2 * (
            -0.05396825396825397 + y2 * (0.021869488536155203 + y2 * -0.008863235529902197)))))
        t = tl.where(tl.abs(y) < 0.3, series, t)
    return t


@triton.jit
def soft_cap(s, SCORES: tl.constexpr):
    """(x, t): x = SOFTCAP * tanh(s / SOFTCAP) and t that tanh (both s without a cap), SOFTCAP = SCORES[0]
    the cap divided by the scale (0: none); the tanh's series near 0 where the cap needs it
    (SERIES_CAP_LOG2; SCORES[2] = QK_SCALE). Any layout: the portable and the Hopper kernels' tiles."""
    SOFTCAP: tl.constexpr = SCORES[0]
    t = s
    x = s
    if SOFTCAP > 0:
        t = tanh(s * (1.0 / SOFTCAP), SOFTCAP * SCORES[2] > SERIES_CAP_LOG2)
        x = t * SOFTCAP
    return x, t


@triton.jit
def probability(x):
    """exp2(x) bounded by 1, for the backward's probabilities: x = (s - lse) * QK_SCALE in the portable
    backward, s * QK_SCALE - `scaled_down`(lse, QK_SCALE) in the Hopper one. It forms the scores s again,
    and where its rounding differs from the forward's (large logits, other tiles or operand order) x may
    exceed 0, and exp2 reach inf. A NaN stays NaN."""
    return tl.math.exp2(tl.minimum(x, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def scaled_down(x, scale):
    """x * scale rounded toward -inf: the log-sum-exp in exp2's units, for the Hopper backward's
    probabilities in one FFMA, exp2(s * QK_SCALE - lse_scaled) (`probability` bounds it by 1). Down, not
    to nearest, so that a score equal to the log-sum-exp (a one-hot row's top, at any magnitude) gets
    exactly 1: s * QK_SCALE - lse_scaled >= 0 there, the product being exact inside the FFMA; elsewhere
    the exponent is at most one unit in the last place of lse_scaled higher than exact. inf and NaN stay."""
    y = x * scale
    below = tl.fma(x, scale, -y) < 0.0  # the exact product lies below y: it was rounded up
    bits = y.to(tl.int32, bitcast=True)
    # The float below y (never +0.0 here: a negative product rounds to -0.0, whose next is -2**-149).
    down = tl.where(y > 0.0, bits - 1, bits + 1).to(tl.float32, bitcast=True)
    return tl.where(below, down, y)


@triton.jit
def transform_scores(dots, query_rows, key_rows, shift, slope, SCORES: tl.constexpr):
    """(x, t): the scores the softmax takes, in units of the unscaled q.k (so that the online softmax,
    the log-sum-exp and delta keep theirs), and the tanh of the soft cap (its derivative is 1 - t^2).
    SOFTCAP is the cap divided by the scale (0: none): x = SOFTCAP * tanh(dots / SOFTCAP). With ALIBI,
    x -= slope * |i + shift - j|, the slope (of this head) divided by the scale."""
    x, t = soft_cap(dots, SCORES)
    if SCORES[1]:
        x = x - slope * tl.abs(query_rows + shift - key_rows).to(tl.float32)
    return x, t
