"""What every test shares: jagged batches built from lengths, the float64 numpy reference (output and
gradients), a vjp runner for the public ops, and the one error metric.

The reference is independent of the package: it reads offsets as written (they must be valid), one
sequence and head at a time, with the textbook softmax-attention gradients.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jagged_flash_jax as jfa
from jagged_flash_jax.implementations import IMPLEMENTATIONS, Implementation
from jagged_flash_jax.launch import gpu

GPU_AVAILABLE = gpu.available()
KERNEL_BACKENDS = ["interpret"] + (["triton"] if GPU_AVAILABLE else [])
BACKENDS = KERNEL_BACKENDS + ["xla"]


def variant(backend: str, **settings):
    """The implementation that `backend` ("interpret", or "triton": the portable kernels on the GPU) runs,
    with other settings (e.g. key_major=True): a test passes it as `implementation=`, instead of
    patching the launch code."""
    return dataclasses.replace(implementation_of(backend), **settings)


class Spy(Implementation):
    """An implementation that records each problem it runs (("forward" | "backward", its name, Problem,
    config), in `calls`, which spies may share) and hands it to `inner` (an implementation's name or
    value): a test passes it as `implementation=`. A new spy is a new implementation: nothing traced for
    another replays past it."""

    def __init__(self, inner, calls: list | None = None):
        self.inner = IMPLEMENTATIONS[inner] if isinstance(inner, str) else inner
        self.name = self.inner.name
        self.calls = [] if calls is None else calls

    def config(self, *args):
        return self.inner.config(*args)

    def supports(self, *args):
        return self.inner.supports(*args)

    def preferred(self, *args):
        return self.inner.preferred(*args)

    def forward(self, p, config, *args):
        self.calls.append(("forward", self.name, p, config))
        return self.inner.forward(p, config, *args)

    def backward(self, p, config, *args):
        self.calls.append(("backward", self.name, p, config))
        return self.inner.backward(p, config, *args)


class FusedDq(Spy):
    """A spy of "hopper-fused-dq", the Hopper implementation whose backward fuses dq into the dk/dv
    kernel (HopperConfig.fused_dq)."""

    def __init__(self, calls: list | None = None):
        super().__init__("hopper-fused-dq", calls)


def launched_kernels(monkeypatch) -> list[str]:
    """The names of the kernels launched from here on, in order (each launch's KernelSpec, recorded as
    launch/calls.kernel_call builds it); the list fills as the test runs."""
    from jagged_flash_jax.launch import calls

    launched = []
    kernel_call = calls.kernel_call
    monkeypatch.setattr(calls, "kernel_call",
                        lambda spec, **kw: launched.append(spec.name) or kernel_call(spec, **kw))
    return launched


def implementation_of(backend: str):
    """The implementation a test's `backend` names when it spies on it or varies it: "triton" is the
    portable kernels on the GPU."""
    return IMPLEMENTATIONS[{"triton": "portable"}.get(backend, backend)]


def backend_params(backends=None):
    """pytest params for backends, the triton one marked `gpu`."""
    return [pytest.param(b, marks=pytest.mark.gpu) if b == "triton" else b
            for b in (backends or BACKENDS)]


def case_backend_params(cases, xla=lambda *case: True, interpret=lambda *case: True):
    """pytest params (*case, backend) of each case (a value or a tuple of values) on every backend: on
    xla only the cases where `xla(*case)`, on the interpreter those where `interpret(*case)`, on the
    GPU (triton, marked `gpu`) all; ids as stacked parametrize gives them ("case-layout-backend").

    The xla backend is one pure-JAX function of the whole batch (blocks of 64 rows, the options applied
    to every score alike, HTD read by one transpose): the cases that add nothing to it are left out
    there. The interpreter leaves out only what it cannot tell from another case (see the callers)."""
    params = []
    for case in cases:
        case = case if isinstance(case, tuple) else (case,)
        for backend in BACKENDS:
            if not {"xla": xla, "interpret": interpret}.get(backend, lambda *case: True)(*case):
                continue
            params.append(pytest.param(*case, backend, marks=[pytest.mark.gpu] if backend == "triton" else [],
                                       id="-".join(map(str, (*case, backend)))))
    return params


# (dtype, allow_tf32, tolerance of `relative_error`) by precision.
TOLERANCES = {"fp32": (jnp.float32, False, 1e-5), "tf32": (jnp.float32, True, 2e-3),
              "bf16": (jnp.bfloat16, True, 1e-2), "fp16": (jnp.float16, True, 1e-2)}


def offsets_of(lengths, lead: int = 0) -> np.ndarray:
    return lead + np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


@dataclasses.dataclass
class Batch:
    """Random float64 q [T_q, H, D], k, v [T_kv, H_kv, D] and cotangent do for sequences of the given
    lengths (kv_lengths for keys: None means self-attention over the same tokens), `lead` uncovered
    tokens before the first sequence and `extra` after the last. Arrays are token-major ("THD")."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    offsets: np.ndarray
    kv_offsets: np.ndarray | None

    @classmethod
    def make(cls, lengths, heads, dim, *, kv_lengths=None, kv_heads=None, lead=0, extra=0, seed=0,
             scale=1.0) -> Batch:
        rng = np.random.default_rng(seed)
        offsets = offsets_of(lengths, lead)
        kv_offsets = None if kv_lengths is None else offsets_of(kv_lengths, lead)
        total = int(offsets[-1]) + extra
        kv_total = total if kv_offsets is None else int(kv_offsets[-1]) + extra
        kv_heads = kv_heads or heads
        q = rng.standard_normal((total, heads, dim)) * scale
        k = rng.standard_normal((kv_total, kv_heads, dim)) * scale
        v = rng.standard_normal((kv_total, kv_heads, dim))
        do = rng.standard_normal((total, heads, dim))
        return cls(q, k, v, do, offsets, kv_offsets)

    @property
    def key_offsets(self) -> np.ndarray:
        return self.offsets if self.kv_offsets is None else self.kv_offsets

    def arrays(self, dtype, layout="THD"):
        """q, k, v, do as JAX arrays of `dtype` in `layout`."""
        def cast(x):
            return jnp.asarray(np.swapaxes(x, 0, 1) if layout == "HTD" else x, dtype)

        return cast(self.q), cast(self.k), cast(self.v), cast(self.do)


