"""The persistent, varlen-aware tile scheduler of the Hopper kernels: the (sequence, head, block) items
taken from a global counter, skipping empty blocks, handed from the producer to the consumers through a
2-slot ring in shared memory; the block each item is (its rows, and the band's other side); and the
producer loop that drives them for the forward and dq.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ..shared import PARAM_KV_HEAD_STRIDE, PARAM_KV_TOKEN_STRIDE, bounds, key_ranges
from .addressing import tile_origin
from .pipeline import partition_barrier


@gluon.jit
def item_position(item, blocks, NUM_HEADS: gl.constexpr, BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """(sequence, head, start) of block `item` of the (sequence, head, block) items, each (sequence,
    head)'s `blocks` blocks of BLOCK rows adjacent, the last first (LAST_FIRST: the query blocks, see
    `query_block`) or the first first: start the block's first row in its sequence."""
    index = item % blocks
    if LAST_FIRST:
        index = blocks - 1 - index
    return item // (NUM_HEADS * blocks), (item // blocks) % NUM_HEADS, index * BLOCK


@gluon.jit
def _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
                 BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """Whether block `item` (see `item_position`) starts at or past its sequence's length (n_q of a query
    block, n_k of a key block: offsets, tokens and MAX_LEN theirs)."""
    sequence, _, start = item_position(item, blocks, NUM_HEADS, BLOCK, LAST_FIRST)
    _, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
    return start >= length


