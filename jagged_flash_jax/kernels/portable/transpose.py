"""The key-major transpose: an operand [tokens, H, D] copied to [H, D, tokens], for the TF32 products that
need both operands K-major (Triton otherwise copies a token-major B operand into shared memory one
element at a time).
"""

import triton
import triton.language as tl

from .memory import PARAM_KEY_MAJOR_PADDED, aligned, array_layout, load_tile


@triton.jit
def key_major_kernel(
    x_ptr, params_ptr,
    out_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    KEY_MAJOR_ALIGN: tl.constexpr,
):
    """out[h, d, t] = x[t, h, d] for BLOCK_T tokens (axis 0) of one head (axis 1), out's token axis
    padded with 0 to PARAM_KEY_MAJOR_PADDED tokens: a key-major operand, in one pass."""
    tokens, token_stride, head_stride = array_layout(params_ptr, STRIDE_ALIGN)
    padded = aligned(tl.load(params_ptr + PARAM_KEY_MAJOR_PADDED), KEY_MAJOR_ALIGN)
    head = tl.program_id(1)
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    x_base = x_ptr + first * token_stride + head.to(tl.int64) * head_stride
    x = load_tile(x_base, rows, cols, tokens - first, token_stride, (D, BLOCK_D), True)
    out = out_ptr + head.to(tl.int64) * D * padded + first
    tl.store(out + cols[:, None].to(tl.int64) * padded + rows[None, :], tl.trans(x),
             mask=(cols[:, None] < D) & (rows[None, :] < padded - first))
