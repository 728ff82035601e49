"""The sliding window, logit soft-capping and ALiBi of `jagged_attention` on every backend against the
float64 reference (outputs and gradients): each alone and combined with causal, GQA and MQA,
cross-attention with n_q < n_k and n_q > n_k, empty sequences and truncation by max_seq_len; that the
kernels skip the key blocks outside the band; the soft cap at large logits; the slopes get no
gradient; the dense reference; errors on bad options."""

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
    launched_kernels,
    reference,
    relative_error,
    run_vjp,
    variant,
)

import jagged_flash_jax as jfa
from jagged_flash_jax import BlockSizes, KernelConfig

SLOPES = (0.5, 0.21, 0.09, 0.03)

CASES = {
    # A window alone on self-attention: an empty sequence, one cut by max_seq_len.
    "window": dict(lengths=[5, 0, 40, 1, 30], heads=2, dim=16, max_seq_len=32, window=(3, 2)),
    # A left window under causal (the intersection), n_q < n_k, GQA, an empty key and query sequence.
    "window-left-causal-cross-nq<nk-gqa": dict(
        lengths=[3, 8, 1, 0, 6], kv_lengths=[9, 20, 0, 5, 30], heads=4, kv_heads=2, dim=16,
        max_seq_len=32, kv_max_seq_len=24, causal=True, window=(5, 3)),
    # A right window only, n_q > n_k (queries before the keys' band see none), MQA, keys truncated.
    "window-right-cross-nq>nk-mqa": dict(
        lengths=[20, 9, 33], kv_lengths=[5, 9, 12], heads=3, kv_heads=1, dim=8, max_seq_len=32,
        kv_max_seq_len=10, window=(None, 1)),
    "softcap": dict(lengths=[17, 2, 9], heads=2, dim=24, max_seq_len=20, softcap=0.8, scale=1.3),
    "softcap-causal-cross-nq>nk-gqa": dict(
        lengths=[20, 9, 0], kv_lengths=[5, 9, 2], heads=4, kv_heads=2, dim=16, max_seq_len=16,
        causal=True, softcap=2.0),
    "alibi": dict(lengths=[5, 0, 40, 1, 30], heads=2, dim=16, max_seq_len=32, alibi=True),  # a slope each
    "alibi-cross-nq<nk-gqa": dict(lengths=[3, 8, 1], kv_lengths=[9, 20, 0], heads=4, kv_heads=2, dim=16,
                                  max_seq_len=32, kv_max_seq_len=24, alibi=True),
    # Everything together over several key and query blocks of the interpreter's tiles.
    "all-causal-cross-gqa-blocks": dict(
        lengths=[35, 3, 70], kv_lengths=[75, 0, 110], heads=4, kv_heads=2, dim=16, max_seq_len=64,
        kv_max_seq_len=100, causal=True, window=(20, 4), softcap=1.5, alibi=True),
    "all-self-blocks": dict(lengths=[75, 3, 110], heads=2, dim=16, max_seq_len=100, window=(17, 40),
                            softcap=3.0, alibi=True),
}
BOTH_LAYOUTS = ("all-causal-cross-gqa-blocks", "window-right-cross-nq>nk-mqa")
# On the xla backend: a window alone (both bounds), a right window with n_q > n_k and MQA, and every
# option together with causal, cross-attention (n_q < n_k, an empty key and query sequence), GQA and
# several 64-row blocks, or on self-attention with both window bounds. Its band, cap and slopes act on
# every score alike, whatever else the case has; each option alone is checked on xla below too
# (test_softcap_at_large_logits, test_slopes_get_no_gradient, test_auto_keeps_the_options).
XLA_CASES = ("window", "window-right-cross-nq>nk-mqa", "all-causal-cross-gqa-blocks", "all-self-blocks")


def check(case: str, backend, layout: str, precision="fp32", **extra):
    """`case` against float64, run by `backend` (a name, or an implementation value)."""
    spec = dict(CASES[case], **extra)
    dtype, allow_tf32, tol = TOLERANCES[precision]
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None),
                       lead=1, extra=2, seed=len(case), scale=0.8)
    if spec.pop("alibi", False):
        spec["alibi_slopes"] = np.asarray(SLOPES[:batch.q.shape[1]], np.float32)
    where = dict(backend=backend) if isinstance(backend, str) else dict(implementation=backend)
    results = run_vjp(jfa.jagged_attention, batch, dtype, layout=layout, allow_tf32=allow_tf32, **where,
                      **spec)
    max_len, kv_max = spec["max_seq_len"], spec.get("kv_max_seq_len", spec["max_seq_len"])
    expected = reference(*results[:4], batch.offsets, max_len, kv_offsets=batch.kv_offsets,
                         kv_max_seq_len=kv_max, scale=spec.get("scale", batch.q.shape[-1] ** -0.5),
                         causal=spec.get("causal", False), window=spec.get("window", (None, None)),
                         softcap=spec.get("softcap"), alibi_slopes=spec.get("alibi_slopes"))
    assert_matches(results, expected, tol,
                   attended_q=attended_mask(batch.offsets, batch.q.shape[0], max_len),
                   attended_kv=attended_mask(batch.key_offsets, batch.k.shape[0], kv_max))


