"""`python -m jagged_flash_jax demo`: a random jagged batch through `jagged_attention` (causal, GQA) and
`multi_head_jagged_flash_attention`, forward and backward on every backend available here, each compared
with a float64 reference and timed."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    jagged_attention,
    jagged_attention_reference,
    multi_head_jagged_flash_attention,
    offsets_from_lengths,
    select,
)


def _batch(lengths, heads, kv_heads, dim, dtype, seed):
    offsets = offsets_from_lengths(jnp.asarray(lengths, jnp.int32))
    total = int(offsets[-1])
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(total, heads, dim), (total, kv_heads, dim), (total, kv_heads, dim), (total, heads, dim)]
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes))
    return offsets, [x.astype(dtype) for x in (q, k, v, do)]


def _relative_error(got, want) -> float:
    got, want = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _reference(offsets, q, k, v, do, max_seq_len, fbgemm):
    """Output and gradients in float64 from the dense reference (JAX differentiates it), as one jitted
    program (run eagerly, each of its operations compiles on its own: seconds more on a CPU)."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64)) for x in (q, k, v, do)]
        kw = dict(scale=1.0, out_scale=1.0 / max_seq_len) if fbgemm else dict(causal=True)

        def forward_backward(q, k, v, do):
            out, vjp = jax.vjp(lambda q, k, v: jagged_attention_reference(q, k, v, offsets, max_seq_len,
                                                                          **kw), q, k, v)
            return (out, *vjp(do))

        return [np.asarray(x) for x in jax.jit(forward_backward)(*args)]


def check(op_name, backend, lengths, heads, kv_heads, dim, max_seq_len, dtype, tolerance, seed=0) -> bool:
    """Forward and backward of one op on `backend` against the float64 reference; one report line."""
    fbgemm = op_name == "multi_head_jagged_flash_attention"
    offsets, (q, k, v, do) = _batch(lengths, heads, kv_heads, dim, dtype, seed)

    def op(q, k, v):
        if fbgemm:
            return multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len, layout="THD",
                                                     backend=backend, allow_tf32=False)
        return jagged_attention(q, k, v, offsets, max_seq_len, causal=True, backend=backend,
                                allow_tf32=False)

    @jax.jit
    def forward_backward(q, k, v, do):
        out, vjp = jax.vjp(op, q, k, v)
        return (out, *vjp(do))

    jax.block_until_ready(forward_backward(q, k, v, do))  # compile
    start = time.perf_counter()
    got = jax.block_until_ready(forward_backward(q, k, v, do))
    elapsed_ms = 1e3 * (time.perf_counter() - start)
    want = _reference(offsets, q, k, v, do, max_seq_len, fbgemm)
    errors = {name: _relative_error(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    ok = all(e <= tolerance for e in errors.values())
    print(f"  {backend:9s} {jnp.dtype(dtype).name:8s} fwd+bwd {elapsed_ms:8.2f} ms; relative error "
          + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
          + f" (tolerance {tolerance:.0e}) {'OK' if ok else 'FAIL'}")
    return ok


def demo(args) -> int:
    backend = select.default_backend()
    print(f"jagged_flash_jax demo on {jax.devices()[0].device_kind} (JAX {jax.__version__}); "
          f"backend='auto' picks {backend!r} here")
    rng = np.random.default_rng(args.seed)
    gpu = backend == "triton"
    lengths = rng.integers(1, 1025 if gpu else 129, size=64 if gpu else 8)
    heads, kv_heads, dim, max_seq_len = (8, 2, 128, 1024) if gpu else (4, 2, 32, 96)
    dtype, tolerance = (jnp.bfloat16, 1e-2) if gpu else (jnp.float32, 1e-5)
    small = [5, 0, 33, 1, 48]
    ok = True
    print(f"\n{len(lengths)} sequences of {lengths.min()} to {lengths.max()} tokens, H={heads}, "
          f"H_kv={kv_heads}, D={dim}; checked against a float64 reference:\n"
          f"  o = jagged_attention(q, k, v, offsets, max_seq_len={max_seq_len}, causal=True)\n"
          f"  (softmax(q kᵀ / √D) v, each query over the keys up to its own position in its sequence; "
          f"GQA: {heads // kv_heads} query heads per kv head)")
    # The interpreter comes with the `interpret` extra (triton), which the package itself does not need.
    from .launch import interpret as interpreter

    try:
        interpreter.triton_internals()
        skipped = None
    except ImportError:
        skipped = ("triton is not installed (pip install 'jagged-flash-jax[interpret]' runs the Triton "
                   "kernels in Triton's interpreter here)")
    except interpreter.UnsupportedTritonError as err:
        skipped = str(err)
    for b in (["triton"] if gpu else []) + ["xla"]:
        ok &= check("jagged_attention", b, lengths, heads, kv_heads, dim, max_seq_len, dtype, tolerance)
    if skipped is None:
        print("  interpret: the same Triton kernels in Triton's interpreter, on a small batch:")
        ok &= check("jagged_attention", "interpret", small, 2, 1, 24, 40, jnp.float32, 1e-5)
    else:
        print(f"  interpret: skipped, {skipped}")
    print(f"\nFBGEMM's semantics, the same batch with H_kv = H:\n"
          f"  o = multi_head_jagged_flash_attention(q, k, v, offsets, max_seq_len={max_seq_len}, "
          f"layout='THD')\n"
          f"  (softmax(q kᵀ) v / max_seq_len, no scale)")
    for b in (["triton"] if gpu else []) + ["xla"]:
        ok &= check("multi_head_jagged_flash_attention", b, lengths, heads, heads, dim, max_seq_len, dtype,
                    tolerance)
    if skipped is None:
        ok &= check("multi_head_jagged_flash_attention", "interpret", small, 2, 2, 24, 40, jnp.float32, 1e-5)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jagged_flash_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser(
        "demo", help="forward and backward of both ops on a random jagged batch, on every backend available "
                     "here, checked against a float64 reference and timed")
    demo_parser.add_argument("--seed", type=int, default=0,
                             help="seed of the random sequence lengths (default: %(default)s)")
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
