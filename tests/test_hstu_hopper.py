"""HSTU attention's Hopper kernels (kernels/hopper/hstu_forward.py, hstu_backward.py; implementation
"hstu-hopper", auto's on sm_90 from 1024 tokens): compiled here for sm_90a with the launcher's constants
(no GPU needed): the forward at D = V = 128 with every mask option on (causal, targets, a window lifted for
the last rows, a context prefix), D = V = 64 causal with a per-token scale, D = 64 against V = 128 with
every option but causal; the backward's dk/dv and dq kernels at D = V = 128 and 64 (causal, with and
without the options, bfloat16 and float16, the scale static and per token) and V != D. On a Hopper GPU
against the float64 reference (helpers.hstu_reference), the forward and the Hopper backward after it (the
spy's backward config says the Hopper kernels ran): every mask combination, bfloat16 and float16, both
layouts, D = V = 64 and 128 and V != D, attn_scale none, static, a scalar array and one per token (its
gradient from the dq kernel), empty, 1-token and truncated sequences (targets straddling max_seq_len),
sequences of many blocks on few persistent programs, nan and inf in every token no query attends,
adversarial offsets (against the portable kernels), and two runs bitwise equal. Their launches' exact
arguments, their reasons, the backward's fall-back to the portable one, and when backend="auto" takes them:
test_launchers.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hstu
from helpers import Spy, attended_counts, attended_mask, relative_error, to_numpy
from test_hopper import check_compiled, compile_for_sm90, products_in_flight
from test_hstu import HstuBatch, assert_close, expected_of, run

from jagged_flash_jax import configs, hstu_attention, implementations, select
from jagged_flash_jax.launch import hstu as launch_hstu
from jagged_flash_jax.problem import HstuProblem

# ---------------------------------------------------------------------------------------------------
# Compiled for sm_90a, without a GPU
# ---------------------------------------------------------------------------------------------------


def _hopper_launches(launch, config, dim: int, value_dim: int, layout: str, dtype, token_scale: bool,
                     mask: dict, backward: bool = False) -> list:
    """The KernelCalls and arrays a Hopper HSTU launch function (launch_hstu.hopper_forward, or with
    `backward` hopper_backward, do as v) makes with `config`, recorded: 2 heads, 64 tokens in 2 sequences
    (offsets [[0, 10, 64]]), max_seq_len 40, alpha 0.5; targets [[2, 3]] with has_targets; the scale 1/40,
    or one per token with `token_scale`; q, k of `dim`, v (and do) of `value_dim`."""
    p = HstuProblem(layout=layout, num_heads=2, head_dim=dim, value_dim=value_dim, batch=2, num_segments=1,
                    tokens=64, offsets_rows=1, max_seq_len=40, alpha=0.5,
                    scale=None if token_scale else 1 / 40, dtype=jnp.dtype(dtype).name, **mask)
    shape = lambda d: (64, 2, d) if layout == "THD" else (2, 64, d)  # noqa: E731
    qk, v = jnp.zeros(shape(dim), dtype), jnp.zeros(shape(value_dim), dtype)
    recorded = []

    def run(call, arrays):
        recorded.append((call, arrays))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in call.out_shapes)

    launch(run, p, config, qk, qk, v, jnp.asarray([[0, 10, 64]], jnp.int32),
           jnp.asarray([[2, 3]], jnp.int32) if p.has_targets else None,
           jnp.ones(64, jnp.float32) if token_scale else None, *((v,) if backward else ()))
    return recorded


def hstu_hopper_call(dim: int, value_dim: int, layout: str, dtype, token_scale: bool = False, **mask):
    """The Hopper HSTU forward's KernelCall and arrays, as launch/hstu.hopper_forward makes them on
    `_hopper_launches`' problem."""
    config = launch_hstu.HopperHstuConfig(configs.HSTU_HOPPER_FWD_TILE, configs.HOPPER_SMS)
    (one,) = _hopper_launches(launch_hstu.hopper_forward, config, dim, value_dim, layout, dtype, token_scale,
                              mask)
    return one