@pytest.mark.parametrize("case,backend", case_backend_params(CASES, xla=lambda case: case in XLA_CASES))
def test_matches_float64(case, backend):
    check(case, backend, "THD")


# The portable forward's TMA loads (which Hopper GPUs take at D = 128 under triton >= 3.7; forced here) with
# every option over several key blocks: a window's clean blocks by TMA, its edges by pointers.
@pytest.mark.parametrize("case,layout", [("all-self-blocks", "THD"), ("all-causal-cross-gqa-blocks", "HTD")])
@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
def test_tma_loads_with_every_option(case, layout, backend, monkeypatch):
    launched = launched_kernels(monkeypatch)
    check(case, variant(backend, tma_loads=True), layout, "bf16")
    assert "attention_fwd_tma_kernel" in launched and "attention_fwd_kernel" not in launched


# HTD: the xla backend transposes it once, for one case.
@pytest.mark.parametrize("case,backend",
                         case_backend_params(BOTH_LAYOUTS, xla=lambda case: case == BOTH_LAYOUTS[0]))
def test_matches_float64_htd(case, backend):
    check(case, backend, "HTD")


def test_window_bounds_are_inclusive_and_bottom_right_aligned():
    """The reference's band itself, on one sequence: window (1, 0) with n_q = 2, n_k = 4 lets query 0
    (key position 2) see keys 1 and 2 exactly; so the output is the mean of those values at scale 0."""
    q = jnp.zeros((2, 1, 16))
    k = jnp.zeros((4, 1, 16))
    v = jnp.arange(4.0)[:, None, None] * jnp.ones((4, 1, 16))
    for backend in ("xla", "interpret"):
        o = jfa.jagged_attention(q, k, v, [0, 2], 4, kv_offsets=[0, 4], window=(1, 0), backend=backend)
        np.testing.assert_allclose(np.asarray(o)[:, 0, 0], [1.5, 2.5], rtol=1e-6)


@pytest.mark.parametrize("backend", backend_params(KERNEL_BACKENDS))
def test_window_skips_key_blocks_outside_the_band(backend):
    """Keys and values NaN in the key blocks outside the band of every query block: a kernel that
    visited them, even masked, would multiply a probability 0 by NaN. Forward and backward stay finite
    and exact: the cost follows the window, not the sequence. (The xla backend scans every block.)"""
    tiles = BlockSizes(fwd=KernelConfig(16, 16), dkdv=KernelConfig(block_m=16, block_n=16),
                       dq=KernelConfig(block_m=16, block_n=16), preprocess_block_m=16)
    n_q, n_k, left = 24, 96, 5
    batch = Batch.make([n_q], 2, 16, kv_lengths=[n_k], seed=3)
    outside = (n_k - n_q - left) // 16 * 16  # the key blocks before the first query's band
    assert outside >= 48
    poisoned = Batch(batch.q, batch.k.copy(), batch.v.copy(), batch.do, batch.offsets, batch.kv_offsets)
    poisoned.k[:outside] = np.nan
    poisoned.v[:outside] = np.nan
    results = run_vjp(jfa.jagged_attention, poisoned, jnp.float32, max_seq_len=n_k, backend=backend,
                      allow_tf32=False, window=(left, 0), block_sizes=tiles)
    k, v = batch.k.copy(), batch.v.copy()
    k[:outside] = v[:outside] = 0.0  # what the band sees of them: nothing
    expected = reference(results[0], k, v, results[3], batch.offsets, n_k, kv_offsets=batch.kv_offsets,
                         scale=16**-0.5, window=(left, 0))
    assert_matches(results, expected, TOLERANCES["fp32"][2])


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("logits", [1e4, 1e12, 1e20])
def test_softcap_at_large_logits(logits, backend):
    """Scores of ~1e4 to 1e20 capped at 5: finite, and exact (the cap's tanh is +-1 there, and its
    derivative 0, so only the keys of small scores carry gradient)."""
    batch = Batch.make([9, 4, 13], 2, 16, seed=int(np.log10(logits)))
    batch.q *= np.sqrt(logits / 16)
    batch.k *= np.sqrt(logits / 16)
    results = run_vjp(jfa.jagged_attention, batch, jnp.float32, max_seq_len=16, backend=backend,
                      allow_tf32=False, softcap=5.0, scale=0.25)
    expected = reference(*results[:4], batch.offsets, 16, scale=0.25, softcap=5.0)
    for name, got, want in zip(("o", "dq", "dk", "dv"), results[4:], expected):
        assert np.all(np.isfinite(got)), name
        scale = np.linalg.norm(want) or np.linalg.norm(expected[0])
        assert relative_error(got, want, scale) <= 1e-5, name


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("softcap", [64.0, 65.0, 1e4, 1e8, 1e30])
def test_a_softcap_far_above_the_scores(softcap, backend):
    """A soft cap far above the scores (tanh's argument s / softcap tiny): the cap barely acts, and the
    output and gradients match float64 as closely as without a cap (a tanh written as (1 - e) / (1 + e)
    cancels there: 1e8 gave 0.33 relative, 1e30 uniform attention). 64 is the largest cap whose tanh the
    kernels take as that quotient (shared.SERIES_CAP_LOG2), 65 the smallest with the series."""
    batch = Batch.make([9, 4, 13], 2, 16, seed=int(np.log10(softcap)))
    results = run_vjp(jfa.jagged_attention, batch, jnp.float32, max_seq_len=16, backend=backend,
                      allow_tf32=False, softcap=softcap, scale=0.25)
    expected = reference(*results[:4], batch.offsets, 16, scale=0.25, softcap=softcap)
    for name, got, want in zip(("o", "dq", "dk", "dv"), results[4:], expected):
        assert relative_error(got, want) <= 1e-5, name


