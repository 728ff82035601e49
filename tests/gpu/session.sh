#!/usr/bin/env bash
# One device call of a GPU session, by number, from the repository root: `bash tests/gpu/session.sh N`.
# The calls run back to back (the machine is handed back after 30 s idle): 1 to 5 each carry .whl, .gr
# (generative-recommenders' kernel, for 4) and one chunk of the triton 3.9 wheel (.t39a ... .t39f, each
# under 48 MiB so that it fits a call's 64 MiB beside the checkout), stage it, and do the session's triton
# 3.6 work; `stage .t39e` stages the fifth alone; 5 (carrying .t39f) installs triton 3.9 and runs its
# tests, 6 its benchmarks. "After staging" below means after STAGE_ONLY=1 2-4 and `stage .t39e`.
# Logs go to $OUT, each ending with `rc=`; a call returns at most 8 files, so end a call's command with
# `cd $OUT && tar czf callN.tgz --remove-files $(ls)`. BUDGET (s) bounds a call's benchmark run.
#
#   1  triton 3.6: the GPU suite under auto, beside memcheck (portable, Hopper) and the demo
#   2  triton 3.6: HSTU's Hopper kernels: their GPU tests beside their memcheck, then their timing
#   3  triton 3.6: the softmax rows against cuDNN (the groups the last session's budget left out first)
#   4  triton 3.6: HSTU's long cases; gr's Triton kernel in PyTorch, one process per case and mode
#   5  triton 3.9: installed, then the GPU suite under auto beside memcheck
#   6  triton 3.9: memcheck (dq fused by TMA, HSTU Hopper) beside HSTU's Hopper kernels' GPU tests, their
#      timing, then the softmax rows 3.9 has not measured
#   7  the GPU suite with the portable kernels forced, under TRITON (3.9 by default; 3.6 as well: "3.6 3.9")
#   8  triton 3.9 (after 5): the TMA dq-fused backward (its padded dq accumulator): its dq-fused GPU tests
#      beside its memcheck (MEMCHECK: the variants), then its timing against the default backward in one
#      process (CASES: the rows)
#   9  every GPU test of HSTU under auto, triton 3.6, and 3.9 where 5 installed it (TRITONS="3.9": 3.9 only)
#  10  the D = 256 Hopper backward (dk/dv's warpgroups splitting the columns) and auto's backward choices
#      (D = 64 and 256): the GPU suite under auto beside memcheck of the D = 256 Hopper kernels, then
#      their timing against the portable backward; on triton 3.6, staging .t39a; with TRITON=3.9 (after
#      staging; carrying .t39f) installing 3.9 first. MEMCHECK (default "['hopper D256']") the
#      Hopper variants memcheck runs; M32=0 leaves out the timing of D = 256's query tiles of 32
#  11  triton 3.6: Nsight Compute of the Hopper backward's kernels on CASE (default L4096-D256, one step),
#      the account its timing lacks: speed of light, memory and warp states of dk/dv and dq (CASE=L4096-D64:
#      D = 64's, the account its 0.93x still lacks)
#  12  TRITON (3.9 by default, after its install): the Hopper backward's tiles at D = 64 (deeper rings; the
#      table's entry was swept on older kernels), each a tuned table's entry (every one compiles within
#      shared memory with 0 spills under 3.9), against the table's, on L4096-D64
#  13  triton 3.6, staging .t39a: memcheck of the Hopper backward at D = 64, then the D = 64 rows (auto
#      takes it) against the portable backward and cuDNN
#  14  triton 3.6, staging .t39a: the GPU suite under auto beside the portable kernels forced (5 workers
#      each), beside memcheck of the portable and default Hopper kernels and of the dq-fused, D = 64 and
#      D = 256 Hopper backwards
#  15  triton 3.9 (after staging): its install, then 14's work under it (SUITES=suite: the one under auto)
#  16  rec-long-causal against cuDNN (3.9, 3.6), the causal forward's probe (benchmarks/probes/
#      causal_forward.py: the band per warpgroup, 64-key tiles), jfa-triton-nondeterministic rows (3.9)
#  17  triton 3.6, staging .t39a: the Hopper forward's GPU tests beside memcheck of the Hopper kernels
#      (MEMCHECK=0: none), then rec-long-causal's timing (IMPLS, default jfa-triton)
#  18  triton 3.9 (after staging): its install, what the suite logs REST did not reach, and 17's
#  19  triton 3.6, staging .t39a: Nsight Compute of the Hopper backward's kernels on CASES (D = 64's account
#      beside D = 128's), then the D = 64 rows with dq fused (atomics) and causal D = 256, against cuDNN
#  20  triton 3.9 (installed by 15): 19's rows
#  21  triton 3.9 (after staging): its install, 20, then memcheck (MEMCHECK) under 3.9 beside the tests the
#      3.6 suite logs REST did not reach
#  22, 23, 24, 26  timed patches since merged (the FFMA softmax, 2aaf0a4; the banded dk/dv's own waits,
#      f47179d): 27 times the tree against a copy without one (PATCH), 19 profiles the tree
#  25  D = 64's dk/dv query tiles of 128 as tuned entries: their D = 64 GPU tests, then their timing
#      against the table's (TRITON, default 3.6, staging .t39a)
#  27  the tree against a copy with PATCH reversed (default the FFMA softmax's; FORWARD=1: applied):
#      alternating timings under TRITON (3.6 staging STAGE; 3.9 after its install)
#  28  triton 3.9 (after staging): its install, then the banded rows (causal, windows, D = 64 causal) and
#      the long rows against cuDNN, for results.json
#  29  what the suite logs REST did not reach beside memcheck of MEMCHECK's Hopper variants, under TRITON
#      (3.6 staging .t39a; 3.9 after staging, installing it)
#  30  the prepared Hopper forward at D = 64 (PATCH) on each of its candidate tiles (FWD64), as tuned tables,
#      after the tree's portable forward, under TRITON
#  31  the portable forward's tiles at D = 64 (FWD: the table's 8-warp 128x64 on 3 stages beside 4-warp
#      tiles), each timed by benchmarks.tune on CASES, under TRITON (3.6 staging .t39a; 3.9 after staging)
#  32  the portable forward's fwd_causal at D = 64 (31's finding): the D = 64 GPU tests under auto beside
#      the same with the portable kernels forced, then the causal D = 64 rows against cuDNN, under TRITON
#      (3.6 staging .t39a; 3.9 after staging)
#  33  the portable forward's TMA loads (merged on 2026-12-07, session 5; PATCH: a patch on a copy): their
#      GPU tests beside memcheck, then the forward with them against pointer loads, under TRITON (3.6
#      staging .t39a; 3.9 after staging). Next: the rows where auto now takes them and that no run has
#      timed, D = 128 below the Hopper forward's 1024 tokens, and D = 256: after staging, `TRITON=3.9
#      TESTS_K=tma CASES=L256,L512,cross,L4096-D256 bash tests/gpu/session.sh 33`
#  34  the sequences' order (benchmarks.probes.sequence_order): CASES' lengths as drawn, longest first and
#      shortest first, forward and forward + backward, alternating ROUNDS times, under TRITON (3.9 after
#      staging, installing it; 3.6 staging .t39a): what taking the longest sequences' items first could
#      gain the persistent Hopper kernels (its --model predicts 3.4% of `long`'s kernels, 1.6% of
#      dlrm-long's, 0.3% of L8192's); SCHEDULER=1: the drawn lengths through the Hopper kernels taking
#      the sequences longest first (calls.sequence_order) against in the offsets' order; HSTU=1: then
#      HSTU's Hopper kernels on its long cases, longest first against in the offsets' order
#  35  the tree against a copy with PATCH applied (session 8: the producers' read-ahead), both through
#      34's --scheduler probe (each order in one process), alternating ROUNDS times, under TRITON;
#      TESTS=1 first the copy's Hopper GPU tests beside its memcheck; HSTU=1 HSTU's orders, tree and copy
# Next (after session 9 of 2026-12-07, which merged dk/dv's K from registers at D = 64 and dropped dq's
# register operands at D = 128): 14 and, after staging, 15 (the GPU suites under auto and with the portable
# kernels forced, memcheck) on main, then 28 and 13's rows against cuDNN (D = 64 above all) for results.json;
# the prepared V from registers at D = 64 (docs/performance.md, "Prepared on 2026-12-07, session 9"), under
# 3.6 (STAGE .t39a) and 3.9: FORWARD=1 PATCH=2026-12-07_register_v_d64.mbox TESTS=1 MEMCHECK="['hopper D64']"
# CASES=L4096-D64,L4096-D64-causal,gqa-16x4-L512-D64 bash tests/gpu/session.sh 27.
# STAGE_ONLY=1 makes 2, 3 and 4 stage their chunk and stop (a session short of device time), as `stage DIR`
# does for any chunk folder. The Hopper forward at D = 64 (27 and 30 on 2026-12-07, session 2) was slower
# unmasked and 4% faster causal at L = 4096: not adopted (docs/performance.md). Next: 31 under 3.6
# (STAGE .t39a), then under 3.9 after staging: if a 4-warp tile wins under 3.9 and holds under 3.6, it
# becomes the table's D = 64 forward (else a triton-release choice, as hopper_dkdv_triton_stages makes);
# then 14, 15 and 28 on the merged tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
call=${1:?usage: bash tests/gpu/session.sh 1..35|stage DIR}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false WORKERS=${WORKERS:-12}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
start=$(date +%s)
elapsed() { echo "[$1 at $(( $(date +%s) - start )) s]"; }
stage() { bash tests/gpu/stage_triton39.sh "$1" 2>&1 | tee -a "$out/stage.log"; }
# memcheck: $4 the Hopper variants to check (check_offsets_cases' `only`, e.g. "['hopper']"), $5 whether
# the portable kernels (HSTU's too) go first (True/False), $6 the log's tag. One call's limit covers
# about 28 cases, so calls 1 and 5 check the portable kernels and the default Hopper ones in two
# processes beside the suite ("[]": no Hopper variant), 2 and 6 HSTU's Hopper kernels, 6 the dq-fused
# backward too. Only the application is checked:
# jaxlib runs ptxas as a child process when it loads a kernel, and the sanitizer crashed (SIGSEGV)
# following it on triton 3.9 and on an int64 case's new compilation on 3.6.
memcheck() {
  local triton=$1 path=$2 limit=$3 only=$4 portable=$5 log="$out/memcheck$6-triton$1.log"
  (cd tests && PYTHONPATH="$path" XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "$limit" compute-sanitizer \
     --tool memcheck --target-processes application-only --error-exitcode 99 --print-limit 20 python3 -c \
     "import test_memory_safety as t
for hopper in ([False] if $portable else []) + [True]:
    t.check_offsets_cases(t.CASES, backend='triton', hopper=hopper, only=$only if hopper else None)" \
     > "$log" 2>&1; echo "rc=$?" >> "$log")
}
summary() {
  for f in "$out"/*.log; do echo "== $(basename "$f"): $(grep -E "passed|failed|ERROR SUMMARY|all ok|rc=" "$f" | tail -3 | tr '\n' ' ')"; done
  grep -h "^FAILED\|^ERROR" "$out"/*.log 2>/dev/null | head -40
}
bench() {  # $1 module (benchmarks.run, or benchmarks.tune), $2 tag, $3 cases, $4 budget (s), $5 PYTHONPATH,
  # then the module's own arguments; BENCH_MARGIN (s, default 40) past the budget before the timeout.
  # Logs bench-TAG.log and .json; prints the count of rows that ran
  local module=$1 tag=$2 cases=$3 budget=$4 path=$5; shift 5
  PYTHONPATH="$path" timeout $(( budget + ${BENCH_MARGIN:-40} )) python3 -m "$module" --out "/tmp/bench-$tag" \
    --cases "$cases" --seconds 0.1 --budget-s "$budget" "$@" > "$out/bench-$tag.log" 2>&1
  echo "rc=$?" >> "$out/bench-$tag.log"
  cp "/tmp/bench-$tag/results.json" "$out/bench-$tag.json" 2>/dev/null
  grep -E "ok:|error|skipped" "$out/bench-$tag.log" | grep -v "needs a GPU" | grep -c "ok:"
}
softmax_bench() {  # $1 tag, $2 cases, $3 impls, $4 budget (s), $5 PYTHONPATH
  bench benchmarks.run "$1" "$2" "$4" "$5" --impls "$3"
}
hstu_jax() {  # $1 triton, $2 PYTHONPATH, $3 impls, $4 limit, cases after
  local triton=$1 path=$2 impls=$3 limit=$4; shift 4
  PYTHONPATH=$path timeout "$limit" python3 -m benchmarks.hstu_run --out "/tmp/hstu$triton" --cases "$@" \
    --impls "$impls" --seconds 0.3 > "$out/hstu-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/hstu-triton$triton.log"
  cp "/tmp/hstu$triton/hstu_results.json" "$out/hstu-triton$triton.json" 2>/dev/null
  grep "^\[hstu\]" "$out/hstu-triton$triton.log"
}
# ab_bench: $1 tag, $2 cases, $3 impls, $4 budget (s) a run, $5 the tree's PYTHONPATH, $6 a variant's copy of
# the tree (`patched_copy`), run from there (python -m puts the working directory first on the path) with
# $5's last entry replaced by it: ROUNDS (default 2) alternating runs of each (tree, variant, tree, ...),
# logs bench-$1-tree-rN and -variant-rN
ab_bench() {
  for r in $(seq "${ROUNDS:-2}"); do
    softmax_bench "$1-tree-r$r" "$2" "$3" "$4" "$5" > /dev/null
    (cd "$6" && softmax_bench "$1-variant-r$r" "$2" "$3" "$4" "${5%:*}:$6" > /dev/null)
  done
  for f in "$out"/bench-"$1"-*.log; do echo "== $(basename "$f")"; grep "fwd+bwd" "$f" | cut -c1-150; done
}
# tree_tests: $1 a tree (run from there, it last on the PYTHONPATH), $2 the tests' log tag, $3 memcheck's
# log tag, $4 memcheck's limit (s), $5 its Hopper variants, $6 the tests' limit (s), $7 their -k, then the
# test files: the tree's GPU tests (8 workers) beside memcheck of the Hopper variants, then the summary
tree_tests() {
  local tree=$1 tag=$2 mtag=$3 mlimit=$4 variants=$5 limit=$6 k=$7; shift 7
  local tpath=${path%:*}:$tree log="$out/$tag-triton$triton.log"
  (cd "$tree" && memcheck $triton "$tpath" "$mlimit" "$variants" False "$mtag") &
  (cd "$tree" && PYTHONPATH=$tpath timeout "$limit" python3 -m pytest "$@" -m gpu -k "$k" -p xdist -n 8 \
     -o addopts=-ra -q -p no:cacheprovider > "$log" 2>&1; echo "rc=$?" >> "$log")
  wait; elapsed "tests, memcheck"; summary
}
# order_probe: $1 a tree (as tree_tests'), $2 the log's name, $3 the limit (s), then the arguments of
# benchmarks.probes.sequence_order; hstu_orders: $1 a tree, $2 the log's name, $3 the limit (s), $4 the
# results' folder: HSTU's Hopper kernels on its long cases in the offsets' order and longest first (one
# run each, not alternating), printing the log's rows
order_probe() {
  local tree=$1 log="$out/$2" limit=$3; shift 3
  (cd "$tree" && PYTHONPATH=${path%:*}:$tree timeout "$limit" python3 -m benchmarks.probes.sequence_order \
     "$@" > "$log" 2>&1; echo "rc=$?" >> "$log")
}
hstu_orders() {
  local tree=$1 log="$out/$2" limit=$3 results=$4
  (cd "$tree" && PYTHONPATH=${path%:*}:$tree timeout "$limit" python3 -m benchmarks.hstu_run \
     --out "$results" --cases "${long_hstu[@]}" --impls jfa-hstu-hopper,jfa-hstu-hopper-longest-first \
     --seconds 0.2 > "$log" 2>&1; echo "rc=$?" >> "$log")
  grep "^\[hstu\]" "$log"
}
d64_table() {  # $1 a file: a tuned table of one D = 64 Hopper entry, $2 its fwd ("null" or tiles), $3 dkdv, $4 dq
  # (tiles as block_m,block_n,warps,stages; each with the table's register cap, 168)
  local fwd=$2; [ "$fwd" = null ] || fwd="[$fwd,168]"
  echo "[{\"gpu\": \"NVIDIA H200\", \"kernels\": \"hopper\", \"bits\": 16, \"head_dim\": 64, \"max_seq_len\": null,
          \"fwd\": $fwd, \"dkdv\": [$3,168], \"dq\": [$4,168]}]" > "$1"
}
patched_copy() {  # $1 a folder, $2 a patch file of benchmarks/results/profile/: the tree there, patched
  # ($3 -R: the patch reversed, the tree without a change it holds)
  rm -rf "$1" && mkdir "$1" && cp -r jagged_flash_jax tests benchmarks docs README.md pyproject.toml "$1/" \
    && (cd "$1" && patch -s ${3:-} -p1 < "$OLDPWD/benchmarks/results/profile/$2")
}
# ncu_backward: $1 case, $2 PYTHONPATH, $3 the log's tag: Nsight Compute of the Hopper backward's two kernels
# on one step of $1 (benchmarks/probes/one_step.py, run from the working directory) into ncu-$3.txt
ncu_backward() {
  PYTHONPATH=$2 timeout 200 ncu --clock-control none --target-processes all \
    --kernel-name "regex:^attention_bwd_(dkdv|dq)_kernel$" --launch-count 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section SchedulerStats --section InstructionStats python3 -m benchmarks.probes.one_step \
    --case "$1" --mode fwd+bwd > "$out/ncu-$3.txt" 2>&1
  echo "rc=$?" >> "$out/ncu-$3.txt"
  grep -E "attention_bwd|Duration|Compute \(SM\) Throughput|No Eligible|Issued Warp" "$out/ncu-$3.txt"
}
site36=/tmp/site:$PWD
site39=/tmp/site39:/tmp/site:$PWD
# use_triton 3.6|3.9: triton and path (PYTHONPATH) for the call; 3.6 stages the first chunk of the 3.9
# wheel, 3.9 stages the last and installs the wheel (after the other chunks' calls)
use_triton() {
  triton=$1
  if [ "$triton" = 3.9 ]; then
    if [ -f /tmp/site39/triton/__init__.py ]; then  # (a later call of the machine's session: installed)
      echo "triton 3.9 already in /tmp/site39"
    else
      stage .t39f && bash tests/gpu/install_triton39.sh > "$out/install-triton3.9.log" 2>&1
      echo "rc=$?" >> "$out/install-triton3.9.log"; tail -2 "$out/install-triton3.9.log"
    fi
    path=$site39
  else
    stage .t39a; path=$site36
  fi
}
hstu_hopper() {  # $1 triton: HSTU's Hopper kernels' GPU tests (beside their memcheck on 3.6), then their timing
  local triton=$1 path
  path=$([ "$triton" = 3.9 ] && echo "$site39" || echo "$site36")
  (PYTHONPATH=$path timeout 170 python3 -m pytest tests/test_hstu_hopper.py -m gpu -p xdist -n 8 \
     -o addopts=-ra -q > "$out/hstu-hopper-tests-triton$triton.log" 2>&1
   echo "rc=$?" >> "$out/hstu-hopper-tests-triton$triton.log") &
  [ "$triton" = 3.6 ] && memcheck 3.6 "$path" 170 "['hstu hopper']" False "-hstu-hopper"
  wait
  PYTHONPATH=$path timeout 100 python3 -m benchmarks.hstu_run --out "/tmp/hstu-hopper-$triton" \
    --cases b128-l1024-random-targets b32-l4096-random-targets b32-l8192-uniform \
    --impls jfa-triton,jfa-hstu-hopper --seconds 0.2 > "$out/hstu-hopper-bench-triton$triton.log" 2>&1
  echo "rc=$?" >> "$out/hstu-hopper-bench-triton$triton.log"
  cp "/tmp/hstu-hopper-$triton/hstu_results.json" "$out/hstu-hopper-bench-triton$triton.json" 2>/dev/null
  tail -2 "$out/hstu-hopper-tests-triton$triton.log"; grep "^\[hstu\]" "$out/hstu-hopper-bench-triton$triton.log"
}
long_hstu=(b32-l4096-random-targets b32-l8192-random-targets b32-l8192-uniform)
case $call in
  stage) stage "${2:?usage: bash tests/gpu/session.sh stage .t39X}" ;;
  1) stage .t39a
     memcheck 3.6 "$site36" 280 "[]" True "" &
     memcheck 3.6 "$site36" 280 "['hopper']" False "-hopper" &
     LIMIT=250 bash tests/gpu/run.sh demo > /dev/null 2>&1 &
     LIMIT=300 bash tests/gpu/run.sh suite > /dev/null 2>&1
     wait; elapsed "call 1"; summary ;;
  2) stage .t39b; [ "${STAGE_ONLY:-0}" = 1 ] && exit 0
     hstu_hopper 3.6; elapsed "call 2"; summary ;;
  3) stage .t39c; [ "${STAGE_ONLY:-0}" = 1 ] && exit 0
     softmax_bench triton3.6 "D-sweep,causal,gqa,cross,window,softcap,L32768,window-sweep" \
       jfa-triton,jfa-triton-fused-dq,cudnn-packed,cudnn-padded ${BUDGET:-250} "$site36"; elapsed "call 3" ;;
  4) stage .t39d; [ "${STAGE_ONLY:-0}" = 1 ] && exit 0
     hstu_jax 3.6 "$site36" jfa-triton,padded 100 b128-l1024-random-targets "${long_hstu[@]}"; elapsed "hstu"
     # gr's kernel, one process per case and mode (an illegal address ends a process): its own autotuning
     # first (which crashed on b128-l1024-random-targets on 2026-12-03), then pinned configs
     for spec in "b128-l1024-random-targets fwd+bwd full" "b32-l4096-random-targets fwd+bwd full" \
                 "b32-l4096-random-targets fwd pinned" "b32-l8192-random-targets fwd pinned" \
                 "b32-l8192-uniform fwd+bwd pinned"; do
       set -- $spec
       tag="$1-$2-$3"; tag=${tag//+/}
       PYTHONPATH=$PWD/.gr timeout 90 python3 benchmarks/hstu_torch_bench.py --out "$out/gr-$tag.json" \
         --cases "$1" --modes "$2" --autotune "$3" > "$out/gr-$tag.log" 2>&1
       echo "rc=$?" >> "$out/gr-$tag.log"
       echo "$spec: $(grep -E "^b[0-9]" "$out/gr-$tag.log" | tail -1) $(grep -m1 -E "Error|error:" "$out/gr-$tag.log" | cut -c1-160) $(tail -1 "$out/gr-$tag.log")"
       [ $(( $(date +%s) - start )) -gt 400 ] && break
     done; elapsed "call 4" ;;
  5) use_triton 3.9
     memcheck 3.9 "$site39" 300 "[]" True "" &
     memcheck 3.9 "$site39" 300 "['hopper']" False "-hopper" &
     TRITON=3.9 LIMIT=340 bash tests/gpu/run.sh suite > /dev/null 2>&1
     wait; elapsed "call 5"; summary ;;
  6) memcheck 3.9 "$site39" 250 "['hopper fused dq', 'hstu hopper']" False "-fused-dq-hstu" &
     hstu_hopper 3.9; wait; elapsed "memcheck, HSTU Hopper"; summary
     # the rows triton 3.9 has not measured yet first (the fbgemm group and L256-L2048 ran on 2026-12-03)
     softmax_bench triton3.9 "L4096,L8192,L16384,L32768,causal,gqa,cross,window,D-sweep,softcap,window-sweep" \
       jfa-triton ${BUDGET:-200} "$site39"
     # D = 64, where auto keeps the portable backward (measured under 3.6 only): the Hopper one under 3.9
     softmax_bench triton3.9-d64 "L4096-D64,gqa-16x4-L512-D64" jfa-triton,jfa-triton-hopper-bwd 60 "$site39"
     elapsed "call 6" ;;
  7) for triton in ${TRITON:-3.9}; do
       TRITON=$triton LIMIT=${LIMIT:-260} bash tests/gpu/run.sh suite-portable > /dev/null 2>&1
     done; elapsed "call 7"; summary ;;
  8) (PYTHONPATH=$site39 timeout 200 python3 -m pytest tests/test_hopper.py -m gpu -k "fused or inf_key" \
        -p xdist -n 8 -o addopts=-ra -q > "$out/fused-dq-tests-triton3.9.log" 2>&1
      echo "rc=$?" >> "$out/fused-dq-tests-triton3.9.log") &
     memcheck 3.9 "$site39" ${MEMCHECK_S:-200} "${MEMCHECK:-"['hopper fused dq']"}" False "-fused-dq"
     wait; tail -2 "$out/fused-dq-tests-triton3.9.log"; elapsed "tests, memcheck"
     softmax_bench fused-dq-triton3.9 "${CASES:-long,long-causal,rec-long,dlrm-long,L1024,L2048,L8192,L16384}" \
       jfa-triton,jfa-triton-fused-dq ${BUDGET:-150} "$site39"
     grep -h "fwd+bwd" "$out"/bench-fused-dq-triton3.9.log; elapsed "call 8" ;;
  9) for triton in ${TRITONS:-3.6 3.9}; do
       [ $triton = 3.9 ] && [ ! -d /tmp/site39/triton ] && continue
       path=$([ $triton = 3.9 ] && echo "$site39" || echo "$site36")
       (PYTHONPATH=$path timeout 250 python3 -m pytest tests -m gpu -k "hstu" -p xdist \
          -n 12 -o addopts=-ra -q -p no:cacheprovider \
          --deselect tests/test_memory_safety.py::test_adversarial_offsets_on_the_gpu_under_compute_sanitizer \
          > "$out/hstu-auto-tests-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/hstu-auto-tests-triton$triton.log")
       tail -2 "$out/hstu-auto-tests-triton$triton.log"
     done; elapsed "call 9" ;;
  10) use_triton "${TRITON:-3.6}"
      variants=${MEMCHECK:-"['hopper D256']"}
      memcheck "$triton" "$path" 300 "$variants" False "-$(echo "$variants" | grep -o "D[0-9]*" | tr D d | paste -sd-)" &
      TRITON=$triton LIMIT=${LIMIT:-330} bash tests/gpu/run.sh suite > /dev/null 2>&1
      wait; elapsed "suite, memcheck"; summary
      softmax_bench "d256-triton$triton" "L4096-D256,L4096-D64" \
        jfa-triton,jfa-triton-portable-bwd,jfa-triton-hopper-bwd ${BUDGET:-90} "$path"
      # D = 256's dk/dv on query tiles of 32 in 3 stages (a tuned table's entry) against the table's 64 in 2
      echo '[{"gpu": "NVIDIA H200", "kernels": "hopper", "bits": 16, "head_dim": 256, "max_seq_len": null,
              "fwd": [128, 64, 4, 2, 168], "dkdv": [32, 64, 4, 3, 168], "dq": [128, 32, 4, 2, 168]}]' \
        > /tmp/d256-m32.json
      [ "${M32:-1}" = 1 ] && JAGGED_FLASH_JAX_TUNED_CONFIGS=/tmp/d256-m32.json softmax_bench "d256-m32-triton$triton" L4096-D256 \
        jfa-triton 40 "$path"
      grep -h "fwd+bwd" "$out"/bench-d256*-triton$triton.log; elapsed "call 10" ;;
  11) for kernel in bwd_dkdv bwd_dq; do
        PYTHONPATH=$site36 timeout 200 ncu --clock-control none --target-processes all \
          --kernel-name "regex:^attention_${kernel}_kernel$" --launch-count 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section Occupancy python3 -m benchmarks.probes.one_step --case ${CASE:-L4096-D256} --mode fwd+bwd \
          > "$out/ncu-${CASE:-L4096-D256}-$kernel.txt" 2>&1
        grep -E "Duration|Compute \(SM\) Throughput|Shared Memory|No Eligible|Local Memory" \
          "$out/ncu-${CASE:-L4096-D256}-$kernel.txt"
      done; elapsed "call 11" ;;
  12) triton=${TRITON:-3.9}
      path=$([ "$triton" = 3.9 ] && echo "$site39" || echo "$site36")
      softmax_bench "d64-table-triton$triton" L4096-D64 jfa-triton-hopper-bwd 40 "$path"
      for tiles in "64,128,4,3 128,128,4,3" "64,128,4,4 128,128,4,3" "32,128,4,4 128,128,4,3" \
                   "64,128,4,2 128,128,4,4" "64,128,4,2 128,64,4,4"; do
        set -- $tiles
        d64_table /tmp/d64.json null "$1" "$2"
        JAGGED_FLASH_JAX_TUNED_CONFIGS=/tmp/d64.json softmax_bench "d64-${1//,/x}-${2//,/x}-triton$triton" \
          L4096-D64 jfa-triton-hopper-bwd 40 "$path"
      done
      grep -h "fwd+bwd" "$out"/bench-d64-*.log; elapsed "call 12" ;;
  13) stage .t39a
      memcheck 3.6 "$site36" 250 "['hopper D64']" False "-d64"; summary
      softmax_bench d64-triton3.6 "L4096-D64,gqa-16x4-L512-D64,gqa-16x4-L512-D64-causal" \
        jfa-triton,jfa-triton-portable-bwd,cudnn-packed,cudnn-padded ${BUDGET:-120} "$site36"
      grep -h "fwd+bwd" "$out"/bench-d64-triton3.6.log; elapsed "call 13" ;;
  14|15) # the whole GPU suite under auto beside the portable kernels forced (SUITES: "suite" alone takes
     # 10 workers), and memcheck of every kernel family (portable and the default Hopper ones in one
     # process, fused dq at D = 128 and 64, D = 64 and D = 256 in another)
     use_triton $([ $call = 14 ] && echo 3.6 || echo 3.9)
     memcheck $triton "$path" ${LIMIT:-480} "['hopper']" True "-portable-hopper" &
     memcheck $triton "$path" ${LIMIT:-480} "['hopper fused dq', 'hopper fused dq D64', 'hopper D64', 'hopper D256']" \
       False "-fused-dq-d64-d256" &
     suites=(${SUITES:-suite suite-portable})
     for suite in "${suites[@]}"; do
       TRITON=$triton WORKERS=$(( 10 / ${#suites[@]} )) LIMIT=${LIMIT:-480} bash tests/gpu/run.sh $suite > /dev/null 2>&1 &
     done
     wait; elapsed "call $call"; summary ;;
  16) # rec-long-causal against cuDNN under both tritons, the causal forward's variants (the band per
      # warpgroup, 64-key tiles), and jfa-triton-nondeterministic beside jfa-triton under 3.9
      PYTHONPATH=$site39 timeout 150 python3 -m benchmarks.probes.causal_forward > "$out/causal-forward-triton3.9.log" 2>&1
      echo "rc=$?" >> "$out/causal-forward-triton3.9.log"; grep "^\[causal" "$out/causal-forward-triton3.9.log"
      softmax_bench rec-long-causal-triton3.9 rec-long-causal jfa-triton,cudnn-packed,cudnn-padded 60 "$site39"
      softmax_bench rec-long-causal-triton3.6 rec-long-causal jfa-triton,cudnn-packed,cudnn-padded 60 "$site36"
      softmax_bench nondeterministic-triton3.9 "long,L8192,L16384,L16384-causal" \
        jfa-triton,jfa-triton-nondeterministic ${BUDGET:-120} "$site39"
      grep -h "^\[bench\].*ms" "$out"/bench-*.log | cut -c1-150; elapsed "call 16" ;;
  17|18) # the causal forward's own tiles (fwd_causal): the Hopper forward's GPU tests (beside memcheck of
     # the Hopper kernels where MEMCHECK=1), then rec-long-causal's timing (IMPLS); 18 (triton 3.9, after
     # STAGE_ONLY=1 2-4) first installs 3.9 and runs what the suite logs REST did not reach
     # (tests/gpu/remaining.py), the portable kernels forced for a suite-portable log
     use_triton $([ $call = 17 ] && echo 3.6 || echo 3.9)
     [ "${MEMCHECK:-1}" = 1 ] && memcheck $triton "$path" 240 "['hopper']" False "-hopper" &
     (PYTHONPATH=$path timeout 200 python3 -m pytest tests/test_hopper.py -m gpu -k "not backward and not fused" \
        -p xdist -n ${WORKERS_FWD:-6} -o addopts=-ra -q -p no:cacheprovider > "$out/forward-tests-triton$triton.log" 2>&1
      echo "rc=$?" >> "$out/forward-tests-triton$triton.log") &
     for log in ${REST:-}; do
       tag=$(basename "$log" .log)
       PYTHONPATH=$path python3 tests/gpu/remaining.py "$log" > "/tmp/rest-$tag.txt" 2> "$out/rest-$tag.log"
       mapfile -t rest < "/tmp/rest-$tag.txt"
       forced=(); [[ $tag == *portable* ]] && forced=(JAGGED_FLASH_JAX_FORWARD=portable JAGGED_FLASH_JAX_BACKWARD=portable)
       env "${forced[@]}" PYTHONPATH=$path timeout 150 python3 -m pytest "${rest[@]}" -m gpu -v -p xdist -n 6 \
         -o addopts=-ra -p no:cacheprovider >> "$out/rest-$tag.log" 2>&1; echo "rc=$?" >> "$out/rest-$tag.log"
     done
     wait; elapsed "tests, memcheck"; summary
     softmax_bench "rec-long-causal-triton$triton" rec-long-causal ${IMPLS:-jfa-triton} 40 "$path"
     grep -h "^\[bench\].*ms" "$out"/bench-*.log | cut -c1-150; elapsed "call $call" ;;
  19|20) # the D = 64 rows (causal too, and GQA at L512) with dq fused (3.6: by atomics; 3.9: TMA
     # reduce-adds) against the default backward and cuDNN, and causal D = 256 against cuDNN; 19 (triton 3.6, staging .t39a) first
     # profiles the Hopper backward's two kernels under Nsight Compute on each of CASES (default
     # "L4096-D64 L4096": D = 64's account beside D = 128's; one step, both kernels in one run); 20 takes
     # triton 3.9 as 15 installed it
     if [ $call = 19 ]; then
       use_triton 3.6
       for case in ${CASES:-L4096-D64 L4096}; do ncu_backward "$case" "$path" "$case"; done; elapsed "ncu"
     else
       triton=3.9 path=$site39
     fi
     softmax_bench "d64-triton$triton" "L4096-D64,L4096-D64-causal,gqa-16x4-L512-D64,gqa-16x4-L512-D64-causal" \
       jfa-triton,jfa-triton-fused-dq,cudnn-packed,cudnn-padded ${BUDGET:-120} "$path"
     # (dq is fused into blocks of 128 keys only: D = 256's are 64)
     softmax_bench "d256-causal-triton$triton" L4096-D256-causal jfa-triton,cudnn-packed,cudnn-padded 40 "$path"
     grep -h "^\[bench\].*ms" "$out"/bench-*.log | cut -c1-150; elapsed "call $call" ;;
  21) # triton 3.9 (after staging): its install, 20's rows, then beside each other memcheck of MEMCHECK's
     # variants under 3.9 and, under 3.6, what the suite logs REST did not reach (the portable kernels
     # forced for a suite-portable log)
     use_triton 3.9
     bash tests/gpu/session.sh 20
     memcheck 3.9 "$site39" 200 "${MEMCHECK:-"['hopper fused dq D64']"}" False "-rest" &
     for log in ${REST:-}; do
       tag=$(basename "$log" .log)
       PYTHONPATH=$site36 python3 tests/gpu/remaining.py "$log" > "/tmp/rest-$tag.txt" 2> "$out/rest-$tag.log"
       mapfile -t rest < "/tmp/rest-$tag.txt"
       forced=(); [[ $tag == *portable* ]] && forced=(JAGGED_FLASH_JAX_FORWARD=portable JAGGED_FLASH_JAX_BACKWARD=portable)
       env "${forced[@]}" PYTHONPATH=$site36 timeout 200 python3 -m pytest "${rest[@]}" -m gpu -v -p xdist -n 5 \
         -o addopts=-ra -p no:cacheprovider >> "$out/rest-$tag.log" 2>&1; echo "rc=$?" >> "$out/rest-$tag.log" &
     done
     wait; elapsed "call 21"; summary ;;
  22|23|24|26) echo "call $call timed a patch since merged (the FFMA softmax: 2aaf0a4; the banded dk/dv's own" \
       "waits: f47179d): 27 times the tree against a copy without it (PATCH), 19 profiles the tree" >&2; exit 2 ;;
  25) # D = 64's dk/dv query tiles of 128 (each consumer's S^T and dP^T 64 keys x 128 queries; ptxas: 168
     # registers, 708 B of spill stores, 40 causal, 117 KB of shared memory), as a tuned table's entries
     # (dk/dv 128x128 in 2 and 3 stages, dq the table's 128x128 in 3): the Hopper backward's D = 64 GPU
     # tests with each, then timing on the D = 64 rows against the table's (TRITON, default 3.6 staging
     # .t39a; 3.9 after staging)
     use_triton ${TRITON:-3.6}
     softmax_bench "d64bm-table-triton$triton" "${CASES:-L4096-D64,L4096-D64-causal}" jfa-triton-hopper-bwd \
       ${BUDGET:-30} "$path"
     for dkdv in 128,128,4,2 128,128,4,3; do
       d64_table "/tmp/d64-$dkdv.json" null "$dkdv" 128,128,4,3
       JAGGED_FLASH_JAX_TUNED_CONFIGS="/tmp/d64-$dkdv.json" PYTHONPATH=$path timeout 150 python3 -m pytest \
         tests/test_hopper.py -m gpu -k "D64 or large_logits" -p xdist -n 8 -o addopts=-ra -q \
         -p no:cacheprovider > "$out/d64bm-tests-${dkdv//,/x}-triton$triton.log" 2>&1
       echo "rc=$?" >> "$out/d64bm-tests-${dkdv//,/x}-triton$triton.log"
       JAGGED_FLASH_JAX_TUNED_CONFIGS="/tmp/d64-$dkdv.json" softmax_bench "d64bm-${dkdv//,/x}-triton$triton" \
         "${CASES:-L4096-D64,L4096-D64-causal}" jfa-triton-hopper-bwd ${BUDGET:-30} "$path"
     done
     summary; grep -h "fwd+bwd" "$out"/bench-d64bm-*.log | cut -c1-150; elapsed "call 25" ;;
  27) # the tree against a copy without a change it holds (PATCH, a file of benchmarks/results/profile/,
     # reversed; default the FFMA softmax's): ROUNDS (default 2) alternating timings (`ab_bench`: CASES,
     # IMPLS, BUDGET a run; logs bench-reverted-*, the variant's the copy's) under TRITON (3.6, staging STAGE, default
     # .t39a; 3.9 once 5 or 15 installed it); TESTS=1: first the tree's Hopper backward GPU tests beside
     # memcheck of its Hopper kernels. FORWARD=1 PATCH=...: a change not merged, applied to the copy (logs
     # bench-applied-*, the variant's then the change's; TESTS=1 tests the copy); TAG names the logs (several
     # patches in one call); TESTS_K the tests' -k (default the backward's), MEMCHECK the Hopper variants
     # memcheck checks (default "['hopper']"); BENCH=0: the tests alone (the timings in a later run, after
     # what runs beside them, e.g. 29, has finished)
     if [ "${TRITON:-3.6}" = 3.9 ]; then
       triton=3.9 path=$site39
     else
       stage "${STAGE:-.t39a}"; triton=3.6 path=$site36
     fi
     if [ "${FORWARD:-0}" = 1 ]; then
       patched_copy /tmp/variant "${PATCH:?FORWARD=1 needs PATCH}" || exit 1; tested=/tmp/variant mode=applied
     else
       patched_copy /tmp/variant "${PATCH:-2026-12-05_ffma_softmax.mbox}" -R || exit 1; tested=$PWD mode=reverted
     fi
     if [ "${TESTS:-0}" = 1 ]; then  # first the Hopper backward GPU tests beside memcheck of the Hopper kernels
       tree_tests "$tested" "hopper-bwd-tests${TAG:+-$TAG}" "-hopper${TAG:+-$TAG}" 200 \
         "${MEMCHECK:-['hopper']}" 220 "${TESTS_K:-backward or large_logits or fused}" tests/test_hopper.py
     fi
     [ "${BENCH:-1}" = 1 ] && ab_bench "$mode${TAG:+-$TAG}-triton$triton" "${CASES:-long,L16384}" \
       "${IMPLS:-jfa-triton}" ${BUDGET:-40} "$path" /tmp/variant
     elapsed "call 27" ;;
  28) # triton 3.9 (after staging): its install, then the rows the banded dk/dv's own waits (f47179d) and the
     # FFMA softmax change, against cuDNN in one process (CASES; BUDGET), for results.json
     use_triton 3.9
     softmax_bench rows-triton3.9 "${CASES:-L16384-causal,long-causal,L4096-D64-causal,window,long,L16384,L4096-D64}" \
       jfa-triton,cudnn-packed,cudnn-padded ${BUDGET:-300} "$path"
     grep -h "fwd+bwd" "$out"/bench-rows-triton3.9.log | cut -c1-150; elapsed "call 28" ;;
  29) # what the suite logs REST did not reach (tests/gpu/remaining.py; the portable kernels forced for a
     # suite-portable log) beside memcheck of MEMCHECK's Hopper variants (none when empty), under TRITON
     # (3.6 staging .t39a; 3.9 after staging, installing it)
     use_triton ${TRITON:-3.6}
     [ -n "${MEMCHECK:-}" ] && memcheck $triton "$path" ${LIMIT:-240} "$MEMCHECK" False "-rest" &
     for log in ${REST:-}; do
       tag=$(basename "$log" .log)
       PYTHONPATH=$path python3 tests/gpu/remaining.py "$log" > "/tmp/rest-$tag.txt" 2> "$out/rest-$tag.log"
       mapfile -t rest < "/tmp/rest-$tag.txt"
       forced=(); [[ $tag == *portable* ]] && forced=(JAGGED_FLASH_JAX_FORWARD=portable JAGGED_FLASH_JAX_BACKWARD=portable)
       env "${forced[@]}" PYTHONPATH=$path timeout ${LIMIT:-240} python3 -m pytest "${rest[@]}" -m gpu -v -p xdist \
         -n $(( 10 / $(echo $REST | wc -w) )) -o addopts=-ra -p no:cacheprovider >> "$out/rest-$tag.log" 2>&1
       echo "rc=$?" >> "$out/rest-$tag.log" &
     done
     wait; elapsed "call 29"; summary ;;
  30) # the Hopper forward at D = 64 (PATCH, default 2026-12-07_hopper_forward_d64.mbox, applied to a copy)
     # on each of its candidate tiles (FWD64: block_m,block_n,warps,stages; each compiles for sm_90a
     # within shared memory: 128x128 on 3 and 4 stages 131 and 164 KB with 16 B of spills under 3.9, 128x64
     # on 3 and 4 stages 82 and 99 KB with none) as a tuned table's D = 64 entry, after the tree (its
     # portable forward), on CASES under TRITON (3.6 staging .t39a; 3.9 after staging, installing it);
     # JAGGED_FLASH_JAX_FORWARD=hopper set for the call reaches sequences under 1024 tokens too
     use_triton ${TRITON:-3.6}
     patched_copy /tmp/variant "${PATCH:-2026-12-07_hopper_forward_d64.mbox}" || exit 1
     cases=${CASES:-L4096-D64,L4096-D64-causal}
     softmax_bench "fwd64-tree-triton$triton" "$cases" jfa-triton ${BUDGET:-30} "$path" > /dev/null
     for tiles in ${FWD64:-128,128,4,3 128,128,4,4 128,64,4,3 128,64,4,4}; do
       d64_table "/tmp/fwd64-$tiles.json" "$tiles" 64,128,4,2 128,128,4,3
       (cd /tmp/variant && JAGGED_FLASH_JAX_TUNED_CONFIGS="/tmp/fwd64-$tiles.json" softmax_bench \
          "fwd64-${tiles//,/x}-triton$triton" "$cases" jfa-triton ${BUDGET:-30} "${path%:*}:/tmp/variant" > /dev/null)
     done
     for f in "$out"/bench-fwd64-*.log; do echo "== $(basename "$f")"; grep "bfloat16" "$f" | cut -c1-150; done
     elapsed "call 30" ;;
  31) # the portable forward's tiles at D = 64 under TRITON (3.6 staging .t39a; 3.9 after staging, installing
     # it). Triton >= 3.7 puts a CTA barrier after each wgmma wait of a kernel of more than 4 warps
     # (triton-lang/triton#11056): in the table's 8-warp forward at D = 64, between S's product and its
     # softmax, which 3.6's build lets the two warpgroups overlap (docs/performance.md, "Found on
     # 2026-12-07, session 2"). Each candidate (FWD, JSON tiles) timed by benchmarks.tune (the portable
     # kernels through block_sizes=) on CASES; the log's last lines are the table it would write
     use_triton ${TRITON:-3.6}
     # (TAG, default fwd64, names the log; CANDIDATES: benchmarks.tune's JSON in place of FWD's, e.g. D = 128's
     # forward on L512, where the table's 8-warp [128,64,8,2,128] runs)
     fwd=${FWD:-[128,64,8,3],[64,64,4,3],[64,64,4,4],[64,128,4,3],[64,32,4,3]}
     tag="tune-${TAG:-fwd64}-triton$triton"
     BENCH_MARGIN=60 bench benchmarks.tune "$tag" \
       "${CASES:-L4096-D64,L4096-D64-causal,gqa-16x4-L512-D64,gqa-16x4-L512-D64-causal}" ${BUDGET:-200} "$path" \
       --dtypes bfloat16 --candidates "${CANDIDATES:-{\"fwd\": [$fwd]\}}" > /dev/null
     grep -E "ok:|\[tune\]|rc=" "$out/bench-$tag.log" | cut -c1-160
     elapsed "call 31" ;;
  32) # the portable forward's fwd_causal at D = 64 (4-warp tiles of 64 queries, 23e9289) under TRITON (3.6
     # staging .t39a; 3.9 after staging): the GPU tests at D = 64 under auto (self-causal-D64-gqa runs
     # it), then the causal D = 64 rows (CASES) against cuDNN, for results.json
     use_triton ${TRITON:-3.6}
     for forced in "" portable; do  # under auto, beside the portable kernels forced (4 workers each)
       log="$out/tests-d64${forced:+-$forced}-triton$triton.log"
       (JAGGED_FLASH_JAX_FORWARD=${forced:-auto} JAGGED_FLASH_JAX_BACKWARD=${forced:-auto} PYTHONPATH=$path \
          timeout ${LIMIT:-200} python3 -m pytest tests -m gpu -k "${TESTS_K:-D64 or d64}" -p xdist -n 4 \
          -o addopts=-ra -q > "$log" 2>&1; echo "rc=$?" >> "$log") &
     done
     wait; tail -n 3 "$out"/tests-d64*-triton$triton.log
     if [ "${BENCH:-1}" = 1 ]; then  # (BENCH=0: the tests alone)
       softmax_bench "rows-d64-causal-triton$triton" "${CASES:-L4096-D64-causal,gqa-16x4-L512-D64-causal}" \
         jfa-triton,cudnn-packed,cudnn-padded ${BUDGET:-120} "$path"
       grep -h "ok:" "$out/bench-rows-d64-causal-triton$triton.log" | cut -c1-150
     fi
     elapsed "call 32" ;;
  33) # the portable forward's TMA loads under TRITON (3.6 staging .t39a; 3.9 after staging, installing
     # it), in the tree (or a copy with PATCH, a file of benchmarks/results/profile/, applied): the GPU
     # tests of the TMA loads and of D = 64 (TESTS_K) under auto beside memcheck of the portable kernels
     # (its "tma loads" variant, forced under either triton), then benchmarks.probes.tma_forward: the
     # forward with TMA loads forced against pointer loads, alternating ROUNDS times on CASES
     use_triton ${TRITON:-3.6}
     tree=$PWD
     if [ -n "${PATCH:-}" ]; then patched_copy /tmp/variant "$PATCH" || exit 1; tree=/tmp/variant; fi
     vpath=${path%:*}:$tree
     (cd $tree && memcheck $triton "$vpath" ${LIMIT:-240} "[]" True "-tma") &
     (cd $tree && PYTHONPATH=$vpath timeout ${LIMIT:-240} python3 -m pytest tests -m gpu \
        -k "${TESTS_K:-tma or D64 or d64}" -p xdist -n 8 -o addopts=-ra -q -p no:cacheprovider \
        > "$out/tests-tma-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/tests-tma-triton$triton.log")
     wait; elapsed "tests, memcheck"; summary
     (cd $tree && PYTHONPATH=$vpath timeout ${BUDGET:-200} python3 -m benchmarks.probes.tma_forward \
        --cases "${CASES:-L4096-D64,L4096-D64-causal,gqa-16x4-L512-D64-causal,rec-long}" --rounds ${ROUNDS:-2} \
        > "$out/tma-forward-triton$triton.log" 2>&1; echo "rc=$?" >> "$out/tma-forward-triton$triton.log")
     grep "^\[ab\]" "$out/tma-forward-triton$triton.log" | cut -c1-170
     elapsed "call 33" ;;
  34) # the sequences' order: what a longest-first scheduler could gain (see the header)
     use_triton ${TRITON:-3.9}
     order_probe "$PWD" "sequence-order-triton$triton.log" ${BUDGET:-300} ${SCHEDULER:+--scheduler} \
       --cases "${CASES:-long,dlrm-long,L8192,rec-long}" --rounds ${ROUNDS:-2}
     grep "^\[" "$out/sequence-order-triton$triton.log" | cut -c1-150
     if [ "${HSTU:-0}" = 1 ]; then  # HSTU's Hopper kernels likewise
       hstu_orders "$PWD" "hstu-order-triton$triton.log" ${HSTU_BUDGET:-150} "/tmp/hstu-order-$triton" \
         | cut -c1-150
     fi
     elapsed "call 34" ;;
  35) # the tree against a copy with PATCH applied (a file of benchmarks/results/profile/; session 8 of
     # 2026-12-07 timed 2026-12-07_read_ahead.mbox, which main's scheduler.py has since moved past), each
     # through benchmarks.probes.sequence_order --scheduler (the Hopper kernels in the offsets' order and
     # longest first, in one process), alternating tree and copy ROUNDS times on CASES, under TRITON (3.9
     # after staging, installing it; 3.6 staging .t39a); TESTS=1: first the copy's Hopper GPU tests
     # (TESTS_K) beside memcheck of its Hopper kernels; HSTU=1: then HSTU's Hopper kernels in both orders,
     # tree and copy
     use_triton ${TRITON:-3.9}
     patched_copy /tmp/variant "${PATCH:?35 needs PATCH, a file of benchmarks/results/profile/}" || exit 1
     if [ "${TESTS:-0}" = 1 ]; then
       tree_tests /tmp/variant variant-tests -hopper-variant ${LIMIT:-200} "['hopper']" ${LIMIT:-200} \
         "${TESTS_K:-order or large_logits or D64 or D256 or causal}" tests/test_hopper.py \
         tests/test_hstu_hopper.py
     fi
     for r in $(seq "${ROUNDS:-2}"); do
       for tree in "$PWD" /tmp/variant; do
         tag=$([ "$tree" = "$PWD" ] && echo tree || echo variant)
         order_probe "$tree" "order-$tag-r$r-triton$triton.log" ${BUDGET:-150} --scheduler \
           --cases "${CASES:-long,rec-long,L8192}" --rounds 1
       done
     done
     for f in "$out"/order-*-triton$triton.log; do
       echo "== $(basename "$f")"; grep "^\[order\]" "$f" | sed -E "s/\{.*attention_bwd_dkdv_kernel': ([0-9.]+).*attention_bwd_dq_kernel': ([0-9.]+).*/dkdv \1 dq \2/; s/\{.*attention_fwd_kernel': ([0-9.]+).*/fwd \1/" | cut -c1-120
     done
     if [ "${HSTU:-0}" = 1 ]; then
       for tree in "$PWD" /tmp/variant; do
         tag=$([ "$tree" = "$PWD" ] && echo tree || echo variant)
         hstu_orders "$tree" "hstu-order-$tag-triton$triton.log" ${HSTU_BUDGET:-120} "/tmp/hstu-order-$tag" \
           | sed "s/^/$tag /" | cut -c1-150
       done
     fi
     elapsed "call 35" ;;
  *) echo "usage: bash tests/gpu/session.sh 1..35|stage DIR" >&2; exit 2 ;;
esac
