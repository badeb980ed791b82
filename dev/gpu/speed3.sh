#!/bin/bash
# x4 call: the #5 table after the loader and loss changes. Four lanes, one GPU each (every figure is a
# one-GPU figure): d12/d20 x {bf16 L, bf16 SSSL, fp8 L}, d12 at larger device batches, and the
# equal-steps quality run (d12, 200 steps of 65,536 tokens).
source "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry4/whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
source "$(dirname "$0")/equal_steps.sh"
D12="--depth 12 --steps 16 --warmup 6"
D20="--depth 20 --steps 12 --warmup 5"
( bench 0 150 d12_L_b32 $D12 -- --window-pattern L
  bench 0 170 d12_L_b128 $D12 --device-batch-size 128 -- --window-pattern L
  bench 0 150 d12_SSSL_b32 $D12 -- --window-pattern SSSL ) &
( bench 1 200 d20_L_b32 $D20 -- --window-pattern L
  bench 1 200 d20_SSSL_b32 $D20 -- --window-pattern SSSL ) &
( bench 2 280 d20_fp8_L_b32 $D20 -- --window-pattern L --fp8
  bench 2 170 d12_fp8_L_b32 $D12 -- --window-pattern L --fp8 ) &
( CUDA_VISIBLE_DEVICES=3 run quality_d12_bf16 240 --num-iterations=200
  bench 3 150 d12_L_b64 $D12 --device-batch-size 64 -- --window-pattern L
  bench 3 170 d12_SSSL_b128 $D12 --device-batch-size 128 -- --window-pattern SSSL ) &
wait
cat $OUT/bench.csv
