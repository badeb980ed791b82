#!/bin/bash
# (The stacked q/k/v tree it measured was reverted afterwards: run now, it compares the tree with itself.)
# x4 call (session 4), one GPU per lane: q/k/v as one matmul, against the previous tree (.carry4/old holds
# its gpt.py, l3.py, tensor_parallel.py) on the same machine; Inductor's max-autotune for the matmuls; tied L3.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
rm -rf /tmp/old && mkdir /tmp/old && cp -r nanochat scripts dev /tmp/old/ && cp .carry4/old/*.py /tmp/old/nanochat/
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
D20="--depth 20 --steps 12 --warmup 5"
( cd /tmp/old && bench 0 160 old_d12_L_b128 $D12 -- --window-pattern L && bench 0 250 old_d20_L_b32 $D20 -- --window-pattern L ) &
( bench 1 160 new_d12_L_b128 $D12 -- --window-pattern L && bench 1 250 new_d20_L_b32 $D20 -- --window-pattern L
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m dev.profile_train --depth 12 --window-pattern L --device-batch-size 32 \
    --grad-accum 1 --warmup 6 --active 4 --data-dir $NANOCHAT_DATA_DIR --l3-after-layers 5 --l3-tied > $OUT/prof_l3_tied.log 2>&1
  grep -v Warn $OUT/prof_l3_tied.log | head -50 ) &
( TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 bench 2 520 autotune_d12_L_b128 $D12 -- --window-pattern L ) &
( export CUDA_VISIBLE_DEVICES=3; run l3_tied_k512 260 --num-iterations=200 --l3-after-layers 5 --l3-tied
  run dense 200 --num-iterations=200 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
