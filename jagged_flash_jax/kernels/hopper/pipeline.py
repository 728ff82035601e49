"""The warp-specialized pipeline of the Hopper kernels: the TMA-load and partition-barrier aliases, a
consumer warpgroup's rows, the mbarrier arrays and their set-up, and the shared-memory ring's helpers
(zeroing a tile's rows, publishing it, passing a slot).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# Gluon's API moves between Triton versions: gated on what exists. The TMA load is tma.async_load from
# 3.7 on (tma.async_copy_global_to_shared before); the partition's barrier gl.barrier from 3.7 on
# (gl.thread_barrier before).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# The TMA reduce-add, tma.async_atomic_add from 3.7 on, None before: named here so that the kernels that
# never call it still compile under 3.6 (Triton resolves every name a kernel's source reaches). Only the
# dq-fused kernel the launcher takes where it exists (`_compat.gluon_tma_reduce`) calls it.
tma_reduce_add = getattr(tma, "async_atomic_add", None)

# Rows of one consumer warpgroup's tiles (a wgmma's M is 64 per warpgroup): each kernel's blocks are
# two warpgroups' 64 rows.
CONSUMER_ROWS: gl.constexpr = gl.constexpr(64)


@gluon.constexpr_function
def wgmma_layout(columns):
    """The register layout of a consumer warpgroup's [64, columns] wgmma result (4 warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.jit
def mbarriers(SLOTS: gl.constexpr):
    """An array of SLOTS mbarriers in shared memory (`init_barriers` sets them up)."""
    return gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())


@gluon.jit
def init_barriers(bars, COUNTS: gl.constexpr, SLOTS: gl.constexpr):
    """Initialize the mbarrier arrays `bars` slot by slot, bars[j] counting COUNTS[j] arrivals. The order
    of the inits places the barriers in shared memory: a kernel's PTX changes with it."""
    for slot in gl.static_range(SLOTS):
        for j in gl.static_range(len(COUNTS)):
            mbarrier.init(bars[j].index(slot), count=COUNTS[j])


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
def hand_over_zeroed(tile, n_rows, tail_bar, phase, ROWS: gl.constexpr, WG: gl.constexpr):
    """A ring tile of ROWS rows, both consumers', whose rows >= n_rows are other tokens (maybe NaN):
    warpgroup 0 zeroes them (`zero_rows`), publishes them and arrives on tail_bar; warpgroup 1 waits on
    it at `phase`."""
    if WG == 0:
        zero_rows(tile, n_rows, ROWS)
        publish()
        mbarrier.arrive(tail_bar, count=1)
    else:
        mbarrier.wait(tail_bar, phase)


@gluon.jit
def zero_tail_tile(q, do, slot, tail_bar, tail_phases, n_rows, ROWS: gl.constexpr, WG: gl.constexpr):
    """A dk/dv consumer's ring tile of ROWS queries whose rows >= n_rows are other tokens (maybe NaN):
    warpgroup 0 zeroes them in Q and dO (`zero_rows`), publishes them and arrives on the slot's tail
    barrier; warpgroup 1 waits on it. A slot's tail barrier is re-armed only after both warpgroups
    released the slot, the ring running on from block to block, so warpgroup 0 cannot arrive twice
    before warpgroup 1 waited. Returns tail_phases (the tail barriers' parities, a bit per slot) with the
    slot's bit flipped."""
    if WG == 0:
        zero_rows(q, n_rows, ROWS)
        zero_rows(do, n_rows, ROWS)
        publish()
        mbarrier.arrive(tail_bar.index(slot), count=1)
    else:
        mbarrier.wait(tail_bar.index(slot), (tail_phases >> slot) & 1)
    return tail_phases ^ (1 << slot)


@gluon.jit
def pass_slot(ready, empty, j, STAGES: gl.constexpr):
    """Release ring tile j, which this consumer warpgroup skips, once it is loaded: so that the arrival
    never counts toward the slot's next use, which needs the other consumer's too."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    mbarrier.arrive(empty.index(j % STAGES), count=1)
