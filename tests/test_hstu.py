"""HSTU attention (generative-recommenders' `hstu_mha`): the mask against matrices worked by hand from
gr's `_get_valid_attn_mask`, then the dense reference and the xla backend against the independent float64
helper (helpers.hstu_reference), forward and backward: every mask option alone and together, causal or
not, empty and 1-token sequences, a sequence longer than max_seq_len (with targets straddling it), tokens
before the first and after the last sequence, V != D, both layouts, attn_scale none / scalar / jagged (and
its gradient), float32 and bfloat16; a property sweep; poisoned tokens; forward mode; jit and vmap."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attended_mask, hstu_mask_np, hstu_reference, relative_error
from hypothesis import given
from hypothesis import strategies as st

from jagged_flash_jax import hstu_attention
from jagged_flash_jax.reference import hstu_attention_reference, hstu_mask

# ---------------------------------------------------------------------------------------------------
# The anchors: masks worked by hand (rows are queries, columns keys; positions within the sequence)
# ---------------------------------------------------------------------------------------------------


def _matrix(text: str) -> np.ndarray:
    return np.array([[c == "1" for c in row] for row in text.split()])


ANCHORS = {
    # ids 0 1 2 3 4 4: the two targets see the history and themselves, not each other.
    "targets": (dict(length=6, targets=2), """
        100000
        110000
        111000
        111100
        111110
        111101"""),
    # ids 0 0 1 2 3 4 4 (the context shift, then the targets clamped to id 4): the context rows see the
    # whole history but not the targets; the window of 2 ids hides the context from rows with id > 2.
    "targets+context+window": (dict(length=7, targets=2, contextual_seq_len=2, max_attn_len=2), """
        1111100
        1111100
        1110000
        1111000
        0011100
        0001110
        0001101"""),
    # ids 0..5 6 6: a window of 1 id, lifted for the rows with id >= 6 - 2 (positions 4, 5 and the targets).
    "targets+window+min_full": (dict(length=8, targets=2, max_attn_len=1, min_full_attn_seq_len=2), """
        10000000
        11000000
        01100000
        00110000
        11111000
        11111100
        11111110
        11111101"""),
    # Not causal, ids 0 0 0 1 2 3 4 (position 6 is the target, id 4 unclamped): |id distance| in (0, 2],
    # the diagonal, and the context rows see ids < 4. The history sees the target; the target sees the
    # history within the window.
    "noncausal+targets+context+window": (dict(length=7, targets=1, contextual_seq_len=3, max_attn_len=2,
                                              causal=False), """
        1111110
        1111110
        1111110
        1111110
        1111111
        0001111
        0000111"""),
}


@pytest.mark.parametrize("name", ANCHORS)
def test_mask_anchors(name):
    spec, text = ANCHORS[name]
    spec = dict(spec)
    length, targets = spec.pop("length"), spec.pop("targets")
    expected = _matrix(text)
    positions = jnp.arange(length)[None]
    got = hstu_mask(positions, positions, jnp.array([length]), jnp.array([targets]), **spec)[0]
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(hstu_mask_np(length, targets, length, **spec), expected)


# ---------------------------------------------------------------------------------------------------
# Batches, runs and checks
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HstuBatch:
    """Random float64 q, k [T, H, D], v, do [T, H, V] (token-major), offsets [B+1], num_targets [B] or
    None, attn_scale None, a float or [T]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    offsets: np.ndarray
    num_targets: np.ndarray | None
    attn_scale: np.ndarray | float | None

    @classmethod
    def make(cls, lengths, *, heads=2, dim=8, value_dim=16, targets=None, attn_scale="none", lead=0,
             extra=0, seed=0) -> HstuBatch:
        rng = np.random.default_rng(seed)
        offsets = lead + np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        total = int(offsets[-1]) + extra
        q, k = (rng.standard_normal((total, heads, dim)) for _ in range(2))
        v, do = (rng.standard_normal((total, heads, value_dim)) for _ in range(2))
        scale = {"none": None, "scalar": float(rng.uniform(0.01, 0.1)),
                 "jagged": rng.uniform(0.01, 0.1, total)}[attn_scale]
        return cls(q, k, v, do, offsets, None if targets is None else np.asarray(targets), scale)

    @property
    def scale_kind(self) -> str:
        return "none" if self.attn_scale is None else "scalar" if np.ndim(self.attn_scale) == 0 else "jagged"


