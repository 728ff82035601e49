"""Jagged (variable-length) attention for JAX, with Triton kernels: softmax attention (standard and
FBGEMM's) and HSTU attention."""

from .api import jagged_attention, merge_attention, multi_head_jagged_flash_attention
from .configs import BlockSizes, KernelConfig
from .hstu import hstu_attention
from .jagged import (
    DataParallelBatch,
    check_offsets,
    jagged_to_padded,
    offsets_from_lengths,
    pack_data_parallel,
    padded_to_jagged,
)
from .reference import hstu_attention_reference, jagged_attention_reference

__all__ = [
    "BlockSizes",
    "DataParallelBatch",
    "KernelConfig",
    "check_offsets",
    "hstu_attention",
    "hstu_attention_reference",
    "jagged_attention",
    "jagged_attention_reference",
    "jagged_to_padded",
    "merge_attention",
    "multi_head_jagged_flash_attention",
    "offsets_from_lengths",
    "pack_data_parallel",
    "padded_to_jagged",
]
__version__ = "0.2.0"
