"""`python -m jagged_flash_jax demo`: a random jagged batch, forward and backward on the best backend
available, checked against the pure-JAX reference; without a GPU, also the Triton kernels through the
interpreter on a small batch."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import api, multi_head_jagged_flash_attention, offsets_from_lengths
from .reference import jagged_attention_reference


def _batch(lengths, heads, dim, dtype, seed):
    offsets = offsets_from_lengths(jnp.asarray(lengths, jnp.int32))
    total = int(offsets[-1])
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, do = (jax.random.normal(key, (heads, total, dim), jnp.float32) for key in keys)
    q, k = q * dim**-0.25, k * dim**-0.25  # scores of order 1, as after a learned projection
    return offsets, q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype)


def _relative_error(got, want) -> float:
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_backend(backend, lengths, heads, dim, max_seq_len, dtype, tolerance, seed=0) -> bool:
    """Forward and backward on `backend` against the float32 reference; prints one report line."""
    offsets, q, k, v, do = _batch(lengths, heads, dim, dtype, seed)

    @jax.jit
    def forward_backward(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: multi_head_jagged_flash_attention(
            q, k, v, offsets, max_seq_len, backend=backend), q, k, v)
        return (out, *vjp(do))

    @jax.jit
    def reference(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jagged_attention_reference(
            q, k, v, offsets, max_seq_len, allow_tf32=False), q, k, v)
        return (out, *vjp(do))

    upcast = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = reference(*upcast)
    jax.block_until_ready(forward_backward(q, k, v, do))  # compile
    start = time.perf_counter()
    got = jax.block_until_ready(forward_backward(q, k, v, do))
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    errors = {name: _relative_error(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    ok = all(e <= tolerance for e in errors.values())
    print(f"  {backend:9s} {jnp.dtype(dtype).name:8s} B={len(lengths)} H={heads} D={dim} "
          f"T={q.shape[1]} max_seq_len={max_seq_len}: fwd+bwd {elapsed_ms:8.2f} ms; relative error "
          + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
          + f" (tolerance {tolerance:.0e}) {'OK' if ok else 'FAIL'}")
    return ok


def demo(args) -> int:
    backend = api.default_backend()
    print(f"jagged_flash_jax demo on {jax.devices()[0].device_kind} (JAX {jax.__version__}); "
          f"best backend here: {backend!r}")
    rng = np.random.default_rng(args.seed)
    ok = True
    if backend == "triton":
        lengths = rng.integers(1, 1025, size=64)
        print("A recommender-style batch: 64 user histories of 1 to 1024 events, bf16:")
        ok &= check_backend("triton", lengths, 8, 128, 1024, jnp.bfloat16, 1e-2, args.seed)
        ok &= check_backend("xla", lengths, 8, 128, 1024, jnp.bfloat16, 1e-2, args.seed)
    else:
        lengths = rng.integers(0, 257, size=32)
        print("No GPU: a jagged batch of 32 sequences of 0 to 256 tokens on the pure-JAX backend:")
        ok &= check_backend("xla", lengths, 4, 64, 192, jnp.float32, 1e-5, args.seed)
    small = [5, 0, 33, 1, 48]
    print("The Triton kernels themselves, run by Triton's interpreter on the CPU (small batch):")
    ok &= check_backend("interpret", small, 2, 24, 40, jnp.float32, 1e-5, args.seed)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jagged_flash_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help=__doc__.splitlines()[0])
    demo_parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