@functools.cache
def _program(impl, layout, max_seq_len, alpha, options):
    """One jitted forward and backward, kept for the runs of the same problem (a clean and a poisoned
    one compile once): JAX's vjp of the dense reference ("reference") or of hstu_attention on the
    backend `impl` (or the implementation, a value: test_hstu_hopper.py's)."""
    options = dict(options)
    if impl == "reference":
        op = functools.partial(hstu_attention_reference, **options)
    elif isinstance(impl, str):
        op = functools.partial(hstu_attention, backend=impl, allow_tf32=False, **options)
    else:
        op = functools.partial(hstu_attention, implementation=impl, **options)

    def forward_backward(q, k, v, scale, do, offsets, targets):
        # (scale None: the options' static attn_scale, or none)
        o, vjp = jax.vjp(lambda q, k, v, scale: op(q, k, v, offsets, max_seq_len, alpha=alpha,
                                                    num_targets=targets, layout=layout,
                                                    **({} if scale is None else dict(attn_scale=scale))),
                         q, k, v, scale)
        return o, *vjp(do)

    return jax.jit(forward_backward)


def run(impl, b: HstuBatch, *, max_seq_len, alpha, dtype=jnp.float32, layout="THD", poison=False, **options):
    """(q, k, v, do as rounded to dtype, then o, dq, dk, dv, d_attn_scale), float64 token-major, of one
    jitted forward and backward of `impl` ("reference": JAX's vjp of the dense reference; a backend's
    name, or an implementation: hstu_attention's). `poison`: every token no query attends holds nan in
    q, k, do and a jagged attn_scale, and inf in v. A static attn_scale (a float) goes in `options`."""
    arrays = [b.q, b.k, b.v, b.do]
    scale = b.attn_scale
    if poison:
        outside = ~attended_mask(b.offsets, b.q.shape[0], max_seq_len)
        arrays = [np.where(outside[:, None, None], bad, x) for x, bad in zip(arrays, (np.nan, np.nan, np.inf,
                                                                                     np.nan))]
        if b.scale_kind == "jagged":
            scale = np.where(outside, np.nan, scale)
    q, k, v, do = (jnp.asarray(np.swapaxes(x, 0, 1) if layout == "HTD" else x, dtype) for x in arrays)
    scale = None if scale is None else jnp.asarray(scale, jnp.float32)
    offsets = jnp.asarray(b.offsets, jnp.int32)
    targets = None if b.num_targets is None else jnp.asarray(b.num_targets, jnp.int32)
    program = _program(impl, layout, max_seq_len, alpha, tuple(sorted(options.items())))
    o, dq, dk, dv, d_scale = program(q, k, v, scale, do, offsets, targets)
    assert o.dtype == q.dtype and o.shape == v.shape

    def numpy(x):
        x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
        return np.swapaxes(x, 0, 1) if layout == "HTD" and x.ndim == 3 else x

    return [numpy(x) for x in (q, k, v, do, o, dq, dk, dv)] + [None if d_scale is None else numpy(d_scale)]


def expected_of(results, b: HstuBatch, **kwargs):
    return hstu_reference(*results[:4], b.offsets, num_targets=b.num_targets, attn_scale=b.attn_scale,
                          **kwargs)


def assert_close(results, expected, tol, attended):
    """o, dq, dk, dv (and the attn_scale's gradient) finite, zero on the tokens no query attends, and
    within `tol` of the float64 reference in norm (a gradient that is zero: on the output's scale)."""
    for name, got, want in zip(("o", "dq", "dk", "dv", "d_attn_scale"), results[4:], expected):
        if want is None:
            assert got is None, f"{name}: expected None"
            continue
        assert np.all(np.isfinite(got)), f"{name} has non-finite values"
        if np.ndim(want) > 0:
            assert np.all(got[~attended] == 0), f"{name} is not zero on unattended tokens"
        scale = np.linalg.norm(want) or np.linalg.norm(expected[0])
        assert scale > 0, "degenerate test: the reference output is zero"
        err = relative_error(got, want, scale)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------------------------------
# Every option, on both implementations
# ---------------------------------------------------------------------------------------------------

