"""Memory safety of the kernels, on the interpret backend, whose guard zones are the proof: that the
guards catch bad kernels, and that no offsets content (negative, decreasing, past the end, int64 past
2**32) makes a kernel write outside its arrays, read outside them, or leave an output element unset."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from helpers import FusedDq, Spy, attended_mask, to_numpy, variant

import jagged_flash_jax as jfa
from jagged_flash_jax import select, transforms
from jagged_flash_jax.launch import interpret
from jagged_flash_jax.launch.calls import KernelCall

TESTS = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------------
# The guards themselves
# ---------------------------------------------------------------------------------------------------


def test_the_sentinel_is_a_nan_for_floats_and_a_distinct_pattern_for_all():
    for dtype in (np.float32, np.float16):
        assert np.isnan(interpret.sentinel(dtype))
    assert interpret.sentinel(np.float32).view(np.uint32) == 0xFFA5A5A5
    assert interpret.sentinel(np.int32) == np.int32(np.uint32(0xFFA5A5A5).view(np.int32))
    assert interpret.sentinel(np.int64).view(np.uint64) == 0xFFA5A5A5A5A5A5A5


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64])
@pytest.mark.parametrize("where", [0, -1], ids=["front", "back"])
def test_a_guard_sees_any_write(dtype, where):
    guarded = interpret.Guarded(np.arange(6).reshape(2, 3), (2, 3), dtype)
    assert guarded.guards_intact()
    guarded.array[...] = np.nan if np.issubdtype(dtype, np.floating) else -1  # the array is free to write
    assert guarded.guards_intact()
    # NaN into a guard: the NaN-filled guards of old could not see this one.
    written = [np.nan, 0] if np.issubdtype(dtype, np.floating) else [-1, 0]
    for value in written:
        guarded = interpret.Guarded(None, (2, 3), dtype)
        guarded.buffer[where] = value
        assert not guarded.guards_intact(), value


# Deliberately bad kernels, run through the interpreter launcher. Arrays (the last the int32 params),
# outputs, constants: the launchers' convention.


@triton.jit
def _copy_kernel(x_ptr, params_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[i + write_shift] = x[i + read_shift] for i < count; params: count, read_shift, write_shift."""
    count, read_shift, write_shift = tl.load(params_ptr), tl.load(params_ptr + 1), tl.load(params_ptr + 2)
    i = tl.arange(0, BLOCK)
    mask = i < count
    tl.store(out_ptr + i + write_shift, tl.load(x_ptr + i + read_shift, mask=mask), mask=mask)


@triton.jit
def _scribble_kernel(x_ptr, params_ptr, out_ptr, BLOCK: tl.constexpr):
    """Copies x to out, then writes 0 one past the end of its input x (params: its length n)."""
    n = tl.load(params_ptr)
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)
    tl.store(x_ptr + n + i, tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty), mask=i < 1)


def _launch(kernel, x, *scalars):
    call = KernelCall(kernel, grid=(1,), out_shapes=(jax.ShapeDtypeStruct(x.shape, x.dtype),),
                      params=scalars, constants=dict(BLOCK=16))
    (out,) = interpret.run(call, (x, jnp.asarray(scalars, jnp.int32)))
    return np.asarray(out)


DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32]


