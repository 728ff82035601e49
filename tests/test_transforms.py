"""The ops under JAX's transformations: vmap (shared and batched offsets), vmap of grad and grad of
vmap, remat names, forward mode's error, and sharding over 4 CPU devices: heads-sharded jit with no
data-moving collective, data-parallel jit and shard_map (default check_vma), and clear errors."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Spy, backend_params, launched_kernels, relative_error, variant
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jagged_flash_jax as jfa

V, T, H, HK, D, MAX_LEN = 2, 40, 4, 2, 8, 16
OFFSETS = np.array([0, 5, 5, 22, 33])  # 7 tokens after the last sequence are not covered
ROWS = np.array([[0, 5, 5, 22, 33], [0, 3, 3, 30, 40]])  # per vmapped problem


def attention(backend, layout="THD", **kw):
    """The op with `backend` (a name), or with `implementation` (an implementation value)."""
    where = dict(backend=backend) if isinstance(backend, str) else dict(implementation=backend)
    return lambda q, k, v, offsets: jfa.jagged_attention(q, k, v, offsets, MAX_LEN, causal=True,
                                                         layout=layout, allow_tf32=False, **where, **kw)


def arrays(layout, seed=0, batch=(V,), heads=H, kv_heads=HK):
    rng = np.random.default_rng(seed)
    shape = lambda h: (*batch, T, h, D) if layout == "THD" else (*batch, h, T, D)
    return [jnp.asarray(rng.standard_normal(shape(h)) * 0.7, jnp.float32)
            for h in (heads, kv_heads, kv_heads)]


def close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_error(g, w) <= tol


# ---------------------------------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------------------------------

# The folding rules (into heads or segments) are shared by the backends: the kernels (interpret) are
# checked on every path, the xla backend on one; and the key-major operands (which float32 inputs with
# TF32 take) on the segments path, in HTD: segments join along the token axis in either layout, and
# the key-major copies read both layouts in test_jagged_attention.py's test_key_major_operands. Shared
# offsets fold into the heads in HTD (HTD-False) and into segments in THD (THD-False, one offsets row
# for all); batched offsets fold into segments in either layout, a row each (HTD-True), the arrays as
# THD-False's in THD (a reshape) or transposed in HTD: THD-True adds nothing to those two.
VMAP_CASES = [pytest.param(backend, layout, batched, key_major,
                           id=f"{backend}-{layout}-{batched}" + "-key_major" * key_major)
              for backend, layout, batched, key_major in [
                  ("interpret", "THD", False, False),
                  ("interpret", "HTD", False, False), ("interpret", "HTD", True, False),
                  ("interpret", "HTD", True, True),
                  ("xla", "HTD", True, False)]]


@pytest.mark.parametrize("backend,layout,offsets_batched,key_major", VMAP_CASES)
def test_vmap_equals_a_loop(backend, layout, offsets_batched, key_major):
    """Forward, vmap(grad) and grad(vmap) of a vmapped call equal a Python loop of single calls.

    The loop runs on the xla backend (checked against float64 by test_jagged_attention.py), so that the
    interpreter runs the batched calls only. The forward's output comes out of the gradient's call
    (has_aux): the op's primal and its vjp's forward run the same vmap rule, so a forward of its own
    would run those kernels again. Two query heads share one kv head (GQA), half the interpreter's
    programs of four."""
    q, k, v = arrays(layout, heads=2, kv_heads=1)
    offsets = jnp.asarray(ROWS if offsets_batched else OFFSETS, jnp.int32)
    in_axes = (0, 0, 0, 0 if offsets_batched else None)
    row = (lambda i: offsets[i]) if offsets_batched else (lambda i: offsets)
    op = attention(variant(backend, key_major=True) if key_major else backend, layout)
    loss = lambda q, k, v, o: jnp.sum(jnp.sin(op(q, k, v, o)))

    def gradient(op):  # (dq, dk, dv), o
        def loss_and_output(q, k, v, o):
            out = op(q, k, v, o)
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.grad(loss_and_output, argnums=(0, 1, 2), has_aux=True))

    grad, single = gradient(op), gradient(attention("xla", layout))
    loop = [single(q[i], k[i], v[i], row(i)) for i in range(V)]
    loop = jax.tree.map(lambda *x: jnp.stack(x), *loop)
    close(jax.jit(jax.vmap(grad, in_axes))(q, k, v, offsets), loop)  # the outputs too
    batched_loss = lambda q, k, v: jnp.sum(jax.vmap(loss, in_axes)(q, k, v, offsets))
    close(jax.jit(jax.grad(batched_loss, argnums=(0, 1, 2)))(q, k, v), loop[0])


def test_vmap_of_unbatched_keys_and_nested_vmap():
    q, k, v = arrays("THD", batch=(2, V))
    op = jax.jit(attention("xla"))
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    got = jax.vmap(lambda q: op(q, k[0, 0], v[0, 0], offsets))(q[0])
    close(got, jnp.stack([op(q[0, i], k[0, 0], v[0, 0], offsets) for i in range(V)]))
    nested = jax.vmap(jax.vmap(op, (0, 0, 0, None)), (0, 0, 0, None))(q, k, v, offsets)
    close(nested, jnp.stack([jnp.stack([op(q[a, b], k[a, b], v[a, b], offsets) for b in range(V)])
                             for a in range(2)]))


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_vmap_with_tma_loads(layout, monkeypatch):
    """Batched offsets fold into offsets segments: the TMA forward's tiles (Hopper's portable forward,
    forced here) start at each segment's keys in the descriptors' 2-D views. bfloat16 at D = 16 (the TMA
    loads' inputs), sequences longer than the interpreter's 32-key blocks (so some load by TMA): the
    forward equals the pointer loads' bitwise in the interpreter, and a loop of single calls on the xla
    backend."""
    launched = launched_kernels(monkeypatch)
    rng = np.random.default_rng(5)
    shape = lambda h: (V, 96, h, 16) if layout == "THD" else (V, h, 96, 16)  # noqa: E731
    q, k, v = (jnp.asarray(rng.standard_normal(shape(h)), jnp.bfloat16) for h in (H, HK, HK))
    offsets = jnp.asarray([[0, 40, 40, 90], [0, 6, 60, 96]], jnp.int32)

    def op(implementation):
        return lambda q, k, v, offsets: jfa.jagged_attention(q, k, v, offsets, 64, layout=layout,
                                                             implementation=implementation)

    out = {}
    for tma in (False, True):
        launched.clear()
        out[tma] = jax.jit(jax.vmap(op(variant("interpret", tma_loads=tma))))(q, k, v, offsets)
        assert set(launched) == {"attention_fwd_tma_kernel" if tma else "attention_fwd_kernel"}, tma
    np.testing.assert_array_equal(out[True], out[False])
    single = jax.jit(op("xla"))
    close(out[True], jnp.stack([single(q[i], k[i], v[i], offsets[i]) for i in range(V)]), tol=1e-2)


def test_vmap_folds_into_one_launch():
    """A vmapped call is one kernel launch (no loop): one callback in the compiled program, run on the
    folded problem."""

    def launches(layout, offsets, in_axes):
        spy = Spy("interpret")
        text = jax.jit(jax.vmap(attention(spy, layout), in_axes)).lower(
            *arrays(layout), jnp.asarray(offsets, jnp.int32)).as_text()
        return len(re.findall(r"python_cpu_callback", text)), spy.calls[-1][2]

    count, problem = launches("HTD", OFFSETS, (0, 0, 0, None))
    assert count == 1 and problem.num_heads == V * H  # shared offsets, HTD: folded into the heads
    count, problem = launches("THD", ROWS, 0)
    assert count == 1 and problem.num_segments == V  # batched offsets: folded into segments


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_eager_calls_trace_once(backend):
    """Called eagerly (no jax.jit around it), the op and its gradient are traced and compiled once per
    problem: the second call of the same shapes runs the compiled program (on xla, each eager call
    compiled its lax.scan again, about 0.3 s each even for tiny inputs), with the same numbers."""
    spy = Spy(backend)
    q, k, v = arrays("THD", batch=())
    q, k, v = (x[:11] for x in (q, k, v))  # a token count of its own: no problem cached by another test
    offsets = jnp.asarray([0, 4, 4, 11], jnp.int32)
    op = functools.partial(jfa.jagged_attention, max_seq_len=5, causal=True, implementation=spy)
    grad = jax.grad(lambda q, k, v: jnp.sum(op(q, k, v, offsets) ** 2), argnums=(0, 1, 2))
    first = (op(q, k, v, offsets), grad(q, k, v))
    traced = [kind for kind, *_ in spy.calls]
    assert traced.count("forward") >= 1 and traced.count("backward") == 1
    spy.calls.clear()
    second = (op(q, k, v, offsets), grad(q, k, v))
    assert spy.calls == []
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------------
# Autodiff modes
# ---------------------------------------------------------------------------------------------------

def _loss(backend):
    k, v = arrays("THD", batch=())[1:]
    q = arrays("THD", batch=())[0][:, :HK]  # H = H_kv: a small problem
    return q, lambda q: jnp.sum(jfa.jagged_attention(q, k, v, OFFSETS, MAX_LEN, backend=backend) ** 2)


HIGHER_ORDER = {
    "hessian": (lambda f, q: jax.hessian(f)(q), "second-order autodiff"),
    "jacfwd(grad)": (lambda f, q: jax.jacfwd(jax.grad(f))(q), "second-order autodiff"),
    "grad(grad)": (lambda f, q: jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q), "second-order autodiff"),
    "jvp(grad)": (lambda f, q: jax.jvp(jax.grad(f), (q,), (q,)), "second-order autodiff"),
    "jvp": (lambda f, q: jax.jvp(f, (q,), (q,)), "does not support forward-mode autodiff"),
    "jacfwd": (lambda f, q: jax.jacfwd(f)(q), "does not support forward-mode autodiff"),
}


# Not jit(jvp): it fails at lowering with JAX's own custom_vjp message (see api.py's _call).
@pytest.mark.parametrize("name,backend,jit", [
    pytest.param(name, backend, jit, id=f"{name}-{backend}-{'jit' if jit else 'eager'}")
    for name in HIGHER_ORDER for backend in ("xla", "interpret") for jit in (False, True)
    if not (name == "jvp" and jit)])
def test_forward_mode_and_second_order_raise_the_librarys_error(name, backend, jit):
    """Each raises the library's TypeError (not JAX's missing rule for custom_partitioning)."""
    transform, match = HIGHER_ORDER[name]
    q, loss = _loss(backend)
    call = (lambda q: transform(loss, q))
    with pytest.raises(TypeError, match=match):
        (jax.jit(call) if jit else call)(q)


def test_first_order_still_runs_inside_an_outer_jacfwd_of_something_else():
    """The second-order guard fires only on tangents that reach the kernels: a grad nested in a jacfwd
    over an unrelated variable runs."""
    q, loss = _loss("xla")
    got = jax.jit(jax.jacfwd(lambda s: s * jax.grad(loss)(q)))(2.0)  # jitted: one compilation each
    close(got, jax.jit(jax.grad(loss))(q))


def test_dense_reference_supports_forward_mode():
    """jagged_attention_reference, the documented way to forward mode, agrees with the op's vjp."""
    q, k, v = arrays("THD", batch=())
    offsets = jnp.asarray(OFFSETS)
    op = lambda q: jfa.jagged_attention(q, k, v, offsets, MAX_LEN, causal=True, backend="xla",
                                        allow_tf32=False)
    dense = lambda q: jfa.jagged_attention_reference(q, k, v, offsets, MAX_LEN, causal=True)
    tangent = jnp.ones_like(q)
    _, jvp = jax.jit(lambda q, t: jax.jvp(dense, (q,), (t,)))(q, tangent)  # jitted: one compilation each
    cotangent = jnp.cos(q)
    vjp = jax.jit(lambda q, c: jax.vjp(op, q)[1](c)[0])(q, cotangent)
    # <J t, c> = <t, J^T c>
    np.testing.assert_allclose(jnp.vdot(jvp, cotangent), jnp.vdot(tangent, vjp), rtol=1e-4)


