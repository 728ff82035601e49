"""The flax layers: shapes and dtypes, numerics against a hand-written computation from the layer's
own weights, jit and gradients, a few optax steps, linen/nnx agreement, and kernel backends vs xla."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from conftest import backend_params  # noqa: E402
from flax import nnx  # noqa: E402

from jagged_flash_jax import jagged_attention_reference, offsets_from_lengths  # noqa: E402
from jagged_flash_jax.flax import (  # noqa: E402
    JaggedMultiHeadAttention,
    JaggedMultiHeadDotProductAttention,
    linen_variables_from_nnx,
    load_linen_variables,
)

HIGHEST = jax.lax.Precision.HIGHEST
F, H, F_OUT = 16, 2, 12  # qkv_features 16 -> D = 8
# Four sequences, with 3 tokens before and 4 after them outside offsets; sequence 1 is longer than
# MAX_SEQ_LEN (its tail is not attended) and sequence 2 is empty.
LENGTHS, LEAD, EXTRA, MAX_SEQ_LEN = (13, 30, 0, 21), 3, 4, 24


def _batch(lengths=LENGTHS, lead=LEAD, extra=EXTRA, features=F, seed=0):
    offsets = lead + offsets_from_lengths(jnp.asarray(lengths))
    total = int(offsets[-1]) + extra
    x = jax.random.normal(jax.random.key(seed), (total, features), jnp.float32)
    return x, offsets


def _layer(dtype=None, *, backend="xla", seed=1, use_bias=True, out_features=F_OUT, **kw):
    # Random (not zero) biases, so that the bias paths are checked too.
    return JaggedMultiHeadAttention(H, F, qkv_features=F, out_features=out_features, use_bias=use_bias,
                                    dtype=dtype, bias_init=nnx.initializers.normal(0.5),
                                    rngs=nnx.Rngs(seed), backend=backend, **kw)


def _params(layer):
    return linen_variables_from_nnx(layer)["params"]


def _hand_written(params, x, offsets, max_seq_len):
    """The layer written out with einsums: projections to [H, T, D], attention, output projection."""
    def project(p):
        y = jnp.einsum("tf,fhd->htd", x, p["kernel"], precision=HIGHEST)
        return y + p["bias"][:, None, :] if "bias" in p else y

    q, k, v = (project(params[name]) for name in ("query", "key", "value"))
    a = jagged_attention_reference(q, k, v, offsets, max_seq_len, allow_tf32=False)
    y = jnp.einsum("htd,hdo->to", a, params["out"]["kernel"], precision=HIGHEST)
    return y + params["out"]["bias"] if "bias" in params["out"] else y


def _numpy_layer(params, x, offsets, max_seq_len):
    """float64 numpy, one sequence and head at a time: softmax(q k^T) v / max_seq_len, no 1/sqrt(D)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    q, k, v = (np.einsum("tf,fhd->thd", x, p[n]["kernel"]) + p[n]["bias"] for n in ("query", "key", "value"))
    a = np.zeros_like(q)
    offsets = np.asarray(offsets)
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        end = min(end, start + max_seq_len)
        if end == start:
            continue
        for h in range(q.shape[1]):
            s = q[start:end, h] @ k[start:end, h].T
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            a[start:end, h] = (w / w.sum(axis=-1, keepdims=True)) @ v[start:end, h] / max_seq_len
    return np.einsum("thd,hdo->to", a, p["out"]["kernel"]) + p["out"]["bias"]