ALL_OPTIONS = dict(has_targets=True, max_attn_len=16, contextual_seq_len=3, min_full_attn_seq_len=8)
# (dim, value_dim, layout, dtype, token_scale, mask options): every mask option's constexpr on at
# D = V = 128 (the code the mask adds to each score tile: the ids' clamps, the window and its lift, the
# context rows), causal; the plain causal kernel at D = V = 64 with the per-token scale's epilogue; V != D
# (v's tiles and o's columns apart from q's and k's) not causal, with the options.
COMPILE_CASES = [(128, 128, "THD", jnp.bfloat16, False, dict(causal=True, **ALL_OPTIONS)),
                 (64, 64, "HTD", jnp.float16, True, dict(causal=True)),
                 (64, 128, "THD", jnp.bfloat16, True, dict(causal=False, **ALL_OPTIONS))]


def _compile_id(case) -> str:
    dim, value_dim, layout, dtype, token_scale, mask = case
    options = "-".join(f"{k}={v}" for k, v in mask.items())
    scale = "token" if token_scale else "static"
    return f"D{dim}-V{value_dim}-{layout}-{jnp.dtype(dtype).name}-{scale}-{options}"


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_compile_id)
def test_the_hstu_hopper_forward_compiles_for_sm90a(case):
    """Through jax-triton's pipeline (test_hopper.compile_for_sm90): 384 threads, setmaxnreg's split,
    wgmma and TMA, shared memory within the H200's; and its waits as written (no Triton pipeliner): the
    next tile's S in flight beside P V."""
    if not implementations.hstu_gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper forward is unavailable)")
    dim, value_dim, layout, dtype, token_scale, mask = case
    ptx, metadata = compile_for_sm90(*hstu_hopper_call(dim, value_dim, layout, dtype, token_scale, **mask))
    check_compiled(ptx, metadata)
    assert products_in_flight(ptx) == 2


def hstu_hopper_backward_calls(dim: int, value_dim: int, layout: str, dtype, token_scale: bool = False,
                               **mask):
    """The Hopper HSTU backward's two KernelCalls and their arrays (dk/dv, then dq), as
    launch/hstu.hopper_backward makes them, on `_hopper_launches`' problem (do as v)."""
    config = launch_hstu.HopperHstuBackwardConfig(configs.HSTU_HOPPER_BWD_DKDV_TILE,
                                                  configs.HSTU_HOPPER_BWD_DQ_TILE, configs.HOPPER_SMS)
    return _hopper_launches(launch_hstu.hopper_backward, config, dim, value_dim, layout, dtype, token_scale,
                            mask, backward=True)


# (dim, value_dim, layout, dtype, token_scale, mask options) of the backward: D = V = 128 and 64, each
# causal with every mask option on (targets, a window lifted for the last rows, a context prefix) and
# plain causal, bfloat16 and float16, both layouts, the scale static and per token (dq's scale gradient);
# V != D with the options, not causal.
BACKWARD_COMPILE_CASES = [(128, 128, "THD", jnp.bfloat16, False, dict(causal=True, **ALL_OPTIONS)),
                          (128, 128, "HTD", jnp.float16, True, dict(causal=True)),
                          (64, 64, "THD", jnp.float16, True, dict(causal=True, **ALL_OPTIONS)),
                          (64, 64, "HTD", jnp.bfloat16, False, dict(causal=True)),
                          (64, 128, "THD", jnp.bfloat16, True, dict(causal=False, **ALL_OPTIONS))]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("case", BACKWARD_COMPILE_CASES, ids=_compile_id)
