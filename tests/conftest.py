"""The test session: 4 CPU devices for the sharding tests, hypothesis profiles, and the `gpu` marker
(tests that need a GPU with jax-triton skip elsewhere). Tests import what they share from helpers.py."""

from __future__ import annotations

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Set before JAX starts its backends: the sharding tests need several devices; on a GPU machine this
# only adds CPU devices, and the default device stays the GPU.
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", False)

# Reproducible property tests: a fixed seed and a bounded number of examples on CI; `dev` explores more.
settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from helpers import GPU_AVAILABLE  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU with jax-triton")
    for item in items:
        if "gpu" in item.keywords and not GPU_AVAILABLE:
            item.add_marker(skip)
