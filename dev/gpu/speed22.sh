#!/bin/bash
# x4 call (session 8), one GPU per lane, all with FlashAttention-4 (.carry5): ReLU^2's backward casting c_fc's
# gradient to fp8 itself (nanochat/fp8.py). Lane 0 first runs tests/test_fp8.py on the GPU (the cast kernel
# bit for bit against PyTorch), then bf16. Lane 1 is fp8 without the new activation (a copy of the tree in
# /tmp/old whose convert_to_fp8 never swaps it in), lane 2 fp8 with it, lane 3 fp8 with it and cuBLAS's fast
# accumulation in the two backward matmuls as well (torchao's tensorwise default keeps it for the forward only).
# Ran on the tree that became commit 6fb5fb1, before fast accumulation was added to it (6fb5fb1 has it, so the
# /tmp/fast patch is moot on later trees).
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
patched_tree /tmp/old nanochat/fp8.py 's/if recipe == "tensorwise" and isinstance(mlp, MLP)/if False and isinstance(mlp, MLP)/'
patched_tree /tmp/fast nanochat/fp8.py 's/    config = Float8LinearConfig.from_recipe_name(recipe)/    import dataclasses; from torchao.float8.config import Float8GemmConfig\n    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True), gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))/'
( CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q tests/test_fp8.py -p no:warnings > $OUT/pytest.log 2>&1
  with_fa4 bench 0 230 d20_L_b32 $D20 -- --window-pattern L ) &
( cd /tmp/old && with_fa4 bench 1 260 d20_fp8_old_b32 $D20 -- --window-pattern L --fp8 ) &
( with_fa4 bench 2 260 d20_fp8_b32 $D20 -- --window-pattern L --fp8 ) &
( cd /tmp/fast && with_fa4 bench 3 260 d20_fp8_fast_b32 $D20 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv; grep -h "converted" $OUT/*.log; tail -3 $OUT/pytest.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
