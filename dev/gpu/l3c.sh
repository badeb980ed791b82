#!/bin/bash
# x4 call (session 4), one GPU per lane: the equal-steps runs three times each, dense / L3 tied / L3 untied
# (k_max 512, the default 2^19-row table, after block 5), and where an L3 step's time goes now
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
L3="--num-iterations=200 --l3-after-layers 5"
( export CUDA_VISIBLE_DEVICES=0; for i in 1 2 3; do run dense_$i 185 --num-iterations=200; done ) &
( export CUDA_VISIBLE_DEVICES=1; for i in 1 2 3; do run l3_tied_$i 185 $L3 --l3-tied; done ) &
( export CUDA_VISIBLE_DEVICES=2; for i in 1 2 3; do run l3_untied_$i 185 $L3 --l3-tied 0; done ) &
( export CUDA_VISIBLE_DEVICES=3
  P="python3 -m dev.profile_train --depth 12 --window-pattern L --device-batch-size 32 --grad-accum 1 --warmup 6 --active 4 --data-dir $NANOCHAT_DATA_DIR --l3-after-layers 5"
  timeout 200 $P --l3-tied > $OUT/prof_l3_tied.log 2>&1; grep -v Warn $OUT/prof_l3_tied.log | head -30
  timeout 200 $P --l3-tied 0 > $OUT/prof_l3_untied.log 2>&1; grep -v Warn $OUT/prof_l3_untied.log | head -12 ) &
wait
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
