"""The warp-specialized Hopper forward as it stood in the package before it was reverted (kept as the
record of the measurement in benchmarks/results/profile/2026-12-01_warp_specialized_forward.md: wrong
outputs for 128-row tiles on triton 3.6, and XLA's command buffers refuse kernels that build TMA
descriptors on the device through jaxlib 0.11.2). Not imported by the package or the tests.

What follows is its original docstring: TMA tensor descriptors, made on the device.

A descriptor of one sequence's rows of one head gives the copy engine the sequence's extent, so a
block load reads zeros past it and no content of the offsets can make it read outside the arrays
(the extent is clamped first, see common._extent). jax-triton >= 0.4.1 with jaxlib >= 0.11.1 gives
the kernels the global scratch memory that descriptors are built in. The rows must be 16-byte aligned:
the launcher passes a descriptor flag only when every stride is (see launch/plan.py).
"""

import triton
import triton.language as tl

from jagged_flash_jax.kernels.common import (
    INF,
    PARAM_FWD_FILL_CHUNK,
    PARAM_FWD_SLOTS,
    _bounds,
    _causal_shift,
    _key_ranges,
    _online_softmax,
    _params,
    _program,
    _rows,
    _zero_tail,
    _zero_uncovered,
)

# The params slot the package gave the log-sum-exp's token count (params.FWD_V_D_STRIDE's, unused here).
PARAM_FWD_LSE_TOKENS: tl.constexpr = tl.constexpr(11)


