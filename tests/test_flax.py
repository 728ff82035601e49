"""The flax layers against the float64 numpy reference of tests/helpers.py, computed from the layer's own
weights (outputs and every gradient), for both semantics, causal and GQA, on each backend; their relation
to nnx.MultiHeadAttention; linen/nnx agreement and the weight copy helpers; argument errors; a few optax
steps; and a tensor-parallel training step on 4 CPU devices that equals the one-device step."""

from __future__ import annotations

import functools
import os
import re
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

from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import (  # noqa: E402
    attended_mask,
    backend_params,
    offsets_of,
    reference,
    relative_error,
    to_numpy,
)
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jagged_flash_jax import flax as jfa_flax  # noqa: E402
from jagged_flash_jax import pack_data_parallel  # noqa: E402
from jagged_flash_jax.flax import (  # noqa: E402
    JaggedMultiHeadAttention,
    JaggedMultiHeadDotProductAttention,
    linen_variables_from_nnx,
    load_linen_variables,
)

HIGHEST = jax.lax.Precision.HIGHEST
F, F_OUT = 16, 12  # qkv_features = F: D = 8 with 2 heads, 4 with 4
# Four sequences, 2 uncovered tokens before them and 1 after (T = 30); sequence 1 is longer than
# MAX_SEQ_LEN (its tail is not attended) and sequence 2 is empty.
LENGTHS, LEAD, EXTRA, MAX_SEQ_LEN = (5, 14, 0, 8), 2, 1, 12
CONFIGS = {
    "fbgemm": dict(num_heads=2),  # the default semantics
    "standard": dict(num_heads=2, semantics="standard"),
    "causal": dict(num_heads=2, semantics="standard", causal=True, scale=0.3),
    "gqa": dict(num_heads=4, num_kv_heads=2, semantics="standard", causal=True),
    # jagged_attention's window, soft cap and ALiBi, passed through.
    "options": dict(num_heads=4, num_kv_heads=2, semantics="standard", causal=True, window=(3, None),
                    softcap=2.0, alibi_slopes=(0.5, 0.2, 0.1, 0.05)),
}
# relative_error bounds: float32 everywhere (HIGHEST projections, no TF32), and bfloat16 computation.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def _batch(lengths=LENGTHS, lead=LEAD, extra=EXTRA, seed=0, dtype=jnp.float32):
    offsets = offsets_of(lengths, lead)
    x = jax.random.normal(jax.random.key(seed), (int(offsets[-1]) + extra, F), jnp.float32)
    return x.astype(dtype), jnp.asarray(offsets, jnp.int32)


def _layer(config="fbgemm", *, backend="xla", seed=1, dtype=None, **kw):
    """The nnx layer with random (not zero) biases, so that the bias paths are checked too."""
    kw = {"precision": HIGHEST, "allow_tf32": False, "bias_init": nnx.initializers.normal(0.5), **kw}
    c = dict(CONFIGS[config])
    return JaggedMultiHeadAttention(c.pop("num_heads"), F, qkv_features=F, out_features=F_OUT, dtype=dtype,
                                    rngs=nnx.Rngs(seed), backend=backend, **c, **kw)


def _linen(config="fbgemm", **kw):
    kw = {"precision": HIGHEST, "allow_tf32": False, "backend": "xla", **kw}
    c = dict(CONFIGS[config])
    return JaggedMultiHeadDotProductAttention(c.pop("num_heads"), qkv_features=F, out_features=F_OUT, **c,
                                              **kw)


def _params(layer):
    return linen_variables_from_nnx(layer)["params"]


def _scales(layer, max_seq_len):
    """(scale of q k^T, factor of the output) of the layer's semantics."""
    if layer.semantics == "fbgemm":
        return 1.0, 1.0 / max_seq_len
    return (1.0 / np.sqrt(layer.head_dim) if layer.scale is None else layer.scale), 1.0


