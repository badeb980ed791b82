#!/bin/bash
# x4 call (session 10), one GPU per lane, FlashAttention-4 (.carry5): the MLP with ReLU^2 inside its products
# (relu_square_mm.py) against the same tree with the module path (/tmp/ref), d20 b64 on lanes 1 and 2 in swapped
# order, d12 b128 on lane 3; lane 0: the kernel bench over tile configs, then fp8 d20 b64 (unchanged code path:
# fp8 swaps its own modules in) for the fp8 ratio on this machine. SM clock and power sampled.
# Ran at commit bca4219 (see speed32.sh): the configs here have 8 values, and "backward from W_proj^T copied" was
# an extra line of that bench, which the kernel now always does.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
patched_tree /tmp/ref nanochat/gpt.py 's/if self.fused_kernels_take(x):/if False:/'
CONFIGS="128,256,64,8,3,8,1,0 256,128,64,8,3,8,1,0 128,256,64,4,3,8,1,0 128,256,64,16,3,8,1,0 128,256,64,8,3,4,1,0
 128,256,64,8,2,8,1,0 128,256,32,8,5,8,1,0 256,128,64,4,3,8,1,0 128,128,64,8,4,4,1,0 128,192,64,8,4,8,1,0"
clock_log
( CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 --configs $CONFIGS > $OUT/mm_d20.log 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m dev.bench_relu_square_mm --depth 12 --device-batch-size 128 --configs $CONFIGS > $OUT/mm_d12.log 2>&1
  with_fa4 bench 0 230 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
( ( cd /tmp/ref && with_fa4 bench 1 230 ref_d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L )
  with_fa4 bench 1 230 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 2 230 d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L
  ( cd /tmp/ref && with_fa4 bench 2 230 ref_d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L ) ) &
( with_fa4 bench 3 200 d12_L_b128 $D12 -- --window-pattern L
  ( cd /tmp/ref && with_fa4 bench 3 200 ref_d12_L_b128 $D12 -- --window-pattern L ) ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
grep -E "^depth|^cuBLAS|fused|backward from" $OUT/mm_d20.log $OUT/mm_d12.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