# An empty and a 1-token sequence, one of 130 tokens cut at max_seq_len = 100 (two blocks of 64), one
# token before the first sequence and two after the last. Targets: none in the 5-token and the empty
# sequences, the whole of the 1-token and the 30-token ones, and 40 of the 130, of which positions 90-99
# are computed (gr counts them from the sequence's true end).
LENGTHS, MAX_SEQ_LEN, ALPHA = [5, 0, 1, 130, 30], 100, 0.35
TARGETS = [0, 0, 1, 40, 30]
CASES = {
    "causal": {},
    "noncausal": dict(causal=False),
    "targets": dict(targets=TARGETS),
    "targets-noncausal": dict(targets=TARGETS, causal=False),
    "window": dict(max_attn_len=4),
    "window-min-full": dict(max_attn_len=4, min_full_attn_seq_len=6),
    "context": dict(contextual_seq_len=3),
    "context-window": dict(contextual_seq_len=3, max_attn_len=4),
    "all": dict(targets=TARGETS, contextual_seq_len=3, max_attn_len=4, min_full_attn_seq_len=6),
    "all-noncausal": dict(targets=TARGETS, contextual_seq_len=3, max_attn_len=4, min_full_attn_seq_len=6,
                          causal=False),
}
# The dense reference, and the op on each backend: the kernels in the interpreter here, on the GPU there.
IMPLS = ["reference", "xla", "interpret", pytest.param("triton", marks=pytest.mark.gpu)]
# The xla backend takes the mask from `hstu_mask` as the reference does: there the cases that add to its
# own code (blocks, gathers, scales, gradients) are enough: every option alone is the reference's.
XLA_CASES = ("causal", "noncausal", "targets", "all", "all-noncausal")


def impl_params(cases, xla_cases=XLA_CASES):
    """pytest params (*case, impl): every case on the reference, those in `xla_cases` on the backends
    too (xla, the kernels in the interpreter, and on the GPU)."""
    params = []
    for case in (c if isinstance(c, tuple) else (c,) for c in cases):
        for impl in IMPLS:
            name, marks = (impl, ()) if isinstance(impl, str) else (impl.values[0], impl.marks)
            if name == "reference" or case[0] in xla_cases:
                params.append(pytest.param(*case, name, id="-".join((*case, name)), marks=marks))
    return params


def check(impl, case, *, attn_scale="none", dtype=jnp.float32, tol=1e-5, layout="THD"):
    options = dict(CASES[case])
    b = HstuBatch.make(LENGTHS, targets=options.pop("targets", None), attn_scale=attn_scale, lead=1, extra=2,
                       seed=len(case))
    results = run(impl, b, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, dtype=dtype, layout=layout, **options)
    expected = expected_of(results, b, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, **options)
    assert_close(results, expected, tol, attended_mask(b.offsets, b.q.shape[0], MAX_SEQ_LEN))


@pytest.mark.parametrize("case,impl", impl_params(CASES))
def test_matches_float64(case, impl):
    check(impl, case)


@pytest.mark.parametrize("case,attn_scale,impl", impl_params(
    [("all", "scalar"), ("all", "jagged"), ("noncausal", "jagged")], xla_cases=("all",)))
def test_attn_scale(case, attn_scale, impl):
    check(impl, case, attn_scale=attn_scale)


@pytest.mark.parametrize("impl", IMPLS)
def test_htd_layout(impl):
    check(impl, "all", attn_scale="jagged", layout="HTD")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case,attn_scale", [("all", "jagged")])
def test_bfloat16(case, attn_scale, impl):
    check(impl, case, attn_scale=attn_scale, dtype=jnp.bfloat16, tol=1e-2)


# ---------------------------------------------------------------------------------------------------
# A property sweep
# ---------------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
    with_targets = draw(st.booleans())
    return dict(
        lengths=lengths,
        targets=[draw(st.integers(0, n)) for n in lengths] if with_targets else None,
        max_seq_len=draw(st.integers(1, 48)), causal=draw(st.booleans()),
        max_attn_len=draw(st.sampled_from([0, 0, 1, 3, 8])),
        min_full_attn_seq_len=draw(st.sampled_from([0, 2, 5])),
        contextual_seq_len=draw(st.sampled_from([0, 0, 1, 2, 5])),
        attn_scale=draw(st.sampled_from(["none", "scalar", "jagged"])),
        dim=draw(st.sampled_from([4, 8])), value_dim=draw(st.sampled_from([4, 8, 12])),
        lead=draw(st.integers(0, 2)), extra=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)))


