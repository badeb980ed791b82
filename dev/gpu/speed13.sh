#!/bin/bash
# x4 calls (session 6), one GPU per lane: #5's table with the final code (rotary + QK-norm custom op), the tree
# before this session (.carry4/old, commit 2e89d52) on the same machine, and the equal-steps quality run.
# `bash dev/gpu/speed13.sh A` on one machine, `... B` on another (the two columns of the README's table).
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
fp8_wheels
old_tree
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
if [ "$1" = A ]; then
( bench 0 200 d12_L_b128 $D12 -- --window-pattern L && bench 0 200 d12_SSSL_b128 $D12 -- --window-pattern SSSL
  CUDA_VISIBLE_DEVICES=0 run quality_d12_L 260 --num-iterations=200 ) &
( bench 1 280 d20_L_b32 $D20 -- --window-pattern L && bench 1 280 d20_SSSL_b32 $D20 -- --window-pattern SSSL ) &
( bench 2 300 d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 && cd /tmp/old && bench 2 200 old_d12_L_b128 $D12 -- --window-pattern L ) &
( bench 3 240 d12_fp8_L_b128 $D12 -- --window-pattern L --fp8 && cd /tmp/old && bench 3 280 old_d20_L_b32 $D20 -- --window-pattern L ) &
else  # B: also more equal-steps runs, new and old, since A's one run spiked at step ~91 (val bpb 1.5526)
( bench 0 200 d12_L_b128 $D12 -- --window-pattern L && bench 0 200 d12_SSSL_b128 $D12 -- --window-pattern SSSL
  export CUDA_VISIBLE_DEVICES=0; run quality_d12_L_2 260 --num-iterations=200; run quality_d12_L_3 260 --num-iterations=200 ) &
( bench 1 280 d20_L_b32 $D20 -- --window-pattern L && cd /tmp/old && bench 1 280 old_d20_L_b32 $D20 -- --window-pattern L
  CUDA_VISIBLE_DEVICES=1 run old_quality_d12_L_1 260 --num-iterations=200 ) &
( bench 2 300 d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 && cd /tmp/old && bench 2 200 old_d12_L_b128 $D12 -- --window-pattern L
  CUDA_VISIBLE_DEVICES=2 run old_quality_d12_L_2 260 --num-iterations=200 ) &
( bench 3 280 d20_SSSL_b32 $D20 -- --window-pattern SSSL
  export CUDA_VISIBLE_DEVICES=3; run quality_d12_L_4 260 --num-iterations=200; run quality_d12_L_5 260 --num-iterations=200 ) &
fi
wait
grep -h "weight gradients, split-K" $OUT/d12_L_b128.log $OUT/d20_L_b32.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
