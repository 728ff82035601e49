"""The Hopper forward (kernels/hopper/forward.py): compiled here for sm_90a with the launcher's constants (no
GPU needed; at D = 128 and 256, with every option's constexpr on), and on a Hopper GPU against the float64
reference, both layouts, causal, windows (left, right, both), a soft cap, ALiBi, GQA, cross, empty and
truncated sequences, FBGEMM's op, 16-bit inputs, D = 128 and 256, with the gradients that the portable
backward takes from its log-sum-exp; inf and nan in unattended tokens, large logits (soft-capped too), the
log-sum-exp returned, a jitted training step run twice, and the kernel's own zero fill (o = 0, log-sum-exp
+inf) under adversarial offsets. The Hopper backward (kernels/hopper/dkdv.py, dq.py) likewise: its dk/dv
and dq kernels compiled for sm_90a (D = 64 causal, D = 128 with every option on, both layouts, both 16-bit
types), and on a Hopper GPU against float64 (both layouts, causal, windows (left, right, both), a soft cap,
ALiBi, all with causal, GQA/MQA, cross-attention both ways, empty and truncated sequences, D = 64 and 128,
float16, FBGEMM's op, inf and nan in unattended tokens, the options' too), one-hot rows at logits to 1e21,
bitwise deterministic with the Hopper forward, the gradients of the log-sum-exp against the portable
backward, and its own zero fill under adversarial offsets; its log-sum-exp scaled and rounded down
(shared.scaled_down, in Triton's interpreter); spies of the implementations says it ran. The compile tests
follow jax-triton 0.4.1's pipeline (make_ttir on the Gluon module, which triton.compile skips). Which
problems take the Hopper kernels, and their launches' exact arguments: test_launchers.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from helpers import (
    TOLERANCES,
    Batch,
    FusedDq,
    Spy,
    assert_matches,
    attended_mask,
    reference,
    relative_error,
    run_vjp,
    to_numpy,
)

import jagged_flash_jax as jfa
from benchmarks.probes import ptx
from jagged_flash_jax import checks, configs, implementations, select
from jagged_flash_jax.kernels.shared import scaled_down
from jagged_flash_jax.launch import calls, gpu, interpret
from jagged_flash_jax.launch.calls import HopperConfig
from jagged_flash_jax.problem import Problem

# ---------------------------------------------------------------------------------------------------
# Compiled for sm_90a, without a GPU
# ---------------------------------------------------------------------------------------------------


def _problem(dim: int, causal: bool, layout: str, dtype, dkdv_block_m=None, **options):
    """A Problem of 4 query heads over 2 kv heads (GQA), 64 query and 48 key tokens (cross-attention),
    the Hopper configuration with the table's tiles for it (at these lengths, D = 128's 64-key ones;
    dk/dv's query tiles `dkdv_block_m` rows if given, as a tuned table may), q and k-shaped zero arrays and
    its offsets."""
    shape = lambda tokens, heads: (tokens, heads, dim) if layout == "THD" else (heads, tokens, dim)  # noqa: E731
    q, kv = jnp.zeros(shape(64, 4), dtype), jnp.zeros(shape(48, 2), dtype)
    p = Problem(layout=layout, num_heads=4, num_kv_heads=2, head_dim=dim, batch=2, num_segments=1,
                q_tokens=64, kv_tokens=48, q_offsets_rows=1, kv_offsets_rows=1, max_seq_len=40,
                kv_max_seq_len=50, causal=causal, scale=0.1, out_scale=1.0, dtype=jnp.dtype(dtype).name,
                input_precision="tf32", **options)
    tiles = configs.hopper_block_sizes(dim, dtype, 40, 50, configs.band_width(p.window, causal))
    if dkdv_block_m is not None:
        tiles = dataclasses.replace(tiles, dkdv=dataclasses.replace(tiles.dkdv, block_m=dkdv_block_m))
    return p, HopperConfig(tiles, configs.HOPPER_SMS, 64), q, kv, jnp.asarray([[0, 10, 64]], jnp.int32)


def _captured(launch, *args):
    """The (KernelCall, arrays) pairs that `launch` (calls.hopper_forward or hopper_backward) makes, run
    nowhere."""
    recorded = []

    def run(call, arrays):
        recorded.append((call, arrays))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in call.out_shapes)

    launch(run, *args)
    return recorded


def hopper_call(dim: int, causal: bool, layout: str, dtype, window=(None, None), softcap=None, alibi=False):
    """The Hopper forward's KernelCall and arrays, as calls.hopper_forward makes them (GQA,
    cross-attention; the options of Problem: a window (left, right), a soft cap, ALiBi)."""
    p, config, q, kv, offsets = _problem(dim, causal, layout, dtype, window=window, softcap=softcap,
                                         alibi=alibi)
    (call,) = _captured(calls.hopper_forward, p, config, q, kv, kv, offsets, offsets,
                        jnp.ones(4, jnp.float32) if alibi else None)
    return call


def hopper_backward_calls(dim: int, causal: bool, layout: str, dtype, window=(None, None), softcap=None,
                          alibi=False, dkdv_block_m=None, fused_dq=False):
    """The Hopper backward's two KernelCalls (dk/dv, dq) and arrays, as calls.hopper_backward makes them
    (GQA, cross-attention; the options as `hopper_call`'s); with `fused_dq` (HopperConfig.fused_dq) its
    one, of the dq-fused dk/dv kernel."""
    p, config, q, kv, offsets = _problem(dim, causal, layout, dtype, dkdv_block_m, window=window,
                                         softcap=softcap, alibi=alibi)
    config = dataclasses.replace(config, fused_dq=fused_dq)
    lse = jnp.zeros(p.stats_shape, jnp.float32)
    recorded = _captured(calls.hopper_backward, p, config, q, kv, kv, offsets, offsets, q, lse, q,
                         jnp.ones(4, jnp.float32) if alibi else None)
    recorded = [c for c in recorded if c[0].descriptors]  # the preprocess is the portable kernel
    assert len(recorded) == (1 if fused_dq else 2)
    return recorded


def compile_for_sm90(call, arrays):
    """The call's Gluon kernel compiled for sm_90a as jax-triton 0.4.1 compiles it (the probe's
    `compile_for_sm90`: make_ttir on the Gluon module too, which triton.compile skips; Triton 3.6's
    verifier rejected there what triton.compile accepted), then assembled by Triton's ptxas. Returns
    (ptx, metadata)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    blocks = dict(call.descriptors)
    described = lambda i, a: dict(dtype=jnp.dtype(a.dtype).name, **({"block": list(blocks[i])}  # noqa: E731
                                                                   if i in blocks else {}))
    # (the kernel has no argument for the results of the inputs it updates in place: after its outputs)
    outputs = call.out_shapes[:len(call.spec.outputs)]
    launch = dict(constants=call.constants, arrays=[described(i, a) for i, a in enumerate(arrays)],
                  out=[dict(dtype=jnp.dtype(s.dtype).name) for s in outputs])
    signature, attrs = ptx.kernel_signature(call.kernel, launch)
    backend_options = dict(gpu.COMPILE_OPTIONS, maxnreg=call.max_registers)
    text, metadata = ptx.compile_for_sm90(call.kernel, signature, call.constants, attrs, call.num_warps,
                                          call.num_stages, backend_options)
    backend = CUDABackend(GPUTarget("cuda", 90, 128))
    options = backend.parse_options(dict(num_warps=call.num_warps, num_stages=call.num_stages,
                                         **backend_options))
    backend.make_cubin(text, metadata, options, 90)
    return text, metadata


def check_compiled(ptx: str, metadata: dict):
    """384 threads (two consumer warpgroups and the producer's, which jax-triton 0.4.1 launches through
    _compat's PTX shim), the register split of setmaxnreg, wgmma and TMA loads, and shared memory within
    the H100/H200's 227 KB."""
    from jagged_flash_jax import _compat

    assert _compat.ptx_warps(ptx) == 12
    registers = set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {str(configs.HOPPER_CONSUMER_REGS), str(configs.HOPPER_PRODUCER_REGS)} <= registers
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert metadata["shared"] <= 232448


def products_in_flight(ptx: str) -> int:
    """The most wgmma groups a warpgroup has in flight at once in straight-line PTX order: a
    commit_group opens one, wait_group N leaves at most N."""
    most = open_groups = 0
    for op, pending in re.findall(r"wgmma\.(commit_group|wait_group)\.sync\.aligned\s*(\d*)", ptx):
        open_groups = open_groups + 1 if op == "commit_group" else min(open_groups, int(pending))
        most = max(most, open_groups)
    return most


# (dim, causal, layout, dtype, options): one compile per head dimension (at these lengths both take
# 128x64 tiles, the narrow bands' at D = 128), every option on at both (a window's two bounds, a soft
# cap and ALiBi, the constexprs that add code to the score tile; the cap above 64 at D = 256, where its
# tanh takes the series near 0), causal at one and not at the other,
# each layout and 16-bit type once. The kernel with options off is the same less those branches; the
# GPU run (CASES below) launches it plain, causal and with the options at both head dimensions.
COMPILE_CASES = [(128, True, "HTD", jnp.float16, dict(window=(16, 4), softcap=5.0, alibi=True)),
                 (256, False, "THD", jnp.bfloat16, dict(window=(40, 8), softcap=500.0, alibi=True))]


def _compile_id(x):
    if isinstance(x, dict):
        return "-".join(f"{k}={v}" for k, v in x.items()) or "plain"
    return jnp.dtype(x).name if isinstance(x, type) else str(x)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,layout,dtype,options", COMPILE_CASES, ids=_compile_id)
