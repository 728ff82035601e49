"""The launchers, on the CPU: the interpreter's first use from several threads and its Triton version
gate, the exact jax_triton.triton_call arguments of the GPU launcher (through a fake jax_triton), the
backend choice when jax-triton cannot run, and the tuned tile table."""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from helpers import Batch, FusedDq, Spy, clamped_sequences, reference, variant

import jagged_flash_jax as jfa
from jagged_flash_jax import _compat, checks, configs, implementations, kernels, select, transforms
from jagged_flash_jax.configs import BlockSizes, KernelConfig
from jagged_flash_jax.implementations import Device
from jagged_flash_jax.kernels import spec
from jagged_flash_jax.launch import calls, gpu
from jagged_flash_jax.launch import hstu as launch_hstu
from jagged_flash_jax.launch import interpret as interpret_launch
from jagged_flash_jax.launch.calls import HopperConfig
from jagged_flash_jax.problem import HstuProblem, Problem

TESTS = Path(__file__).resolve().parent
LOG2E = 1.4426950408889634


def spawn(call: str, env: dict) -> subprocess.Popen:
    """`call` (an expression over this module, imported as `t`) in a fresh Python process, on the CPU;
    a value None in `env` removes that variable."""
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    env = {key: value for key, value in env.items() if value is not None}
    return subprocess.Popen([sys.executable, "-c", f"import test_launchers as t; {call}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS)


def finish(run: subprocess.Popen, timeout: float = 240) -> tuple[subprocess.Popen, str, str]:
    """(run, stdout, stderr) once `run` ended; killed past `timeout` (a deadlock), with a note."""
    try:
        stdout, stderr = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        stdout, stderr = run.communicate()
        stderr += f"\n(killed after {timeout} s)"
    return run, stdout, stderr


# ---------------------------------------------------------------------------------------------------
# The interpreter's first use, from several threads at once
# ---------------------------------------------------------------------------------------------------


def first_use_from_threads(threads: int) -> None:
    """In a fresh process: `threads` threads make the first interpret calls at once, then one more call
    follows; prints what each saw, and TRITON_INTERPRET before and after."""
    before = os.environ.get("TRITON_INTERPRET")
    sys.setswitchinterval(1e-6)  # threads trade the GIL far more often: the race shows in most runs
    batch = Batch.make([5, 0, 11], 2, 8, kv_lengths=[3, 7, 2], extra=2, seed=3)
    q, k, v, _ = batch.arrays(jnp.float32)
    expected = reference(batch.q, batch.k, batch.v, batch.do, batch.offsets, 8, kv_offsets=batch.kv_offsets,
                         scale=1 / math.sqrt(8))[0]
    op = lambda q, k, v: jfa.jagged_attention(q, k, v, batch.offsets, 8, kv_offsets=batch.kv_offsets,
                                              backend="interpret", allow_tf32=False)
    # Compiled ahead (the interpreter first runs when it executes): the threads then reach it together.
    compiled = jax.jit(op).lower(q, k, v).compile()
    barrier = threading.Barrier(threads)
    outcomes = [None] * threads

    def attempt(i=0):
        o = compiled(q, k, v) if i % 2 else op(q, k, v)
        np.testing.assert_allclose(o, expected, rtol=1e-5, atol=1e-5)

    def work(i):
        barrier.wait()
        try:
            attempt(i)
            outcomes[i] = "ok"
        except Exception as err:  # reported to the parent, which shows it
            outcomes[i] = f"{type(err).__name__}: {str(err)[-400:]}"

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    try:
        attempt()
        later = "ok"
    except Exception as err:
        later = f"{type(err).__name__}: {str(err)[-400:]}"
    print(json.dumps(dict(outcomes=outcomes, later=later, before=before,
                          after=os.environ.get("TRITON_INTERPRET"))))


def test_first_use_from_several_threads():
    """Before the fix, a fresh process whose first interpret calls came from several threads at once
    often broke for good (`RuntimeError: 0 active drivers`: kernels.py was reloaded while another thread
    restored TRITON_INTERPRET) and leaked TRITON_INTERPRET=1: 8 processes in 10 did. Three processes
    here, two with TRITON_INTERPRET unset and one with it set to 0."""
    presets = [None, None, "0"]
    runs = [spawn("t.first_use_from_threads(8)", {"TRITON_INTERPRET": preset}) for preset in presets]
    finished = [finish(run) for run in runs]
    for preset, (run, stdout, stderr) in zip(presets, finished):
        assert run.returncode == 0, f"the child process failed ({run.returncode}):\n{stderr[-3000:]}"
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report["outcomes"] == ["ok"] * 8, report["outcomes"]
        assert report["later"] == "ok", report["later"]
        assert report["before"] == preset and report["after"] == preset, report


def test_interpret_leaves_the_environment_alone():
    before = dict(os.environ)
    q = jnp.ones((6, 2, 8), jnp.float32)
    o = jfa.jagged_attention(q, q, q, [0, 2, 6], 4, backend="interpret")
    assert bool(jnp.all(jnp.isfinite(o)))
    assert dict(os.environ) == before


@triton.jit
def _small_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(o_ptr + i, tl.where(x > 0, x + 1.0, tl.max(x, axis=0)), mask=i < n)


def _language_attributes() -> dict:
    modules = {name: module for name, module in sys.modules.items()
               if module is not None and name.startswith("triton.language")}
    owners = {**modules, "tl.tensor": tl.tensor}
    return {(name, attr): value for name, owner in owners.items() for attr, value in vars(owner).items()}


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
def test_interpret_leaves_triton_language_as_it_was_and_the_gpu_compiler_working():
    """The interpreter patches tl.where, tl.store, tl.tensor's operators and more, for good. A process
    that ran the interpret backend and then compiled for the GPU (the demo on a GPU machine) failed in
    the code generator. Every attribute that existed before is put back, and compilation works."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    before = _language_attributes()
    q = jnp.ones((6, 2, 8), jnp.float32)
    jax.block_until_ready(jfa.jagged_attention(q, q, q, [0, 2, 6], 4, backend="interpret"))
    after = _language_attributes()
    assert [key for key, value in before.items() if after.get(key) is not value] == []
    assert [key for key in after if key[0] == "tl.tensor" and key not in before] == []
    source = ASTSource(_small_kernel, {"x_ptr": "*fp32", "o_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 16})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert "_small_kernel" in compiled.asm["ptx"]


# ---------------------------------------------------------------------------------------------------
# The Triton version gate of the interpreter's internals
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0", "2.3.1", "nightly"])
def test_triton_outside_the_supported_range_is_refused(monkeypatch, version):
    monkeypatch.setattr(triton, "__version__", version)
    with pytest.raises(interpret_launch.UnsupportedTritonError,
                       match=r"triton>=3\.6,<3\.10.*found triton " + version):
        interpret_launch.triton_internals()


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.9.0+git1234abc"])
def test_triton_inside_the_supported_range_is_accepted(monkeypatch, version):
    monkeypatch.setattr(triton, "__version__", version)
    interpret_launch.triton_internals()


@pytest.mark.parametrize("internal", ["_patch_lang_tensor", "_patch_lang", "_get_np_dtype",
                                      "InterpretedFunction"])
def test_a_missing_triton_internal_is_refused(monkeypatch, internal):
    from triton.runtime import interpreter

    monkeypatch.delattr(interpreter, internal)
    with pytest.raises(interpret_launch.UnsupportedTritonError, match=rf"{internal}.*triton>=3\.6,<3\.10"):
        interpret_launch.triton_internals()


def test_the_interpret_backend_refuses_an_unsupported_triton_at_trace_time(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    q = jnp.ones((7, 2, 8), jnp.float32)  # a shape of its own: no trace cached by another test
    with pytest.raises(interpret_launch.UnsupportedTritonError, match=r"triton>=3\.6,<3\.10"):
        jfa.jagged_attention(q, q, q, [0, 3, 7], 5, backend="interpret")


# ---------------------------------------------------------------------------------------------------
# The GPU launcher: the exact jax_triton.triton_call arguments, recorded by a fake jax_triton
# ---------------------------------------------------------------------------------------------------


def _clear_backend_caches():
    # Without its cache, _warn_fallback would warn every time: the fallback test says so, not an error here.
    for cached in (gpu.jax_triton_module, gpu.unavailable_reason, gpu.ptx_options, select._warn_fallback):
        getattr(cached, "cache_clear", lambda: None)()


H200 = configs.FALLBACK_GPU


def gpu_device(capability=None, sms=132, kind=H200) -> Device:
    """A GPU for the choice (select.use_device); the arrays stay on the CPU."""
    return Device("gpu", kind, capability, sms)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The ops choose as on a GPU (not a Hopper). Caches of what jax-triton's import gave are cleared
    before and after, so that no test sees another's."""
    # No ptxas for jaxlib: Triton's own PTX version, whatever ptxas this machine has (tests/test_ptxas.py).
    monkeypatch.setattr(_compat, "xla_ptxas", lambda: None)
    _clear_backend_caches()
    with select.use_device(gpu_device()):
        yield
    _clear_backend_caches()


@pytest.fixture
def fake_jax_triton(fake_gpu, monkeypatch):
    """A jax_triton 0.4.1 whose triton_call records its arguments and returns zeros of the out types."""
    module = types.ModuleType("jax_triton")
    module.__version__ = "0.4.1"
    module.calls = []

    def triton_call(*args, kernel, out_type, grid, **kwargs):
        module.calls.append(dict(args=args, kernel=kernel, out_type=out_type, grid=grid, **kwargs))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_type)

    # The params array is traced when triton_call sees it: its values are recorded where it is made.
    make_params = calls._params

    def params(call):
        array = make_params(call)
        module.params[id(array)] = call.params
        return array

    @dataclasses.dataclass(frozen=True)
    class TensorDescriptor:  # jax_triton.TensorDescriptor.from_array's arguments
        base: jax.Array
        block_shape: tuple[int, ...]
        layout: object

        @classmethod
        def from_array(cls, array, block_shape, layout=None):
            return cls(array, tuple(block_shape), layout)

    def reset():
        """Forget the recorded launches and the programs of eager calls, so that the next call is traced
        afresh and its launches recorded."""
        module.calls.clear()
        transforms.clear_programs()

    module.triton_call = triton_call
    module.TensorDescriptor = TensorDescriptor
    module.reset = reset
    module.params = {}
    monkeypatch.setattr(calls, "_params", params)
    monkeypatch.setitem(sys.modules, "jax_triton", module)
    return module


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _check_call(fake, call, kernel, grid, arrays, params, out_shapes, constants, num_warps, num_stages):
    """One recorded triton_call against what it must be, argument by argument."""
    call = dict(call)
    assert call.pop("kernel") is kernel
    assert call.pop("grid") == grid
    args = call.pop("args")
    assert [(a.shape, a.dtype) for a in args[:-1]] == arrays
    # The runtime sizes come last, as an int32 array: never as Python scalars, which jax-triton turns
    # into compile-time constants when they equal 1.
    assert args[-1].dtype == jnp.int32 and args[-1].shape == (len(params),)
    assert fake.params[id(args[-1])] == params
    assert tuple(call.pop("out_type")) == out_shapes
    assert call.pop("num_warps") == num_warps
    assert call.pop("num_stages") == num_stages
    # Triton's options: every kernel's (FP fusion asked for), and those `constants` names (a register cap).
    constants = dict(constants)
    assert call.pop("backend_options") == {**gpu.COMPILE_OPTIONS, **constants.pop("backend_options", {})}
    # The compile-time constants, and nothing else: no zeroed_outputs either (the portable kernels write
    # every element they own; zeroing would cost a memset per launch).
    assert call == constants


# Distinct warps and stages per kernel, and blocks that give each sequence several slots.
GPU_BLOCKS = BlockSizes(fwd=KernelConfig(16, 32, num_warps=2, num_stages=3),
                        dkdv=KernelConfig(32, 16, num_warps=8, num_stages=1),
                        dq=KernelConfig(32, 16, num_warps=8, num_stages=1), preprocess_block_m=16)


@pytest.mark.parametrize("allow_tf32,precision", [(True, "tf32"), (False, "ieee")])
def test_gpu_launcher_arguments_gqa_cross_causal(fake_jax_triton, allow_tf32, precision):
    """q [24, 4, 8] THD, k, v [30, 2, 8] (GQA group 2), 2 sequences, max_seq_len 20, kv_max_seq_len 24."""
    f32, i32 = jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    q = jnp.ones((24, 4, 8), jnp.float32)
    kv = jnp.ones((30, 2, 8), jnp.float32)
    op = lambda q, k, v: jfa.jagged_attention(
        q, k, v, jnp.asarray([0, 5, 24], jnp.int32), 20, kv_offsets=jnp.asarray([0, 9, 30], jnp.int32),
        kv_max_seq_len=24, scale=0.5, causal=True, backend="triton", allow_tf32=allow_tf32,
        block_sizes=GPU_BLOCKS)
    o, vjp = jax.vjp(op, q, kv, kv)
    vjp(jnp.ones_like(o))
    forward, preprocess, backward = fake_jax_triton.calls
    common = dict(NUM_HEADS=4, KV_GROUP=2, D=8, BLOCK_D=16, Q_MAX_LEN=20, KV_MAX_LEN=24, CAUSAL=True,
                  WINDOW_LEFT=-1, WINDOW_RIGHT=-1, SOFTCAP=0.0, ALIBI=False,
                  QK_SCALE=0.5 * LOG2E, INPUT_PRECISION=precision, STRIDE_ALIGN=8,
                  FILL_BLOCK=calls.FILL_BLOCK)
    # Params: batch, q and kv tokens per segment, q token/head strides, kv token/head strides (in units
    # of STRIDE_ALIGN = 8 elements), offsets row strides (0: one shared row), then fill chunks.
    strides = (2, 24, 30, 4, 1, 2, 1, 0, 0)
    # The operands fit in L2, so the grid has two axes: (segment, sequence or zero fill, head) = 1 * 3 * 4,
    # and 3 slots: ceil(20 / 16) blocks and the tail-zeroing slot. Params end with the fill chunk,
    # ceil(tokens / slots), slots, and the D stride of a key-major v (none at D = 8).
    _check_call(fake_jax_triton, forward, kernels.attention_fwd_kernel, (12, 3),
                arrays=[((24, 4, 8), f32)] + [((30, 2, 8), f32)] * 2 + [((1, 3), i32)] * 2 + [((1,), f32)],
                params=(*strides, 8, 3, 0), out_shapes=(_sds((24, 4, 8), f32), _sds((1, 4, 24), f32)),
                constants=dict(common, OUT_SCALE=1.0, BLOCK_M=16, BLOCK_N=32, V_KEY_MAJOR=False,
                               KEY_MAJOR_ALIGN=16), num_warps=2, num_stages=3)
    _check_call(fake_jax_triton, preprocess, kernels.attention_bwd_preprocess_kernel, (2, 4),
                arrays=[((24, 4, 8), f32), ((24, 4, 8), f32)], params=(24, 4, 1),
                out_shapes=(_sds((1, 4, 24), f32),),
                constants=dict(NUM_HEADS=4, D=8, BLOCK_D=16, OUT_SCALE=1.0, BLOCK_M=16, STRIDE_ALIGN=8),
                num_warps=4, num_stages=2)
    # 6 slots: dq (even) and dk/dv (odd) programs for max(ceil(20 / 32), ceil(24 / 16)) = 2 blocks
    # each, and a tail slot of each. q and do come twice (no key-major copies at D = 8); params end
    # with the fill chunks, slots and the key-major copies' D stride (none).
    _check_call(fake_jax_triton, backward, kernels.attention_bwd_kernel, (12, 6),
                arrays=[((24, 4, 8), f32), ((30, 2, 8), f32), ((30, 2, 8), f32), ((24, 4, 8), f32),
                        ((1, 4, 24), f32), ((1, 4, 24), f32), ((1, 3), i32), ((1, 3), i32),
                        ((24, 4, 8), f32), ((24, 4, 8), f32), ((1,), f32)],
                params=(*strides, 8, 10, 6, 0),
                out_shapes=(_sds((24, 4, 8), f32), _sds((30, 2, 8), f32), _sds((30, 2, 8), f32)),
                constants=dict(common, OUT_SCALE=1.0, DS_SCALE=0.5, DKDV_BLOCK_M=32, DKDV_BLOCK_N=16,
                               DQ_BLOCK_M=32, DQ_BLOCK_N=16, QDO_KEY_MAJOR=False, KEY_MAJOR_ALIGN=16,
                               DQ_PROGRAMS=True, DKDV_PROGRAMS=True),
                num_warps=8, num_stages=1)


def test_gpu_launcher_two_backward_launches(fake_jax_triton):
    """dq tiles with their own warps and stages: dq and dk/dv programs run in a launch each, each with
    its own slots, fill chunks, warps and stages (the problem of the test above)."""
    f32, i32 = jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    q = jnp.ones((24, 4, 8), jnp.float32)
    kv = jnp.ones((30, 2, 8), jnp.float32)
    tiles = dataclasses.replace(GPU_BLOCKS, dq=KernelConfig(32, 16, num_warps=4, num_stages=3))
    op = lambda q, k, v: jfa.jagged_attention(
        q, k, v, jnp.asarray([0, 5, 24], jnp.int32), 20, kv_offsets=jnp.asarray([0, 9, 30], jnp.int32),
        kv_max_seq_len=24, scale=0.5, causal=True, backend="triton", block_sizes=tiles)
    o, vjp = jax.vjp(op, q, kv, kv)
    vjp(jnp.ones_like(o))
    _, _, dq_call, dkdv_call = fake_jax_triton.calls
    constants = dict(NUM_HEADS=4, KV_GROUP=2, D=8, BLOCK_D=16, Q_MAX_LEN=20, KV_MAX_LEN=24, CAUSAL=True,
                     WINDOW_LEFT=-1, WINDOW_RIGHT=-1, SOFTCAP=0.0, ALIBI=False,
                  QK_SCALE=0.5 * LOG2E, INPUT_PRECISION="tf32", STRIDE_ALIGN=8, FILL_BLOCK=calls.FILL_BLOCK,
                     OUT_SCALE=1.0, DS_SCALE=0.5, DKDV_BLOCK_M=32, DKDV_BLOCK_N=16, DQ_BLOCK_M=32,
                     DQ_BLOCK_N=16, QDO_KEY_MAJOR=False, KEY_MAJOR_ALIGN=16)
    strides = (2, 24, 30, 4, 1, 2, 1, 0, 0)
    arrays = [((24, 4, 8), f32), ((30, 2, 8), f32), ((30, 2, 8), f32), ((24, 4, 8), f32),
              ((1, 4, 24), f32), ((1, 4, 24), f32), ((1, 3), i32), ((1, 3), i32), ((24, 4, 8), f32),
              ((24, 4, 8), f32), ((1,), f32)]
    # dq: ceil(20 / 32) = 1 block and the tail slot; fill chunks ceil(tokens / 2); dk and dv are
    # one-element placeholders.
    _check_call(fake_jax_triton, dq_call, kernels.attention_bwd_kernel, (12, 2), arrays=arrays,
                params=(*strides, 12, 15, 2, 0),
                out_shapes=(_sds((24, 4, 8), f32), _sds((1,), f32), _sds((1,), f32)),
                constants=dict(constants, DQ_PROGRAMS=True, DKDV_PROGRAMS=False), num_warps=4, num_stages=3)
    # dk/dv: ceil(24 / 16) = 2 blocks and the tail slot; fill chunks ceil(tokens / 3).
    _check_call(fake_jax_triton, dkdv_call, kernels.attention_bwd_kernel, (12, 3), arrays=arrays,
                params=(*strides, 8, 10, 3, 0), out_shapes=(_sds((1,), f32),) + (_sds((30, 2, 8), f32),) * 2,
                constants=dict(constants, DQ_PROGRAMS=False, DKDV_PROGRAMS=True), num_warps=8, num_stages=1)


def test_gpu_launcher_arguments_fbgemm_htd_bfloat16(fake_jax_triton):
    """FBGEMM's op, [H=2, T=40, D=24] bfloat16: no scale, output / max_seq_len, float32 statistics."""
    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    x = jnp.ones((2, 40, 24), jnp.bfloat16)
    offsets = jnp.asarray([0, 10, 10, 33], jnp.int32)
    op = lambda q, k, v: jfa.multi_head_jagged_flash_attention(q, k, v, offsets, 32, block_sizes=GPU_BLOCKS,
                                                                backend="triton")
    o, vjp = jax.vjp(op, x, x, x)
    vjp(jnp.ones_like(o))
    forward, preprocess, backward = fake_jax_triton.calls
    common = dict(NUM_HEADS=2, KV_GROUP=1, D=24, BLOCK_D=32, Q_MAX_LEN=32, KV_MAX_LEN=32, CAUSAL=False,
                  WINDOW_LEFT=-1, WINDOW_RIGHT=-1, SOFTCAP=0.0, ALIBI=False,
                  QK_SCALE=LOG2E, INPUT_PRECISION="tf32", STRIDE_ALIGN=8, FILL_BLOCK=calls.FILL_BLOCK)
    # HTD: token stride D, head stride T * D, in units of 8 elements.
    strides = (3, 40, 40, 3, 120, 3, 120, 0, 0)
    arrays = [((2, 40, 24), bf16)] * 3 + [((1, 4), i32)] * 2 + [((1,), f32)]
    _check_call(fake_jax_triton, forward, kernels.attention_fwd_kernel, (8, 3), arrays=arrays,
                params=(*strides, 14, 3, 0),
                out_shapes=(_sds((2, 40, 24), bf16), _sds((1, 2, 40), f32)),
                constants=dict(common, OUT_SCALE=1 / 32, BLOCK_M=16, BLOCK_N=32, V_KEY_MAJOR=False,
                               KEY_MAJOR_ALIGN=16), num_warps=2, num_stages=3)
    _check_call(fake_jax_triton, preprocess, kernels.attention_bwd_preprocess_kernel, (3, 2),
                arrays=[((2, 40, 24), bf16)] * 2, params=(40, 3, 120), out_shapes=(_sds((1, 2, 40), f32),),
                constants=dict(NUM_HEADS=2, D=24, BLOCK_D=32, OUT_SCALE=1 / 32, BLOCK_M=16, STRIDE_ALIGN=8),
                num_warps=4, num_stages=2)
    _check_call(fake_jax_triton, backward, kernels.attention_bwd_kernel, (8, 6),
                arrays=[((2, 40, 24), bf16)] * 4 + [((1, 2, 40), f32)] * 2 + [((1, 4), i32)] * 2
                + [((2, 40, 24), bf16)] * 2 + [((1,), f32)],
                params=(*strides, 14, 14, 6, 0), out_shapes=(_sds((2, 40, 24), bf16),) * 3,
                constants=dict(common, OUT_SCALE=1 / 32, DS_SCALE=1 / 32, DKDV_BLOCK_M=32, DKDV_BLOCK_N=16,
                               DQ_BLOCK_M=32, DQ_BLOCK_N=16, QDO_KEY_MAJOR=False, KEY_MAJOR_ALIGN=16,
                               DQ_PROGRAMS=True, DKDV_PROGRAMS=True),
                num_warps=8, num_stages=1)


@pytest.mark.parametrize("dtype,allow_tf32,head_dim,v_key_major,qdo_key_major", [
    (jnp.float32, True, 128, True, True), (jnp.float32, True, 64, True, False),
    (jnp.float32, False, 128, False, False), (jnp.bfloat16, True, 128, False, False)])
def test_gpu_launcher_key_major_operands(fake_jax_triton, dtype, allow_tf32, head_dim, v_key_major,
                                         qdo_key_major):
    """float32 with TF32: from D = 64, v [30, 2, D] THD goes through key_major_kernel to [2, D, 32] (30
    tokens padded to 32), which the forward takes with V_KEY_MAJOR and its D stride, 32 / 16 = 2; the
    backward keeps v as it is. At D = 128 the backward also takes q and do [24, 4, D] as [4, D, 32],
    besides themselves. Other inputs skip the transposes."""
    f32 = jnp.dtype(jnp.float32)
    q = jnp.ones((24, 4, head_dim), dtype)
    kv = jnp.ones((30, 2, head_dim), dtype)
    op = lambda q, k, v: jfa.jagged_attention(
        q, k, v, jnp.asarray([0, 5, 24], jnp.int32), 20, kv_offsets=jnp.asarray([0, 9, 30], jnp.int32),
        backend="triton", allow_tf32=allow_tf32, block_sizes=GPU_BLOCKS)
    o, vjp = jax.vjp(op, q, kv, kv)
    vjp(jnp.ones_like(o))
    kinds = [call["kernel"] for call in fake_jax_triton.calls]
    assert kinds == ([kernels.key_major_kernel] * v_key_major
                     + [kernels.attention_fwd_kernel, kernels.attention_bwd_preprocess_kernel]
                     + [kernels.key_major_kernel] * (2 * qdo_key_major) + [kernels.attention_bwd_kernel])
    forward = fake_jax_triton.calls[kinds.index(kernels.attention_fwd_kernel)]
    backward = fake_jax_triton.calls[-1]
    assert forward["V_KEY_MAJOR"] is v_key_major and backward["QDO_KEY_MAJOR"] is qdo_key_major
    assert [a.shape for a in backward["args"][:4]] == [(24, 4, head_dim), (30, 2, head_dim),
                                                      (30, 2, head_dim), (24, 4, head_dim)]
    transpose = dict(BLOCK_T=calls.KEY_MAJOR_BLOCK, STRIDE_ALIGN=16, KEY_MAJOR_ALIGN=16)
    # Params: tokens, token and head strides in units of 16 elements, padded tokens in units of 16.
    if v_key_major:
        _check_call(fake_jax_triton, fake_jax_triton.calls[0], kernels.key_major_kernel, (1, 2),
                    arrays=[((30, 2, head_dim), f32)], params=(30, head_dim // 8, head_dim // 16, 2),
                    out_shapes=(_sds((2, head_dim, 32), f32),),
                    constants=dict(transpose, D=head_dim, BLOCK_D=head_dim), num_warps=4, num_stages=2)
    assert forward["args"][2].shape == ((2, head_dim, 32) if v_key_major else (30, 2, head_dim))
    assert fake_jax_triton.params[id(forward["args"][-1])][-1] == 2 * v_key_major
    for call in fake_jax_triton.calls[-3:-1] if qdo_key_major else ():
        _check_call(fake_jax_triton, call, kernels.key_major_kernel, (1, 4),
                    arrays=[((24, 4, head_dim), f32)], params=(24, head_dim // 4, head_dim // 16, 2),
                    out_shapes=(_sds((4, head_dim, 32), f32),),
                    constants=dict(transpose, D=head_dim, BLOCK_D=head_dim), num_warps=4, num_stages=2)
    assert [a.shape for a in backward["args"][8:10]] == (
        [(4, head_dim, 32)] * 2 if qdo_key_major else [(24, 4, head_dim)] * 2)
    assert fake_jax_triton.params[id(backward["args"][-1])][-1] == 2 * qdo_key_major


def test_gpu_launcher_groups_programs_by_sequence_past_l2(fake_jax_triton):
    """Operands larger than the portable kernels' l2_reuse_bytes get a one-axis grid, each sequence's
    slots adjacent."""
    q = jnp.ones((24, 4, 8), jnp.float32)  # q, k, v: 3 * 24 * 4 * 8 * 4 bytes = 9216
    op = lambda q, limit: jfa.jagged_attention(  # noqa: E731
        q, q, q, jnp.asarray([0, 5, 24], jnp.int32), 20, block_sizes=GPU_BLOCKS,
        implementation=dataclasses.replace(implementations.PORTABLE, l2_reuse_bytes=limit))
    o, vjp = jax.vjp(lambda q: op(q, 9216 - 1), q)
    vjp(jnp.ones_like(o))
    grids = [call["grid"] for call in fake_jax_triton.calls]
    fake_jax_triton.reset()
    jax.vjp(lambda q: op(q, 9216), q)
    # forward: 3 sequences (with the fill) * 4 heads * 3 slots; backward: * 6 slots; the preprocess
    # keeps its own grid.
    assert grids == [(36,), (2, 4), (72,)] and fake_jax_triton.calls[-1]["grid"] == (12, 3)


def test_gpu_launcher_returns_what_triton_call_returns(fake_jax_triton):
    q = jnp.ones((6, 2, 8), jnp.float32)
    o = jfa.jagged_attention(q, q, q, [0, 6], 8, backend="triton")
    assert o.shape == q.shape and not bool(jnp.any(o))  # the fake's zeros
    assert select.default_backend() == "triton"


# ---------------------------------------------------------------------------------------------------
# Backend choice when jax-triton cannot run
# ---------------------------------------------------------------------------------------------------


class _FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import jax_triton` raise a given exception, as a broken install would."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "jax_triton" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


def _small_problem():
    """One problem for every test of the xla fallback, so that they share its compilations."""
    q, k, v, _ = Batch.make([3, 5], 2, 8, seed=4).arrays(jnp.float32)
    return q, k, v, jnp.asarray([0, 3, 8], jnp.int32)


BROKEN_IMPORTS = [ImportError("libcuda.so.1: cannot open shared object file"),
                  RuntimeError("jaxlib was built without CUDA support")]


@pytest.mark.parametrize("error", BROKEN_IMPORTS, ids=lambda e: type(e).__name__)
def test_auto_on_a_gpu_without_jax_triton_warns_once_and_runs_xla(fake_gpu, monkeypatch, error):
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(error), *sys.meta_path])
    q, k, v, offsets = _small_problem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so that only the package's own once-only logic can dedupe
        first = jfa.jagged_attention(q, k, v, offsets, 8)
        second = jfa.jagged_attention(q, k, v, offsets, 8)
    fallbacks = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert "'xla'" in message and f"{type(error).__name__}: " in message and str(error) in message
    expected = jfa.jagged_attention(q, k, v, offsets, 8, backend="xla")
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(second, expected)
    assert select.default_backend() == "xla"
    with pytest.raises(ValueError, match="backend='triton' cannot run: " + type(error).__name__) as raised:
        jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")
    assert str(error) in str(raised.value)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="JAX's default backend here is not the CPU")
def test_auto_on_the_cpu_runs_xla_without_a_warning():
    q, k, v, offsets = _small_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select.default_backend() == "xla"
        o = jfa.jagged_attention(q, k, v, offsets, 8)
    np.testing.assert_array_equal(o, jfa.jagged_attention(q, k, v, offsets, 8, backend="xla"))
    with pytest.raises(ValueError, match="backend='triton' needs a GPU"):
        jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")


@pytest.mark.parametrize("jax_triton_version,triton_version", [("0.3.1", "3.9.0"), ("0.5.0", "3.9.0"),
                                                              ("0.4.1", "3.5.0"), ("0.4.1", "3.10.1")])
def test_a_gpu_stack_outside_the_tested_versions_is_refused(fake_jax_triton, monkeypatch, jax_triton_version,
                                                          triton_version):
    monkeypatch.setattr(fake_jax_triton, "__version__", jax_triton_version)
    monkeypatch.setattr(triton, "__version__", triton_version)
    q, k, v, offsets = _small_problem()
    expected = (r"tested with jax-triton>=0\.4\.1,<0\.5 and triton>=3\.6,<3\.10; found "
                r".*(jax-triton 0\.[35]|triton 3\.(5|10)).*pip install 'jagged-flash-jax\[cuda13\]'")
    with pytest.raises(ValueError, match=expected):
        jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")
    assert fake_jax_triton.calls == []


# ---------------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1 (Triton's switch for debugging kernels): the kernels are interpreter functions
# ---------------------------------------------------------------------------------------------------


def interpret_under_triton_interpret() -> None:
    """In a process started with TRITON_INTERPRET=1: the interpret backend against the float64 reference."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(kernels.attention_fwd_kernel, InterpretedFunction)
    batch = Batch.make([4, 0, 9], 2, 8, kv_lengths=[6, 3, 5], kv_heads=1, seed=5)
    q, k, v, do = batch.arrays(jnp.float32)
    want = reference(batch.q, batch.k, batch.v, batch.do, batch.offsets, 8, kv_offsets=batch.kv_offsets,
                     scale=0.5, causal=True)
    op = lambda q, k, v: jfa.jagged_attention(q, k, v, batch.offsets, 8, kv_offsets=batch.kv_offsets,
                                              scale=0.5, causal=True, backend="interpret", allow_tf32=False)
    out, vjp = jax.vjp(op, q, k, v)
    for got, expected in zip((out, *vjp(do)), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    print("ok")


def test_the_interpret_backend_runs_under_triton_interpret():
    run, stdout, stderr = finish(spawn("t.interpret_under_triton_interpret()", {"TRITON_INTERPRET": "1"}))
    assert run.returncode == 0 and stdout.strip().endswith("ok"), stderr[-3000:]


def test_the_triton_backend_under_triton_interpret_says_so(fake_jax_triton, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(kernels, "attention_fwd_kernel", InterpretedFunction(kernels.attention_fwd_kernel.fn))
    q, k, v, offsets = _small_problem()
    with pytest.raises(ValueError, match="backend='triton' cannot run: .*TRITON_INTERPRET is set.*unset"):
        jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")
    with pytest.warns(RuntimeWarning, match="'xla'.*TRITON_INTERPRET is set"):
        assert select.default_backend() == "xla"
    assert fake_jax_triton.calls == []


# ---------------------------------------------------------------------------------------------------
# The Hopper forward: which problems take it, and its launch
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def hopper_gpu(fake_jax_triton, monkeypatch):
    """The fake jax_triton on a device of compute capability 9.0, the Hopper forward asked for wherever
    it can run (the short sequences below would take the portable one under "auto")."""
    monkeypatch.setenv(select.FORWARD_ENV, "hopper")
    with select.use_device(gpu_device((9, 0))):
        yield fake_jax_triton


def _forward_kernel(fake, *, dtype=jnp.bfloat16, dim=128, layout="THD", kv_heads=4, cross=False,
                    segments=False, fbgemm=False, max_seq_len=32, **options):
    """The attention kernel that the forward of one call launches (float32 may launch transposes
    first), on 40 query tokens of 4 heads."""
    fake.reset()
    tokens, kv_tokens = 40, 50 if cross else 40
    shape = lambda t, h: (t, h, dim) if layout == "THD" else (h, t, dim)  # noqa: E731
    q = jnp.ones(shape(tokens, 4), dtype)
    kv = jnp.ones(shape(kv_tokens, kv_heads), dtype)
    offsets = jnp.asarray([[0, 5, 20], [0, 10, 20]] if segments else [0, 15, 40], jnp.int32)
    if fbgemm:
        jfa.multi_head_jagged_flash_attention(q, kv, kv, offsets, max_seq_len, layout=layout,
                                              backend="triton")
    else:
        if cross:
            options.setdefault("kv_max_seq_len", 30)
            options.update(kv_offsets=jnp.asarray([0, 20, 50], jnp.int32))
        jfa.jagged_attention(q, kv, kv, offsets, max_seq_len, layout=layout, backend="triton", **options)
    return next(call["kernel"] for call in fake.calls if call["kernel"] is not kernels.key_major_kernel)


@pytest.mark.parametrize("case", [
    dict(), dict(layout="HTD"), dict(causal=True), dict(kv_heads=2), dict(kv_heads=1, layout="HTD"),
    dict(cross=True, causal=True, kv_heads=2), dict(dtype=jnp.float16, dim=256), dict(fbgemm=True),
    dict(fbgemm=True, layout="THD"), dict(return_lse=True), dict(window=(8, None)), dict(window=(None, 4)),
    dict(window=(8, None), causal=True), dict(softcap=5.0), dict(alibi_slopes=jnp.ones(4)),
    dict(cross=True, window=(3, 2), softcap=5.0, alibi_slopes=jnp.ones(4), kv_heads=2)], ids=str)
def test_hopper_gpus_take_the_hopper_forward(hopper_gpu, case):
    assert _forward_kernel(hopper_gpu, **case) is kernels.hopper_attention_fwd_kernel


# The portable forward: on a Hopper GPU under triton >= 3.7 its TMA-loading kernel where the problem
# allows (test_the_portable_forward_loads_by_tma_on_hopper_gpus_from_triton_3_7 says where).
PORTABLE_FORWARD = (kernels.attention_fwd_kernel, kernels.attention_fwd_tma_kernel)


@pytest.mark.parametrize("case", [
    dict(dim=64), dict(dim=96), dict(dtype=jnp.float32), dict(segments=True),
    dict(dim=64, window=(8, None), softcap=5.0)], ids=str)
def test_the_portable_forward_keeps_what_the_hopper_one_lacks(hopper_gpu, case):
    assert _forward_kernel(hopper_gpu, **case) in PORTABLE_FORWARD


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_the_portable_forward_loads_by_tma_on_hopper_gpus_from_triton_3_7(hopper_gpu, monkeypatch, layout):
    """On a Hopper GPU under triton >= 3.7 the portable forward of 16-bit inputs at D = 128 (where they
    measured faster: configs.PORTABLE_TMA_LOADS_HEAD_DIMS) loads its unmasked key blocks by TMA: k and v
    once more, as descriptors of [BLOCK_N, D] tiles over 2-D views whose rows are one token stride long.
    Not under 3.6, off Hopper, for float32, at D = 64 or D = 96; an implementation's tma_loads forces it
    either way where the problem allows (a power-of-two D among them)."""
    monkeypatch.setenv(select.FORWARD_ENV, "portable")
    tma, pointers = kernels.attention_fwd_tma_kernel, kernels.attention_fwd_kernel
    for release, case, kernel in (((3, 9, 0), dict(), tma), ((3, 7, 0), dict(dtype=jnp.float16), tma),
                                  ((3, 6, 0), dict(), pointers), ((3, 9, 0), dict(dim=64), pointers),
                                  ((3, 9, 0), dict(dtype=jnp.float32), pointers),
                                  ((3, 9, 0), dict(dim=96), pointers)):
        monkeypatch.setattr(_compat, "triton_release", lambda release=release: release)
        assert _forward_kernel(hopper_gpu, layout=layout, **case) is kernel, (release, case)
    with select.use_device(gpu_device((8, 0))):
        assert _forward_kernel(hopper_gpu, layout=layout) is pointers
    # The launch: k_tiles and v_tiles after q, k, v (40 tokens of 2 kv heads at D = 128).
    _forward_kernel(hopper_gpu, layout=layout, kv_heads=2)
    call = hopper_gpu.calls[-1]
    k_tiles, v_tiles = call["args"][3:5]
    view = (40, 2 * 128) if layout == "THD" else (2 * 40, 128)
    for tiles in (k_tiles, v_tiles):  # (Triton's layout: none given)
        assert tiles.block_shape == (call["BLOCK_N"], 128) and tiles.base.shape == view
        assert tiles.layout is None
    assert "BLOCK_D" not in call and "V_KEY_MAJOR" not in call
    # Forced: off under 3.9, on under 3.6 and at D = 64, never where the problem does not allow it.
    q = jnp.ones((40, 4, 64), jnp.bfloat16)
    for release, tma_loads, dtype, kernel in (((3, 9, 0), False, jnp.bfloat16, pointers),
                                              ((3, 6, 0), True, jnp.bfloat16, tma),
                                              ((3, 9, 0), True, jnp.bfloat16, tma),
                                              ((3, 6, 0), True, jnp.float32, pointers)):
        monkeypatch.setattr(_compat, "triton_release", lambda release=release: release)
        hopper_gpu.reset()
        jfa.jagged_attention(q.astype(dtype), q.astype(dtype), q.astype(dtype), jnp.asarray([0, 15, 40]), 32,
                             implementation=variant("triton", tma_loads=tma_loads))
        assert hopper_gpu.calls[-1]["kernel"] is kernel, (release, tma_loads, dtype)
    # No key tokens (cross-attention with every key sequence empty): no descriptor over an empty array.
    hopper_gpu.reset()
    empty = jnp.ones((0, 4, 64), jnp.bfloat16)
    out = jfa.jagged_attention(q, empty, empty, jnp.asarray([0, 15, 40]), 32,
                               kv_offsets=jnp.zeros(3, jnp.int32), kv_max_seq_len=8,
                               implementation=variant("triton", tma_loads=True))
    assert hopper_gpu.calls[-1]["kernel"] is pointers and out.shape == q.shape


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0), None])
def test_other_gpus_take_the_portable_forward(hopper_gpu, capability):
    with select.use_device(gpu_device(capability)):
        assert _forward_kernel(hopper_gpu) is kernels.attention_fwd_kernel


def test_the_environment_chooses_the_forward(hopper_gpu, monkeypatch):
    """"portable" always, "hopper" wherever it can run; "auto" (or unset) the Hopper forward from
    sequences of HOPPER_FORWARD_MIN_LENGTH tokens (the longer of max_seq_len and kv_max_seq_len) on,
    with max_seq_len at least HOPPER_FORWARD_MIN_QUERIES, but for a soft cap with causal masking."""
    portable, hopper = PORTABLE_FORWARD, (kernels.hopper_attention_fwd_kernel,)
    shortest = configs.HOPPER_FORWARD_MIN_LENGTH
    for value, max_seq_len, kernel in (("portable", 32, portable), (" Portable ", shortest, portable),
                                       ("hopper", 32, hopper), ("auto", shortest - 1, portable),
                                       ("auto", shortest, hopper), ("", 32, portable), ("", 4096, hopper)):
        monkeypatch.setenv(select.FORWARD_ENV, value)
        assert _forward_kernel(hopper_gpu, max_seq_len=max_seq_len) in kernel, (value, max_seq_len)
    monkeypatch.setenv(select.FORWARD_ENV, "auto")
    # Cross-attention with long keys: the Hopper forward from a query block's worth of queries per
    # sequence; with fewer the portable one (measured faster).
    queries = configs.HOPPER_FORWARD_MIN_QUERIES
    for max_seq_len, kernel in ((queries - 1, portable), (queries, hopper)):
        chosen = _forward_kernel(hopper_gpu, cross=True, kv_max_seq_len=shortest, max_seq_len=max_seq_len)
        assert chosen in kernel, max_seq_len
    # A soft cap with causal masking: the portable forward under "auto" (measured faster), else Hopper.
    assert _forward_kernel(hopper_gpu, max_seq_len=shortest, softcap=5.0) in hopper
    assert _forward_kernel(hopper_gpu, max_seq_len=shortest, softcap=5.0, causal=True) in portable
    monkeypatch.setenv(select.FORWARD_ENV, "hopper")
    assert _forward_kernel(hopper_gpu, max_seq_len=shortest, softcap=5.0, causal=True) in hopper
    monkeypatch.setenv(select.FORWARD_ENV, "hoper")
    with pytest.raises(ValueError, match=f"{select.FORWARD_ENV}='hoper'.*'portable', 'hopper'"):
        _forward_kernel(hopper_gpu)


def test_without_gluon_the_portable_forward_runs(hopper_gpu, monkeypatch):
    """A Triton without triton.experimental.gluon: the kernel module does not import, and the portable
    forward runs."""
    implementations.gluon_available.cache_clear()
    for name in [name for name in sys.modules if name.startswith("jagged_flash_jax.kernels.hopper")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(kernels, "hopper", raising=False)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)
    try:
        assert not implementations.gluon_available()
        assert _forward_kernel(hopper_gpu) in PORTABLE_FORWARD
    finally:
        implementations.gluon_available.cache_clear()


def test_vmap_keeps_the_hopper_forward_only_with_one_segment(hopper_gpu):
    """vmap folds its axis into the heads ("HTD", shared offsets: one segment, Hopper) or into segments
    of the token axis (batched offsets: portable), below the choice made for the unbatched problem."""
    q = jnp.ones((3, 4, 40, 128), jnp.bfloat16)
    offsets = jnp.asarray([0, 15, 40], jnp.int32)
    op = lambda q, o: jfa.jagged_attention(q, q, q, o, 32, layout="HTD", backend="triton")  # noqa: E731
    for offsets_axis, kernel in ((None, (kernels.hopper_attention_fwd_kernel,)), (0, PORTABLE_FORWARD)):
        hopper_gpu.reset()
        batched_offsets = offsets if offsets_axis is None else jnp.stack([offsets] * 3)
        jax.vmap(op, in_axes=(0, offsets_axis))(q, batched_offsets)
        # (custom_vmap traces the unbatched problem too, before its rule: the last launch is the rule's)
        assert hopper_gpu.calls[-1]["kernel"] in kernel


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_gpu_launcher_arguments_of_the_hopper_forward(hopper_gpu, layout):
    """q [40, 4, 128] bfloat16, k, v [50, 2, 128] (GQA), 2 sequences, max_seq_len 600, kv_max_seq_len 30,
    causal (the table's fwd_causal tiles, 64 keys in 3 stages, up to 1024 tokens): one launch of a
    persistent grid, one program per SM of the device (78 here), q, k, v as TMA
    descriptors over 2-D views one token stride wide, o and the log-sum-exp as outputs (no pre-filled
    input: the kernel zeroes what it does not compute) and the programs' int32 counter of query blocks,
    which alone the launch zeroes, 4 warps asked (the launch takes the compiled 12 from the PTX) and a
    register cap of 168."""
    from triton.experimental.gluon import language as gl

    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    q_shape, kv_shape = ((40, 4, 128), (50, 2, 128)) if layout == "THD" else ((4, 40, 128), (2, 50, 128))
    q, kv = jnp.ones(q_shape, bf16), jnp.ones(kv_shape, bf16)
    with select.use_device(gpu_device((9, 0), sms=78)):
        o = jfa.jagged_attention(q, kv, kv, jnp.asarray([0, 15, 40], jnp.int32), 600,
                                 kv_offsets=jnp.asarray([0, 20, 50], jnp.int32), kv_max_seq_len=30, scale=0.5,
                                 causal=True, layout=layout, backend="triton")
    assert o.shape == q_shape
    (call,) = hopper_gpu.calls
    call = dict(call)
    assert call.pop("kernel") is kernels.hopper_attention_fwd_kernel
    assert call.pop("grid") == (78,)
    args = call.pop("args")
    views = ((40, 512), (50, 256)) if layout == "THD" else ((160, 128), (100, 128))
    blocks = ((64, 128), (64, 128), (64, 128))
    for desc, view, block in zip(args[:3], (views[0], views[1], views[1]), blocks):
        assert isinstance(desc, hopper_gpu.TensorDescriptor)
        assert (desc.base.shape, desc.base.dtype, desc.block_shape) == (view, bf16, block)
        assert desc.layout == gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
    # The offsets, the one-element placeholders of the sequences' order (calls.sequence_order: the
    # offsets' order by default) and of the slopes (no ALiBi).
    assert [(a.shape, a.dtype) for a in args[3:-1]] == [((1, 3), i32)] * 2 + [((1,), i32), ((1,), f32)]
    # batch, q and kv tokens, q token/head strides, kv token/head strides (in units of 16 elements),
    # offsets row strides, then the query blocks per (sequence, head) and the tokens per zero-fill
    # program (40 tokens over 2 slots).
    strides = (32, 8, 16, 8) if layout == "THD" else (8, 320, 8, 400)
    assert hopper_gpu.params[id(args[-1])] == (2, 40, 50, *strides, 0, 0, 1, 20)
    assert tuple(call.pop("out_type")) == (_sds(q_shape, bf16), _sds((1, 4, 40), f32), _sds((1,), i32))
    options = (call.pop("num_warps"), call.pop("num_stages"), call.pop("backend_options"))
    assert options == (4, configs.HOPPER_FWD_TRITON_STAGES, dict(gpu.COMPILE_OPTIONS, maxnreg=168))
    assert call.pop("zeroed_outputs") == (2,)
    assert call == dict(NUM_HEADS=4, KV_GROUP=2, D=128, Q_MAX_LEN=600, KV_MAX_LEN=30, CAUSAL=True,
                        WINDOW_LEFT=-1, WINDOW_RIGHT=-1, SOFTCAP=0.0, ALIBI=False,
                        QK_SCALE=0.5 * LOG2E, STRIDE_ALIGN=16, FILL_BLOCK=calls.FILL_BLOCK, OUT_SCALE=1.0,
                        BLOCK_M=128, BLOCK_N=64, STAGES=3, CONSUMER_REGS=configs.HOPPER_CONSUMER_REGS,
                        PRODUCER_REGS=configs.HOPPER_PRODUCER_REGS, ORDERED=False)


@pytest.mark.parametrize("max_seq_len", [512, 1024, 1025])
def test_causal_forwards_take_the_hopper_entry_fwd_causal(max_seq_len):
    """A Hopper entry's fwd_causal is the forward's tiles under causal (D = 128: 64-key tiles in 3
    stages from 513 to 1024 tokens), in fwd's place, the backward's unchanged; elsewhere, and without
    causal, fwd; the JSON form keeps it; the block_sizes argument refuses it."""
    causal = configs.hopper_block_sizes(128, jnp.bfloat16, max_seq_len, causal=True, gpu=H200)
    plain = configs.hopper_block_sizes(128, jnp.bfloat16, max_seq_len, gpu=H200)
    key = configs.table_key(128, jnp.bfloat16, max_seq_len, gpu=H200, kernels="hopper")
    entry = configs.BUILTIN_TABLE[key]
    assert plain == entry and (causal.dkdv, causal.dq) == (entry.dkdv, entry.dq)
    assert causal.fwd == (entry.fwd_causal or entry.fwd) and causal.fwd_causal is None
    assert (causal.fwd.block_n, causal.fwd.num_stages) == ((64, 3) if max_seq_len == 1024 else
                                                          (plain.fwd.block_n, plain.fwd.num_stages))
    assert configs.entry_from_json(configs.entry_to_json(key, entry)) == (key, entry)
    q = jnp.ones((8, 1, 16), jnp.float32)
    tiles = dataclasses.replace(configs.INTERPRET_BLOCK_SIZES, fwd_causal=configs.KernelConfig(16, 16))
    with pytest.raises(TypeError, match="block_sizes.fwd_causal"):
        jfa.jagged_attention(q, q, q, jnp.asarray([0, 8], jnp.int32), 8, causal=True, block_sizes=tiles,
                             backend="interpret")


def test_the_hopper_launch_passes_the_options(hopper_gpu):
    """A window, a soft cap and ALiBi reach the Hopper forward as the portable one gets them: the
    window's bounds, the cap in units of the unscaled scores, and the slopes [1, H] (divided by the
    scale: calls._slopes), float32, before the params."""
    q = jnp.ones((40, 4, 128), jnp.bfloat16)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 1.0], jnp.float32)
    jfa.jagged_attention(q, q, q, jnp.asarray([0, 15, 40], jnp.int32), 32, scale=0.5, window=(8, 2),
                         softcap=5.0, alibi_slopes=slopes, backend="triton")
    (call,) = hopper_gpu.calls
    assert call["kernel"] is kernels.hopper_attention_fwd_kernel
    assert (call["WINDOW_LEFT"], call["WINDOW_RIGHT"], call["SOFTCAP"], call["ALIBI"]) == (8, 2, 10.0, True)
    slopes = call["args"][spec.HOPPER_FWD.index("slopes")]
    assert (slopes.shape, slopes.dtype) == ((1, 4), jnp.float32)  # traced here


def _step_launches(fake, tokens: int, max_seq_len: int, **options) -> list[dict]:
    """The launches of one gradient of jagged_attention (q = k = v: `tokens` tokens of 4 heads, D = 128,
    bfloat16, two sequences, offsets [0, 15, tokens]) on the triton backend, recorded afresh."""
    q = jnp.ones((tokens, 4, 128), jnp.bfloat16)
    fake.reset()
    jax.grad(lambda q: jnp.sum(jfa.jagged_attention(
        q, q, q, jnp.asarray([0, 15, tokens], jnp.int32), max_seq_len, backend="triton",
        **options).astype(jnp.float32)))(q)
    return fake.calls


@pytest.mark.parametrize("window,causal,max_seq_len,narrow", [
    ((8, 2), False, 1024, True), ((500, 12), False, 1024, True), ((500, 13), False, 1024, False),
    ((512, None), True, 1024, True), ((8, None), False, 1024, False), ((None, 8), True, 1024, False),
    ((None, None), True, 1024, False), ((None, None), False, 512, True), ((None, None), False, 513, False)])
def test_narrow_bands_take_the_hopper_kernels_narrow_tiles(hopper_gpu, monkeypatch, window, causal,
                                                           max_seq_len, narrow):
    """At D = 128 a band of at most 512 keys (left + right, right 0 under causal; a side without a
    bound is no narrow band, nor is causal alone), or sequences as short, take the table's 64-key tiles
    in the forward and dq (dk/dv's are the same in both entries); the rest 128-key tiles, but the
    forward under causal up to 1024 tokens (the entry's fwd_causal: 64-key tiles in 3 stages)."""
    monkeypatch.setenv(select.BACKWARD_ENV, "hopper")
    forward, *_, dkdv, dq = _step_launches(hopper_gpu, 1040, max_seq_len, window=window, causal=causal)
    assert (forward["kernel"], dq["kernel"]) == (kernels.hopper_attention_fwd_kernel,
                                                 kernels.hopper_attention_bwd_dq_kernel)
    want = configs.BUILTIN_TABLE[(configs.FALLBACK_GPU, "hopper", 16, 128, 512 if narrow else None)]
    assert want.fwd.block_n == want.dq.block_n == (64 if narrow else 128)
    fwd = want.fwd
    if causal and not narrow:
        fwd = configs.BUILTIN_TABLE[(configs.FALLBACK_GPU, "hopper", 16, 128, 1024)].fwd_causal
        assert (fwd.block_n, fwd.num_stages) == (64, 3)
    for call, tiles in ((forward, fwd), (dq, want.dq)):
        assert (call["BLOCK_M"], call["BLOCK_N"], call["STAGES"]) == (tiles.block_m, tiles.block_n,
                                                                      tiles.num_stages)
        assert tuple(call["args"][2].block_shape) == (tiles.block_n, 128)  # v's TMA tile
    assert (dkdv["BLOCK_M"], dkdv["BLOCK_N"]) == (want.dkdv.block_m, want.dkdv.block_n)


def test_the_hopper_tiles_come_from_the_table(hopper_gpu, tmp_path, monkeypatch):
    """The table's "hopper" entries, of exactly the problem's head dimension (the Hopper kernels do not
    pad): an override file replaces them as it does the portable ones; a kernel whose tiles are None,
    or a head dimension with no entry, runs the portable kernel."""
    monkeypatch.setenv(select.BACKWARD_ENV, "hopper")
    table, hopper = configs.BUILTIN_TABLE, (H200, "hopper", 16, 128)
    assert configs.hopper_block_sizes(128, jnp.bfloat16, 4096) == table[(*hopper, None)]
    assert configs.hopper_block_sizes(128, jnp.float16, 4096, band=300) == table[(*hopper, 512)]
    for head_dim, dtype in ((96, jnp.bfloat16), (32, jnp.bfloat16), (128, jnp.float32), (512, jnp.float16)):
        assert configs.hopper_block_sizes(head_dim, dtype, 4096) is None, (head_dim, dtype)
    # D = 256: dk/dv on blocks of 64 keys (the two warpgroups split the columns), dq on key tiles of 32.
    d256 = configs.hopper_block_sizes(256, jnp.bfloat16, 4096)
    assert (d256.dkdv.block_m, d256.dkdv.block_n, d256.dq.block_m, d256.dq.block_n) == (64, 64, 128, 32)
    entry = dict(gpu=H200, kernels="hopper", bits=16, head_dim=128, max_seq_len=1024,
                 fwd=[128, 32, 4, 3, 160], dkdv=None, dq=[128, 32, 4, 4, 160])
    monkeypatch.setenv(select.TUNED_CONFIGS_ENV, _override(tmp_path, entry))
    forward, *_, backward = _step_launches(hopper_gpu, 1040, 1024)
    assert forward["kernel"] is kernels.hopper_attention_fwd_kernel
    assert (forward["BLOCK_N"], forward["STAGES"], forward["backend_options"]) == (
        32, 3, dict(gpu.COMPILE_OPTIONS, maxnreg=160))
    # dk/dv has no tiles in the entry: the whole backward stays portable (one kernel family per pass).
    assert backward["kernel"] is kernels.attention_bwd_kernel


@pytest.mark.parametrize("head_dim,dtype,override,want", [
    (128, jnp.bfloat16, False, None),
    (128, jnp.float32, False, "float32 inputs (the Hopper kernels take 16-bit inputs only)"),
    (64, jnp.float16, False, "head dimension 64 (the tile table has Hopper fwd tiles at head dimensions "
                             "[128, 256])"),
    (64, jnp.float16, True, None),
    (32, jnp.bfloat16, True, "head dimension 32 (the tile table has Hopper fwd tiles at head dimensions "
                             "[64, 128, 256])")])
def test_why_the_forward_is_portable_comes_from_the_active_table(hopper_gpu, tmp_path, monkeypatch,
                                                                 head_dim, dtype, override, want):
    """The Hopper forward runs where the problem's tiles, from the table an override file may extend,
    have a forward (the built-in table has none at D = 64); the reason otherwise names the inputs' type,
    or the head dimensions of that table."""
    if override:
        monkeypatch.setenv(select.TUNED_CONFIGS_ENV, _override(tmp_path, dict(
            gpu=H200, kernels="hopper", bits=16, head_dim=64, max_seq_len=None, fwd=[128, 64, 4, 2, 168],
            dkdv=[64, 128, 4, 2, 168], dq=[128, 128, 4, 3, 168])))
    q = jnp.ones((2000, 2, head_dim), dtype)
    offsets = jnp.asarray([0, 2000], jnp.int32)
    p = checks.attention_problem(q, q, q, offsets, offsets, max_seq_len=2000, kv_max_seq_len=2000,
                                 scale=0.1, out_scale=1.0, causal=False, layout="THD", allow_tf32=True,
                                 self_attention=True, validate=False)
    assert select.why(p, "hopper") == want
    plan = select.choose(p, select.request("triton"))
    assert plan.forward.name == ("hopper" if want is None else "portable")


def _recorder():
    """([(KernelCall, arrays)], a plan Runner that records each call there and returns zeros of its
    outputs)."""
    calls = []

    def run(call, arrays):
        calls.append((call, arrays))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in call.out_shapes)

    return calls, run


def _hopper_problem(batch: int, **fields) -> Problem:
    """A Problem of one segment of "THD" tokens."""
    return Problem(batch=batch, layout="THD", num_segments=1, q_offsets_rows=1, kv_offsets_rows=1, scale=0.1,
                   out_scale=0.5, input_precision="tf32", **fields)


def test_the_hopper_launch_zeroes_its_own_outputs():
    """The plan's Hopper launch, recorded: o and the log-sum-exp are the kernel's outputs, no input
    (the kernel writes 0 and +inf where it computes nothing), and the counter it takes query blocks
    from the one zeroed output; its grid is the problem's persistent programs, a batch of no sequence
    included, whose programs still zero every token (the fills' chunks: the blocks' count plus one)."""
    recorded, run = _recorder()
    q = jnp.ones((300, 4, 256), jnp.float16)
    fields = dict(num_heads=4, num_kv_heads=4, head_dim=256, q_tokens=300, kv_tokens=300, max_seq_len=260,
                  kv_max_seq_len=300, causal=False, dtype="float16")
    config = HopperConfig(configs.hopper_block_sizes(256, jnp.float16, 260, 300), programs=7,
                          preprocess_block_m=64, longest_first=True)
    offsets = jnp.asarray([[0, 40, 300]], jnp.int32)
    for batch in (2, 0):
        recorded.clear()
        p = _hopper_problem(batch, **fields)
        o, lse = calls.hopper_forward(run, p, config, q, q, q, offsets[:, :batch + 1], offsets[:, :batch + 1])
        (call, arrays), = recorded
        assert call.grid == (7,) and call.zeroed_outputs == (2,) and call.out_shapes[2].shape == (1,)
        assert dict(call.descriptors) == {0: (64, 256), 1: (64, 256), 2: (64, 256)}
        assert call.constants["OUT_SCALE"] == 0.5 and call.constants["BLOCK_N"] == 64
        assert call.params[spec.HOPPER_FWD.slot("blocks")] == 3
        assert call.params[spec.HOPPER_FWD.slot("fill_chunk")] == 75
        assert [a.shape for a in arrays[3:]] == [(1, batch + 1), (1, batch + 1), (max(batch, 1),), (1,),
                                                 (len(call.params),)]
        # The sequences' order (longest_first: ORDERED): the second (260 tokens attended) before the
        # first (40); a placeholder without sequences.
        assert call.constants["ORDERED"] is True
        np.testing.assert_array_equal(arrays[spec.HOPPER_FWD.index("order")], [1, 0] if batch else [0])
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (1, 4, 300), jnp.float32)


def test_the_hopper_backward_launches_zero_their_own_outputs():
    """The plan's Hopper backward, recorded: dk, dv and dq are the kernels' outputs, and the counter
    each launch takes its blocks from the one zeroed output; both grids are the problem's persistent
    programs, a batch of no sequence included, whose programs still zero every token (the fills'
    chunks: the blocks' count plus one, of the keys for dk/dv, of the queries for dq)."""
    recorded, run = _recorder()
    q, kv = jnp.ones((300, 4, 128), jnp.bfloat16), jnp.ones((200, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 4, 300), jnp.float32)
    fields = dict(num_heads=4, num_kv_heads=2, head_dim=128, q_tokens=300, kv_tokens=200, max_seq_len=260,
                  kv_max_seq_len=150, causal=True, dtype="bfloat16")
    config = HopperConfig(configs.hopper_block_sizes(128, jnp.bfloat16, 260, 150), programs=7,
                          preprocess_block_m=64)
    q_offsets, kv_offsets = jnp.asarray([[0, 40, 300]], jnp.int32), jnp.asarray([[0, 90, 200]], jnp.int32)
    for batch in (2, 0):
        recorded.clear()
        p = _hopper_problem(batch, **fields)
        dq, dk, dv = calls.hopper_backward(run, p, config, q, kv, kv, q_offsets[:, :batch + 1],
                                           kv_offsets[:, :batch + 1], q, lse, q)
        _, (dkdv_call, _), (dq_call, _) = recorded
        for call, kernel, shape, tokens, blocks, zeroed in (
                (dkdv_call, kernels.hopper_attention_bwd_dkdv_kernel, kv.shape, 200, 2, (2,)),
                (dq_call, kernels.hopper_attention_bwd_dq_kernel, q.shape, 300, 3, (1,))):
            assert call.kernel is kernel and call.grid == (7,) and call.zeroed_outputs == zeroed
            assert [s.shape for s in call.out_shapes] == [shape] * (len(call.out_shapes) - 1) + [(1,)]
            chunk = call.params[spec.HOPPER_BWD_DQ.slot("fill_chunk")]
            assert call.params[spec.HOPPER_BWD_DQ.slot("blocks")] == blocks
            assert chunk == -(-tokens // (blocks + 1))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)


# ---------------------------------------------------------------------------------------------------
# The Hopper backward: which problems take it, and its launches
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def hopper_backward_gpu(fake_jax_triton, monkeypatch):
    """The fake jax_triton on a device of compute capability 9.0, the Hopper backward asked for wherever
    it can run (the forward left to "auto": the portable one on these short sequences)."""
    monkeypatch.setenv(select.BACKWARD_ENV, "hopper")
    monkeypatch.delenv(select.FORWARD_ENV, raising=False)
    with select.use_device(gpu_device((9, 0))):
        yield fake_jax_triton


HOPPER_BACKWARD = ("hopper_attention_bwd_dkdv_kernel", "hopper_attention_bwd_dq_kernel")
# The dq-fused dk/dv kernel, adding dq by atomics, or by TMA reduce-adds where Triton's Gluon has them.
FUSED_DQ = {False: "hopper_attention_bwd_dkdv_dq_kernel", True: "hopper_attention_bwd_dkdv_dq_tma_kernel"}
PORTABLE_BACKWARD = ("attention_bwd_kernel",)


def _backward_kernels(fake, *, dtype=jnp.bfloat16, dim=128, layout="THD", kv_heads=4, cross=False,
                      fbgemm=False, max_seq_len=32, **options) -> tuple[str, ...]:
    """The names of the attention kernels that the backward of one call launches (after the forward's
    and the preprocess), on 40 query tokens of 4 heads."""
    tokens, kv_tokens = 40, 50 if cross else 40
    shape = lambda t, h: (t, h, dim) if layout == "THD" else (h, t, dim)  # noqa: E731
    q = jnp.ones(shape(tokens, 4), dtype)
    kv = jnp.ones(shape(kv_tokens, kv_heads), dtype)
    offsets = jnp.asarray([0, 15, 40], jnp.int32)
    if cross:
        options.setdefault("kv_max_seq_len", 30)
        options.update(kv_offsets=jnp.asarray([0, 20, 50], jnp.int32))

    def loss(q, k, v):
        if fbgemm:
            o = jfa.multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, layout=layout,
                                                      backend="triton", **options)
        else:
            o = jfa.jagged_attention(q, k, v, offsets, max_seq_len, layout=layout, backend="triton",
                                     **options)
        o = o[0] if isinstance(o, tuple) else o
        return jnp.sum(o.astype(jnp.float32))

    fake.reset()
    jax.grad(loss, argnums=(0, 1, 2))(q, kv, kv)
    names = {getattr(kernels, name): name
             for name in (*HOPPER_BACKWARD, *PORTABLE_BACKWARD, *FUSED_DQ.values())}
    # (the portable backward launches once or twice: dq and dk/dv apart when their tiles differ)
    return tuple(dict.fromkeys(names[call["kernel"]] for call in fake.calls if call["kernel"] in names))


@pytest.mark.parametrize("case", [
    dict(), dict(layout="HTD"), dict(causal=True), dict(kv_heads=2), dict(kv_heads=1, layout="HTD"),
    dict(cross=True, causal=True, kv_heads=2), dict(cross=True, kv_max_seq_len=8), dict(dim=64),
    dict(dtype=jnp.float16, causal=True), dict(fbgemm=True), dict(return_lse=True), dict(window=(8, None)),
    dict(window=(None, 3), layout="HTD"), dict(softcap=5.0), dict(softcap=5.0, causal=True),
    dict(alibi_slopes=jnp.ones(4), kv_heads=2),
    dict(causal=True, window=(8, None), softcap=5.0, alibi_slopes=jnp.ones(4), dim=64)], ids=str)
def test_hopper_gpus_take_the_hopper_backward(hopper_backward_gpu, case):
    """Windows, soft caps (causal too, which the forward leaves portable under "auto") and ALiBi
    included."""
    assert _backward_kernels(hopper_backward_gpu, **case) == HOPPER_BACKWARD


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("case", [dict(), dict(causal=True, layout="HTD"), dict(dim=64, window=(8, None)),
                                  dict(fbgemm=True)], ids=str)
def test_hopper_fused_dq_is_the_dq_fused_dkdv_kernel_alone(hopper_backward_gpu, monkeypatch, case, tma):
    """backward_implementation="hopper-fused-dq": the dq-fused dk/dv kernel alone, the one adding dq by
    TMA reduce-adds where Triton's Gluon has them (`_compat.gluon_tma_reduce`), else by atomics; auto
    keeps the two kernels (every element written once)."""
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: tma)
    assert _backward_kernels(hopper_backward_gpu, **case) == HOPPER_BACKWARD
    assert (_backward_kernels(hopper_backward_gpu, backward_implementation="hopper-fused-dq", **case)
            == (FUSED_DQ[tma],))


@pytest.mark.parametrize("case", [dict(dim=32), dict(dtype=jnp.float32), dict(dim=120), dict(dim=96)],
                         ids=str)
def test_the_portable_backward_keeps_what_the_hopper_one_lacks(hopper_backward_gpu, case):
    """Head dimensions the table has no Hopper tiles for, float32."""
    assert _backward_kernels(hopper_backward_gpu, **case) == PORTABLE_BACKWARD


@pytest.mark.parametrize("layout", ["THD", "HTD"])
@pytest.mark.parametrize("options", [{}, dict(window=(8, 2), causal=True)], ids=str)
def test_the_hopper_backward_at_d256_splits_the_columns(hopper_backward_gpu, layout, options):
    """D = 256 takes both Hopper kernels: dk/dv on blocks of 64 keys (BLOCK_N 64, which makes its two
    warpgroups split dK's and dV's columns: 64 x 256 in float32 of each would need 256 registers per
    consumer thread) and query tiles of 64; dq on 128 queries by key tiles of 32. The dq-fused option
    is refused there (dq is fused into blocks of 128 keys)."""
    assert _backward_kernels(hopper_backward_gpu, dim=256, layout=layout, **options) == HOPPER_BACKWARD
    *_, dkdv, dq = hopper_backward_gpu.calls
    assert (dkdv["BLOCK_M"], dkdv["BLOCK_N"], dkdv["STAGES"]) == (64, 64, 2)
    assert (dq["BLOCK_M"], dq["BLOCK_N"]) == (128, 32)
    with pytest.raises(ValueError, match="dq is fused into blocks of 128 keys"):
        _backward_kernels(hopper_backward_gpu, dim=256, layout=layout,
                          backward_implementation="hopper-fused-dq", **options)


def test_no_key_tokens_keep_both_kernels_portable(hopper_backward_gpu, monkeypatch):
    """A key array of no tokens (every key sequence empty): no TMA descriptor over an empty array, so
    the portable forward and backward run even when the Hopper ones are asked for; o and every
    gradient are 0."""
    monkeypatch.setenv(select.FORWARD_ENV, "hopper")
    q = jnp.ones((40, 4, 128), jnp.bfloat16)
    kv = jnp.ones((0, 4, 128), jnp.bfloat16)
    offsets, kv_offsets = jnp.asarray([0, 15, 40], jnp.int32), jnp.zeros(3, jnp.int32)

    def loss(q, k, v):
        o = jfa.jagged_attention(q, k, v, offsets, 2048, kv_offsets=kv_offsets, backend="triton")
        return jnp.sum(o.astype(jnp.float32))

    hopper_backward_gpu.reset()
    jax.grad(loss, argnums=(0, 1, 2))(q, kv, kv)
    launched = {call["kernel"] for call in hopper_backward_gpu.calls}
    hopper = {getattr(kernels, name) for name in ("hopper_attention_fwd_kernel", *HOPPER_BACKWARD)}
    assert launched and not launched & hopper


@pytest.mark.parametrize("capability", [(8, 0), (10, 0), None])
def test_other_gpus_take_the_portable_backward(hopper_backward_gpu, capability):
    with select.use_device(gpu_device(capability)):
        assert _backward_kernels(hopper_backward_gpu) == PORTABLE_BACKWARD


def test_the_environment_chooses_the_backward(hopper_backward_gpu, monkeypatch):
    """"portable" always, "hopper" wherever it can run; "auto" (or unset) the Hopper backward from
    HOPPER_BACKWARD_MIN_LENGTH tokens (of the longer of max_seq_len and kv_max_seq_len) at the head
    dimensions of HOPPER_BACKWARD_AUTO_HEAD_DIMS; each kernel's variable chooses its own."""
    shortest = configs.HOPPER_BACKWARD_MIN_LENGTH
    hopper, portable = HOPPER_BACKWARD, PORTABLE_BACKWARD
    for value, max_seq_len, want in (("portable", 4096, portable), ("hopper", 32, hopper),
                                     ("auto", shortest - 1, portable), ("auto", shortest, hopper),
                                     ("", 32, portable), ("", 4096, hopper)):
        monkeypatch.setenv(select.BACKWARD_ENV, value)
        assert _backward_kernels(hopper_backward_gpu, max_seq_len=max_seq_len) == want, (value, max_seq_len)
    monkeypatch.setenv(select.BACKWARD_ENV, "auto")
    assert _backward_kernels(hopper_backward_gpu, cross=True, kv_max_seq_len=shortest) == HOPPER_BACKWARD
    # D = 64 and 256 take the Hopper one too, under any Triton.
    for release in ((3, 6, 0), (3, 9, 0)):
        monkeypatch.setattr(_compat, "triton_release", lambda release=release: release)
        assert _backward_kernels(hopper_backward_gpu, dim=64, max_seq_len=4096) == hopper, release
    assert _backward_kernels(hopper_backward_gpu, dim=64, max_seq_len=shortest - 1) == portable
    assert _backward_kernels(hopper_backward_gpu, dim=256, max_seq_len=4096) == hopper
    assert _backward_kernels(hopper_backward_gpu, dim=256, max_seq_len=shortest - 1) == portable
    # The options too, a causal soft cap included (the forward's rule against it is the forward's).
    assert _backward_kernels(hopper_backward_gpu, max_seq_len=shortest, causal=True, softcap=5.0,
                             window=(8, None), alibi_slopes=jnp.ones(4)) == HOPPER_BACKWARD
    # The forward's variable does not choose the backward, nor the reverse.
    monkeypatch.setenv(select.BACKWARD_ENV, "portable")
    monkeypatch.setenv(select.FORWARD_ENV, "hopper")
    assert _backward_kernels(hopper_backward_gpu) == PORTABLE_BACKWARD
    assert hopper_backward_gpu.calls[0]["kernel"] is kernels.hopper_attention_fwd_kernel
    monkeypatch.setenv(select.BACKWARD_ENV, "hoper")
    with pytest.raises(ValueError, match=f"{select.BACKWARD_ENV}='hoper'.*'portable', 'hopper'"):
        _backward_kernels(hopper_backward_gpu)


def test_deterministic_false_lets_auto_take_the_dq_fused_backward_where_faster(hopper_backward_gpu,
                                                                               monkeypatch):
    """deterministic=False: the TMA dq-fused kernel alone from FUSED_DQ_MIN_LENGTH's tokens for the head
    dimension (the longer of max_seq_len and kv_max_seq_len) at D = 128 and 64 where Triton's Gluon has
    the TMA reduce-add; the two Hopper kernels below that length, at D = 256 (no dq-fused tiles there),
    and where dq would be added by atomics (triton 3.6, slower); the portable backward where auto takes
    it; "hopper" in the environment the dq-fused kernel wherever it runs, "portable" none. The default
    never fuses."""
    longest, longest64 = configs.FUSED_DQ_MIN_LENGTH[128], configs.FUSED_DQ_MIN_LENGTH[64]
    assert longest64 < longest
    fused = (FUSED_DQ[True],)
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: True)
    monkeypatch.setenv(select.BACKWARD_ENV, "auto")
    run = functools.partial(_backward_kernels, hopper_backward_gpu, deterministic=False)
    assert run(max_seq_len=longest) == fused
    assert run(max_seq_len=longest, causal=True, layout="HTD") == fused
    assert run(max_seq_len=longest, fbgemm=True) == fused
    assert run(cross=True, max_seq_len=64, kv_max_seq_len=longest) == fused
    assert run(max_seq_len=longest - 1) == HOPPER_BACKWARD
    assert run(max_seq_len=longest64, dim=64) == fused
    assert run(max_seq_len=longest64, dim=64, causal=True) == fused
    assert run(max_seq_len=longest64) == HOPPER_BACKWARD
    assert run(max_seq_len=longest, dim=256) == HOPPER_BACKWARD
    assert run(max_seq_len=32) == PORTABLE_BACKWARD
    assert _backward_kernels(hopper_backward_gpu, max_seq_len=longest) == HOPPER_BACKWARD
    monkeypatch.setenv(select.BACKWARD_ENV, "hopper")
    assert run(max_seq_len=32) == fused
    monkeypatch.setenv(select.BACKWARD_ENV, "portable")
    assert run(max_seq_len=longest) == PORTABLE_BACKWARD
    monkeypatch.setenv(select.BACKWARD_ENV, "auto")
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: False)
    assert run(max_seq_len=longest) == HOPPER_BACKWARD
    assert run(max_seq_len=longest64, dim=64) == HOPPER_BACKWARD


def test_deterministic_is_a_static_bool_for_the_backends_choice_only():
    """deterministic=False with an implementation named raises, saying to name the backward instead; a
    value that is not a bool raises, naming it. On the CPU nothing changes."""
    q = jnp.ones((40, 2, 16), jnp.float32)
    offsets = jnp.asarray([0, 15, 40], jnp.int32)
    for named in (dict(implementation="xla"), dict(backward_implementation="portable")):
        with pytest.raises(ValueError, match="deterministic=False.*name the backward"):
            jfa.jagged_attention(q, q, q, offsets, 32, deterministic=False, **named)
    with pytest.raises(TypeError, match="deterministic"):
        jfa.multi_head_jagged_flash_attention(q, q, q, offsets, 32, layout="THD", deterministic="no")
    np.testing.assert_array_equal(jfa.jagged_attention(q, q, q, offsets, 32, deterministic=False),
                                  jfa.jagged_attention(q, q, q, offsets, 32))


def test_vmap_keeps_the_hopper_backward_only_with_one_segment(hopper_backward_gpu):
    """As the forward: shared offsets fold vmap's axis into the heads (one segment: Hopper), batched
    offsets into segments (portable)."""
    q = jnp.ones((3, 4, 40, 128), jnp.bfloat16)
    offsets = jnp.asarray([0, 15, 40], jnp.int32)
    op = lambda q, o: jnp.sum(jfa.jagged_attention(q, q, q, o, 32, layout="HTD",  # noqa: E731
                                                   backend="triton").astype(jnp.float32))
    for offsets_axis, kernel in ((None, kernels.hopper_attention_bwd_dq_kernel),
                                 (0, kernels.attention_bwd_kernel)):
        hopper_backward_gpu.reset()
        batched_offsets = offsets if offsets_axis is None else jnp.stack([offsets] * 3)
        jax.vmap(jax.grad(op), in_axes=(0, offsets_axis))(q, batched_offsets)
        assert hopper_backward_gpu.calls[-1]["kernel"] is kernel


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_gpu_launcher_arguments_of_the_hopper_backward(hopper_backward_gpu, layout):
    """q [40, 4, 128] bfloat16, k, v [50, 2, 128] (GQA), 2 sequences, max_seq_len 600, kv_max_seq_len 30,
    causal, FBGEMM-like out_scale: after the preprocess, a dk/dv launch and a dq launch, both on the
    persistent grid (HOPPER_SMS programs: the fake device does not say its SMs; one 128-key block of
    min(30, 50) tokens per (sequence, kv head), one 128-query block of min(600, 40) tokens per (sequence,
    head), the fills' chunks one more), q, do, k, v as TMA descriptors over 2-D views one token stride
    wide, the log-sum-exp and delta [1, H, 40], and the outputs as the kernels' own (no pre-filled input;
    each launch's counter of blocks the one zeroed)."""
    from triton.experimental.gluon import language as gl

    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    q_shape, kv_shape = ((40, 4, 128), (50, 2, 128)) if layout == "THD" else ((4, 40, 128), (2, 50, 128))
    q, kv = jnp.ones(q_shape, bf16), jnp.ones(kv_shape, bf16)
    hopper_backward_gpu.reset()
    jax.grad(lambda q, k, v: jnp.sum(jfa.jagged_attention(
        q, k, v, jnp.asarray([0, 15, 40], jnp.int32), 600, kv_offsets=jnp.asarray([0, 20, 50], jnp.int32),
        kv_max_seq_len=30, scale=0.5, causal=True, layout=layout, backend="triton").astype(jnp.float32)),
        argnums=(0, 1, 2))(q, kv, kv)
    *_, dkdv, dq = hopper_backward_gpu.calls
    views = ((40, 512), (50, 256)) if layout == "THD" else ((160, 128), (100, 128))
    strides = (32, 8, 16, 8) if layout == "THD" else (8, 320, 8, 400)
    for call, kernel, grid, blocks, params, outputs, zeroed in (
            (dkdv, kernels.hopper_attention_bwd_dkdv_kernel, configs.HOPPER_SMS, ((64, 128), (64, 128)),
             (1, 25), (_sds(kv_shape, bf16), _sds(kv_shape, bf16), _sds((1,), i32)), (2,)),
            (dq, kernels.hopper_attention_bwd_dq_kernel, configs.HOPPER_SMS, ((64, 128), (128, 128)), (1, 20),
             (_sds(q_shape, bf16), _sds((1,), i32)), (1,))):
        call = dict(call)
        assert call.pop("kernel") is kernel
        assert call.pop("grid") == (grid,)
        assert call.pop("zeroed_outputs") == zeroed
        args = call.pop("args")
        for desc, view, block in zip(args[:4], (views[0], views[0], views[1], views[1]),
                                     (blocks[0], blocks[0], blocks[1], blocks[1])):
            assert isinstance(desc, hopper_backward_gpu.TensorDescriptor)
            assert (desc.base.shape, desc.base.dtype, desc.block_shape) == (view, bf16, block)
            assert desc.layout == gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
        # The log-sum-exp and delta, the offsets, the one-element placeholders of the sequences' order
        # (the offsets' by default) and of the slopes (no ALiBi).
        assert [(a.shape, a.dtype) for a in args[4:-1]] == ([((1, 4, 40), f32)] * 2 + [((1, 3), i32)] * 2
                                                            + [((1,), i32), ((1,), f32)])
        assert hopper_backward_gpu.params[id(args[-1])] == (2, 40, 50, *strides, 0, 0, *params)
        assert tuple(call.pop("out_type")) == outputs
        options = (call.pop("num_warps"), call.pop("num_stages"), call.pop("backend_options"))
        stages = (configs.hopper_dkdv_triton_stages(True, _compat.triton_release())  # causal
                  if kernel is kernels.hopper_attention_bwd_dkdv_kernel else configs.HOPPER_BWD_TRITON_STAGES)
        assert options == (4, stages, dict(gpu.COMPILE_OPTIONS, maxnreg=168))
        if kernel is kernels.hopper_attention_bwd_dkdv_kernel:
            heads = dict(NUM_KV_HEADS=2, OUT_SCALE=1.0, BLOCK_M=64, BLOCK_N=128, STAGES=2)
        else:
            heads = dict(NUM_HEADS=4, BLOCK_M=128, BLOCK_N=128, STAGES=2)
        assert call == dict(KV_GROUP=2, D=128, Q_MAX_LEN=600, KV_MAX_LEN=30, CAUSAL=True, WINDOW_LEFT=-1,
                            WINDOW_RIGHT=-1, SOFTCAP=0.0, ALIBI=False, QK_SCALE=0.5 * LOG2E, STRIDE_ALIGN=16,
                            FILL_BLOCK=calls.FILL_BLOCK, DS_SCALE=0.5,
                            CONSUMER_REGS=configs.HOPPER_CONSUMER_REGS,
                            PRODUCER_REGS=configs.HOPPER_PRODUCER_REGS, ORDERED=False, **heads)


def test_the_hopper_backward_launches_pass_the_options(hopper_backward_gpu):
    """A window, a soft cap and ALiBi reach both Hopper backward kernels as the forward gets them: the
    window's bounds, the cap in units of the unscaled scores, and the slopes [1, H] (divided by the
    scale), float32, before the params."""
    slopes = jnp.asarray([0.5, 0.25, 0.125, 1.0], jnp.float32)
    *_, dkdv, dq = _step_launches(hopper_backward_gpu, 40, 32, scale=0.5, window=(8, 2), softcap=5.0,
                                  alibi_slopes=slopes)
    for call, kernel in ((dkdv, kernels.hopper_attention_bwd_dkdv_kernel),
                         (dq, kernels.hopper_attention_bwd_dq_kernel)):
        assert call["kernel"] is kernel
        options = (call["WINDOW_LEFT"], call["WINDOW_RIGHT"], call["SOFTCAP"], call["ALIBI"])
        assert options == (8, 2, 10.0, True)
        slopes = call["args"][spec.HOPPER_BWD_DQ.index("slopes")]
        assert (slopes.shape, slopes.dtype) == ((1, 4), jnp.float32)


def _fused_dq_shapes(layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """q's and k's shapes in `_fused_dq_launches`."""
    return ((40, 4, 128), (50, 2, 128)) if layout == "THD" else ((4, 40, 128), (2, 50, 128))


def _fused_dq_launches(fake, layout: str) -> tuple[dict, dict, dict, tuple]:
    """The gradient of a cross-attention (GQA, causal, a left window) through the dq-fused Hopper
    backward (helpers.FusedDq) and through the unfused one, recorded by the fake jax_triton: the fused
    one's last launch, the unfused one's dk/dv and dq launches, the fused one's gradients. Both take the
    same preprocess before."""
    q_shape, kv_shape = _fused_dq_shapes(layout)
    q, kv = jnp.ones(q_shape, jnp.bfloat16), jnp.ones(kv_shape, jnp.bfloat16)
    records = {}
    for backward in (FusedDq(), "hopper"):
        fake.reset()
        grads = jax.grad(lambda q, k, v, backward=backward: jnp.sum(jfa.jagged_attention(
            q, k, v, jnp.asarray([0, 15, 40], jnp.int32), 600, kv_offsets=jnp.asarray([0, 20, 50], jnp.int32),
            kv_max_seq_len=30, scale=0.5, causal=True, window=(8, None), layout=layout,
            implementation="portable", backward_implementation=backward).astype(jnp.float32)),
            argnums=(0, 1, 2))(q, kv, kv)
        records[backward if isinstance(backward, str) else "fused"] = (list(fake.calls), grads, backward)
    (*_, preprocess, fused_call), grads, fused = records["fused"]
    (*_, unfused_preprocess, dkdv, dq), _, _ = records["hopper"]
    assert fused.calls[-1][0] == "backward" and fused.calls[-1][3].fused_dq
    assert preprocess["kernel"] is unfused_preprocess["kernel"] is kernels.attention_bwd_preprocess_kernel
    return fused_call, dkdv, dq, grads


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_the_fused_dq_hopper_backward_is_one_launch(hopper_backward_gpu, monkeypatch, layout):
    """HopperConfig.fused_dq (helpers.FusedDq asks for it) where Triton's Gluon has no TMA reduce-add
    (3.6): after the preprocess, one launch, of the dq-fused dk/dv kernel that adds dq by atomics, and no
    dq launch. It takes what the unfused dk/dv launch takes (q, do, k, v as the same descriptors, the
    statistics, offsets and slopes, the same runtime parameters, warps, stages, register cap and
    constants), and its outputs are dk, dv, a float32 dq_acc of q's shape and strides and the counter,
    dq_acc zeroed with the counter; the gradient dq is dq_acc cast to q's dtype (the fake launches return
    zeros: the cast's shape and dtype)."""
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: False)
    q_shape, kv_shape = _fused_dq_shapes(layout)
    fused_call, dkdv, dq, grads = _fused_dq_launches(hopper_backward_gpu, layout)
    assert dkdv["kernel"] is kernels.hopper_attention_bwd_dkdv_kernel
    assert dq["kernel"] is kernels.hopper_attention_bwd_dq_kernel
    assert fused_call["kernel"] is kernels.hopper_attention_bwd_dkdv_dq_kernel
    fused_call, dkdv = dict(fused_call, kernel=None), dict(dkdv, kernel=None)
    fused_args, args = fused_call.pop("args"), dkdv.pop("args")
    assert [a.block_shape for a in fused_args[:4]] == [a.block_shape for a in args[:4]]
    assert [a.base.shape for a in fused_args[:4]] == [a.base.shape for a in args[:4]]
    assert [(a.shape, a.dtype) for a in fused_args[4:]] == [(a.shape, a.dtype) for a in args[4:]]
    assert hopper_backward_gpu.params[id(fused_args[-1])] == hopper_backward_gpu.params[id(args[-1])]
    i32, f32 = jnp.dtype(jnp.int32), jnp.dtype(jnp.float32)
    assert tuple(fused_call.pop("out_type")) == (_sds(kv_shape, jnp.bfloat16), _sds(kv_shape, jnp.bfloat16),
                                                 _sds(q_shape, f32), _sds((1,), i32))
    assert (fused_call.pop("zeroed_outputs"), dkdv.pop("zeroed_outputs")) == ((2, 3), (2,))
    dkdv.pop("out_type")
    assert fused_call == dkdv  # warps, stages, backend options and every constant
    assert [(g.shape, g.dtype) for g in grads] == [(q_shape, jnp.bfloat16), (kv_shape, jnp.bfloat16),
                                                   (kv_shape, jnp.bfloat16)]


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_the_tma_fused_dq_hopper_backward_is_one_launch(hopper_backward_gpu, monkeypatch, layout):
    """Where Triton's Gluon has the TMA reduce-add (`_compat.gluon_tma_reduce`), the one launch after the
    preprocess is the dq-fused dk/dv kernel that adds dq by it: the unfused dk/dv launch's arguments (q,
    do, k, v as the same descriptors, the statistics, offsets and slopes, the same runtime parameters,
    warps, stages, register cap and constants) with dq_acc and dq_rows before the runtime parameters:
    a descriptor of [dk/dv's query tile, 64] blocks over float32 [the 40 queries and a query tile per
    sequence, H * D] in either layout (`calls.unpad_dq`), and each sequence's first row in it, int32
    [B] (`calls.dq_rows`); the kernel updates dq_acc in place (jax-triton's
    input_output_aliases: its result after dk, dv and the counter, the counter alone zeroed); the
    gradient dq has q's shape and dtype."""
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: True)
    q_shape, kv_shape = _fused_dq_shapes(layout)
    fused_call, dkdv, _, grads = _fused_dq_launches(hopper_backward_gpu, layout)
    assert fused_call["kernel"] is kernels.hopper_attention_bwd_dkdv_dq_tma_kernel
    fused_call, dkdv = dict(fused_call, kernel=None), dict(dkdv, kernel=None)
    fused_args, args = fused_call.pop("args"), dkdv.pop("args")
    dq_acc, rows = fused_args[10:12]
    assert [a.block_shape for a in fused_args[:4]] == [a.block_shape for a in args[:4]]
    assert [a.base.shape for a in fused_args[:4]] == [a.base.shape for a in args[:4]]
    assert ([(a.shape, a.dtype) for a in fused_args[4:10] + fused_args[12:]]
            == [(a.shape, a.dtype) for a in args[4:]])
    assert (rows.shape, rows.dtype) == ((2,), jnp.int32)
    assert hopper_backward_gpu.params[id(fused_args[-1])] == hopper_backward_gpu.params[id(args[-1])]
    block_m = args[0].block_shape[0]
    view = (40 + 2 * block_m, 4 * 128)  # 2 sequences
    assert dq_acc.block_shape == (block_m, 64)
    assert (dq_acc.base.shape, dq_acc.base.dtype) == (view, jnp.float32)
    i32, f32 = jnp.dtype(jnp.int32), jnp.dtype(jnp.float32)
    assert tuple(fused_call.pop("out_type")) == (_sds(kv_shape, jnp.bfloat16), _sds(kv_shape, jnp.bfloat16),
                                                 _sds((1,), i32), _sds(view, f32))
    assert fused_call.pop("input_output_aliases") == {10: 3}
    assert (fused_call.pop("zeroed_outputs"), dkdv.pop("zeroed_outputs")) == ((2,), (2,))
    dkdv.pop("out_type")
    assert fused_call == dkdv  # warps, stages, backend options and every constant
    assert [(g.shape, g.dtype) for g in grads] == [(q_shape, jnp.bfloat16), (kv_shape, jnp.bfloat16),
                                                   (kv_shape, jnp.bfloat16)]


@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_the_tma_fused_dq_launch_updates_float32_zeros(monkeypatch, layout):
    """The plan's TMA dq-fused launch, recorded eagerly: dq_acc is float32 zeros of [the queries and a
    query tile per sequence, H * D] in either layout (with no sequence, the queries' rows alone), an input
    the call returns updated (spec.HOPPER_BWD_DKDV_DQ_TMA.aliases), from which the backward gathers dq
    in q's shape and dtype (`calls.unpad_dq`); at D = 64 a block covers a row, [dk/dv's query tile,
    64]."""
    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: True)
    recorded, run = _recorder()
    for dim, batch in ((128, 2), (64, 2), (128, 0)):
        recorded.clear()
        q_shape = (300, 4, dim) if layout == "THD" else (4, 300, dim)
        kv_shape = (200, 2, dim) if layout == "THD" else (2, 200, dim)
        q, kv = jnp.ones(q_shape, jnp.float16), jnp.ones(kv_shape, jnp.float16)
        p = dataclasses.replace(_hopper_problem(
            batch, num_heads=4, num_kv_heads=2, head_dim=dim, q_tokens=300, kv_tokens=200, max_seq_len=260,
            kv_max_seq_len=150, causal=True, dtype="float16"), layout=layout)
        config = HopperConfig(configs.hopper_block_sizes(dim, jnp.float16, 260, 150), programs=7,
                              preprocess_block_m=64, fused_dq=True)
        q_offsets, kv_offsets = [0, 40, 300][:batch + 1], [0, 90, 200][:batch + 1]
        dq, dk, dv = calls.hopper_backward(run, p, config, q, kv, kv, jnp.asarray([q_offsets], jnp.int32),
                                           jnp.asarray([kv_offsets], jnp.int32), q,
                                           jnp.zeros((1, 4, 300), jnp.float32), q)
        _, (call, arrays) = recorded
        assert call.spec is spec.HOPPER_BWD_DKDV_DQ_TMA
        assert call.kernel is kernels.hopper_attention_bwd_dkdv_dq_tma_kernel
        view = (300 + batch * config.tiles.dkdv.block_m, 4 * dim)
        dq_acc = arrays[spec.HOPPER_BWD_DKDV_DQ_TMA.index("dq_acc")]
        assert (dq_acc.shape, dq_acc.dtype) == (view, jnp.float32) and not np.any(np.asarray(dq_acc))
        rows = arrays[spec.HOPPER_BWD_DKDV_DQ_TMA.index("dq_rows")]
        assert rows.dtype == jnp.int32
        np.testing.assert_array_equal(rows, [0, 40 + config.tiles.dkdv.block_m][:batch])
        assert dict(call.descriptors)[10] == (config.tiles.dkdv.block_m, 64)
        assert call.aliases == ((10, 3),) and call.zeroed_outputs == (2,)
        assert [(s.shape, s.dtype) for s in call.out_shapes[2:]] == [((1,), jnp.int32), (view, jnp.float32)]
        assert (dq.shape, dq.dtype, dk.shape, dv.shape) == (q_shape, jnp.float16, kv_shape, kv_shape)


def _work_order(q_offsets, kv_offsets, tokens, max_lens) -> list[int]:
    """The sequences by their work n_q * n_k (float64, clamped as the kernels clamp them), the most first,
    equal work in the offsets' order."""
    n_q = [n for _, n in clamped_sequences(q_offsets, tokens[0], max_lens[0])]
    n_k = [n for _, n in clamped_sequences(kv_offsets, tokens[1], max_lens[1])]
    return sorted(range(len(n_q)), key=lambda b: (-float(n_q[b]) * n_k[b], b))


@pytest.mark.parametrize("seed", range(6))
def test_the_hopper_kernels_take_the_longest_sequences_first(seed):
    """calls.sequence_order, the Hopper kernels' `order` input (which they index unchecked): for any
    offsets (random lengths, or random integers: negative, decreasing, past the tokens) a permutation of
    the sequences, the most work n_q * n_k first, ties in the offsets' order; the offsets' order itself
    with longest_first (the kernels' ORDERED); a placeholder, never read, without it or without
    sequences."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 40))
    tokens = (int(rng.integers(1, 900)), int(rng.integers(1, 900)))
    max_lens = (int(rng.integers(1, 1000)), int(rng.integers(1, 1000)))
    if seed % 2:  # malformed
        q_offsets, kv_offsets = (rng.integers(-50, t + 50, batch + 1) for t in tokens)
    else:
        q_offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 2 * tokens[0] // batch + 2, batch))])
        kv_offsets = q_offsets if seed % 4 == 0 else np.sort(rng.integers(0, tokens[1] + 1, batch + 1))
    p = _hopper_problem(batch, num_heads=2, num_kv_heads=2, head_dim=128, q_tokens=tokens[0],
                        kv_tokens=tokens[1], max_seq_len=max_lens[0], kv_max_seq_len=max_lens[1],
                        causal=False, dtype="bfloat16")
    config = HopperConfig(configs.hopper_block_sizes(128, jnp.bfloat16, *max_lens), programs=7,
                          preprocess_block_m=64, longest_first=True)
    for rows in ((batch + 1,), (1, batch + 1)):  # as the launchers get them: one segment's row
        order = calls.sequence_order(p, config, jnp.asarray(q_offsets.reshape(rows), jnp.int32),
                                     jnp.asarray(kv_offsets.reshape(rows), jnp.int32))
        assert order.dtype == jnp.int32
        np.testing.assert_array_equal(order, _work_order(q_offsets, kv_offsets, tokens, max_lens))
    given = dataclasses.replace(config, longest_first=False)
    order = calls.sequence_order(p, given, jnp.asarray(q_offsets), jnp.asarray(kv_offsets))
    np.testing.assert_array_equal(order, [0])
    empty = dataclasses.replace(p, batch=0)
    np.testing.assert_array_equal(calls.sequence_order(empty, config, jnp.zeros(1, jnp.int32),
                                                       jnp.zeros(1, jnp.int32)), [0])


@pytest.mark.parametrize("longest_first", [True, False])
def test_the_hopper_implementation_sets_the_sequences_order(longest_first):
    """implementations.Hopper's longest_first (False by default) reaches the forward's and the backward's
    HopperConfig, which calls.sequence_order reads."""
    p = _hopper_problem(2, num_heads=4, num_kv_heads=4, head_dim=128, q_tokens=300, kv_tokens=300,
                        max_seq_len=2048, kv_max_seq_len=2048, causal=False, dtype="bfloat16")
    context = implementations.Context(gpu_device((9, 0)), configs.load_table(None))
    assert not implementations.HOPPER.longest_first
    hopper = dataclasses.replace(implementations.HOPPER, longest_first=longest_first)
    for backward in (False, True):
        assert hopper.config(p, context, backward).longest_first is longest_first


@pytest.mark.parametrize("seed", range(4))
def test_the_hstu_hopper_kernels_take_the_longest_sequences_first(seed):
    """launch/hstu.sequence_order, the Hopper HSTU kernels' `order` input: for any offsets (random
    lengths, or random integers, int32 or int64) a permutation of the sequences, the longest (clamped as
    the kernels clamp them) first, ties in the offsets' order; without longest_first, or without
    sequences, a placeholder, never read."""
    rng = np.random.default_rng(seed)
    batch, tokens, max_len = int(rng.integers(1, 40)), int(rng.integers(1, 900)), int(rng.integers(1, 1000))
    if seed % 2:  # malformed
        offsets = rng.integers(-50, tokens + 50, batch + 1)
    else:
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 2 * tokens // batch + 2, batch))])
    p = HstuProblem(layout="THD", num_heads=2, head_dim=64, value_dim=64, batch=batch, num_segments=1,
                    tokens=tokens, offsets_rows=1, max_seq_len=max_len, alpha=0.5, scale=None,
                    dtype="bfloat16")
    want = _work_order(offsets, offsets, (tokens, tokens), (max_len, max_len))
    for dtype in (jnp.int32, jnp.int64):
        with jax.enable_x64(dtype == jnp.int64):
            order = launch_hstu.sequence_order(p, True, jnp.asarray(offsets.reshape(1, -1), dtype))
            assert order.dtype == jnp.int32
            np.testing.assert_array_equal(order, want)
    given = launch_hstu.sequence_order(p, False, jnp.asarray(offsets))
    np.testing.assert_array_equal(given, [0])
    empty = launch_hstu.sequence_order(dataclasses.replace(p, batch=0), True, jnp.zeros((1, 1), jnp.int32))
    np.testing.assert_array_equal(empty, [0])


@pytest.mark.parametrize("longest_first", [True, False])
def test_the_hstu_hopper_implementation_sets_the_sequences_order(fake_jax_triton, longest_first):
    """implementations.HstuHopper's longest_first (False by default) reaches the forward's and the
    backward's configs, and from them the three launches' `order` (sequences of 15 and 25 tokens)."""
    assert not implementations.HSTU_HOPPER.longest_first
    hstu = Spy(dataclasses.replace(implementations.HSTU_HOPPER, longest_first=longest_first), calls_ := [])
    with select.use_device(gpu_device((9, 0), sms=78)):
        _hstu_call(implementation=hstu, grad=True)
    assert [(kind, config.longest_first) for kind, _, _, config in calls_] == [
        ("forward", longest_first), ("backward", longest_first)]
    # The launches again with those configs, their arrays concrete (under the gradient they are traced).
    (_, _, p, forward), (_, _, _, backward) = calls_
    recorded = []

    def run(call, arrays):
        recorded.append((call.kernel, arrays))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in call.out_shapes)

    qk, v = jnp.zeros((40, 4, 128), jnp.bfloat16), jnp.zeros((40, 4, 64), jnp.bfloat16)
    offsets = jnp.asarray([[0, 15, 40]], jnp.int32)
    launch_hstu.hopper_forward(run, p, forward, qk, qk, v, offsets, None, None)
    launch_hstu.hopper_backward(run, p, backward, qk, qk, v, offsets, None, None, v)
    specs = {kernels.hopper_hstu_fwd_kernel: spec.HOPPER_HSTU_FWD,
             kernels.hopper_hstu_bwd_dkdv_kernel: spec.HOPPER_HSTU_BWD_DKDV,
             kernels.hopper_hstu_bwd_dq_kernel: spec.HOPPER_HSTU_BWD_DQ}
    assert [kernel for kernel, _ in recorded] == list(specs)
    want = [1, 0] if longest_first else [0]  # (without longest_first a placeholder, never read)
    for kernel, arrays in recorded:
        np.testing.assert_array_equal(arrays[specs[kernel].index("order")], want)


PADDED_DQ_OFFSETS = {
    "lengths 5, 59, 0, 136, 133": [0, 5, 64, 64, 200, 333],
    "tokens outside, lengths 17, 0, 130, 150": [3, 20, 20, 150, 300],
    "none": [9],
    # the sequences out of order: [300, 333) empty, [10, 240) (130 attended), [0, 5), [5, 5), [5, 9)
    "unsorted": [300, 10, 240, -3, 5, 5, 9],
    # empty sequences starting inside another's tokens: [0, 100), [100, 100), [30, 30)
    "empty inside": [0, 100, 30, 20],
}


@pytest.mark.parametrize("layout", ["THD", "HTD"])
@pytest.mark.parametrize("offsets", PADDED_DQ_OFFSETS.values(), ids=PADDED_DQ_OFFSETS.keys())
def test_the_tma_fused_dq_padded_rows_reach_their_sequences_queries_only(layout, offsets):
    """calls.dq_rows and calls.unpad_dq against a float64 model of what the TMA dq-fused kernel writes:
    sequence b's query tiles of 16 rows whole, at rows dq_rows[b] + [0, 16 ceil(n_b / 16)) of the padded
    accumulator (n_b = min(length, max_seq_len)), the last tile's rows past n_b NaN (as dS K is there
    where the sequence has an inf key). Those rows lie within the accumulator and, in whatever order the
    offsets give the sequences, no two sequences' overlap; dq is each sequence's first n_b rows and 0 at
    every other token (past max_seq_len, before the first sequence, after the last): no NaN, no row of
    another sequence."""
    rng = np.random.default_rng(3)
    total, heads, dim, block_m, max_seq_len = 333, 3, 8, 16, 130
    batch = len(offsets) - 1
    p = dataclasses.replace(_hopper_problem(batch, num_heads=heads, num_kv_heads=heads, head_dim=dim,
                                            q_tokens=total, kv_tokens=total, max_seq_len=max_seq_len,
                                            kv_max_seq_len=max_seq_len, causal=False, dtype="bfloat16"),
                            layout=layout)
    offsets_ = jnp.asarray([offsets], jnp.int32)
    rows = np.asarray(jax.jit(lambda o: calls.dq_rows(p, o, block_m)[0])(offsets_)) if batch else []
    with jax.enable_x64(True):  # int64 offsets: the kernel's rows int32 still (its TMA coordinates)
        rows64 = calls.dq_rows(p, jnp.asarray([offsets], jnp.int64), block_m)[0]
        assert rows64.dtype == jnp.int32 and np.array_equal(rows64, rows)
    padded = np.zeros((calls.padded_dq_rows(p, block_m), heads * dim))
    written = np.zeros(len(padded), int)
    want = np.zeros((total, heads, dim))
    for b, (start, n) in enumerate(clamped_sequences(offsets, total, max_seq_len)):
        if n == 0:
            continue
        tile_rows = -(-n // block_m) * block_m
        assert 0 <= rows[b] and rows[b] + tile_rows <= len(padded), (b, rows[b])
        tiles = rng.standard_normal((tile_rows, heads, dim))
        tiles[n:] = np.nan
        padded[rows[b]:rows[b] + tile_rows] += tiles.reshape(tile_rows, heads * dim)
        written[rows[b]:rows[b] + tile_rows] += 1
        want[start:start + n] = tiles[:n]
    assert written.max(initial=0) <= 1
    got = np.asarray(jax.jit(lambda acc, o: calls.unpad_dq(p, acc, calls.dq_rows(p, o, block_m)))(
        jnp.asarray(padded, jnp.float32), offsets_))
    want = want if layout == "THD" else want.transpose(1, 0, 2)
    np.testing.assert_array_equal(got, want.astype(np.float32))


# ---------------------------------------------------------------------------------------------------
# jax-triton 0.4 shims: its import under triton 3.6, its launch of warp-specialized kernels, the
# metadata of TMA descriptors under triton 3.6
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("jax_triton_version,triton_version,defined", [
    ("0.4.1", "3.6.0", True), ("0.3.1", "3.6.0", False), ("0.4.1", "3.7.0", False),
    ("0.4.1", "3.5.0", False)])
def test_tma_tf32_is_defined_for_jax_triton_0_4_under_triton_3_6(monkeypatch, jax_triton_version,
                                                                triton_version, defined):
    from triton.backends.nvidia import driver

    monkeypatch.delattr(driver, "TMA_TF32", raising=False)
    monkeypatch.setattr(triton, "__version__", triton_version)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: jax_triton_version if name == "jax-triton" else real_version(name))
    _compat.prepare_jax_triton_import()
    assert getattr(driver, "TMA_TF32", None) == (11 if defined else None)


def test_tma_tf32_of_triton_itself_is_kept(monkeypatch):
    from triton.backends.nvidia import driver

    monkeypatch.setattr(driver, "TMA_TF32", 99, raising=False)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.1")
    _compat.prepare_jax_triton_import()
    assert driver.TMA_TF32 == 99


# jax-triton 0.4.1's triton_lib as its import leaves it where importing Triton's NVIDIA backend failed
# (triton 3.6 lacks TMA_TF32), as far as the stubs and two module-level functions that use them
# (make_cuda_target's line, and the TMA descriptor's map type as jax-triton picks it).
STUBBED_TRITON_LIB = textwrap.dedent("""
    import types
    from typing import Any


    class _Stub(Any):
        ...


    cb = types.SimpleNamespace(CUDAOptions=_Stub, CUDABackend=_Stub, GPUTarget=_Stub)
    _TMA_DTYPE_DEVICE_TO_HOST = {}
    _TMA_TF32 = 0


    def make_cuda_target(compute_capability, num_ctas):
        return cb.GPUTarget("cuda", compute_capability, 32)


    def descriptor_map_type(elem_type, round_f32_to_tf32):
        return _TMA_DTYPE_DEVICE_TO_HOST[_TMA_TF32 if round_f32_to_tf32 else elem_type]
""")


def _stubbed_jax_triton() -> types.ModuleType:
    triton_lib = types.ModuleType("jax_triton.triton_lib")
    exec(STUBBED_TRITON_LIB, triton_lib.__dict__)
    module = types.ModuleType("jax_triton")
    module.__version__ = "0.4.1"
    module.triton_lib = triton_lib
    return module


def test_a_jax_triton_imported_first_gets_the_nvidia_backend_back():
    """jax_triton imported before this package (by a user, or tokamax) under triton 3.6: its stubbed
    backend fails every launch; repaired, its functions build a real target and find the map types."""
    from triton.backends.nvidia import compiler, driver

    module = _stubbed_jax_triton()
    lib = module.triton_lib
    # "'_Stub' object has no attribute 'backend'" (Python 3.13; the GPU machine's report), or typing.Any
    # refusing the target's arguments (3.11, 3.12.1).
    with pytest.raises((AttributeError, TypeError)):
        triton.compiler.make_backend(lib.make_cuda_target(90, 1))
    assert _compat.repair_stubbed_jax_triton(module)
    target = lib.make_cuda_target(90, 1)
    assert target == compiler.GPUTarget("cuda", 90, 32)
    assert isinstance(triton.compiler.make_backend(target), lib.cb.CUDABackend)
    assert lib.cb is compiler and lib._TMA_DTYPE_DEVICE_TO_HOST is driver.TMA_DTYPE_DEVICE_TO_HOST
    assert lib._TMA_TF32 == 11 and lib.descriptor_map_type(0, round_f32_to_tf32=True) == 11
    assert not _compat.repair_stubbed_jax_triton(module)  # once only
    assert lib.cb is compiler


def test_a_jax_triton_that_is_not_stubbed_is_left_alone():
    from triton.backends.nvidia import compiler

    triton_lib = types.SimpleNamespace(cb=compiler, _TMA_DTYPE_DEVICE_TO_HOST={}, _TMA_TF32=0)
    assert not _compat.repair_stubbed_jax_triton(types.SimpleNamespace(triton_lib=triton_lib))
    assert triton_lib.cb is compiler and triton_lib._TMA_DTYPE_DEVICE_TO_HOST == {}
    assert not _compat.repair_stubbed_jax_triton(types.SimpleNamespace())  # no triton_lib at all


def test_a_stubbed_jax_triton_stays_stubbed_without_the_nvidia_backend(monkeypatch):
    """On a machine without Triton's NVIDIA backend, jax-triton's stubs are right: kept."""
    module = _stubbed_jax_triton()
    stubs = module.triton_lib.cb
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.compiler", None)  # import fails
    assert not _compat.repair_stubbed_jax_triton(module)
    assert module.triton_lib.cb is stubs


def _ptx(maxntid: str) -> str:
    return (".version 8.7\n.target sm_90a\n.visible .entry k(\n.param .u64 k_param_0\n)\n"
            f"{maxntid}\n{{\nret;\n}}\n")


class _FakeKernelLib:
    """jaxlib's gpu_triton as jax-triton 0.4.1 calls it: TritonKernel records its arguments."""

    def __init__(self):
        self.kernels = []

    def TritonKernel(self, *args):  # noqa: N802
        self.kernels.append(args)
        return len(self.kernels)

    def create_scalar_parameter(self, value, dtype):
        return ("scalar", value, dtype)


@pytest.mark.parametrize("maxntid,requested,launched", [
    (".maxntid 384, 1, 1", 4, 12),  # warp-specialized: 4 warps asked, 12 compiled
    (".reqntid 384", 4, 12),  # what Triton 3.6-3.9 write for sm_90 (a warp-specialized kernel)
    (".maxntid 128, 1, 1", 4, 4), (".maxntid 256", 8, 8), ("", 4, 4)])
def test_jax_triton_0_4_1_launches_the_warps_the_ptx_needs(maxntid, requested, launched):
    lib = _FakeKernelLib()
    module = types.SimpleNamespace(__version__="0.4.1",
                                   triton_lib=types.SimpleNamespace(triton_kernel_call_lib=lib))
    _compat.patch_jax_triton(module)
    _compat.patch_jax_triton(module)  # once only
    patched = module.triton_lib.triton_kernel_call_lib
    assert patched.TritonKernel("k", requested, 1, 1024, _ptx(maxntid), "ttir", 90, 4096, 128) == 1
    assert lib.kernels == [("k", launched, 1, 1024, _ptx(maxntid), "ttir", 90, 4096, 128)]
    assert patched.create_scalar_parameter(3, "i32") == ("scalar", 3, "i32")
    assert patched.lib is lib


@pytest.mark.parametrize("version", ["0.3.1", "0.4.2", "0.5.0"])
def test_other_jax_triton_versions_are_left_alone(version):
    lib = _FakeKernelLib()
    module = types.SimpleNamespace(__version__=version,
                                   triton_lib=types.SimpleNamespace(triton_kernel_call_lib=lib))
    _compat.patch_jax_triton(module)
    assert module.triton_lib.triton_kernel_call_lib is lib


def test_the_gpu_launcher_applies_the_warps_shim(fake_jax_triton):
    lib = _FakeKernelLib()
    fake_jax_triton.triton_lib = types.SimpleNamespace(triton_kernel_call_lib=lib)
    assert gpu.jax_triton_module() is fake_jax_triton
    fake_jax_triton.triton_lib.triton_kernel_call_lib.TritonKernel("k", 4, 1, 0, _ptx(".maxntid 256, 1, 1"))
    assert lib.kernels == [("k", 8, 1, 0, _ptx(".maxntid 256, 1, 1"))]


def _fake_compilation_result():
    """jax-triton 0.4.1's CompilationResult and TensorDescMeta, as far as the tensordesc_meta check."""
    from typing import TypedDict

    class TensorDescMeta(TypedDict):
        block_size: list
        is_im2col: bool

    @dataclasses.dataclass
    class CompilationResult:
        tensordesc_meta: list = ()

        def __post_init__(self):
            for meta in self.tensordesc_meta or ():
                if missing := TensorDescMeta.__required_keys__ - meta.keys():
                    raise ValueError(f"Invalid tensordesc_meta entry. Missing keys: {sorted(missing)}")

    return CompilationResult, TensorDescMeta


@pytest.mark.parametrize("triton_version,patched", [("3.6.0", True), ("3.7.0", False), ("3.9.0", False)])
def test_jax_triton_0_4_1_gets_is_im2col_under_triton_3_6(monkeypatch, triton_version, patched):
    result, meta = _fake_compilation_result()
    triton_lib = types.SimpleNamespace(CompilationResult=result, TensorDescMeta=meta)
    module = types.SimpleNamespace(__version__="0.4.1", triton_lib=triton_lib)
    monkeypatch.setattr(triton, "__version__", triton_version)
    _compat.patch_tensordesc_meta(module)
    _compat.patch_tensordesc_meta(module)  # once only
    entries = [{"block_size": [64, 128]}, {"block_size": [128, 128], "is_im2col": True}]
    if patched:
        assert result(entries).tensordesc_meta == [{"block_size": [64, 128], "is_im2col": False}, entries[1]]
        assert result(None).tensordesc_meta is None
    else:
        with pytest.raises(ValueError, match="Missing keys: \\['is_im2col'\\]"):
            result(entries)


def test_a_jax_triton_without_is_im2col_is_left_alone(monkeypatch):
    result, _ = _fake_compilation_result()
    original = result.__post_init__

    class TensorDescMeta(dict):
        __annotations__ = {"block_size": list}

    module = types.SimpleNamespace(triton_lib=types.SimpleNamespace(CompilationResult=result,
                                                                    TensorDescMeta=TensorDescMeta))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    _compat.patch_tensordesc_meta(module)
    assert result.__post_init__ is original
    _compat.patch_tensordesc_meta(types.SimpleNamespace())  # no triton_lib (no GPU support): nothing


def test_the_gpu_launcher_applies_the_is_im2col_shim(fake_jax_triton, monkeypatch):
    result, meta = _fake_compilation_result()
    fake_jax_triton.triton_lib = types.SimpleNamespace(CompilationResult=result, TensorDescMeta=meta)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert gpu.jax_triton_module() is fake_jax_triton
    entry = {"block_size": [64, 128]}
    assert result([entry]).tensordesc_meta == [dict(entry, is_im2col=False)]


# ---------------------------------------------------------------------------------------------------
# The tuned tile table and its override file
#
# Written against configs.py's table keyed by (GPU name, bits, padded head dimension, max_seq_len
# bucket), whose JSON form is a list of entries; adapt this section alone if that representation moves.
# ---------------------------------------------------------------------------------------------------

PORTABLE = (H200, "portable")  # the first two fields of a key of the portable kernels' entries on an H200


@pytest.mark.parametrize("head_dim,dtype,max_seq_len,key", [
    (8, jnp.float32, 16, (*PORTABLE, 32, 32, 256)),  # the smallest padded D and length bucket that cover
    (64, jnp.bfloat16, 256, (*PORTABLE, 16, 64, 256)),
    (64, jnp.bfloat16, 300, (*PORTABLE, 16, 64, None)),
    (8, jnp.float32, 5000, (*PORTABLE, 32, 32, 256)),  # longer than every bucket of D = 32: the longest
    (100, jnp.float16, 1024, (*PORTABLE, 16, 128, 1024)),
    (100, jnp.float16, 1025, (*PORTABLE, 16, 128, None)),
    (256, jnp.float32, 5, (*PORTABLE, 32, 256, None)),
    (257, jnp.float32, 5, None),
])
def test_table_key_buckets(head_dim, dtype, max_seq_len, key):
    assert configs.table_key(head_dim, dtype, max_seq_len, gpu=H200) == key
    # A GPU without entries of its own takes the fallback GPU's.
    assert configs.table_key(head_dim, dtype, max_seq_len, gpu="NVIDIA A100-SXM4-80GB") == key


def test_a_gpu_with_entries_of_its_own_takes_them():
    tiles = BlockSizes(KernelConfig(32, 32, 2, 2), KernelConfig(32, 32, 2, 2), KernelConfig(32, 32, 2, 2))
    table = {**configs.BUILTIN_TABLE, ("NVIDIA B200", "portable", 32, 64, None): tiles}
    key = configs.table_key(40, jnp.float32, 4096, gpu="NVIDIA B200", table=table)
    assert key == ("NVIDIA B200", "portable", 32, 64, None)
    # Its table has no 16-bit entries: those fall back.
    assert configs.table_key(40, jnp.bfloat16, 64, gpu="NVIDIA B200", table=table) == (*PORTABLE, 16, 64, 256)


def test_default_block_sizes_reads_the_builtin_table(monkeypatch):
    monkeypatch.delenv(select.TUNED_CONFIGS_ENV, raising=False)
    assert configs.default_block_sizes(8, jnp.float32, 200) == BlockSizes(
        KernelConfig(32, 16, 2, 2), KernelConfig(32, 64, 4, 2), KernelConfig(64, 32, 4, 2))
    assert configs.default_block_sizes(128, jnp.bfloat16, 2048) == BlockSizes(
        KernelConfig(128, 64, 8, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 128, 8, 2))
    assert configs.default_block_sizes(128, jnp.bfloat16, 2048).one_backward_launch
    # Long sequences at D = 64: dq programs on 8 warps, dk/dv on 4, in a launch each.
    assert not configs.default_block_sizes(64, jnp.bfloat16, 4096).one_backward_launch
    assert configs.default_block_sizes(256, jnp.float16, 64).preprocess_block_m == 32
    with pytest.raises(ValueError, match="head dimension 300"):
        configs.default_block_sizes(300, jnp.float32, 16)


@pytest.mark.parametrize("causal", [False, True])
def test_the_portable_forward_takes_the_entry_fwd_causal_under_causal(fake_jax_triton, monkeypatch, causal):
    """A portable entry's fwd_causal (D = 64 from 257 tokens: 4-warp tiles of 64 queries under causal,
    where the 8-warp 128-query tile stays without a mask) is the forward the launch runs, fitted to the
    lengths as fwd is; the tiles returned have no fwd_causal of their own (what block_sizes= takes), and
    the JSON form keeps the entry's."""
    monkeypatch.delenv(select.TUNED_CONFIGS_ENV, raising=False)
    key = (*PORTABLE, 16, 64, None)
    entry = configs.BUILTIN_TABLE[key]
    assert entry.fwd == KernelConfig(128, 64, 8, 3) and entry.fwd_causal == KernelConfig(64, 64, 4, 3)
    assert configs.entry_from_json(configs.entry_to_json(key, entry)) == (key, entry)
    want = entry.fwd_causal if causal else entry.fwd
    tiles = configs.default_block_sizes(64, jnp.bfloat16, 4096, causal=causal)
    assert tiles == BlockSizes(want, entry.dkdv, entry.dq)
    # Fitted as fwd is: 8 queries against 4096 keys.
    assert configs.default_block_sizes(64, jnp.bfloat16, 8, 4096, causal=causal).fwd == KernelConfig(
        16, 128, 4, want.num_stages)
    # Sequences of at most 256 tokens: that entry's forward, masked or not.
    assert configs.default_block_sizes(64, jnp.bfloat16, 256, causal=causal).fwd == configs.BUILTIN_TABLE[
        (*PORTABLE, 16, 64, 256)].fwd
    q = jnp.ones((600, 2, 64), jnp.bfloat16)
    jfa.jagged_attention(q, q, q, [0, 600], 1024, causal=causal, backend="triton")
    (forward,) = fake_jax_triton.calls
    assert (forward["BLOCK_M"], forward["BLOCK_N"], forward["num_warps"], forward["num_stages"]) == (
        want.block_m, want.block_n, want.num_warps, want.num_stages)


def test_default_block_sizes_fit_the_sequence_lengths(monkeypatch):
    """Blocks no longer than the sequences they cover: 8 queries against 4096 keys take the long keys'
    entry with 16-row query blocks, whose rows go to the key blocks (up to 128), and a 4-warp forward;
    20 tokens take 32-row blocks."""
    monkeypatch.delenv(select.TUNED_CONFIGS_ENV, raising=False)
    assert configs.default_block_sizes(128, jnp.bfloat16, 8, 4096) == BlockSizes(
        KernelConfig(16, 128, 4, 3), KernelConfig(16, 128, 8, 2), KernelConfig(16, 128, 8, 2))
    assert configs.default_block_sizes(128, jnp.bfloat16, 4096, 8) == BlockSizes(
        KernelConfig(128, 16, 8, 3), KernelConfig(64, 16, 8, 2), KernelConfig(128, 16, 8, 2))
    assert configs.default_block_sizes(8, jnp.float32, 20) == BlockSizes(
        KernelConfig(32, 16, 2, 2), KernelConfig(32, 32, 4, 2), KernelConfig(32, 32, 4, 2))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fitted_key_blocks_leave_room_in_shared_memory(monkeypatch, dtype):
    """A query block cut to short sequences gives its rows to the key block only as far as the program
    fits sm_90's shared memory (227 KB): at D = 256 (16-bit) and D = 128 (float32), 33-64 queries against
    longer keys keep the forward's 64-key blocks (64 x 128 took 288 KB), and the dq programs of D = 256
    halve theirs (64 x 64 on 3 stages took 256 KB); a fit that fits is unchanged (8 queries against 4096
    keys, D = 128: 16 x 128, 196 KB). Every fitted tile of the built-in table, at any head dimension,
    stays within it (`portable_shared_bytes`, which matched the compiled kernels' figures within a KiB:
    docs/performance.md)."""
    monkeypatch.delenv(select.TUNED_CONFIGS_ENV, raising=False)
    itemsize = np.dtype(dtype).itemsize
    wide = 256 if itemsize == 2 else 128
    cross = configs.default_block_sizes(wide, dtype, 64, 4096)
    assert (cross.fwd.block_m, cross.fwd.block_n) == (64, 64)
    if itemsize == 2:
        dq = configs.default_block_sizes(wide, dtype, 64).dq
        assert (dq.block_m, dq.block_n) == (64, 32)
        assert configs.default_block_sizes(128, dtype, 8, 4096).fwd == KernelConfig(16, 128, 4, 3)
    for head_dim in (8, 24, 40, 64, 96, 128, 160, 256):
        for max_seq_len in (1, 16, 33, 64, 100, 256, 1024, 4096):
            for kv_max_seq_len in (max_seq_len, 128, 4096):
                fitted = configs.default_block_sizes(head_dim, dtype, max_seq_len, kv_max_seq_len)
                for kernel in ("fwd", "dq", "dkdv"):
                    size = configs.portable_shared_bytes(kernel, getattr(fitted, kernel), head_dim, itemsize)
                    assert size <= configs.SHARED_MEMORY_BYTES, (
                        head_dim, max_seq_len, kv_max_seq_len, kernel, getattr(fitted, kernel), size)


def test_the_table_round_trips_through_json():
    text = json.dumps(configs.table_to_json(configs.BUILTIN_TABLE))
    assert configs.table_from_json(json.loads(text)) == configs.BUILTIN_TABLE


def _override(tmp_path, *entries) -> str:
    path = tmp_path / "tuned.json"  # a new path per test: load_table caches by path
    path.write_text(json.dumps(list(entries)))
    return str(path)


def test_the_override_file_replaces_and_adds_entries(fake_jax_triton, tmp_path, monkeypatch):
    replaced = dict(gpu=H200, bits=32, head_dim=32, max_seq_len=256, fwd=[16, 16, 1, 1], dkdv=[16, 32, 2, 1],
                    dq=[32, 16, 2, 1], preprocess_block_m=16)
    added = dict(gpu="NVIDIA B200", bits=32, head_dim=64, max_seq_len=None, fwd=[128, 128, 8, 4],
                 dkdv=[64, 64, 8, 4], dq=[64, 64, 8, 4])
    table = configs.load_table(_override(tmp_path, replaced, added))
    assert configs.default_block_sizes(8, jnp.float32, 100, table=table) == BlockSizes(
        KernelConfig(16, 16, 1, 1), KernelConfig(16, 32, 2, 1), KernelConfig(32, 16, 2, 1), 16)
    untouched = configs.default_block_sizes(64, jnp.float32, 100, table=table)
    assert untouched == configs.BUILTIN_TABLE[(*PORTABLE, 32, 64, 256)]
    assert configs.default_block_sizes(64, jnp.float32, 100, table=table, gpu="NVIDIA B200") == BlockSizes(
        KernelConfig(128, 128, 8, 4), KernelConfig(64, 64, 8, 4), KernelConfig(64, 64, 8, 4))
    assert configs.default_block_sizes(8, jnp.float32, 100) == configs.BUILTIN_TABLE[(*PORTABLE, 32, 32, 256)]
    # The op reads the file $JAGGED_FLASH_JAX_TUNED_CONFIGS names (select.py, its only reader).
    monkeypatch.setenv(select.TUNED_CONFIGS_ENV, _override(tmp_path, replaced))
    p = checks.attention_problem(*(jnp.ones((40, 2, 8), jnp.float32),) * 3, *(jnp.asarray([0, 40]),) * 2,
                                 max_seq_len=100, kv_max_seq_len=100, scale=0.1, out_scale=1.0, causal=False,
                                 layout="THD", allow_tf32=True, self_attention=True, validate=False)
    config = select.choose(p, select.request("interpret"), gpu_device()).forward_config
    assert config.tiles == configs.INTERPRET_BLOCK_SIZES  # the interpreter keeps its own tiles
    with select.use_device(gpu_device()):
        config = select.choose(p, select.request(implementation="portable")).forward_config
    assert config.tiles == configs.load_table(os.environ[select.TUNED_CONFIGS_ENV])[(*PORTABLE, 32, 32, 256)]


def test_a_malformed_override_file_is_refused(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"32bit/D32/L256": {}}))
    with pytest.raises(ValueError, match="expected a list of entries"):
        configs.load_table(str(path))
    entry = dict(gpu=H200, bits=32, head_dim=32, max_seq_len=None, fwd=[16, 16], dkdv=[16, 16], dq=[16, 16])
    for name, change, message in (("family", dict(kernels="ampere"), "kernels must be one of"),
                                  ("no-dq", dict(dq=None), "portable tile table entry needs fwd, dkdv"),
                                  ("hopper-32bit", dict(kernels="hopper"), "hopper tile table entry's bits")):
        path = tmp_path / f"{name}.json"  # a path each: load_table caches by path
        path.write_text(json.dumps([{**entry, **change}]))
        with pytest.raises(ValueError, match=message):
            configs.load_table(str(path))


def test_the_gpu_launcher_takes_its_tiles_from_the_table(fake_jax_triton, tmp_path, monkeypatch):
    """block_sizes=None on the triton backend: the override file's tiles, chosen by the longer of
    max_seq_len and kv_max_seq_len (2000 is past the D = 128 bucket of 1024), their query blocks cut to
    max_seq_len = 16 and their key blocks grown by as much."""
    entry = dict(gpu=H200, bits=16, head_dim=128, max_seq_len=None, fwd=[32, 16, 2, 5], dkdv=[16, 64, 1, 6],
                 dq=[64, 16, 1, 6], preprocess_block_m=128)
    monkeypatch.setenv(select.TUNED_CONFIGS_ENV, _override(tmp_path, entry))
    q = jnp.ones((24, 2, 128), jnp.bfloat16)
    o, vjp = jax.vjp(lambda q, k, v: jfa.jagged_attention(q, k, v, [0, 24], 16, kv_max_seq_len=2000,
                                                          backend="triton"), q, q, q)
    vjp(jnp.ones_like(o))
    forward, preprocess, backward = fake_jax_triton.calls
    assert (forward["num_warps"], forward["num_stages"]) == (2, 5)
    assert (forward["BLOCK_M"], forward["BLOCK_N"]) == (16, 32)
    assert preprocess["BLOCK_M"] == 128
    assert (backward["num_warps"], backward["num_stages"]) == (1, 6)
    assert (backward["DKDV_BLOCK_M"], backward["DKDV_BLOCK_N"], backward["DQ_BLOCK_M"],
            backward["DQ_BLOCK_N"]) == (16, 64, 16, 64)


def test_a_window_keys_the_table_by_its_width(fake_jax_triton, monkeypatch):
    """A sliding window (left, right) takes the tiles of sequences of left + right tokens (its key blocks
    are shaped like theirs), whatever the sequences' length; a window open on one side keys by the
    lengths."""
    monkeypatch.delenv(select.TUNED_CONFIGS_ENV, raising=False)
    assert configs.band_width((256, None), causal=True) == 256
    assert configs.band_width((100, 28), causal=False) == 128
    assert configs.band_width((100, None), causal=False) is None
    assert configs.band_width((None, 0), causal=False) is None
    short = configs.BUILTIN_TABLE[(*PORTABLE, 16, 128, 256)]
    assert configs.default_block_sizes(128, jnp.bfloat16, 16384, band=256) == short
    assert configs.default_block_sizes(128, jnp.bfloat16, 16384, band=257) == configs.BUILTIN_TABLE[
        (*PORTABLE, 16, 128, 1024)]
    assert configs.default_block_sizes(128, jnp.bfloat16, 200, band=5000) == short
    q = jnp.ones((600, 1, 128), jnp.bfloat16)
    for window, causal, want in (((256, 0), False, short.fwd), ((256, None), True, short.fwd),
                                 ((256, None), False, configs.BUILTIN_TABLE[(*PORTABLE, 16, 128, None)].fwd)):
        fake_jax_triton.reset()
        jfa.jagged_attention(q, q, q, [0, 600], 2048, window=window, causal=causal, backend="triton")
        (forward,) = fake_jax_triton.calls
        assert (forward["BLOCK_M"], forward["BLOCK_N"], forward["num_warps"]) == (
            want.block_m, want.block_n, want.num_warps), window


def test_gpu_launcher_passes_register_caps(fake_jax_triton):
    """A tile's max_registers reaches jax-triton as Triton's maxnreg (a backend option) for its own
    kernel only; dq and dk/dv tiles with different caps run in a launch each."""
    tiles = BlockSizes(fwd=KernelConfig(16, 32, max_registers=96),
                       dkdv=KernelConfig(16, 32, max_registers=128), dq=KernelConfig(16, 32),
                       preprocess_block_m=16)
    assert not tiles.one_backward_launch
    q = jnp.ones((24, 2, 8), jnp.float32)
    op = lambda q: jfa.jagged_attention(q, q, q, jnp.asarray([0, 5, 24], jnp.int32), 20, backend="triton",
                                        block_sizes=tiles)
    o, vjp = jax.vjp(op, q)
    vjp(jnp.ones_like(o))
    options = [(call["kernel"], call.get("backend_options")) for call in fake_jax_triton.calls]
    assert options == [(kernels.attention_fwd_kernel, dict(gpu.COMPILE_OPTIONS, maxnreg=96)),
                       (kernels.attention_bwd_preprocess_kernel, gpu.COMPILE_OPTIONS),
                       (kernels.attention_bwd_kernel, gpu.COMPILE_OPTIONS),  # the dq launch
                       (kernels.attention_bwd_kernel, dict(gpu.COMPILE_OPTIONS, maxnreg=128))]


def test_the_gpu_launcher_asks_triton_for_ptx_that_jaxlibs_ptxas_accepts(fake_jax_triton, monkeypatch):
    monkeypatch.setattr(_compat, "ptx_version_option", lambda default: {"ptx_version": 90})
    q, k, v, offsets = _small_problem()
    jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")
    assert fake_jax_triton.calls
    assert all(call["backend_options"]["ptx_version"] == 90 for call in fake_jax_triton.calls)


def test_a_ptxas_too_old_for_the_kernels_is_refused_and_auto_falls_back(fake_jax_triton, monkeypatch):
    monkeypatch.setattr(_compat, "ptxas_unsupported_reason", lambda: "jaxlib assembles ... PTX up to 8.4")
    q, k, v, offsets = _small_problem()
    with pytest.raises(ValueError, match="backend='triton' cannot run: RuntimeError: jaxlib assembles"):
        jfa.jagged_attention(q, k, v, offsets, 8, backend="triton")
    with pytest.warns(RuntimeWarning, match="'xla'.*PTX up to 8.4"):
        assert select.default_backend() == "xla"
    assert fake_jax_triton.calls == []


# ---------------------------------------------------------------------------------------------------
# HSTU's Hopper forward ("hstu-hopper"): when auto takes it, which problems it takes, and its launch
# ---------------------------------------------------------------------------------------------------


def _hstu_call(*, dim=128, value_dim=64, layout="THD", dtype=jnp.bfloat16, grad=False, max_seq_len=600,
               **options):
    """hstu_attention (or its gradient in q, k, v) on 40 tokens of 4 heads in 2 sequences (offsets
    [0, 15, 40]), max_seq_len 600, alpha 0.5; q, k of `dim`, v of `value_dim`."""
    shape = lambda d: (40, 4, d) if layout == "THD" else (4, 40, d)  # noqa: E731
    q, v = jnp.ones(shape(dim), dtype), jnp.ones(shape(value_dim), dtype)
    op = lambda q, k, v: jfa.hstu_attention(  # noqa: E731
        q, k, v, jnp.asarray([0, 15, 40], jnp.int32), max_seq_len, alpha=0.5, layout=layout, **options)
    if grad:
        return jax.grad(lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, q, v)
    return op(q, q, v)


@pytest.mark.parametrize("token_scale", [False, True], ids=["static-scale", "token-scale"])
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_gpu_launcher_arguments_of_the_hstu_hopper_forward(fake_jax_triton, layout, token_scale):
    """q, k [40, 4, 128] bfloat16, v [40, 4, 64], 2 sequences, targets, a window lifted for the last
    rows, a context prefix, the scale static or per token: one launch of a persistent grid, one program
    per SM (78 here), q, k, v as TMA descriptors over 2-D views one token stride wide (v's narrower), the
    offsets, targets and scale (or its one-element placeholder) as kernels/spec.py's HOPPER_HSTU_FWD
    names them, o and the programs' int32 counter of query blocks (which alone the launch zeroes), 4 warps
    asked (the launch takes the compiled 12 from the PTX) and a register cap of 168."""
    from triton.experimental.gluon import language as gl

    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    scale = jnp.full((40,), 0.25, jnp.float32) if token_scale else 0.25
    with select.use_device(gpu_device((9, 0), sms=78)):
        o = _hstu_call(layout=layout, num_targets=jnp.asarray([1, 2], jnp.int32), max_attn_len=8,
                       contextual_seq_len=2, min_full_attn_seq_len=4, attn_scale=scale,
                       implementation="hstu-hopper")
    assert o.shape == ((40, 4, 64) if layout == "THD" else (4, 40, 64))
    (call,) = fake_jax_triton.calls
    call = dict(call)
    assert call.pop("kernel") is kernels.hopper_hstu_fwd_kernel
    assert call.pop("grid") == (78,)
    args = call.pop("args")
    views = ((40, 512), (40, 512), (40, 256)) if layout == "THD" else ((160, 128), (160, 128), (160, 64))
    blocks = ((64, 128), (64, 128), (64, 64))
    for desc, view, block in zip(args[:3], views, blocks):
        assert isinstance(desc, fake_jax_triton.TensorDescriptor)
        assert (desc.base.shape, desc.base.dtype, desc.block_shape) == (view, bf16, block)
        assert desc.layout == gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
    # The offsets and targets as [1, ...] rows, the sequences' order (launch/hstu.sequence_order: by
    # default a placeholder, the offsets' order), the per-token scale (or a static one's placeholder).
    assert [(a.shape, a.dtype) for a in args[3:-1]] == [((1, 3), i32), ((1, 2), i32), ((1,), i32),
                                                        ((40,) if token_scale else (1,), f32)]
    # batch, tokens, q/k token and head strides, v's (in units of 16 elements), the row strides of the
    # offsets and targets, the tokens per zero-fill chunk (40 over 2), the query blocks per (sequence, head).
    strides = (32, 8, 16, 4) if layout == "THD" else (8, 320, 4, 160)
    assert fake_jax_triton.params[id(args[-1])] == (2, 40, *strides, 0, 0, 20, 1)
    assert spec.HOPPER_HSTU_FWD.params[-1] == "blocks"
    assert tuple(call.pop("out_type")) == (_sds(o.shape, bf16), _sds((1,), i32))
    options = (call.pop("num_warps"), call.pop("num_stages"), call.pop("backend_options"))
    assert options == (4, configs.HOPPER_FWD_TRITON_STAGES, dict(gpu.COMPILE_OPTIONS, maxnreg=168))
    assert call.pop("zeroed_outputs") == (1,)
    assert call == dict(NUM_HEADS=4, D=128, V=64, MAX_LEN=600, ALPHA=0.5, SCALE=1.0 if token_scale else 0.25,
                        TOKEN_SCALE=token_scale, CAUSAL=True, MAX_ATTN_LEN=8, CONTEXT_LEN=2, MIN_FULL_LEN=4,
                        HAS_TARGETS=True, BLOCK_M=128, BLOCK_N=64, STAGES=2, STRIDE_ALIGN=16,
                        FILL_BLOCK=calls.FILL_BLOCK, CONSUMER_REGS=configs.HOPPER_CONSUMER_REGS,
                        PRODUCER_REGS=configs.HOPPER_PRODUCER_REGS, ORDERED=False)


@pytest.mark.parametrize("token_scale", [False, True], ids=["static-scale", "token-scale"])
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_gpu_launcher_arguments_of_the_hstu_hopper_backward(fake_jax_triton, layout, token_scale):
    """The gradient of `test_gpu_launcher_arguments_of_the_hstu_hopper_forward`'s call: after the forward,
    a launch of the dk/dv kernel and one of the dq kernel, each on a persistent grid of one program per
    SM, q, do, k, v as TMA descriptors over the forward's 2-D views (do's and v's of V), the offsets,
    targets and scale as kernels/spec.py's HOPPER_HSTU_BWD_DKDV and HOPPER_HSTU_BWD_DQ name them; dk, dv
    and dq, dq's launch also dscale ([T, H] float32 with a per-token scale, else a one-element placeholder,
    which the launch zeroes beside the counter); the backward's Triton stages and the register cap."""
    from triton.experimental.gluon import language as gl

    bf16, f32, i32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    scale = jnp.full((40,), 0.25, jnp.float32) if token_scale else 0.25
    with select.use_device(gpu_device((9, 0), sms=78)):
        dq, dk, dv = _hstu_call(layout=layout, num_targets=jnp.asarray([1, 2], jnp.int32), max_attn_len=8,
                                contextual_seq_len=2, min_full_attn_seq_len=4, attn_scale=scale,
                                implementation="hstu-hopper", grad=True)
    qk_shape, v_shape = ((40, 4, 128), (40, 4, 64)) if layout == "THD" else ((4, 40, 128), (4, 40, 64))
    assert (dq.shape, dk.shape, dv.shape) == (qk_shape, qk_shape, v_shape)
    launched = [call["kernel"] for call in fake_jax_triton.calls]
    assert launched == [kernels.hopper_hstu_fwd_kernel, kernels.hopper_hstu_bwd_dkdv_kernel,
                        kernels.hopper_hstu_bwd_dq_kernel]
    dscale = _sds((40, 4) if token_scale else (1,), f32)
    results = {kernels.hopper_hstu_bwd_dkdv_kernel: ((_sds(qk_shape, bf16), _sds(v_shape, bf16)), (2,)),
               kernels.hopper_hstu_bwd_dq_kernel: ((_sds(qk_shape, bf16), dscale), (1, 2))}
    tiles = {kernels.hopper_hstu_bwd_dkdv_kernel: configs.HSTU_HOPPER_BWD_DKDV_TILE,
             kernels.hopper_hstu_bwd_dq_kernel: configs.HSTU_HOPPER_BWD_DQ_TILE}
    for call in fake_jax_triton.calls[1:]:
        call = dict(call)
        kernel = call.pop("kernel")
        assert call.pop("grid") == (78,)
        args = call.pop("args")
        views = (((40, 512), (40, 256), (40, 512), (40, 256)) if layout == "THD"
                 else ((160, 128), (160, 64), (160, 128), (160, 64)))
        # Both kernels' tiles are 64 rows here: dk/dv's query tile and half its keys, dq's half of its
        # queries and its key tile.
        blocks = ((64, 128), (64, 64), (64, 128), (64, 64))
        for desc, view, block in zip(args[:4], views, blocks):
            assert isinstance(desc, fake_jax_triton.TensorDescriptor)
            assert (desc.base.shape, desc.base.dtype, desc.block_shape) == (view, bf16, block)
            assert desc.layout == gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)
        assert [(a.shape, a.dtype) for a in args[4:-1]] == [((1, 3), i32), ((1, 2), i32), ((1,), i32),
                                                            ((40,) if token_scale else (1,), f32)]
        strides = (32, 8, 16, 4) if layout == "THD" else (8, 320, 4, 160)
        # ... the tokens per zero-fill chunk (40 over 2), the key (dq: query) blocks per (sequence, head).
        assert fake_jax_triton.params[id(args[-1])] == (2, 40, *strides, 0, 0, 20, 1)
        outputs, zeroed = results[kernel]
        assert tuple(call.pop("out_type")) == (*outputs, _sds((1,), i32))
        assert call.pop("zeroed_outputs") == zeroed
        options = (call.pop("num_warps"), call.pop("num_stages"), call.pop("backend_options"))
        assert options == (4, configs.HOPPER_BWD_TRITON_STAGES, dict(gpu.COMPILE_OPTIONS, maxnreg=168))
        tile = tiles[kernel]
        assert call == dict(NUM_HEADS=4, D=128, V=64, MAX_LEN=600, ALPHA=0.5,
                            SCALE=1.0 if token_scale else 0.25, TOKEN_SCALE=token_scale, CAUSAL=True,
                            MAX_ATTN_LEN=8, CONTEXT_LEN=2, MIN_FULL_LEN=4, HAS_TARGETS=True,
                            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, STAGES=2, STRIDE_ALIGN=16,
                            FILL_BLOCK=calls.FILL_BLOCK, CONSUMER_REGS=configs.HOPPER_CONSUMER_REGS,
                            PRODUCER_REGS=configs.HOPPER_PRODUCER_REGS, ORDERED=False)


@pytest.mark.parametrize("options,reason", [
    (dict(dtype=jnp.float32), "float32 inputs"),
    (dict(dim=96, value_dim=96), "head dimensions D=96, V=96"),
], ids=["float32", "D96"])
def test_the_hstu_hopper_backward_falls_back_to_the_portable_one(fake_jax_triton, options, reason):
    """Named for the backward, "hstu-hopper" runs the portable HSTU backward where its Hopper kernels
    cannot take the problem (here after the portable forward): no error, where the forward named
    "hstu-hopper" refuses it (`test_hstu_hopper_says_why_it_cannot_run`)."""
    with select.use_device(gpu_device((9, 0))):
        with pytest.raises(ValueError, match=f"'hstu-hopper': {reason}"):
            _hstu_call(implementation="hstu-hopper", grad=True, **options)
        fake_jax_triton.reset()
        _hstu_call(implementation="portable", backward_implementation="hstu-hopper", grad=True, **options)
    launched = {call["kernel"] for call in fake_jax_triton.calls}
    assert launched == {kernels.hstu_fwd_kernel, kernels.hstu_bwd_kernel}


@pytest.mark.parametrize("segments", [1, 2])
def test_the_hstu_hopper_backward_takes_one_offsets_segment(fake_jax_triton, segments):
    """A problem of two offsets segments (what vmap and data-parallel packing can make) gets the portable
    backward's config, which supports it, from "hstu-hopper"; a problem of one, the Hopper backward's."""
    p = HstuProblem(layout="THD", num_heads=2, head_dim=128, value_dim=128, batch=2, num_segments=segments,
                    tokens=64, offsets_rows=segments, max_seq_len=40, alpha=0.5, scale=0.25, dtype="bfloat16",
                    causal=True)
    context = implementations.Context(gpu_device((9, 0)), configs.load_table(None))
    config = implementations.HSTU_HOPPER.config(p, context, backward=True)
    assert isinstance(config, launch_hstu.HopperHstuBackwardConfig) == (segments == 1)
    assert implementations.HSTU_HOPPER.supports(p, context, config, backward=True) is None


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("max_seq_len,env,hopper", [
    (1024, None, True), (1023, None, False), (1024, "portable", False), (600, "hopper", True),
], ids=["1024", "1023", "portable-env", "hopper-env"])
def test_auto_takes_hstu_hopper_from_1024_tokens(fake_jax_triton, monkeypatch, backend, max_seq_len, env,
                                                 hopper):
    """On a Hopper GPU, backend="auto" and "triton" run HSTU's Hopper kernels (forward, dk/dv and dq) for
    16-bit inputs from configs.HSTU_HOPPER_AUTO_MIN_LENGTH tokens, the portable ones below; the
    environment narrows them as it does the softmax op's ("portable": no Hopper kernels; "hopper": the
    Hopper kernels wherever they can run, any length)."""
    for name in (select.FORWARD_ENV, select.BACKWARD_ENV):
        if env is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, env)
    with select.use_device(gpu_device((9, 0))):
        _hstu_call(backend=backend, grad=True, max_seq_len=max_seq_len)
    launched = {call["kernel"] for call in fake_jax_triton.calls}
    hopper_kernels = {kernels.hopper_hstu_fwd_kernel, kernels.hopper_hstu_bwd_dkdv_kernel,
                      kernels.hopper_hstu_bwd_dq_kernel}
    want = hopper_kernels if hopper else {kernels.hstu_fwd_kernel, kernels.hstu_bwd_kernel}
    assert launched == want


@pytest.mark.parametrize("options,device,reason", [
    (dict(dtype=jnp.float32), gpu_device((9, 0)), "float32 inputs"),
    (dict(dim=96, value_dim=96), gpu_device((9, 0)), "head dimensions D=96, V=96"),
    (dict(value_dim=32), gpu_device((9, 0)), "head dimensions D=128, V=32"),
    (dict(), gpu_device((8, 0)), "compute capability \\(8, 0\\)"),
    (dict(), gpu_device(None), "compute capability None"),
    (dict(), Device("cpu", "cpu"), "it needs a GPU"),
], ids=["float32", "D96", "V32", "ampere", "no-capability", "cpu"])
def test_hstu_hopper_says_why_it_cannot_run(fake_jax_triton, options, device, reason):
    """Named alone, "hstu-hopper" refuses with its reason; named first of a sequence, the next runs."""
    with select.use_device(device):
        with pytest.raises(ValueError, match=f"'hstu-hopper': {reason}"):
            _hstu_call(implementation="hstu-hopper", **options)
        if device.gpu:
            fake_jax_triton.reset()
            _hstu_call(implementation=("hstu-hopper", "portable"), **options)
            assert fake_jax_triton.calls[0]["kernel"] is kernels.hstu_fwd_kernel


def test_hstu_hopper_takes_one_offsets_segment(fake_jax_triton):
    """vmap with batched offsets folds the problems into offsets segments, which the Hopper HSTU forward
    does not take: the portable one runs them, falling through."""
    q = jnp.ones((2, 40, 4, 128), jnp.bfloat16)
    offsets = jnp.asarray([[0, 15, 40], [0, 30, 40]], jnp.int32)

    def op(implementation):
        return jax.vmap(lambda q, o: jfa.hstu_attention(q, q, q, o, 600, alpha=0.5,
                                                        implementation=implementation))

    with select.use_device(gpu_device((9, 0))):
        with pytest.raises(ValueError, match="'hstu-hopper': 2 offsets segments"):
            op("hstu-hopper")(q, offsets)
        fake_jax_triton.reset()
        op(("hstu-hopper", "portable"))(q, offsets)
        assert fake_jax_triton.calls[-1]["kernel"] is kernels.hstu_fwd_kernel
        # auto, which takes the Hopper kernels from 1024 tokens, runs the portable ones under vmap
        # (custom_vmap traces the unbatched problem too, before its rule: the last launch is the rule's)
        fake_jax_triton.reset()
        jax.vmap(lambda q, o: jfa.hstu_attention(q, q, q, o, 1024, alpha=0.5))(q, offsets)
    assert fake_jax_triton.calls[-1]["kernel"] is kernels.hstu_fwd_kernel
