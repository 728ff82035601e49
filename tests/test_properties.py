"""Property test: random jagged batches and options, the kernels (interpreted) and the xla backend
against the float64 reference (reproducible: the `ci` hypothesis profile of conftest.py)."""

from __future__ import annotations

import jax.numpy as jnp
from helpers import Batch, assert_matches, attended_mask, reference, run_vjp
from hypothesis import given, settings
from hypothesis import strategies as st

import jagged_flash_jax as jfa


@st.composite
def problems(draw):
    batch = draw(st.integers(0, 4))
    kv_heads = draw(st.integers(1, 2))
    cross = draw(st.booleans())
    return dict(
        lengths=draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)),
        kv_lengths=draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)) if cross else None,
        kv_heads=kv_heads, heads=kv_heads * draw(st.integers(1, 2)),
        dim=draw(st.sampled_from([1, 3, 8, 16, 17, 32])),
        max_seq_len=draw(st.integers(1, 48)), kv_max_seq_len=draw(st.integers(1, 48)),
        causal=draw(st.booleans()), lead=draw(st.integers(0, 3)), extra=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)))


@given(spec=problems())
def test_kernels_on_random_batches(spec):
    check("interpret", spec)


@settings(max_examples=5)  # each example compiles anew: the xla backend's compile dominates
@given(spec=problems())
def test_xla_backend_on_random_batches(spec):
    check("xla", spec)


def check(backend, spec):
    batch = Batch.make(spec["lengths"], spec["heads"], spec["dim"], kv_lengths=spec["kv_lengths"],
                       kv_heads=spec["kv_heads"], lead=spec["lead"], extra=spec["extra"], seed=spec["seed"],
                       scale=spec["dim"] ** -0.25)
    max_len, kv_max = spec["max_seq_len"], spec["kv_max_seq_len"]
    if batch.q.shape[0] == 0 or batch.k.shape[0] == 0:
        return
    results = run_vjp(jfa.jagged_attention, batch, jnp.float32, backend=backend, allow_tf32=False,
                      max_seq_len=max_len, kv_max_seq_len=kv_max, causal=spec["causal"])
    expected = reference(*results[:4], batch.offsets, max_len, kv_offsets=batch.kv_offsets,
                         kv_max_seq_len=kv_max, scale=spec["dim"] ** -0.5, causal=spec["causal"])
    attended_q = attended_mask(batch.offsets, batch.q.shape[0], max_len)
    attended_kv = attended_mask(batch.key_offsets, batch.k.shape[0], kv_max)
    if not any(e.any() for e in expected):
        assert all(not r.any() for r in results[4:])  # nothing attended: every output is zero
        return
    assert_matches(results, expected, 1e-5, attended_q=attended_q, attended_kv=attended_kv)
