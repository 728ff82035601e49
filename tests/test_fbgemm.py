"""FBGEMM's op (`multi_head_jagged_flash_attention`) on every backend against the float64 reference:
output and the three gradients, every precision, both layouts, offsets dtypes, tiles, determinism
(also of jagged_attention with a window, a soft cap and ALiBi)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    KERNEL_BACKENDS,
    TOLERANCES,
    Batch,
    assert_matches,
    attended_mask,
    backend_params,
    case_backend_params,
    fbgemm,
    reference,
    run_vjp,
)

import jagged_flash_jax as jfa
from jagged_flash_jax import BlockSizes, KernelConfig

# lengths, heads, head dim, max_seq_len, tokens before the first sequence, tokens after the last
CASES = {
    "empty-len1-pastmax-tail-D25": ([5, 0, 40, 1, 70], 2, 25, 48, 0, 3),
    "uncovered-lead-D8-H1": ([17, 33], 1, 8, 64, 4, 5),
    "D64-H3": ([33, 64, 7], 3, 64, 64, 0, 2),
    "D128-pastmax": ([20, 50], 2, 128, 48, 0, 0),
    "maxlen1": ([3, 0, 2], 1, 8, 1, 1, 1),
    # An empty last sequence followed by uncovered tokens: a kernel reading it as length 1 would
    # attend (and write) the first uncovered token.
    "trailing-empty": ([6, 9, 0], 2, 16, 16, 0, 4),
}


def check(batch, max_seq_len, precision, backend, layout="HTD", **kwargs):
    dtype, allow_tf32, tol = TOLERANCES[precision]
    results = run_vjp(fbgemm, batch, dtype, layout=layout, max_seq_len=max_seq_len, backend=backend,
                      allow_tf32=allow_tf32, **kwargs)
    # The reference sees the inputs as rounded to the tested dtype: only the computation's error counts.
    expected = reference(*results[:4], batch.offsets, max_seq_len, scale=1.0, out_scale=1.0 / max_seq_len)
    attended = attended_mask(batch.offsets, batch.q.shape[0], max_seq_len)
    assert_matches(results, expected, tol, attended_q=attended, attended_kv=attended)


# The xla backend does not pad the head dimension (D64, D128 test the kernels' head blocks).
@pytest.mark.parametrize("case,backend", case_backend_params(CASES, xla=lambda case: "D64" not in case
                                                            and "D128" not in case))
def test_fp32_matches_float64(case, backend):
    lengths, heads, dim, max_seq_len, lead, extra = CASES[case]
    batch = Batch.make(lengths, heads, dim, lead=lead, extra=extra, seed=len(lengths) + dim,
                       scale=dim**-0.25)
    check(batch, max_seq_len, "fp32", backend)


# The xla backend computes in float32 from inputs of any precision: one case there. Triton's interpreter
# computes tl.dot in float32 whatever its input precision: tf32 with D25 (no key-major operands, see
# plan.key_major) is then the fp32 test's run with a looser tolerance, left to the GPU; tf32 at D64
# takes the key-major operands. bfloat16 and float16 change the loads, stores and roundings alone, the
# same at any head dimension: on the interpreter at D25 (a padded head block), at D64 on the GPU.
@pytest.mark.parametrize("case,precision,backend", case_backend_params(
    [(case, precision) for case in ("empty-len1-pastmax-tail-D25", "D64-H3")
     for precision in ("tf32", "bf16", "fp16")],
    xla=lambda case, precision: case == "empty-len1-pastmax-tail-D25",
    interpret=lambda case, precision: (precision == "tf32") == (case == "D64-H3")))
def test_low_precisions(case, precision, backend):
    lengths, heads, dim, max_seq_len, lead, extra = CASES[case]
    batch = Batch.make(lengths, heads, dim, lead=lead, extra=extra, seed=dim, scale=dim**-0.25)
    check(batch, max_seq_len, precision, backend)


# bfloat16 on xla: test_low_precisions. On the interpreter, the token-major layout in 16 bits is
# test_jagged_attention.py's test_low_precision (bf16 and fp16, THD), and this op's scales in 16 bits are
# test_low_precisions' (HTD): bfloat16 here runs on the GPU.
@pytest.mark.parametrize("precision,backend", case_backend_params(
    ["fp32", "bf16"], xla=lambda precision: precision == "fp32",
    interpret=lambda precision: precision == "fp32"))
def test_token_major_layout(precision, backend):
    batch = Batch.make([5, 0, 40, 1, 70], 3, 25, extra=3, seed=1, scale=25**-0.25)
    check(batch, 48, precision, backend, layout="THD")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offsets_dtype", [np.int32, np.int64])
def test_offsets_dtypes(offsets_dtype, backend):
    batch = Batch.make([9, 0, 26, 1], 2, 16, lead=2, extra=2, seed=3, scale=0.5)
    with jax.enable_x64(offsets_dtype == np.int64):
        check(batch, 20, "fp32", backend, offsets_dtype=offsets_dtype)


@pytest.mark.parametrize("backend", backend_params())
def test_very_negative_logits(backend):
    """Every real score is below -100: an unmasked row max over padded keys made this NaN.

    A constant feature (q = 10, k = -15) shifts every score by -150 and leaves the softmax well
    conditioned. Scores near 150 carry an absolute float32 rounding error of ~150 * 6e-8 = 1e-5, which
    the exponential turns into that relative error of p: hence 1e-4 here rather than 1e-5.
    """
    batch = Batch.make([13, 40, 2], 2, 16, extra=3, seed=7, scale=0.5)
    batch.q[..., 0], batch.k[..., 0] = 10.0, -15.0
    attended = attended_mask(batch.offsets, batch.q.shape[0], 32)
    scores = np.einsum("thd,shd->hts", batch.q[attended], batch.k[attended])
    assert scores.max() < -100
    results = run_vjp(fbgemm, batch, jnp.float32, layout="HTD", max_seq_len=32, backend=backend,
                      allow_tf32=False)
    expected = reference(*results[:4], batch.offsets, 32, scale=1.0, out_scale=1 / 32)
    assert_matches(results, expected, 1e-4, attended_q=attended, attended_kv=attended)


TILES = {
    "16x16": BlockSizes(KernelConfig(16, 16), KernelConfig(16, 16), KernelConfig(16, 16),
                        preprocess_block_m=16),
    "unequal": BlockSizes(KernelConfig(32, 16), KernelConfig(block_m=64, block_n=16), KernelConfig(16, 64),
                          preprocess_block_m=32),
    # Unequal warps: dq and dk/dv programs run in a launch each.
    "two-launches": BlockSizes(KernelConfig(32, 16), KernelConfig(16, 32, num_warps=8),
                               KernelConfig(64, 16, num_stages=3), preprocess_block_m=16),
}


@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
@pytest.mark.parametrize("tiles", TILES, ids=str)
def test_tile_sizes(tiles, backend):
    """dq and dk/dv programs have their own tiles: they need not be equal, and with their own warps or
    stages they run in separate launches."""
    batch = Batch.make([5, 0, 40, 1, 70], 2, 25, extra=3, seed=11, scale=25**-0.25)
    check(batch, 48, "fp32", backend, block_sizes=TILES[tiles])


# jagged_attention with a window, a soft cap and ALiBi (the kernels' other masks and score transforms).
_WITH_OPTIONS = dict(window=(9, 4), softcap=3.0, alibi_slopes=np.asarray([0.3, 0.07], np.float32))


@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
@pytest.mark.parametrize("options", ["fbgemm", "window-softcap-alibi"])
def test_backward_is_deterministic(options, backend):
    batch = Batch.make([37, 3, 64], 2, 32, seed=5, scale=0.4)
    op, kwargs = fbgemm, {}
    if options != "fbgemm":
        op, kwargs = jfa.jagged_attention, _WITH_OPTIONS
    first = run_vjp(op, batch, jnp.bfloat16, layout="HTD", max_seq_len=64, backend=backend, **kwargs)
    second = run_vjp(op, batch, jnp.bfloat16, layout="HTD", max_seq_len=64, backend=backend, **kwargs)
    for a, b in zip(first[4:], second[4:]):
        np.testing.assert_array_equal(a, b)