def test_the_hstu_hopper_backward_compiles_for_sm90a(case, kernel):
    """Both kernels of the backward, through jax-triton's pipeline (test_hopper.compile_for_sm90): 384
    threads, setmaxnreg's split, wgmma and TMA, shared memory within the H200's."""
    if not implementations.hstu_backward_gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    dim, value_dim, layout, dtype, token_scale, mask = case
    dkdv, dq = hstu_hopper_backward_calls(dim, value_dim, layout, dtype, token_scale, **mask)
    call, arrays = dkdv if kernel == "dkdv" else dq
    ptx, metadata = compile_for_sm90(call, arrays)
    check_compiled(ptx, metadata)


# ---------------------------------------------------------------------------------------------------
# On a Hopper GPU, against float64
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def hstu_hopper():
    """A spy of "hstu-hopper" (helpers.Spy: it records each pass it runs), on a Hopper GPU."""
    device = select.current_device()
    if device.capability is None or device.capability[0] != 9:
        pytest.skip(f"needs a Hopper GPU (compute capability 9.x), not {device.capability}")
    return Spy(implementations.HSTU_HOPPER)


# Sequences of 5, 0, 1, 300 (cut at max_seq_len = 260: three 128-query blocks, the last of 4 rows, a key
# range ending 4 keys into a 64-key tile), 130 (two blocks, warpgroup 1 of the last one without a row) and
# 64 tokens (one block, warpgroup 1 without a row), one token before the first and two after the last.
# Targets: none in the 5-token and the empty one, the whole 1-token and 64-token ones, 50 of the 300 (of
# which positions 250-259 are computed: gr counts them from the sequence's true end), 30 of the 130.
LENGTHS, MAX_SEQ_LEN, ALPHA = [5, 0, 1, 300, 130, 64], 260, 0.35
TARGETS = [0, 0, 1, 50, 30, 64]
# test_hstu.py's mask combinations (its targets replaced by these), and wider ones.
CASES = {name: dict(options, **({"targets": TARGETS} if "targets" in options else {}))
         for name, options in test_hstu.CASES.items()}
CASES.update({
    # A window wider than a query block: key ranges starting past 0, several tiles each.
    "window-wide": dict(max_attn_len=150),
    "window-wide-noncausal": dict(max_attn_len=150, causal=False),
    "all-wide": dict(targets=TARGETS, contextual_seq_len=70, max_attn_len=100, min_full_attn_seq_len=40),
})
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
TOLERANCE = 1e-2  # 16-bit inputs, the weights rounded to them before P V (as the portable forward's)


def check(spy, case, *, dtype="bf16", layout="THD", dim=128, value_dim=128, attn_scale="none", seed=0,
          lengths=LENGTHS, max_seq_len=MAX_SEQ_LEN, **extra):
    """The forward on "hstu-hopper" (the spy) and the portable backward after it, against float64: o,
    dq, dk, dv (and the scale's gradient) within TOLERANCE in norm, finite, zero on unattended tokens."""
    options = dict(CASES[case], **extra)
    targets = options.pop("targets", None)
    static_scale = None
    if attn_scale == "static":  # a Python float: a constant of the kernel (SCALE), no operand
        static_scale, attn_scale = 0.04, "none"
    b = HstuBatch.make(lengths, heads=2, dim=dim, value_dim=value_dim, targets=targets, attn_scale=attn_scale,
                       lead=1, extra=2, seed=seed + len(case))
    run_options = dict(options, **({} if static_scale is None else dict(attn_scale=static_scale)))
    results = run(spy, b, max_seq_len=max_seq_len, alpha=ALPHA, dtype=DTYPES[dtype], layout=layout,
                  **run_options)
    if static_scale is not None:  # the reference's scalar scale, without a gradient (none is asked)
        expected = expected_of(results, dataclasses.replace(b, attn_scale=static_scale),
                               max_seq_len=max_seq_len, alpha=ALPHA, **options)
        expected = (*expected[:4], None)
    else:
        expected = expected_of(results, b, max_seq_len=max_seq_len, alpha=ALPHA, **options)
    assert_close(results, expected, TOLERANCE, attended_mask(b.offsets, b.q.shape[0], max_seq_len))
    assert_ran_hopper(spy)


