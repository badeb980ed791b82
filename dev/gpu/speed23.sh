#!/bin/bash
# x4 call (session 8), one GPU per lane, with FlashAttention-4 (.carry5). Lanes 0-1: where d20 fp8's time goes
# with and without ReLU^2 casting c_fc's gradient (speed22.sh: it gained only 0.4%); lanes 2-3: fp8 with
# cuBLAS's fast accumulation in the backward matmuls too (speed22.sh: +2.4-2.9%) at d20 batch 64 and d12 batch 128.
# Ran on the tree that became commit 6fb5fb1, before fast accumulation was added to it (6fb5fb1 has it, so the
# /tmp/fast patch is moot on later trees).
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
patched_tree /tmp/old nanochat/fp8.py 's/if recipe == "tensorwise" and isinstance(mlp, MLP)/if False and isinstance(mlp, MLP)/'
patched_tree /tmp/fast nanochat/fp8.py 's/    config = Float8LinearConfig.from_recipe_name(recipe)/    import dataclasses; from torchao.float8.config import Float8GemmConfig\n    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True), gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))/'
P="python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 32 --grad-accum 8 --fp8 --data-dir $NANOCHAT_DATA_DIR"
( CUDA_VISIBLE_DEVICES=0 with_fa4 timeout 300 $P > $OUT/prof_new.log 2>&1 ) &
( cd /tmp/old && CUDA_VISIBLE_DEVICES=1 with_fa4 timeout 300 $P > $OUT/prof_old.log 2>&1 ) &
( cd /tmp/fast && with_fa4 bench 2 260 d20_fp8_fast_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
( cd /tmp/fast && with_fa4 bench 3 200 d12_fp8_fast_b128 $D12 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
for f in $OUT/prof_*.log; do echo "== $f"; grep -v -i "warn\|Failed to load" $f | head -70; done
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
