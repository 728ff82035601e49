"""The triton backend over several GPUs: heads-sharded jit with no data-moving collective,
data-parallel jit and shard_map (default check_vma), and vmap; each equal to one GPU. Skipped unless
jax-triton and at least two GPUs are here."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPU_AVAILABLE, relative_error
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jagged_flash_jax as jfa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not GPU_AVAILABLE or len(jax.devices()) < 2, reason="needs two GPUs with jax-triton")]

T, H, HK, D, MAX_LEN = 1024, 8, 4, 64, 256
LENGTHS = [100, 0, 256, 37, 300, 5, 200]  # 126 uncovered tokens at the end; one past max_seq_len
OFFSETS = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
DATA_MOVING = r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\("


def arrays(layout="THD", dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    shape = lambda h: (T, h, D) if layout == "THD" else (h, T, D)
    return [jnp.asarray(rng.standard_normal(shape(h)) * 0.5, dtype) for h in (H, HK, HK)]


def step(layout):
    def loss(q, k, v, offsets):
        out = jfa.jagged_attention(q, k, v, offsets, MAX_LEN, causal=True, layout=layout, backend="triton")
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def mesh(*axes):
    n = len(jax.devices())
    return jax.make_mesh((n,), axes, axis_types=(AxisType.Auto,))


def close(got, want, tol=1e-2):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_error(g, w) <= tol


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_heads_sharded_jit(layout):
    q, k, v = arrays(layout)
    offsets = jnp.asarray(OFFSETS)
    f = step(layout)
    (_, want), want_grads = f(q, k, v, offsets)
    m = mesh("model")
    heads = NamedSharding(m, P(None, "model", None) if layout == "THD" else P("model", None, None))
    args = [jax.device_put(x, heads) for x in (q, k, v)] + [jax.device_put(offsets, NamedSharding(m, P()))]
    (_, out), grads = f(*args)
    close(out, want)
    close(grads, want_grads)
    assert all(x.sharding.is_equivalent_to(heads, 3) for x in (out, *grads))
    assert not re.search(DATA_MOVING, f.lower(*args).compile().as_text())


def test_data_parallel_jit_and_shard_map():
    q, k, v = arrays()
    offsets = jnp.asarray(OFFSETS)
    n = len(jax.devices())
    packed = jfa.pack_data_parallel([x.reshape(T, -1) for x in (q, k, v)], offsets, n)
    qp, kp, vp = (x.reshape(x.shape[0], -1, D) for x in packed.values)
    f = step("THD")
    (loss, _), grads = f(q, k, v, offsets)
    m = mesh("data")
    tokens = NamedSharding(m, P("data", None, None))
    args = [jax.device_put(x, tokens) for x in (qp, kp, vp)]
    args.append(jax.device_put(packed.offsets, NamedSharding(m, P("data"))))
    (loss_dp, _), grads_dp = f(*args)
    assert relative_error(loss_dp, loss) < 1e-3
    close([packed.unpack(g, T) for g in grads_dp], grads)
    assert not re.search(DATA_MOVING, f.lower(*args).compile().as_text())
    local = jax.shard_map(lambda q, k, v, o: jfa.jagged_attention(q, k, v, o, MAX_LEN, causal=True,
                                                                  backend="triton"),
                          mesh=m, in_specs=(P("data"),) * 4, out_specs=P("data"))
    value, g = jax.jit(jax.value_and_grad(
        lambda q, k, v, o: jnp.sum(local(q, k, v, o).astype(jnp.float32) ** 2)))(*args)
    assert relative_error(value, loss) < 1e-3
    close(g, grads_dp[0])


def test_vmap():
    q, k, v = arrays()
    offsets = jnp.asarray(OFFSETS)
    op = jax.jit(lambda q, k, v: jfa.jagged_attention(q, k, v, offsets, MAX_LEN, causal=True,
                                                      backend="triton"))
    stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]
    got = jax.jit(jax.vmap(op))(*stacked)
    close(got, jnp.stack([op(*(x[i] for x in stacked)) for i in range(2)]), tol=1e-6)
