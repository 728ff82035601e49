"""The public API around the kernels: errors on bad input (at trace time, naming the argument), jit
and grad composition without retracing, and the helpers (offsets, padding, data-parallel packing)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPU_AVAILABLE, Batch, backend_params, reference, relative_error, to_numpy

import jagged_flash_jax as jfa
from jagged_flash_jax import jagged_attention, multi_head_jagged_flash_attention

T, H, D = 24, 2, 8
OFFSETS = jnp.asarray([0, 5, 5, 20], jnp.int32)


def arrays(shape=(T, H, D), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3)]


# ---------------------------------------------------------------------------------------------------
# Bad input: each raises at trace time, naming the argument
# ---------------------------------------------------------------------------------------------------

def bad_calls():
    q, k, v = arrays()
    q4 = q[None]
    std, fb = jagged_attention, multi_head_jagged_flash_attention
    return {
        "rank": (lambda: std(q4, q4, q4, OFFSETS, 8), ValueError, r"q must have rank 3 \[T, H, D\]"),
        "fbgemm k shape": (lambda: fb(q, k[:, :-1], v, OFFSETS, 8), ValueError, "k must have the shape of q"),
        "v shape": (lambda: std(q, k, v[:-1], OFFSETS, 8, kv_offsets=OFFSETS), ValueError,
                    "v must have the shape of k"),
        "v dtype": (lambda: std(q, k, v.astype(jnp.bfloat16), OFFSETS, 8), TypeError,
                    "v must have the dtype"),
        "dtype": (lambda: std(*(x.astype(jnp.int32) for x in (q, k, v)), OFFSETS, 8), TypeError,
                  "q must be one of float32, bfloat16, float16, got int32"),
        "float64": (lambda: std(*(np.asarray(x, np.float64) for x in (q, k, v)), OFFSETS, 8), TypeError,
                    r"q must be one of .*got float64: cast it, e.g. q.astype\(jnp.float32\)"),
        "padded input": (lambda: std(q4, q4, q4, OFFSETS, 8), ValueError,
                         r"for padded \[B, L, H, D\] arrays, jagged_flash_jax.padded_to_jagged"),
        "max_seq_len array": (lambda: std(q, k, v, OFFSETS, jnp.asarray(8)), TypeError,
                              r"max_seq_len must be a static Python int, got a .* scalar: pass "
                              r"int\(max_seq_len\)"),
        "scale subnormal": (lambda: std(q, k, v, OFFSETS, 8, scale=1e-39), ValueError,
                            "scale must be a finite, normal float32"),
        "softcap over scale overflows": (lambda: std(q, k, v, OFFSETS, 8, softcap=1e38, scale=1e-3),
                                         ValueError, r"softcap / scale must lie within float32's range"),
        "softcap under scale underflows": (lambda: std(q, k, v, OFFSETS, 8, softcap=1e-30, scale=1e10),
                                           ValueError, r"softcap / scale must lie within float32's range"),
        "slope over scale overflows": (lambda: std(q, k, v, OFFSETS, 8, scale=1e-30,
                                                   alibi_slopes=jnp.asarray([0.5, 1e10])), ValueError,
                                       r"alibi_slopes / scale must be finite.*alibi_slopes\[1\] = "
                                       r"10000000000.0"),
        "implementation": (lambda: std(q, k, v, OFFSETS, 8, implementation="cudnn"), ValueError,
                           r"implementation must be one of \('hopper', 'hopper-fused-dq', 'portable', "
                           r"'interpret', 'xla'\)"),
        "implementation and backend": (lambda: std(q, k, v, OFFSETS, 8, backend="xla", implementation="xla"),
                                       ValueError, "pass either backend .* or implementation"),
        "implementation unsupported": (lambda: std(q, k, v, OFFSETS, 8, implementation="hopper"),
                                       ValueError, r"no implementation among \('hopper',\) can run this "
                                                   r"forward: 'hopper': float32 inputs"),
        "not array": (lambda: std([[1.0]], k, v, OFFSETS, 8), TypeError, "q must be an array"),
        "heads": (lambda: std(q, *arrays((T, 3, D))[:2], OFFSETS, 8), ValueError,
                  "multiple of the number of kv"),
        "head dim mismatch": (lambda: std(q, *arrays((T, H, 4))[:2], OFFSETS, 8), ValueError,
                              "head dimension of q"),
        "self tokens": (lambda: std(q, k[:-2], v[:-2], OFFSETS, 8), ValueError, "pass kv_offsets"),
        "offsets 3-D": (lambda: std(q, k, v, OFFSETS[None, None], 8), ValueError, "offsets must be"),
        "offsets empty": (lambda: std(q, k, v, OFFSETS[:0], 8), ValueError, "offsets must be"),
        "offsets float": (lambda: std(q, k, v, OFFSETS.astype(jnp.float32), 8), TypeError,
                          "offsets must be an integer array"),
        "offsets float list": (lambda: std(q, k, v, [0.0, 5.0], 8), TypeError,
                               "offsets must be an integer"),
        "offsets bool": (lambda: std(q, k, v, np.array([True, False]), 8), TypeError, "offsets must be an"),
        "kv_offsets shape": (lambda: std(q, k, v, OFFSETS, 8, kv_offsets=OFFSETS[:2]), ValueError,
                             "kv_offsets must have the shape of offsets"),
        "shards": (lambda: std(q, k, v, jnp.zeros((5, 3), jnp.int32), 8), ValueError, "5 equal shards"),
        "max_seq_len 0": (lambda: std(q, k, v, OFFSETS, 0), ValueError, "max_seq_len must be >= 1"),
        "max_seq_len float": (lambda: std(q, k, v, OFFSETS, 8.0), TypeError, "max_seq_len must be a static"),
        "max_seq_len bool": (lambda: fb(q, k, v, OFFSETS, True), TypeError, "max_seq_len must be a static"),
        "max_seq_len traced": (lambda: jax.jit(lambda n: std(q, k, v, OFFSETS, n))(8), TypeError,
                               r"max_seq_len must be a static.*static_argnums.*functools.partial"),
        "kv_max_seq_len": (lambda: std(q, k, v, OFFSETS, 8, kv_max_seq_len=-1), ValueError,
                           "kv_max_seq_len must be >= 1"),
        "scale traced": (lambda: jax.jit(lambda s: std(q, k, v, OFFSETS, 8, scale=s))(1.0), TypeError,
                         "scale must be a static Python float"),
        "scale inf": (lambda: std(q, k, v, OFFSETS, 8, scale=float("inf")), ValueError,
                      "scale must be a finite, normal float32"),
        "scale overflows": (lambda: std(q, k, v, OFFSETS, 8, scale=3e38), ValueError,
                            r"scale must be .*2.359e\+38\]"),
        "scale 0": (lambda: std(q, k, v, OFFSETS, 8, scale=0.0), ValueError,
                    "scale must be a finite, normal float32"),
        "offsets negative": (lambda: std(q, k, v, [-1, 5], 8), ValueError, r"offsets must be >= 0"),
        "offsets decreasing": (lambda: fb(q, k, v, jnp.asarray([0, 9, 4]), 8, layout="THD"), ValueError,
                               r"non-decreasing, got offsets\[1\] = 9 > offsets\[2\] = 4"),
        "offsets past T": (lambda: std(q, k, v, [0, 5, 25], 8), ValueError, r"offsets\[-1\] = 25 is past"),
        "kv_offsets past T": (lambda: std(q, k[:10], v[:10], OFFSETS, 8, kv_offsets=OFFSETS), ValueError,
                              r"kv_offsets must be at most the number of tokens.*past the 10 tokens"),
        "sharded offsets row": (lambda: std(q, k, v, jnp.asarray([[0, 12], [0, 13]]), 8), ValueError,
                                r"offsets\[1\] must be at most.*past the 12 tokens"),
        "offsets int64 wrap": (lambda: std(q, k, v, np.array([0, 2**31 + 3], np.int64), 8), ValueError,
                               "offsets holds values outside int32"),
        "causal": (lambda: std(q, k, v, OFFSETS, 8, causal="yes"), TypeError, "causal must be a bool"),
        "window -1": (lambda: std(q, k, v, OFFSETS, 8, window=(-1, -1)), ValueError,
                      r"window's left bound must be >= 0 or None \(None: no bound, FlashAttention's -1\)"),
        "head dim": (lambda: std(*arrays((4, 1, 257)), OFFSETS[:2] * 0, 8, backend="interpret"), ValueError,
                     r"'interpret': head dimension D=257 \(the kernels take D <= 256; the 'xla'"),
        "backend": (lambda: std(q, k, v, OFFSETS, 8, backend="cuda"), ValueError, "backend must be one of"),
        "layout": (lambda: std(q, k, v, OFFSETS, 8, layout="BTHD"), ValueError, "layout must be one of"),
        "allow_tf32": (lambda: fb(q, k, v, OFFSETS, 8, allow_tf32="yes"), TypeError,
                       "allow_tf32 must be a bool"),
        "block_sizes": (lambda: std(q, k, v, OFFSETS, 8, block_sizes=(64, 64)), TypeError,
                        "block_sizes must be a BlockSizes"),
        "block_sizes without dq": (lambda: std(q, k, v, OFFSETS, 8, block_sizes=jfa.BlockSizes(
            jfa.KernelConfig(16, 16), jfa.KernelConfig(16, 16), None)), TypeError,
            "block_sizes needs a KernelConfig for each of fwd, dkdv and dq"),
        "tile": (lambda: jfa.KernelConfig(48, 64), ValueError, "power of two"),
        # (16384 sequences + the fill) x 2 heads x (2**17 blocks of 16 rows + 1) programs > 2**31 - 1.
        "grid": (lambda: jax.eval_shape(
                     lambda q: std(q, q, q, jnp.zeros(16385, jnp.int32), 2**21, backend="interpret",
                                   block_sizes=jfa.BlockSizes(*[jfa.KernelConfig(16, 16)] * 3)),
                     jax.ShapeDtypeStruct((2**21, 2, 16), jnp.float32)),
                 ValueError, r"forward would need 4295262210 programs"),
    }


BAD = bad_calls()


@pytest.mark.parametrize("name", BAD, ids=str)
def test_bad_input_raises(name):
    call, error, match = BAD[name]
    with pytest.raises(error, match=match):
        call()


def test_fbgemm_layout_mix_up_raises():
    """[T, H, D] arrays given to FBGEMM's op with its default "HTD" read H as the token axis: the
    concrete offsets, which run to T, cannot fit there, and the error says which layout to pass."""
    lengths = [5, 12, 7]
    batch = Batch.make(lengths, 8, D, seed=5)
    q, k, v, _ = batch.arrays(jnp.float32)  # [24, 8, 8]
    with pytest.raises(ValueError, match=r"past the 8 tokens of the token axis \(axis 1 in layout 'HTD'\); "
                                         r"if q, k, v are \[T, H, D\], pass layout='THD'"):
        multi_head_jagged_flash_attention(q, k, v, batch.offsets, 16, backend="xla")
    got = multi_head_jagged_flash_attention(q, k, v, batch.offsets, 16, backend="xla", layout="THD",
                                            allow_tf32=False)
    want, *_ = reference(batch.q, batch.k, batch.v, batch.do, batch.offsets, 16, out_scale=1 / 16)
    assert relative_error(got, want) < 1e-5


def test_traced_slopes_past_float32_are_clamped_not_nan():
    """Slopes that a trace hides from the check (1e10 with scale 1e-30: slope / scale past float32) are
    clamped: the bias saturates, and the output stays finite (each query's own key dominates)."""
    q, k, v = arrays(seed=3)
    op = jax.jit(lambda slopes: jagged_attention(q, k, v, OFFSETS, 8, scale=1e-30, alibi_slopes=slopes,
                                                 backend="xla"))
    out = op(jnp.asarray([1e10, 1e10], jnp.float32))
    assert np.all(np.isfinite(np.asarray(out)))


def test_head_dimensions_past_256_run_on_xla():
    """The kernels take D <= 256; the xla implementation (and so backend="auto" where no kernel can run
    it) takes any D, against float64."""
    batch = Batch.make([5, 0, 11], 2, 300, seed=8, scale=0.3)
    q, k, v, do = batch.arrays(jnp.float32)
    out = jagged_attention(q, k, v, batch.offsets, 8, causal=True, allow_tf32=False)
    rounded = (np.asarray(x, np.float64) for x in (q, k, v, do))
    want = reference(*rounded, batch.offsets, 8, scale=300**-0.5, causal=True)[0]
    assert relative_error(out, want) < 1e-5


@pytest.mark.parametrize("offsets,ok", [([0, 5, 5, 20], True), ([0, 9, 4, 20], False),
                                        ([-2, 5, 5, 20], False), ([0, 5, 5, 25], False)])
def test_validate_checks_traced_offsets_with_checkify(offsets, ok):
    """validate=True: jit-traced offsets are checked by checkify.check, which the caller functionalizes;
    without validate, malformed traced offsets pass (finite values, as documented)."""
    q, k, v = arrays(seed=6)
    checked, unchecked = _validated_and_unchecked()
    err, out = checked(q, jnp.asarray(offsets, jnp.int32))
    assert (err.get() is None) == ok, err.get()
    if ok:
        np.testing.assert_array_equal(out, jagged_attention(q, k, v, OFFSETS, 8, backend="xla"))
    assert bool(jnp.all(jnp.isfinite(unchecked(q, jnp.asarray(offsets, jnp.int32)))))


@functools.cache
def _validated_and_unchecked():
    """The jitted op with validate=True under checkify, and without validate, over the k and v of the
    test above: compiled once for its four offsets (traced, of one shape)."""
    from jax.experimental import checkify

    _, k, v = arrays(seed=6)
    checked = checkify.checkify(jax.jit(lambda q, o: jagged_attention(q, k, v, o, 8, backend="xla",
                                                                      validate=True)))
    return checked, jax.jit(lambda q, o: jagged_attention(q, k, v, o, 8, backend="xla"))


def test_max_seq_len_beyond_the_tokens_is_accepted():
    """The attended length never exceeds the token count: max_seq_len=10**9 equals max_seq_len=T."""
    q, k, v = arrays(seed=7)
    for backend in ("xla", "interpret"):
        np.testing.assert_array_equal(jagged_attention(q, k, v, OFFSETS, 10**9, backend=backend),
                                      jagged_attention(q, k, v, OFFSETS, T, backend=backend))


@pytest.mark.skipif(GPU_AVAILABLE, reason="checks the error raised without a GPU")
def test_triton_backend_without_gpu_says_how_to_install():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"needs a GPU.*pip install 'jagged-flash-jax\[cuda13\]'"):
        jagged_attention(q, k, v, OFFSETS, 8, backend="triton")