@pytest.mark.parametrize("backend", backend_params())
def test_remat_policy_keeps_the_named_residuals(backend):
    q, k, v = arrays("THD", batch=())
    op = attention(backend)
    offsets = jnp.asarray(OFFSETS)
    loss = lambda q: jnp.sum(op(q, k, v, offsets) ** 2)
    policy = jax.checkpoint_policies.save_only_these_names(*jfa.api.RESIDUAL_NAMES)
    remat = jax.checkpoint(loss, policy=policy)
    close(jax.jit(jax.grad(remat))(q), jax.jit(jax.grad(loss))(q))
    # With the named residuals saved, the backward does not run the forward again.
    text = str(jax.make_jaxpr(jax.grad(remat))(q))
    assert text.count("name=jagged_attention_out") + text.count("jagged_attention_out") >= 1


def test_residual_dtypes_are_float32():
    """The log-sum-exp residual stays float32 whatever the input dtype."""
    q, k, v = (x.astype(jnp.bfloat16) for x in arrays("THD", batch=()))
    _, residuals = jax.vjp(lambda q: attention("interpret")(q, k, v, jnp.asarray(OFFSETS)), q)
    lse = [x for x in jax.tree.leaves(residuals) if x.ndim == 3 and x.shape[1:] == (H, T)]
    assert lse and all(x.dtype == jnp.float32 for x in lse)


