#!/usr/bin/env bash
# One device call of a GPU session, by number, from the repository root: `bash tests/gpu/session.sh N`.
# The calls run back to back (the machine is handed back after 30 s idle): 1 to 5 each carry .whl and one
# chunk of the triton 3.9 wheel (.t39a ... .t39e; 2 also .gr, generative-recommenders' kernel), stage it,
# and do the session's triton 3.6 work; 5 installs triton 3.9 and runs its tests, 6 its benchmarks.
# Logs go to $OUT, each ending with `rc=`.
#
#   1  triton 3.6: the GPU suite, beside memcheck on the Hopper kernels (and dq fused) and the demo
#   2  triton 3.6: HSTU on the GPU (the library's op, padded JAX, gr's Triton kernel in PyTorch)
#   3  stage only          4  stage only
#   5  triton 3.9: installed, then the GPU suite beside memcheck and the demo
#   6  triton 3.9: the softmax rows against cuDNN, deterministic and not, and HSTU's op
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
# memcheck on the Hopper kernels, deterministic and with dq fused (the portable kernels' addressing did
# not change; their adversarial offsets run in the CPU suite between guard zones)
memcheck() {
  local triton=$1 path=$2
  (cd tests && PYTHONPATH="$path" XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$3" compute-sanitizer \
     --tool memcheck --error-exitcode 99 --print-limit 20 python3 -c \
     "import test_memory_safety as t; t.check_offsets_cases(t.CASES, backend='triton', hopper=True)" \
     > "$out/memcheck-hopper-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/memcheck-hopper-triton$triton.log")
}
summary() {
  for f in "$out"/*.log; do echo "== $(basename "$f"): $(grep -E "passed|failed|ERROR SUMMARY|all checks|rc=" "$f" | tail -3 | tr '\n' ' ')"; done
  grep -h "^FAILED\|^ERROR" "$out"/suite-*.log 2>/dev/null | head -40
}
softmax_bench() {  # $1 tag, $2 cases, $3 budget (s), $4 PYTHONPATH
  PYTHONPATH="$4" timeout $(( $3 + 30 )) python3 -m benchmarks.run --out "/tmp/bench-$1" --cases "$2" \
    --dtypes bfloat16 --impls jfa-triton,jfa-triton-nondet,cudnn-packed,cudnn-padded --seconds 0.3 \
    --budget-s "$3" > "$out/bench-$1.log" 2>&1; echo "rc=$?" >> "$out/bench-$1.log"
  cp "/tmp/bench-$1/results.json" "$out/bench-$1.json" 2>/dev/null
  grep -E "ok:|error|skipped" "$out/bench-$1.log" | grep -v "needs a GPU" | tail -60
}
site36=/tmp/site:$PWD
site39=/tmp/site39:/tmp/site:$PWD
case $call in
  1) stage .t39a
     memcheck 3.6 "$site36" 250 &
     LIMIT=250 bash tests/gpu/run.sh demo > /dev/null 2>&1 &
     LIMIT=260 bash tests/gpu/run.sh suite > /dev/null 2>&1
     wait; elapsed "call 1"; summary ;;
  2) stage .t39b
     PYTHONPATH=$site36 timeout 100 python3 -m benchmarks.hstu_run --out /tmp/hstu36 --no-long \
       --cases b128-l1024-random-targets b64-l2048-h8-d64-random-targets \
       b64-l2048-random-targets-context-window --impls jfa-triton,padded --seconds 0.3 \
       > "$out/hstu-triton3.6.log" 2>&1; echo "rc=$?" >> "$out/hstu-triton3.6.log"
     cp /tmp/hstu36/hstu_results.json "$out/hstu-triton3.6.json" 2>/dev/null; elapsed "hstu"
     timeout 110 python3 benchmarks/hstu_torch_bench.py --out "$out/hstu-gr.json" \
       --cases b128-l1024-random-targets b64-l2048-h8-d64-random-targets > "$out/hstu-gr.log" 2>&1
     echo "rc=$?" >> "$out/hstu-gr.log"; elapsed "gr"
     grep "^\[hstu\]" "$out/hstu-triton3.6.log"; tail -8 "$out/hstu-gr.log" ;;
  3) stage .t39c ;;
  4) stage .t39d ;;
  5) stage .t39e && bash tests/gpu/install_triton39.sh > "$out/install-triton3.9.log" 2>&1
     echo "rc=$?" >> "$out/install-triton3.9.log"; tail -4 "$out/install-triton3.9.log"
     memcheck 3.9 "$site39" 250 &
     TRITON=3.9 LIMIT=250 bash tests/gpu/run.sh demo > /dev/null 2>&1 &
     TRITON=3.9 LIMIT=260 bash tests/gpu/run.sh suite > /dev/null 2>&1
     wait; elapsed "call 5"; summary ;;
  6) softmax_bench triton3.9 long,L4096-D256,long-causal,rec-long,L4096-softcap50,L4096-D64 110 "$site39"
     elapsed "softmax"
     PYTHONPATH=$site39 timeout 45 python3 -m benchmarks.hstu_run --out /tmp/hstu39 \
       --cases b128-l1024-random-targets b64-l2048-h8-d64-random-targets --impls jfa-triton --seconds 0.3 \
       > "$out/hstu-triton3.9.log" 2>&1; echo "rc=$?" >> "$out/hstu-triton3.9.log"
     cp /tmp/hstu39/hstu_results.json "$out/hstu-triton3.9.json" 2>/dev/null
     grep "^\[hstu\]" "$out/hstu-triton3.9.log"; elapsed "call 6" ;;
  *) echo "usage: bash tests/gpu/session.sh 1..6" >&2; exit 2 ;;
esac
