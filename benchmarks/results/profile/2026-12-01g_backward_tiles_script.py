"""Hopper backward tile sweep and the auto threshold: per case and variant, CUPTI device time of the
fwd+bwd step and of each kernel, and the gradients' difference from the portable backward."""
import os, sys, time, json
import jax, jax.numpy as jnp, numpy as np
from jagged_flash_jax import configs
from jagged_flash_jax import transforms
from benchmarks import cases, impls, timing

K = configs.KernelConfig
def tiles(bm, st, bn, st2):
    return dict(dkdv=K(bm, 128, num_warps=4, num_stages=st, max_registers=168),
                dq=K(128, bn, num_warps=4, num_stages=st2, max_registers=168))
SWEEP = {
    128: [("base", tiles(64, 2, 128, 2)), ("bm32s2", tiles(32, 2, 128, 2)), ("bm32s3", tiles(32, 3, 128, 2)),
          ("bm32s4", tiles(32, 4, 128, 2)), ("dq64s3", tiles(64, 2, 64, 3))],
    64: [("base", tiles(64, 2, 128, 3)), ("bm64s3", tiles(64, 3, 128, 3)), ("bm32s3", tiles(32, 3, 128, 3)),
         ("bm32s4", tiles(32, 4, 128, 3)), ("bm128s2", tiles(128, 2, 128, 3)), ("dq128s4", tiles(64, 2, 128, 4))],
}
CASES = sys.argv[1].split(",")
THRESH = sys.argv[2].split(",") if len(sys.argv) > 2 else []
out = []

def run(case, label, env_bwd, tile=None, ref=None):
    os.environ["JAGGED_FLASH_JAX_BACKWARD"] = env_bwd
    if tile is not None:
        configs.HOPPER_BACKWARD_TILES[case.head_dim] = tile
    jax.clear_caches(); transforms._forward_fn.cache_clear(); transforms._backward_fn.cache_clear()
    attend, prepare = impls.jfa(case, "triton")
    sets = [prepare(s) for s in cases.input_sets(case, "bfloat16", 3)]
    step = impls.timed_function(attend, "fwd+bwd")
    args = [impls.arguments(p, "fwd+bwd") for p in sets]
    t0 = time.time()
    try:
        grads = jax.block_until_ready(jax.jit(step)(*args[0]))
        r = timing.device_ms(timing.every_set(step), args, 15)
    except Exception as e:
        print(f"{case.name:14s} {label:9s} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True); return None
    err = None
    if ref is not None:
        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - h.astype(jnp.float32))) /
                        (float(jnp.max(jnp.abs(h.astype(jnp.float32)))) + 1e-30)) for g, h in zip(grads, ref))
    ks = {k.split("(")[0][:28]: round(v, 4) for k, v in r.get("kernels", {}).items() if v > 0.01}
    tf = case.flops("fwd+bwd") / r["device_ms"] / 1e9 if "device_ms" in r else None
    print(f"{case.name:14s} {label:9s} fwd+bwd {r.get('device_ms', float('nan')):.4f} ms {tf:.0f} TF/s maxrel_vs_portable={err} "
          f"compile+first {time.time()-t0:.0f}s kernels {ks}", flush=True)
    out.append(dict(case=case.name, variant=label, ms=r.get("device_ms"), kernels=r.get("kernels"), err=err))
    return grads

for case in cases.select(CASES, quick=False):
    base = dict(configs.HOPPER_BACKWARD_TILES)
    ref = run(case, "portable", "portable")
    for label, tile in SWEEP[case.head_dim]:
        run(case, label, "hopper", tile, ref)
    configs.HOPPER_BACKWARD_TILES.update(base)
for case in cases.select(THRESH, quick=False):
    ref = run(case, "portable", "portable")
    run(case, "hopper", "hopper", None, ref)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_tiles.json"), "w"), indent=1)
