"""`jagged_attention(..., return_lse=True)` on every backend against a float64 reference of the output,
the log-sum-exp and the gradients of a loss of both (causal, GQA, cross-attention both ways, empty
sequences, truncation, both layouts); -inf exactly for queries with no key and unattended tokens;
`merge_attention` of the two halves of each key sequence equals the whole (values and gradients);
vmap, jit and [shards, B+1] offsets; return_lse=False unchanged and its backward without the lse term."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    Batch,
    Spy,
    attended_mask,
    backend_params,
    case_backend_params,
    implementation_of,
    relative_error,
    to_numpy,
)

import jagged_flash_jax as jfa
from jagged_flash_jax.jagged import attended_tokens

TOL = 1e-5  # float32 with exact products (allow_tf32=False)


def reference_with_lse(q, k, v, do, dlse, offsets, max_seq_len, *, kv_offsets=None, kv_max_seq_len=None,
                       scale=1.0, causal=False):
    """(o, lse, dq, dk, dv) in float64 for token-major q [T_q, H, D], k, v [T_kv, H_kv, D]: lse [T_q, H]
    the natural log-sum-exp of the scaled scores (-inf without keys or attention), and the gradients of
    sum(o * do) + sum(lse * dlse) over the finite lse."""
    q, k, v, do, dlse = (np.asarray(x, np.float64) for x in (q, k, v, do, dlse))
    kv_offsets = offsets if kv_offsets is None else kv_offsets
    kv_max_seq_len = max_seq_len if kv_max_seq_len is None else kv_max_seq_len
    group = q.shape[1] // k.shape[1]
    o, dq, dk, dv = np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(offsets) - 1):
        qs, ks = int(offsets[b]), int(kv_offsets[b])
        n_q = min(int(offsets[b + 1]) - qs, max_seq_len)
        n_k = min(int(kv_offsets[b + 1]) - ks, kv_max_seq_len)
        if n_q == 0 or n_k == 0:
            continue
        rows, keys = slice(qs, qs + n_q), slice(ks, ks + n_k)
        allowed = np.ones((n_q, n_k), bool)
        if causal:
            allowed = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
        seen = allowed.any(axis=1)
        for h in range(q.shape[1]):
            g = h // group
            s = np.where(allowed, scale * q[rows, h] @ k[keys, g].T, -np.inf)
            m = np.where(seen, s.max(axis=1), 0.0)
            e = np.where(allowed, np.exp(s - m[:, None]), 0.0)
            total = e.sum(axis=1)
            p = e / np.where(seen, total, 1.0)[:, None]
            lse[rows, h] = np.where(seen, m + np.log(np.where(seen, total, 1.0)), -np.inf)
            o[rows, h] = p @ v[keys, g]
            dv[keys, g] += p.T @ do[rows, h]
            dp = do[rows, h] @ v[keys, g].T
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True) + np.where(seen, dlse[rows, h], 0)[:, None])
            dq[rows, h] = scale * ds @ k[keys, g]
            dk[keys, g] += scale * ds.T @ q[rows, h]
    return o, lse, dq, dk, dv


CASES = {
    # An empty sequence, one cut by max_seq_len.
    "self-causal": dict(lengths=[5, 0, 21, 1], heads=2, dim=8, max_seq_len=16, causal=True),
    # Fewer queries than keys; an empty key sequence (its query: -inf); GQA.
    "cross-nq<nk-causal-gqa": dict(lengths=[3, 6, 1, 0], kv_lengths=[9, 12, 0, 5], heads=4, kv_heads=2,
                                   dim=8, max_seq_len=16, kv_max_seq_len=10, causal=True),
    # More queries than keys under causal: the first n_q - n_k queries have no key (-inf); MQA.
    "cross-nq>nk-causal-mqa": dict(lengths=[12, 7], kv_lengths=[5, 9], heads=3, kv_heads=1, dim=8,
                                   max_seq_len=10, kv_max_seq_len=4, causal=True),
    "self-scale": dict(lengths=[9, 2], heads=2, dim=12, max_seq_len=16, scale=0.7),
}


def _batch(case):
    spec = dict(CASES[case])
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None),
                       lead=1, extra=2, seed=len(case), scale=0.8)
    return batch, spec


def _lse_layout(x, layout):
    return jnp.swapaxes(x, 0, 1) if layout == "HTD" else x


def _run(batch, spec, backend, layout, dlse):
    """(o, lse, dq, dk, dv) of the op as float64 numpy, token-major, with cotangents (do, dlse); the
    forward and its vjp jitted together, as helpers.run_vjp does (eager calls: test_vmap_and_jit).
    `backend` a name, or an implementation value."""
    q, k, v, do = batch.arrays(jnp.float32, layout)
    where = dict(backend=backend) if isinstance(backend, str) else dict(implementation=backend)
    kwargs = dict(spec, layout=layout, allow_tf32=False, return_lse=True, **where)
    if batch.kv_offsets is not None:
        kwargs["kv_offsets"] = jnp.asarray(batch.kv_offsets, jnp.int32)
    offsets = jnp.asarray(batch.offsets, jnp.int32)

    def forward_and_vjp(q, k, v, do, dlse):
        (o, lse), vjp = jax.vjp(lambda q, k, v: jfa.jagged_attention(q, k, v, offsets, **kwargs), q, k, v)
        return o, lse, vjp((do, dlse))

    o, lse, grads = jax.jit(forward_and_vjp)(q, k, v, do, _lse_layout(jnp.asarray(dlse, jnp.float32), layout))
    assert lse.dtype == jnp.float32 and lse.shape == o.shape[:2]  # [T, H] or [H, T]: q's
    return (to_numpy(o, layout), to_numpy(_lse_layout(lse, layout)), *(to_numpy(g, layout) for g in grads))


def _assert_lse(got, want, attended):
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "lse is -inf at other tokens than expected"
    assert np.all(np.isneginf(got[~attended])), "lse of a token no query attends is not -inf"
    finite = np.isfinite(want)
    assert np.all(np.isfinite(got[finite]))
    err = relative_error(got[finite], want[finite])
    assert err <= TOL, f"lse: relative error {err:.2e}"


def _assert_close(name, got, want):
    assert np.all(np.isfinite(got)), f"{name} has non-finite values"
    err = relative_error(got, want, np.linalg.norm(want) or 1.0)
    assert err <= TOL, f"{name}: relative error {err:.2e}"


# HTD for one case on the interpreter and xla: the lse's layout ([H, T] for HTD) is the api's transpose
# of the kernels' statistics, the same on every backend, and the kernels' reading of HTD is tested on
# every case in test_jagged_attention.py (the xla backend reads HTD by one transpose of the batch).
@pytest.mark.parametrize("case,layout,backend", case_backend_params(
    [(case, layout) for case in CASES for layout in ("THD", "HTD")],
    xla=lambda case, layout: layout == "THD" or case == "cross-nq<nk-causal-gqa",
    interpret=lambda case, layout: layout == "THD" or case == "cross-nq<nk-causal-gqa"))
def test_lse_and_its_gradient_match_float64(case, layout, backend):
    batch, spec = _batch(case)
    # The lse cotangent is random everywhere, also where lse is -inf: there it must count for nothing.
    dlse = np.random.default_rng(1).standard_normal(batch.q.shape[:2])
    got = _run(batch, spec, backend, layout, dlse)
    q, k, v, do = (to_numpy(x) for x in batch.arrays(jnp.float32))
    scale = spec.get("scale", q.shape[-1] ** -0.5)
    want = reference_with_lse(q, k, v, do, dlse, batch.offsets, spec["max_seq_len"],
                              kv_offsets=batch.kv_offsets, kv_max_seq_len=spec.get("kv_max_seq_len"),
                              scale=scale, causal=spec.get("causal", False))
    _assert_lse(got[1], want[1], attended_mask(batch.offsets, q.shape[0], spec["max_seq_len"]))
    for name, g, w in zip(("o", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        _assert_close(name, g, w)
    # The lse term changes the gradients (else the comparison above could not see it dropped).
    without = reference_with_lse(q, k, v, do, 0 * dlse, batch.offsets, spec["max_seq_len"],
                                 kv_offsets=batch.kv_offsets, kv_max_seq_len=spec.get("kv_max_seq_len"),
                                 scale=scale, causal=spec.get("causal", False))
    assert relative_error(without[2], want[2]) > 100 * TOL


def _halves(lengths):
    """Key lengths of the first and second halves of each sequence."""
    first = [n // 2 for n in lengths]
    return first, [n - f for n, f in zip(lengths, first)]


@pytest.mark.parametrize("backend", backend_params())
def test_merging_the_halves_of_the_keys_equals_the_whole(backend):
    """Each sequence's keys split in two halves (own arrays and kv_offsets), attended apart and merged:
    the outputs, lse and the gradients of a loss of both equal the whole's float64 reference."""
    lengths, kv_lengths = [4, 3, 0, 5], [9, 1, 6, 0]
    batch = Batch.make(lengths, 4, 8, kv_lengths=kv_lengths, kv_heads=2, seed=3, scale=0.8)
    first, second = _halves(kv_lengths)
    cut = [int(s) + f for s, f in zip(batch.kv_offsets[:-1], first)]
    parts = [np.concatenate([x[s:c] for s, c in zip(batch.kv_offsets[:-1], cut)]) for x in (batch.k, batch.v)]
    parts += [np.concatenate([x[c:e] for c, e in zip(cut, batch.kv_offsets[1:])]) for x in (batch.k, batch.v)]
    ka, va, kb, vb = (jnp.asarray(x, jnp.float32) for x in parts)
    q, _, _, do = batch.arrays(jnp.float32)
    dlse = jnp.asarray(np.random.default_rng(2).standard_normal(batch.q.shape[:2]), jnp.float32)
    offsets = jnp.asarray(batch.offsets, jnp.int32)
    attend = functools.partial(jfa.jagged_attention, offsets=offsets, max_seq_len=16, backend=backend,
                               allow_tf32=False, return_lse=True)

    def merged(q, ka, va, kb, vb):
        halves = [attend(q, k, v, kv_offsets=jnp.asarray(np.concatenate([[0], np.cumsum(n)]), jnp.int32))
                  for k, v, n in ((ka, va, first), (kb, vb, second))]
        return jfa.merge_attention([h[0] for h in halves], [h[1] for h in halves])

    def merged_and_vjp(q, ka, va, kb, vb, do, dlse):
        (o, lse), vjp = jax.vjp(merged, q, ka, va, kb, vb)
        return o, lse, vjp((do, dlse))

    o, lse, grads = jax.jit(merged_and_vjp)(q, ka, va, kb, vb, do, dlse)  # one compilation
    dq, dka, dva, dkb, dvb = (np.asarray(g, np.float64) for g in grads)
    want = reference_with_lse(*(to_numpy(x) for x in batch.arrays(jnp.float32)), dlse, batch.offsets, 16,
                              kv_offsets=batch.kv_offsets, scale=8 ** -0.5)
    _assert_lse(np.asarray(lse, np.float64), want[1], np.ones(len(dlse), bool))
    _assert_close("o", np.asarray(o, np.float64), want[0])
    _assert_close("dq", dq, want[2])
    split = [np.concatenate([x[s:c] for s, c in zip(batch.kv_offsets[:-1], cut)]) for x in want[3:]]
    split += [np.concatenate([x[c:e] for c, e in zip(cut, batch.kv_offsets[1:])]) for x in want[3:]]
    for name, g, w in zip(("dk first", "dv first", "dk second", "dv second"), (dka, dva, dkb, dvb), split):
        _assert_close(name, g, w)


