"""Shared fixtures: the backends available here, and jagged batches built from lengths."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jagged_flash_jax.launch import gpu

jax.config.update("jax_enable_x64", False)

GPU_AVAILABLE = gpu.available()
KERNEL_BACKENDS = ["interpret"] + (["triton"] if GPU_AVAILABLE else [])
BACKENDS = KERNEL_BACKENDS + ["xla"]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU with jax-triton")
    for item in items:
        if "gpu" in item.keywords and not GPU_AVAILABLE:
            item.add_marker(skip)


def backend_params(backends=None):
    """pytest params for backends, the triton one marked `gpu`."""
    return [pytest.param(b, marks=pytest.mark.gpu) if b == "triton" else b
            for b in (backends or BACKENDS)]


class JaggedBatch:
    """Random q, k, v, do (float64 numpy) for sequences of the given lengths, plus `extra` uncovered
    tokens after the last sequence and `lead` before the first."""

    def __init__(self, lengths, heads, dim, *, lead=0, extra=0, seed=0, scale=1.0):
        rng = np.random.default_rng(seed)
        self.lengths = np.asarray(lengths, np.int64)
        self.offsets = lead + np.concatenate([[0], np.cumsum(self.lengths)])
        self.total = int(self.offsets[-1]) + extra
        shape = (heads, self.total, dim)
        self.q, self.k, self.v, self.do = (rng.standard_normal(shape) * s for s in (scale, scale, 1, 1))

    def arrays(self, dtype, layout="HTD"):
        def cast(x):
            x = np.swapaxes(x, 0, 1) if layout == "THD" else x
            return jax.numpy.asarray(x, dtype)

        return cast(self.q), cast(self.k), cast(self.v), cast(self.do)


@pytest.fixture
def make_batch():
    return JaggedBatch
