#!/bin/bash
# Call 1 of 2026-12-02 on 802aa47: the GPU suite with the portable kernels forced; the backward's dq tiles
# under windows; float32 rec-mid tiles wider than tune.py's entry.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
C=$(cut -c1-7 .gpu_commit)
D="--deselect tests/test_memory_safety.py::test_adversarial_offsets_on_the_gpu_under_compute_sanitizer"
S=$(date +%s)
JAGGED_FLASH_JAX_FORWARD=portable JAGGED_FLASH_JAX_BACKWARD=portable timeout 250 python3 -m pytest tests -m gpu \
  -v -p xdist -n 6 -o addopts=-ra $D > $OUT/gpu_tests_portable_$C.log 2>&1; echo rc=$? >> $OUT/gpu_tests_portable_$C.log
echo suite $(( $(date +%s) - S ))s
timeout 140 python3 benchmarks/results/profile/2026-12-01h_window_tiles.py none \
  L4096-w256,L16384-w256,L16384-w512,L16384-w1024 > $OUT/bwd_window_tiles_$C.log 2>&1; echo rc=$? >> $OUT/bwd_window_tiles_$C.log
echo tiles $(( $(date +%s) - S ))s
timeout 140 python3 -m benchmarks.tune --out /tmp/t --cases rec-mid --dtypes float32 --seconds 0.1 --candidates \
  '{"fwd": [[64,32,4,2],[64,64,4,2],[32,32,2,2],[32,64,4,2],[64,32,4,3],[128,32,8,2],[64,16,4,3]],
    "bwd": [[[32,64,4,2],[64,32,4,2]],[[32,32,4,2],[32,32,4,2]],[[16,64,4,2],[64,16,4,2]],[[32,64,4,3],[64,32,4,3]],[[64,64,4,2],[64,64,4,2]]]}' \
  > $OUT/tune_rec_mid_fp32_$C.log 2>&1; echo rc=$? >> $OUT/tune_rec_mid_fp32_$C.log
echo tune $(( $(date +%s) - S ))s
cp /tmp/t/results.json $OUT/tune_rec_mid_fp32_$C.json 2>/dev/null
grep -E "passed|failed" $OUT/gpu_tests_portable_$C.log | tail -3
grep FAILED $OUT/gpu_tests_portable_$C.log | head -40
tail -20 $OUT/bwd_window_tiles_$C.log; tail -30 $OUT/tune_rec_mid_fp32_$C.log
