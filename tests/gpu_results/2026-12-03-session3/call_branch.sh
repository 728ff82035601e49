# The device calls of 2026-12-03's third session on the tree of cda1816 (then branch wip/round4-gpu), from the
# repository root: OUT=$OUT bash call_branch.sh TRITON CHUNK (3.6 .t39c: call 3, run without the memcheck
# lines; 3.9 -: call 6, after session.sh 5 had installed triton 3.9).
set -uo pipefail
out=$OUT; tri=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
[ "$2" != - ] && bash tests/gpu/stage_triton39.sh "$2" 2>&1 | tail -1
if [ "$tri" = 3.9 ]; then path=/tmp/site39:/tmp/site:$PWD; else path=/tmp/site:$PWD; fi
export PYTHONPATH=$path
source <(sed -n '/^memcheck()/,/^}/p' tests/gpu/session.sh)
(memcheck $tri "$path" 240 "['hopper fused dq']"; mv $out/memcheck-triton$tri.log $out/branch-memcheck-fused-dq-triton$tri.log) &
python3 -c "import triton,jax;print('triton',triton.__version__,'jax',jax.__version__)" | tee $out/branch-tests-triton$tri.log
git log --oneline -1 2>/dev/null | tee -a $out/branch-tests-triton$tri.log
timeout 200 python3 -m pytest tests/test_hstu_hopper.py tests/test_hopper.py tests/test_launchers.py -m gpu -k "hstu or fused" -v -p xdist -n 8 -o addopts=-ra >> $out/branch-tests-triton$tri.log 2>&1; echo "rc=$?" >> $out/branch-tests-triton$tri.log
tail -3 $out/branch-tests-triton$tri.log
grep -E "^FAILED|^ERROR" $out/branch-tests-triton$tri.log | head -20
timeout 100 python3 -m benchmarks.hstu_run --out /tmp/hstub$tri --cases b128-l1024-random-targets b32-l4096-random-targets b32-l8192-uniform --impls jfa-triton,jfa-hstu-hopper --seconds 0.2 > $out/branch-hstu-triton$tri.log 2>&1; echo "rc=$?" >> $out/branch-hstu-triton$tri.log
cp /tmp/hstub$tri/hstu_results.json $out/branch-hstu-triton$tri.json 2>/dev/null; grep "^\[hstu\]" $out/branch-hstu-triton$tri.log; tail -2 $out/branch-hstu-triton$tri.log
wait; timeout 90 python3 -m benchmarks.run --out /tmp/benchb$tri --cases long,long-causal,rec-long --impls jfa-triton,jfa-triton-fused-dq --seconds 0.1 > $out/branch-bench-triton$tri.log 2>&1; echo "rc=$?" >> $out/branch-bench-triton$tri.log
cp /tmp/benchb$tri/results.json $out/branch-bench-triton$tri.json 2>/dev/null; grep "ok:" $out/branch-bench-triton$tri.log | head; tail -1 $out/branch-bench-triton$tri.log
grep -E '^ok|ERROR SUMMARY|rc=' $out/branch-memcheck-fused-dq-triton$tri.log | tail -4
