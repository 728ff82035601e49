"""The shared memory of HSTU's portable kernels on the tiles they take, compiled for sm_90a as jax-triton
0.4.1 compiles them (benchmarks.probes.ptx); no GPU needed. Run from the repository root:
python -m benchmarks.probes.hstu_shared [--jobs 2] (triton from PYTHONPATH).

HSTU's portable kernels take the softmax kernels' tiles at the padded head dimension max(D, V)
(launch/hstu.tiles), fitted to max_seq_len within sm_90's shared memory as `configs.portable_shared_bytes`
counts it for the softmax kernels. HSTU's programs hold other tiles (v of V columns beside q and k of D;
its backward one kernel for dq and dk/dv), so that count does not bound theirs: this compiles every
launch of a forward and backward over head dimensions, value dimensions, element sizes and lengths that
reach every entry of the tile table and every fit, and prints each distinct tile's figure against
configs.SHARED_MEMORY_BYTES. Exit status 1 where one is over.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from benchmarks.probes import ptx

# (D, V): the padded head dimensions of the table's entries, V wider and narrower than D.
DIMS = ((32, 32), (64, 64), (128, 128), (256, 256), (64, 256), (256, 64), (128, 96))
DTYPES = ("bfloat16", "float32")
# max_seq_len: short ones fit the query blocks (and give their rows to the key blocks); the table's
# buckets are 256, 1024 and longer.
LENGTHS = (16, 33, 64, 100, 256, 1024, 4096)


def cases() -> list[tuple[str, dict]]:
    return [(f"hstu-d{d}-v{v}-{dtype}-L{n}",
             dict(kernels="portable", op="hstu", dim=d, value_dim=v, dtype=dtype, layout="THD", causal=True,
                  max_seq_len=n))
            for (d, v), dtype, n in itertools.product(DIMS, DTYPES, LENGTHS)]


def tiles(launch: dict) -> str:
    blocks = sorted((k, v) for k, v in launch["constants"].items() if k.endswith(("BLOCK_M", "BLOCK_N")))
    return " ".join(f"{k}={v}" for k, v in blocks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.hstu_shared", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    from jagged_flash_jax import configs

    launches = ptx.capture(cases())
    digests = ptx.digest(launches, jobs=args.jobs)
    print(f"triton {digests['triton']}; sm_90a shared memory per block: {configs.SHARED_MEMORY_BYTES} bytes")
    seen, over = {}, 0
    for case, calls in launches.items():
        for launch, result in zip(calls, digests["cases"][case], strict=True):
            key = (result["kernel"], result["ptx"])
            if key in seen:
                continue
            seen[key] = case
            fits = result["shared"] <= configs.SHARED_MEMORY_BYTES
            over += not fits
            print(f"{'ok  ' if fits else 'OVER'} {result['shared']:>7} B  {result['kernel']:<16} "
                  f"warps={launch['num_warps']} stages={launch['num_stages']} {tiles(launch)}"
                  f"  (first: {case})")
    largest = max(r["shared"] for results in digests["cases"].values() for r in results)
    print(f"{len(seen)} distinct kernels of {len(launches)} cases; largest {largest} B; over: {over}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
