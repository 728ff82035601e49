"""Where a portable kernel's data is, and its masked loads and stores: the runtime parameters it reads,
its program's (segment, sequence, head, slot), a head's token of one segment, the float32 statistics
[segments, H, tokens], a sequence's window in a key-major copy.

An array's token axis may hold several segments of `tokens` tokens (data-parallel shards, vmapped
problems), each with its row of offsets. Its strides come in units of STRIDE_ALIGN elements, so that
"THD" and "HTD" (anything with unit stride along D) share one code path: a `layout` is (tokens,
token_stride, head_stride) in elements, one for q, o, do, dq and one for k, v, dk, dv.
"""

import triton
import triton.language as tl

from ..shared import (
    PARAM_BATCH,
    PARAM_KV_HEAD_STRIDE,
    PARAM_KV_OFFSETS_STRIDE,
    PARAM_KV_TOKEN_STRIDE,
    PARAM_KV_TOKENS,
    PARAM_Q_HEAD_STRIDE,
    PARAM_Q_OFFSETS_STRIDE,
    PARAM_Q_TOKEN_STRIDE,
    PARAM_Q_TOKENS,
)
from ..spec import ATTENTION_BWD, ATTENTION_BWD_PREPROCESS, ATTENTION_FWD, KEY_MAJOR

# Each portable kernel's own slots of its runtime parameters (kernels/spec.py).
PARAM_FWD_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("fill_chunk"))
PARAM_FWD_SLOTS: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("slots"))
PARAM_FWD_V_D_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_FWD.slot("v_d_stride"))
PARAM_BWD_Q_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("q_fill_chunk"))
PARAM_BWD_KV_FILL_CHUNK: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("kv_fill_chunk"))
PARAM_BWD_SLOTS: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("slots"))
PARAM_BWD_KM_D_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD.slot("km_d_stride"))
# The kernels over one array's tokens (the preprocess, the key-major transpose) share their first slots.
PARAM_ARRAY_TOKENS: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("tokens"))
PARAM_ARRAY_TOKEN_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("token_stride"))
PARAM_ARRAY_HEAD_STRIDE: tl.constexpr = tl.constexpr(ATTENTION_BWD_PREPROCESS.slot("head_stride"))
PARAM_KEY_MAJOR_PADDED: tl.constexpr = tl.constexpr(KEY_MAJOR.slot("padded"))


@triton.jit
def program(batch, slots, NUM_HEADS: tl.constexpr):
    """(segment, sequence, head, slot) of this program: sequence == batch is a program of the zero fill of
    the tokens no sequence covers, slot 0 of a sequence the one of its tokens past the maximum length.

    Two grids, chosen by the launcher. A two-axis grid [(segment, sequence, head), slot] runs every
    sequence's first slot, then every second one, and so on. A one-axis grid keeps each sequence's
    slots adjacent, for launches whose operands outgrow L2: the programs running at one time then share
    a few heads' keys and values (forward, dq) or queries (dk/dv) in L2, instead of each streaming its
    own head from memory. Slots count down (the last blocks, the costliest of long sequences, start
    first), so slot 0 runs last.
    """
    if tl.num_programs(1) == 1:
        pid = tl.program_id(0)
        slot = pid % slots
        head_sequence = pid // slots
    else:
        slot = tl.program_id(1)
        head_sequence = tl.program_id(0)
    head = head_sequence % NUM_HEADS
    segment_sequence = head_sequence // NUM_HEADS
    return segment_sequence // (batch + 1), segment_sequence % (batch + 1), head, slots - 1 - slot


@triton.jit
def aligned(stride, ALIGN: tl.constexpr):
    """A stride given in units of ALIGN elements, in elements. The constant factor tells the compiler
    that rows are ALIGN-aligned: without it every load falls back to single elements, with no
    asynchronous copies (tl.multiple_of on a runtime scalar did not do this)."""
    return stride * ALIGN


@triton.jit
def attention_params(params_ptr, ALIGN: tl.constexpr):
    """(batch, q_layout, kv_layout, offsets_strides): the runtime sizes every attention kernel starts
    with, read from the int32 array the launcher passes (not as scalar arguments, whose values
    jax-triton specializes). offsets_strides are the distances between the segments' rows of q and kv
    offsets (0: one row shared by every segment)."""
    batch = tl.load(params_ptr + PARAM_BATCH)
    q_tokens = tl.load(params_ptr + PARAM_Q_TOKENS)
    kv_tokens = tl.load(params_ptr + PARAM_KV_TOKENS)
    q_token_stride = aligned(tl.load(params_ptr + PARAM_Q_TOKEN_STRIDE), ALIGN)
    q_head_stride = aligned(tl.load(params_ptr + PARAM_Q_HEAD_STRIDE), ALIGN)
    kv_token_stride = aligned(tl.load(params_ptr + PARAM_KV_TOKEN_STRIDE), ALIGN)
    kv_head_stride = aligned(tl.load(params_ptr + PARAM_KV_HEAD_STRIDE), ALIGN)
    q_offsets_stride = tl.load(params_ptr + PARAM_Q_OFFSETS_STRIDE)
    kv_offsets_stride = tl.load(params_ptr + PARAM_KV_OFFSETS_STRIDE)
    return (batch, (q_tokens, q_token_stride, q_head_stride), (kv_tokens, kv_token_stride, kv_head_stride),
            (q_offsets_stride, kv_offsets_stride))