def test_offsets_as_list_or_numpy():
    q, k, v = arrays(seed=1)
    want = jagged_attention(q, k, v, OFFSETS, 8, backend="xla")
    for offsets in ([0, 5, 5, 20], np.array([0, 5, 5, 20], np.int16), np.array([0, 5, 5, 20], np.uint8)):
        np.testing.assert_array_equal(jagged_attention(q, k, v, offsets, 8, backend="xla"), want)


# ---------------------------------------------------------------------------------------------------
# jit, grad, retracing
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backend_params())
def test_jit_and_grad_compose_without_retracing(backend):
    batch = Batch.make([7, 0, 19, 3], H, D, extra=2, seed=2, scale=0.6)
    offsets = jnp.asarray(batch.offsets, jnp.int32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def loss_and_grads(q, k, v, offsets):
        def loss(q, k, v):
            o = jagged_attention(q, k, v, offsets, 16, backend=backend, allow_tf32=False, causal=True)
            return jnp.sum(o * o)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    q, k, v, _ = batch.arrays(jnp.float32)
    value, grads = loss_and_grads(q, k, v, offsets)
    other = Batch.make([7, 0, 19, 3], H, D, extra=2, seed=3, scale=0.6)
    value2, _ = loss_and_grads(*other.arrays(jnp.float32)[:3], offsets)  # same shapes: no retrace
    assert value != value2
    # d(sum o^2) = vjp with cotangent 2 o, against the float64 reference.
    o, *_ = reference(batch.q, batch.k, batch.v, batch.q, batch.offsets, 16, scale=D**-0.5, causal=True)
    _, *expected = reference(to_numpy(q), to_numpy(k), to_numpy(v), 2 * o, batch.offsets, 16,
                             scale=D**-0.5, causal=True)
    for g, e in zip(grads, expected):
        assert relative_error(g, e) < 1e-5
    chex.clear_trace_counter()


@pytest.mark.parametrize("backend", backend_params())
def test_offsets_get_no_gradient_and_grad_of_jit(backend):
    q, k, v = arrays(seed=4)

    def loss(q, offsets):
        return jnp.sum(jagged_attention(q, k, v, offsets, 16, backend=backend) ** 2)

    dq = jax.jit(jax.grad(loss))(q, OFFSETS)
    assert dq.shape == q.shape and bool(jnp.all(jnp.isfinite(dq)))
    assert float(jnp.max(jnp.abs(dq[20:]))) == 0.0  # tokens past offsets[-1]
    assert float(jnp.max(jnp.abs(dq[:20]))) > 0.0
    with pytest.raises(TypeError):
        jax.grad(loss, argnums=1)(q, OFFSETS)  # integer offsets are not differentiable


@pytest.mark.parametrize("backend", ["interpret", "xla"])
def test_empty_batch_and_no_tokens(backend):
    q, k, v = arrays()
    o = jagged_attention(q, k, v, jnp.asarray([0], jnp.int32), 8, backend=backend)
    assert o.shape == q.shape and not bool(jnp.any(o))
    empty = [x[:0] for x in (q, k, v)]
    o, vjp = jax.vjp(lambda q, k, v: jagged_attention(q, k, v, jnp.asarray([0, 0], jnp.int32), 8,
                                                      backend=backend), *empty)
    assert o.shape == (0, H, D) and all(g.shape == (0, H, D) for g in vjp(o))
    # Queries but no keys at all: every output is 0.
    o = jagged_attention(q, k[:0], v[:0], OFFSETS, 8, kv_offsets=jnp.zeros(4, jnp.int32), backend=backend)
    assert not bool(jnp.any(o))


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------

def test_offsets_from_lengths():
    offsets = jfa.offsets_from_lengths(jnp.asarray([3, 0, 5]))
    assert offsets.dtype == jnp.int32
    np.testing.assert_array_equal(offsets, [0, 3, 3, 8])
    np.testing.assert_array_equal(jfa.offsets_from_lengths([2, 2]), [0, 2, 4])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        jfa.offsets_from_lengths(jnp.asarray([3, -1]))
    with pytest.raises(ValueError, match="lengths must be a 1-D integer array"):
        jfa.offsets_from_lengths(jnp.asarray([[3]]))
    np.testing.assert_array_equal(jax.jit(jfa.offsets_from_lengths)(jnp.asarray([2, 2])), [0, 2, 4])


@pytest.mark.parametrize("shape,layout", [((17, 3), None), ((17, 2, 3), "THD"), ((2, 17, 3), "HTD")])
def test_padding_round_trip(shape, layout):
    rng = np.random.default_rng(9)
    lengths = [4, 0, 9, 2]
    offsets = [0, 4, 4, 13, 15]  # a list works too
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    token_axis = 1 if layout == "HTD" else 0
    padded = jfa.jagged_to_padded(x, offsets, 6, padding_value=-7.0, layout=layout)
    xt = np.moveaxis(np.asarray(x), token_axis, 0)  # [T, ...]
    pt = np.moveaxis(np.asarray(padded), 2, 1) if layout == "HTD" else np.asarray(padded)  # [B, L, ...]
    assert pt.shape == (4, 6, *xt.shape[1:])
    kept = np.zeros(17, bool)
    for b, n in enumerate(lengths):
        n_kept = min(n, 6)
        np.testing.assert_array_equal(pt[b, :n_kept], xt[offsets[b]:offsets[b] + n_kept])
        assert np.all(pt[b, n_kept:] == -7.0)
        kept[offsets[b]:offsets[b] + n_kept] = True
    back = np.moveaxis(np.asarray(jfa.padded_to_jagged(padded, offsets, 17, layout=layout)), token_axis, 0)
    np.testing.assert_array_equal(back[kept], xt[kept])
    assert not back[~kept].any()


def test_padding_needs_a_layout_for_rank_3():
    x = jnp.zeros((17, 2, 3))
    with pytest.raises(ValueError, match="pass layout='THD'"):
        jfa.jagged_to_padded(x, [0, 17], 4)
    with pytest.raises(ValueError, match=r"\[T, F\]"):
        jfa.jagged_to_padded(jnp.zeros(17), [0, 17], 4)
    with pytest.raises(ValueError, match=r"\[B, L, F\]"):
        jfa.padded_to_jagged(jnp.zeros((1, 4, 2, 3)), [0, 4], 4)


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


def test_pack_data_parallel():
    lengths = [5, 0, 7, 3, 9]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    x = jnp.arange(30.0)[:, None] * jnp.ones((1, 2))  # 6 uncovered tokens at the end
    packed = jfa.pack_data_parallel(x, offsets, 2)
    # Shards take sequences [0, 3) and [3, 5): 12 tokens each, padded to 16.
    assert packed.values[0].shape == (32, 2)
    np.testing.assert_array_equal(packed.offsets, [[0, 5, 5, 12], [0, 3, 12, 12]])
    np.testing.assert_array_equal(packed.token_index[:13], list(range(12)) + [-1])
    np.testing.assert_array_equal(packed.values[0][16:28, 0], np.arange(12, 24))
    assert not packed.values[0][12:16].any()
    np.testing.assert_array_equal(packed.unpack(packed.values[0], 30)[:24], x[:24])
    with pytest.raises(ValueError, match="less than the 12 tokens"):
        jfa.pack_data_parallel(x, offsets, 2, tokens_per_shard=10)
    with pytest.raises(ValueError, match="non-decreasing"):
        jfa.pack_data_parallel(x, [0, 5, 3], 2)


LENGTHS_HINT = r"if offsets holds the sequences' lengths, pass offsets_from_lengths\(lengths\)"


@pytest.mark.parametrize("lengths,total", [([5, 12, 0, 7], 24), ([0, 4, 2], 6), ([3, 9, 30], 24)],
                         ids=["falls", "falls-after-0", "past-the-tokens"])
def test_lengths_passed_as_offsets_are_pointed_to_offsets_from_lengths(lengths, total):
    """Sequence lengths passed where offsets go fail the offsets' checks; the error says how to make
    offsets of them."""
    with pytest.raises(ValueError, match=LENGTHS_HINT):
        jfa.check_offsets(np.asarray(lengths), total)
    jfa.check_offsets(jfa.offsets_from_lengths(np.asarray(lengths)), sum(lengths))  # the hint's fix passes


def test_the_op_points_lengths_passed_as_offsets_to_offsets_from_lengths():
    q = jnp.ones((24, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"non-decreasing.*" + LENGTHS_HINT):
        jfa.jagged_attention(q, q, q, [5, 12, 0, 7], 16)
    jfa.jagged_attention(q, q, q, jfa.offsets_from_lengths([5, 12, 0, 7]), 16)  # the hint's call runs


@pytest.mark.parametrize("offsets,total", [([-1, 3], 5), ([0, 4, 9], 5), ([2, -4], 5)])
def test_offsets_that_do_not_read_as_lengths_get_no_lengths_hint(offsets, total):
    with pytest.raises(ValueError) as raised:
        jfa.check_offsets(np.asarray(offsets), total)
    assert "offsets_from_lengths" not in str(raised.value)