def test_merge_attention_edge_cases():
    """Parts without keys count for nothing; none at all gives o = 0, lse = -inf and finite gradients;
    one part is itself; mismatched arguments raise."""
    rng = np.random.default_rng(0)
    o1, o2 = (jnp.asarray(rng.standard_normal((3, 2, 4)), jnp.float32) for _ in range(2))
    l1 = jnp.asarray([[0.5, -jnp.inf], [2.0, -jnp.inf], [-jnp.inf, 1.0]], jnp.float32)
    l2 = jnp.asarray([[1.5, -jnp.inf], [-jnp.inf, -jnp.inf], [-jnp.inf, -3.0]], jnp.float32)
    o, lse = jfa.merge_attention([o1, o2], [l1, l2])
    w1 = np.exp(np.float64(0.5) - np.logaddexp(0.5, 1.5))
    np.testing.assert_allclose(o[0, 0], w1 * o1[0, 0] + (1 - w1) * o2[0, 0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0], np.logaddexp(0.5, 1.5), rtol=1e-6)
    np.testing.assert_array_equal(o[1, 0], o1[1, 0])  # the other part has no key
    assert np.all(o[:2, 1] == 0) and np.all(np.isneginf(lse[:2, 1]))
    same = jfa.merge_attention([o1], [l1])
    np.testing.assert_allclose(same[0], jnp.where(jnp.isfinite(l1)[..., None], o1, 0), rtol=1e-6)

    def loss(a, b):
        o, lse = jfa.merge_attention([o1, o2], [a, b])
        return o.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    for g in jax.grad(loss, argnums=(0, 1))(l1, l2):
        assert np.all(np.isfinite(g)) and np.all(g[1:2, 1] == 0) and np.all(g[:2, 1] == 0)
    with pytest.raises(ValueError, match="lses"):
        jfa.merge_attention([o1, o2], [l1])
    with pytest.raises(ValueError, match=r"lses\[1\]"):
        jfa.merge_attention([o1, o2], [l1, l2[:2]])