def _expected(layer, x, offsets, max_seq_len, dy):
    """float64: the layer's output y and the gradients of sum(y * dy) in its parameters and x, from its
    weights: numpy projections around `reference` (attention and its q, k, v gradients)."""
    p = {name: {n: to_numpy(w) for n, w in leaves.items()} for name, leaves in _params(layer).items()}
    x, dy = to_numpy(x), to_numpy(dy)
    q, k, v = (np.einsum("tf,fhd->thd", x, p[n]["kernel"]) + p[n].get("bias", 0)
               for n in ("query", "key", "value"))
    w_out = p["out"]["kernel"]
    scale, out_scale = _scales(layer, max_seq_len)
    a, dq, dk, dv = reference(q, k, v, np.einsum("to,hdo->thd", dy, w_out), np.asarray(offsets),
                              max_seq_len, scale=scale, causal=layer.causal, out_scale=out_scale,
                              window=getattr(layer, "window", (None, None)),
                              softcap=getattr(layer, "softcap", None),
                              alibi_slopes=getattr(layer, "alibi_slopes", None))
    y = np.einsum("thd,hdo->to", a, w_out) + p["out"].get("bias", 0)
    grads = {"out": {"kernel": np.einsum("thd,to->hdo", a, dy), "bias": dy.sum(0)}}
    dx = 0
    for name, g in (("query", dq), ("key", dk), ("value", dv)):
        grads[name] = {"kernel": np.einsum("tf,thd->fhd", x, g), "bias": g.sum(0)}
        dx = dx + np.einsum("thd,fhd->tf", g, p[name]["kernel"])
    grads = {name: {n: g for n, g in leaves.items() if n in p[name]} for name, leaves in grads.items()}
    return y, dx, grads


def _check_grads(got, want, tol):
    """Every parameter gradient within tol of the reference. The key bias shifts all scores of a query
    equally, so its exact gradient is 0: measure it on the scale of the query bias's."""
    for name, leaves in want.items():
        for leaf, w in leaves.items():
            scale = np.linalg.norm(want["query"]["bias"]) if (name, leaf) == ("key", "bias") else None
            err = relative_error(got[name][leaf], w, scale)
            assert err < tol, f"{name}/{leaf}: relative error {err:.2e} > {tol:.0e}"


@nnx.jit
def _forward(layer, x, offsets):
    """The layer's output [T, F_OUT] with max_seq_len MAX_SEQ_LEN, jitted (eager calls of the xla backend
    dispatch op by op: slow)."""
    return layer(x, offsets, MAX_SEQ_LEN)


