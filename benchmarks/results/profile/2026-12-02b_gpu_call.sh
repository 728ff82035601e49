#!/bin/bash
# Call 2 of 2026-12-02 on 0890c63 (one tile table; narrow bands' 64-key dq tiles): memcheck and the demo
# in the background, the GPU suite under auto; then the dq tiles at L512/L1024 (L512 now takes the narrow
# entry) and the window rows of jfa-triton.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
C=$(cut -c1-7 .gpu_commit); S=$(date +%s)
(cd tests && XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 400 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 python3 -c "import test_memory_safety as t; [t.check_offsets_cases(t.CASES, backend='triton', hopper=h) for h in (False, True)]" > $OUT/sanitizer_$C.log 2>&1; echo rc=$? >> $OUT/sanitizer_$C.log; echo "sanitizer done $(( $(date +%s) - S ))s") &
(timeout 300 python3 -m jagged_flash_jax demo > $OUT/demo_$C.log 2>&1; echo rc=$? >> $OUT/demo_$C.log; echo "demo done $(( $(date +%s) - S ))s") &
D="--deselect tests/test_memory_safety.py::test_adversarial_offsets_on_the_gpu_under_compute_sanitizer"
timeout 270 python3 -m pytest tests -m gpu -v -p xdist -n 6 -o addopts=-ra --durations=8 $D > $OUT/gpu_tests_$C.log 2>&1; echo rc=$? >> $OUT/gpu_tests_$C.log
echo "suite done $(( $(date +%s) - S ))s"
timeout 80 python3 benchmarks/results/profile/2026-12-01h_window_tiles.py none L512,L1024 > $OUT/dq_tiles_L512_$C.log 2>&1; echo rc=$? >> $OUT/dq_tiles_L512_$C.log
echo "tiles done $(( $(date +%s) - S ))s"
wait
timeout $(( 575 - ($(date +%s) - S) )) python3 -m benchmarks.run --out /tmp/b --cases window,window-sweep --dtypes bfloat16 --impls jfa-triton > $OUT/bench_$C.log 2>&1; echo rc=$? >> $OUT/bench_$C.log
cp /tmp/b/results.json $OUT/results.json 2>/dev/null
echo "bench done $(( $(date +%s) - S ))s"
grep -E "passed|failed" $OUT/gpu_tests_$C.log | tail -2; grep FAILED $OUT/gpu_tests_$C.log | head
tail -2 $OUT/sanitizer_$C.log $OUT/demo_$C.log; cat $OUT/dq_tiles_L512_$C.log | grep -v "^ *$"
grep -v compiled $OUT/bench_$C.log | tail -22
