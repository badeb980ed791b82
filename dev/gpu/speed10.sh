#!/bin/bash
# x4 call (session 5), one GPU per lane: #5's table with the final code (split-K weight gradients tuned per shape,
# the cheaper loss kernel), and the tree before this session (.carry4/old, commit 5275b0a) on the same machine.
source "$(dirname "$0")/env.sh"
fp8_wheels
old_tree
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
( bench 0 200 d12_L_b128 $D12 -- --window-pattern L && bench 0 200 d12_SSSL_b128 $D12 -- --window-pattern SSSL ) &
( bench 1 280 d20_L_b32 $D20 -- --window-pattern L && cd /tmp/old && bench 1 280 old_d20_L_b32 $D20 -- --window-pattern L ) &
( bench 2 280 d20_SSSL_b32 $D20 -- --window-pattern SSSL && bench 2 240 d12_fp8_L_b128 $D12 -- --window-pattern L --fp8 ) &
( bench 3 300 d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 && cd /tmp/old && bench 3 200 old_d12_L_b128 $D12 -- --window-pattern L ) &
wait
grep -h "weight gradients, split-K" $OUT/d12_L_b128.log $OUT/d20_L_b32.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
