"""Pipelined time per call (many calls queued, one synchronization) of a trivial XLA op, a trivial
jax-triton kernel, and the forward of this library and of cuDNN (padded) on gr-ml1m and rec-long: where
host dispatch, not the kernels, sets the time of small cases. Needs a GPU and jax-triton.

    python -m benchmarks.probes.launch_overhead
"""

import time

import jax
import jax.numpy as jnp
import jax_triton
import triton
import triton.language as tl

from .. import cases, impls


@triton.jit
def copy_kernel(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i))


def per_call_ms(f, args, n=300) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready([f(*args) for _ in range(n)])
        best = min(best, (time.perf_counter() - start) / n * 1e3)
    return best


def main() -> None:
    x = jnp.ones(1024, jnp.float32)
    print("xla add         ms/call", per_call_ms(jax.jit(lambda x: x + 1), (x,)))
    copy = jax.jit(lambda x: jax_triton.triton_call(x, kernel=copy_kernel, out_shape=x, grid=(1,), N=1024))
    print("triton copy     ms/call", per_call_ms(copy, (x,)))
    for name in ("gr-ml1m", "rec-long"):
        (case,) = cases.select([name], quick=False)
        s = cases.input_sets(case, "bfloat16", 1)[0]
        for impl in ("jfa", "cudnn"):
            attend, prepare = impls.jfa(case, "triton") if impl == "jfa" else impls.cudnn_padded(case)
            q, k, v, _, aux = prepare(s)
            f = jax.jit(impls.timed_function(attend, "fwd"))
            print(f"{name:9s} {impl:5s} fwd ms/call", per_call_ms(f, (q, k, v, aux), n=100))


if __name__ == "__main__":
    main()
