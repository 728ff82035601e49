"""A padded-JAX HSTU attention, the baseline a JAX user has without the library's op: pad the jagged
batch to [B, L, H, D], take silu(alpha q.k) / max_seq_len under the mask with dense einsums ([B, H, L, L]
scores in memory), unpad; the backward is JAX's autodiff of it.

`hstu_padded` is the op (the semantics of reference.hstu_attention_reference, attn_scale aside); `step`
makes the jitted function to time for a case of hstu_cases.py and a mode ("fwd", "fwd+bwd"), and
`inputs` its arguments. Products take the inputs' dtype with float32 results (preferred_element_type),
and the silu weights are cast back to v's dtype for the second product, as the kernels do.

    python -m benchmarks.hstu_padded [--cases NAME ...] [--no-long] [--dtype bfloat16]

prints wall-clock medians (each call followed by block_until_ready) and XLA's temporary memory; the
library's timing (benchmarks/timing.py) is the better clock for reports.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.hstu_cases import MODES, HstuCase, select
from jagged_flash_jax.reference import hstu_mask


def _padded_index(offsets, tokens: int, max_seq_len: int):
    """[B, L] token of each padded position (`tokens`, out of range, where there is none) and the full
    lengths [B] (the mask's)."""
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    positions = jnp.arange(max_seq_len)
    inside = positions[None] < jnp.minimum(lengths, max_seq_len)[:, None]
    return jnp.where(inside, starts[:, None] + positions, tokens), lengths


def hstu_padded(q, k, v, offsets, num_targets=None, *, max_seq_len: int, alpha: float, causal: bool = True,
                max_attn_len: int = 0, contextual_seq_len: int = 0, min_full_attn_seq_len: int = 0):
    """HSTU attention of q, k [T, H, D], v [T, H, V] by padding: o [T, H, V] in q's dtype (0 on the
    tokens past a sequence's first max_seq_len)."""
    tokens = q.shape[0]
    index, lengths = _padded_index(offsets, tokens, max_seq_len)
    qp, kp, vp = (jnp.take(x, index, axis=0, mode="fill", fill_value=0) for x in (q, k, v))  # [B, L, H, .]
    scores = jnp.einsum("bqhd,bkhd->bhqk", qp, kp, preferred_element_type=jnp.float32)
    positions = jnp.arange(max_seq_len)[None]
    mask = hstu_mask(positions, positions, lengths, num_targets, causal=causal, max_attn_len=max_attn_len,
                     contextual_seq_len=contextual_seq_len, min_full_attn_seq_len=min_full_attn_seq_len)
    weights = jnp.where(mask[:, None], jax.nn.silu(alpha * scores) / max_seq_len, 0.0).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhv->bqhv", weights, vp, preferred_element_type=jnp.float32).astype(q.dtype)
    flat = index.reshape(-1)
    return jnp.zeros((tokens, *out.shape[2:]), q.dtype).at[flat].set(out.reshape(-1, *out.shape[2:]),
                                                                     mode="drop")


def inputs(case: HstuCase, dtype=jnp.bfloat16, seed: int = 0):
    """(q, k, v, do, offsets, num_targets): standard-normal q, k [T, H, D], v and the cotangent do
    [T, H, V] of `dtype`; int32 offsets [B+1] and num_targets [B] (or None)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    tokens = int(case.lengths().sum())
    dims = (case.head_dim, case.head_dim, case.value_dim, case.value_dim)
    q, k, v, do = (jax.random.normal(key, (tokens, case.heads, dim), dtype) for key, dim in zip(keys, dims))
    targets = case.num_targets()
    return (q, k, v, do, jnp.asarray(case.offsets(), jnp.int32),
            None if targets is None else jnp.asarray(targets, jnp.int32))


def step(case: HstuCase, mode: str):
    """The jitted function to time: (q, k, v, do, offsets, num_targets) -> o, or -> (dq, dk, dv)."""
    def op(q, k, v, offsets, targets):
        return hstu_padded(q, k, v, offsets, targets, max_seq_len=case.max_seq_len, alpha=case.alpha,
                           max_attn_len=case.max_attn_len, contextual_seq_len=case.contextual_seq_len)

    if mode == "fwd":
        return jax.jit(lambda q, k, v, do, offsets, targets: op(q, k, v, offsets, targets))

    def forward_backward(q, k, v, do, offsets, targets):
        _, vjp = jax.vjp(lambda q, k, v: op(q, k, v, offsets, targets), q, k, v)
        return vjp(do)

    return jax.jit(forward_backward)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="*")
    p.add_argument("--no-long", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)
    for case in select(args.cases, long=not args.no_long):
        arrays = inputs(case, jnp.dtype(args.dtype))
        for mode in MODES:
            fn = step(case, mode)
            try:
                compiled = fn.lower(*arrays).compile()
                temp = compiled.memory_analysis().temp_size_in_bytes
                jax.block_until_ready(compiled(*arrays))
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(*arrays))
                    times.append((time.perf_counter() - start) * 1e3)
                ms = statistics.median(times)
                print(f"{case.name:42s} {mode:8s} {ms:9.3f} ms {case.flops(mode) / ms / 1e9:7.1f} TF/s "
                      f"temp {temp / 2**30:.2f} GiB", flush=True)
            except Exception as err:  # out of memory at the long lengths, most likely
                print(f"{case.name:42s} {mode:8s} {type(err).__name__}: {str(err)[:200]}", flush=True)


if __name__ == "__main__":
    main()
