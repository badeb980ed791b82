#!/bin/bash
# x4 call (session 10), one GPU per lane, FlashAttention-4 (.carry5): the #5 table with the fused MLP on one more
# machine (bf16 and fp8 at d20 b64 on lanes 1 and 2 in swapped order; d12 twice and d20 b32 on lane 3), and where
# d20 b64's step goes now (lane 0, profile). SM clock and power sampled.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
clock_log
( export CUDA_VISIBLE_DEVICES=0; with_fa4 timeout 300 python3 -m dev.profile_train --depth 20 --window-pattern L \
    --device-batch-size 64 --grad-accum 4 --data-dir $NANOCHAT_DATA_DIR --active 1 --top 40 > $OUT/prof_d20_b64.log 2>&1 ) &
( with_fa4 bench 1 230 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
  with_fa4 bench 1 230 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
( with_fa4 bench 2 230 d20_fp8_b64_2 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 2 230 d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 3 150 d12_L_b128 $D12 -- --window-pattern L
  with_fa4 bench 3 150 d12_L_b128_2 $D12 -- --window-pattern L
  with_fa4 bench 3 230 d20_L_b32 $D20 -- --window-pattern L ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
grep -v -i "warn\|Failed to load" $OUT/prof_d20_b64.log | head -45
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
