"""Hopper tile sweep with per-warpgroup tile skipping (the forward's; the backward's was measured slower
and dropped, see 2026-12-01i_window_skip.md): per case, mode and variant, CUPTI device time of
the step and of each kernel, and the outputs' (gradients') largest difference from the first variant.
Its forward part ran on fb6c895 (L16384-w128,L16384-w256,L16384-w512: 2026-12-01h_window_tiles_fb6c895.log,
which chose 2 stages), its backward part on 802aa47 (2026-12-02a_bwd_window_tiles_802aa47.log, which chose
64-key dq tiles on 2 stages for narrow bands). On the H200, from the repository root:
  python3 benchmarks/results/profile/2026-12-01h_window_tiles.py \
      L4096-w256,L16384-w256,L4096-w1024,L16384-w1024,L2048,L1024 \
      L4096-w256,L16384-w256,L4096-w1024,L16384-w1024
(forward tiles for the first list, with JAGGED_FLASH_JAX_FORWARD=hopper; the dq tiles of the backward
for the second; a list of no case, e.g. "none", skips its part), writing $OUT/tiles.json. A third list
sweeps dk/dv's query tiles (64 and 32 rows) under the narrow-band entry's dq tiles (ran on 228a1ac:
2026-12-02h_dkdv_window_tiles_228a1ac.log)."""
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import cases, impls, timing
from jagged_flash_jax import configs, transforms

K = configs.KernelConfig
FWD = [("F128x128s2", K(128, 128, num_warps=4, num_stages=2, max_registers=168)),
       ("F128x64s2", K(128, 64, num_warps=4, num_stages=2, max_registers=168)),
       ("F128x64s3", K(128, 64, num_warps=4, num_stages=3, max_registers=168)),
       ("F128x64s4", K(128, 64, num_warps=4, num_stages=4, max_registers=168))]
def bwd(st2, bn):
    return dict(dkdv=K(64, 128, num_warps=4, num_stages=2, max_registers=168),
                dq=K(128, bn, num_warps=4, num_stages=st2, max_registers=168))
BWD = [("Bdq128s2", bwd(2, 128)), ("Bdq64s3", bwd(3, 64)), ("Bdq64s2", bwd(2, 64))]
def narrow(rows, stages):  # the narrow-band entry's dq tiles, dk/dv's query tiles of `rows`
    return dict(dkdv=K(rows, 128, num_warps=4, num_stages=stages, max_registers=168),
                dq=K(128, 64, num_warps=4, num_stages=2, max_registers=168))
DKDV = [("Bkv64s2", narrow(64, 2)), ("Bkv32s2", narrow(32, 2)), ("Bkv32s3", narrow(32, 3)),
        ("Bkv32s4", narrow(32, 4))]
out = []

def run(case, mode, label):
    jax.clear_caches()
    transforms.clear_programs()
    attend, prepare = impls.jfa(case, "triton")
    sets = [prepare(s) for s in cases.input_sets(case, "bfloat16", 3)]
    step = impls.timed_function(attend, mode)
    args = [impls.arguments(p, mode) for p in sets]
    t0 = time.time()
    try:
        res = jax.block_until_ready(jax.jit(step)(*args[0]))
        r = timing.device_ms(timing.every_set(step), args, 15)
    except Exception as e:
        print(f"{case.name:14s} {mode:7s} {label:10s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None
    ks = {k.split("(")[0][:28]: round(v, 4) for k, v in r.get("kernels", {}).items() if v > 0.01}
    tf = case.flops(mode) / r["device_ms"] / 1e9
    print(f"{case.name:14s} {mode:7s} {label:10s} {r['device_ms']:.4f} ms {tf:.0f} TF/s "
          f"({time.time() - t0:.0f}s) {ks}", flush=True)
    out.append(dict(case=case.name, mode=mode, variant=label, ms=r["device_ms"], kernels=r.get("kernels")))
    return res

def maxrel(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) /
                     (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30)) for x, y in zip(a, b))

# The variants replace both D = 128 "hopper" entries of the table (configs.BUILTIN_TABLE; until 802aa47
# they were configs.HOPPER_FORWARD_TILES, HOPPER_FORWARD_NARROW_TILES and HOPPER_BACKWARD_TILES).
ENTRIES = [(configs.FALLBACK_GPU, "hopper", 16, 128, n) for n in (512, None)]
BASE = {key: configs.BUILTIN_TABLE[key] for key in ENTRIES}


def use(**tiles):
    for key in ENTRIES:
        configs.BUILTIN_TABLE[key] = dataclasses.replace(BASE[key], **tiles)
    configs.load_table.cache_clear()


def sweep(names, mode, variants):
    for case in cases.select(names.split(","), quick=False):
        ref = None
        for label, tiles in variants:
            use(**tiles)
            res = run(case, mode, label)
            if res is not None:
                ref = res if ref is None else ref
                if res is not ref:
                    print(f"    maxrel vs {variants[0][0]}: {maxrel(res, ref):.3g}", flush=True)
    use()


os.environ["JAGGED_FLASH_JAX_FORWARD"] = "hopper"
sweep(sys.argv[1], "fwd", [(label, dict(fwd=tile)) for label, tile in FWD])
os.environ.pop("JAGGED_FLASH_JAX_FORWARD")
if len(sys.argv) > 2:
    sweep(sys.argv[2], "fwd+bwd", BWD)
if len(sys.argv) > 3:
    sweep(sys.argv[3], "fwd+bwd", DKDV)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "tiles.json"), "w"), indent=1)
