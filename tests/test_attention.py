"""The shared correctness suite: every backend against the float64 numpy reference, output and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KERNEL_BACKENDS, JaggedBatch, backend_params
from numpy_reference import attended_mask, attention_and_grads

from jagged_flash_jax import BlockSizes, KernelConfig, multi_head_jagged_flash_attention

# (name, dtype, allow_tf32, tolerance on ||out - ref|| / ||ref||)
PRECISIONS = [
    pytest.param(jnp.float32, False, 1e-5, id="fp32"),
    pytest.param(jnp.float32, True, 2e-3, id="tf32"),
    pytest.param(jnp.bfloat16, True, 1e-2, id="bf16"),
    pytest.param(jnp.float16, True, 1e-2, id="fp16"),
]

# lengths, heads, head dim, max_seq_len, tokens before the first sequence, tokens after the last
CASES = [
    pytest.param(([5, 0, 40, 1, 70], 2, 25, 48, 0, 3), id="empty-len1-pastmax-tail-D25"),
    pytest.param(([17, 33], 1, 8, 64, 4, 5), id="uncovered-lead-D8-H1"),
    pytest.param(([30, 12, 0, 45], 4, 24, 40, 0, 0), id="D24-H4"),
    pytest.param(([33, 64, 7], 1, 64, 64, 0, 2), id="D64"),
    pytest.param(([20, 50], 2, 128, 48, 0, 0), id="D128-pastmax"),
    pytest.param(([3, 0, 2], 1, 8, 1, 1, 1), id="maxlen1"),
]


def run_op(batch: JaggedBatch, dtype, backend, max_seq_len, *, allow_tf32=True, layout="HTD",
           offsets_dtype=np.int32, block_sizes=None):
    """(inputs as float64 [H, T, D], o, dq, dk, dv as float64 [H, T, D]) of one forward and vjp."""
    q, k, v, do = batch.arrays(dtype, layout)
    offsets = jnp.asarray(batch.offsets.astype(offsets_dtype))

    def attention(q, k, v):
        return multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, allow_tf32=allow_tf32,
                                                 backend=backend, layout=layout,
                                                 block_sizes=block_sizes)

    o, vjp = jax.vjp(attention, q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype
    results = (q, k, v, do, o, *vjp(do))

    def to_htd(x):
        x = np.asarray(x.astype(jnp.float32), np.float64)
        return np.swapaxes(x, 0, 1) if layout == "THD" else x

    return [to_htd(x) for x in results]


def assert_matches_reference(batch, results, max_seq_len, tol):
    q, k, v, do, *got = results
    # The reference sees the inputs as rounded to the tested dtype: only the computation's error counts.
    expected = attention_and_grads(q, k, v, do, batch.offsets, max_seq_len)
    attended = attended_mask(batch.offsets, batch.total, max_seq_len)
    for name, g, e in zip(("o", "dq", "dk", "dv"), got, expected):
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        assert np.all(g[:, ~attended] == 0), f"{name} is not zero on unattended tokens"
        # A gradient can be exactly zero (one key per sequence): measure it on the output's scale then.
        scale = np.linalg.norm(e) or np.linalg.norm(expected[0])
        assert scale > 0, "degenerate test: the reference output is zero"
        err = np.linalg.norm(g - e) / scale
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype,allow_tf32,tol", PRECISIONS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, dtype, allow_tf32, tol, backend):
    lengths, heads, dim, max_seq_len, lead, extra = case
    batch = JaggedBatch(lengths, heads, dim, lead=lead, extra=extra, seed=len(lengths) + dim,
                        scale=dim**-0.25)
    results = run_op(batch, dtype, backend, max_seq_len, allow_tf32=allow_tf32)
    assert_matches_reference(batch, results, max_seq_len, tol)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype,allow_tf32,tol", [PRECISIONS[0], PRECISIONS[2]])
def test_token_major_layout(dtype, allow_tf32, tol, backend):
    batch = JaggedBatch([5, 0, 40, 1, 70], 3, 25, extra=3, seed=1, scale=25**-0.25)
    results = run_op(batch, dtype, backend, 48, allow_tf32=allow_tf32, layout="THD")
    assert_matches_reference(batch, results, 48, tol)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offsets_dtype", [np.int32, np.int64])
def test_offsets_dtypes(offsets_dtype, backend):
    batch = JaggedBatch([9, 0, 26, 1], 2, 16, lead=2, extra=2, seed=3, scale=0.5)
    with jax.enable_x64(offsets_dtype == np.int64):
        results = run_op(batch, jnp.float32, backend, 20, allow_tf32=False, offsets_dtype=offsets_dtype)
    assert_matches_reference(batch, results, 20, 1e-5)


@pytest.mark.parametrize("backend", backend_params())
def test_very_negative_logits(backend):
    """Every real score is below -100: the seed's unmasked row max made this NaN.

    A constant feature (q = 10, k = -15) shifts every score by -150 and leaves the softmax well
    conditioned. Scores near 150 carry an absolute float32 rounding error of ~150 * 6e-8 = 1e-5, which
    the exponential turns into that relative error of p: hence 1e-4 here rather than 1e-5.
    """
    batch = JaggedBatch([13, 40, 2], 2, 16, extra=3, seed=7, scale=0.5)
    batch.q[..., 0], batch.k[..., 0] = 10.0, -15.0
    attended = attended_mask(batch.offsets, batch.total, 32)
    scores = np.einsum("htd,hsd->hts", batch.q[:, attended], batch.k[:, attended])
    assert scores.max() < -100
    results = run_op(batch, jnp.float32, backend, 32, allow_tf32=False)
    assert_matches_reference(batch, results, 32, 1e-4)


TILES = [
    BlockSizes(KernelConfig(16, 16), KernelConfig(16, 16), KernelConfig(16, 16), preprocess_block_m=16),
    BlockSizes(KernelConfig(32, 16), KernelConfig(block_m=64, block_n=16), KernelConfig(16, 64),
               preprocess_block_m=32),
]


@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
@pytest.mark.parametrize("block_sizes", TILES, ids=["16x16", "unequal"])
def test_tile_sizes(block_sizes, backend):
    """dq and dk/dv are separate kernels: their tiles need not be equal (the seed assumed they were)."""
    batch = JaggedBatch([5, 0, 40, 1, 70], 2, 25, extra=3, seed=11, scale=25**-0.25)
    results = run_op(batch, jnp.float32, backend, 48, allow_tf32=False, block_sizes=block_sizes)
    assert_matches_reference(batch, results, 48, 1e-5)


@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
def test_backward_is_deterministic(backend):
    batch = JaggedBatch([37, 3, 64], 2, 32, seed=5, scale=0.4)
    first = run_op(batch, jnp.bfloat16, backend, 64)
    second = run_op(batch, jnp.bfloat16, backend, 64)
    for a, b in zip(first[4:], second[4:]):
        np.testing.assert_array_equal(a, b)
