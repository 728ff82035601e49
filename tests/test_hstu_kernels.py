"""HSTU attention's portable kernels (kernels/portable/hstu.py) through their launch functions
(launch/hstu.py) in Triton's interpreter, against the independent float64 reference (helpers.hstu_reference):
forward and every gradient, the per-token scale's included, for every mask option alone and together,
empty, 1-token and over-long sequences, tokens outside every sequence, D != V, both layouts, shared and
per-segment offsets rows, a constant and a per-token scale, one backward launch or two; the block ranges
against the dense mask; nan and inf where nothing attends; any offsets and num_targets content, which
the interpreter's guard zones prove never takes a kernel outside its arrays; bitwise determinism; and
each kernel compiled for sm_90a (tensor-core instructions), under the installed Triton."""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl
from helpers import attended_mask, hstu_mask_np, hstu_reference, relative_error

from jagged_flash_jax.configs import INTERPRET_BLOCK_SIZES, SHARED_MEMORY_BYTES, BlockSizes, KernelConfig
from jagged_flash_jax.kernels.shared_hstu import key_range, query_spans, sequence_rule
from jagged_flash_jax.launch import hstu, interpret
from jagged_flash_jax.launch.calls import KernelCall
from jagged_flash_jax.problem import HstuProblem

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: not installed
from benchmarks.probes.ptx import compile_quietly, kernel_signature  # noqa: E402

ALPHA = 0.35
TOL = 1e-5

# ---------------------------------------------------------------------------------------------------
# Batches, runs and checks
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """A problem and its operands: random float32 values (as float64), token-major."""

    p: HstuProblem
    q: np.ndarray  # [Z*T, H, D]
    k: np.ndarray  # [Z*T, H, D]
    v: np.ndarray  # [Z*T, H, V]
    do: np.ndarray  # [Z*T, H, V]
    offsets: np.ndarray  # [rows, B+1]
    num_targets: np.ndarray | None  # [rows, B], None without targets
    scale: np.ndarray | None  # [Z*T], None for the constant p.scale

    @classmethod
    def make(cls, lengths, *, targets=None, max_seq_len=64, segments=1, shared_rows=True, heads=2, dim=16,
             value_dim=24, token_scale=True, lead=1, extra=2, layout="THD", seed=0, **options) -> Inputs:
        """Segment z of Z holds sequences of `lengths` (reversed in odd segments when not shared_rows),
        after `lead` tokens and before `extra`."""
        rng = np.random.default_rng(seed)
        rows = 1 if shared_rows else segments
        row_lengths = [lengths if z % 2 == 0 else lengths[::-1] for z in range(rows)]
        offsets = np.stack([lead + np.concatenate([[0], np.cumsum(n, dtype=np.int64)]) for n in row_lengths])
        num_targets = None if targets is None else np.stack(
            [np.asarray(targets if z % 2 == 0 else targets[::-1], np.int64) for z in range(rows)])
        tokens = lead + int(np.sum(lengths)) + extra
        total = segments * tokens
        q, k = (rng.standard_normal((total, heads, dim)).astype(np.float32) for _ in range(2))
        v, do = (rng.standard_normal((total, heads, value_dim)).astype(np.float32) for _ in range(2))
        scale = rng.uniform(0.01, 0.1, total).astype(np.float32) if token_scale else None
        p = HstuProblem(layout=layout, num_heads=heads, head_dim=dim, value_dim=value_dim, batch=len(lengths),
                        num_segments=segments, tokens=tokens, offsets_rows=rows, max_seq_len=max_seq_len,
                        alpha=ALPHA, scale=None if token_scale else 0.03, has_targets=targets is not None,
                        **options)
        return cls(p, *(x.astype(np.float64) for x in (q, k, v, do)), offsets, num_targets,
                   None if scale is None else scale.astype(np.float64))

    def attended(self) -> np.ndarray:
        """[Z*T] bool: the tokens some query attends (each segment by its row of offsets)."""
        p = self.p
        return np.concatenate([attended_mask(self.offsets[z % len(self.offsets)], p.tokens, p.max_seq_len)
                               for z in range(p.num_segments)])

    def poisoned(self) -> Inputs:
        """nan in q, k, do and the scale, inf in v, on every token no query attends."""
        outside = ~self.attended()
        bad = lambda x, value: np.where(outside.reshape(-1, *[1] * (x.ndim - 1)), value, x)  # noqa: E731
        return dataclasses.replace(self, q=bad(self.q, np.nan), k=bad(self.k, np.nan), v=bad(self.v, np.inf),
                                   do=bad(self.do, np.nan),
                                   scale=None if self.scale is None else bad(self.scale, np.nan))


