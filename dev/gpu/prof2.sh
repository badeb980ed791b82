#!/bin/bash
# x4 call (session 4): where a dense step's time goes with the current code (loader prefetch, Triton loss),
# d12 at device batch 128 (the fastest d12 L setting) and d20 at 32, one GPU per lane
source "$(dirname "$0")/env.sh"
P="python3 -m dev.profile_train --window-pattern L --data-dir $NANOCHAT_DATA_DIR"
( CUDA_VISIBLE_DEVICES=0 timeout 300 $P --depth 12 --device-batch-size 128 --grad-accum 2 > $OUT/prof_d12_b128.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout 400 $P --depth 20 --device-batch-size 32 --grad-accum 8 > $OUT/prof_d20_b32.log 2>&1 ) &
wait
for f in $OUT/prof_*.log; do echo "== $f"; grep -v Warn $f | head -45; done
