#!/usr/bin/env bash
# One GPU device call: `bash tests/gpu/run.sh STAGE` from the repository root, carrying .whl/ (jax-triton's
# wheel). Installs jax-triton into /tmp/site, picks the triton, prints the versions and the ptxas jaxlib
# will use, runs the stage, and logs it all to $OUT/STAGE-tritonX.Y.log, ending with `rc=`.
#
#   STAGE           suite           the GPU tests (marked `gpu`) under backend="auto", but memcheck's
#                   suite-portable  the same with the portable kernels forced (no Hopper kernels)
#                   memcheck        the adversarial offsets under compute-sanitizer (portable; Hopper too on one)
#                   demo            python3 -m jagged_flash_jax demo
#   TRITON=3.6      the machine's triton (default); TRITON=3.9: /tmp/site39 (tests/gpu/install_triton39.sh)
#   PTXAS39_ON_PATH=1   with TRITON=3.9: triton 3.9's own ptxas (CUDA 13.4) first on PATH, to compare
#   WORKERS=4       pytest-xdist workers for the suites
#   LIMIT=540       seconds the stage may run (a device call stops at 600), then rc=124 in the log
#   PYTHON=python3, SITE=/tmp/site (where jax-triton goes), T39_SITE=/tmp/site39 and T39_PTXAS=/tmp/ptxas39
#   (install_triton39.sh's), COMMIT (when the copy has no .git), OUT (the call's folder; else /tmp/gpu-out)
set -uo pipefail
cd "$(dirname "$0")/../.."
usage="usage: [TRITON=3.6|3.9] bash tests/gpu/run.sh suite|suite-portable|memcheck|demo"
stage=${1:?$usage}
case $stage in suite|suite-portable|memcheck|demo) ;; *) echo "$usage" >&2; exit 2 ;; esac
triton=${TRITON:-3.6}
site39=${T39_SITE:-/tmp/site39}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
log="$out/$stage-triton$triton.log"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
unset JAGGED_FLASH_JAX_FORWARD JAGGED_FLASH_JAX_BACKWARD

python=${PYTHON:-python3}
site=${SITE:-/tmp/site}
[ -d "$site/jax_triton" ] || "$python" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl \
  || { echo "could not install .whl/*.whl into $site: carry .whl" >&2; exit 2; }
case $triton in
  3.6) export PYTHONPATH="$site:$PWD" ;;
  3.9) [ -d "$site39/triton" ] || { echo "no triton 3.9 in $site39: tests/gpu/install_triton39.sh" >&2; exit 2; }
       export PYTHONPATH="$site39:$site:$PWD"
       [ "${PTXAS39_ON_PATH:-0}" = 1 ] && export PATH="${T39_PTXAS:-/tmp/ptxas39}:$PATH" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

# The suites as tests/gpu_results/ ran them: the memcheck test deselected (its own stage), pyproject's
# addopts replaced (the machine has no nbmake), xdist loaded by name.
suite=("$python" -m pytest tests -m gpu -v -p xdist -n "${WORKERS:-4}" --dist worksteal -p no:cacheprovider
       -o addopts=-ra --durations=5
       --deselect tests/test_memory_safety.py::test_adversarial_offsets_on_the_gpu_under_compute_sanitizer)
# What that test runs, directly, so that the log names each case as it starts and ends.
memcheck="import jax, test_memory_safety as t
from jagged_flash_jax import _compat
for hopper in [False, True] if (_compat.cuda_capability(jax.devices()[0]) or (0,))[0] == 9 else [False]:
    t.check_offsets_cases(t.CASES, backend='triton', hopper=hopper)"
limit=(timeout "${LIMIT:-540}")

{
  # The device tool copies the working tree; the copy's git HEAD may lag it (seen on 2026-12-03), so say
  # how many tracked files differ from the commit named.
  commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  [ -z "${COMMIT:-}" ] && commit="$commit ($(git status --porcelain --untracked-files=no 2>/dev/null | wc -l) tracked files differ from it)"
  echo "stage $stage, triton $triton, commit $commit, $(date -u +%FT%TZ);" \
       "PTXAS39_ON_PATH=${PTXAS39_ON_PATH:-0}, ptxas on PATH: $(command -v ptxas || echo none)"
  "$python" - <<'PY'
import jax, triton
from jagged_flash_jax import _compat
from jagged_flash_jax.launch import gpu
capability = _compat.cuda_capability(jax.devices()[0])
print(f"jax {jax.__version__}, triton {triton.__version__} ({triton.__path__[0]}), "
      f"{jax.devices()[0].device_kind}, capability {capability}")
print("the triton backend:", gpu.unavailable_reason() or "available")
# The ptxas jaxlib assembles with, and the option asked of Triton.
ptxas = _compat.xla_ptxas()
arch = 10 * capability[0] + capability[1] if capability else 90
default = _compat.triton_ptx_version(arch)
print(f"jaxlib's ptxas: {ptxas} (PTX up to {ptxas and _compat.ptxas_ptx_version(ptxas)}); Triton "
      f"writes {default} for sm_{arch}, option {_compat.ptx_version_option(default)}")
PY
  case $stage in
    suite) "${limit[@]}" "${suite[@]}" ;;
    suite-portable)
      JAGGED_FLASH_JAX_FORWARD=portable JAGGED_FLASH_JAX_BACKWARD=portable "${limit[@]}" "${suite[@]}" ;;
    memcheck)
      command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer is not on PATH"; false; } &&
      (cd tests && XLA_PYTHON_CLIENT_ALLOCATOR=platform "${limit[@]}" compute-sanitizer --tool memcheck \
         --target-processes application-only --error-exitcode 99 --print-limit 20 "$python" -c "$memcheck") ;;
    demo) "${limit[@]}" "$python" -m jagged_flash_jax demo ;;
  esac
  echo "rc=$?"
} 2>&1 | tee "$log"
rc=$(tail -n 1 "$log" | sed -n 's/^rc=//p')
exit "${rc:-1}"