def run(x: Inputs, tiles: BlockSizes = INTERPRET_BLOCK_SIZES, offsets_dtype=jnp.int32):
    """(o, dq, dk, dv, d_scale) of the launch functions in the interpreter, float64 token-major (d_scale
    None for a constant scale)."""
    p = x.p
    arrays = [jnp.asarray(np.swapaxes(a, 0, 1) if p.layout == "HTD" else a, jnp.float32)
              for a in (x.q, x.k, x.v, x.do)]
    q, k, v, do = arrays
    offsets = jnp.asarray(x.offsets, offsets_dtype)
    targets = None if x.num_targets is None else jnp.asarray(x.num_targets, jnp.int32)
    scale = None if x.scale is None else jnp.asarray(x.scale, jnp.float32)
    o = hstu.forward(interpret.run, p, tiles, q, k, v, offsets, targets, scale)
    *grads, d_scale = hstu.backward(interpret.run, p, tiles, q, k, v, offsets, targets, scale, do)
    if d_scale is not None:  # each head's share [Z, H, T], summed as the op sums it
        assert d_scale.shape == (p.num_segments, p.num_heads, p.tokens)
        grads.append(d_scale.sum(axis=1).reshape(-1))
    else:
        grads.append(None)
    assert o.shape == p.shape(p.value_dim) and o.dtype == q.dtype

    def numpy(a):
        if a is None:
            return None
        a = np.asarray(a, np.float64)
        return np.swapaxes(a, 0, 1) if p.layout == "HTD" and a.ndim == 3 else a

    return [numpy(a) for a in (o, *grads)]


def expected(x: Inputs):
    """The float64 reference of each segment, on its tokens and row of offsets and num_targets."""
    p, tokens = x.p, x.p.tokens
    parts = []
    for z in range(p.num_segments):
        rows = slice(z * tokens, (z + 1) * tokens)
        row = z % len(x.offsets)
        parts.append(hstu_reference(
            x.q[rows], x.k[rows], x.v[rows], x.do[rows], x.offsets[row], p.max_seq_len, alpha=p.alpha,
            num_targets=None if x.num_targets is None else x.num_targets[row],
            attn_scale=p.scale if x.scale is None else x.scale[rows], **p.mask_options()))
    return [np.concatenate(parts_of) for parts_of in zip(*(part[:4] for part in parts))] + [
        None if x.scale is None else np.concatenate([part[4] for part in parts])]


def assert_matches(results, x: Inputs):
    """o, dq, dk, dv (and the scale's gradient) finite, zero on the tokens no query attends, and within
    TOL of the reference, in norm relative to the result's own (the output's, where that is 0)."""
    want = expected(x)
    outside = ~x.attended()
    for name, got, ref in zip(("o", "dq", "dk", "dv", "d_scale"), results, want):
        if ref is None:
            assert got is None, f"{name}: expected None"
            continue
        assert np.all(np.isfinite(got)), f"{name} has non-finite values"
        assert np.all(got[outside] == 0), f"{name} is not zero on unattended tokens"
        scale = np.linalg.norm(ref) or np.linalg.norm(want[0])
        assert scale > 0, "degenerate test: the reference output is zero"
        err = relative_error(got, ref, scale)
        assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:.0e}"


# ---------------------------------------------------------------------------------------------------
# Every mask option, alone and together
# ---------------------------------------------------------------------------------------------------