@pytest.mark.parametrize(("layout", "backend"), [("HTD", "interpret"), ("THD", "xla")])
def test_vmap_and_jit(layout, backend):
    """vmap (shared and batched offsets: folded into heads and into segments) and jit of return_lse,
    values and the vjp with an lse cotangent, equal a loop of single eager calls on the xla backend
    (checked against float64 by test_lse_and_its_gradient_match_float64; the interpreter runs the
    batched calls only). Cross-attention with MQA and queries without a key (lse -inf): 2 sequences of
    3 heads, fewer interpreted programs than the GQA case's 4 sequences of 4 heads."""
    batch, spec = _batch("cross-nq>nk-causal-mqa")
    rng = np.random.default_rng(4)
    q, k, v, do = (jnp.stack([x, 0.5 * x + 0.3]) for x in batch.arrays(jnp.float32, layout))
    dlse = jnp.asarray(rng.standard_normal((2, *batch.q.shape[:2])), jnp.float32)
    dlse = jax.vmap(lambda x: _lse_layout(x, layout))(dlse)
    offsets = jnp.asarray(np.stack([batch.offsets, batch.offsets]), jnp.int32)
    kv_offsets = jnp.asarray(batch.kv_offsets, jnp.int32)

    def with_vjp(q, k, v, do, dlse, offsets, backend=backend):
        op = lambda q, k, v: jfa.jagged_attention(  # noqa: E731
            q, k, v, offsets, kv_offsets=kv_offsets, layout=layout, backend=backend, allow_tf32=False,
            return_lse=True, **spec)
        out, vjp = jax.vjp(op, q, k, v)
        return out, vjp((do, dlse))

    # Eager calls: the two share one problem, compiled once (test_transforms' test_eager_calls_trace_once).
    loop = [with_vjp(q[i], k[i], v[i], do[i], dlse[i], offsets[i], "xla") for i in range(2)]
    want = jax.tree.map(lambda *x: jnp.stack(x), *loop)
    for offsets_axis in (None, 0):
        got = jax.jit(jax.vmap(with_vjp, in_axes=(0, 0, 0, 0, 0, offsets_axis)))(
            q, k, v, do, dlse, offsets if offsets_axis == 0 else offsets[0])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", backend_params(["interpret", "xla"]))
