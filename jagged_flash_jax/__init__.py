"""Jagged (variable-length) multi-head flash attention for JAX, with Triton kernels."""

import importlib.util as _importlib_util
import sys as _sys

# kernels.py imports triton, which only the `interpret` and GPU extras install: it is loaded on its first
# attribute access (a kernel launch), so that the package and its `xla` backend import without triton.
# It is bound here as the package's attribute too: `from .. import kernels` then takes it as it is, where
# the import machinery would read its __spec__, which loads it.
_spec = _importlib_util.find_spec(f"{__name__}.kernels")
_spec.loader = _importlib_util.LazyLoader(_spec.loader)
kernels = _sys.modules[_spec.name] = _importlib_util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)
del _spec

from .api import jagged_attention, multi_head_jagged_flash_attention
from .configs import BlockSizes, KernelConfig
from .jagged import (
    DataParallelBatch,
    check_offsets,
    jagged_to_padded,
    offsets_from_lengths,
    pack_data_parallel,
    padded_to_jagged,
)
from .reference import jagged_attention_reference

__all__ = [
    "BlockSizes",
    "DataParallelBatch",
    "KernelConfig",
    "check_offsets",
    "jagged_attention",
    "jagged_attention_reference",
    "jagged_to_padded",
    "multi_head_jagged_flash_attention",
    "offsets_from_lengths",
    "pack_data_parallel",
    "padded_to_jagged",
]
__version__ = "0.2.0"
