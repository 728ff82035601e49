"""The standard op (`jagged_attention`) on every backend against the float64 reference: causal with
n_q = n_k, n_q < n_k and n_q > n_k; GQA and MQA; distinct kv_offsets with empty query or key
sequences; kv_max_seq_len truncation; scale; both layouts; int32 and int64 offsets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    TOLERANCES,
    Batch,
    assert_matches,
    attended_mask,
    backend_params,
    case_backend_params,
    launched_kernels,
    reference,
    run_vjp,
    variant,
)

import jagged_flash_jax as jfa

CASES = {
    # n_q = n_k per sequence; one sequence longer than max_seq_len. (Heads are computed apart: two show
    # a wrong head stride as well as four, at half the interpreter's programs.)
    "self-causal": dict(lengths=[5, 0, 40, 1, 30], heads=2, dim=16, max_seq_len=32, causal=True),
    # Target attention: fewer queries than keys, an empty key sequence (its query gets 0) and an empty
    # query sequence (its keys get no gradient); GQA with groups of 2.
    "cross-nq<nk-causal-gqa": dict(lengths=[3, 8, 1, 0, 6], kv_lengths=[9, 20, 0, 5, 30], heads=4,
                                   kv_heads=2, dim=16, max_seq_len=32, kv_max_seq_len=24, causal=True),
    # More queries than keys under causal: the first n_q - n_k queries see no key; MQA; keys cut by
    # kv_max_seq_len.
    "cross-nq>nk-causal-mqa": dict(lengths=[20, 9, 33], kv_lengths=[5, 9, 2], heads=3, kv_heads=1,
                                   dim=8, max_seq_len=32, kv_max_seq_len=4, causal=True),
    "cross-gqa-truncated": dict(lengths=[7, 0, 25], kv_lengths=[40, 3, 0], heads=4, kv_heads=2, dim=24,
                                max_seq_len=16, kv_max_seq_len=32),
    "self-scale-D40": dict(lengths=[17, 2, 9], heads=2, dim=40, max_seq_len=20, scale=0.7),
    # Sequences of several key blocks, none starting at a multiple of 16 tokens (the forward's
    # key-major v loads its key window from the 16-aligned token before), one cut by max_seq_len.
    "self-causal-blocks": dict(lengths=[75, 3, 110], heads=2, dim=16, max_seq_len=100, causal=True),
}


def check(case: str, backend: str, layout: str, precision="fp32", offsets_dtype=np.int32, cases=None,
          **options):
    spec = dict((CASES if cases is None else cases)[case])
    dtype, allow_tf32, tol = TOLERANCES[precision]
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None),
                       lead=1, extra=2, seed=len(case), scale=0.6)
    where = dict(backend=backend) if isinstance(backend, str) else dict(implementation=backend)
    results = run_vjp(jfa.jagged_attention, batch, dtype, layout=layout, allow_tf32=allow_tf32,
                      offsets_dtype=offsets_dtype, **where, **spec, **options)
    max_len, kv_max = spec["max_seq_len"], spec.get("kv_max_seq_len", spec["max_seq_len"])
    scale = spec.get("scale", batch.q.shape[-1] ** -0.5)
    expected = reference(*results[:4], batch.offsets, max_len, kv_offsets=batch.kv_offsets,
                         kv_max_seq_len=kv_max, scale=scale, causal=spec.get("causal", False))
    assert_matches(results, expected, tol,
                   attended_q=attended_mask(batch.offsets, batch.q.shape[0], max_len),
                   attended_kv=attended_mask(batch.key_offsets, batch.k.shape[0], kv_max))


# The xla backend reads HTD by one transpose of the whole batch: HTD for one case there. The kernels
# read either layout through its strides, the same code: on the interpreter HTD for GQA with
# cross-attention and for a padded head dimension (the columns past D, of the next head in THD, are
# another token's in HTD); on the GPU every case in both. (HTD over several blocks, and with every
# option: test_key_major_operands and test_features.py's test_matches_float64_htd.)
HTD_ON_THE_INTERPRETER = ("cross-nq<nk-causal-gqa", "self-scale-D40")


@pytest.mark.parametrize("case,layout,backend", case_backend_params(
    [(case, layout) for case in CASES for layout in ("THD", "HTD")],
    xla=lambda case, layout: layout == "THD" or case == "cross-nq<nk-causal-gqa",
    interpret=lambda case, layout: layout == "THD" or case in HTD_ON_THE_INTERPRETER))
def test_matches_float64(case, layout, backend):
    check(case, backend, layout)


@pytest.mark.parametrize("backend", backend_params(["interpret", "triton"]))
@pytest.mark.parametrize("case", ["cross-nq<nk-causal-gqa", "self-scale-D40"])
def test_programs_grouped_by_sequence(case, backend):
    """The one-axis grid large problems get (each sequence's programs adjacent, for L2 reuse) computes
    the same results as the two-axis grid small problems get (the test cases are small)."""
    check(case, variant(backend, l2_reuse_bytes=0), "THD")


# The key-major copies read either layout (then the kernels read the copies alike): both layouts on
# the interpreter for the windows that start before a sequence, each other case in one; every case in
# both on the GPU.
KEY_MAJOR_ON_THE_INTERPRETER = {("self-causal-blocks", "THD"), ("self-causal-blocks", "HTD"),
                                ("cross-nq<nk-causal-gqa", "THD"), ("cross-gqa-truncated", "HTD"),
                                ("self-scale-D40", "THD")}


@pytest.mark.parametrize("case,layout,backend", case_backend_params(
    [(case, layout) for case in ("self-causal-blocks", "cross-nq<nk-causal-gqa", "cross-gqa-truncated",
                                 "self-scale-D40") for layout in ("THD", "HTD")],
    xla=lambda case, layout: False, interpret=lambda *case: case in KEY_MAJOR_ON_THE_INTERPRETER))
def test_key_major_operands(case, layout, backend):
    """The key-major v of the forward and q and do of the dk/dv programs, which float32 inputs with TF32
    products take, forced here for exact float32 products: key and query windows that start before the
    sequence, causal, cross, GQA, padded D."""
    check(case, variant(backend, key_major=True), layout)


@pytest.mark.parametrize("backend", backend_params(["interpret", "triton"]))
def test_key_major_windows_ignore_the_tokens_before_a_sequence(backend):
    """A key-major key or query window starts up to 15 tokens before its sequence: those tokens' q, k
    and v (inf and nan here, on every token no sequence attends) reach neither the output nor the
    gradients."""
    max_len = 24
    batch = Batch.make([30, 30], 2, 16, lead=5, extra=3, seed=2, scale=0.6)  # windows from 0 and 32
    attended = attended_mask(batch.offsets, batch.q.shape[0], max_len)
    batch.q[~attended], batch.k[~attended], batch.v[~attended] = -np.inf, np.inf, np.nan
    results = run_vjp(jfa.jagged_attention, batch, jnp.float32, max_seq_len=max_len,
                      implementation=variant(backend, key_major=True), allow_tf32=False)
    expected = reference(*results[:4], batch.offsets, max_len, scale=16**-0.5)
    assert_matches(results, expected, TOLERANCES["fp32"][2], attended_q=attended, attended_kv=attended)


# Few queries at wide heads on the GPU: the portable kernels' key blocks, grown from the query rows that
# short sequences leave, within shared memory (configs.fit_to_lengths; 64 x 128 forward tiles at D = 256
# and float32 D = 128, and 64 x 64 dq tiles on 3 stages at D = 256, took more than sm_90's 227 KB).
SHORT_WIDE = {
    "cross-D256-short": dict(lengths=[40, 64, 7], kv_lengths=[300, 20, 129], heads=2, dim=256,
                             max_seq_len=64, kv_max_seq_len=256, causal=True),
    "self-D256-short": dict(lengths=[64, 50, 3], heads=2, dim=256, max_seq_len=64),
    "cross-D128-short": dict(lengths=[33, 64, 0], kv_lengths=[200, 64, 9], heads=2, dim=128,
                             max_seq_len=64, kv_max_seq_len=256),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case,precision", [("cross-D256-short", "bf16"), ("self-D256-short", "fp16"),
                                            ("cross-D128-short", "fp32")])
def test_short_sequences_at_wide_heads_fit_shared_memory(case, precision):
    check(case, "triton", "THD", precision, cases=SHORT_WIDE)


# The portable forward with its unmasked key blocks loaded by TMA (kernels.attention_fwd_tma_kernel, which
# Hopper GPUs take under triton >= 3.7; forced here): 16-bit inputs at a power-of-two D, the interpreter
# reading Triton's host descriptors as TMA reads them. Several key blocks under causal, cross-attention
# with GQA and keys cut by kv_max_seq_len, both layouts.
@pytest.mark.parametrize("case,layout,precision,backend", case_backend_params(
    [("self-causal-blocks", "THD", "bf16"), ("cross-nq<nk-causal-gqa", "HTD", "fp16"),
     ("cross-gqa-truncated", "THD", "bf16")], xla=lambda *case: False))
def test_tma_loads(case, layout, precision, backend):
    check(case, variant(backend, tma_loads=True), layout, precision)


@pytest.mark.parametrize("backend", backend_params(["interpret", "triton"]))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_tma_loads_read_no_key_past_a_sequence(backend, causal, layout, monkeypatch):
    """The TMA tiles cover the unmasked key blocks only: the tokens no sequence attends (inf keys and
    nan values on each sequence's tokens past max_seq_len, right before the next sequence's) reach no
    output, and the forward is the pointer loads' (bitwise, in the interpreter)."""
    launched = launched_kernels(monkeypatch)
    max_len = 48
    batch = Batch.make([40, 70, 33, 64], 2, 32, lead=3, extra=5, seed=3, scale=0.6)
    attended = attended_mask(batch.offsets, batch.q.shape[0], max_len)
    batch.k[~attended], batch.v[~attended] = np.inf, np.nan
    results = {tma: run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                            causal=causal, implementation=variant(backend, tma_loads=tma))
               for tma in (False, True)}
    assert launched.count("attention_fwd_tma_kernel") == 1 and launched.count("attention_fwd_kernel") == 1
    expected = reference(*results[True][:4], batch.offsets, max_len, scale=32**-0.5, causal=causal)
    assert_matches(results[True], expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)
    if backend == "interpret":
        np.testing.assert_array_equal(results[True][4], results[False][4])


