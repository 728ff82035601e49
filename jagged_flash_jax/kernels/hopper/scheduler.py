"""The persistent, varlen-aware tile scheduler of the Hopper kernels: the (sequence, head, block) items,
taken from a global counter past the empty blocks and handed from the producer to the consumers through
a 2-slot ring in shared memory; the block each item is; the loops of the forward's and dq's producer
and consumers, and the buffers of dq's (`dq_buffers`, the softmax dq kernel's and HSTU's).

Bundles: schedule = (counter_ptr, end, blocks, ring, order_ptr), the counter the launcher zeroes, the
item count, the blocks of each (sequence, head), the item ring (items, item_full, item_empty) and the
order the sequences are handed out in (`_take`: the launcher's, launch/calls.work_order, or None: as
given; each kernel entry puts `order_ptr if ORDERED else None` there itself, as triton 3.6 cannot return
a tuple holding None from a jitted helper: "cannot convert None of type NoneType to tensor"); sequences =
(q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens); SHAPE = (NUM_HEADS, KV_GROUP, D); LENGTHS =
(Q_MAX_LEN, KV_MAX_LEN); TILES = (BLOCK_M, BLOCK_N, STAGES).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..shared import PARAM_KV_HEAD_STRIDE, PARAM_KV_TOKEN_STRIDE, bounds, key_ranges
from .addressing import tile_origin
from .pipeline import CONSUMER_ROWS, init_barriers, mbarriers, partition_barrier


@gluon.jit
def item_position(item, blocks, NUM_HEADS: gl.constexpr, BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """(sequence, head, start) of block `item` of the (sequence, head, block) items, each (sequence,
    head)'s `blocks` blocks of BLOCK rows adjacent, the last first (LAST_FIRST: query blocks, the
    costliest under causal) or the first first (key blocks, likewise): start the block's first row in
    its sequence."""
    index = item % blocks
    if LAST_FIRST:
        index = blocks - 1 - index
    return item // (NUM_HEADS * blocks), (item // blocks) % NUM_HEADS, index * BLOCK


@gluon.jit
def _empty_block(offsets_ptr, num_tokens, item, blocks, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
                 BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """Whether block `item` (see `item_position`) starts at or past its sequence's length (n_q of a query
    block, n_k of a key block: offsets, tokens and MAX_LEN theirs)."""
    sequence, _, start = item_position(item, blocks, NUM_HEADS, BLOCK, LAST_FIRST)
    _, length = bounds(offsets_ptr, sequence, num_tokens, MAX_LEN)
    return start >= length


@gluon.jit
def _take(schedule, NUM_HEADS: gl.constexpr):
    """The launch counter's next number, as the item it stands for: with an order (the schedule's
    order_ptr not None, a kernel's ORDERED: int32 [batch], a permutation of the sequences, the
    launcher's), the items of sequence order[s] in the place of sequence s's, so the sequences are handed
    out in that order, each (sequence, head)'s blocks as `item_position` orders them; without one, the
    number itself. A number >= end stays as it is (none left): the order is read under a mask, not a
    branch, which ptxas allocated worse (dk/dv at D = 128 spilled 120 bytes instead of 8 in the
    producer's 24 registers)."""
    counter_ptr, end, blocks, ring, order_ptr = schedule
    item = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    if order_ptr is not None:
        per_sequence = NUM_HEADS * blocks
        slot = item // per_sequence
        sequence = gl.load(order_ptr + slot, mask=item < end, other=slot)
        item = sequence * per_sequence + item % per_sequence
    return item


@gluon.jit
def fetch(schedule, offsets_ptr, num_tokens, NUM_HEADS: gl.constexpr, MAX_LEN: gl.constexpr,
          BLOCK: gl.constexpr, LAST_FIRST: gl.constexpr):
    """The next block with rows (see `_empty_block`) from the launch's counter (`_take`: in the
    schedule's order of the sequences), or a number >= end when none is left. A block's offsets are read
    only when it is one (< end): with no sequence, offsets has one entry."""
    counter_ptr, end, blocks, ring, order_ptr = schedule
    item = _take(schedule, NUM_HEADS)
    skip = item < end
    if skip:
        skip = _empty_block(offsets_ptr, num_tokens, item, blocks, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    while skip:
        item = _take(schedule, NUM_HEADS)
        skip = item < end
        if skip:
            skip = _empty_block(offsets_ptr, num_tokens, item, blocks, NUM_HEADS, MAX_LEN, BLOCK, LAST_FIRST)
    return item


@gluon.jit
def item_ring():
    """The 2-slot ring in shared memory through which a persistent kernel's producer hands its items to
    the two consumer warpgroups (`hand_out`, `receive`): (items, item_full, item_empty), the barriers
    initialized (item_empty counting one arrival per consumer). The caller fences the inits."""
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    item_full = mbarriers(2)
    item_empty = mbarriers(2)
    init_barriers((item_full, item_empty), (1, 2), 2)
    return items, item_full, item_empty


@gluon.jit
def dq_buffers(q_desc, do_desc, k_desc, v_desc, SIZES: gl.constexpr):
    """The shared memory and barriers of a persistent dq program (dq.py's, and HSTU's in
    hstu_backward.py), set up once: its two consumer warpgroups' Q [64, D] and dO [64, V] tiles, a
    STAGES-deep ring of K [BLOCK_N, D] and V [BLOCK_N, V] tiles (SIZES = (D, V, BLOCK_N, STAGES)), their
    barriers (q_bar and q_free per warpgroup, ready and empty per ring slot, empty counting both
    consumers, and the tail barrier) and the item ring (`item_ring`), the inits fenced. Returns (pipe,
    ring), pipe = (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar)."""
    D: gl.constexpr = SIZES[0]
    V: gl.constexpr = SIZES[1]
    BLOCK_N: gl.constexpr = SIZES[2]
    STAGES: gl.constexpr = SIZES[3]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, CONSUMER_ROWS, V], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, V], v_desc.layout)
    q_bar = mbarriers(2)
    q_free = mbarriers(2)
    tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = mbarriers(STAGES)
    empty = mbarriers(STAGES)
    ring = item_ring()
    init_barriers((q_bar, q_free), (1, 1), 2)
    mbarrier.init(tail_bar, count=1)
    init_barriers((ready, empty), (1, 2), STAGES)  # empty: one arrival per consumer
    fence_async_shared()
    return (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, tail_bar), ring