# ---------------------------------------------------------------------------------------------------
# Sharding over 4 CPU devices
# ---------------------------------------------------------------------------------------------------

DATA_MOVING = r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\("


def mesh(axis_types=AxisType.Auto, shape=(2, 2)):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_types,) * 2,
                         devices=jax.devices()[:math.prod(shape)])


def train_step(backend, layout):
    def loss(q, k, v, offsets):
        out = attention(backend, layout)(q, k, v, offsets)
        return jnp.sum(out * out), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def large_all_reduces(hlo: str) -> list[str]:
    """all-reduces of more than a scalar (the loss's sum is one, and legitimately crosses devices)."""
    return [line for line in hlo.splitlines() if re.search(r"all-reduce(-start)?\(", line)
            and not re.search(r"= f32\[\] all-reduce", line)]


# Each layout once and each axis type once: the layouts shard different axes (H is axis 1 of THD, 0 of
# HTD), and the axis types propagate shardings differently; neither depends on the other.
@pytest.mark.parametrize("layout,axis_types", [("THD", AxisType.Auto), ("HTD", AxisType.Explicit)],
                         ids=["THD-auto", "HTD-explicit"])
def test_heads_sharded_jit_runs_each_devices_heads(layout, axis_types):
    q, k, v = arrays(layout, batch=())
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    step = train_step("xla", layout)
    want, want_grads = _unsharded_step(layout)
    m = mesh(axis_types)
    heads = NamedSharding(m, P(None, "model", None) if layout == "THD" else P("model", None, None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(offsets, NamedSharding(m, P()))]
    compiled = step.lower(*args).compile()  # run and searched: one compilation
    (_, out), grads = compiled(*args)
    close(out, want)
    close(grads, want_grads)
    for x in (out, *grads):
        assert x.sharding.is_equivalent_to(heads, 3)
    hlo = compiled.as_text()
    assert not re.search(DATA_MOVING, hlo)
    assert not large_all_reduces(hlo)


def _unsharded_step(layout):
    """The output and gradients of train_step on one device."""
    (_, out), grads = train_step("xla", layout)(*arrays(layout, batch=()), jnp.asarray(OFFSETS, jnp.int32))
    return out, grads


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_data_parallel_jit_and_shard_map(layout):
    """Each device's own jagged batch: packed, then run under a sharded jit (xla) and under shard_map
    with the default check_vma (xla; and interpret, in THD); the loss and gradients equal one device's.
    The shard_maps leave the mesh's model axis unmentioned: of size 2 on xla, and of size 1 on the
    interpreter, whose kernels would otherwise run twice over on its two replicas."""
    q, k, v = arrays("THD", batch=())
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    packed = jfa.pack_data_parallel([x.reshape(T, -1) for x in (q, k, v)], offsets, num_shards=2)
    qp, kp, vp = (x.reshape(x.shape[0], -1, D) for x in packed.values)
    to_layout = (lambda x: x) if layout == "THD" else (lambda x: jnp.swapaxes(x, 0, 1))
    step = train_step("xla", layout)
    (loss, _), grads = step(*map(to_layout, (q, k, v)), offsets)

    m = mesh()
    tokens = P("data", None, None) if layout == "THD" else P(None, "data", None)
    args = [jax.device_put(to_layout(x), NamedSharding(m, tokens)) for x in (qp, kp, vp)]
    args.append(jax.device_put(packed.offsets, NamedSharding(m, P("data"))))
    compiled = step.lower(*args).compile()  # run and searched: one compilation
    (loss_dp, out), grads_dp = compiled(*args)
    assert relative_error(loss_dp, loss) < 1e-5
    token_major = (lambda x: x) if layout == "THD" else (lambda x: jnp.swapaxes(x, 0, 1))
    close([packed.unpack(token_major(g), T) for g in grads_dp], [token_major(g) for g in grads])
    assert not re.search(DATA_MOVING, compiled.as_text())

    for backend in ("xla", "interpret") if layout == "THD" else ("xla",):
        m = mesh() if backend == "xla" else mesh(shape=(2, 1))
        specs = (tokens, tokens, tokens, P("data"))
        args = [jax.device_put(x, NamedSharding(m, spec)) for x, spec in zip(args, specs)]
        local = jax.shard_map(attention(backend, layout), mesh=m, in_specs=specs, out_specs=tokens)
        loss_sm = jax.jit(jax.value_and_grad(lambda q, k, v, o, f=local: jnp.sum(f(q, k, v, o) ** 2)))
        value, g = loss_sm(*args)
        assert relative_error(value, loss) < 1e-5
        assert relative_error(g, grads_dp[0]) < 1e-5


def test_readme_data_parallel_example_on_one_device():
    """The README's data-parallel block on a mesh of one device, with JAX's default axis type (Explicit,
    as the README's block makes its mesh): a mesh axis of size 1 splits nothing, and is valid; the result,
    unpacked, equals the unsharded call's. (On several devices: test_data_parallel_jit_and_shard_map, and
    test_readme.py runs the block as written on 4.)"""
    devices = 1
    q, k, v = arrays("THD", batch=())
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    m = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices], axis_types=(AxisType.Explicit,))
    packed = jfa.pack_data_parallel([x.reshape(T, -1) for x in (q, k, v)], offsets, devices)
    args = [jax.device_put(x.reshape(x.shape[0], -1, D), NamedSharding(m, P("data"))) for x in packed.values]
    args.append(jax.device_put(packed.offsets, NamedSharding(m, P("data"))))
    op = attention("xla")
    out = jax.jit(op)(*args)
    want, want_dq = _unsharded_output_and_dq()
    close(packed.unpack(out.reshape(out.shape[0], -1), T), want.reshape(T, -1))
    dq = jax.jit(jax.grad(lambda *a: jnp.sum(op(*a) ** 2)))(*args)
    close(packed.unpack(dq.reshape(dq.shape[0], -1), T), want_dq.reshape(T, -1))