def _value_and_grads(layer, x, offsets, max_seq_len, dy):
    """y, parameter gradients (pure dict) and dx of sum(y * dy), under nnx.jit."""
    def loss(m, x):
        y = m(x, offsets, max_seq_len)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    (_, y), (grads, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(layer, x)
    return y, nnx.to_pure_dict(grads), dx


# ---------------------------------------------------------------------------------------------------
# Numerics against the float64 reference
# ---------------------------------------------------------------------------------------------------


def _cases(backend, combos):
    """pytest params (backend, config, dtype); backend_params marks "triton" `gpu`."""
    (param,) = backend_params([backend])
    name, marks = (param.values[0], param.marks) if hasattr(param, "values") else (param, ())
    return [pytest.param(name, config, dtype, marks=marks, id=f"{name}-{config}-{jnp.dtype(dtype).name}")
            for config, dtype in combos]


ALL_FP32 = [(config, jnp.float32) for config in CONFIGS]
REFERENCE_CASES = (
    _cases("xla", ALL_FP32)
    # The interpreter is slow (and computes bfloat16 in float32): two configurations.
    + _cases("interpret", [("fbgemm", jnp.float32), ("gqa", jnp.float32), ("options", jnp.float32)])
    + _cases("triton", ALL_FP32 + [(config, jnp.bfloat16) for config in CONFIGS]))


@pytest.mark.parametrize("backend, config, dtype", REFERENCE_CASES)
def test_layer_matches_float64_reference(backend, config, dtype):
    """Output, parameter gradients and dx equal the float64 reference from the layer's own weights;
    tokens the op does not attend get exactly the out bias and zero dx."""
    x, offsets = _batch(dtype=dtype)
    layer = _layer(config, backend=backend, dtype=dtype)
    dy = jax.random.normal(jax.random.key(4), (x.shape[0], F_OUT))
    y, grads, dx = _value_and_grads(layer, x, offsets, MAX_SEQ_LEN, dy)
    assert y.shape == (x.shape[0], F_OUT) and y.dtype == dtype and dx.dtype == dtype
    y_ref, dx_ref, grads_ref = _expected(layer, x, offsets, MAX_SEQ_LEN, dy)
    tol = TOL[dtype]
    assert relative_error(y, y_ref) < tol
    assert relative_error(dx, dx_ref) < tol
    _check_grads(grads, grads_ref, tol)
    attended = attended_mask(np.asarray(offsets), x.shape[0], MAX_SEQ_LEN)
    assert 0 < (~attended).sum() and attended.sum() > 20
    bias = np.asarray(layer.out.bias[...].astype(dtype))
    np.testing.assert_array_equal(np.asarray(y)[~attended], np.broadcast_to(bias, y[~attended].shape))
    assert not np.any(np.asarray(dx)[~attended])


@pytest.mark.parametrize("config", ["fbgemm", "gqa"])
def test_relation_to_nnx_multi_head_attention(config):
    """As the class docstring says: on each sequence padded to max_seq_len with a key-padding (and causal)
    mask, nnx.MultiHeadAttention with W_q, b_q * scale * sqrt(D) and W_o * out_scale."""
    lengths = (9, 12, 5)
    x, offsets = _batch(lengths, lead=0, extra=0)
    layer = _layer(config)
    mha = nnx.MultiHeadAttention(layer.num_heads, F, qkv_features=F, out_features=F_OUT,
                                 num_kv_heads=layer.num_kv_heads, decode=False, precision=HIGHEST,
                                 rngs=nnx.Rngs(5))
    params = _params(layer)
    scale, out_scale = _scales(layer, MAX_SEQ_LEN)
    factor = scale * np.sqrt(layer.head_dim)
    load_linen_variables(mha, dict(params, query={n: w * factor for n, w in params["query"].items()},
                                   out=dict(params["out"], kernel=params["out"]["kernel"] * out_scale)))
    with jax.default_matmul_precision("highest"):  # no TF32 in nnx.MultiHeadAttention's einsums on a GPU
        y = np.asarray(_forward(layer, x, offsets))
    padded = np.zeros((len(lengths), MAX_SEQ_LEN, F), np.float32)
    for b, (start, n) in enumerate(zip(np.asarray(offsets[:-1]), lengths)):
        padded[b, :n] = x[start:start + n]
    mask = nnx.make_attention_mask(jnp.arange(MAX_SEQ_LEN)[None] < jnp.asarray(lengths)[:, None],
                                   jnp.arange(MAX_SEQ_LEN)[None] < jnp.asarray(lengths)[:, None])
    if layer.causal:
        mask = nnx.combine_masks(mask, nnx.make_causal_mask(jnp.zeros((len(lengths), MAX_SEQ_LEN))))
    with jax.default_matmul_precision("highest"):
        y_mha = np.asarray(nnx.jit(lambda m, x, mask: m(x, mask=mask))(mha, padded, mask))
    for b, (start, n) in enumerate(zip(np.asarray(offsets[:-1]), lengths)):
        assert relative_error(y[start:start + n], y_mha[b, :n]) < 1e-5, f"sequence {b}"


# ---------------------------------------------------------------------------------------------------
# Shapes, dtypes, errors, jit
# ---------------------------------------------------------------------------------------------------


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


def test_shapes_defaults_and_dtype_promotion():
    x, offsets = _batch()
    x16 = x.astype(jnp.bfloat16)
    out = lambda layer, x: jax.eval_shape(lambda: layer(x, offsets, MAX_SEQ_LEN))
    layer = _layer("gqa", dtype=jnp.bfloat16)
    assert out(layer, x) == jax.ShapeDtypeStruct((x.shape[0], F_OUT), jnp.bfloat16)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (4, 2, 4)
    assert layer.query.kernel.shape == (F, 4, 4) and layer.query.bias.shape == (4, 4)
    assert layer.key.kernel.shape == layer.value.kernel.shape == (F, 2, 4)
    assert layer.out.kernel.shape == (4, 4, F_OUT) and layer.query.kernel.dtype == jnp.float32
    linen = _linen("gqa", dtype=jnp.bfloat16)
    variables = jax.eval_shape(lambda: linen.init(jax.random.key(0), x, offsets, MAX_SEQ_LEN))
    assert variables == jax.eval_shape(lambda: linen_variables_from_nnx(layer))
    assert jax.eval_shape(lambda v: linen.apply(v, x, offsets, MAX_SEQ_LEN), variables).dtype == jnp.bfloat16

    default = JaggedMultiHeadAttention(2, F, rngs=nnx.Rngs(0), backend="xla")
    assert (default.qkv_features, default.out_features, default.head_dim) == (F, F, 8)
    assert (default.num_kv_heads, default.semantics, default.causal, default.scale, default.heads_axis) == (
        2, "fbgemm", False, None, None)
    assert out(default, x16).dtype == jnp.float32  # promoted to the parameters' dtype
    half = JaggedMultiHeadAttention(2, F, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend="xla")
    assert out(half, x16).dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3), "divisible by num_heads"),
    (dict(num_heads=0), "num_heads must be an int >= 1"),
    (dict(num_kv_heads=3, semantics="standard"), "multiple of num_kv_heads"),
    (dict(num_kv_heads=0, semantics="standard"), "num_kv_heads must be an int >= 1"),
    (dict(semantics="flash"), "semantics must be one of"),
    (dict(causal=True), "semantics='fbgemm'.*cannot take causal=True"),
    (dict(scale=0.5), "semantics='fbgemm'.*cannot take scale=0.5"),
    (dict(window=(2, 0)), r"semantics='fbgemm'.*cannot take window=\(2, 0\)"),
    (dict(softcap=1.0), "semantics='fbgemm'.*cannot take softcap=1.0"),
    (dict(alibi_slopes=(0.1, 0.2)), "semantics='fbgemm'.*cannot take alibi_slopes"),
    (dict(semantics="standard", alibi_slopes=(0.1,)), "alibi_slopes must be a tuple of num_heads=2 floats"),
    (dict(num_kv_heads=1), "semantics='fbgemm'.*num_kv_heads=1 != num_heads=2"),
    (dict(semantics="standard", causal=1), "causal must be a bool"),
    (dict(semantics="standard", scale=float("nan")), "scale must be a finite float"),
    (dict(semantics="standard", scale="1"), "scale must be a finite float"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(heads_axis=("model",)), "heads_axis must be a mesh axis name"),
    (dict(deterministic="no"), "deterministic must be a bool"),
])
def test_argument_errors(kwargs, match):
    """nnx raises at construction, linen at construction or (for shapes) at init; the same messages."""
    kwargs = {"num_heads": 2, **kwargs}
    num_heads = kwargs.pop("num_heads")
    with pytest.raises(ValueError, match=match):
        JaggedMultiHeadAttention(num_heads, F, rngs=nnx.Rngs(0), **kwargs)
    x, offsets = _batch()
    with pytest.raises(ValueError, match=match):
        JaggedMultiHeadDotProductAttention(num_heads, **kwargs).init(jax.random.key(0), x, offsets, 8)


