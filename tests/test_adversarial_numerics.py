"""Adversarial numerics on every backend and on the dense `jagged_attention_reference`: inf and nan in
tokens that no query attends stay out of every other token's output and gradients; logits up to 1e21
with scales that are not powers of two keep the output and dv exact; the log-sum-exp residual is in the
kernels' units on every backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Batch, assert_matches, attended_mask, backend_params, reference, relative_error, run_vjp

import jagged_flash_jax as jfa

# The backends, and the dense reference as a fourth way to compute the same op.
BACKENDS = backend_params(["xla", "interpret", "triton"]) + ["reference"]


def op_of(name: str, backend: str):
    """The public op `name` ("standard" or "fbgemm") on `backend`, called as run_vjp calls it."""
    if backend != "reference":
        op = jfa.jagged_attention if name == "standard" else jfa.multi_head_jagged_flash_attention
        return functools.partial(op, backend=backend, allow_tf32=False)
    if name == "standard":
        return jfa.jagged_attention_reference

    def fbgemm(q, k, v, offsets, max_seq_len, **kwargs):
        return jfa.jagged_attention_reference(q, k, v, offsets, max_seq_len, scale=1.0,
                                              out_scale=1.0 / max_seq_len, **kwargs)

    return fbgemm


def semantics(name: str, max_seq_len: int, head_dim: int, scale=None) -> dict:
    """The float64 reference's scale and out_scale of the op `name`."""
    if name == "fbgemm":
        return {"scale": 1.0, "out_scale": 1.0 / max_seq_len}
    return {"scale": head_dim**-0.5 if scale is None else scale, "out_scale": 1.0}


# ---------------------------------------------------------------------------------------------------
# inf and nan in tokens that no query attends
# ---------------------------------------------------------------------------------------------------

# Sequences of 5, 0, 40 and 3 tokens, max_seq_len 32, 4 tokens after the last: tokens 37 to 44 are past
# max_seq_len in the third sequence, 48 to 51 after the last. A 64-row block of the first (or last)
# sequence spans both, so an implementation that reads a block past its sequence's end meets them.
LENGTHS, MAX_SEQ_LEN, EXTRA = [5, 0, 40, 3], 32, 4
POISON = {37: np.nan, 44: np.inf, 49: np.inf, 51: np.nan}  # token: value, past max_seq_len and after all
# op, layout, query heads, kv heads (GQA for the standard op), head dim
POISON_CASES = {"standard-gqa-THD": ("standard", "THD", 2, 1, 8), "fbgemm-HTD": ("fbgemm", "HTD", 2, 2, 8)}


# On the GPU, one operand at a time (which one a kernel reads past its sequence shows in the test's
# id); on the interpreter, the xla backend and the dense reference, all four at once: inf and nan
# survive every sum and product, so an operand read where it should not be shows as surely with the
# others poisoned too (the interpreter runs the GPU's kernels, one case costing four).
POISON_PARAMS = [
    pytest.param(case, operand, backend, id=f"{case}-{operand}-{backend}",
                 marks=[pytest.mark.gpu] if backend == "triton" else [])
    for case in POISON_CASES
    for backend in ("interpret", "triton", "xla", "reference")
    for operand in (("q", "k", "v", "do") if backend == "triton" else ("all",))]


@pytest.mark.parametrize("case,operand,backend", POISON_PARAMS)
def test_inf_and_nan_in_unattended_tokens_stay_out(case, operand, backend):
    """nan and inf in `operand` (or in all four) at tokens past max_seq_len and after the last
    sequence: every output and gradient is finite, matches the float64 reference on the same data
    (which never reads those tokens) and is 0 on the tokens nothing attends. A masked weight multiplied
    by a value it read gives 0 * nan = nan: masked operands must be selected away, not multiplied."""
    name, layout, heads, kv_heads, dim = POISON_CASES[case]
    batch = Batch.make(LENGTHS, heads, dim, kv_heads=kv_heads, extra=EXTRA, seed=3)
    for each in ("q", "k", "v", "do") if operand == "all" else (operand,):
        poisoned = getattr(batch, each).copy()
        for token, value in POISON.items():
            poisoned[token] = value
        setattr(batch, each, poisoned)
    results = run_vjp(op_of(name, backend), batch, jnp.float32, layout=layout, max_seq_len=MAX_SEQ_LEN)
    expected = reference(*results[:4], batch.offsets, MAX_SEQ_LEN, **semantics(name, MAX_SEQ_LEN, dim))
    attended = attended_mask(batch.offsets, len(batch.q), MAX_SEQ_LEN)
    assert not attended[list(POISON)].any(), "the poisoned tokens must be unattended"
    assert_matches(results, expected, 1e-5, attended_q=attended, attended_kv=attended)