def check_random(impl, spec):
    spec = dict(spec)
    b = HstuBatch.make(spec.pop("lengths"), targets=spec.pop("targets"), attn_scale=spec.pop("attn_scale"),
                       dim=spec.pop("dim"), value_dim=spec.pop("value_dim"), lead=spec.pop("lead"),
                       extra=spec.pop("extra"), seed=spec.pop("seed"), heads=1)
    if b.q.shape[0] == 0:
        return
    results = run(impl, b, alpha=ALPHA, **spec)
    expected = expected_of(results, b, alpha=ALPHA, **spec)
    if not np.any(expected[0]):  # nothing attended (empty sequences): every result is zero
        assert all(not np.any(r) for r in results[4:] if r is not None)
        return
    assert_close(results, expected, 1e-5, attended_mask(b.offsets, b.q.shape[0], spec["max_seq_len"]))


@given(spec=batches())
def test_reference_on_random_batches(spec):
    check_random("reference", spec)


@given(spec=batches())
def test_xla_backend_on_random_batches(spec):
    check_random("xla", spec)


# ---------------------------------------------------------------------------------------------------
# Poisoned tokens, forward mode, jit and vmap
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_poisoned_tokens_stay_out(impl):
    """NaN and inf in every token no query attends (before the first sequence, past max_seq_len, after
    the last sequence; nan in q, k, do and a jagged attn_scale, inf in v) leave every result exact: bit
    for bit those of finite values there (the same compiled program), and zero on those tokens."""
    options = dict(CASES["all"])
    b = HstuBatch.make([5, 130, 0, 3], targets=[1, 40, 0, 3], attn_scale="jagged", lead=2, extra=3, seed=7)
    del options["targets"]
    clean = run(impl, b, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, **options)
    poisoned = run(impl, b, max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, poison=True, **options)
    outside = ~attended_mask(b.offsets, b.q.shape[0], MAX_SEQ_LEN)
    for name, got, want in zip(("o", "dq", "dk", "dv", "d_attn_scale"), poisoned[4:], clean[4:]):
        assert np.all(got[outside] == 0), f"{name} is not zero outside"
        np.testing.assert_array_equal(got, want, err_msg=f"{name} differs with nan and inf outside")


def test_reference_forward_mode():
    """The dense reference under jax.jvp: <J t, do> = <t, J^T do>, the right side from the float64
    helper's gradients (q, k, v and the jagged attn_scale all carry a tangent)."""
    options = dict(CASES["all"])
    b = HstuBatch.make(LENGTHS, targets=options.pop("targets"), attn_scale="jagged", lead=1, extra=2, seed=3)
    rng = np.random.default_rng(4)
    tangents = [rng.standard_normal(x.shape) for x in (b.q, b.k, b.v, b.attn_scale)]
    f = lambda q, k, v, s: hstu_attention_reference(
        q, k, v, jnp.asarray(b.offsets), MAX_SEQ_LEN, alpha=ALPHA, num_targets=jnp.asarray(b.num_targets),
        attn_scale=s, **options)
    primals = [jnp.asarray(x, jnp.float32) for x in (b.q, b.k, b.v, b.attn_scale)]
    _, out_tangent = jax.jvp(f, primals, [jnp.asarray(t, jnp.float32) for t in tangents])
    expected = hstu_reference(b.q, b.k, b.v, b.do, b.offsets, MAX_SEQ_LEN, alpha=ALPHA,
                              num_targets=b.num_targets, attn_scale=b.attn_scale, **options)
    want = sum(np.vdot(t, g) for t, g in zip(tangents, expected[1:]))
    got = np.vdot(np.asarray(out_tangent, np.float64), b.do)
    assert abs(got - want) <= 1e-5 * sum(np.linalg.norm(t) * np.linalg.norm(g)
                                         for t, g in zip(tangents, expected[1:]))