def test_sharded_offsets_lay_lse_out_like_q(backend):
    """[shards, B+1] offsets: lse's token axis is q's, each shard's rows those of a call on that shard."""
    one, two = Batch.make([3, 5], 2, 8, extra=1, seed=5), Batch.make([0, 6], 2, 8, extra=3, seed=6)
    arrays = [np.concatenate([a, b]) for a, b in zip((one.q, one.k, one.v), (two.q, two.k, two.v))]
    offsets = np.stack([one.offsets, two.offsets])
    def call(q, k, v, offsets):  # jitted, the offsets concrete (as in an eager call)
        op = functools.partial(jfa.jagged_attention, max_seq_len=8, backend=backend, return_lse=True)
        return jax.jit(lambda q, k, v: op(q, k, v, jnp.asarray(offsets, jnp.int32)))(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))

    _, lse = call(*arrays, offsets)
    for i, part in enumerate((one, two)):
        _, want = call(part.q, part.k, part.v, part.offsets)
        np.testing.assert_array_equal(lse[i * 9:(i + 1) * 9], want)


@pytest.mark.parametrize("backend", ["xla"])  # the symbolic zero is the custom_vjp's, on any backend
def test_without_lse_the_backward_is_unchanged(backend):
    """return_lse=False (and an lse that the loss does not read) gives the same output and gradients, and
    its backward gets no lse gradient at all (the custom_vjp's symbolic zero): nothing added to it."""
    batch, spec = _batch("self-causal")
    q, k, v, do = batch.arrays(jnp.float32)
    offsets = jnp.asarray(batch.offsets, jnp.int32)
    seen = []

    class DlseSpy(Spy):
        def backward(self, p, config, *args):
            seen.append(args[-1] is None)  # dlse, the last operand
            return super().backward(p, config, *args)

    spy = DlseSpy(backend)
    results = []  # both calls run one backward program (one problem, no lse gradient): traced once
    for return_lse in (False, True):
        def loss(q, k, v, return_lse=return_lse):
            out = jfa.jagged_attention(q, k, v, offsets, implementation=spy, return_lse=return_lse, **spec)
            return jnp.sum((out[0] if return_lse else out) * do)

        results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert seen == [True]
    for g, w in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_array_equal(g, w)

    def with_lse(q):
        o, lse = jfa.jagged_attention(q, k, v, offsets, implementation=spy, return_lse=True, **spec)
        return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    jax.jit(jax.grad(with_lse))(q)
    assert seen[-1] is False


