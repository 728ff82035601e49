"""The warp-specialized pipeline of the Hopper kernels: the TMA-load and partition-barrier aliases, a
consumer warpgroup's rows, and the shared-memory ring's helpers (zeroing a tile's rows, publishing it,
passing a slot).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# Gluon's API moves between Triton versions: gated on what exists. The TMA load is tma.async_load from
# 3.7 on (tma.async_copy_global_to_shared before); the partition's barrier gl.barrier from 3.7 on
# (gl.thread_barrier before).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

# Query rows of one consumer warpgroup (a wgmma's M is 64 per warpgroup).
CONSUMER_ROWS: gl.constexpr = gl.constexpr(64)


@gluon.jit
def zero_rows(buf, n_rows, ROWS: gl.constexpr):
    """Zero the rows >= n_rows of a [ROWS, D] tile in shared memory (other tokens, maybe NaN), by one
    warpgroup (4 warps); `publish` then makes the writes visible to the wgmma products."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile = buf.load(blocked)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
    tile = gl.where(gl.expand_dims(rows < n_rows, 1), tile, gl.zeros_like(tile))
    buf.store(tile)


@gluon.jit
def publish():
    """After `zero_rows`: the generic-proxy writes visible to wgmma (the async proxy), and every warp's
    rows written before the mbarrier arrival that hands the tile to the other warpgroup."""
    fence_async_shared()
    partition_barrier()


@gluon.jit
def pass_slot(ready, empty, j, STAGES: gl.constexpr):
    """Release ring tile j, which this consumer warpgroup skips, once it is loaded: so that the arrival
    never counts toward the slot's next use, which needs the other consumer's too."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def pass_tiles(k_ready, v_ready, k_empty, v_empty, first, end, STAGES: gl.constexpr):
    """`pass_slot` of the key and value tiles [first, end) of the ring, in the producer's order."""
    for j in range(first, end):
        pass_slot(k_ready, k_empty, j, STAGES)
        pass_slot(v_ready, v_empty, j, STAGES)

