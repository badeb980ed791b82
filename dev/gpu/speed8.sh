#!/bin/bash
# x4 call (session 5), one GPU per lane: split-K weight gradients (tuned per shape at start) and the cheaper loss
# kernel, against the tree before this session on the same machine (env.sh's old_tree); SSSL and fp8 with them;
# the equal-steps quality run. (In the call itself the old runs failed: they had only the old modules under the
# new base_train; old_tree now copies the whole old tree.)
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
fp8_wheels
old_tree
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
( export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 -m dev.bench_softcap_ce 2>&1 | grep -v Warn | tee $OUT/ce_d12.log
  bench 0 200 new_d12_L_b128 $D12 -- --window-pattern L && bench 0 200 new_d12_SSSL_b128 $D12 -- --window-pattern SSSL ) &
( cd /tmp/old && bench 1 200 old_d12_L_b128 $D12 -- --window-pattern L && bench 1 280 old_d20_L_b32 $D20 -- --window-pattern L ) &
( bench 2 280 new_d20_L_b32 $D20 -- --window-pattern L && bench 2 280 new_d20_SSSL_b32 $D20 -- --window-pattern SSSL ) &
( export CUDA_VISIBLE_DEVICES=3; run quality_d12_L 260 --num-iterations=200
  bench 3 300 new_d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 ) &
wait
grep -h "weight gradients, split-K" $OUT/new_d12_L_b128.log $OUT/new_d20_L_b32.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