def assert_ran_hopper(spy):
    """The spy's last forward and backward were "hstu-hopper"'s Hopper kernels (by their configs: its
    backward runs the portable one's where the Hopper kernels cannot take the problem)."""
    assert [(kind, name) for kind, name, *_ in spy.calls][-2:] == [("forward", "hstu-hopper"),
                                                                  ("backward", "hstu-hopper")]
    forward_config = [config for kind, _, _, config in spy.calls if kind == "forward"][-1]
    assert isinstance(forward_config, launch_hstu.HopperHstuConfig)
    backward_config = [config for kind, _, _, config in spy.calls if kind == "backward"][-1]
    assert isinstance(backward_config, launch_hstu.HopperHstuBackwardConfig)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_matches_float64(case, hstu_hopper):
    check(hstu_hopper, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "targets-noncausal", "window-wide", "all", "all-noncausal"])
def test_float16_htd(case, hstu_hopper):
    check(hstu_hopper, case, dtype="fp16", layout="HTD")


@pytest.mark.gpu
@pytest.mark.parametrize("dim,value_dim", [(64, 64), (64, 128), (128, 64)])
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_head_dimensions(dim, value_dim, layout, hstu_hopper):
    check(hstu_hopper, "all", layout=layout, dim=dim, value_dim=value_dim, attn_scale="jagged")


@pytest.mark.gpu
@pytest.mark.parametrize("attn_scale", ["static", "scalar", "jagged"])
@pytest.mark.parametrize("case", ["all", "noncausal"])
def test_attn_scale(case, attn_scale, hstu_hopper):
    """A static float (the kernel's SCALE), a scalar array and one per token (the TOKEN_SCALE operand,
    its gradient from the portable backward)."""
    check(hstu_hopper, case, attn_scale=attn_scale, dtype="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("case", ["causal", "all-wide"])
def test_many_blocks_on_few_programs(case, programs, hstu_hopper):
    """Sequences of 1000 and 700 tokens (cut at 900) on 1 and 3 persistent programs: each program takes
    many query blocks, the ring's positions, the query tiles' phases and the tail hand-overs' phases
    running on from block to block."""
    with select.use_device(dataclasses.replace(select.current_device(), sms=programs)):
        check(hstu_hopper, case, lengths=[1000, 3, 700], max_seq_len=900,
              **({"targets": [40, 3, 0]} if "targets" in CASES[case] else {}))
    assert {config.programs for _, _, _, config in hstu_hopper.calls} == {programs}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["THD", "HTD"])
@pytest.mark.parametrize("case", ["causal", "all"])
def test_poisoned_tokens_stay_out(case, layout, hstu_hopper):
    """nan (q, k, do, a per-token scale) and inf (v) in every token no query attends (before the first
    sequence, past max_seq_len, after the last; the truncated sequence's last key tile reads some: zeroed
    in shared memory before P V) leave every result exactly that of finite values there, and zero on
    those tokens."""
    options = dict(CASES[case])
    b = HstuBatch.make([5, 300, 0, 3, 64], heads=2, dim=128, value_dim=128,
                       targets=[1, 40, 0, 3, 10] if "targets" in options else None, attn_scale="jagged",
                       lead=2, extra=3, seed=7)
    options.pop("targets", None)
    kwargs = dict(max_seq_len=MAX_SEQ_LEN, alpha=ALPHA, dtype=jnp.bfloat16, layout=layout, **options)
    clean = run(hstu_hopper, b, **kwargs)
    poisoned = run(hstu_hopper, b, poison=True, **kwargs)
    outside = ~attended_mask(b.offsets, b.q.shape[0], MAX_SEQ_LEN)
    for name, got, want in zip(("o", "dq", "dk", "dv", "d_attn_scale"), poisoned[4:], clean[4:]):
        assert np.all(got[outside] == 0), f"{name} is not zero outside"
        np.testing.assert_array_equal(got, want, err_msg=f"{name} differs with nan and inf outside")
    assert_ran_hopper(hstu_hopper)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 3])
