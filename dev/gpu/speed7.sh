#!/bin/bash
# x4 call (session 5), one GPU per lane: the lm_head matmul and the loss as one autograd function (the logits'
# gradient written in the forward), against the tree before it on the same machine (env.sh's old_tree; the call
# itself used commit 5275b0a's gpt.py, softcap_ce.py and tensor_parallel.py in today's tree, the same code);
# the loss and matmul micro-benchmarks; fp8 with it.
source "$(dirname "$0")/env.sh"
fp8_wheels
old_tree
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
( export CUDA_VISIBLE_DEVICES=0
  timeout 60 python3 -m dev.bench_softcap_ce 2>&1 | grep -v Warn | tee $OUT/ce_d12.log
  timeout 60 python3 -m dev.bench_softcap_ce --dim 1280 2>&1 | grep -v Warn | tee $OUT/ce_d20.log
  timeout 60 python3 -m dev.bench_matmul --depth 20 --device-batch-size 32 2>&1 | tee $OUT/mm_d20.log
  timeout 60 python3 -m dev.bench_matmul --depth 12 --device-batch-size 128 2>&1 | tee $OUT/mm_d12.log
  bench 0 200 new_d12_L_b128 $D12 -- --window-pattern L ) &
( cd /tmp/old && bench 1 200 old_d12_L_b128 $D12 -- --window-pattern L && bench 1 280 old_d20_L_b32 $D20 -- --window-pattern L ) &
( bench 2 280 new_d20_L_b32 $D20 -- --window-pattern L && bench 2 200 new_d12_L_b32 --depth 12 --steps 16 --warmup 6 -- --window-pattern L ) &
( bench 3 330 new_d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 && bench 3 200 new_d12_fp8_L_b128 $D12 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