@pytest.mark.parametrize("config", ["fbgemm", "standard"])
def test_layers_pass_deterministic_to_the_op(config, monkeypatch):
    """Both layers hand their `deterministic` to the op (True by default), with either semantics."""
    seen = []

    def recording(op):
        def call(*args, **kwargs):
            seen.append(kwargs["deterministic"])
            return op(*args, **kwargs)
        return call

    for name in ("jagged_attention", "multi_head_jagged_flash_attention"):
        monkeypatch.setattr(jfa_flax, name, recording(getattr(jfa_flax, name)))
    x, offsets = _batch()
    for deterministic in (True, False):
        kw = {} if deterministic else dict(deterministic=False)
        _layer(config, **kw)(x, offsets, MAX_SEQ_LEN)
        _linen(config, **kw).init(jax.random.key(0), x, offsets, MAX_SEQ_LEN)
    assert seen == [True, True, False, False]


def test_call_errors():
    x, offsets = _batch()
    layer = _layer()
    with pytest.raises(ValueError, match="rank 2"):
        layer(x[None], offsets, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match="in_features"):
        layer(x[:, :8], offsets, MAX_SEQ_LEN)
    with pytest.raises(TypeError, match="max_seq_len"):
        layer(x, offsets, 2.5)
    with pytest.raises(ValueError, match="rank 2"):
        _linen().init(jax.random.key(0), x[None], offsets, MAX_SEQ_LEN)


