"""The public API around the kernels: errors on bad input, jit/grad composition, helpers, memory safety."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GPU_AVAILABLE, JaggedBatch, backend_params

import jagged_flash_jax as jfa
from jagged_flash_jax import multi_head_jagged_flash_attention as attention

H, T, D = 2, 24, 8


def arrays(shape=(H, T, D), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3)]


OFFSETS = jnp.asarray([0, 5, 5, 20], jnp.int32)


# ---------------------------------------------------------------------------------------------------
# Bad input: each raises at trace time, naming the argument
# ---------------------------------------------------------------------------------------------------

def bad_calls():
    q, k, v = arrays()
    q4 = q[None]
    return [
        ("rank", lambda: attention(q4, q4, q4, OFFSETS, 8), ValueError, "q must have rank 3"),
        ("k shape", lambda: attention(q, k[:, :-1], v, OFFSETS, 8), ValueError, "k must have the shape"),
        ("v dtype", lambda: attention(q, k, v.astype(jnp.bfloat16), OFFSETS, 8), TypeError,
         "v must have the dtype"),
        ("dtype", lambda: attention(*(x.astype(jnp.int32) for x in (q, k, v)), OFFSETS, 8), TypeError,
         "float32, bfloat16 or float16"),
        ("not array", lambda: attention([[1.0]], k, v, OFFSETS, 8), TypeError, "q must be an array"),
        ("offsets 2-D", lambda: attention(q, k, v, OFFSETS[None], 8), ValueError, "offsets must be 1-D"),
        ("offsets empty", lambda: attention(q, k, v, OFFSETS[:0], 8), ValueError, "offsets must be 1-D"),
        ("offsets float", lambda: attention(q, k, v, OFFSETS.astype(jnp.float32), 8), TypeError,
         "offsets must be int32 or int64"),
        ("max_seq_len 0", lambda: attention(q, k, v, OFFSETS, 0), ValueError, "max_seq_len must be >= 1"),
        ("max_seq_len float", lambda: attention(q, k, v, OFFSETS, 8.0), TypeError,
         "max_seq_len must be a static Python int"),
        ("max_seq_len traced", lambda: jax.jit(lambda n: attention(q, k, v, OFFSETS, n))(8), TypeError,
         "max_seq_len must be a static Python int"),
        ("head dim", lambda: attention(*arrays((1, 4, 257)), OFFSETS[:2] * 0, 8), ValueError,
         "at most 256"),
        ("backend", lambda: attention(q, k, v, OFFSETS, 8, backend="cuda"), ValueError,
         "backend must be one of"),
        ("layout", lambda: attention(q, k, v, OFFSETS, 8, layout="BTHD"), ValueError,
         "layout must be one of"),
        ("allow_tf32", lambda: attention(q, k, v, OFFSETS, 8, allow_tf32="yes"), TypeError,
         "allow_tf32 must be a bool"),
        ("block_sizes", lambda: attention(q, k, v, OFFSETS, 8, block_sizes=(64, 64)), TypeError,
         "block_sizes must be a BlockSizes"),
        ("tile", lambda: jfa.KernelConfig(48, 64), ValueError, "power of two"),
        ("grid", lambda: attention(*arrays((1, 2**21, 16)), jnp.asarray([0, 2**21]), 2**21,
                                   backend="interpret",
                                   block_sizes=jfa.BlockSizes(*[jfa.KernelConfig(16, 16)] * 3)),
         ValueError, "blocks of 16 rows per sequence"),
    ]


@pytest.mark.parametrize("name,call,error,match", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_bad_input_raises(name, call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(GPU_AVAILABLE, reason="checks the error raised without a GPU")
def test_triton_backend_without_gpu_says_how_to_install():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"needs a GPU.*pip install 'jagged-flash-jax\[cuda13\]'"):
        attention(q, k, v, OFFSETS, 8, backend="triton")


def test_auto_backend_choice():
    assert jfa.api.default_backend() == ("triton" if GPU_AVAILABLE else "xla")


# ---------------------------------------------------------------------------------------------------
# jit, grad, retracing
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backend_params())
def test_jit_and_grad_compose_without_retracing(backend):
    batch = JaggedBatch([7, 0, 19, 3], H, D, extra=2, seed=2, scale=0.6)
    offsets = jnp.asarray(batch.offsets, jnp.int32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def loss_and_grads(q, k, v, offsets):
        def loss(q, k, v):
            o = attention(q, k, v, offsets, 16, backend=backend, allow_tf32=False)
            return jnp.sum(o * o)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    q, k, v, _ = batch.arrays(jnp.float32)
    value, grads = loss_and_grads(q, k, v, offsets)
    other = JaggedBatch([7, 0, 19, 3], H, D, extra=2, seed=3, scale=0.6)
    q2, k2, v2, _ = other.arrays(jnp.float32)
    value2, grads2 = loss_and_grads(q2, k2, v2, offsets)  # same shapes: no retrace
    assert value != value2
    # Gradients of the jitted op equal those of the pure-JAX reference, differentiated by JAX.
    ref = jax.grad(lambda q, k, v: jnp.sum(jfa.jagged_attention_reference(
        q, k, v, offsets, 16, allow_tf32=False) ** 2), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(r))))
    chex.clear_trace_counter()


@pytest.mark.parametrize("backend", backend_params())
def test_offsets_get_no_gradient_and_grad_of_jit(backend):
    q, k, v = arrays(seed=4)

    def loss(q, offsets):
        return jnp.sum(attention(q, k, v, offsets, 16, backend=backend) ** 2)

    dq = jax.jit(jax.grad(loss))(q, OFFSETS)
    assert dq.shape == q.shape and bool(jnp.all(jnp.isfinite(dq)))
    assert float(jnp.max(jnp.abs(dq[:, 20:]))) == 0.0  # tokens past offsets[-1]
    assert float(jnp.max(jnp.abs(dq[:, :20]))) > 0.0
    with pytest.raises(TypeError):
        jax.grad(loss, argnums=1)(q, OFFSETS)  # integer offsets are not differentiable


def test_empty_batch_and_no_tokens():
    q, k, v = arrays()
    for backend in ("interpret", "xla"):
        o = attention(q, k, v, jnp.asarray([0], jnp.int32), 8, backend=backend)
        assert o.shape == q.shape and not bool(jnp.any(o))
        empty = [x[:, :0] for x in (q, k, v)]
        o = attention(*empty, jnp.asarray([0, 0], jnp.int32), 8, backend=backend)
        assert o.shape == (H, 0, D)


# ---------------------------------------------------------------------------------------------------
# Memory safety: any offsets content
# ---------------------------------------------------------------------------------------------------

ADVERSARIAL_OFFSETS = [
    [-5, 3, 10],
    [10, 3, 20],
    [0, 2**31 - 1, 5],
    [-(2**31), 0, 24],
    [20, 30, 40],
    [24, 24, 0],
    [0, 24, 24, -1, 12],
]


@pytest.mark.parametrize("offsets", ADVERSARIAL_OFFSETS, ids=str)
def test_any_offsets_are_memory_safe(offsets):
    """The interpreter embeds every array between NaN guard zones and raises if a kernel wrote there; a
    read there would put NaN into the outputs. Neither may happen, whatever the offsets hold."""
    q, k, v = arrays(seed=5)
    offsets = jnp.asarray(offsets, jnp.int32)
    o, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, offsets, 16, backend="interpret"), q, k, v)
    for x in (o, *vjp(jnp.ones_like(o))):
        assert bool(jnp.all(jnp.isfinite(x)))


def test_huge_int64_offsets_are_memory_safe():
    q, k, v = arrays(seed=6)
    with jax.enable_x64(True):
        offsets = jnp.asarray([-(2**62), 7, 2**62, 3], jnp.int64)
        o = attention(q, k, v, offsets, 16, backend="interpret")
    assert bool(jnp.all(jnp.isfinite(o)))


def test_malformed_offsets_give_the_same_result_on_every_backend():
    """Offsets are clamped the same way by the kernels and the reference."""
    q, k, v = arrays(seed=8)
    offsets = jnp.asarray([-3, 6, 40], jnp.int32)
    kernel = attention(q, k, v, offsets, 16, backend="interpret", allow_tf32=False)
    reference = attention(q, k, v, offsets, 16, backend="xla", allow_tf32=False)
    np.testing.assert_allclose(kernel, reference, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------

def test_offsets_from_lengths():
    offsets = jfa.offsets_from_lengths(jnp.asarray([3, 0, 5]))
    assert offsets.dtype == jnp.int32
    np.testing.assert_array_equal(offsets, [0, 3, 3, 8])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        jfa.offsets_from_lengths(jnp.asarray([3, -1]))
    with pytest.raises(ValueError, match="lengths must be a 1-D integer array"):
        jfa.offsets_from_lengths(jnp.asarray([[3]]))
    np.testing.assert_array_equal(jax.jit(jfa.offsets_from_lengths)(jnp.asarray([2, 2])), [0, 2, 4])


def test_padding_round_trip():
    rng = np.random.default_rng(9)
    lengths = [4, 0, 9, 2]
    offsets = jfa.offsets_from_lengths(jnp.asarray(lengths))
    x = jnp.asarray(rng.standard_normal((2, 17, 3)), jnp.float32)
    padded = jfa.jagged_to_padded(x, offsets, 6, padding_value=-7.0)
    assert padded.shape == (4, 2, 6, 3)
    for b, n in enumerate(lengths):
        n_kept = min(n, 6)
        np.testing.assert_array_equal(padded[b, :, :n_kept], x[:, int(offsets[b]):int(offsets[b]) + n_kept])
        assert bool(jnp.all(padded[b, :, n_kept:] == -7.0))
    back = jfa.padded_to_jagged(padded, offsets, 17)
    kept = np.zeros(17, bool)
    for b, n in enumerate(lengths):
        kept[int(offsets[b]):int(offsets[b]) + min(n, 6)] = True
    np.testing.assert_array_equal(back[:, kept], x[:, kept])
    assert not bool(jnp.any(back[:, ~kept]))


@pytest.mark.parametrize("offsets,total,match", [
    ([-1, 3], 5, r"offsets must be >= 0, got offsets\[0\] = -1"),
    ([0, 4, 2], 5, r"non-decreasing, got offsets\[1\] = 4 > offsets\[2\] = 2"),
    ([0, 4, 9], 5, r"at most the number of tokens 5, got offsets\[-1\] = 9"),
    ([], 5, "B\\+1 >= 1 entries"),
    ([[0, 1]], 5, "1-D integer array"),
])
def test_check_offsets_rejects(offsets, total, match):
    with pytest.raises(ValueError, match=match):
        jfa.check_offsets(np.asarray(offsets, np.int64), total)


def test_check_offsets_accepts_and_refuses_tracers():
    jfa.check_offsets(jnp.asarray([0, 0, 3, 5]), 7)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda o: jfa.check_offsets(o, 7))(jnp.asarray([0, 1]))
