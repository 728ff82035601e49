"""Property test: random jagged batches, kernels (interpreted) and the reference against float64 numpy."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from conftest import JaggedBatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import assert_matches_reference, run_op

batches = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(0, 40), min_size=0, max_size=4),
    "heads": st.integers(1, 2),
    "dim": st.sampled_from([1, 3, 8, 16, 17, 32]),
    "max_seq_len": st.integers(1, 48),
    "lead": st.integers(0, 3),
    "extra": st.integers(0, 3),
    "seed": st.integers(0, 2**16),
})


@pytest.mark.parametrize("backend", ["interpret", "xla"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batches)
def test_random_jagged_batches(backend, spec):
    batch = JaggedBatch(spec["lengths"], spec["heads"], spec["dim"], lead=spec["lead"],
                        extra=spec["extra"], seed=spec["seed"], scale=spec["dim"] ** -0.25)
    if batch.total == 0:
        return
    results = run_op(batch, jnp.float32, backend, spec["max_seq_len"], allow_tf32=False)
    if not batch.lengths.any():
        assert all(not r.any() for r in results[4:])  # nothing attended: all outputs are zero
        return
    assert_matches_reference(batch, results, spec["max_seq_len"], 1e-5)