# ---------------------------------------------------------------------------------------------------
# Large logits
# ---------------------------------------------------------------------------------------------------

# op, scale (None: 1/sqrt(D)), head dim, log2 of the factor on q (q k^T reaches about 1536 * 2**that),
# layout. 1/sqrt(24) and 1/3 are not powers of two: scaling a score rounds it.
LARGE_CASES = {
    "default-scale-D24-logits~1e6-THD": ("standard", None, 24, 10, "THD"),
    "default-scale-D24-logits~1e21-HTD": ("standard", None, 24, 59, "HTD"),
    "scale-1/3-logits~1e12-THD": ("standard", 1 / 3, 16, 30, "THD"),
    "fbgemm-logits~1e21-HTD": ("fbgemm", None, 16, 59, "HTD"),
}


def _integer_batch(dim: int, exponent: int) -> Batch:
    """q small integers times 2**exponent and k small integers, so that q k^T is exact in float32 (at
    most 1536 * 2**exponent, under 2**24 units of 2**exponent) in every backend and every pass; v and do
    random. The top score of each row is unique, and every other score is at least 2**exponent below:
    the softmax rows are one-hot in float64."""
    batch = Batch.make([13, 40, 2], 2, dim, extra=3, seed=9)
    rng = np.random.default_rng(5)
    batch.q = rng.integers(-8, 9, batch.q.shape) * 2.0**exponent
    batch.k = rng.integers(-8, 9, batch.k.shape).astype(np.float64)
    for b in range(len(batch.offsets) - 1):
        tokens = slice(batch.offsets[b], min(batch.offsets[b + 1], batch.offsets[b] + 32))
        scores = np.sort(np.einsum("qhd,khd->hqk", batch.q[tokens], batch.k[tokens]), axis=-1)
        assert np.all(scores[..., -1] > scores[..., -2]), "a tie at the top: pick another seed"
    return batch


def _rounding_bound(results, other, out_scale: float, scale: float) -> float:
    """What rounding alone can leave in dq (other = k) or dk (other = q) where the float64 value is 0:
    each row's ds = p (dp - delta) with dp and delta two float32 sums of the same products, so |ds| is
    about D * eps * |do_i| |v_j| at most; times scale and the largest row of `other`."""
    v, do = results[2], results[3]
    row_norms = lambda x: np.linalg.norm(x, axis=-1)
    return scale * out_scale * row_norms(v).max() * row_norms(other).max() * row_norms(do).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LARGE_CASES)
def test_large_logits_with_any_scale(case, backend):
    """Exact scores up to 1e21 with one-hot softmax rows: o and dv match float64 to rounding (the top
    score of a row gets probability exactly 1 in the forward and in both backward passes, which needs
    the row max, or the log-sum-exp, subtracted from the unscaled score before the scale multiplies),
    and dq and dk, 0 in float64, stay at the level of rounding."""
    name, scale, dim, exponent, layout = LARGE_CASES[case]
    max_seq_len = 32
    batch = _integer_batch(dim, exponent)
    kwargs = {} if name == "fbgemm" or scale is None else {"scale": scale}
    results = run_vjp(op_of(name, backend), batch, jnp.float32, layout=layout, max_seq_len=max_seq_len,
                      **kwargs)
    sem = semantics(name, max_seq_len, dim, scale)
    expected = reference(*results[:4], batch.offsets, max_seq_len, **sem)
    for label, got in zip(("o", "dq", "dk", "dv"), results[4:]):
        assert np.all(np.isfinite(got)), f"{label} has non-finite values"
    for label, got, want in (("o", results[4], expected[0]), ("dv", results[7], expected[3])):
        err = relative_error(got, want)
        assert err < 1e-6, f"{label}: relative error {err:.1e}"
    for label, got, want, other in (("dq", results[5], expected[1], results[1]),
                                    ("dk", results[6], expected[2], results[0])):
        bound = _rounding_bound(results, other, sem["out_scale"], sem["scale"])
        err = relative_error(got, want, bound)
        assert err < 1e-5, f"{label}: {err:.1e} of the rounding bound"


