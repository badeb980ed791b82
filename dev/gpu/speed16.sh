#!/bin/bash
# x4 call (session 7), one GPU per lane: FlashAttention-4 (flash-attn-4 4.0.0b15 with nvidia-cutlass-dsl 4.4.2,
# quack-kernels 0.4.1, apache-tvm-ffi 0.1.15.post2, torch-c-dlpack-ext 0.1.5, einops; carried in .carry5 with
# one training shard and a 16-document validation shard) against cuDNN / FlexAttention. Lane 0: the kernels
# alone at d20 and d12, then the GPU test. Lanes 1-3: end to end, the same tree with and without FA4 on the path.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
with_fa4 python3 -c "import time; t = time.time(); import flash_attn.cute.interface; print(f'flash-attn-4 imports in {time.time() - t:.1f} s')"
D20="--depth 20 --steps 12 --warmup 5"
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
( export CUDA_VISIBLE_DEVICES=0
  with_fa4 timeout 240 python3 -m dev.bench_attention --depth 20 --device-batch-size 32 > $OUT/attn_d20.log 2>&1
  with_fa4 timeout 150 python3 -m dev.bench_attention --depth 12 --device-batch-size 128 > $OUT/attn_d12.log 2>&1
  with_fa4 timeout 100 python3 -m pytest -q tests/test_flash_attention.py -p no:warnings > $OUT/pytest.log 2>&1 ) &
( with_fa4 bench 1 520 d20_L_fa4 $D20 -- --window-pattern L ) &
( bench 2 400 d20_L_cudnn $D20 -- --window-pattern L ) &
( with_fa4 bench 3 300 d12_L_fa4 $D12 -- --window-pattern L && bench 3 240 d12_L_cudnn $D12 -- --window-pattern L ) &
wait
cat $OUT/bench.csv; cat $OUT/attn_d20.log $OUT/attn_d12.log; tail -5 $OUT/pytest.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