@pytest.mark.parametrize("backend", ["xla", "interpret", pytest.param("triton", marks=pytest.mark.gpu)])
def test_vmap_folds_batches(backend):
    """jax.vmap over two batches of the same shapes (their own offsets, targets and attn_scale) gives
    each batch's own results, forward and backward (the vmapped axis folded into segments)."""
    options = dict(CASES["all"])
    del options["targets"]
    one = HstuBatch.make([5, 130, 0, 3], targets=[1, 40, 0, 3], attn_scale="jagged", extra=2, seed=1)
    two = HstuBatch.make([70, 1, 60, 7], targets=[9, 0, 60, 2], attn_scale="jagged", extra=2, seed=2)

    def forward_backward(q, k, v, do, offsets, targets, scale):
        o, vjp = jax.vjp(lambda q, k, v, scale: hstu_attention(
            q, k, v, offsets, MAX_SEQ_LEN, alpha=ALPHA, num_targets=targets, attn_scale=scale,
            backend=backend, allow_tf32=False, **options), q, k, v, scale)
        return o, *vjp(do)

    def arrays(b):
        return [jnp.asarray(x, jnp.float32) for x in (b.q, b.k, b.v, b.do)] + [
            jnp.asarray(b.offsets, jnp.int32), jnp.asarray(b.num_targets, jnp.int32),
            jnp.asarray(b.attn_scale, jnp.float32)]

    stacked = jax.jit(jax.vmap(forward_backward))(*(jnp.stack(x) for x in zip(arrays(one), arrays(two))))
    for i, b in enumerate((one, two)):
        expected = hstu_reference(b.q, b.k, b.v, b.do, b.offsets, MAX_SEQ_LEN, alpha=ALPHA,
                                  num_targets=b.num_targets, attn_scale=b.attn_scale, **options)
        results = [b.q, b.k, b.v, b.do] + [np.asarray(x[i], np.float64) for x in stacked]
        assert_close(results, expected, 1e-5, attended_mask(b.offsets, b.q.shape[0], MAX_SEQ_LEN))


def test_xla_backend_empty():
    """No tokens, or no sequence: zeros of the right shapes and dtypes, and a zero attn_scale gradient."""
    for lengths, extra in (([], 0), ([], 3), ([0, 0], 0)):
        b = HstuBatch.make(lengths, attn_scale="jagged", extra=extra)
        results = run("xla", b, max_seq_len=8, alpha=ALPHA)
        assert all(r.shape[0] == b.q.shape[0] and not np.any(r) for r in results[4:])


# ---------------------------------------------------------------------------------------------------
# The benchmarks' cases and padded baseline
# ---------------------------------------------------------------------------------------------------

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: not installed
from benchmarks import hstu_cases, hstu_padded  # noqa: E402


@pytest.mark.parametrize("case", [c.shrunk() for c in hstu_cases.CASES[:5]] + [
    hstu_cases.HstuCase("odd", 5, 1, 4, 4, 40, "random", max_targets=30, contextual_seq_len=7,
                        max_attn_len=3),
    hstu_cases.HstuCase("wide", 4, 1, 4, 4, 40, "random", contextual_seq_len=2, max_attn_len=40)],
    ids=lambda c: c.name)
def test_benchmark_case_pairs(case):
    """A case's FLOP count rests on its attended pairs: those of the dense masks."""
    targets = case.num_targets()
    dense = sum(int(hstu_mask_np(int(n), 0 if targets is None else int(targets[b]), int(n),
                                 contextual_seq_len=case.contextual_seq_len,
                                 max_attn_len=case.max_attn_len).sum())
                for b, n in enumerate(case.lengths()))
    assert case.pairs() == dense
    assert np.all(case.lengths() <= case.max_seq_len)


def test_padded_baseline_matches_reference():
    case = hstu_cases.CASES[4].shrunk()  # targets, context and window
    q, k, v, do, offsets, targets = hstu_padded.inputs(case, jnp.float32)
    options = dict(max_seq_len=case.max_seq_len, alpha=case.alpha, max_attn_len=case.max_attn_len,
                   contextual_seq_len=case.contextual_seq_len)
    got = jax.jit(hstu_padded.step(case, "fwd+bwd"))(q, k, v, do, offsets, targets)
    o = jax.jit(hstu_padded.step(case, "fwd"))(q, k, v, do, offsets, targets)
    expected = hstu_reference(q, k, v, do, np.asarray(offsets), num_targets=np.asarray(targets), **options)
    for name, g, e in zip(("o", "dq", "dk", "dv"), (o, *got), expected):
        assert relative_error(g, e) <= 1e-5, name