def _unsharded_output_and_dq():
    """The unsharded call's output and dq of sum(o ** 2) on arrays("THD")."""
    q, k, v = arrays("THD", batch=())
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    op = attention("xla")
    return jax.jit(op)(q, k, v, offsets), jax.jit(jax.grad(lambda q: jnp.sum(op(q, k, v, offsets) ** 2)))(q)


def test_heads_shard_map_with_check_vma():
    """Heads split over "model" under shard_map with the default check_vma; the data axis unmentioned
    (of size 2 on xla, of size 1 on the interpreter: see test_data_parallel_jit_and_shard_map)."""
    q, k, v = arrays("THD", batch=())
    offsets = jnp.asarray(OFFSETS, jnp.int32)
    heads = P(None, "model", None)
    # The unsharded gradients, as one jitted program.
    want = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention("xla")(q, k, v, offsets) ** 2), (0, 1, 2)))(
        q, k, v)
    for backend in ("xla", "interpret"):
        m = mesh() if backend == "xla" else mesh(shape=(1, 2))
        local = jax.shard_map(attention(backend), mesh=m, in_specs=(heads, heads, heads, P()),
                              out_specs=heads)
        loss = lambda q, k, v, f=local: jnp.sum(f(q, k, v, offsets) ** 2)
        close(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v), want)


@pytest.mark.parametrize("spec,match", [
    (P("data", None, None), "sequences cannot be cut between devices"),
    (P(None, None, "model"), "cannot split the head dimension D"),
], ids=["tokens-without-packing", "head-dim"])
def test_unsupported_sharding_raises(spec, match):
    q, k, v = arrays("THD", batch=())
    m = mesh()
    args = [jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)] + [jnp.asarray(OFFSETS)]
    with pytest.raises(Exception, match=match):
        jax.jit(attention("xla"))(*args)


def test_interpret_under_sharded_jit_raises_instead_of_crashing():
    q, k, v = arrays("THD", batch=())
    m = mesh()
    heads = NamedSharding(m, P(None, "model", None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [jnp.asarray(OFFSETS)]
    with pytest.raises(Exception, match="backend='interpret' cannot be partitioned"):
        jax.jit(attention("interpret"))(*args)