@pytest.mark.parametrize("backend", backend_params())
def test_unwritten_rows_are_never_exposed(backend):
    """The kernels leave the residual of tokens no query attends unwritten (the interpreter fills NaN,
    the GPU leaves whatever was there): made finite garbage here, the lse there is still -inf, and the
    gradients finite."""
    batch, spec = _batch("self-causal")
    attended = attended_mask(batch.offsets, batch.q.shape[0], spec["max_seq_len"])

    class Garbage(Spy):
        def forward(self, p, config, q, k, v, q_offsets, *args):
            o, lse = super().forward(p, config, q, k, v, q_offsets, *args)
            # (from the offsets operand: a constant cannot enter the partitioned call)
            covered = attended_tokens(q_offsets[0], p.q_tokens, p.max_seq_len)
            return o, jnp.where(covered, lse, 1234.0)

    dlse = np.ones(batch.q.shape[:2])
    o, lse, *grads = _run(batch, spec, Garbage(implementation_of(backend)), "THD", dlse)
    assert np.all(np.isneginf(lse[~attended])) and np.all(np.isfinite(lse[attended]))
    assert all(np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("backend", backend_params())
def test_a_nan_input_gives_a_nan_lse(backend):
    """A NaN key makes its sequence's outputs NaN and their lse NaN, not -inf (the value that means "no
    key"), so that merge_attention's lse is NaN there too; the other sequence is untouched."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(10, 2, 8)), jnp.float32) for _ in range(3))
    k = k.at[3, 0, 5].set(jnp.nan)  # sequence 0 (tokens 0-4), head 0
    offsets = [0, 5, 10]
    o, lse = jfa.jagged_attention(q, k, v, offsets, 8, return_lse=True, backend=backend, allow_tf32=False)
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.all(np.isnan(o[:5, 0])) and np.all(np.isnan(lse[:5, 0])), lse[:5, 0]
    assert np.all(np.isfinite(o[5:])) and np.all(np.isfinite(lse[5:])) and np.all(np.isfinite(lse[:, 1]))
    merged_o, merged_lse = jfa.merge_attention([o, o], [lse, lse])
    assert np.all(np.isnan(np.asarray(merged_lse)[:5, 0])) and np.all(np.isnan(np.asarray(merged_o)[:5, 0]))


@pytest.mark.parametrize("backend", backend_params())
def test_the_lse_is_float32_under_x64(backend):
    """With jax_enable_x64 the lse is float32 as documented on every backend, and a float32 cotangent of
    it is accepted."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(9, 2, 8)), jnp.float32) for _ in range(3))
    with jax.enable_x64(True):
        op = lambda q: jfa.jagged_attention(q, k, v, [0, 4, 9], 8, return_lse=True, backend=backend)
        (o, lse), vjp = jax.vjp(op, q)
        assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
        (dq,) = vjp((jnp.zeros_like(o), jnp.ones_like(lse)))
        assert dq.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(dq)))


