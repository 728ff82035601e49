#!/bin/bash
# Call 3 of 2026-12-02 on 0e5a3ed: the Hopper forward's tiles at L = 1024-4096 (128 x 128 on 2 stages, 128 x 64
# on 2, 3, 4), against the portable forward in the same call (the forward at L = 1024-2048 is 0.82-0.89x cuDNN).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
C=$(cut -c1-7 .gpu_commit); S=$(date +%s)
timeout 200 python3 benchmarks/results/profile/2026-12-01h_window_tiles.py L1024,rec-long,L2048,L4096 none > $OUT/fwd_tiles_mid_$C.log 2>&1; echo rc=$? >> $OUT/fwd_tiles_mid_$C.log
echo "tiles done $(( $(date +%s) - S ))s"
JAGGED_FLASH_JAX_FORWARD=portable timeout 120 python3 -m benchmarks.run --out /tmp/p --cases L1024,rec-long,L2048 --dtypes bfloat16 --impls jfa-triton --seconds 0.1 > $OUT/portable_mid_$C.log 2>&1; echo rc=$? >> $OUT/portable_mid_$C.log
echo "portable done $(( $(date +%s) - S ))s"
grep -v "^ *$" $OUT/fwd_tiles_mid_$C.log; grep -v compiled $OUT/portable_mid_$C.log | grep bench
