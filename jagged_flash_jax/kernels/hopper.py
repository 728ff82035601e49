"""What the kernels use on Hopper GPUs (sm_90+) only: TMA tensor descriptors, made on the device.

A descriptor of one sequence's rows of one head gives the copy engine the sequence's extent, so a
block load reads zeros past it and no content of the offsets can make it read outside the arrays
(the extent is clamped first, see common._extent). jax-triton >= 0.4.1 with jaxlib >= 0.11.1 gives
the kernels the global scratch memory that descriptors are built in. The rows must be 16-byte aligned:
the launcher passes a descriptor flag only when every stride is (see launch/plan.py).
"""

import triton
import triton.language as tl

from .common import _rows


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