def test_the_hopper_forward_compiles_for_sm90a(dim, causal, layout, dtype, options):
    """With the constants the launcher passes, through jax-triton's pipeline (`compile_for_sm90`)."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper forward is unavailable)")
    start = time.perf_counter()
    ptx, metadata = compile_for_sm90(*hopper_call(dim, causal, layout, dtype, **options))
    check_compiled(ptx, metadata)
    assert time.perf_counter() - start < 60
    # Its waits as written (configs.HOPPER_FWD_TRITON_STAGES: no Triton pipeliner): the next tile's S
    # in flight beside P V. The pipeliner's wait_group 0 after each product would leave one.
    assert products_in_flight(ptx) == 2


# (dim, causal, layout, dtype, options): both head dimensions (their dq pipelines differ: 128 keys on
# 3 stages, and at these lengths D = 128's narrow 64 keys on 2), each layout and 16-bit type once;
# causal without options at D = 64 (the kernels' paths without a window: the dk/dv programs' causal
# tile test), every option on at D = 128 (a window's two bounds, a soft cap and ALiBi: the windowed
# tile ranges and masks, the score transform and the cap's tanh with its series (a cap above 64), the
# cap's derivative), not causal; and D = 256 (dk/dv's split columns) causal with every option. The GPU
# run (BACKWARD_CASES below) launches every head dimension plain, causal and with the options.
BACKWARD_COMPILE_CASES = [(64, True, "THD", jnp.bfloat16, {}),
                          (128, False, "HTD", jnp.float16, dict(window=(40, 8), softcap=100.0, alibi=True)),
                          (256, True, "THD", jnp.bfloat16, dict(window=(40, 8), softcap=100.0, alibi=True))]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,layout,dtype,options", BACKWARD_COMPILE_CASES, ids=_compile_id)
def test_the_hopper_backward_compiles_for_sm90a(dim, causal, layout, dtype, options):
    """The dk/dv and dq kernels with the constants calls.hopper_backward passes, through jax-triton's
    pipeline: as the forward."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    for call, arrays in hopper_backward_calls(dim, causal, layout, dtype, **options):
        ptx, metadata = compile_for_sm90(call, arrays)
        check_compiled(ptx, metadata)


def narrower_dkdv_table(tmp_path, block_m: int) -> str:
    """A tuned tile table (the file $JAGGED_FLASH_JAX_TUNED_CONFIGS names) whose Hopper entries at D = 128
    give dk/dv query tiles of `block_m` rows, as a tuned table may."""
    entries = []
    for key, tiles in configs.BUILTIN_TABLE.items():
        if key[1] == "hopper" and key[3] == 128:
            tiles = dataclasses.replace(tiles, dkdv=dataclasses.replace(tiles.dkdv, block_m=block_m))
            entries.append(configs.entry_to_json(key, tiles))
    path = tmp_path / f"dkdv{block_m}.json"
    path.write_text(json.dumps(entries))
    return str(path)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
def test_the_hopper_dkdv_compiles_with_query_tiles_narrower_than_a_warp():
    """A tuned table may give dk/dv 16-query tiles: its producer's statistics (a tile's log-sum-exp and
    delta, spread over its warp's 32 lanes) still compile."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    (call, arrays), _ = hopper_backward_calls(128, False, "THD", jnp.bfloat16, dkdv_block_m=16)
    assert call.kernel.__name__ == "attention_bwd_dkdv_kernel" and call.constants["BLOCK_M"] == 16
    check_compiled(*compile_for_sm90(call, arrays))


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (None, 8))])
def test_dkdv_takes_its_own_waits_without_a_band_and_from_triton_3_7(causal, window):
    """Triton's num_stages (whether its pipeliner waits on every product) of the Hopper backward's
    kernels: dk/dv's own waits without causal or a window, and with either from triton 3.7 (whose
    pipeliner's PTX ptxas serializes, below); dq the pipeliner's always."""
    from jagged_flash_jax import _compat

    (dkdv, _), (dq, _) = hopper_backward_calls(128, causal, "THD", jnp.bfloat16, window=window)
    banded = causal or window != (None, None)
    own = not banded or _compat.triton_release() >= (3, 7)
    expected = configs.HOPPER_DKDV_UNBANDED_TRITON_STAGES if own else configs.HOPPER_BWD_TRITON_STAGES
    assert (dkdv.num_stages, dq.num_stages) == (expected, configs.HOPPER_BWD_TRITON_STAGES)
    assert configs.HOPPER_DKDV_UNBANDED_TRITON_STAGES != configs.HOPPER_BWD_TRITON_STAGES
    assert [configs.hopper_dkdv_triton_stages(banded, release) for release in ((3, 6, 0), (3, 9, 0))] == (
        [configs.HOPPER_BWD_TRITON_STAGES if banded else 0, 0])


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,window", [(64, True, (None, None)), (128, True, (None, None)),
                                               (128, False, (64, 0)), (128, False, (None, None))])
def test_ptxas_keeps_the_dkdv_products_asynchronous(dim, causal, window):
    """The dk/dv kernel, banded (causal, a window: where triton 3.9's pipeliner PTX had ptxas serialize
    every wgmma, its info C7513) or not (where K as S^T's register operand at D = 128 had it serialize
    them for want of registers, C7512), assembled for sm_90a by Triton's own ptxas: no serialized wgmma,
    and the SASS waits for all of a warpgroup's products (WARPGROUP.DEPBAR.LE gsb0, 0x0) no more often
    than the PTX asks it to (wgmma.wait_group 0)."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    (call, arrays), _ = hopper_backward_calls(dim, causal, "THD", jnp.bfloat16, window=window)
    code, _ = compile_for_sm90(call, arrays)
    report, sass = ptx.assemble_sm90a(code, sass=True)
    assert "serialized" not in report, report
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") <= code.count("wgmma.wait_group.sync.aligned 0")


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,kernel,ratio", [
    (64, False, "dkdv", (3, 1)), (64, True, "dkdv", (3, 1)), (128, False, "dkdv", (1, 2)),
    (128, False, "dq", (1, 4)), (128, True, "dq", (1, 4)), (256, False, "dq", (1, 16))])