def _values(dtype):
    return jnp.arange(1, 9).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_correct_kernel_passes(dtype):
    x = _values(dtype)
    np.testing.assert_array_equal(_launch(_copy_kernel, x, 8, 0, 0), np.asarray(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("write_shift", [1, -1, 8], ids=["one-past-the-end", "one-before", "after"])
def test_a_kernel_writing_outside_its_output_raises(dtype, write_shift):
    with pytest.raises(jax.errors.JaxRuntimeError, match="_copy_kernel wrote outside its arrays"):
        _launch(_copy_kernel, _values(dtype), 8, 0, write_shift)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_a_kernel_writing_nan_outside_its_output_raises(dtype):
    x = jnp.full(8, jnp.nan, dtype)
    with pytest.raises(jax.errors.JaxRuntimeError, match="wrote outside its arrays"):
        _launch(_copy_kernel, x, 8, 0, 1)


def test_a_kernel_writing_outside_an_input_raises():
    with pytest.raises(jax.errors.JaxRuntimeError, match="_scribble_kernel wrote outside its arrays"):
        _launch(_scribble_kernel, _values(jnp.float32), 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_kernel_reading_outside_its_input_shows(dtype):
    """The last element comes from the guard after x: NaN for floats, the sentinel for integers."""
    out = _launch(_copy_kernel, _values(dtype), 8, 1, 0)
    np.testing.assert_array_equal(out[:7], np.asarray(_values(dtype))[1:])
    if jnp.issubdtype(dtype, jnp.floating):
        assert np.isnan(out[7].astype(np.float32))
    else:
        assert out[7] == interpret.sentinel(out.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_an_output_element_left_unwritten_shows(dtype):
    """Outputs start as the sentinel, not as zeros that could pass for a result."""
    out = _launch(_copy_kernel, _values(dtype), 7, 0, 0)
    if jnp.issubdtype(dtype, jnp.floating):
        assert np.isnan(out[7].astype(np.float32))
    else:
        assert out[7] == interpret.sentinel(out.dtype)


# ---------------------------------------------------------------------------------------------------
# Any offsets content: every case in one process of its own (a crash fails the test, naming its case)
# ---------------------------------------------------------------------------------------------------

TOKENS, KV_TOKENS, HEADS, DIM = 24, 20, 2, 8
HOPPER_DIM = 128  # with bfloat16: the Hopper forward's (on a Hopper GPU)
MAX_SEQ_LEN, KV_MAX_SEQ_LEN = 16, 12

ADVERSARIAL_OFFSETS = [
    [-5, 3, 10],
    [10, 3, 20],
    [0, 2**31 - 1, 5],
    [-(2**31), 0, 24],
    [20, 30, 40],
    [24, 24, 0],
    [0, 24, 24, -1, 12],
    [0],  # no sequence: offsets has one entry, which the persistent Hopper forward must not read past
]
# int64, with jax.enable_x64: far past int32, and past 2**32 by little (int32 truncation would read 3).
ADVERSARIAL_INT64_OFFSETS = [
    [-(2**62), 7, 2**62, 3],
    [2**32 + 3, 10, 2**32 - 1],
]
CASES = [(offsets, False) for offsets in ADVERSARIAL_OFFSETS] + [(o, True) for o in ADVERSARIAL_INT64_OFFSETS]


@functools.cache
def _ops(where):
    """The jitted ops the cases run on `where` (a backend's name, or an implementation), made once per
    process, so that every case of a variant (the offsets are traced arguments) reuses their
    compilations. The softmax ops are None for HSTU's Hopper forward, named (they have no such
    implementation)."""
    hstu_only = where == "hstu-hopper"
    if isinstance(where, tuple):  # (the forward's implementation, the backward's)
        where = dict(implementation=where[0], backward_implementation=where[1])
    elif isinstance(where, str) and not hstu_only:
        where = dict(backend=where)
    else:
        where = dict(implementation=where)
    # HSTU attention (its own implementations: on a backend's name, or its Hopper forward named), every
    # mask option on: targets read per sequence, a window and a context prefix.
    hstu_op = jax.jit(lambda q, k, v, o, targets: jfa.hstu_attention(
        q, k, v, o, MAX_SEQ_LEN, alpha=0.5, num_targets=targets, max_attn_len=4, contextual_seq_len=1,
        **where)) if "backend" in where or hstu_only else None
    if hstu_only:
        return None, None, None, None, hstu_op
    self_op = jax.jit(lambda q, k, v, o: jfa.jagged_attention(q, k, v, o, MAX_SEQ_LEN, **where))
    cross_op = jax.jit(lambda q, k, v, o, kv_o: jfa.jagged_attention(
        q, k, v, o, MAX_SEQ_LEN, kv_offsets=kv_o, kv_max_seq_len=KV_MAX_SEQ_LEN, causal=True, **where))
    fbgemm_op = jax.jit(lambda q, k, v, o: jfa.multi_head_jagged_flash_attention(
        q, k, v, o, MAX_SEQ_LEN, **where))
    # The band skips key and query blocks and ALiBi reads a slope per segment and head: with any
    # offsets, they stay inside the arrays too.
    options_op = jax.jit(lambda q, k, v, o, kv_o, slopes: jfa.jagged_attention(
        q, k, v, o, MAX_SEQ_LEN, kv_offsets=kv_o, kv_max_seq_len=KV_MAX_SEQ_LEN, window=(5, 3),
        softcap=2.0, alibi_slopes=slopes, **where))
    return self_op, cross_op, fbgemm_op, options_op, hstu_op


def _check_offsets_case(offsets, int64: bool, where, hopper: bool, variant: str) -> None:
    """Forward and vjp of both ops on `where` (see `_ops`) with these offsets (the kv offsets, reversed,
    for cross-attention): every output finite, zero on tokens nothing attends."""
    rng = np.random.default_rng(11)
    hopper_dim = {"hopper D64": 64, "hopper D256": 256, "hopper fused dq D64": 64}.get(variant, HOPPER_DIM)
    # The portable forward's TMA loads take 16-bit inputs at a power-of-two D.
    dtype, dim = ((jnp.bfloat16, hopper_dim) if hopper else (jnp.bfloat16, 16) if variant == "tma loads"
                  else (jnp.float32, DIM))
    q = jnp.asarray(rng.standard_normal((TOKENS, HEADS, dim)), dtype)
    kv = jnp.asarray(rng.standard_normal((KV_TOKENS, HEADS, dim)), dtype)
    kv_offsets = offsets[::-1]
    self_op, cross_op, fbgemm_op, options_op, hstu_op = _ops(where)
    with jax.enable_x64(int64):
        dtype = jnp.int64 if int64 else jnp.int32
        # Offsets as jit arguments (traced): concrete malformed offsets are rejected before any kernel.
        q_offsets, kv_offsets = jnp.asarray(offsets, dtype), jnp.asarray(kv_offsets, dtype)
        assert q_offsets.dtype == dtype
        slopes = jnp.linspace(0.1, 0.9, HEADS, dtype=jnp.float32)
        cases = {} if self_op is None else {
            "jagged_attention": (lambda q, k, v: self_op(q, k, v, q_offsets), (q, q, q), "THD", False),
            "jagged_attention cross causal": (lambda q, k, v: cross_op(q, k, v, q_offsets, kv_offsets),
                                              (q, kv, kv), "THD", True),
            "multi_head_jagged_flash_attention": (lambda q, k, v: fbgemm_op(q, k, v, q_offsets),
                                                  (q.swapaxes(0, 1),) * 3, "HTD", False),
            "jagged_attention cross window softcap alibi": (
                lambda q, k, v: options_op(q, k, v, q_offsets, kv_offsets, slopes), (q, kv, kv), "THD", True),
        }
        if hstu_op is not None:
            targets = jnp.ones(len(offsets) - 1, dtype)
            cases["hstu_attention targets window context"] = (
                lambda q, k, v: hstu_op(q, k, v, q_offsets, targets), (q, q, q), "THD", False)
        q_mask = attended_mask(offsets, TOKENS, MAX_SEQ_LEN)
        for name, (op, args, layout, cross) in cases.items():
            o, vjp = jax.vjp(op, *args)
            results = dict(zip(["o", "dq", "dk", "dv"], (o, *vjp(jnp.ones_like(o)))))
            kv_mask = attended_mask(kv_offsets, KV_TOKENS, KV_MAX_SEQ_LEN) if cross else q_mask
            for what, x in results.items():
                x = to_numpy(x, layout)
                assert np.all(np.isfinite(x)), f"{name} ({variant}): {what} is not finite (a read outside)"
                mask = q_mask if what in ("o", "dq") else kv_mask
                assert not np.any(x[~mask]), (f"{name} ({variant}): {what} is not zero on tokens "
                                              f"{np.flatnonzero(~mask)}")


def check_offsets_cases(cases, backend: str = "interpret", hopper: bool = False, only=None) -> None:
    """Every case (offsets, int64) under each variant, in this process; prints `start CASE VARIANT`
    before and `ok CASE VARIANT` after each, so that a crash names its case. The variants: the kernels
    as chosen, then the portable ones with key-major operands forced (which float32 inputs with TF32 and
    D >= 64 take: their transposes, and key and query windows that start before their sequence), then
    the portable forward's TMA loads forced ("tma loads", bfloat16 at D = 16: its tiles' coordinates from
    the clamped offsets). With
    `hopper` (a Hopper GPU), bfloat16 at D = 128 on the Hopper kernels alone (a spy says they ran), whose
    tiles reach past the arrays' ends here and whose own programs zero the uncovered tokens, at D = 256
    ("hopper D256": the dk/dv kernel whose warpgroups split the columns) and the Hopper backward at
    D = 64 ("hopper D64", its own tiles, after the portable forward), then with
    dq fused into dk/dv ("hopper-fused-dq"; at D = 64 too, "hopper fused dq D64", where one warpgroup
    adds a tile's whole dQ), then HSTU attention on its Hopper forward and backward
    ("hstu-hopper", named: auto takes it from 1024 tokens only). `only`: the names of the variants to run
    (default all)."""
    spy = Spy("hopper")
    # At D = 64 the Hopper backward alone: the Hopper forward has no tiles there.
    variants = ({"hopper": spy, "hopper D256": spy, "hopper D64": ("portable", spy),
                 "hopper fused dq": FusedDq(spy.calls),
                 "hopper fused dq D64": ("portable", FusedDq(spy.calls)),
                 "hstu hopper": "hstu-hopper"} if hopper
                else {"as chosen": backend, "key-major": variant(backend, key_major=True),
                      "tma loads": variant(backend, tma_loads=True)})
    variants = {name: where for name, where in variants.items() if only is None or name in only}
    for name, where in variants.items():
        # Each variant traces its own programs: the last one's may go (memory).
        jax.clear_caches()
        transforms.clear_programs()
        for offsets, int64 in cases:
            case = json.dumps([offsets, int64])
            print("start", case, name, flush=True)
            _check_offsets_case(offsets, int64, where, hopper, name)
            print("ok", case, name, flush=True)
    if hopper and only is None:  # the four ops (the window, soft cap and ALiBi one too), forward and backward
        kinds = [kind for kind, *_ in spy.calls]
        assert kinds.count("forward") >= 4 and kinds.count("backward") >= 4, kinds
    print("all ok", flush=True)


def _describe(result: subprocess.CompletedProcess) -> str:
    if result.returncode < 0:
        how = f"killed by {signal.Signals(-result.returncode).name}"
    else:
        how = f"exit status {result.returncode}"
    return f"the case's process failed ({how}):\n{result.stderr[-4000:]}"


def _child_env(**variables) -> dict:
    """This process's environment with `variables`, and the tests and the package importable."""
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **variables, "PYTHONPATH": path}


def test_adversarial_offsets_are_memory_safe():
    """Forward and backward of both ops, self- and cross-attention, causal, a window with a soft cap and
    ALiBi, and HSTU attention with targets, a window and a context prefix, for every case of CASES: see
    `check_offsets_cases`, run in a process of its own (a crash fails this test with the case it was in;
    the cases share their compilations there). The guards raise if a kernel wrote outside its arrays; a
    read outside, or an output element left unwritten, would be a NaN."""
    call = f"import test_memory_safety as t; t.check_offsets_cases({CASES!r})"
    result = subprocess.run([sys.executable, "-c", call], env=_child_env(JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=600, cwd=TESTS)
    lines = result.stdout.splitlines()
    for offsets, int64 in CASES:
        for name in ("as chosen", "key-major", "tma loads"):
            case = f"{json.dumps([offsets, int64])} {name}"
            if f"ok {case}" not in lines:
                reached = f"start {case}" in lines
                pytest.fail(f"case {case} {'failed' if reached else 'was not reached'}: "
                            + _describe(result))
    assert result.returncode == 0 and lines[-1] == "all ok", _describe(result)


def test_malformed_offsets_without_overlap_match_the_xla_backend():
    """Decreasing offsets whose clamped sequences do not overlap: every token, covered or not, equals
    the xla backend's (same clamping rule); uncovered tokens are 0."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((24, 2, 8)), jnp.float32) for _ in range(3))
    offsets = jnp.asarray([10, 3, 20], jnp.int32)  # sequence 0 empty at 10, sequence 1 is tokens 3..19
    got, want = (jax.jit(lambda q, k, v, o, b=b: jfa.jagged_attention(q, k, v, o, 32, backend=b,
                                                                        allow_tf32=False))(q, k, v, offsets)
                 for b in ("interpret", "xla"))  # traced offsets: concrete malformed ones raise
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got)[np.r_[0:3, 20:24]])


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
def test_adversarial_offsets_on_the_gpu_under_compute_sanitizer():
    """The same cases on the triton backend, in one process under compute-sanitizer's memcheck, and on a
    Hopper GPU again in bfloat16 at D = 128 (the Hopper forward and backward, whose TMA tiles reach past the
    arrays: the copy engine must clip them). XLA's platform allocator gives every buffer its own
    allocation, so an access just past an array is an error rather than a read of a neighbouring
    buffer in XLA's pool. The sanitizer checks this process alone: following the ptxas that jaxlib runs
    as a child process to load a kernel crashed it (SIGSEGV) on the H200 with triton 3.9."""
    env = _child_env(XLA_PYTHON_CLIENT_ALLOCATOR="platform", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    capability = select.current_device().capability
    hopper = [False, True] if capability is not None and capability[0] == 9 else [False]
    call = (f"import test_memory_safety as t\nfor hopper in {hopper!r}:\n"
            f"    t.check_offsets_cases({CASES!r}, backend='triton', hopper=hopper)\n")
    result = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--target-processes",
                             "application-only", "--error-exitcode", "99", "--print-limit", "20",
                             sys.executable, "-c", call],
                            env=env, capture_output=True, text=True, timeout=480, cwd=TESTS)
    report = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0 and "ERROR SUMMARY: 0 errors" in report, report