def clamped_sequences(offsets, total: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(start, n) of each sequence: each offset clamped into [0, T] and each end to at least its start,
    as the kernels do with any offsets, n the tokens attended (at most max_seq_len)."""
    bounds = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        start = min(max(int(start), 0), total)
        end = min(max(int(end), start), total)
        bounds.append((start, min(end - start, max_seq_len)))
    return bounds


def attended_counts(offsets, total: int, max_seq_len: int) -> np.ndarray:
    """Int [T]: how many sequences have token t among their first max_seq_len tokens (`clamped_sequences`;
    more than one where malformed offsets make sequences overlap)."""
    counts = np.zeros(total, int)
    for start, n in clamped_sequences(offsets, total, max_seq_len):
        counts[start:start + n] += 1
    return counts


def attended_mask(offsets, total: int, max_seq_len: int) -> np.ndarray:
    """Boolean [T]: whether token t is among the first max_seq_len tokens of some sequence (see
    attended_counts)."""
    return attended_counts(offsets, total, max_seq_len) > 0


def reference(q, k, v, do, offsets, max_seq_len, *, kv_offsets=None, kv_max_seq_len=None, scale=1.0,
              causal=False, out_scale=1.0, window=(None, None), softcap=None, alibi_slopes=None):
    """(o, dq, dk, dv) in float64 of out_scale * softmax(s) v per sequence, for token-major q [T_q, H, D]
    and k, v [T_kv, H_kv, D]; zero outside the attended tokens. s = scale * q k^T, then
    softcap * tanh(s / softcap), then - slope_h * |i + n_k - n_q - j|; query i sees the keys with
    -right <= i + n_k - n_q - j <= left for window (left, right) (and >= 0 when causal). The gradients
    differentiate through the tanh; the slopes get none."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    kv_offsets = offsets if kv_offsets is None else kv_offsets
    kv_max_seq_len = max_seq_len if kv_max_seq_len is None else kv_max_seq_len
    group = q.shape[1] // k.shape[1]
    o, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for b in range(len(offsets) - 1):
        qs, ks = int(offsets[b]), int(kv_offsets[b])
        n_q = max(0, min(int(offsets[b + 1]) - qs, max_seq_len))
        n_k = max(0, min(int(kv_offsets[b + 1]) - ks, kv_max_seq_len))
        if n_q == 0 or n_k == 0:
            continue
        rows, keys = slice(qs, qs + n_q), slice(ks, ks + n_k)
        distance = np.arange(n_q)[:, None] + n_k - n_q - np.arange(n_k)[None, :]
        allowed = np.ones((n_q, n_k), bool)
        if causal:
            allowed &= distance >= 0
        if window[0] is not None:
            allowed &= distance <= window[0]
        if window[1] is not None:
            allowed &= distance >= -window[1]
        seen = allowed.any(axis=1)  # queries with no key get 0
        for h in range(q.shape[1]):
            g = h // group
            qh, kh, vh, doh = q[rows, h], k[keys, g], v[keys, g], do[rows, h]
            s = scale * qh @ kh.T
            cap_grad = np.ones_like(s)  # d(capped score) / d(score)
            if softcap is not None:
                t = np.tanh(s / softcap)
                s, cap_grad = softcap * t, 1 - t * t
            if alibi_slopes is not None:
                s = s - float(alibi_slopes[h]) * np.abs(distance)
            s = np.where(allowed, s, -np.inf)
            m = np.where(seen, s.max(axis=1), 0.0)
            p = np.where(allowed, np.exp(s - m[:, None]), 0.0)
            p /= np.where(seen, p.sum(axis=1), 1.0)[:, None]
            o[rows, h] = out_scale * p @ vh
            dv[keys, g] += out_scale * p.T @ doh
            dp = out_scale * doh @ vh.T
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True)) * cap_grad
            dq[rows, h] = scale * ds @ kh
            dk[keys, g] += scale * ds.T @ qh
    return o, dq, dk, dv


