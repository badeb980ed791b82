#!/bin/bash
# x4 call (session 6), one GPU per lane: rotary + QK-norm as one custom op (Triton kernels) against the tree
# before this session (.carry4/old: commit 2e89d52) on the same machine; the op's micro-benchmark; a d20 profile.
source "$(dirname "$0")/env.sh"
old_tree
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
( export CUDA_VISIBLE_DEVICES=0
  timeout 90 python3 -m dev.bench_rotary_norm --depth 12 --device-batch-size 128 2>&1 | tee $OUT/rn_d12.log
  timeout 90 python3 -m dev.bench_rotary_norm --depth 20 --device-batch-size 32 2>&1 | tee $OUT/rn_d20.log
  bench 0 200 new_d12_L_b128 $D12 -- --window-pattern L && bench 0 280 new_d20_L_b32 $D20 -- --window-pattern L ) &
( cd /tmp/old && bench 1 200 old_d12_L_b128 $D12 -- --window-pattern L && bench 1 280 old_d20_L_b32 $D20 -- --window-pattern L ) &
( export CUDA_VISIBLE_DEVICES=2
  timeout 300 python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 32 --grad-accum 8 \
    --data-dir $NANOCHAT_DATA_DIR > $OUT/prof_d20_b32.log 2>&1; grep -v Warn $OUT/prof_d20_b32.log | head -45
  bench 2 200 new_d12_L_b128_b $D12 -- --window-pattern L ) &
( cd /tmp/old && bench 3 280 old_d20_L_b32_b $D20 -- --window-pattern L && cd - >/dev/null && bench 3 280 new_d20_L_b32_b $D20 -- --window-pattern L ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