@gluon.jit
def dkdv_barriers(READY_ARRIVALS: gl.constexpr, STAGES: gl.constexpr):
    """The barriers of a persistent dk/dv program (dkdv.py's, and HSTU's in hstu_backward.py), allocated
    after its tiles and set up once: kv_bar (K and V loaded) and kv_free (both consumers done with them),
    per ring slot tail_bar, ready (READY_ARRIVALS: the TMA loads' expect, and any other arrival the
    producer makes) and empty (one arrival per consumer), and the item ring (`item_ring`), the inits
    fenced. Returns ((kv_bar, kv_free, ready, empty, tail_bar), ring)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tail_bar = mbarriers(STAGES)
    ready = mbarriers(STAGES)
    empty = mbarriers(STAGES)
    ring = item_ring()
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_free, count=2)  # one arrival per consumer
    init_barriers((tail_bar, ready, empty), (1, READY_ARRIVALS, 2), STAGES)
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before the first copy
    return (kv_bar, kv_free, ready, empty, tail_bar), ring


@gluon.jit
def hand_out(ring, i, item):
    """The producer's i-th item into the ring the consumers read it from."""
    items, item_full, item_empty = ring
    slot = i % 2
    mbarrier.wait(item_empty.index(slot), ((i // 2) & 1) ^ 1)  # fresh barriers: phase 1 counts as complete
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(slot).store(gl.full([1], item, gl.int32, layout))
    partition_barrier()
    mbarrier.arrive(item_full.index(slot), count=1)


@gluon.jit
def receive(ring, i):
    """A consumer's i-th item, from the ring `hand_out` fills."""
    items, item_full, item_empty = ring
    slot = i % 2
    mbarrier.wait(item_full.index(slot), (i // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    item = gl.max(items.index(slot).load(layout), axis=0)
    partition_barrier()
    mbarrier.arrive(item_empty.index(slot), count=1)
    return item


@gluon.jit
def query_block(sequences, item, blocks, NUM_HEADS: gl.constexpr, LENGTHS: gl.constexpr, BAND: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query block `item` (the last of each (sequence, head) first): (sequence, head, q_start, n_q,
    kv_start, n_k, start_m, key_first, key_end, num_key_blocks), with the keys [key_first, key_end) that
    some query of the block sees (`shared.key_ranges`): the producer loads and both consumers visit
    exactly those, in blocks of BLOCK_N. A block past the sequence's n_q has no work: `fetch` never hands
    one out."""
    q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens = sequences
    sequence, head, start_m = item_position(item, blocks, NUM_HEADS, BLOCK_M, LAST_FIRST=True)
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_tokens, LENGTHS[0])
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, LENGTHS[1])
    key_first, _, _, key_end = key_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, BAND)
    num_key_blocks = gl.maximum(gl.cdiv(key_end, BLOCK_N) - key_first // BLOCK_N, 0)
    return sequence, head, q_start, n_q, kv_start, n_k, start_m, key_first, key_end, num_key_blocks


@gluon.jit
def key_block(sequences, item, blocks, NUM_KV_HEADS: gl.constexpr, LENGTHS: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """Key block `item` (the first of each (sequence, kv head) first): (kv_head, q_start, n_q, kv_start,
    n_k, key0)."""
    q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens = sequences
    sequence, kv_head, key0 = item_position(item, blocks, NUM_KV_HEADS, BLOCK_N, LAST_FIRST=False)
    q_start, n_q = bounds(q_offsets_ptr, sequence, q_tokens, LENGTHS[0])
    kv_start, n_k = bounds(kv_offsets_ptr, sequence, kv_tokens, LENGTHS[1])
    return kv_head, q_start, n_q, kv_start, n_k, key0


@gluon.jit
def _block_origins(sequences, item, blocks, layouts, SHAPE: gl.constexpr, LENGTHS: gl.constexpr,
                   BAND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where query block `item` loads from in the descriptors' 2-D views: (q_origin, kv_origin,
    num_key_blocks), the (row, column) of the block's first query and of the first key of its band, and
    the band's key blocks."""
    q_layout, kv_layout = layouts
    _, head, q_start, _, kv_start, _, start_m, key_first, _, num_key_blocks = query_block(
        sequences, item, blocks, SHAPE[0], LENGTHS, BAND, BLOCK_M, BLOCK_N)
    q_origin = tile_origin(q_start + start_m, head, q_layout)
    kv_row, kv_col = tile_origin(kv_start, head // SHAPE[1], kv_layout)
    return q_origin, (kv_row + key_first, kv_col), num_key_blocks


@gluon.jit
def producer_loop(produce: gl.constexpr, buffers, schedule, sequences, q_layout, params_ptr,
                  SHAPE: gl.constexpr, LENGTHS: gl.constexpr, BAND: gl.constexpr, TILES: gl.constexpr,
                  STRIDE_ALIGN: gl.constexpr):
    """The load partition of the forward and of dq: `produce_items` of the query blocks `query_block`
    describes, their keys and values at k's and v's layout (kv_layout, from the runtime parameters)."""
    q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens = sequences
    kv_token_stride = gl.load(params_ptr + PARAM_KV_TOKEN_STRIDE) * STRIDE_ALIGN
    kv_head_stride = gl.load(params_ptr + PARAM_KV_HEAD_STRIDE) * STRIDE_ALIGN
    produce_items(produce, gl.constexpr(_block_origins), buffers, schedule, sequences,
                  (q_layout, (kv_tokens, kv_token_stride, kv_head_stride)), SHAPE, LENGTHS, BAND, TILES)


@gluon.jit
def produce_items(produce: gl.constexpr, origins: gl.constexpr, buffers, schedule, sequences, layouts,
                  SHAPE: gl.constexpr, LENGTHS: gl.constexpr, BAND: gl.constexpr, TILES: gl.constexpr):
    """The load partition's loop: the query blocks `fetch` takes from the counter (sequences[0] the
    queries' offsets, sequences[2] their tokens, LENGTHS[0] their MAX_LEN), each handed out to the
    consumers, placed by `origins(sequences, item, blocks, layouts, SHAPE, LENGTHS, BAND, BLOCK_M,
    BLOCK_N)` -> (q_origin, kv_origin, num_key_blocks) (`_block_origins`: the softmax kernels'), then
    loaded by `produce(buffers, q_origin, kv_origin, num_key_blocks, t, phase, TILES)` (the block's
    query tiles, then its band's key tiles from the ring's position t), the ring's position and the
    query tiles' phase running on; then `end`, which ends the consumers."""
    q_offsets_ptr, kv_offsets_ptr, q_tokens, kv_tokens = sequences
    counter_ptr, end, blocks, ring, order_ptr = schedule
    BLOCK_M: gl.constexpr = TILES[0]
    BLOCK_N: gl.constexpr = TILES[1]
    t = 0
    i = 0
    item = fetch(schedule, q_offsets_ptr, q_tokens, SHAPE[0], LENGTHS[0], BLOCK_M, LAST_FIRST=True)
    while item < end:
        hand_out(ring, i, item)
        q_origin, kv_origin, num_key_blocks = origins(sequences, item, blocks, layouts, SHAPE, LENGTHS, BAND,
                                                      BLOCK_M, BLOCK_N)
        produce(buffers, q_origin, kv_origin, num_key_blocks, t, i & 1, TILES)
        t += num_key_blocks
        i += 1
        item = fetch(schedule, q_offsets_ptr, q_tokens, SHAPE[0], LENGTHS[0], BLOCK_M, LAST_FIRST=True)
    hand_out(ring, i, end)


@gluon.jit
def consumer_loop(consume: gl.constexpr, pipe, schedule, sequences, arrays, SHAPE: gl.constexpr,
                  LENGTHS: gl.constexpr, BAND: gl.constexpr, SCORES: gl.constexpr, SCALE: gl.constexpr,
                  TILES: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG of the forward or dq: `consume_items` of the query blocks `query_block`
    describes."""
    consume_items(consume, gl.constexpr(query_block), pipe, schedule, sequences, arrays, SHAPE, LENGTHS, BAND,
                  SCORES, SCALE, TILES, WG)


@gluon.jit
def consume_items(consume: gl.constexpr, describe: gl.constexpr, pipe, schedule, sequences, arrays,
                  SHAPE: gl.constexpr, LENGTHS: gl.constexpr, BAND: gl.constexpr, SCORES: gl.constexpr,
                  SCALE: gl.constexpr, TILES: gl.constexpr, WG: gl.constexpr):
    """A consumer warpgroup's loop: for each query block the producer hands out, until `end`,
    `consume(pipe, arrays, block, position, SHAPE[2], BAND, SCORES, SCALE, TILES, WG)` (block:
    `describe(sequences, item, blocks, SHAPE[0], LENGTHS, BAND, BLOCK_M, BLOCK_N)`, `query_block`'s tuple
    for the softmax kernels; position: (t, i, tails), the ring's position, the block's index among this
    consumer's and the count of tail hand-overs), which returns t and tails after the block."""
    counter_ptr, end, blocks, ring, order_ptr = schedule  # (names, not `_`: a reassigned name is carried)
    t = 0
    tails = 0
    i = 0
    item = receive(ring, i)
    while item < end:
        block = describe(sequences, item, blocks, SHAPE[0], LENGTHS, BAND, TILES[0], TILES[1])
        t, tails = consume(pipe, arrays, block, (t, i, tails), SHAPE[2], BAND, SCORES, SCALE, TILES, WG)
        i += 1
        item = receive(ring, i)
