#!/usr/bin/env bash
# The Hopper forward and backward on a Hopper GPU, in one call (about 5 minutes on the H200, 10.5 at
# most): the versions and the kernels a bfloat16 D = 128 problem takes; tests/test_hopper.py (compiled
# for sm_90a, then the forward and the backward against the float64 reference and the portable kernels,
# a jitted training step run twice) on 8 workers; then CUPTI device times of a `long`-like batch (16
# sequences of 1 to 4096 tokens, 8 heads, D = 128, bfloat16), forward alone and jitted forward + backward
# steps, with (forward/backward) hopper/hopper, hopper/portable and portable/portable.
#
#   bash tests/gpu_hopper_check.sh            # from the repository root
#
# Memory safety under compute-sanitizer (Hopper forward and backward included), separately (several minutes):
#   pytest -o addopts="-ra" -m gpu tests/test_memory_safety.py -k compute_sanitizer
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset JAGGED_FLASH_JAX_FORWARD JAGGED_FLASH_JAX_BACKWARD
status=0

python3 - <<'PY' || status=1
import jax
import jax.numpy as jnp
import triton

import jagged_flash_jax as jfa
from jagged_flash_jax import api
from jagged_flash_jax.launch import gpu, hopper

print(f"jax {jax.__version__}, triton {triton.__version__}, jax-triton "
      f"{gpu.jax_triton_module().__version__}, {jax.devices()[0].device_kind}, capability "
      f"{hopper.device_capability()}, gluon {hopper.gluon_available()}")
q = jnp.zeros((64, 2, 128), jnp.bfloat16)
offsets = jnp.asarray([0, 64], jnp.int32)
p = api._problem(q, q, q, offsets, offsets, max_seq_len=4096, kv_max_seq_len=4096, scale=0.1,
                 out_scale=1.0, causal=False, layout="THD", allow_tf32=True, backend="triton",
                 block_sizes=None, self_attention=True, validate=False)
print(f"bfloat16 D = 128, L4096 takes the {p.forward_kernel} forward ({hopper.portable_reason(p, q.dtype)}) "
      f"and the {p.backward_kernel} backward ({hopper.backward_portable_reason(p, q.dtype)})")
assert p.hopper_forward, "expected the Hopper forward here"
assert p.hopper_backward, "expected the Hopper backward here"
PY

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 python3 -m pytest -o addopts="-ra" -n 8 -p no:cacheprovider \
  tests/test_hopper.py || status=1

timeout 200 python3 - <<'PY' || status=1
import os

import jax
import jax.numpy as jnp
import numpy as np

import jagged_flash_jax as jfa
from benchmarks import timing
from jagged_flash_jax import configs

rng = np.random.default_rng(0)
B, H, D, L = 16, 8, 128, 4096
lengths = rng.integers(1, L + 1, B)
offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
T = int(offsets[-1])
q, k, v = (jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16) for _ in range(3))
pairs = float(np.sum(lengths.astype(np.float64) ** 2))


def forward(causal):
    return lambda q, k, v, o: jfa.jagged_attention(q, k, v, o, L, causal=causal)


def step(causal):
    def loss(q, k, v, o):
        return jnp.sum(jfa.jagged_attention(q, k, v, o, L, causal=causal).astype(jnp.float32) ** 2)

    return lambda q, k, v, o: jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, o)


# (forward, backward): both Hopper, the Hopper forward with the portable backward, both portable.
for kernel, backward in (("auto", "auto"), ("auto", "portable"), ("portable", "portable")):
    os.environ[configs.FORWARD_KERNEL_ENV] = kernel  # read when the problem is built: at the first call
    os.environ[configs.BACKWARD_KERNEL_ENV] = backward
    cases = (("forward", forward(False), 4 * H * D * pairs), ("forward causal", forward(True), 2 * H * D * pairs))
    cases = cases if backward == kernel else ()
    for name, fn, flops in (*cases, ("fwd+bwd step", step(False), 14 * H * D * pairs),
                            ("fwd+bwd causal", step(True), 7 * H * D * pairs)):
        program = timing.every_set(fn)
        arg_sets = [(q, k, v, offsets)]
        for _ in range(2):  # twice: XLA's command buffers (CUDA graphs) replay the second
            jax.block_until_ready(program(arg_sets))
        row = timing.device_ms(program, arg_sets, iterations=5)
        label = "/".join("hopper" if x == "auto" else x for x in (kernel, backward))
        if "device_ms" not in row:  # CUPTI could not time this program: say why
            print(f"{label:17s} {name:15s} {row}", flush=True)
            continue
        ms = row["device_ms"]
        print(f"{label:17s} {name:15s} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TF/s kernels {row['kernels']}",
              flush=True)
PY

echo "gpu_hopper_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