def _rel_err(a, b, scale=None):
    """max |a - b| relative to max |b| (or to `scale`)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) if scale is None else scale))


def _check_param_grads(grads, expected, tol):
    """Every parameter gradient finite and close to `expected`; nonzero except the key bias, which
    softmax ignores (q . (k + b_k) shifts a query's scores by one constant), so its gradient is ~0."""
    scale = max(float(np.max(np.abs(np.asarray(e, np.float64)))) for e in jax.tree.leaves(expected))
    for name, leaves in expected.items():
        for leaf, e in leaves.items():
            g = grads[name][leaf]
            assert bool(jnp.all(jnp.isfinite(g))), (name, leaf)
            if (name, leaf) == ("key", "bias"):
                assert _rel_err(g, e, scale) < tol and _rel_err(g, 0 * e, scale) < tol, (name, leaf)
            else:
                assert float(jnp.max(jnp.abs(g.astype(jnp.float32)))) > 0, (name, leaf)
                assert _rel_err(g, e) < tol, (name, leaf)


def _attended(offsets, total, max_seq_len):
    """Boolean [T]: the tokens the op attends (the first max_seq_len of each sequence)."""
    mask = np.zeros(total, bool)
    offsets = np.asarray(offsets)
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        mask[start:min(end, start + max_seq_len)] = True
    return mask


def test_import_without_flax_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["flax"] = None  # as if flax were not installed
        import jagged_flash_jax
        assert hasattr(jagged_flash_jax, "multi_head_jagged_flash_attention")
        try:
            import jagged_flash_jax.flax
        except ImportError as err:
            print(err)
        else:
            raise SystemExit("no ImportError")
    """)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=root, env=env)
    assert run.returncode == 0, run.stderr
    assert "pip install 'jagged-flash-jax[flax]'" in run.stdout


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shape_dtype(dtype):
    x, offsets = _batch()
    layer = _layer(dtype)
    y = layer(x, offsets, MAX_SEQ_LEN)
    assert y.shape == (x.shape[0], F_OUT) and y.dtype == dtype
    assert layer.head_dim == F // H
    assert layer.query.kernel.shape == (F, H, F // H) and layer.out.kernel.shape == (H, F // H, F_OUT)
    assert layer.query.kernel.dtype == jnp.float32  # param_dtype
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    linen = JaggedMultiHeadDotProductAttention(H, out_features=F_OUT, dtype=dtype, backend="xla")
    yl = linen.apply(linen.init(jax.random.key(0), x, offsets, MAX_SEQ_LEN), x, offsets, MAX_SEQ_LEN)
    assert yl.shape == y.shape and yl.dtype == dtype


def test_dtype_promotion_and_defaults():
    x, offsets = _batch()
    layer = JaggedMultiHeadAttention(H, F, rngs=nnx.Rngs(0), backend="xla")
    assert (layer.qkv_features, layer.out_features, layer.head_dim) == (F, F, F // H)
    assert layer(x.astype(jnp.bfloat16), offsets, MAX_SEQ_LEN).dtype == jnp.float32  # promoted to params
    half = JaggedMultiHeadAttention(H, F, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend="xla")
    assert half(x.astype(jnp.bfloat16), offsets, MAX_SEQ_LEN).dtype == jnp.bfloat16


def test_argument_errors():
    x, offsets = _batch()
    with pytest.raises(ValueError, match="divisible"):
        JaggedMultiHeadAttention(3, F, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="backend"):
        JaggedMultiHeadAttention(H, F, rngs=nnx.Rngs(0), backend="cuda")
    with pytest.raises(ValueError, match="divisible"):
        JaggedMultiHeadDotProductAttention(3, backend="xla").init(jax.random.key(0), x, offsets, 8)
    layer = _layer()
    with pytest.raises(ValueError, match="rank 2"):
        layer(x[None], offsets, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="in_features"):
        layer(x[:, :8], offsets, MAX_SEQ_LEN)
    with pytest.raises(TypeError, match="max_seq_len"):
        layer(x, offsets, 2.5)


def test_matches_hand_written_computation():
    x, offsets = _batch()
    layer = _layer(precision=HIGHEST)
    params = _params(layer)
    y = np.asarray(layer(x, offsets, MAX_SEQ_LEN))
    expected = _numpy_layer(params, x, offsets, MAX_SEQ_LEN)
    assert _rel_err(y, expected) < 1e-5
    assert _rel_err(y, _hand_written(params, x, offsets, MAX_SEQ_LEN)) < 1e-5
    # Tokens the op does not attend (lead, tail past max_seq_len, trailing) get exactly the out bias.
    attended = _attended(offsets, x.shape[0], MAX_SEQ_LEN)
    assert (~attended).sum() > 10 and attended.sum() > 40
    np.testing.assert_array_equal(y[~attended], np.broadcast_to(params["out"]["bias"], y[~attended].shape))
    # The attention part is real: it differs from the bias and between sequences.
    assert np.min(np.abs(y[attended] - np.asarray(params["out"]["bias"]))) > 0
    # Numerics as documented: no 1/sqrt(D) and a 1/max_seq_len factor (a second max_seq_len >= every
    # attended length changes only that factor).
    y2 = np.asarray(layer(x, offsets, 2 * MAX_SEQ_LEN))
    a1 = y - np.asarray(params["out"]["bias"])
    short = attended & (np.arange(x.shape[0]) < int(offsets[1]))  # sequence 0 (13 < MAX_SEQ_LEN tokens)
    np.testing.assert_allclose((y2 - np.asarray(params["out"]["bias"]))[short], a1[short] / 2,
                               rtol=1e-5, atol=1e-6)


def test_without_bias_matches_hand_written():
    x, offsets = _batch()
    layer = _layer(use_bias=False, precision=HIGHEST)
    params = _params(layer)
    assert "bias" not in params["query"] and "bias" not in params["out"]
    y = layer(x, offsets, MAX_SEQ_LEN)
    assert _rel_err(y, _hand_written(params, x, offsets, MAX_SEQ_LEN)) < 1e-5
    attended = _attended(offsets, x.shape[0], MAX_SEQ_LEN)
    assert not np.any(np.asarray(y)[~attended]) and np.all(np.asarray(y)[attended] != 0)


def test_relation_to_nnx_multi_head_attention():
    """As the class docstring says: nnx.MultiHeadAttention with W_q, b_q * sqrt(D) and W_o / L."""
    lengths = (9, 16, 5)
    x, offsets = _batch(lengths, lead=0, extra=0)
    layer = _layer(precision=HIGHEST)
    mha = nnx.MultiHeadAttention(H, F, qkv_features=F, out_features=F_OUT, decode=False,
                                 precision=HIGHEST, rngs=nnx.Rngs(5))
    params = _params(layer)
    scale = np.sqrt(F // H)
    moved = dict(params, query={n: w * scale for n, w in params["query"].items()},
                 out=dict(params["out"], kernel=params["out"]["kernel"] / MAX_SEQ_LEN))
    load_linen_variables(mha, {"params": moved})
    y = np.asarray(layer(x, offsets, MAX_SEQ_LEN))
    starts = np.asarray(offsets[:-1])
    padded = np.zeros((len(lengths), MAX_SEQ_LEN, F), np.float32)
    for b, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        padded[b, :n] = x[start:start + n]
    key_valid = jnp.arange(MAX_SEQ_LEN)[None, :] < jnp.asarray(lengths)[:, None]  # [B, L]
    y_mha = np.asarray(mha(padded, mask=jnp.broadcast_to(key_valid[:, None, None, :],
                                                         (len(lengths), 1, MAX_SEQ_LEN, MAX_SEQ_LEN))))
    for b, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        np.testing.assert_allclose(y[start:start + n], y_mha[b, :n], rtol=1e-4, atol=1e-5,
                                   err_msg=f"sequence {b}")


def test_jit_and_grad_match_hand_written():
    x, offsets = _batch()
    layer = _layer(precision=HIGHEST)
    eager = layer(x, offsets, MAX_SEQ_LEN)

    jitted = nnx.jit(lambda m, x, o: m(x, o, MAX_SEQ_LEN))(layer, x, offsets)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
    graphdef, state = nnx.split(layer)
    apply = jax.jit(lambda s, x, o: nnx.merge(graphdef, s)(x, o, MAX_SEQ_LEN))
    np.testing.assert_allclose(apply(state, x, offsets), eager, rtol=1e-6, atol=1e-6)

    target = jax.random.normal(jax.random.key(9), eager.shape)
    loss = lambda y: jnp.sum(jnp.sin(y) * target)

    @nnx.jit
    def layer_grads(m, x, o):
        return nnx.grad(lambda m, x: loss(m(x, o, MAX_SEQ_LEN)), argnums=(0, 1))(m, x)

    grads, dx = layer_grads(layer, x, offsets)
    grads = nnx.to_pure_dict(grads)
    expected, expected_dx = jax.jit(jax.grad(
        lambda p, x: loss(_hand_written(p, x, offsets, MAX_SEQ_LEN)), argnums=(0, 1)))(_params(layer), x)
    _check_param_grads(grads, expected, 1e-4)
    assert _rel_err(dx, expected_dx) < 1e-4
    # The query and key kernels get gradient only through the softmax: it must reach them.
    assert float(jnp.min(jnp.abs(grads["query"]["kernel"]).sum(axis=0))) > 0


def test_adam_steps_lower_the_loss():
    """A student layer learns a teacher layer's map on synthetic jagged batches."""
    teacher, student = _layer(seed=2), _layer(seed=3)
    # Equal token counts (64), so that one compilation serves every batch.
    batches = [_batch(lengths, lead=0, extra=0, seed=s) for s, lengths in
               enumerate([(10, 22, 17, 15), (25, 8, 14, 17), (19, 19, 0, 26)])]
    batches = [(x, o, teacher(x, o, MAX_SEQ_LEN)) for x, o in batches]
    optimizer = nnx.Optimizer(student, optax.adam(3e-2), wrt=nnx.Param)

    def loss_fn(model, x, o, y):
        return jnp.mean((model(x, o, MAX_SEQ_LEN) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, x, o, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, o, y)
        optimizer.update(model, grads)
        return loss

    jit_loss = nnx.jit(loss_fn)

    def total_loss():
        return sum(float(jit_loss(student, *b)) for b in batches)

    before = total_loss()
    query_before = np.asarray(student.query.kernel[...])
    for i in range(30):
        step(student, optimizer, *batches[i % len(batches)])
    after = total_loss()
    assert np.isfinite(after) and after < 0.3 * before, (before, after)
    assert not np.allclose(np.asarray(student.query.kernel[...]), query_before)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linen_and_nnx_agree(dtype):
    x, offsets = _batch()
    layer = _layer(dtype)
    linen = JaggedMultiHeadDotProductAttention(H, qkv_features=F, out_features=F_OUT, dtype=dtype,
                                               backend="xla")
    variables = linen.init(jax.random.key(0), x, offsets, MAX_SEQ_LEN)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, linen_variables_from_nnx(layer))

    # nnx weights -> linen: identical outputs, eager and under jax.jit.
    y = layer(x, offsets, MAX_SEQ_LEN)
    from_nnx = linen_variables_from_nnx(layer)
    np.testing.assert_array_equal(linen.apply(from_nnx, x, offsets, MAX_SEQ_LEN), y)
    apply = jax.jit(linen.apply, static_argnums=3)
    np.testing.assert_allclose(np.asarray(apply(from_nnx, x, offsets, MAX_SEQ_LEN), np.float32),
                               np.asarray(y, np.float32), rtol=1e-6, atol=1e-6)

    # linen weights -> nnx, in place.
    load_linen_variables(layer, variables)
    np.testing.assert_array_equal(layer(x, offsets, MAX_SEQ_LEN), linen.apply(variables, x, offsets,
                                                                               MAX_SEQ_LEN))
    assert not np.array_equal(np.asarray(layer(x, offsets, MAX_SEQ_LEN)), np.asarray(y))

    # Equal gradients too.
    loss = lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32)))
    g_linen = jax.grad(lambda v: loss(linen.apply(v, x, offsets, MAX_SEQ_LEN)))(variables)["params"]
    g_nnx = nnx.to_pure_dict(nnx.grad(lambda m: loss(m(x, offsets, MAX_SEQ_LEN)))(layer))
    jax.tree.map(np.testing.assert_array_equal, g_nnx, dict(g_linen))


