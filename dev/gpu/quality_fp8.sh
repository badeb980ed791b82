#!/bin/bash
# x4 call (session 8): the equal-steps quality run (d12 L, 200 steps of 65,536 tokens, the real shards of .carry4;
# cuDNN attention, no FA4 on this carry) twice in bf16, once with --fp8 as committed (ReLU^2 casting c_fc's
# gradient) and once with --fp8 plus cuBLAS's fast accumulation in the backward matmuls (a copy of the tree in
# /tmp/fast, as in speed22.sh): do the fp8 loss curves stay within the bf16 runs' noise?
# Ran on the tree that became commit 6fb5fb1, before fast accumulation was added to it (6fb5fb1 has it, so the
# /tmp/fast patch is moot on later trees).
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
fp8_wheels
patched_tree /tmp/fast nanochat/fp8.py 's/    config = Float8LinearConfig.from_recipe_name(recipe)/    import dataclasses; from torchao.float8.config import Float8GemmConfig\n    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True), gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))/'
( CUDA_VISIBLE_DEVICES=0 run bf16_a 260 --num-iterations=200 ) &
( CUDA_VISIBLE_DEVICES=1 run bf16_b 260 --num-iterations=200 ) &
( CUDA_VISIBLE_DEVICES=2 run fp8 260 --num-iterations=200 --fp8 ) &
( cd /tmp/fast && CUDA_VISIBLE_DEVICES=3 run fp8_fast 260 --num-iterations=200 --fp8 ) &
wait
grep -h "converted" $OUT/*.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