# ---------------------------------------------------------------------------------------------------
# The op: its errors, and sharding (4 CPU devices, tests/conftest.py)
# ---------------------------------------------------------------------------------------------------


def _small():
    b = HstuBatch.make([5, 12, 0, 7], heads=4, targets=[1, 3, 0, 2], attn_scale="jagged", seed=9)
    q, k, v, do = (jnp.asarray(x, jnp.float32) for x in (b.q, b.k, b.v, b.do))
    return b, q, k, v, do, jnp.asarray(b.offsets, jnp.int32), jnp.asarray(b.num_targets, jnp.int32)


def bad_calls():
    _, q, k, v, _, offsets, targets = _small()
    op = functools.partial(hstu_attention, max_seq_len=16, alpha=ALPHA)
    return {
        "rank": (lambda: op(q[None], k, v, offsets), ValueError, r"q must have rank 3 \[T, H, D\]"),
        "k shape": (lambda: op(q, k[:, :2], v, offsets), ValueError, "k must have the shape of q"),
        "v heads": (lambda: op(q, k, v[:, :2], offsets), ValueError, r"v must have q's tokens and heads"),
        "dtype": (lambda: op(q, k, v.astype(jnp.bfloat16), offsets), TypeError, "v must have the dtype of q"),
        "float64": (lambda: op(*(np.asarray(x, np.float64) for x in (q, k, v)), offsets), TypeError,
                    r"cast it, e.g. q.astype\(jnp.float32\)"),
        "alpha": (lambda: op(q, k, v, offsets, alpha=float("nan")), ValueError, "alpha must be finite"),
        "alpha traced": (lambda: jax.jit(lambda a: op(q, k, v, offsets, alpha=a))(0.5), TypeError,
                         "alpha must be a static Python float"),
        "max_attn_len": (lambda: op(q, k, v, offsets, max_attn_len=-1), ValueError,
                         "max_attn_len must be >= 0"),
        "targets shape": (lambda: op(q, k, v, offsets, num_targets=targets[:2]), ValueError,
                          r"num_targets must have one entry per sequence, shape \(4,\)"),
        "targets past length": (lambda: op(q, k, v, offsets, num_targets=jnp.asarray([1, 13, 0, 2])),
                                ValueError, r"num_targets\[1\] = 13 for a sequence of 12 tokens"),
        "targets float": (lambda: op(q, k, v, offsets, num_targets=jnp.ones(4)), TypeError,
                          "num_targets must be an integer array"),
        "attn_scale shape": (lambda: op(q, k, v, offsets, attn_scale=jnp.ones(3)), ValueError,
                             r"attn_scale must be a scalar or one factor per token \[T\]"),
        "offsets past T": (lambda: op(q, k, v, [0, 5, 40]), ValueError, r"offsets\[-1\] = 40 is past"),
        "triton on the CPU": (lambda: op(q, k, v, offsets, backend="triton"), ValueError,
                              "backend='triton' needs a GPU"),
        "implementation": (
            lambda: op(q, k, v, offsets, implementation="hopper"), ValueError,
            r"implementation must be one of \('portable', 'interpret', 'xla', 'hstu-hopper'\)"),
    }


BAD = bad_calls()


@pytest.mark.parametrize("name", BAD, ids=str)
def test_bad_input_raises(name):
    call, error, match = BAD[name]
    with pytest.raises(error, match=match):
        call()


def test_reference_checks_as_the_op():
    _, q, k, v, _, offsets, targets = _small()
    with pytest.raises(ValueError, match=r"num_targets\[1\] = 13"):
        hstu_attention_reference(q, k, v, offsets, 16, alpha=ALPHA, num_targets=jnp.asarray([1, 13, 0, 2]))
    with pytest.raises(ValueError, match="v must have q's tokens and heads"):
        hstu_attention_reference(q, k, v[:, :2], offsets, 16, alpha=ALPHA)


