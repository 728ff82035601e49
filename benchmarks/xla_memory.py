"""Peak memory of the blockwise xla backend on the CPU: forward + backward of `jagged_attention` for two
sequences of max_seq_len tokens (default B=2, H=4, D=64, L=16384), as the process's peak resident size and
XLA's memory analysis. `python -m benchmarks.xla_memory [--max-seq-len L]`.
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp

import jagged_flash_jax as jfa


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.xla_memory", description=__doc__)
    parser.add_argument("--max-seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    length, heads, dim = args.max_seq_len, args.heads, args.head_dim
    offsets = jfa.offsets_from_lengths(jnp.array([length, length]))
    q, k, v, do = (jax.random.normal(key, (2 * length, heads, dim), jnp.float32)
                   for key in jax.random.split(jax.random.key(0), 4))

    def step(q, k, v, do):
        attend = lambda q, k, v: jfa.jagged_attention(q, k, v, offsets, length, backend="xla")  # noqa: E731
        return jax.vjp(attend, q, k, v)[1](do)

    compiled = jax.jit(step).lower(q, k, v, do).compile()
    stats = compiled.memory_analysis()
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, do))
    print(f"B=2 H={heads} D={dim} L={length} on {jax.devices()[0].device_kind}: fwd+bwd "
          f"{time.perf_counter() - start:.1f} s; XLA temporaries {stats.temp_size_in_bytes / 1e9:.2f} GB, "
          f"arguments {stats.argument_size_in_bytes / 1e9:.2f} GB; peak resident memory of the process "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