# ---------------------------------------------------------------------------------------------------
# linen, weight copies, training
# ---------------------------------------------------------------------------------------------------


def test_linen_and_nnx_agree():
    """Equal parameter trees; weights copied either way give bit-identical outputs and gradients (standard
    semantics, causal, GQA; test_linen_heads_axis_annotations runs the default semantics)."""
    x, offsets = _batch()
    layer, other = (_layer("gqa", seed=seed) for seed in (1, 5))
    linen = _linen("gqa")
    shapes = jax.eval_shape(lambda: linen.init(jax.random.key(0), x, offsets, MAX_SEQ_LEN))
    assert shapes == jax.eval_shape(lambda: linen_variables_from_nnx(layer))

    loss = lambda y: jnp.sum(jnp.sin(y.astype(jnp.float32)))
    linen_grad = jax.jit(jax.value_and_grad(lambda v: loss(linen.apply(v, x, offsets, MAX_SEQ_LEN))))
    nnx_grad = nnx.jit(nnx.value_and_grad(lambda m: loss(m(x, offsets, MAX_SEQ_LEN))))

    def check(variables):
        (value, grads), (want_value, want_grads) = linen_grad(variables), nnx_grad(layer)
        assert value == want_value
        jax.tree.map(np.testing.assert_array_equal, dict(grads["params"]), nnx.to_pure_dict(want_grads))
        return value

    before = check(linen_variables_from_nnx(layer))  # nnx weights -> linen
    load_linen_variables(layer, linen_variables_from_nnx(other))  # other weights (as linen's) -> nnx
    assert check(linen_variables_from_nnx(other)) != before


def test_load_linen_variables_rejects_mismatches():
    layer = _layer()
    params = _params(layer)
    with pytest.raises(ValueError, match="missing"):
        load_linen_variables(layer, {"params": {k: v for k, v in params.items() if k != "out"}})
    with pytest.raises(ValueError, match="shape"):
        load_linen_variables(layer, {"params": dict(params, out={"kernel": jnp.zeros((2, 8, 3)),
                                                                  "bias": jnp.zeros(3)})})
    with pytest.raises(ValueError, match="unexpected"):
        load_linen_variables(_layer(use_bias=False), {"params": params})
    # A GQA layer's key/value kernels [F, 1, D] do not fit a layer with 2 kv heads.
    with pytest.raises(ValueError, match="param key/(kernel|bias) has shape"):
        load_linen_variables(_layer("standard"), _params(_layer("standard", num_kv_heads=1)))


