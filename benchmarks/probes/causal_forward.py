"""The Hopper forward under causal masking on one case (default `rec-long-causal`), variant by variant in one
process, for the account of its distance from cuDNN (CUPTI device time of the forward, ms):

- the band as `causal=True` (both consumer warpgroups compute every key tile of the block) against the
  same band as `window=(None, 0)` (each warpgroup computes its own tiles: the windowed path);
- the forward's tiles: the table's, then each of --tiles (BLOCK_M,BLOCK_N,warps,stages[,regs]) through
  $JAGGED_FLASH_JAX_TUNED_CONFIGS;
- the same case without the mask, the work that the causal one halves.

    python -m benchmarks.probes.causal_forward [--case rec-long-causal] [--tiles 128,64,4,2 128,64,4,3]
"""

import argparse
import dataclasses
import json
import os
import tempfile

import jax

from jagged_flash_jax import select

from .. import cases, impls, timing


def _time(case, sets, iterations: int) -> tuple[float, dict | str | None]:
    """The forward's CUPTI device time (ms; NaN off the GPU) and its kernels (else why no timing)."""
    attend, prepare = impls.jfa(case, "triton")
    args = [impls.arguments(prepare(s), "fwd") for s in sets]
    fn = impls.timed_function(attend, "fwd")
    jax.block_until_ready([jax.jit(fn)(*a) for a in args])  # compiles
    row = timing.device_ms(timing.every_set(fn), args, iterations)
    return row.get("device_ms", float("nan")), row.get("kernels", row.get("timer_note"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.causal_forward", description=__doc__)
    p.add_argument("--case", default="rec-long-causal")
    p.add_argument("--tiles", nargs="*", default=["128,64,4,2", "128,64,4,3"])
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args(argv)
    (case,) = cases.select([args.case], quick=False)
    sets = cases.input_sets(case, "bfloat16", 2)
    band = dataclasses.replace(case, causal=False, window=(None, 0))
    full = dataclasses.replace(case, causal=False)
    tiles = [None] + [[int(x) for x in t.split(",")] for t in args.tiles]
    for tile in tiles:
        if tile is None:
            os.environ.pop(select.TUNED_CONFIGS_ENV, None)
        else:
            entry = dict(gpu=jax.devices()[0].device_kind, kernels="hopper", bits=16, head_dim=case.head_dim,
                         max_seq_len=None, fwd=tile if len(tile) == 5 else tile + [168], dkdv=None, dq=None)
            path = os.path.join(tempfile.mkdtemp(), "tiles.json")
            with open(path, "w") as f:
                json.dump([entry], f)
            os.environ[select.TUNED_CONFIGS_ENV] = path
        variants = [("causal", case), ("window (None, 0)", band)]
        variants += [("unmasked", full)] if tile is None else []
        for name, c in variants:
            ms, kernels = _time(c, sets, args.iterations)
            print(f"[causal-forward] {case.name} {name} tiles {tile or 'table'}: {ms:.4f} ms {kernels}",
                  flush=True)


if __name__ == "__main__":
    main()