# int64 offsets on xla: the same conversion for any case (and test_fbgemm.py's test_offsets_dtypes).
@pytest.mark.parametrize("case,backend", case_backend_params(
    ["cross-nq<nk-causal-gqa", "cross-nq>nk-causal-mqa"], xla=lambda case: case == "cross-nq<nk-causal-gqa"))
def test_int64_offsets(case, backend):
    with jax.enable_x64(True):
        check(case, backend, "THD", offsets_dtype=np.int64)


# The kernels only: the xla backend computes in float32 from any input dtype, the same for either op
# (test_fbgemm.py's test_low_precisions runs it).
@pytest.mark.parametrize("backend", backend_params(["interpret", "triton"]))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision(precision, backend):
    check("cross-nq<nk-causal-gqa", backend, "THD", precision)


@pytest.mark.parametrize("backend", backend_params())
def test_causal_sees_only_the_past(backend):
    """Changing a later token changes no earlier output under causal self-attention."""
    batch = Batch.make([12, 7], 2, 8, seed=9)
    q, k, v, _ = batch.arrays(jnp.float32)
    offsets = jnp.asarray(batch.offsets, jnp.int32)
    attention = jax.jit(lambda k, v: jfa.jagged_attention(q, k, v, offsets, 16, causal=True, backend=backend))
    before = attention(k, v)  # compiled once for both calls
    after = attention(k.at[8].add(5.0), v.at[8].add(5.0))  # token 8 of sequence 0
    np.testing.assert_array_equal(before[:8], after[:8])
    assert not np.array_equal(before[8:12], after[8:12])
    np.testing.assert_array_equal(before[12:], after[12:])  # the other sequence