def test_return_lse_must_be_a_bool():
    q = jnp.zeros((4, 1, 8))
    with pytest.raises(TypeError, match="return_lse"):
        jfa.jagged_attention(q, q, q, [0, 4], 4, backend="xla", return_lse="yes")


def test_flax_layers_return_the_attention_lse():
    """The nnx and linen layers' return_lse: the output of return_lse=False and the lse of jagged_attention
    on the layer's own projections, the two twins alike; FBGEMM semantics refuse it."""
    pytest.importorskip("flax")
    from flax import nnx

    from jagged_flash_jax.flax import (
        JaggedMultiHeadAttention,
        JaggedMultiHeadDotProductAttention,
        linen_variables_from_nnx,
    )

    offsets = jnp.asarray([0, 5, 5, 12], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (14, 16))
    kw = dict(semantics="standard", causal=True, num_kv_heads=1, backend="xla", allow_tf32=False)
    layer = JaggedMultiHeadAttention(2, 16, rngs=nnx.Rngs(0), **kw)
    y, lse = layer(x, offsets, 6, return_lse=True)
    np.testing.assert_array_equal(y, layer(x, offsets, 6))
    q, k, v = layer.query(x), layer.key(x), layer.value(x)
    _, want = jfa.jagged_attention(q, k, v, offsets, 6, causal=True, backend="xla", allow_tf32=False,
                                   return_lse=True)
    np.testing.assert_array_equal(lse, want)
    assert lse.shape == (14, 2) and np.isneginf(lse[12:]).all()
    linen = JaggedMultiHeadDotProductAttention(2, **kw)
    linen_y, linen_lse = linen.apply(linen_variables_from_nnx(layer), x, offsets, 6, return_lse=True)
    np.testing.assert_allclose(linen_y, y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(linen_lse, lse)
    fbgemm = JaggedMultiHeadAttention(2, 16, rngs=nnx.Rngs(0), backend="xla")
    with pytest.raises(ValueError, match="return_lse"):
        fbgemm(x, offsets, 6, return_lse=True)