def test_the_backward_reads_each_blocks_own_operand_from_registers(dim, causal, kernel, ratio):
    """dk/dv at D = 64 reads K, S^T's A operand, from registers (loaded once a block), not from shared
    memory at each tile. ratio = (products reading A from registers, from a descriptor), by k-steps per
    tile: dk/dv at D = 64 three to one (S^T, P^T dO and dS^T Q against V dO^T). Elsewhere only the
    operands a tile computes come from registers: dk/dv at D = 128 one to two (P^T dO, dS^T Q: 4 k-steps
    each, against S^T's and dP^T's 8; K from registers there serializes every wgmma, C7512), dq at
    D = 128 one to four (dS K's 4 against 8 each of S and dP: Q and dO from registers measured slower,
    docs/performance.md) and at D = 256 one to sixteen. Counted in the PTX as the wgmma of a register A
    operand ({a0, ...}) against those of a descriptor; ptxas serializes none of them."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    dkdv, dq = hopper_backward_calls(dim, causal, "THD", jnp.bfloat16)
    call, arrays = dq if kernel == "dq" else dkdv
    code, _ = compile_for_sm90(call, arrays)
    products = re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+\s+\{[^}]*\},\s*(\{|%rd)", code)
    registers, descriptors = products.count("{"), products.count("%rd")
    assert registers > 0 and registers * ratio[1] == descriptors * ratio[0], (registers, descriptors)
    report, _ = ptx.assemble_sm90a(code)
    assert "serialized" not in report, report


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,options", [(64, False, {}), (64, True, {}),
                                                (64, True, dict(window=(16, 4), softcap=5.0, alibi=True)),
                                                (128, False, {})])
def test_d64_dq_issues_its_next_key_tile_ahead_of_dq(dim, causal, options):
    """At D = 64 dq takes its own waits (Triton's num_stages 0) and issues the next key tile's S and dP
    ahead of dQ: its PTX waits with two and one products outstanding, and Triton's ptxas serializes
    none of them. D = 128 keeps one tile's products at a time under the pipeliner."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    _, (call, arrays) = hopper_backward_calls(dim, causal, "THD", jnp.bfloat16, **options)
    assert call.num_stages == configs.hopper_dq_triton_stages(dim) == (0 if dim == 64 else
                                                                        configs.HOPPER_BWD_TRITON_STAGES)
    code, _ = compile_for_sm90(call, arrays)
    ahead = "wgmma.wait_group.sync.aligned 2" in code and "wgmma.wait_group.sync.aligned 1" in code
    assert ahead == (dim == 64)
    report, _ = ptx.assemble_sm90a(code)
    assert "serialized" not in report, report


# (dim, causal, layout, dtype, options, block_m): the unfused kernels' compile cases (D = 64 causal, where
# one warpgroup takes a tile's whole dQ; D = 128 with every option on, where each takes half; not D = 256,
# whose blocks of 64 keys dq is not fused into), D = 128 causal, and the 16-query tiles a tuned table may
# give.
FUSED_DQ_COMPILE_CASES = ([(*case, None) for case in BACKWARD_COMPILE_CASES if case[0] != 256]
                          + [(128, True, "THD", jnp.bfloat16, {}, block_m) for block_m in (None, 16)])


def fused_dq_call(monkeypatch, tma: bool, dim, causal, layout, dtype, options, block_m):
    """The dq-fused dk/dv launch as calls.hopper_backward makes it where Triton's Gluon has the TMA
    reduce-add (`tma`) or not (`_compat.gluon_tma_reduce` pretended so)."""
    from jagged_flash_jax import _compat

    monkeypatch.setattr(_compat, "gluon_tma_reduce", lambda: tma)
    (call, arrays), = hopper_backward_calls(dim, causal, layout, dtype, dkdv_block_m=block_m, fused_dq=True,
                                            **options)
    return call, arrays


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,layout,dtype,options,block_m", FUSED_DQ_COMPILE_CASES, ids=_compile_id)
def test_the_fused_dq_hopper_backward_compiles_for_sm90a(dim, causal, layout, dtype, options, block_m,
                                                         monkeypatch):
    """The dq-fused dk/dv kernel that adds dq by atomics (HopperConfig.fused_dq where Triton's Gluon has
    no TMA reduce-add: 3.6), with the constants calls.hopper_backward passes, through jax-triton's
    pipeline and ptxas, as the unfused kernels: dQ's adds relaxed and four floats wide, its product a
    wgmma with K^T read transposed from shared memory, and its buffers within the shared memory (at the
    table's 2 stages of 64-query tiles). Compiled under triton 3.9 too, where the launcher takes the
    TMA kernel (below)."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    call, arrays = fused_dq_call(monkeypatch, False, dim, causal, layout, dtype, options, block_m)
    assert call.kernel.__name__ == "attention_bwd_dkdv_dq_kernel" and call.zeroed_outputs == (2, 3)
    assert call.aliases == ()
    ptx, metadata = compile_for_sm90(call, arrays)
    check_compiled(ptx, metadata)
    assert re.search(r"(red|atom)\.global\.gpu\.relaxed\.add\.v4\.f32", ptx)
    assert "cp.reduce.async.bulk.tensor" not in ptx
    # (both operands descriptors, A transposed: scale-d, scale-a, scale-b, trans-a = 1, trans-b = 1)
    assert re.search(r"wgmma\.mma_async[^;]*\}, %rd\d+, %rd\d+, [^,]+, 1, 1, 1, 1;", ptx)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice
@pytest.mark.parametrize("dim,causal,layout,dtype,options,block_m", FUSED_DQ_COMPILE_CASES, ids=_compile_id)
def test_the_tma_fused_dq_hopper_backward_compiles_for_sm90a(dim, causal, layout, dtype, options, block_m,
                                                             monkeypatch):
    """Where Triton's Gluon has the TMA reduce-add (3.7 on), the dq-fused kernel calls.hopper_backward
    launches adds each warpgroup's dQ tile from shared memory by it: `cp.reduce.async.bulk.tensor ...
    .add` into dq_acc's descriptor, float32 atomics from registers nowhere (the counter's integer adds
    stay), the product as in the atomics kernel, within the shared memory."""
    if not implementations.gluon_available():
        pytest.skip("this Triton has no triton.experimental.gluon (the Hopper backward is unavailable)")
    from jagged_flash_jax import _compat

    if not _compat.gluon_tma_reduce():
        pytest.skip("this Triton's Gluon has no TMA reduce-add (tma.async_atomic_add, triton >= 3.7)")
    call, arrays = fused_dq_call(monkeypatch, True, dim, causal, layout, dtype, options, block_m)
    assert call.kernel.__name__ == "attention_bwd_dkdv_dq_tma_kernel" and call.zeroed_outputs == (2,)
    assert call.aliases == ((10, 3),) and dict(call.descriptors)[10] == (call.constants["BLOCK_M"], 64)
    ptx, metadata = compile_for_sm90(call, arrays)
    check_compiled(ptx, metadata)
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add", ptx)
    assert not re.search(r"(red|atom)\.global[.\w]*\.f32", ptx)
    assert re.search(r"wgmma\.mma_async[^;]*\}, %rd\d+, %rd\d+, [^,]+, 1, 1, 1, 1;", ptx)


# ---------------------------------------------------------------------------------------------------
# On a Hopper GPU
# ---------------------------------------------------------------------------------------------------


class Chosen:
    """What ran: spies of the Hopper and portable implementations sharing one record (helpers.Spy), and
    the arguments that ask for `kind`'s pass ("forward" or "backward") on the Hopper kernels wherever they
    can run, else the portable ones (these short sequences take the portable ones under "auto"), the
    other pass on the portable ones. `ran` lists the kernel families ("hopper" for "hopper-fused-dq" too)
    that ran `kind`, in order."""

    def __init__(self, kind: str):
        device = select.current_device()
        if device.capability is None or device.capability[0] != 9:
            pytest.skip(f"needs a Hopper GPU (compute capability 9.x), not {device.capability}")
        self.kind, self.calls = kind, []
        self.hopper, self.portable = Spy("hopper", self.calls), Spy("portable", self.calls)
        asked = (self.hopper, self.portable)
        self.kwargs = (dict(implementation=asked, backward_implementation="portable") if kind == "forward"
                       else dict(implementation="portable", backward_implementation=asked))

    @property
    def ran(self) -> list[str]:
        return [name.removesuffix("-fused-dq") for kind, name, *_ in self.calls if kind == self.kind]


@pytest.fixture
def forward_kernels():
    """The forwards that ran (`Chosen`), the Hopper one asked for wherever it can run, on a Hopper GPU."""
    return Chosen("forward")


CASES = {
    # One sequence past max_seq_len (several 128-query blocks and 128-key tiles), one empty, one of 1.
    "self-causal": dict(lengths=[5, 0, 300, 1, 130], heads=4, dim=128, max_seq_len=256, causal=True),
    # Fewer queries than keys, an empty key sequence and an empty query sequence; GQA; keys truncated.
    "cross-nq<nk-causal-gqa": dict(lengths=[3, 80, 1, 0, 60], kv_lengths=[90, 200, 0, 5, 300], heads=4,
                                   kv_heads=2, dim=128, max_seq_len=256, kv_max_seq_len=240, causal=True),
    # More queries than keys under causal: the first n_q - n_k queries see no key (whole 128-query
    # blocks and parts of one); MQA; keys cut to 4.
    "cross-nq>nk-causal-mqa": dict(lengths=[200, 9, 130], kv_lengths=[5, 9, 2], heads=3, kv_heads=1,
                                   dim=128, max_seq_len=256, kv_max_seq_len=4, causal=True),
    "cross-gqa-truncated": dict(lengths=[70, 0, 250], kv_lengths=[400, 3, 0], heads=4, kv_heads=2, dim=128,
                                max_seq_len=160, kv_max_seq_len=320),
    "self-D256-scale": dict(lengths=[17, 200, 90], heads=2, dim=256, max_seq_len=256, scale=0.07),
    "cross-D256-causal-gqa": dict(lengths=[150, 3, 64], kv_lengths=[100, 70, 200], heads=4, kv_heads=2,
                                  dim=256, max_seq_len=128, kv_max_seq_len=150, causal=True),
    # The options (kernels/hopper/forward.py visits only the key blocks of each 128-query block's band, masks
    # its edge blocks): a left window under causal (diagonal and left-edge blocks, the first key block
    # past 0), GQA, a sequence past max_seq_len and an empty one.
    "window-left-causal-gqa": dict(lengths=[300, 0, 7, 200], heads=4, kv_heads=2, dim=128, max_seq_len=256,
                                   causal=True, window=(100, None)),
    # A right window alone (not causal), a soft cap; cross, MQA, keys truncated, empty sequences.
    "cross-window-right-softcap-mqa": dict(lengths=[150, 3, 0, 260], kv_lengths=[90, 200, 5, 300], heads=4,
                                           kv_heads=1, dim=128, max_seq_len=256, kv_max_seq_len=280,
                                           window=(None, 40), softcap=20.0),
    # Both bounds and ALiBi at D = 256 (64-key tiles), more queries than keys: queries past the band.
    "cross-window-both-alibi-D256": dict(lengths=[17, 200, 90, 140], kv_lengths=[30, 120, 90, 0], heads=2,
                                         dim=256, max_seq_len=192, window=(30, 70), alibi=True),
    # Narrow bands (64-key tiles): each consumer warpgroup computes only the tiles its own rows see, so
    # one warpgroup passes tiles the other computes (the first, the last, the last block's tail tile),
    # and in the last blocks of 150 and 70 tokens warpgroup 1 has no row or few.
    "narrow-window-causal-gqa": dict(lengths=[150, 70, 1, 200, 0, 64], heads=4, kv_heads=2, dim=128,
                                     max_seq_len=192, causal=True, window=(8, None)),
    "cross-narrow-window-both": dict(lengths=[130, 5, 0, 250], kv_lengths=[140, 9, 3, 200], heads=2, dim=128,
                                     max_seq_len=256, window=(6, 5)),
    # A soft cap above 64 (its tanh takes the series near 0: shared.SERIES_CAP_LOG2), scores far below it.
    "softcap-above-64": dict(lengths=[300, 0, 129, 64], heads=2, dim=128, max_seq_len=256, scale=1.0,
                             softcap=200.0),
    # Causal from 513 to 1024 tokens (the table's fwd_causal: 64-key tiles in 3 stages, warpgroup 0
    # passing the diagonal block's last tile): sequences past max_seq_len, empty, of 1, GQA.
    "self-causal-long-gqa": dict(lengths=[700, 0, 1000, 1, 300, 513], heads=4, kv_heads=2, dim=128,
                                 max_seq_len=900, causal=True),
    # Everything at once, causal with n_q > n_k (whole query blocks see no key), GQA.
    "cross-causal-all-options-gqa": dict(lengths=[200, 9, 130], kv_lengths=[60, 9, 300], heads=4, kv_heads=2,
                                         dim=128, max_seq_len=256, kv_max_seq_len=100, causal=True,
                                         window=(50, None), softcap=10.0, alibi=True),
}


def slopes_for(heads: int) -> np.ndarray:
    """ALiBi slopes of every magnitude: the last far steeper than the others."""
    return np.asarray([0.5**h for h in range(1, heads)] + [2.0], np.float32)


def matches_float64(spec: dict, layout: str, precision: str, seed: int, **options) -> None:
    """A case of CASES or BACKWARD_CASES on the GPU kernels that `options` ask for (Chosen.kwargs): o and
    dq, dk, dv against float64, with the case's options (a window, a soft cap, ALiBi with `slopes_for`'s
    slopes)."""
    spec = dict(spec)
    dtype, _, tol = TOLERANCES[precision]
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None),
                       lead=3, extra=70, seed=seed, scale=0.6)
    slopes = slopes_for(batch.q.shape[1]) if spec.pop("alibi", False) else None
    if slopes is not None:
        options["alibi_slopes"] = jnp.asarray(slopes)
    results = run_vjp(jfa.jagged_attention, batch, dtype, layout=layout, **spec, **options)
    max_len, kv_max = spec["max_seq_len"], spec.get("kv_max_seq_len", spec["max_seq_len"])
    scale = spec.get("scale", batch.q.shape[-1] ** -0.5)
    expected = reference(*results[:4], batch.offsets, max_len, kv_offsets=batch.kv_offsets,
                         kv_max_seq_len=kv_max, scale=scale, causal=spec.get("causal", False),
                         window=spec.get("window", (None, None)), softcap=spec.get("softcap"),
                         alibi_slopes=slopes)
    assert_matches(results, expected, tol,
                   attended_q=attended_mask(batch.offsets, batch.q.shape[0], max_len),
                   attended_kv=attended_mask(batch.key_offsets, batch.k.shape[0], kv_max))


def check(case: str, layout: str, precision: str, forward_kernels, **options):
    matches_float64(CASES[case], layout, precision, seed=len(case), **forward_kernels.kwargs, **options)
    assert forward_kernels.ran == ["hopper"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["THD", "HTD"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64(case, layout, forward_kernels):
    check(case, layout, "bf16", forward_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["cross-nq<nk-causal-gqa", "cross-D256-causal-gqa"])
def test_float16(case, forward_kernels):
    check(case, "THD", "fp16", forward_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["self-causal", "cross-nq<nk-causal-gqa"])
def test_int64_offsets(case, forward_kernels):
    with jax.enable_x64(True):
        check(case, "HTD", "bf16", forward_kernels, offsets_dtype=np.int64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["self-causal", "cross-nq>nk-causal-mqa", "self-D256-scale"])
def test_the_portable_forward_on_the_same_cases(case, forward_kernels):
    """implementation="portable" on the same cases: the portable forward, as right."""
    matches_float64(CASES[case], "THD", "bf16", seed=len(case), implementation=forward_kernels.portable)
    assert forward_kernels.ran == ["portable"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HTD", "THD"])
def test_fbgemm_op(layout, forward_kernels):
    """FBGEMM's op: no scale, output divided by max_seq_len; sequences past it and empty ones."""
    max_len = 200
    batch = Batch.make([5, 0, 300, 130, 1], 3, 128, lead=2, extra=40, seed=6, scale=0.3)
    results = run_vjp(jfa.multi_head_jagged_flash_attention, batch, jnp.bfloat16, layout=layout,
                      max_seq_len=max_len, **forward_kernels.kwargs)
    assert forward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=1.0, out_scale=1.0 / max_len)
    attended = attended_mask(batch.offsets, batch.q.shape[0], max_len)
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


def poison_unattended(batch, operand: str, max_len: int) -> np.ndarray:
    """nan in every third token of `operand` that no sequence attends, inf in the next ones; returns the
    attended mask."""
    attended = attended_mask(batch.offsets, len(batch.q), max_len)
    poisoned = getattr(batch, operand).copy()
    poisoned[np.flatnonzero(~attended)[::3]] = np.nan
    poisoned[np.flatnonzero(~attended)[1::3]] = np.inf
    setattr(batch, operand, poisoned)
    return attended


@pytest.mark.gpu
@pytest.mark.parametrize("operand", ["q", "k", "v"])
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_inf_and_nan_in_unattended_tokens_stay_out(operand, layout, forward_kernels):
    """inf and nan in the tokens past max_seq_len and after the last sequence, which the 128-row query
    and key tiles of the sequences before them read (and the value tile's rows past the keys, zeroed
    before P V reads them): every output and gradient finite, matching float64, 0 where unattended."""
    max_len, dim = 150, 128
    batch = Batch.make([5, 0, 200, 3], 2, dim, kv_heads=1, extra=90, seed=3)
    attended = poison_unattended(batch, operand, max_len)
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                      causal=operand == "k", **forward_kernels.kwargs)
    assert forward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=dim**-0.5, causal=operand == "k")
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


@pytest.mark.gpu
@pytest.mark.parametrize("operand,layout", [("k", "THD"), ("v", "HTD")])
def test_inf_and_nan_in_unattended_tokens_with_the_options(operand, layout, forward_kernels):
    """The same with a window of both bounds, a soft cap and ALiBi (GQA): the band's edge blocks mask
    the tokens past each sequence, and the last value tile of each block's band is zeroed past the
    band's end (there the sequence's next tokens, or the poisoned ones past it)."""
    max_len, dim, heads = 150, 128, 4
    batch = Batch.make([5, 0, 200, 140, 3], heads, dim, kv_heads=2, extra=90, seed=7)
    attended = attended_mask(batch.offsets, len(batch.q), max_len)
    poisoned = getattr(batch, operand).copy()
    poisoned[np.flatnonzero(~attended)[::3]] = np.nan
    poisoned[np.flatnonzero(~attended)[1::3]] = -np.inf
    setattr(batch, operand, poisoned)
    options = dict(window=(70, 20), softcap=8.0)
    slopes = slopes_for(heads)
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                      alibi_slopes=jnp.asarray(slopes), **forward_kernels.kwargs, **options)
    assert forward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=dim**-0.5, alibi_slopes=slopes,
                         **options)
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


@pytest.mark.gpu
def test_a_soft_cap_on_large_logits(forward_kernels):
    """Logits to 1e12 through a soft cap (q = k * 2**30, scale 1/3): tanh saturates to exactly +-1 on
    most scores, so rows tie at the cap: o matches float64 (the top keys' mean of v), and the gradients
    from the log-sum-exp the backward reads stay finite (their float64 values hinge on the rare exact
    zero dot products where the cap's derivative is 1)."""
    dim = 128
    batch = Batch.make([13, 140, 2, 300], 2, dim, extra=3, seed=9)
    batch.k = np.random.default_rng(5).integers(-8, 9, batch.k.shape).astype(np.float64)
    batch.q = batch.k * 2.0**30
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout="THD", max_seq_len=256,
                      scale=1 / 3, softcap=40.0, causal=True, **forward_kernels.kwargs)
    assert forward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, 256, scale=1 / 3, softcap=40.0, causal=True)
    assert all(np.all(np.isfinite(x)) for x in results[4:])
    assert relative_error(results[4], expected[0]) < TOLERANCES["bf16"][2]


@pytest.mark.gpu
@pytest.mark.parametrize("scale,exponent,layout", [(None, 10, "THD"), (1 / 3, 30, "HTD"), (0.7, 59, "THD")],
                         ids=["default-scale-logits~1e6", "scale-1/3-logits~1e12", "scale-0.7-logits~1e21"])
def test_large_logits_with_any_scale(scale, exponent, layout, forward_kernels):
    """Exact scores up to 1e21 (q = k * 2**exponent, k small integers: every product exact in float32)
    whose softmax rows are one-hot (each query's top key is its own token, the others far below): o is
    v exactly, which needs the row max subtracted from the unscaled score before the scale multiplies;
    dv, from the portable backward fed this log-sum-exp, matches float64 to bfloat16 rounding."""
    results, expected = one_hot_rows(scale, exponent, layout, 128, forward_kernels)
    assert forward_kernels.ran == ["hopper"]
    assert relative_error(results[4], expected[0]) < 1e-6
    assert relative_error(results[7], expected[3]) < TOLERANCES["bf16"][2]


def one_hot_rows(scale, exponent, layout, dim, kernels):
    """`test_large_logits_with_any_scale`'s problem run forward and backward by `kernels` (`Chosen`):
    (results, float64 reference), results' gradients checked finite."""
    batch = Batch.make([13, 140, 2], 2, dim, extra=3, seed=9)
    batch.k = np.random.default_rng(5).integers(-8, 9, batch.k.shape).astype(np.float64)
    batch.q = batch.k * 2.0**exponent
    kwargs = {} if scale is None else {"scale": scale}
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=256,
                      **kernels.kwargs, **kwargs)
    for b in range(3):
        tokens = slice(batch.offsets[b], batch.offsets[b + 1])
        scores = np.sort(np.einsum("qhd,khd->hqk", results[0][tokens], results[1][tokens]), axis=-1)
        assert np.all(scores[..., -1] > scores[..., -2]), "a tie at the top: pick another seed"
    expected = reference(*results[:4], batch.offsets, 256, scale=dim**-0.5 if scale is None else scale)
    assert all(np.all(np.isfinite(x)) for x in results[4:])
    return results, expected


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_lse_and_its_gradient_match_the_portable_forward(layout, forward_kernels):
    """return_lse=True: o, the log-sum-exp (-inf where no key or unattended) and the gradients of a loss
    of both (the portable backward, fed each forward's log-sum-exp) from the Hopper forward match the
    portable forward's."""
    batch = Batch.make([150, 0, 40, 260], 4, 128, kv_lengths=[100, 20, 0, 300], kv_heads=2, lead=1, extra=20,
                       seed=4, scale=0.6)
    q, k, v, _ = batch.arrays(jnp.bfloat16, layout)
    offsets, kv_offsets = (jnp.asarray(x, jnp.int32) for x in (batch.offsets, batch.kv_offsets))

    def loss(q, k, v, forward):
        o, lse = jfa.jagged_attention(q, k, v, offsets, 256, kv_offsets=kv_offsets, causal=True,
                                      layout=layout, implementation=forward,
                                      backward_implementation="portable", return_lse=True)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(finite)), (o, lse)

    results = {}
    for forward in (forward_kernels.hopper, forward_kernels.portable):
        (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, forward)
        results[forward.name] = [np.asarray(x, np.float64) for x in (o, lse, *grads)]
    assert forward_kernels.ran == ["hopper", "portable"]
    hopper, portable = results["hopper"], results["portable"]
    np.testing.assert_array_equal(np.isfinite(hopper[1]), np.isfinite(portable[1]))
    assert np.all(hopper[1][~np.isfinite(hopper[1])] == -np.inf)
    finite = np.isfinite(hopper[1])
    np.testing.assert_allclose(hopper[1][finite], portable[1][finite], rtol=1e-3, atol=1e-3)
    for name, got, want in zip(("o", "dq", "dk", "dv"), [hopper[0], *hopper[2:]],
                               [portable[0], *portable[2:]]):
        assert relative_error(got, want) < 1e-2, name


@pytest.mark.gpu
def test_a_jitted_training_step_runs_twice(forward_kernels):
    """A jitted forward + backward with the Hopper forward, run twice (host-made TMA descriptors: XLA's
    command buffers, CUDA graphs, must take the launch), with the same results both times."""
    batch = Batch.make([300, 5, 128], 4, 128, seed=1, scale=0.5)
    q, k, v, _ = batch.arrays(jnp.bfloat16)
    offsets = jnp.asarray(batch.offsets, jnp.int32)

    @jax.jit
    def step(q, k, v):
        loss = lambda q, k, v: jnp.sum(jfa.jagged_attention(  # noqa: E731
            q, k, v, offsets, 256, causal=True, **forward_kernels.kwargs).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    first = jax.block_until_ready(step(q, k, v))
    second = jax.block_until_ready(step(q, k, v))
    assert forward_kernels.ran == ["hopper"]
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# Offsets into 300 tokens, max_seq_len 200 (two 128-query blocks): sorted with tokens before the first
# sequence, after the last and past max_seq_len; decreasing (clamped to empty sequences) without
# overlap, which the fill programs check token by token; past the end, negative, and one past 2**31.
FILL_OFFSETS = {"sorted-gaps": [7, 50, 50, 290], "unsorted": [250, 10, 240, -3, 5],
                "past-the-end": [-(2**31), 280, 2**31 - 1, 120]}


@pytest.mark.gpu
@pytest.mark.parametrize("layout,causal", [("THD", True), ("HTD", False)])
def test_rows_no_block_computes_are_zero_and_inf(layout, causal, forward_kernels):
    """The kernel's own zero fill (no pre-filled output): the Hopper forward, each time into memory just
    freed full of NaN, with offsets of every kind (FILL_OFFSETS): o exactly 0 and the kernel's
    log-sum-exp exactly +inf on every row that no query block writes, and the rows it does write equal
    to the portable forward's (o to rounding, the log-sum-exp finite)."""
    tokens, heads, dim, max_len = 300, 4, 128, 200
    rng = np.random.default_rng(2)
    shape = (tokens, heads, dim) if layout == "THD" else (heads, tokens, dim)
    kv_shape = shape[:1] + (2,) + shape[2:] if layout == "THD" else (2, tokens, dim)
    q = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16) for _ in range(2))
    for name, values in FILL_OFFSETS.items():
        offsets = jnp.asarray(values, jnp.int32)
        shape_only = jnp.zeros_like(offsets)  # the Problem needs the batch only (these would be refused)
        p = checks.attention_problem(q, k, v, shape_only, shape_only, max_seq_len=max_len,
                                     kv_max_seq_len=max_len, scale=dim**-0.5, out_scale=1.0, causal=causal,
                                     layout=layout, allow_tf32=True, self_attention=True, validate=False)
        results = {}
        for impl in (forward_kernels.hopper, forward_kernels.portable):
            config = select.choose(p, select.request(implementation=impl)).forward_config
            for poison in (jnp.full(shape, jnp.nan, jnp.bfloat16), jnp.full(p.stats_shape, jnp.nan)):
                poison.block_until_ready().delete()  # its memory, free, for the outputs to reuse
            o, lse = impl.forward(p, config, q, k, v, offsets[None], offsets[None], None)
            results[impl.name] = (to_numpy(o, layout), np.asarray(lse)[0].T)  # [tokens, H, D], [tokens, H]
        mask = attended_mask(values, tokens, max_len)
        (o, lse), (o_portable, lse_portable) = results["hopper"], results["portable"]
        assert np.all(o[~mask] == 0), (name, np.flatnonzero(~mask & np.any(o != 0, axis=(1, 2))))
        assert np.all(lse[~mask] == np.inf), (name, np.flatnonzero(~mask & np.any(lse != np.inf, axis=1)))
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[mask])), name
        assert relative_error(o, o_portable) < 1e-2, name
        np.testing.assert_allclose(lse[mask], lse_portable[mask], rtol=1e-3, atol=1e-3, err_msg=name)
    assert forward_kernels.ran == ["hopper", "portable"] * len(FILL_OFFSETS)


# ---------------------------------------------------------------------------------------------------
# The Hopper backward (kernels/hopper/dkdv.py, dq.py), on a Hopper GPU
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def backward_kernels():
    """The backwards that ran (`Chosen`), the Hopper one asked for wherever it can run, on a Hopper GPU."""
    return Chosen("backward")


BACKWARD_CASES = {
    "self-causal": CASES["self-causal"],
    "cross-nq<nk-causal-gqa": CASES["cross-nq<nk-causal-gqa"],
    "cross-nq>nk-causal-mqa": CASES["cross-nq>nk-causal-mqa"],
    "cross-gqa-truncated": CASES["cross-gqa-truncated"],  # not causal
    # D = 64 (3 stages of 128-key tiles in the dq programs), more keys than queries, not causal, GQA.
    "cross-D64-gqa": dict(lengths=[200, 0, 64, 129], kv_lengths=[300, 7, 0, 129], heads=4, kv_heads=2, dim=64,
                          max_seq_len=256, kv_max_seq_len=280),
    # The options (the dq programs visit their block's band, the dk/dv programs the query tiles whose
    # queries see their keys, both masking the band's edge tiles). Each with empty sequences and one
    # past max_seq_len. A left window under causal, GQA (the forward's case).
    "window-left-causal-gqa": CASES["window-left-causal-gqa"],
    # Causal at D = 64 past 256 tokens: the portable forward on its entry's fwd_causal (4-warp tiles of 64
    # queries); sequences past max_seq_len, of 1, empty and of one 64-query block and one more; GQA.
    "self-causal-D64-gqa": dict(lengths=[700, 0, 1, 300, 65], heads=4, kv_heads=2, dim=64, max_seq_len=600,
                                causal=True),
    # A left window alone, not causal, D = 64: long enough that query tiles before and after a key
    # block's band are skipped.
    "window-left-D64": dict(lengths=[400, 0, 5, 260], heads=2, dim=64, max_seq_len=384, window=(90, None)),
    # A right window alone; cross both ways (n_q > n_k, n_q < n_k), GQA, keys truncated.
    "cross-window-right-gqa": dict(lengths=[150, 3, 0, 260], kv_lengths=[90, 200, 5, 300], heads=4,
                                   kv_heads=2, dim=128, max_seq_len=256, kv_max_seq_len=280,
                                   window=(None, 40)),
    # Both bounds, D = 64; cross both ways (keys of the last sequence empty), GQA, both truncated.
    "cross-window-both-D64-gqa": dict(lengths=[17, 600, 90, 140], kv_lengths=[30, 500, 90, 0], heads=4,
                                      kv_heads=2, dim=64, max_seq_len=512, kv_max_seq_len=480,
                                      window=(60, 130)),
    # A right window and a soft cap, MQA (the forward's case).
    "cross-window-right-softcap-mqa": CASES["cross-window-right-softcap-mqa"],
    # Narrow bands (the forward's cases, where the forward's warpgroups pass tiles): the backward of a
    # forward that computed some tiles in one warpgroup only.
    "narrow-window-causal-gqa": CASES["narrow-window-causal-gqa"],
    "cross-narrow-window-both": CASES["cross-narrow-window-both"],
    # A soft cap alone, D = 64, at scores large enough against it that its derivative matters.
    "softcap-D64": dict(lengths=[300, 0, 129, 64], heads=2, dim=64, max_seq_len=256, scale=1.0, softcap=3.0),
    # The soft cap's series (the forward's case).
    "softcap-above-64": CASES["softcap-above-64"],
    # ALiBi alone (`slopes_for`'s slopes, one steep); cross both ways, GQA, keys truncated.
    "cross-alibi-gqa": dict(lengths=[200, 9, 130, 0], kv_lengths=[60, 9, 300, 40], heads=4, kv_heads=2,
                            dim=128, max_seq_len=256, kv_max_seq_len=256, alibi=True),
    # Everything with causal: n_q > n_k (whole query blocks see no key), GQA (the forward's case); and at
    # D = 64 with n_q < n_k, MQA.
    "cross-causal-all-options-gqa": CASES["cross-causal-all-options-gqa"],
    "cross-causal-all-options-D64-mqa": dict(lengths=[3, 80, 1, 0, 260], kv_lengths=[90, 200, 0, 5, 300],
                                             heads=3, kv_heads=1, dim=64, max_seq_len=256,
                                             kv_max_seq_len=280, causal=True, window=(70, None),
                                             softcap=10.0, alibi=True),
    # D = 256: dk/dv on blocks of 64 keys whose columns the two warpgroups split, each computing P^T and
    # dS^T of half of a query tile (the forward's cases: a scale; cross, causal, GQA; both window
    # bounds and ALiBi), and a soft cap at scores large against it.
    "self-D256-scale": CASES["self-D256-scale"],
    "cross-D256-causal-gqa": CASES["cross-D256-causal-gqa"],
    "cross-window-both-alibi-D256": CASES["cross-window-both-alibi-D256"],
    "softcap-D256": dict(lengths=[300, 0, 129, 64], heads=2, dim=256, max_seq_len=256, scale=0.5,
                         softcap=4.0),
}


def check_backward(case: str, layout: str, precision: str, backward_kernels, **options):
    """`matches_float64` on BACKWARD_CASES (o from the portable forward), and the backward that ran."""
    matches_float64(BACKWARD_CASES[case], layout, precision, seed=len(case) + 1, **backward_kernels.kwargs,
                    **options)
    assert backward_kernels.ran == ["hopper"]


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", [
    ("self-causal", "THD"), ("self-causal", "HTD"), ("cross-nq<nk-causal-gqa", "THD"),
    ("cross-nq<nk-causal-gqa", "HTD"), ("cross-nq>nk-causal-mqa", "THD"), ("cross-nq>nk-causal-mqa", "HTD"),
    ("cross-gqa-truncated", "HTD"), ("cross-D64-gqa", "THD"), ("self-causal-D64-gqa", "HTD"),
    ("window-left-causal-gqa", "THD"), ("window-left-causal-gqa", "HTD"), ("window-left-D64", "HTD"),
    ("cross-window-right-gqa", "THD"), ("cross-window-both-D64-gqa", "THD"),
    ("cross-window-both-D64-gqa", "HTD"), ("cross-window-right-softcap-mqa", "HTD"), ("softcap-D64", "THD"),
    ("cross-alibi-gqa", "HTD"), ("narrow-window-causal-gqa", "THD"), ("narrow-window-causal-gqa", "HTD"),
    ("cross-narrow-window-both", "THD"), ("cross-causal-all-options-gqa", "THD"),
    ("cross-causal-all-options-gqa", "HTD"), ("cross-causal-all-options-D64-mqa", "THD"),
    ("self-D256-scale", "THD"), ("self-D256-scale", "HTD"), ("cross-D256-causal-gqa", "THD"),
    ("cross-D256-causal-gqa", "HTD"), ("cross-window-both-alibi-D256", "THD"), ("softcap-D256", "HTD")],
    ids=str)
def test_backward_matches_float64(case, layout, backward_kernels):
    check_backward(case, layout, "bf16", backward_kernels)


@pytest.mark.gpu
def test_backward_float16(backward_kernels):
    check_backward("cross-nq<nk-causal-gqa", "HTD", "fp16", backward_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("case,layout", [("cross-D64-gqa", "THD"), ("cross-window-right-gqa", "HTD"),
                                         ("cross-causal-all-options-gqa", "THD"),
                                         ("cross-D256-causal-gqa", "HTD")], ids=str)
def test_backward_on_few_programs(case, layout, programs, backward_kernels):
    """Few persistent programs, each taking many blocks of both kernels in turn: the barriers' phases
    running on from block to block (dk/dv: K and V reloaded behind kv_free, the Q/dO ring and its tail
    barriers; dq: the Q tiles behind q_free, the K/V ring), and key blocks that no query sees (their dk,
    dv zeros) between the others."""
    with select.use_device(dataclasses.replace(select.current_device(), sms=programs)):
        check_backward(case, layout, "bf16", backward_kernels)
    assert backward_kernels.calls[-1][3].programs == programs


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("case,layout", [("cross-nq<nk-causal-gqa", "THD"),
                                         ("cross-causal-all-options-gqa", "HTD")], ids=str)
def test_backward_with_narrower_query_tiles(case, layout, block_m, backward_kernels, monkeypatch, tmp_path):
    """dk/dv streaming the 16- and 32-query tiles a tuned table may give (the producer's statistics
    spread over fewer rows than a warp's lanes at 16): the gradients still match float64."""
    monkeypatch.setenv(select.TUNED_CONFIGS_ENV, narrower_dkdv_table(tmp_path, block_m))
    check_backward(case, layout, "bf16", backward_kernels)
    assert backward_kernels.calls[-1][3].tiles.dkdv.block_m == block_m


@pytest.mark.gpu
@pytest.mark.parametrize("scale,exponent,layout,dim", [(None, 10, "THD", 128), (1 / 3, 30, "HTD", 64),
                                                       (0.7, 59, "THD", 256)],
                         ids=["default-scale-logits~1e6-D128", "scale-1/3-logits~1e12-D64",
                              "scale-0.7-logits~1e21-D256"])
def test_backward_at_large_logits(scale, exponent, layout, dim, backward_kernels):
    """The forward's one-hot rows at logits to 1e21 (`one_hot_rows`) through the Hopper backward: each
    top score, equal to its row's log-sum-exp, gets probability exactly 1 and the rest 0, so dv (the dO
    of the queries whose top key each key is) matches float64 to bfloat16 rounding, and nothing is
    inf or NaN."""
    results, expected = one_hot_rows(scale, exponent, layout, dim, backward_kernels)
    assert backward_kernels.ran == ["hopper"]
    assert relative_error(results[7], expected[3]) < TOLERANCES["bf16"][2]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["self-causal", "cross-nq<nk-causal-gqa", "cross-D64-gqa",
                                  "cross-D256-causal-gqa", "cross-causal-all-options-gqa"], ids=str)
def test_the_sequences_order_changes_no_bit(case):
    """The Hopper kernels taking the sequences with the most work first (Hopper(longest_first=True):
    these cases' lengths come in another order) or in the offsets' order (the default), forward and
    deterministic backward: o, dq, dk, dv bitwise equal, as each element is one program's either way."""
    Chosen("forward")  # (skips off Hopper GPUs)
    spec = dict(BACKWARD_CASES[case])
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None),
                       lead=3, extra=70, seed=len(case), scale=0.6)
    if spec.pop("alibi", False):
        spec["alibi_slopes"] = jnp.asarray(slopes_for(batch.q.shape[1]))
    # The passes the Hopper kernels run: the backward, and the forward but at D = 64, which has no Hopper
    # forward tiles (the portable forward runs there).
    hopper_passes = ("backward",) if "D64" in case else ("forward", "backward")
    results = []
    for longest_first in (True, False):
        calls_ = []
        hopper = Spy(dataclasses.replace(implementations.HOPPER, longest_first=longest_first), calls_)
        results.append(run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, implementation=(hopper, "portable"),
                               backward_implementation=hopper, **spec))
        assert [(kind, config.longest_first) for kind, _, _, config in calls_] == [
            (kind, longest_first) for kind in hopper_passes]
    for name, first, given in zip(("o", "dq", "dk", "dv"), results[0][4:], results[1][4:]):
        np.testing.assert_array_equal(first, given, err_msg=name)


LOG2E = float(np.log2(np.e))


@triton.jit
def _scaled_down_kernel(x_ptr, out_ptr, N: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, scaled_down(tl.load(x_ptr + offs), SCALE))


@functools.cache
def _interpreted_fma_is_exact() -> bool:
    """Whether the installed Triton's interpreter rounds tl.fma once (3.9's does; 3.6's multiplies, then
    adds), as the GPU does: scaled_down's test needs it."""
    x = np.full(16, 0.1, np.float32)
    out = np.empty_like(x)
    interpret.interpret(_scaled_down_kernel, (1,), x, out, N=16, SCALE=float(x[0]))
    return bool(out[0] < x[0] * x[0])  # 0.1f squared rounds up in float32


@pytest.mark.parametrize("scale", [1.0, LOG2E, LOG2E / np.sqrt(128), 0.7 * LOG2E, LOG2E / 3])
def test_scaled_down_rounds_toward_minus_infinity(scale):
    """The Hopper backward's log-sum-exp in exp2's units: the largest float32 not above the exact product
    of x and the float32 scale the kernels multiply by (so that s * QK_SCALE - it >= 0 where s = lse, in
    one FFMA), on random magnitudes of both signs (products within float32's range); zeros, infinities
    and NaN kept."""
    if not _interpreted_fma_is_exact():
        pytest.skip("this Triton's interpreter rounds tl.fma twice (the GPU rounds it once)")
    rng = np.random.default_rng(7)
    x = (rng.choice([-1.0, 1.0], 4096) * 10.0 ** rng.uniform(-30, 38, 4096)).astype(np.float32)
    x[:5] = [0.0, -0.0, np.inf, -np.inf, np.nan]
    out = np.empty_like(x)
    interpret.interpret(_scaled_down_kernel, (1,), x, out, N=x.size, SCALE=scale)
    exact = x.astype(np.float64) * np.float64(np.float32(scale))  # exact: 24-bit significands
    finite = np.isfinite(exact)
    assert np.all(out[finite].astype(np.float64) <= exact[finite])
    assert np.all(np.nextafter(out[finite], np.float32(np.inf)).astype(np.float64) > exact[finite])
    np.testing.assert_array_equal(out[:5], [0.0, -0.0, np.inf, -np.inf, np.nan])
    assert np.signbit(out[1])
    # Exact products kept; under a scale other than 1 most are inexact, so the rounding acted.
    inexact = exact[finite] != exact[finite].astype(np.float32)
    np.testing.assert_array_equal(out[finite] == exact[finite], ~inexact)
    assert scale == 1.0 or inexact.sum() > 1000


@pytest.mark.gpu
def test_the_portable_backward_on_a_case(backward_kernels):
    """backward_implementation="portable" on a case: the portable backward, as right."""
    case = "cross-nq>nk-causal-mqa"
    matches_float64(BACKWARD_CASES[case], "THD", "bf16", seed=len(case) + 1, implementation="portable",
                    backward_implementation=backward_kernels.portable)
    assert backward_kernels.ran == ["portable"]


@pytest.mark.gpu
def test_backward_fbgemm_op(backward_kernels):
    """FBGEMM's op: no scale, output divided by max_seq_len (OUT_SCALE, DS_SCALE); sequences past it and
    empty ones."""
    max_len = 200
    batch = Batch.make([5, 0, 300, 130, 1], 3, 128, lead=2, extra=40, seed=6, scale=0.3)
    results = run_vjp(jfa.multi_head_jagged_flash_attention, batch, jnp.bfloat16, layout="HTD",
                      max_seq_len=max_len, **backward_kernels.kwargs)
    assert backward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=1.0, out_scale=1.0 / max_len)
    attended = attended_mask(batch.offsets, batch.q.shape[0], max_len)
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


@pytest.mark.gpu
@pytest.mark.parametrize("operand,layout,dim", [("q", "THD", 128), ("k", "HTD", 128), ("v", "THD", 128),
                                               ("k", "THD", 256), ("v", "HTD", 256)])
def test_backward_keeps_inf_and_nan_in_unattended_tokens_out(operand, layout, dim, backward_kernels):
    """inf and nan in the tokens past max_seq_len and after the last sequence, which the 64-query tiles
    of the dk/dv programs (zeroed in shared memory past n_q) and the 128-key tiles of the dq programs
    (K zeroed past n_k, dS masked against V's) read: every gradient finite, matching float64, 0 where
    unattended. Causal on k, GQA; at D = 256 too (its split dk/dv's P^T and dS^T halves)."""
    max_len = 150
    batch = Batch.make([5, 0, 200, 3, 70], 4, dim, kv_heads=2, extra=90, seed=3)
    attended = poison_unattended(batch, operand, max_len)
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                      causal=operand == "k", **backward_kernels.kwargs)
    assert backward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=dim**-0.5, causal=operand == "k")
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


@pytest.mark.gpu
@pytest.mark.parametrize("operand,layout", [("q", "HTD"), ("k", "THD"), ("v", "HTD")])
def test_backward_keeps_inf_and_nan_in_unattended_tokens_out_with_the_options(operand, layout,
                                                                            backward_kernels):
    """The same with a window of both bounds, a soft cap and ALiBi (GQA): the band's edge tiles, masked,
    hold the tokens past each sequence (the poisoned ones past max_seq_len and after the last)."""
    max_len, dim, heads = 150, 128, 4
    batch = Batch.make([5, 0, 200, 140, 3], heads, dim, kv_heads=2, extra=90, seed=7)
    attended = poison_unattended(batch, operand, max_len)
    options = dict(window=(70, 20), softcap=8.0)
    slopes = slopes_for(heads)
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                      alibi_slopes=jnp.asarray(slopes), **backward_kernels.kwargs, **options)
    assert backward_kernels.ran == ["hopper"]
    expected = reference(*results[:4], batch.offsets, max_len, scale=dim**-0.5, alibi_slopes=slopes,
                         **options)
    assert_matches(results, expected, TOLERANCES["bf16"][2], attended_q=attended, attended_kv=attended)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(window=(70, 10), softcap=20.0, alibi=True), dict(dim=256)],
                         ids=["causal", "causal-all-options", "causal-D256"])
def test_backward_is_bitwise_deterministic_with_both_hopper_kernels(backward_kernels, options):
    """A jitted forward + backward, the Hopper forward and backward together, run twice: the same bits
    (no atomics: one writer per element), all finite; with a window, a soft cap and ALiBi too, and at
    D = 256 (its dk/dv warpgroups each write their own columns)."""
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = jnp.asarray([0.3, 0.1, 0.05, 0.02], jnp.float32)
    dim = options.pop("dim", 128)
    batch = Batch.make([300, 5, 128, 0, 257], 4, dim, kv_lengths=[260, 9, 300, 4, 100], kv_heads=2, seed=1,
                       scale=0.5)
    q, k, v, do = batch.arrays(jnp.bfloat16)
    offsets, kv_offsets = (jnp.asarray(x, jnp.int32) for x in (batch.offsets, batch.kv_offsets))

    @jax.jit
    def step(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: jfa.jagged_attention(
            q, k, v, offsets, 256, kv_offsets=kv_offsets, causal=True,
            implementation=(backward_kernels.hopper, backward_kernels.portable), **options), q, k, v)
        return o, *vjp(do)

    first = jax.block_until_ready(step(q, k, v, do))
    second = jax.block_until_ready(step(q, k, v, do))
    assert backward_kernels.ran == ["hopper"]
    assert [name for kind, name, *_ in backward_kernels.calls if kind == "forward"] == ["hopper"]
    for a, b in zip(first, second):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16)),
                                      np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint16)))


@pytest.mark.gpu
def test_backward_of_the_lse_matches_the_portable_backward(backward_kernels):
    """return_lse=True, a loss of o and the log-sum-exp (dlse taken from delta, as calls.delta does
    for both): the Hopper backward's gradients match the portable backward's."""
    batch = Batch.make([150, 0, 40, 260], 4, 128, kv_lengths=[100, 20, 0, 300], kv_heads=2, lead=1, extra=20,
                       seed=4, scale=0.6)
    q, k, v, _ = batch.arrays(jnp.bfloat16, "HTD")
    offsets, kv_offsets = (jnp.asarray(x, jnp.int32) for x in (batch.offsets, batch.kv_offsets))

    def loss(q, k, v, backward):
        o, lse = jfa.jagged_attention(q, k, v, offsets, 256, kv_offsets=kv_offsets, causal=True,
                                      layout="HTD", implementation="portable",
                                      backward_implementation=backward, return_lse=True)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(finite))

    results = {}
    for backward in (backward_kernels.hopper, backward_kernels.portable):
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, backward)
        results[backward.name] = [np.asarray(x, np.float64) for x in grads]
    assert backward_kernels.ran == ["hopper", "portable"]
    for name, got, want in zip(("dq", "dk", "dv"), results["hopper"], results["portable"]):
        assert np.all(np.isfinite(got)), name
        assert relative_error(got, want) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("layout,causal", [("THD", True), ("HTD", False)])
def test_backward_rows_no_block_computes_are_zero(layout, causal, backward_kernels):
    """The backward kernels' own zero fill (no pre-filled outputs): the Hopper backward, each time into
    memory just freed full of NaN, with offsets of every kind (FILL_OFFSETS): dq, dk, dv exactly 0 on
    every row that no block writes, and equal to the portable backward's elsewhere."""
    tokens, heads, dim, max_len = 300, 4, 128, 200
    rng = np.random.default_rng(2)
    shape = (tokens, heads, dim) if layout == "THD" else (heads, tokens, dim)
    kv_shape = shape[:1] + (2,) + shape[2:] if layout == "THD" else (2, tokens, dim)
    q, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16) for _ in range(2))
    for name, values in FILL_OFFSETS.items():
        offsets = jnp.asarray(values, jnp.int32)[None]
        shape_only = jnp.zeros_like(offsets[0])  # the Problem needs the batch only (these would be refused)
        p = checks.attention_problem(q, k, v, shape_only, shape_only, max_seq_len=max_len,
                                     kv_max_seq_len=max_len, scale=dim**-0.5, out_scale=1.0, causal=causal,
                                     layout=layout, allow_tf32=True, self_attention=True, validate=False)
        portable = implementations.PORTABLE
        o, lse = portable.forward(p, select.choose(p, select.request(implementation=portable)).forward_config,
                                  q, k, v, offsets, offsets, None)
        results = {}
        for impl in (backward_kernels.hopper, backward_kernels.portable):
            config = select.choose(p, select.request(implementation=impl)).backward_config
            for poison in (jnp.full(shape, jnp.nan, jnp.bfloat16), jnp.full(kv_shape, jnp.nan, jnp.bfloat16),
                           jnp.full(kv_shape, jnp.nan, jnp.bfloat16)):
                poison.block_until_ready().delete()  # its memory, free, for the outputs to reuse
            grads = impl.backward(p, config, q, k, v, offsets, offsets, o, lse, do, None, None)
            results[impl.name.removesuffix("-fused-dq")] = [to_numpy(x, layout) for x in grads]
        mask = attended_mask(values, tokens, max_len)
        for what, got, want in zip(("dq", "dk", "dv"), results["hopper"], results["portable"]):
            nonzero = np.flatnonzero(~mask & np.any(got != 0, axis=(1, 2)))
            assert np.all(got[~mask] == 0), (name, what, nonzero)
            assert np.all(np.isfinite(got)), (name, what)
            assert relative_error(got, want) < 1e-2, (name, what)
    assert backward_kernels.ran == ["hopper", "portable"] * len(FILL_OFFSETS)


# ---------------------------------------------------------------------------------------------------
# The Hopper backward with dq fused into the dk/dv kernel (HopperConfig.fused_dq), on a Hopper GPU
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def fused_dq_kernels():
    """The backwards that ran (`Chosen`), the Hopper one with dq fused into its dk/dv kernel
    (helpers.FusedDq) asked for wherever it can run, on a Hopper GPU."""
    chosen = Chosen("backward")
    chosen.hopper = FusedDq(chosen.calls)
    chosen.kwargs = dict(implementation="portable", backward_implementation=(chosen.hopper, chosen.portable))
    return chosen


def assert_fused(kernels: Chosen) -> None:
    """Every Hopper backward that ran fused dq."""
    configs_ = [config for kind, name, _, config in kernels.calls
                if (kind, name) == ("backward", "hopper-fused-dq")]
    assert configs_ and all(config.fused_dq for config in configs_)


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", [
    ("self-causal", "THD"), ("self-causal", "HTD"), ("cross-nq<nk-causal-gqa", "THD"),
    ("cross-nq<nk-causal-gqa", "HTD"), ("cross-nq>nk-causal-mqa", "THD"), ("cross-gqa-truncated", "HTD"),
    ("cross-D64-gqa", "THD"), ("window-left-causal-gqa", "THD"), ("window-left-causal-gqa", "HTD"),
    ("cross-window-right-gqa", "THD"), ("cross-window-both-D64-gqa", "HTD"),
    ("cross-window-right-softcap-mqa", "HTD"), ("cross-alibi-gqa", "THD"),
    ("narrow-window-causal-gqa", "THD"), ("cross-narrow-window-both", "HTD"),
    ("cross-causal-all-options-gqa", "THD"),
    ("cross-causal-all-options-gqa", "HTD"), ("cross-causal-all-options-D64-mqa", "THD")], ids=str)
def test_fused_dq_backward_matches_float64(case, layout, fused_dq_kernels):
    """The fused-dq backward on the unfused one's cases (D = 128, where each warpgroup adds half of a
    tile's dQ columns, and D = 64, where the warpgroups take whole tiles in turn): causal, windows, GQA
    and MQA, cross-attention both ways (queries that see no key: their dq stays the zeroed buffer's),
    keys truncated (K's rows past n_k zeroed before dS K), both layouts."""
    check_backward(case, layout, "bf16", fused_dq_kernels)
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
def test_fused_dq_backward_float16(fused_dq_kernels):
    check_backward("cross-nq<nk-causal-gqa", "HTD", "fp16", fused_dq_kernels)
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("case,layout", [("cross-D64-gqa", "THD"), ("cross-window-right-gqa", "HTD"),
                                         ("cross-causal-all-options-gqa", "THD")], ids=str)
def test_fused_dq_backward_on_few_programs(case, layout, programs, fused_dq_kernels):
    """Few programs taking many key blocks: the dS^T slots' barrier (ds_full) and the K tile, which both
    warpgroups' dQ products read, running on from block to block."""
    with select.use_device(dataclasses.replace(select.current_device(), sms=programs)):
        check_backward(case, layout, "bf16", fused_dq_kernels)
    assert fused_dq_kernels.calls[-1][3].programs == programs
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("case,layout", [("cross-nq<nk-causal-gqa", "THD"),
                                         ("cross-causal-all-options-gqa", "HTD")], ids=str)
def test_fused_dq_backward_with_narrower_query_tiles(case, layout, block_m, fused_dq_kernels, monkeypatch,
                                                     tmp_path):
    """16- and 32-query tiles (a tuned table's): dQ^T products 16 and 32 wide, their adds in 2 and 4
    chunks of 8 queries."""
    monkeypatch.setenv(select.TUNED_CONFIGS_ENV, narrower_dkdv_table(tmp_path, block_m))
    check_backward(case, layout, "bf16", fused_dq_kernels)
    assert fused_dq_kernels.calls[-1][3].tiles.dkdv.block_m == block_m
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("operand,layout", [("q", "THD"), ("k", "HTD"), ("v", "THD")])
def test_fused_dq_backward_keeps_inf_and_nan_in_unattended_tokens_out(operand, layout, fused_dq_kernels):
    """`test_backward_keeps_inf_and_nan_in_unattended_tokens_out` with dq fused: K's poisoned rows past
    n_k (zeroed before dS K reads them), dS^T's there (selected to 0, as dP^T from V's poisoned rows may
    be NaN), the query rows past n_q (no add) keep dq finite and 0 where unattended."""
    test_backward_keeps_inf_and_nan_in_unattended_tokens_out(operand, layout, 128, fused_dq_kernels)
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("operand,layout", [("q", "HTD"), ("k", "THD"), ("v", "HTD")])
def test_fused_dq_backward_keeps_inf_and_nan_out_with_the_options(operand, layout, fused_dq_kernels):
    """The same with a window of both bounds, a soft cap and ALiBi (GQA)."""
    test_backward_keeps_inf_and_nan_in_unattended_tokens_out_with_the_options(operand, layout,
                                                                              fused_dq_kernels)
    assert_fused(fused_dq_kernels)


def check_a_sequences_inf_key_stays_in_it(layout: str, kernels) -> None:
    """An inf in an attended key of the first sequence, which ends inside a 64-query tile (n_q = 100)
    whose rows past it are the next sequence's tokens: there dS is 0, and dQ = dS K is 0 * inf = NaN
    unless those rows are kept out of dq. The other sequences' o, dq, dk and dv finite and matching
    float64; the first's not checked (its softmax meets the inf); unattended tokens 0."""
    max_len, dim = 256, 128
    batch = Batch.make([100, 150, 37], 4, dim, kv_heads=2, extra=20, seed=9)
    batch.k = batch.k.copy()
    batch.k[3, 1] = np.inf
    results = run_vjp(jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, max_seq_len=max_len,
                      **kernels.kwargs)
    assert kernels.ran == ["hopper"]
    with np.errstate(invalid="ignore"):  # the first sequence's scores meet the inf
        expected = reference(*results[:4], batch.offsets, max_len, scale=dim**-0.5)
    others = attended_mask(batch.offsets[1:], len(batch.q), max_len)
    attended = attended_mask(batch.offsets, len(batch.q), max_len)
    for name, got, want in zip(("o", "dq", "dk", "dv"), results[4:], expected):
        assert np.all(np.isfinite(got[others])), f"{name}: not finite in the other sequences"
        assert not np.any(got[~attended]), f"{name} is not zero on unattended tokens"
        err = relative_error(got[others], want[others])
        assert err <= TOLERANCES["bf16"][2], f"{name}: relative error {err:.2e} in the other sequences"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_backward_keeps_a_sequences_inf_key_in_it(layout, backward_kernels):
    check_a_sequences_inf_key_stays_in_it(layout, backward_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["THD", "HTD"])
def test_fused_dq_backward_keeps_a_sequences_inf_key_in_it(layout, fused_dq_kernels):
    """The same with dq fused: under the TMA reduce-add (triton >= 3.7) the whole tile is added, its rows
    past n_q selected to 0 first."""
    check_a_sequences_inf_key_stays_in_it(layout, fused_dq_kernels)
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,causal", [("THD", True), ("HTD", False)])
def test_fused_dq_backward_rows_no_block_computes_are_zero(layout, causal, fused_dq_kernels):
    """`test_backward_rows_no_block_computes_are_zero` with dq fused: dq's rows that no key block adds to
    (past max_seq_len, outside every sequence, under adversarial offsets) are exactly 0, from the zeroed
    float32 buffer, never written outside q's tokens."""
    test_backward_rows_no_block_computes_are_zero(layout, causal, fused_dq_kernels)
    assert_fused(fused_dq_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", [("cross-causal-all-options-gqa", "THD"), ("cross-D64-gqa", "HTD")],
                         ids=str)
def test_fused_dq_backward_matches_the_unfused_one(case, layout, fused_dq_kernels):
    """The same problem through the unfused and the fused Hopper backward: dv bitwise the same (its
    products untouched), dk to bfloat16 rounding (dK's product reads dS^T from shared memory, not
    registers), dq to bfloat16 rounding (float32 atomic adds in any order)."""
    spec = dict(BACKWARD_CASES[case])
    slopes = slopes_for(spec["heads"]) if spec.pop("alibi", False) else None
    batch = Batch.make(spec.pop("lengths"), spec.pop("heads"), spec.pop("dim"),
                       kv_lengths=spec.pop("kv_lengths", None), kv_heads=spec.pop("kv_heads", None), lead=3,
                       extra=70, seed=5, scale=0.6)
    if slopes is not None:
        spec["alibi_slopes"] = jnp.asarray(slopes)
    results = {}
    for backward in (Spy("hopper", fused_dq_kernels.calls), fused_dq_kernels.hopper):
        results[type(backward).__name__] = run_vjp(
            jfa.jagged_attention, batch, jnp.bfloat16, layout=layout, implementation="portable",
            backward_implementation=backward, **spec)
    unfused, fused = results["Spy"][5:], results["FusedDq"][5:]
    np.testing.assert_array_equal(fused[2], unfused[2])
    for name, got, want in zip(("dq", "dk"), fused[:2], unfused[:2]):
        assert np.all(np.isfinite(got)), name
        assert relative_error(got, want) < 1e-2, name
    configs_ = [config.fused_dq for kind, _, _, config in fused_dq_kernels.calls if kind == "backward"]
    assert configs_ == [False, True]