def relative_error(got, want, scale=None) -> float:
    """||got - want|| / ||want|| (or / `scale`), in float64."""
    got, want = (np.asarray(jnp.asarray(x, jnp.float32) if hasattr(x, "dtype") and x.dtype == jnp.bfloat16
                            else x, np.float64) for x in (got, want))
    denominator = np.linalg.norm(want) if scale is None else scale
    return float(np.linalg.norm(got - want) / denominator)


def to_numpy(x, layout="THD") -> np.ndarray:
    """A JAX array of any float dtype as float64 numpy, token-major."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    return np.swapaxes(x, 0, 1) if layout == "HTD" else x


def run_vjp(op, batch: Batch, dtype, *, layout="THD", offsets_dtype=np.int32, **kwargs):
    """(q, k, v, do rounded to dtype, then o, dq, dk, dv), all float64 token-major, of one forward and
    vjp of `op(q, k, v, offsets, ..., layout=layout, **kwargs)`.

    Forward and vjp run as one jitted program (one XLA compilation; called eagerly, the xla backend
    compiles its forward and backward apart, which took most of these tests' time). The offsets are
    constants of that program, concrete when the op checks them, as in an eager call; each call traces
    anew (a new function), so a test that patches the launch plan gets its own kernels. Eager calls are
    tested elsewhere (test_lse.py, test_api.py, test_transforms.py, the README and the notebooks)."""
    q, k, v, do = batch.arrays(dtype, layout)
    offsets = jnp.asarray(batch.offsets.astype(offsets_dtype))
    if batch.kv_offsets is not None:
        kwargs["kv_offsets"] = jnp.asarray(batch.kv_offsets.astype(offsets_dtype))

    def forward_and_vjp(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: op(q, k, v, offsets, layout=layout, **kwargs), q, k, v)
        return o, *vjp(do)

    o, *grads = jax.jit(forward_and_vjp)(q, k, v, do)
    assert o.shape == q.shape and o.dtype == q.dtype
    return [to_numpy(x, layout) for x in (q, k, v, do, o, *grads)]


def assert_matches(results, expected, tol, *, attended_q=None, attended_kv=None):
    """Each of o, dq, dk, dv finite, within `tol` of the reference, and zero where nothing attends."""
    got = results[4:]
    for i, (name, g, e) in enumerate(zip(("o", "dq", "dk", "dv"), got, expected)):
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        attended = attended_q if i < 2 else attended_kv
        if attended is not None:
            assert np.all(g[~attended] == 0), f"{name} is not zero on unattended tokens"
        # A gradient can be exactly zero (one key per sequence): measure it on the output's scale then.
        scale = np.linalg.norm(e) or np.linalg.norm(expected[0])
        assert scale > 0, "degenerate test: the reference output is zero"
        err = relative_error(g, e, scale)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def fbgemm(q, k, v, offsets, max_seq_len, **kwargs):
    return jfa.multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, **kwargs)


# ---------------------------------------------------------------------------------------------------
# HSTU attention: an independent float64 reference (generative-recommenders' hstu_mha), forward and
# gradients derived by hand. It shares nothing with the package: it reads valid offsets as written and
# builds the mask element by element.
# ---------------------------------------------------------------------------------------------------


def hstu_mask_np(length, targets, size, *, causal=True, max_attn_len=0, contextual_seq_len=0,
                 min_full_attn_seq_len=0) -> np.ndarray:
    """[size, size] bool: whether position i of a sequence of `length` tokens, whose last `targets` are
    targets, attends position j (size <= length: the positions computed). Per generative-recommenders:
    a position's id is its index, less contextual_seq_len - 1 (at least 0) when there is a context, and
    at most the history's end (the first target's id) when there are targets; i sees j when i == j or
    id(i) > id(j) (!= when not causal), within max_attn_len of ids unless id(i) is among the last
    min_full_attn_seq_len ids before the history's end or later; and a context row (id 0) sees every
    id before the history's end whatever the rest says."""
    c = contextual_seq_len
    history_end = length - targets - (c - 1 if c > 0 else 0)

    def ident(pos):
        pos = max(pos - c + 1, 0) if c > 0 else pos
        return min(pos, history_end)  # no target: history_end = length (past every position)

    mask = np.zeros((size, size), bool)
    for i in range(size):
        for j in range(size):
            a, b = ident(i), ident(j)
            d = a - b if causal else abs(a - b)
            ok = i == j or d > 0
            if max_attn_len > 0 and d > max_attn_len:
                ok = ok and min_full_attn_seq_len > 0 and a >= history_end - min_full_attn_seq_len
            if c > 0 and a == 0 and b < history_end:
                ok = True
            mask[i, j] = ok
    return mask