@pytest.mark.parametrize("case", ["causal", "all-wide"])
def test_two_runs_are_bitwise_equal(case, programs, hstu_hopper):
    """The persistent programs take their blocks in no set order, but every gradient row has one writer
    and sums its tiles in a fixed order: two runs of the same program give the same bits (o, dq, dk, dv
    and the per-token scale's gradient)."""
    options = dict(CASES[case])
    b = HstuBatch.make([1000, 3, 700, 130], heads=2, dim=128, value_dim=128,
                       targets=[40, 3, 0, 20] if "targets" in options else None, attn_scale="jagged", lead=1,
                       extra=2, seed=11)
    options.pop("targets", None)
    device = select.current_device()
    with select.use_device(device if programs is None else dataclasses.replace(device, sms=programs)):
        first, second = (run(hstu_hopper, b, max_seq_len=900, alpha=ALPHA, dtype=jnp.bfloat16, **options)
                         for _ in range(2))
    for name, x, y in zip(("o", "dq", "dk", "dv", "d_attn_scale"), first[4:], second[4:]):
        np.testing.assert_array_equal(x, y, err_msg=f"{name} differs between two runs")
    assert_ran_hopper(hstu_hopper)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal", "all-wide", "noncausal"])
def test_the_sequences_order_changes_no_bit(case, hstu_hopper):
    """The Hopper HSTU kernels taking the sequences longest first (HstuHopper(longest_first=True): these
    lengths come in another order) or in the offsets' order (the default) on 3 programs: o, dq, dk,
    dv and the per-token scale's gradient bitwise equal, as each element is one program's either way."""
    options = dict(CASES[case])
    b = HstuBatch.make([130, 3, 1000, 0, 700], heads=2, dim=128, value_dim=128,
                       targets=[20, 3, 40, 0, 0] if "targets" in options else None, attn_scale="jagged",
                       lead=1, extra=2, seed=13)
    options.pop("targets", None)
    results = []
    with select.use_device(dataclasses.replace(select.current_device(), sms=3)):
        for longest_first in (True, False):
            spy = Spy(dataclasses.replace(hstu_hopper.inner, longest_first=longest_first))
            results.append(run(spy, b, max_seq_len=900, alpha=ALPHA, dtype=jnp.bfloat16, **options))
            assert_ran_hopper(spy)
            assert {config.longest_first for _, _, _, config in spy.calls} == {longest_first}
    for name, first, given in zip(("o", "dq", "dk", "dv", "d_attn_scale"), results[0][4:], results[1][4:]):
        np.testing.assert_array_equal(first, given, err_msg=name)


# The adversarial offsets of test_memory_safety.py (a token axis of 24): negative, decreasing, past the
# end, overlapping; and int64 ones far past int32.
TOKENS = 24
ADVERSARIAL_OFFSETS = [[-5, 3, 10], [10, 3, 20], [0, 2**31 - 1, 5], [-(2**31), 0, 24], [20, 30, 40],
                       [24, 24, 0], [0, 24, 24, -1, 12], [0, 1, 2, 24], [0]]
ADVERSARIAL_INT64_OFFSETS = [[-(2**62), 7, 2**62, 3], [2**32 + 3, 10, 2**32 - 1]]


@functools.cache
def _offsets_op(implementation):
    """hstu_attention with every mask option on, the offsets and targets traced (concrete malformed
    offsets are refused before any kernel)."""
    return jax.jit(lambda q, k, v, offsets, targets: hstu_attention(
        q, k, v, offsets, 16, alpha=0.5, num_targets=targets, max_attn_len=4, contextual_seq_len=2,
        implementation=implementation))