def test_adam_steps_lower_the_loss():
    """A student layer (standard semantics, causal, GQA) learns a teacher layer's map on jagged batches."""
    teacher, student = _layer("gqa", seed=2), _layer("gqa", seed=3)
    # Equal token counts (30), so that one compilation serves every batch.
    batches = [_batch(lengths, lead=0, extra=0, seed=s) for s, lengths in
               enumerate([(5, 14, 0, 11), (12, 8, 6, 4), (9, 9, 12, 0)])]
    batches = [(x, o, _forward(teacher, x, o)) for x, o in batches]
    optimizer = nnx.Optimizer(student, optax.adam(3e-2), wrt=nnx.Param)

    def loss_fn(model, x, o, y):
        return jnp.mean((model(x, o, MAX_SEQ_LEN) - y) ** 2)

    @nnx.jit
    def step(model, optimizer, x, o, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, o, y)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(student, optimizer, *batches[i % len(batches)])) for i in range(30)]
    before, after = sum(losses[:3]), sum(losses[-3:])  # each over the 3 batches
    assert np.all(np.isfinite(losses)) and after < 0.3 * before, (before, after)


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism: heads split over "model", sequences over "data"
# ---------------------------------------------------------------------------------------------------

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def _train_step(graphdef, state, x, offsets, target):
    """One optax (Adam) step of the layer on a mean-squared error: loss, gradients, updated params."""
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x, offsets, MAX_SEQ_LEN) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss, nnx.to_pure_dict(grads), nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def _one_device_step():
    """The layer (heads annotated over "model", inert without a mesh) and its Adam optimizer as
    (graphdef, state) on one device, a batch packed for 2 data shards, and the results of one step."""
    with jax.default_device(jax.devices("cpu")[0]), nnx.use_eager_sharding(False):
        model = _layer("gqa", heads_axis="model")  # 4 query heads, 2 kv heads
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        x, offsets = _batch((7, 12, 0, 9, 3, 5), lead=0, extra=0)
        target = jax.random.normal(jax.random.key(2), (x.shape[0], F_OUT))
        packed = pack_data_parallel((x, target), offsets, 2)  # [2 * tokens, ...], offsets [2, B/2 + 1]
        batch = (packed.values[0], packed.offsets, packed.values[1])
        graphdef, state = nnx.split((model, optimizer))
        results = jax.jit(_train_step, static_argnums=0)(graphdef, state, *batch)
    return graphdef, state, batch, jax.tree.map(to_numpy, results)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_tensor_parallel_train_step_matches_one_device(axis_type):
    """An optax step under jax.jit on a (data 2, model 2) mesh of CPU devices, the layer's state sharded
    by its partitioning annotations (heads over "model"; Auto: placed with nnx.get_named_sharding,
    Explicit: created under jax.set_mesh) and the jagged batch packed per data shard: the loss, gradients
    and updated parameters of the same step on one device, gradients and parameters sharded as annotated,
    and no all-gather in the compiled step: its only collectives are all-reduces (the output
    projection's sum over heads, the gradients' sum over data)."""
    if axis_type == AxisType.Explicit and jax.default_backend() != "cpu":
        pytest.skip("JAX cannot compile an Explicit mesh of CPU devices when its default backend is a GPU "
                    "(NOT_FOUND: no implementation of the Sharding custom call for Host)")
    cpus = jax.devices("cpu")
    assert len(cpus) >= 4, "tests/conftest.py must set jax_num_cpu_devices to 4 before JAX starts"
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=cpus[:4])
    graphdef, state, batch, (want_loss, want_grads, want_params) = _one_device_step()
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)))
    assert specs["query"]["kernel"] == P(None, "model", None) and specs["out"]["kernel"] == P("model", None,
                                                                                              None)
    if axis_type == AxisType.Auto:
        state = jax.device_put(state, nnx.get_named_sharding(state, mesh))
    else:
        with jax.set_mesh(mesh):  # flax shards annotated parameters as it creates them
            model = _layer("gqa", heads_axis="model")
            graphdef, sharded = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)))
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(sharded), nnx.to_pure_dict(state))
        state = sharded

    def sharded_as_annotated(tree):
        return all(jax.tree.leaves(jax.tree.map(
            lambda a, spec: a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), tree, specs)))

    params = nnx.to_pure_dict(state)[0]
    assert sharded_as_annotated(params)
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        compiled = jax.jit(_train_step, static_argnums=0).lower(graphdef, state, *batch).compile()
        loss, grads, params = compiled(state, *batch)

    assert relative_error(loss, want_loss) < 1e-5
    _check_grads(grads, want_grads, 1e-5)
    # Adam turns the key bias's gradient, rounding noise around 0 (see _check_grads), into steps of
    # +-lr: leave that parameter out.
    _check_grads(params, {**want_params, "key": {"kernel": want_params["key"]["kernel"]}}, 1e-5)
    assert sharded_as_annotated(grads) and sharded_as_annotated(params)
    collectives = {m.group(1) for m in COLLECTIVE.finditer(compiled.as_text())}
    assert collectives == {"all-reduce"}, collectives