@pytest.mark.parametrize("backend", backend_params())
def test_slopes_get_no_gradient(backend):
    """ALiBi's slopes are an operand, traced under jit, and their cotangent is zero (not differentiated,
    as in FlashAttention); q's gradient is the reference's."""
    batch = Batch.make([6, 11], 2, 16, seed=9)
    q, k, v, _ = batch.arrays(jnp.float32)

    def loss(q, slopes):
        o = jfa.jagged_attention(q, k, v, batch.offsets, 16, alibi_slopes=slopes, backend=backend,
                                 allow_tf32=False)
        return jnp.sum(o * jnp.asarray(batch.do, jnp.float32))

    dq, dslopes = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, jnp.asarray([0.3, 0.1]))
    assert not np.any(np.asarray(dslopes))
    want = reference(batch.q, batch.k, batch.v, batch.do, batch.offsets, 16, scale=0.25,
                     alibi_slopes=[0.3, 0.1])[1]
    assert relative_error(dq, want) <= 1e-5


def test_dense_reference_supports_the_options():
    """jagged_attention_reference with all three options matches the float64 reference."""
    spec = CASES["all-causal-cross-gqa-blocks"]
    batch = Batch.make(spec["lengths"], 4, 16, kv_lengths=spec["kv_lengths"], kv_heads=2, seed=2, scale=0.8)
    options = dict(max_seq_len=64, kv_max_seq_len=100, causal=True, window=(20, 4), softcap=1.5)
    slopes = np.asarray(SLOPES, np.float32)
    results = run_vjp(jfa.jagged_attention_reference, batch, jnp.float32, alibi_slopes=slopes, **options)
    expected = reference(*results[:4], batch.offsets, kv_offsets=batch.kv_offsets, scale=0.25,
                         alibi_slopes=slopes, **options)
    assert_matches(results, expected, 1e-5)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(window=3), TypeError, "window must be a pair"),
    (dict(window=(1, 2, 3)), TypeError, "window must be a pair"),
    (dict(window=(-1, None)), ValueError, "window's left bound must be >= 0"),
    (dict(window=(None, 1.5)), TypeError, "window's right bound must be a static Python int"),
    (dict(window=(True, None)), TypeError, "window's left bound"),
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite and > 0"),
    (dict(softcap="1"), TypeError, "softcap must be a static Python float"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \[H\] = \(2,\)"),
    (dict(alibi_slopes=np.ones(2, np.int32)), TypeError, "alibi_slopes must be a float array"),
    (dict(alibi_slopes="slopes"), TypeError, "alibi_slopes must be a float array"),
])
def test_bad_options_raise(kwargs, error, match):
    x = jnp.zeros((8, 2, 16))
    with pytest.raises(error, match=match):
        jfa.jagged_attention(x, x, x, [0, 8], 8, backend="xla", **kwargs)


def test_traced_window_raises():
    x = jnp.zeros((8, 2, 16))
    with pytest.raises(TypeError, match="window's left bound"):
        jax.jit(lambda x, w: jfa.jagged_attention(x, x, x, [0, 8], 8, window=(w, 0), backend="xla"))(x, 2)


def test_auto_keeps_the_options():
    """backend='auto' (xla on this CPU) runs every option, never silently without one."""
    batch = Batch.make([7, 12], 2, 16, seed=4)
    slopes = np.asarray([0.2, 0.6], np.float32)
    results = run_vjp(jfa.jagged_attention, batch, jnp.float32, max_seq_len=16, backend="auto",
                      allow_tf32=False, window=(3, 1), softcap=1.0, alibi_slopes=slopes)
    expected = reference(*results[:4], batch.offsets, 16, scale=0.25, window=(3, 1), softcap=1.0,
                         alibi_slopes=slopes)
    assert_matches(results, expected, 1e-5)