@pytest.mark.gpu
@pytest.mark.parametrize("offsets,int64", [(o, False) for o in ADVERSARIAL_OFFSETS]
                         + [(o, True) for o in ADVERSARIAL_INT64_OFFSETS], ids=str)
def test_adversarial_offsets(offsets, int64, hstu_hopper):
    """Any offsets content: o finite, zero on the tokens no sequence attends (offsets clamped into
    [0, T], each end to at least its start), and the portable forward's on the tokens one sequence
    attends (within TOLERANCE); its own zero fill does the tokens outside (no memset)."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((TOKENS, 2, 128)), jnp.bfloat16) for _ in range(3))
    with jax.enable_x64(int64):
        dtype = jnp.int64 if int64 else jnp.int32
        traced = jnp.asarray(offsets, dtype)
        targets = jnp.ones(len(offsets) - 1, dtype)
        got = to_numpy(_offsets_op(hstu_hopper)(q, k, v, traced, targets))
        want = to_numpy(_offsets_op("portable")(q, k, v, traced, targets))
    assert np.all(np.isfinite(got))
    counts = attended_counts(offsets, TOKENS, 16)
    assert not np.any(got[counts == 0]), f"o is not zero on tokens {np.flatnonzero(counts == 0)}"
    # A token in two (clamped) sequences is written by both, in no set order (each kernel's own): it
    # is compared where one sequence writes it.
    once = counts == 1
    if np.any(want[once]):
        assert relative_error(got[once], want[once]) <= TOLERANCE
    if len(offsets) > 1:
        assert hstu_hopper.calls and hstu_hopper.calls[-1][:2] == ("forward", "hstu-hopper")


@functools.cache
def _offsets_grad_op(implementation):
    """The gradient in q, k, v of `_offsets_op`'s op (a fixed weighting of o), the offsets and targets
    traced."""
    def loss(q, k, v, offsets, targets, weights):
        o = hstu_attention(q, k, v, offsets, 16, alpha=0.5, num_targets=targets, max_attn_len=4,
                           contextual_seq_len=2, implementation=implementation)
        return jnp.sum(o.astype(jnp.float32) * weights)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("offsets,int64", [(o, False) for o in ADVERSARIAL_OFFSETS]
                         + [(o, True) for o in ADVERSARIAL_INT64_OFFSETS], ids=str)
def test_adversarial_offsets_backward(offsets, int64, hstu_hopper):
    """Any offsets content: dq, dk, dv finite, zero on the tokens no sequence attends (the kernels' own
    zero fills), and the portable backward's on the tokens one sequence attends (within TOLERANCE)."""
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((TOKENS, 2, 128)), jnp.bfloat16) for _ in range(3))
    weights = jnp.asarray(rng.standard_normal((TOKENS, 2, 128)), jnp.float32)
    with jax.enable_x64(int64):
        dtype = jnp.int64 if int64 else jnp.int32
        traced = jnp.asarray(offsets, dtype)
        targets = jnp.ones(len(offsets) - 1, dtype)
        got = [to_numpy(x) for x in _offsets_grad_op(hstu_hopper)(q, k, v, traced, targets, weights)]
        want = [to_numpy(x) for x in _offsets_grad_op("portable")(q, k, v, traced, targets, weights)]
    counts = attended_counts(offsets, TOKENS, 16)
    once = counts == 1
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(g)), f"{name} is not finite"
        assert not np.any(g[counts == 0]), f"{name} is not zero on tokens {np.flatnonzero(counts == 0)}"
        if np.any(w[once]):
            assert relative_error(g[once], w[once]) <= TOLERANCE, name
    if len(offsets) > 1:
        assert hstu_hopper.calls[-1][:2] == ("backward", "hstu-hopper")
        assert isinstance(hstu_hopper.calls[-1][3], launch_hstu.HopperHstuBackwardConfig)