@triton.jit
def _sequence_descriptor(ptr, segment, head, seq_start, length, num_tokens, token_stride, head_stride,
                         D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A descriptor of the `length` rows of one head of a sequence ([length, D], rows `token_stride`
    apart), loaded BLOCK_ROWS rows at a time. A descriptor has at least one row: that of an empty
    sequence starts at its segment's first token, and is never read (its sequence has no block)."""
    first = tl.where(length > 0, seq_start, 0)
    return tl.make_tensor_descriptor(_rows(ptr, segment, head, first, num_tokens, token_stride, head_stride),
                                     shape=[tl.maximum(length, 1), D], strides=[token_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


# The copies of each log-sum-exp value the warp-specialized forward writes: 16 bytes of float32.
LSE_COPIES: tl.constexpr = tl.constexpr(4)


@triton.jit
def _query_block(batch, slots, NUM_HEADS: tl.constexpr):
    """(segment, sequence, head, query block) of a program of a grid of query blocks only (no zero-fill
    programs), on two axes or one as common._program's; selected, not branched: a branch before the
    key loop keeps Triton from specializing it."""
    pid = tl.program_id(0)
    one_axis = tl.num_programs(1) == 1
    slot = tl.where(one_axis, pid % slots, tl.program_id(1))
    head_sequence = tl.where(one_axis, pid // slots, pid)
    segment_sequence = head_sequence // NUM_HEADS
    return segment_sequence // batch, segment_sequence % batch, head_sequence % NUM_HEADS, slots - 1 - slot


@triton.jit
def _ws_tile(acc, row_sum, row_max, q, k_desc, v_desc, key_start, query_rows, n_k, shift,
             QK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """One online-softmax step over the keys [key_start, +BLOCK_N), every block masked (a specialized
    loop has one body): keys past n_k read 0 from the descriptor and are masked, as are causal ones."""
    k = k_desc.load([key_start, 0])
    scores = tl.dot(q, tl.trans(k))
    key_rows = key_start + tl.arange(0, BLOCK_N)
    keep = key_rows[None, :] < n_k
    if CAUSAL:
        keep = keep & (key_rows[None, :] <= query_rows[:, None] + shift)
    scores = tl.where(keep, scores, -INF)
    p, correction, row_sum, row_max = _online_softmax(scores, row_max, row_sum, QK_SCALE, EMPTY_ROWS=CAUSAL)
    v = v_desc.load([key_start, 0])
    acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
    return acc, row_sum, row_max


@triton.jit
def attention_fwd_ws_kernel(
    q_ptr, k_ptr, v_ptr, q_offsets_ptr, kv_offsets_ptr, params_ptr,
    o_ptr, lse_ptr,
    NUM_HEADS: tl.constexpr, KV_GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_MAX_LEN: tl.constexpr, KV_MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr, QK_SCALE: tl.constexpr,
    OUT_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
):
    """o and the log-sum-exp of one block of BLOCK_M queries (portable.attention_fwd_kernel's, 16-bit
    inputs), with Triton's Hopper warp specialization of the key loop: a producer warpgroup issues the
    TMA loads of k and v, and two consumer warpgroups each take half of the query rows.

    Triton 3.6 specializes only one loop at the top level of straight-line code, so there is no early
    return and no zero fill here (`zero_fill_kernel` runs after, on the same o), every key block is
    masked, and a block past its sequence's queries walks no key and stores nothing. Plain stores after
    the loop come out wrong there: o and the log-sum-exp leave through TMA descriptors, clipped to the
    sequence. The log-sum-exp is written as [H, tokens, LSE_COPIES] (LSE_COPIES equal values, a 16-byte
    row as a descriptor needs; tokens: all segments', PARAM_FWD_LSE_TOKENS), which the launcher reduces
    to [segments, H, tokens]. Every grid program is a query block: no fill programs."""
    (batch, q_tokens, kv_tokens, q_token_stride, q_head_stride, kv_token_stride, kv_head_stride,
     q_offsets_stride, kv_offsets_stride) = _params(params_ptr, STRIDE_ALIGN)
    segment, sequence, head, block = _query_block(batch, tl.load(params_ptr + PARAM_FWD_SLOTS), NUM_HEADS)
    q_offsets_ptr += segment * q_offsets_stride
    kv_offsets_ptr += segment * kv_offsets_stride
    q_start, n_q = _bounds(q_offsets_ptr, sequence, q_tokens, Q_MAX_LEN)
    kv_start, n_k = _bounds(kv_offsets_ptr, sequence, kv_tokens, KV_MAX_LEN)
    kv_head = head // KV_GROUP
    query_start = block * BLOCK_M
    q_desc = _sequence_descriptor(q_ptr, segment, head, q_start, n_q, q_tokens, q_token_stride,
                                  q_head_stride, D=D, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    k_desc = _sequence_descriptor(k_ptr, segment, kv_head, kv_start, n_k, kv_tokens, kv_token_stride,
                                  kv_head_stride, D=D, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = _sequence_descriptor(v_ptr, segment, kv_head, kv_start, n_k, kv_tokens, kv_token_stride,
                                  kv_head_stride, D=D, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    o_desc = _sequence_descriptor(o_ptr, segment, head, q_start, n_q, q_tokens, q_token_stride,
                                  q_head_stride, D=D, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    query_rows = query_start + tl.arange(0, BLOCK_M)
    q = q_desc.load([query_start, 0])
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -INF, dtype=tl.float32)
    shift = _causal_shift(n_q, n_k, CAUSAL)
    _, end = _key_ranges(query_start, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    end = tl.where(query_start < n_q, end, 0)
    for key_start in tl.range(0, end, BLOCK_N, warp_specialize=True):
        acc, row_sum, row_max = _ws_tile(acc, row_sum, row_max, q, k_desc, v_desc, key_start, query_rows,
                                         n_k, shift, QK_SCALE=QK_SCALE, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    attended = row_sum > 0
    acc = acc * (OUT_SCALE / tl.where(attended, row_sum, 1.0))[:, None]
    # Rows from n_q on are clipped; an empty sequence's one-row descriptor gets its block at row 1.
    o_desc.store([tl.where(n_q > 0, query_start, 1), 0], acc.to(o_desc.dtype))
    lse = tl.where(attended, row_max + tl.math.log2(row_sum) * (1.0 / QK_SCALE), INF)
    lse_desc = _sequence_descriptor(lse_ptr, segment, head, q_start, n_q, q_tokens, token_stride=LSE_COPIES,
                                    head_stride=tl.load(params_ptr + PARAM_FWD_LSE_TOKENS) * LSE_COPIES,
                                    D=LSE_COPIES, BLOCK_ROWS=BLOCK_M, BLOCK_D=LSE_COPIES)
    lse_desc.store([tl.where(n_q > 0, query_start, 1), 0],
                   tl.broadcast_to(lse[:, None], [BLOCK_M, LSE_COPIES]))


@triton.jit
def zero_fill_kernel(
    offsets_ptr, params_ptr, x_ptr,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, MAX_LEN: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """Write 0, in place, to the tokens of x (an input the launcher aliases to the output) that no
    sequence attends: portable.attention_fwd_kernel's zero-fill programs, for attention_fwd_ws_kernel
    (same params; grid: (segment, sequence or fill, head) x PARAM_FWD_SLOTS)."""
    (batch, tokens, _, token_stride, head_stride, _, _, offsets_stride, _) = _params(params_ptr, STRIDE_ALIGN)
    fill_chunk = tl.load(params_ptr + PARAM_FWD_FILL_CHUNK)
    segment, sequence, head, slot = _program(batch, tl.load(params_ptr + PARAM_FWD_SLOTS), NUM_HEADS)
    offsets_ptr += segment * offsets_stride
    if sequence == batch:
        _zero_uncovered(x_ptr, x_ptr, offsets_ptr, batch, segment, head, chunk=slot, fill_chunk=fill_chunk,
                        num_tokens=tokens, token_stride=token_stride, head_stride=head_stride,
                        MAX_LEN=MAX_LEN, D=D, BLOCK_D=BLOCK_D, BLOCK=FILL_BLOCK, TWO=False)
    elif slot == 0:
        _zero_tail(x_ptr, x_ptr, offsets_ptr, sequence, segment, head, num_tokens=tokens,
                   token_stride=token_stride, head_stride=head_stride, MAX_LEN=MAX_LEN, D=D,
                   BLOCK_D=BLOCK_D, BLOCK=FILL_BLOCK, TWO=False)