def hstu_reference(q, k, v, do, offsets, max_seq_len, *, alpha, causal=True, num_targets=None,
                   max_attn_len=0, contextual_seq_len=0, min_full_attn_seq_len=0, attn_scale=None):
    """(o, dq, dk, dv, d_attn_scale) in float64 of HSTU attention for token-major q, k [T, H, D],
    v, do [T, H, V]: per sequence (its first min(n, max_seq_len) tokens; every other token gets 0) and
    head, o_i = sum_j m_ij s_i silu(u_ij) v_j with u = alpha q_i . k_j, m = `hstu_mask_np` on the full
    length n, s_i = 1 / max_seq_len, attn_scale (a scalar) or attn_scale[token i] ([T]).

    By hand, with silu'(u) = sigmoid(u) (1 + u (1 - sigmoid(u))) and dp_ij = do_i . v_j:
    dv_j = sum_i m_ij s_i silu(u_ij) do_i; du_ij = m_ij s_i dp_ij silu'(u_ij); dq_i = alpha sum_j du_ij k_j;
    dk_j = alpha sum_i du_ij q_i; d s_i = sum_h sum_j m_ij silu(u_ij) dp_ij (summed over i for a scalar;
    None without attn_scale)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    o, dq, dk, dv = np.zeros_like(v), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_rows = np.zeros(q.shape[0])
    for b in range(len(offsets) - 1):
        start, length = int(offsets[b]), int(offsets[b + 1]) - int(offsets[b])
        size = min(length, max_seq_len)
        if size <= 0:
            continue
        targets = 0 if num_targets is None else int(num_targets[b])
        mask = hstu_mask_np(length, targets, size, causal=causal, max_attn_len=max_attn_len,
                            contextual_seq_len=contextual_seq_len,
                            min_full_attn_seq_len=min_full_attn_seq_len)
        rows = slice(start, start + size)
        if attn_scale is None:
            s = np.full(size, 1.0 / max_seq_len)
        elif np.ndim(attn_scale) == 0:
            s = np.full(size, float(attn_scale))
        else:
            s = np.asarray(attn_scale, np.float64)[rows]
        for h in range(q.shape[1]):
            qh, kh, vh, doh = q[rows, h], k[rows, h], v[rows, h], do[rows, h]
            u = alpha * qh @ kh.T
            sig = 1.0 / (1.0 + np.exp(-u))
            silu = u * sig
            weights = mask * silu * s[:, None]
            o[rows, h] = weights @ vh
            dv[rows, h] += weights.T @ doh
            dp = doh @ vh.T
            du = mask * dp * sig * (1 + u * (1 - sig)) * s[:, None]
            dq[rows, h] += alpha * du @ kh
            dk[rows, h] += alpha * du.T @ qh
            d_rows[rows] += (mask * silu * dp).sum(axis=1)
    d_scale = None if attn_scale is None else (d_rows.sum() if np.ndim(attn_scale) == 0 else d_rows)
    return o, dq, dk, dv, d_scale