@gluon.jit
def fetch(counter_ptr, offsets_ptr, end, blocks, num_tokens, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
           BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """The next block with rows (see `_empty_block`) from the launch's counter (zeroed by the launcher),
    or a number >= end when none is left. A block's offsets are read only when it is one (< end): with
    no sequence, offsets has one entry."""
    item = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    skip = item < end
    if skip:
        skip = _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    while skip:
        item = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        skip = item < end
        if skip:
            skip = _empty_block(offsets_ptr, item, blocks, num_tokens, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    return item


@gluon.jit
def item_ring():
    """The 2-slot ring in shared memory through which a persistent kernel's producer hands its items to
    the two consumer warpgroups (`hand_out`, `receive`): (items, item_full, item_empty), the barriers
    initialized (item_empty counting one arrival per consumer). The caller fences the inits."""
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    item_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(item_full.index(w), count=1)
        mbarrier.init(item_empty.index(w), count=2)  # one arrival per consumer
    return items, item_full, item_empty


@gluon.jit
def hand_out(items, item_full, item_empty, i, item):
    """The producer's i-th item into the 2-slot ring the consumers read it from."""
    slot = i % 2
    mbarrier.wait(item_empty.index(slot), ((i // 2) & 1) ^ 1)  # fresh barriers: phase 1 counts as complete
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], item, gl.int32, layout))
    partition_barrier()
    mbarrier.arrive(item_full.index(slot), count=1)


@gluon.jit
def receive(items, item_full, item_empty, i):
    """A consumer's i-th item, from the ring `hand_out` fills."""
    slot = i % 2
    mbarrier.wait(item_full.index(slot), (i // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    item = gl.max(items.index(slot).load(layout), axis=0)
    partition_barrier()
    mbarrier.arrive(item_empty.index(slot), count=1)
    return item


@gluon.jit
def query_block(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS: gl.constexpr,
           Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr,
           WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr):
    """Query block `item` of the (sequence, head, block) items, each (sequence, head)'s blocks adjacent
    and the last first: (sequence, head, q_start, n_q, kv_start, n_k, start_m, key_first, key_end,
    num_key_blocks), the key blocks some query of the block sees (common._key_ranges, bottom-right
    aligned: the producer loads and both consumers visit exactly [key_first, key_end) in blocks of
    BLOCK_N). A block past the sequence's n_q has no work: `fetch` never hands one out."""
    sequence, head, start_m = item_position(item, blocks, NUM_HEADS, BLOCK_M, LAST_FIRST=True)
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    key_first, _, _, key_end = key_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, (CAUSAL, WINDOW_LEFT,
                                           WINDOW_RIGHT))
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    return sequence, head, q_start, n_q, kv_start, n_k, start_m, key_first, key_end, num_key_blocks


@gluon.jit
def _block_origins(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, q_token_stride,
                   q_head_stride, kv_token_stride, kv_head_stride, NUM_HEADS: gl.constexpr,
                   KV_GROUP: gl.constexpr, Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where query block `item` (see `query_block`) loads from, in the descriptors' 2-D views: (q_row, q_col,
    kv_row, kv_col, num_key_blocks), the block's first query and the first key of its band, and the
    band's key blocks (the forward's and dq's producers)."""
    _, head, q_start, _, kv_start, _, start_m, key_first, _, num_key_blocks = query_block(
        q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_HEADS, Q_MAX_LEN,
        KV_MAX_LEN, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N)
    q_row, q_col = tile_origin(q_start + start_m, head, q_token_stride, q_head_stride)
    kv_row, kv_col = tile_origin(kv_start, head // KV_GROUP, kv_token_stride, kv_head_stride)
    return q_row, q_col, kv_row + key_first, kv_col, num_key_blocks


@gluon.jit
def producer_loop(produce: gl.constexpr, buffers, items, item_full, item_empty, counter_ptr,
                   q_offsets_ptr, kv_offsets_ptr, params_ptr, end, blocks, q_tokens, kv_tokens,
                   q_token_stride, q_head_stride, NUM_HEADS: gl.constexpr, KV_GROUP: gl.constexpr,
                   Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STRIDE_ALIGN: gl.constexpr):
    """The load partition of the forward and of dq: the query blocks `fetch` takes from the counter,
    each handed out to the consumers and then loaded by `produce(buffers, q_row, q_col, kv_row, kv_col,
    num_key_blocks, t, phase, BLOCK_N, STAGES)` (`_produce`, `hopper_backward._dq_produce`: the block's
    query tiles, then its band's key tiles from the ring's position t), the ring's position and the query
    tiles' phase running on; then `end`, which ends the consumers."""
    kv_token_stride = gl.load(params_ptr + PARAM_KV_TOKEN_STRIDE) * STRIDE_ALIGN
    kv_head_stride = gl.load(params_ptr + PARAM_KV_HEAD_STRIDE) * STRIDE_ALIGN
    t = 0
    i = 0
    item = fetch(counter_ptr, q_offsets_ptr, end, blocks, q_tokens, NUM_HEADS, Q_MAX_LEN, BLOCK_M,
                  LAST_FIRST=True)
    while item < end:
        hand_out(items, item_full, item_empty, i, item)
        q_row, q_col, kv_row, kv_col, num_key_blocks = _block_origins(
            q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, q_token_stride, q_head_stride,
            kv_token_stride, kv_head_stride, NUM_HEADS, KV_GROUP, Q_MAX_LEN, KV_MAX_LEN, CAUSAL, WINDOW_LEFT,
            WINDOW_RIGHT, BLOCK_M, BLOCK_N)
        produce(buffers, q_row, q_col, kv_row, kv_col, num_key_blocks, t, i & 1, BLOCK_N, STAGES)
        t += num_key_blocks
        i += 1
        item = fetch(counter_ptr, q_offsets_ptr, end, blocks, q_tokens, NUM_HEADS, Q_MAX_LEN, BLOCK_M,
                      LAST_FIRST=True)
    hand_out(items, item_full, item_empty, i, end)



@gluon.jit
def key_block(q_offsets_ptr, kv_offsets_ptr, item, blocks, q_tokens, kv_tokens, NUM_KV_HEADS: gl.constexpr,
               Q_MAX_LEN: gl.constexpr, KV_MAX_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block `item` of the (sequence, kv head, block) items, each (sequence, kv head)'s blocks
    adjacent and the first first (the costliest under causal): (kv_head, q_start, n_q, kv_start, n_k,
    key0)."""
    sequence, kv_head, key0 = item_position(item, blocks, NUM_KV_HEADS, BLOCK_N, LAST_FIRST=False)
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    return kv_head, q_start, n_q, kv_start, n_k, key0