@triton.jit
def array_layout(params_ptr, ALIGN: tl.constexpr):
    """The layout of the one array a kernel over tokens reads (the preprocess, the key-major transpose)."""
    tokens = tl.load(params_ptr + PARAM_ARRAY_TOKENS)
    token_stride = aligned(tl.load(params_ptr + PARAM_ARRAY_TOKEN_STRIDE), ALIGN)
    head_stride = aligned(tl.load(params_ptr + PARAM_ARRAY_HEAD_STRIDE), ALIGN)
    return tokens, token_stride, head_stride


@triton.jit
def token_ptr(ptr, segment, head, first_token, layout):
    """Pointer to token `first_token` of `head` in `segment` of an array of this layout (int64
    arithmetic): kernels rebase each pointer once, then address rows from there."""
    num_tokens, token_stride, head_stride = layout
    token = segment.to(tl.int64) * num_tokens + first_token
    return ptr + token * token_stride + head.to(tl.int64) * head_stride


@triton.jit
def stat_ptr(ptr, segment, head, first_token, num_tokens, NUM_HEADS: tl.constexpr):
    """Pointer to the float32 statistic [segments, H, tokens] (log-sum-exp, delta) of `first_token`."""
    return ptr + (segment.to(tl.int64) * NUM_HEADS + head) * num_tokens + first_token


@triton.jit
def key_major_window(segment, seq_start, length, num_tokens, ALIGN: tl.constexpr):
    """(window, lead) of a sequence in a key-major [D, tokens] copy, whose token axis runs over every
    segment: the ALIGN-aligned token at or before the sequence's first (so that its rows load in 16-byte
    pieces), and the tokens from there to the sequence, which the kernels mask."""
    first = segment.to(tl.int64) * num_tokens + seq_start
    window = first // ALIGN * ALIGN
    # No window for no tokens: a block of only masked keys would give non-causal rows a max of -inf.
    lead = tl.where(length > 0, first - window, 0).to(tl.int32)
    return window, lead


@triton.jit
def load_tile(base, rows, cols, num_rows, token_stride, DIMS: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows `rows` of a [tokens, D] view, [len(rows), BLOCK_D] (DIMS = (D, BLOCK_D), BLOCK_D the power of
    two at or above D); rows >= num_rows and cols >= D read 0."""
    D: tl.constexpr = DIMS[0]
    BLOCK_D: tl.constexpr = DIMS[1]
    ptrs = base + rows[:, None] * token_stride + cols[None, :]
    if MASK_ROWS:
        mask = rows[:, None] < num_rows
        if BLOCK_D != D:
            mask = mask & (cols[None, :] < D)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def load_tile_key_major(base, rows, cols, first_row, num_rows, d_stride, DIMS: tl.constexpr,
                        MASKED: tl.constexpr):
    """`load_tile` of a [D, tokens] view (tokens contiguous, D rows `d_stride` apart): rows `rows` as
    [BLOCK_D, len(rows)]; rows outside [first_row, num_rows) (a window's lead, see `key_major_window`)
    and cols >= D read 0."""
    D: tl.constexpr = DIMS[0]
    BLOCK_D: tl.constexpr = DIMS[1]
    ptrs = base + rows[None, :] + cols[:, None] * d_stride
    if MASKED:
        mask = (rows[None, :] >= first_row) & (rows[None, :] < num_rows)
        if BLOCK_D != D:
            mask = mask & (cols[:, None] < D)
        return tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != D:
        return tl.load(ptrs, mask=cols[:, None] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(base, rows, cols, num_rows, value, token_stride, DIMS: tl.constexpr):
    """`value` into rows `rows` < num_rows of a [tokens, D] view, cast to its dtype."""
    mask = rows[:, None] < num_rows
    if DIMS[1] != DIMS[0]:
        mask = mask & (cols[None, :] < DIMS[0])
    tl.store(base + rows[:, None] * token_stride + cols[None, :], value.to(base.dtype.element_ty),
             mask=mask)
