"""HSTU attention's rules in pure Triton, for any kernel family (shared.py's counterpart): the slots of its
kernels' runtime parameters, a sequence's rule, the position ids and the mask (`reference.hstu_mask`'s
arithmetic), the key blocks a query block visits and the query blocks a key block visits, and silu with
its derivative. Scalars and elementwise code only.

MASK = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS) travels as a tuple of constexprs,
read by index (see shared.py). A sequence's `rule` = (length, history_end, lift_from), int32: its attended
length L = min(n, MAX_LEN) (n its full length), and, in ids, the history's end m = n - C - num_targets
(the targets' id; C = max(CONTEXT_LEN - 1, 0)) and m - MIN_FULL_LEN (the first id the window's lift
reaches), each clamped into [-1, L]. Ids lie in [0, L - 1], or all equal m when m < 0, and the mask reads
m only in comparisons with ids, which those clamps leave unchanged: any num_targets content (negative,
past the length) gives the reference's mask, in int32.
"""

import triton
import triton.language as tl

from .shared import extent
from .spec import HSTU_PARAMS

# The slots of the HSTU kernels' runtime parameters (kernels/spec.py's HSTU_PARAMS).
PARAM_HSTU_BATCH: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("batch"))
PARAM_HSTU_TOKENS: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("tokens"))
PARAM_HSTU_QK_TOKEN_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("qk_token_stride"))
PARAM_HSTU_QK_HEAD_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("qk_head_stride"))
PARAM_HSTU_V_TOKEN_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("v_token_stride"))
PARAM_HSTU_V_HEAD_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("v_head_stride"))
PARAM_HSTU_OFFSETS_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("offsets_stride"))
PARAM_HSTU_TARGETS_STRIDE: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("targets_stride"))
PARAM_HSTU_FILL_CHUNK: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("fill_chunk"))
PARAM_HSTU_SLOTS: tl.constexpr = tl.constexpr(HSTU_PARAMS.index("slots"))

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------------------------------------
# A sequence, its ids and the mask
# ---------------------------------------------------------------------------------------------------


@triton.jit
def sequence_rule(offsets_ptr, targets_ptr, sequence, num_tokens, MAX_LEN: tl.constexpr, MASK: tl.constexpr):
    """(first token (int64), rule) of a sequence: its extent clamped as `shared.extent` clamps it, and
    its number of targets read only with HAS_TARGETS (MASK[4]). The history's end is computed in int64
    and clamped (see the module docstring), so that no content of offsets or num_targets overflows."""
    CONTEXT_LEN: tl.constexpr = MASK[2]
    start, end = extent(offsets_ptr, sequence, num_tokens)
    full = end - start
    length = tl.minimum(full, MAX_LEN)
    history_end = full
    if CONTEXT_LEN > 1:
        history_end = history_end - (CONTEXT_LEN - 1)
    if MASK[4]:
        history_end = history_end - tl.load(targets_ptr + sequence).to(tl.int64)
    lift_from = tl.minimum(tl.maximum(history_end - MASK[3], -1), length)
    history_end = tl.minimum(tl.maximum(history_end, -1), length)
    return start, (length.to(tl.int32), history_end.to(tl.int32), lift_from.to(tl.int32))


@triton.jit
def position_ids(positions, history_end, MASK: tl.constexpr):
    """The ids of positions within a sequence: the CONTEXT_LEN context tokens share id 0 (the first
    history token has id 1), and with targets every target has the history's end. Non-decreasing in the
    position, which the block ranges below rely on."""
    CONTEXT_LEN: tl.constexpr = MASK[2]
    ids = positions
    if CONTEXT_LEN > 1:
        ids = tl.maximum(positions - (CONTEXT_LEN - 1), 0)
    if MASK[4]:  # without targets the history's end lies past every id
        ids = tl.minimum(ids, history_end)
    return ids


