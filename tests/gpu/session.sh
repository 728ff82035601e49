#!/usr/bin/env bash
# One device call of a GPU session, by number, from the repository root: `bash tests/gpu/session.sh N`.
# The calls run back to back (the machine is handed back after 30 s idle): 1 to 5 each carry .whl, .gr
# (generative-recommenders' kernel, for 3) and one chunk of the triton 3.9 wheel (.t39a ... .t39e), stage
# it, and do the session's triton 3.6 work; 5 installs triton 3.9 and runs its tests, 6 its benchmarks.
# Logs go to $OUT, each ending with `rc=`.
#
#   1  triton 3.6: the GPU suite with the portable kernels forced, beside memcheck on "hopper-fused-dq";
#      then the soft cap's cost by its tanh (benchmarks/probes/softcap_tanh.py)
#   2  triton 3.6: the softmax rows (bfloat16, the fbgemm cases in float32 too) against cuDNN
#   3  triton 3.6: HSTU's long cases; gr's Triton kernel in PyTorch, one process per case and mode
#   4  triton 3.6: the window sweep against cuDNN
#   5  triton 3.9: installed, then the GPU suite with the portable kernels forced, beside memcheck on the
#      Hopper kernels (deterministic and with dq fused)
#   6  triton 3.9: the softmax rows, the soft cap's tanh, HSTU's cases
set -uo pipefail
cd "$(dirname "$0")/../.."
call=${1:?usage: bash tests/gpu/session.sh 1..6}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false WORKERS=${WORKERS:-12}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
start=$(date +%s)
elapsed() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
stage() { bash tests/gpu/stage_triton39.sh "$1" 2>&1 | tee -a "$out/stage.log"; }
# memcheck on the Hopper kernels ($4: the variants, e.g. "['hopper fused dq']", or None for all). Only the
# application is checked: jaxlib runs ptxas as a child process when it loads a kernel, and the sanitizer
# crashed (SIGSEGV) following it on triton 3.9 and on an int64 case's new compilation on 3.6.
memcheck() {
  local triton=$1 path=$2 limit=$3 only=$4
  (cd tests && PYTHONPATH="$path" XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$limit" compute-sanitizer \
     --tool memcheck --target-processes application-only --error-exitcode 99 --print-limit 20 python3 -c \
     "import test_memory_safety as t; t.check_offsets_cases(t.CASES, backend='triton', hopper=True, only=$only)" \
     > "$out/memcheck-hopper-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/memcheck-hopper-triton$triton.log")
}
summary() {
  for f in "$out"/*.log; do echo "== $(basename "$f"): $(grep -E "passed|failed|ERROR SUMMARY|all ok|rc=" "$f" | tail -3 | tr '\n' ' ')"; done
  grep -h "^FAILED\|^ERROR" "$out"/suite-*.log 2>/dev/null | head -40
}
softmax_bench() {  # $1 tag, $2 cases, $3 impls, $4 budget (s), $5 PYTHONPATH
  PYTHONPATH="$5" timeout $(( $4 + 40 )) python3 -m benchmarks.run --out "/tmp/bench-$1" --cases "$2" \
    --impls "$3" --seconds 0.1 --budget-s "$4" > "$out/bench-$1.log" 2>&1; echo "rc=$?" >> "$out/bench-$1.log"
  cp "/tmp/bench-$1/results.json" "$out/bench-$1.json" 2>/dev/null
  grep -E "ok:|error|skipped" "$out/bench-$1.log" | grep -v "needs a GPU" | grep -c "ok:"
}
softcap() {  # $1 triton, $2 PYTHONPATH
  PYTHONPATH="$2" timeout 150 python3 -m benchmarks.probes.softcap_tanh --out "$out/softcap-triton$1" \
    --cases L4096,L4096-softcap50 --budget-s 40 > "$out/softcap-triton$1.log" 2>&1
  echo "rc=$?" >> "$out/softcap-triton$1.log"; cat "$out/softcap-triton$1.log"
}
hstu_jax() {  # $1 triton, $2 PYTHONPATH, $3 impls, $4 limit, cases after
  local triton=$1 path=$2 impls=$3 limit=$4; shift 4
  PYTHONPATH=$path timeout "$limit" python3 -m benchmarks.hstu_run --out "/tmp/hstu$triton" --cases "$@" \
    --impls "$impls" --seconds 0.3 > "$out/hstu-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/hstu-triton$triton.log"
  cp "/tmp/hstu$triton/hstu_results.json" "$out/hstu-triton$triton.json" 2>/dev/null
  grep "^\[hstu\]" "$out/hstu-triton$triton.log"
}
site36=/tmp/site:$PWD
site39=/tmp/site39:/tmp/site:$PWD
rows=fbgemm,L-sweep,D-sweep,causal,gqa,cross,window,softcap
long_hstu=(b32-l4096-random-targets b32-l8192-random-targets b32-l8192-uniform)
case $call in
  1) stage .t39a
     memcheck 3.6 "$site36" 200 "['hopper fused dq']" &
     LIMIT=250 bash tests/gpu/run.sh suite-portable > /dev/null 2>&1
     wait; elapsed "suite"; summary
     softcap 3.6 "$site36"; elapsed "call 1" ;;
  2) stage .t39b
     softmax_bench triton3.6 "$rows" jfa-triton,cudnn-packed,cudnn-padded 230 "$site36"; elapsed "call 2" ;;
  3) stage .t39c
     hstu_jax 3.6 "$site36" jfa-triton,padded 100 "${long_hstu[@]}"; elapsed "hstu"
     # gr's kernel, one process per case and mode (an illegal address ends a process); pinned configs
     # first (one per kernel), then gr's own autotuning on the first case
     for spec in "b128-l1024-uniform fwd pinned" "b128-l1024-uniform fwd+bwd pinned" \
                 "b128-l1024-random-targets fwd pinned" "b128-l1024-random-targets fwd+bwd pinned" \
                 "b64-l2048-h8-d64-random-targets fwd+bwd pinned" "b32-l4096-random-targets fwd+bwd pinned" \
                 "b32-l8192-random-targets fwd+bwd pinned" "b128-l1024-uniform fwd full"; do
       set -- $spec
       tag="$1-$2-$3"; tag=${tag//+/}
       PYTHONPATH=$PWD/.gr timeout 60 python3 benchmarks/hstu_torch_bench.py --out "$out/gr-$tag.json" \
         --cases "$1" --modes "$2" --autotune "$3" > "$out/gr-$tag.log" 2>&1
       echo "rc=$?" >> "$out/gr-$tag.log"
       echo "$spec: $(grep -E "^b[0-9]" "$out/gr-$tag.log" | tail -1) $(grep -m1 -E "Error|error:" "$out/gr-$tag.log" | cut -c1-160) $(tail -1 "$out/gr-$tag.log")"
       [ $(( $(date +%s) - start )) -gt 330 ] && break
     done; elapsed "call 3" ;;
  4) stage .t39d
     softmax_bench triton3.6-sweep window-sweep jfa-triton,cudnn-packed,cudnn-padded ${BUDGET:-100} "$site36"
     elapsed "call 4" ;;
  5) stage .t39e && bash tests/gpu/install_triton39.sh > "$out/install-triton3.9.log" 2>&1
     echo "rc=$?" >> "$out/install-triton3.9.log"; tail -2 "$out/install-triton3.9.log"
     memcheck 3.9 "$site39" 260 None &
     TRITON=3.9 LIMIT=260 bash tests/gpu/run.sh suite-portable > /dev/null 2>&1
     wait; elapsed "call 5"; summary ;;
  6) softmax_bench triton3.9 "$rows" jfa-triton ${BUDGET:-170} "$site39"; elapsed "softmax"
     softcap 3.9 "$site39"; elapsed "softcap"
     hstu_jax 3.9 "$site39" jfa-triton 60 b128-l1024-random-targets "${long_hstu[@]}"; elapsed "call 6" ;;
  *) echo "usage: bash tests/gpu/session.sh 1..6" >&2; exit 2 ;;
esac
