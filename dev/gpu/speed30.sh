#!/bin/bash
# x4 call (session 9), one GPU per lane, FlashAttention-4 (.carry5): the #5 table with ReLU^2 keeping only its
# output (commit 1082745). bf16 and fp8 at d20 device batch 64 on lanes 0 and 1 in swapped order (the fp8 ratio
# like for like); batch 32 and d12 on lanes 2 and 3. SM clock and power sampled.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
clock_log
( with_fa4 bench 0 230 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
  with_fa4 bench 0 230 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 0 200 d12_fp8_b128 $D12 -- --window-pattern L --fp8 ) &
( with_fa4 bench 1 230 d20_fp8_b64_2 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 1 230 d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 2 230 d20_L_b32 $D20 -- --window-pattern L
  with_fa4 bench 2 200 d12_L_b128 $D12 -- --window-pattern L
  with_fa4 bench 2 200 d12_SSSL_b128 $D12 -- --window-pattern SSSL ) &
( with_fa4 bench 3 230 d20_SSSL_b64 $D20 --device-batch-size 64 -- --window-pattern SSSL
  with_fa4 bench 3 230 d20_fp8_b32 $D20 -- --window-pattern L --fp8 ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
