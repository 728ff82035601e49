"""Jagged (variable-length) multi-head flash attention for JAX, with Triton kernels."""

from .api import multi_head_jagged_flash_attention
from .configs import BlockSizes, KernelConfig
from .jagged import check_offsets, jagged_to_padded, offsets_from_lengths, padded_to_jagged
from .reference import jagged_attention_reference

__all__ = [
    "BlockSizes",
    "KernelConfig",
    "check_offsets",
    "jagged_attention_reference",
    "jagged_to_padded",
    "multi_head_jagged_flash_attention",
    "offsets_from_lengths",
    "padded_to_jagged",
]
__version__ = "0.1.0"