def test_linen_heads_axis_annotations():
    """linen with heads_axis (default semantics): init gives nn.Partitioned boxes with the nnx layer's
    specs (no mesh needed); load_linen_variables takes them boxed; and with the params placed by those
    specs on an Explicit mesh, a jitted apply computes the unsharded output, replicated."""
    x, offsets = _batch()
    linen = _linen("fbgemm", heads_axis="model")
    variables = jax.jit(linen.init, static_argnums=3)(jax.random.key(0), x, offsets, MAX_SEQ_LEN)
    assert isinstance(variables["params"]["query"]["kernel"], nn.Partitioned)
    with nnx.use_eager_sharding(False):  # annotations without a mesh
        layer = _layer("fbgemm", heads_axis="model")
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(layer, nnx.Param)))
    assert specs == dict(nn.get_partition_spec(variables)["params"])
    assert specs["out"]["kernel"] == P("model", None, None) and specs["value"]["bias"] == P("model", None)
    load_linen_variables(layer, variables)
    jax.tree.map(np.testing.assert_array_equal, _params(layer), nn.unbox(variables)["params"])
    apply = jax.jit(linen.apply, static_argnums=3)
    y = apply(variables, x, offsets, MAX_SEQ_LEN)

    if jax.default_backend() != "cpu":
        return  # see test_tensor_parallel_train_step_matches_one_device
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:2])
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), nn.get_partition_spec(variables))
    placed = jax.device_put(nn.unbox(variables), shardings)
    with jax.set_mesh(mesh):
        y_sharded = apply(placed, x, offsets, MAX_SEQ_LEN)
    assert relative_error(y_sharded, y) < 1e-6 and y_sharded.sharding.is_fully_replicated


# ---------------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["fbgemm", "gqa"])
def test_triton_larger_matches_float64_reference(config):
    lengths = tuple(int(n) for n in np.random.default_rng(0).integers(0, 300, size=12))
    x, offsets = _batch(lengths, lead=5, extra=7)
    layer = _layer(config, backend="triton")
    dy = jax.random.normal(jax.random.key(4), (x.shape[0], F_OUT))
    y, grads, dx = _value_and_grads(layer, x, offsets, 256, dy)
    y_ref, dx_ref, grads_ref = _expected(layer, x, offsets, 256, dy)
    assert relative_error(y, y_ref) < 1e-4 and relative_error(dx, dx_ref) < 1e-4
    _check_grads(grads, grads_ref, 1e-4)


@pytest.mark.gpu
def test_triton_linen_matches_nnx():
    x, offsets = _batch()
    layer = _layer("gqa", backend="triton", allow_tf32=True)
    linen = _linen("gqa", backend="triton", allow_tf32=True)
    y = layer(x, offsets, MAX_SEQ_LEN)
    np.testing.assert_array_equal(linen.apply(linen_variables_from_nnx(layer), x, offsets, MAX_SEQ_LEN), y)


def test_hstu_block_is_its_definition():
    """HSTUBlock against its formula, from its own weights, with the dense reference attention in
    float64: u, v, q, k = silu(LayerNorm(x) W + b), y = x + (u * LayerNorm(a)) W_o + b_o; gradients
    flow to every parameter."""
    from jagged_flash_jax import hstu_attention_reference
    from jagged_flash_jax.flax import HSTUBlock

    block = HSTUBlock(16, 2, attention_dim=8, linear_dim=6, max_attn_len=3, contextual_seq_len=1,
                      backend="xla", allow_tf32=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (20, 16))
    offsets, targets = jnp.asarray([0, 4, 13, 18]), jnp.asarray([1, 2, 0])
    got = block(x, offsets, 12, num_targets=targets)
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731

        def norm(z, layer):
            mean, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
            return (z - mean) / jnp.sqrt(var + layer.epsilon) * f64(layer.scale.value) + f64(layer.bias.value)

        projected = norm(f64(x), block.input_norm) @ f64(block.uvqk.kernel.value)
        u, v, q, k = jnp.split(jax.nn.silu(projected + f64(block.uvqk.bias.value)), [12, 24, 40], axis=-1)
        a = hstu_attention_reference(q.reshape(20, 2, 8), k.reshape(20, 2, 8), v.reshape(20, 2, 6), offsets,
                                     12, alpha=8**-0.5, num_targets=targets, max_attn_len=3,
                                     contextual_seq_len=1)
        want = f64(x) + (u * norm(a.reshape(20, 12), block.output_norm)) @ f64(block.output.kernel.value) \
            + f64(block.output.bias.value)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda m: jnp.sum(m(x, offsets, 12, num_targets=targets) ** 2))(block)
    assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