def test_forward_mode_says_to_use_the_reference():
    _, q, k, v, _, offsets, _ = _small()
    with pytest.raises(TypeError, match="hstu_attention_reference"):
        jax.jvp(lambda q: hstu_attention(q, k, v, offsets, 16, alpha=ALPHA), (q,), (q,))


def _mesh(shape=(2, 2)):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_heads_sharded_jit_and_shard_map():
    """Heads split over "model": a sharded jit (no collective in the program) and shard_map with
    check_vma give one device's loss and gradients (the per-token scale's too)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    b, q, k, v, do, offsets, targets = _small()
    scale = jnp.asarray(b.attn_scale, jnp.float32)

    def loss(q, k, v, scale):
        o = hstu_attention(q, k, v, offsets, 16, alpha=ALPHA, num_targets=targets, attn_scale=scale,
                           backend="xla", allow_tf32=False)
        return jnp.sum(o * do)

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
    want = step(q, k, v, scale)
    m = _mesh()
    heads = NamedSharding(m, P(None, "model", None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [scale]
    compiled = step.lower(*args).compile()
    got = compiled(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_error(np.asarray(g), np.asarray(w), np.linalg.norm(np.asarray(w)) or 1) < 1e-5
    assert not any(op in compiled.as_text() for op in ("all-gather", "all-to-all", "collective-permute"))
    local = jax.shard_map(lambda q, k, v, s: hstu_attention(q, k, v, offsets, 16, alpha=ALPHA,
                                                            num_targets=targets, attn_scale=s, backend="xla",
                                                            allow_tf32=False),
                          mesh=m, in_specs=(P(None, "model", None),) * 3 + (P(),),
                          out_specs=P(None, "model", None))
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(local(q, k, v, scale) * do), (0, 1, 2)))(q, k, v)
    for g, w in zip(got, want[1][:3]):
        assert relative_error(np.asarray(g), np.asarray(w), np.linalg.norm(np.asarray(w))) < 1e-5


def test_data_parallel_sharded_jit():
    """Each device's own sequences (offsets [shards, B+1], num_targets [shards, B], the per-token scale
    split with the tokens), under a sharded jit: each shard's results equal its batch's alone."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = (([5, 12, 3], [1, 3, 0]), ([9, 0, 11], [2, 0, 5]))
    shards = [HstuBatch.make(lengths, heads=2, targets=targets, attn_scale="jagged", extra=4, seed=s)
              for s, (lengths, targets) in enumerate(specs)]
    assert shards[0].q.shape == shards[1].q.shape
    stack = lambda name, dtype: jnp.concatenate([jnp.asarray(getattr(s, name), dtype) for s in shards])  # noqa: E731
    q, k, v, do, scale = (stack(n, jnp.float32) for n in ("q", "k", "v", "do", "attn_scale"))
    offsets = jnp.stack([jnp.asarray(s.offsets, jnp.int32) for s in shards])
    targets = jnp.stack([jnp.asarray(s.num_targets, jnp.int32) for s in shards])

    def loss(q, k, v, scale, offsets, targets):
        o = hstu_attention(q, k, v, offsets, 16, alpha=ALPHA, num_targets=targets, attn_scale=scale,
                           backend="xla", allow_tf32=False)
        return jnp.sum(o * do)

    m = _mesh()
    data = NamedSharding(m, P("data"))
    args = [jax.device_put(x, data) for x in (q, k, v, scale, offsets, targets)]
    grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(*args)
    half = q.shape[0] // 2
    for i, s in enumerate(shards):
        expected = hstu_reference(s.q, s.k, s.v, s.do, s.offsets, 16, alpha=ALPHA, num_targets=s.num_targets,
                                  attn_scale=s.attn_scale)
        for g, e in zip(grads, expected[1:]):
            got = np.asarray(g)[i * half:(i + 1) * half]
            assert relative_error(got, e, np.linalg.norm(e)) < 1e-5


def test_eager_calls_trace_once():
    """Called eagerly twice, the op and its gradient compile once per problem, with the same numbers."""
    _, q, k, v, do, offsets, targets = _small()
    f = jax.grad(lambda q: jnp.sum(hstu_attention(q, k, v, offsets, 16, alpha=ALPHA, num_targets=targets,
                                                  backend="xla") * do))
    first = f(q)
    with jax.log_compiles(True):
        second = f(q)
    np.testing.assert_array_equal(first, second)