@pytest.mark.parametrize("backend", backend_params(["xla", "interpret", "triton"]))
def test_the_backward_bounds_its_probabilities_by_one(backend):
    """The backward recomputes each probability as exp(s - lse) from scores it forms again; where its
    rounding of s differs from the forward's, large logits could push that past 1, and to inf. Given an
    lse far too small (the worst such rounding), every allowed probability is bounded to exactly 1: dv
    of key j is then the sum of do over the queries that see it, and no gradient is inf or nan."""
    from helpers import Spy, implementation_of

    class SmallLse(Spy):
        def forward(self, p, config, *args):
            o, lse = super().forward(p, config, *args)
            return o, lse - 1e4  # in the unscaled scores' units: exp2 of about +5e3 unbounded

    batch = Batch.make([7, 0, 20, 3], 2, 8, extra=2, seed=4)
    q, k, v, do = batch.arrays(jnp.float32)
    op = lambda q, k, v: jfa.jagged_attention(q, k, v, batch.offsets, 16, causal=True, allow_tf32=False,
                                              implementation=SmallLse(implementation_of(backend)))
    _, vjp = jax.vjp(op, q, k, v)
    dq, dk, dv = (np.asarray(g, np.float64) for g in vjp(do))
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    want = np.zeros_like(dv)
    for b in range(len(batch.offsets) - 1):
        start = batch.offsets[b]
        n = min(batch.offsets[b + 1] - start, 16)
        for j in range(n):  # causal: key j is seen by queries j..n-1
            want[start + j] = np.asarray(do, np.float64)[start + j:start + n].sum(axis=0)
    assert relative_error(dv, want) < 1e-5


# ---------------------------------------------------------------------------------------------------
# The log-sum-exp residual
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params(["xla", "interpret", "triton"]))
def test_log_sum_exp_in_units_of_the_unscaled_scores(backend):
    """Every backend saves the float32 log-sum-exp lse of each attended query in units of the unscaled
    scores (scale * lse is the natural log-sum-exp of the scaled scores), +inf where a query has no key,
    so one conversion serves them all."""
    scale, max_seq_len = 0.3, 16
    batch = Batch.make([6, 9, 20], 2, 8, kv_lengths=[3, 0, 12], extra=2, seed=2, scale=2.0)
    q, k, v, _ = batch.arrays(jnp.float32)
    op = lambda q: jfa.jagged_attention(q, k, v, batch.offsets, max_seq_len, kv_offsets=batch.kv_offsets,
                                        causal=True, scale=scale, backend=backend, allow_tf32=False)
    _, vjp = jax.vjp(op, q)
    (lse,) = [x for x in jax.tree.leaves(vjp) if x.shape == (1, 2, len(batch.q))]
    assert lse.dtype == jnp.float32
    lse = np.asarray(lse[0])  # the interpreter leaves rows it does not write as a NaN bit pattern
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    for b in range(len(batch.offsets) - 1):
        q0, k0 = batch.offsets[b], batch.kv_offsets[b]
        n_q = min(batch.offsets[b + 1] - q0, max_seq_len)
        n_k = min(batch.kv_offsets[b + 1] - k0, max_seq_len)
        scores = np.einsum("qhd,khd->hqk", q64[q0:q0 + n_q], k64[k0:k0 + n_k])
        allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
        seen = allowed.any(-1)
        if not seen.any():  # no key at all: +inf, and nothing to take the max of
            assert np.all(lse[:, q0:q0 + n_q] == np.inf)
            continue
        scaled = np.where(allowed, scale * scores, -np.inf)[:, seen]
        top = scaled.max(-1)
        want = (top + np.log(np.exp(scaled - top[..., None]).sum(-1))) / scale
        got = lse[:, q0:q0 + n_q]
        assert np.all(got[:, ~seen] == np.inf)
        np.testing.assert_allclose(got[:, seen], want, rtol=1e-6, atol=1e-5)