# An empty and a 1-token sequence, one of 75 tokens cut at max_seq_len = 64 (its last 20 tokens are
# targets, counted from its true end: positions 55-63 are computed), one token before the first sequence
# and two after the last. Targets: none in the 5-token and the empty sequences, the whole of the 1-token
# and the 30-token ones. Each option set, causal and not.
LENGTHS, MAX_SEQ_LEN = [5, 0, 1, 75, 30], 64
TARGETS = [0, 0, 1, 20, 30]
WINDOW, MIN_FULL, CONTEXT = dict(max_attn_len=4), dict(min_full_attn_seq_len=6), dict(contextual_seq_len=3)
OPTIONS = {"plain": {}, "targets": dict(targets=TARGETS), "window": WINDOW,
           "window-min-full": WINDOW | MIN_FULL, "context": CONTEXT, "context-window": CONTEXT | WINDOW,
           "all": dict(targets=TARGETS) | CONTEXT | WINDOW | MIN_FULL}
CASES = {f"{name}{'' if causal else '-noncausal'}": dict(options, causal=causal)
         for name, options in OPTIONS.items() for causal in (True, False)}


def case_inputs(case: str, **settings) -> Inputs:
    return Inputs.make(LENGTHS, max_seq_len=MAX_SEQ_LEN, seed=len(case), **{**CASES[case], **settings})


@pytest.mark.parametrize("case", CASES)
def test_matches_float64(case):
    """A per-token scale with targets, a constant one without."""
    x = case_inputs(case, token_scale="targets" in CASES[case])
    assert_matches(run(x), x)


