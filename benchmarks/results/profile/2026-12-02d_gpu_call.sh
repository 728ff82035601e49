#!/bin/bash
# Call 4 of 2026-12-02: wip/persistent-forward (in .gpu_persist) against main (the root, 956cda2).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
S=$(date +%s); ROOT=$PWD
cd .gpu_persist; export PYTHONPATH=/tmp/site:$PWD
K='not backward and not compiles'
JAGGED_FLASH_JAX_HOPPER_PROGRAMS=132 timeout 150 python3 -m pytest tests/test_hopper.py -m gpu -k "$K" -p xdist -n 6 -o addopts=-ra -q -x > $OUT/persist_fwd_tests.log 2>&1; echo rc=$? >> $OUT/persist_fwd_tests.log
echo "persistent tests $(( $(date +%s) - S ))s: $(tail -2 $OUT/persist_fwd_tests.log | head -1)"
timeout 120 python3 -m pytest tests/test_hopper.py -m gpu -k "$K" -p xdist -n 6 -o addopts=-ra -q -x > $OUT/branch_fwd_tests.log 2>&1; echo rc=$? >> $OUT/branch_fwd_tests.log
echo "one-block tests $(( $(date +%s) - S ))s: $(tail -2 $OUT/branch_fwd_tests.log | head -1)"
(cd tests && JAGGED_FLASH_JAX_HOPPER_PROGRAMS=132 timeout 70 python3 -c "import test_memory_safety as t; t.check_offsets_cases(t.CASES, backend='triton', hopper=True)" > $OUT/persist_offsets.log 2>&1; echo rc=$? >> $OUT/persist_offsets.log)
echo "offsets $(( $(date +%s) - S ))s: $(tail -2 $OUT/persist_offsets.log | tr '\n' ' ')"
C="rec-long,long,L1024,L2048,L4096,L16384,long-causal,L16384-w256,gqa-16x2"
JAGGED_FLASH_JAX_HOPPER_PROGRAMS=132 timeout 100 python3 -m benchmarks.run --out /tmp/bp --cases $C --dtypes bfloat16 --impls jfa-triton --seconds 0.1 > $OUT/bench_persist.log 2>&1; echo rc=$? >> $OUT/bench_persist.log
echo "bench persistent $(( $(date +%s) - S ))s"
cd $ROOT; export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m benchmarks.run --out /tmp/bm --cases $C --dtypes bfloat16 --impls jfa-triton --seconds 0.1 > $OUT/bench_main.log 2>&1; echo rc=$? >> $OUT/bench_main.log
echo "bench main $(( $(date +%s) - S ))s"
grep -E "FAILED|Error|error" $OUT/persist_fwd_tests.log | head -8
paste <(grep "ok:" $OUT/bench_main.log | awk '{print $2, $4, $7}') <(grep "ok:" $OUT/bench_persist.log | awk '{print $7}')