@triton.jit
def keep(query_rows, key_rows, query_ids, key_ids, rule, MASK: tl.constexpr):
    """Whether each query (its position and id) sees each key (the queries' and the keys' broadcast
    against each other): `reference.hstu_mask`, and both positions attended (below L).

    The diagonal by position, or a distance of ids above 0 (either side when not causal); with a window
    (MAX_ATTN_LEN > 0) a distance of at most MAX_ATTN_LEN, unless the query's id is at least lift_from
    (MIN_FULL_LEN > 0); then, with a context, rows of id 0 see every key whose id is below the
    history's end."""
    CAUSAL: tl.constexpr = MASK[0]
    MAX_ATTN_LEN: tl.constexpr = MASK[1]
    length, history_end, lift_from = rule
    distance = query_ids - key_ids
    if not CAUSAL:
        distance = tl.abs(distance)
    seen = (query_rows == key_rows) | (distance > 0)
    if MAX_ATTN_LEN > 0:
        near = distance <= MAX_ATTN_LEN
        if MASK[3] > 0:
            near = near | (query_ids >= lift_from)
        seen = seen & near
    if MASK[2] > 0:
        seen = seen | ((query_ids == 0) & (key_ids < history_end))
    return seen & (query_rows < length) & (key_rows < length)


# ---------------------------------------------------------------------------------------------------
# The blocks that a block visits
#
# Ids are non-decreasing in the position, so a block's ids lie between those of its first and last rows.
# With C = max(CONTEXT_LEN - 1, 0) and W = MAX_ATTN_LEN, an id is max(p - C, 0), or less (the targets'
# clamp): a position p < id + C + 1 has an id at most id, and a position p > id + C has an id above
# id unless it is clamped at the history's end. From this, for a query i and a key j:
#   - causal: i sees j only if j <= i (the diagonal, or an id below i's);
#   - a window: only if id(j) >= id(i) - W (and id(j) <= id(i) + W when not causal); both fail to hold
#     for the rows the lift reaches (ids >= lift_from, a suffix of the rows) and for the context rows
#     (id 0, a prefix of at most C + 1 rows), which see every key whose id is below the history's end.
# Every bound is computed in int64 (W and C are any constants) and is conservative: a visited block may
# hold no key a row sees, and `keep` masks every element.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def key_range(query_start, rule, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """[lo, hi) (int32): the keys that some query of the block [query_start, +BLOCK_M) may see, lo a
    multiple of BLOCK_N. Each bound holds for every row of the block:
      lo: 0 if a row is lifted, or the first row's id is within the window of id 0; else the keys
          before id(first) - W + C have ids below id(first) - W (a context row has id 0: none here);
      hi: causal, the last row + 1; not causal with a window, the keys from id(last) + W + C + 1 on
          have ids above id(last) + W, unless a row is lifted or the history's end is within the window
          of the last row's id (the ids stop there); a block with a context row, L."""
    CAUSAL: tl.constexpr = MASK[0]
    MAX_ATTN_LEN: tl.constexpr = MASK[1]
    SHIFT: tl.constexpr = max(MASK[2] - 1, 0)
    length, history_end, lift_from = rule
    last = tl.minimum(query_start + BLOCK_M, length) - 1
    first_id = position_ids(query_start, history_end, MASK).to(tl.int64)
    last_id = position_ids(last, history_end, MASK).to(tl.int64)
    lo = first_id * 0
    hi = length.to(tl.int64)
    if CAUSAL:
        hi = last.to(tl.int64) + 1
    if MAX_ATTN_LEN > 0:
        unbounded = first_id <= MAX_ATTN_LEN
        if MASK[3] > 0:
            unbounded = unbounded | (last_id >= lift_from)
        lo = tl.where(unbounded, 0, first_id - MAX_ATTN_LEN + SHIFT)
        if not CAUSAL:
            open_end = last_id + MAX_ATTN_LEN >= history_end
            if MASK[3] > 0:
                open_end = open_end | (last_id >= lift_from)
            hi = tl.where(open_end, hi, tl.minimum(hi, last_id + MAX_ATTN_LEN + SHIFT + 1))
    if MASK[2] > 0:
        hi = tl.where(first_id == 0, length.to(tl.int64), hi)
    return (lo // BLOCK_N * BLOCK_N).to(tl.int32), hi.to(tl.int32)


@triton.jit
def query_spans(key_start, rule, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """The queries that may see some key of the block [key_start, +BLOCK_N), as up to three disjoint
    spans of query blocks (multiples of BLOCK_M), walked in order by `span_block`: (prefix_blocks,
    band_start, band_blocks, suffix_start, suffix_blocks), int32.
      the prefix [0, min(C + 1, L)): the context rows, where some key's id is below the history's end;
      the band: causal, from key_start; with a window, the rows whose ids are within W of the block's
          ids (not causal: from id(first) - W + C when that is above C), to id(last) + W + C + 1 unless
          the history's end is within the window (then to L);
      the suffix [lift_from + C (0 where lift_from <= 0), L) (causal: from key_start): the rows the lift
          reaches (only with a window and MIN_FULL_LEN).
    A suffix that begins before the band ends is merged into it; the band and the suffix begin after
    the prefix."""
    CAUSAL: tl.constexpr = MASK[0]
    MAX_ATTN_LEN: tl.constexpr = MASK[1]
    SHIFT: tl.constexpr = max(MASK[2] - 1, 0)
    length, history_end, lift_from = rule
    wide_length = length.to(tl.int64)
    last = tl.minimum(key_start + BLOCK_N, length) - 1
    first_id = position_ids(key_start, history_end, MASK).to(tl.int64)
    last_id = position_ids(last, history_end, MASK).to(tl.int64)
    prefix_end = first_id * 0
    if MASK[2] > 0:
        prefix_end = tl.where(first_id < history_end, tl.minimum(SHIFT + 1, wide_length), 0)
    band_start = first_id * 0
    if CAUSAL:
        band_start = band_start + key_start
    band_end = wide_length
    # In blocks: every span from the block of its first row to the block of its last (`end`: L's).
    end = (wide_length + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    suffix_start = end  # none
    if MAX_ATTN_LEN > 0:
        if not CAUSAL:
            band_start = tl.where(first_id > MAX_ATTN_LEN, first_id - MAX_ATTN_LEN + SHIFT, 0)
        band_end = tl.where(last_id + MAX_ATTN_LEN >= history_end, wide_length,
                            tl.minimum(wide_length, last_id + MAX_ATTN_LEN + SHIFT + 1))
        if MASK[3] > 0:
            suffix_start = tl.where(lift_from > 0, lift_from.to(tl.int64) + SHIFT, 0)
            if CAUSAL:
                suffix_start = tl.maximum(suffix_start, key_start)
            suffix_start = tl.minimum(suffix_start // BLOCK_M * BLOCK_M, end)
    prefix_end = (prefix_end + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    band_start = band_start // BLOCK_M * BLOCK_M
    band_end = (band_end + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    # The suffix merged into the band where they meet; then each span after the one before.
    merged = suffix_start <= band_end
    band_start = tl.maximum(tl.where(merged, tl.minimum(band_start, suffix_start), band_start), prefix_end)
    band_end = tl.maximum(tl.where(merged, end, band_end), band_start)
    suffix_start = tl.where(merged, end, tl.maximum(suffix_start, band_end))
    return ((prefix_end // BLOCK_M).to(tl.int32), band_start.to(tl.int32),
            ((band_end - band_start) // BLOCK_M).to(tl.int32), suffix_start.to(tl.int32),
            ((end - suffix_start) // BLOCK_M).to(tl.int32))


@triton.jit
def span_block(block, spans, BLOCK_M: tl.constexpr):
    """The first query of block `block` (0 <= block < the three spans' blocks together) of `query_spans`'
    spans: one loop walks them all, so that its body is compiled once."""
    prefix_blocks, band_start, band_blocks, suffix_start, _ = spans
    in_band = block - prefix_blocks
    in_suffix = in_band - band_blocks
    in_span = tl.where(in_band < 0, block, tl.where(in_suffix < 0, in_band, in_suffix))
    span_start = tl.where(in_band < 0, 0, tl.where(in_suffix < 0, band_start, suffix_start))
    return span_start + in_span * BLOCK_M


# ---------------------------------------------------------------------------------------------------
# silu
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _sigmoid(u):
    """(sigmoid(u), 1 - sigmoid(u)) in float32, from e = exp(-|u|) in (0, 1]: no overflow and no
    cancellation for any finite u."""
    e = tl.math.exp2(tl.abs(u) * -LOG2E)
    r = 1.0 / (1.0 + e)
    positive = u >= 0
    return tl.where(positive, r, e * r), tl.where(positive, e * r, r)


@triton.jit
def silu(u):
    """u * sigmoid(u)."""
    sigmoid, _ = _sigmoid(u)
    return u * sigmoid


@triton.jit
def silu_and_grad(u):
    """(silu(u), silu'(u)), silu'(u) = sigmoid(u) (1 + u (1 - sigmoid(u)))."""
    sigmoid, complement = _sigmoid(u)
    return u * sigmoid, sigmoid * (1.0 + u * complement)