def test_fbgemm_op_is_the_standard_op_rescaled():
    """multi_head_jagged_flash_attention = jagged_attention(scale=1) / max_seq_len."""
    batch = Batch.make([9, 0, 14], 2, 8, extra=2, seed=4, scale=0.5)
    q, k, v, _ = batch.arrays(jnp.float32, "HTD")
    offsets = jnp.asarray(batch.offsets, jnp.int32)
    fbgemm = jfa.multi_head_jagged_flash_attention(q, k, v, offsets, 16, backend="xla", allow_tf32=False)
    standard = jfa.jagged_attention(q, k, v, offsets, 16, scale=1.0, layout="HTD", backend="xla",
                                    allow_tf32=False)
    np.testing.assert_allclose(fbgemm, standard / 16, rtol=1e-6, atol=1e-7)


def test_log_sum_exp_only_for_attended_queries():
    """The forward writes the statistics of exactly the attended queries, +inf for those that have no
    key; the interpreter's outputs start as a NaN bit pattern, so a write to any other row shows (an
    empty sequence read as length 1 would write the token after it)."""
    batch = Batch.make([6, 9, 0], 2, 8, kv_lengths=[3, 0, 5], extra=4, seed=2)
    q, k, v, _ = batch.arrays(jnp.float32)
    op = lambda q: jfa.jagged_attention(q, k, v, batch.offsets, 16, kv_offsets=batch.kv_offsets, causal=True,
                                        backend="interpret")
    _, vjp = jax.vjp(op, q)
    (lse,) = [x for x in jax.tree.leaves(vjp) if x.ndim == 3 and x.shape[:2] == (1, 2)]
    lse = np.asarray(lse[0])
    # Sequence 0: 6 queries, 3 keys, causal: the first 3 queries see no key. Sequence 1 has no keys.
    no_key = np.r_[0:3, 6:15]
    assert np.all(lse[:, no_key] == np.inf)
    assert np.all(np.isfinite(lse[:, 3:6]))
    assert np.all(np.isnan(lse[:, 15:]))  # after the last (empty) sequence: never written