def test_load_linen_variables_rejects_mismatches():
    layer = _layer()
    params = _params(layer)
    with pytest.raises(ValueError, match="missing"):
        load_linen_variables(layer, {"params": {k: v for k, v in params.items() if k != "out"}})
    with pytest.raises(ValueError, match="shape"):
        load_linen_variables(layer, {"params": dict(params, out={"kernel": jnp.zeros((H, F // H, 3)),
                                                                  "bias": jnp.zeros(3)})})
    with pytest.raises(ValueError, match="unexpected"):
        load_linen_variables(_layer(use_bias=False), {"params": params})


def _backend_vs_xla(backend, dtype, *, lengths, lead, extra, max_seq_len, tol, grad_tol):
    x, offsets = _batch(lengths, lead=lead, extra=extra)
    x = x.astype(dtype)
    kw = dict(dtype=dtype, precision=HIGHEST, allow_tf32=False)
    layer, reference = _layer(backend=backend, **kw), _layer(backend="xla", **kw)
    target = jax.random.normal(jax.random.key(4), (x.shape[0], F_OUT))

    def run(m):
        def loss(m, x):
            y = m(x, offsets, max_seq_len)
            return jnp.sum(y.astype(jnp.float32) * target), y

        (_, y), (g, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(m, x)
        return y, dx, nnx.to_pure_dict(g)

    y, dx, g = run(layer)
    y_ref, dx_ref, g_ref = run(reference)
    assert y.dtype == dtype
    assert _rel_err(y, y_ref) < tol
    assert _rel_err(dx, dx_ref) < grad_tol
    _check_param_grads(g, g_ref, grad_tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", backend_params(["interpret", "triton"]))
def test_kernel_backend_matches_xla_tiny(backend, dtype):
    """Tiny sizes, so that the interpreter stays fast; triton runs the same on a GPU."""
    fp32 = dtype == jnp.float32
    _backend_vs_xla(backend, dtype, lengths=(13, 30, 0, 17), lead=2, extra=3, max_seq_len=24,
                    tol=1e-5 if fp32 else 2e-2, grad_tol=1e-4 if fp32 else 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_matches_xla_larger(dtype):
    fp32 = dtype == jnp.float32
    lengths = tuple(int(n) for n in np.random.default_rng(0).integers(0, 300, size=12))
    _backend_vs_xla("triton", dtype, lengths=lengths, lead=5, extra=7, max_seq_len=256,
                    tol=1e-4 if fp32 else 3e-2, grad_tol=1e-3 if fp32 else 1e-1)


@pytest.mark.gpu
def test_triton_linen_matches_nnx():
    x, offsets = _batch()
    layer = _layer(backend="triton")
    linen = JaggedMultiHeadDotProductAttention(H, out_features=F_OUT, backend="triton")
    y = layer(x, offsets, MAX_SEQ_LEN)
    y_linen = linen.apply(linen_variables_from_nnx(layer), x, offsets, MAX_SEQ_LEN)
    np.testing.assert_allclose(y_linen, y, rtol=1e-6, atol=1e-6)
    assert _rel_err(y, _numpy_layer(_params(layer), x, offsets, MAX_SEQ_LEN)) < 1e-2  # TF32 allowed