# Z = 2 segments; D and V differ, and are not powers of two in one case; two backward launches (dq's
# warps differ from dk/dv's) in another.
TWO_LAUNCHES = dataclasses.replace(INTERPRET_BLOCK_SIZES, dq=KernelConfig(32, 16, num_warps=8))
LAYOUTS = {
    "thd-shared-tokens": dict(layout="THD", shared_rows=True, token_scale=True),
    "htd-segments-tokens": dict(layout="HTD", shared_rows=False, token_scale=True, dim=20, value_dim=12),
    "htd-shared-constant": dict(layout="HTD", shared_rows=True, token_scale=False),
    "thd-segments-constant-two-launches": dict(layout="THD", shared_rows=False, token_scale=False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_segments_and_scales(name):
    settings = dict(LAYOUTS[name])
    tiles = TWO_LAUNCHES if name.endswith("two-launches") else INTERPRET_BLOCK_SIZES
    x = case_inputs("all", segments=2, **settings)
    assert len(hstu.backward_launches(x.p, tiles)) == (2 if tiles is TWO_LAUNCHES else 1)
    assert_matches(run(x, tiles), x)


def test_nothing_to_attend():
    """No sequence, or only empty ones: zeros everywhere, a zero scale gradient."""
    for lengths, extra in (([], 3), ([0, 0], 4)):
        x = Inputs.make(lengths, lead=0, extra=extra, targets=[0] * len(lengths))
        assert all(not np.any(r) for r in run(x))
    empty = Inputs.make([], lead=0, extra=0)
    assert all(r.shape[0] == 0 for r in run(empty))


# ---------------------------------------------------------------------------------------------------
# The block ranges against the dense mask
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _ranges_kernel(offsets_ptr, targets_ptr, params_ptr, out_ptr, MAX_LEN: tl.constexpr, CAUSAL: tl.constexpr,
                   MAX_ATTN_LEN: tl.constexpr, CONTEXT_LEN: tl.constexpr, MIN_FULL_LEN: tl.constexpr,
                   HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[b] = (lo, hi) of shared_hstu.key_range for the queries [b * BLOCK_M, +BLOCK_M) of sequence 0,
    then the five values of shared_hstu.query_spans for the keys [b * BLOCK_N, +BLOCK_N)."""
    MASK: tl.constexpr = (CAUSAL, MAX_ATTN_LEN, CONTEXT_LEN, MIN_FULL_LEN, HAS_TARGETS)
    _, rule = sequence_rule(offsets_ptr, targets_ptr, 0, tl.load(params_ptr), MAX_LEN, MASK)
    b = tl.program_id(0)
    lo, hi = key_range(b * BLOCK_M, rule, BLOCK_M, BLOCK_N, MASK)
    spans = query_spans(b * BLOCK_N, rule, BLOCK_M, BLOCK_N, MASK)
    out = out_ptr + b * 7
    tl.store(out, lo)
    tl.store(out + 1, hi)
    for i in tl.static_range(5):
        tl.store(out + 2 + i, spans[i])


def _visited(length, targets, block_m, block_n, **options):
    """(key blocks each query block visits, query blocks each key block visits) by the rules' ranges."""
    blocks = max(-(-length // block_m), -(-length // block_n), 1)
    call = KernelCall(_ranges_kernel, grid=(blocks,),
                      out_shapes=(jax.ShapeDtypeStruct((blocks, 7), jnp.int32),), params=(length,),
                      constants=dict(
                          MAX_LEN=length, CAUSAL=options["causal"], MAX_ATTN_LEN=options["max_attn_len"],
                          CONTEXT_LEN=options["contextual_seq_len"],
                          MIN_FULL_LEN=options["min_full_attn_seq_len"], HAS_TARGETS=targets is not None,
                          BLOCK_M=block_m, BLOCK_N=block_n))
    arrays = (jnp.asarray([0, length], jnp.int32),
              jnp.asarray([0 if targets is None else targets], jnp.int32), jnp.asarray([length], jnp.int32))
    (out,) = interpret.run(call, arrays)
    out = np.asarray(out)
    keys = [list(range(lo, hi, block_n)) for lo, hi in out[:, :2]]
    queries = []
    for prefix, band_start, band, suffix_start, suffix in out[:, 2:]:
        queries.append([b * block_m for b in range(prefix)] + [band_start + b * block_m for b in range(band)]
                       + [suffix_start + b * block_m for b in range(suffix)])
    return keys, queries


RANGE_OPTIONS = [dict(causal=c, max_attn_len=w, contextual_seq_len=ctx, min_full_attn_seq_len=m)
                 for c, w, ctx, m in itertools.product((True, False), (0, 1, 3), (0, 1, 4), (0, 5))
                 if m == 0 or w > 0]


@pytest.mark.parametrize("targets", [None, 0, 9, -3, 200], ids=lambda t: f"targets={t}")
def test_block_ranges_cover_the_mask(targets):
    """Every (query block, key block) pair holding a pair the mask keeps is visited, from either side,
    once, and never a block past the sequence; with a plain causal window (no targets to clamp the ids),
    only those pairs."""
    length, block_m, block_n = 70, 16, 8
    for options in RANGE_OPTIONS:
        exact = targets in (None, 0, -3) and options == dict(
            causal=True, max_attn_len=3, contextual_seq_len=0, min_full_attn_seq_len=0)
        mask = hstu_mask_np(length, 0 if targets is None else targets, length, **options)
        keys, queries = _visited(length, targets, block_m, block_n, **options)
        for q0 in range(0, length, block_m):
            needed = {k0 for k0 in range(0, length, block_n) if mask[q0:q0 + block_m, k0:k0 + block_n].any()}
            got = keys[q0 // block_m]
            assert needed <= set(got) and all(0 <= k0 < length for k0 in got), (options, q0, got, needed)
            assert not exact or set(got) == needed, (q0, got, needed)
        for k0 in range(0, length, block_n):
            needed = {q0 for q0 in range(0, length, block_m) if mask[q0:q0 + block_m, k0:k0 + block_n].any()}
            got = queries[k0 // block_n]
            assert len(got) == len(set(got)), (options, k0, got)  # each query block once
            assert needed <= set(got) and all(0 <= q0 < length and q0 % block_m == 0 for q0 in got), (
                options, k0, got, needed)
            assert not exact or set(got) == needed, (k0, got, needed)


# ---------------------------------------------------------------------------------------------------
# Poisoned tokens, adversarial offsets and num_targets, determinism
# ---------------------------------------------------------------------------------------------------


def test_poisoned_tokens_stay_out():
    """nan and inf in every token no query attends (before the first sequence, past max_seq_len, after
    the last) leave every result bit for bit as with finite values there, and zero on those tokens."""
    x = case_inputs("all", token_scale=True)
    clean, poisoned = run(x), run(x.poisoned())
    outside = ~x.attended()
    assert outside.sum() > 10
    for name, got, want in zip(("o", "dq", "dk", "dv", "d_scale"), poisoned, clean):
        assert np.all(got[outside] == 0), f"{name} is not zero outside"
        np.testing.assert_array_equal(got, want, err_msg=f"{name} differs with nan and inf outside")


def test_bitwise_deterministic():
    x = case_inputs("all-noncausal", token_scale=True)
    for first, second in zip(run(x, TWO_LAUNCHES), run(x, TWO_LAUNCHES)):
        np.testing.assert_array_equal(first, second)


def test_any_num_targets_is_the_references():
    """num_targets negative, past the length, or at int32's ends: the reference's mask (its arithmetic
    in unbounded integers), in int32 without overflow."""
    targets = [-4, 45, 2**31 - 1, -(2**31)]
    x = Inputs.make([9, 40, 1, 12], max_seq_len=32, token_scale=True, **{**CASES["all"], "targets": targets})
    assert_matches(run(x), x)


# Over 24 tokens.
ADVERSARIAL_OFFSETS = {
    "negative": [-5, 3, 10], "decreasing": [10, 3, 20], "int32-max": [0, 2**31 - 1, 5],
    "int32-min": [-(2**31), 0, 24], "past-the-end": [20, 30, 40], "reversed": [24, 24, 0],
    "mixed": [0, 24, 24, -1, 12],
}


@pytest.mark.parametrize("name", ADVERSARIAL_OFFSETS)
def test_adversarial_offsets_are_memory_safe(name):
    """Any offsets and num_targets content: the interpreter's guards raise if a kernel writes outside
    its arrays; a read outside, or an element never written, would be a nan. Every result is finite and
    zero on the tokens no sequence attends (offsets clamped as the kernels clamp them)."""
    offsets = ADVERSARIAL_OFFSETS[name]
    batch = len(offsets) - 1
    targets = [[7, -2, 2**31 - 1, -(2**31)][b % 4] for b in range(batch)]
    x = Inputs.make([0] * batch, max_seq_len=16, lead=24, extra=0, dim=8, value_dim=12,
                    **{**CASES["all"], "targets": targets})
    x = dataclasses.replace(x, offsets=np.asarray([offsets]))
    outside = ~x.attended()
    for result in run(x):
        assert np.all(np.isfinite(result))
        assert not np.any(result[outside])


def test_int64_offsets_past_int32():
    with jax.enable_x64(True):
        x = Inputs.make([0, 0], max_seq_len=16, lead=24, extra=0, dim=8, value_dim=8,
                        **{**CASES["all"], "targets": [3, 1]})
        x = dataclasses.replace(x, offsets=np.asarray([[2**32 + 3, 10, 2**32 - 1]], np.int64))
        outside = ~x.attended()
        for result in run(x, offsets_dtype=jnp.int64):
            assert np.all(np.isfinite(result)) and not np.any(result[outside])


# ---------------------------------------------------------------------------------------------------
# Tiles, grids, and the kernels compiled for sm_90a
# ---------------------------------------------------------------------------------------------------


def test_tiles_and_grid_limits():
    x = case_inputs("all")
    assert hstu.tiles(x.p, interpret=True) == INTERPRET_BLOCK_SIZES
    gpu = hstu.tiles(x.p.with_(dtype="bfloat16", head_dim=128, value_dim=128), interpret=False)
    assert gpu.fwd.block_m >= 64 and gpu.fwd.block_n >= 32
    assert hstu.grid_error(x.p, gpu) is None and hstu.addressing_error(x.p) is None
    huge = x.p.with_(batch=2**26, num_heads=64)
    assert "programs" in hstu.grid_error(huge, gpu)
    assert "address" in hstu.addressing_error(x.p.with_(tokens=2**30, max_seq_len=2**30))


COMPILED = HstuProblem(layout="THD", num_heads=4, head_dim=128, value_dim=128, batch=3, num_segments=1,
                       tokens=96, offsets_rows=1, max_seq_len=256, alpha=0.2, scale=None, causal=True,
                       max_attn_len=64, contextual_seq_len=4, has_targets=True, dtype="bfloat16",
                       input_precision="tf32")


def _launches(tiles, p=COMPILED):
    """The KernelCalls of a forward and a backward of `p` (D = V; a launcher that records them)."""
    calls = []

    def record(call, arrays):
        calls.append((call, arrays))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in call.out_shapes)

    x = jnp.zeros(p.shape(p.head_dim), p.dtype)
    rows = (jnp.asarray([[0, 20, 70, 96]], jnp.int32), jnp.asarray([[1, 5, 3]], jnp.int32),
            jnp.ones((p.tokens,), jnp.float32))
    hstu.forward(record, p, tiles, x, x, x, *rows)
    hstu.backward(record, p, tiles, x, x, x, *rows, x)
    return calls


def _compiled(call: KernelCall, arrays) -> tuple[str, dict]:
    """A recorded launch compiled for sm_90a as jax-triton compiles it: (ptx, metadata)."""
    launch = dict(constants=call.constants, arrays=[dict(dtype=str(a.dtype)) for a in arrays],
                  out=[dict(dtype=str(s.dtype)) for s in call.out_shapes])
    signature, attrs = kernel_signature(call.kernel, launch)
    return compile_quietly(call.kernel, signature, call.constants, attrs, call.num_warps, call.num_stages)


@pytest.mark.parametrize("tiles", ["default", "two-launches"])
def test_every_kernel_compiles_for_sm90_with_tensor_cores(tiles):
    """bfloat16, D = V = 128, causal with targets, a window, a context and a per-token scale: each launch
    compiles for sm_90a as jax-triton compiles it (benchmarks.probes.ptx), with mma or wgmma products."""
    tiles = hstu.tiles(COMPILED, interpret=False) if tiles == "default" else BlockSizes(
        fwd=KernelConfig(64, 64, 4, 3), dkdv=KernelConfig(32, 64, 4, 2), dq=KernelConfig(64, 32, 8, 2))
    calls = _launches(tiles)
    assert [call.kernel.__name__ for call, _ in calls] == ["hstu_fwd_kernel"] + ["hstu_bwd_kernel"] * (
        len(calls) - 1)
    for call, arrays in calls:
        ptx, _ = _compiled(call, arrays)
        assert re.search(r"\b(wgmma|mma)\.", ptx), (
            f"{call.kernel.__name__}: no tensor-core product (triton {triton.__version__})")


@pytest.mark.parametrize("dtype, max_seq_len", [("bfloat16", 256), ("float32", 64)])
def test_the_widest_tiles_fit_shared_memory(dtype, max_seq_len):
    """HSTU's portable kernels take the softmax kernels' tiles, fitted within sm_90's shared memory as
    configs.portable_shared_bytes counts the softmax programs; HSTU's hold more. At D = V = 256, where
    they come nearest (benchmarks.probes.hstu_shared compiles every fit: 229,376 bytes, the 16-bit
    backward), each launch compiled for sm_90a stays within SHARED_MEMORY_BYTES."""
    p = COMPILED.with_(head_dim=256, value_dim=256, dtype=dtype, max_seq_len=max_seq_len)
    for call, arrays in _launches(hstu.tiles(p, interpret=False), p):
        _, metadata = _compiled(call, arrays)
        assert 0 < metadata["shared"] <= SHARED_MEMORY_BYTES, (call.kernel.__name__, metadata["shared"])
