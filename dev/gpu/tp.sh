#!/bin/bash
# x4 call 1: tensor parallelism (#7) d32 and d20, TP=1 on one GPU vs TP=2 with/without SP, same global
# batch; plus the one-GPU d26 baselines for the pipeline runs (#8). Lanes run side by side on separate GPUs.
source "$(dirname "$0")/env.sh"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -6
git log --oneline -1 2>/dev/null; python3 -c "import torch; print(torch.__version__, torch.cuda.device_count())"
C="--steps 9 --warmup 4 -- --window-pattern L"
# round 1
bench 0   230 d32_tp1     --depth 32 --total-batch-size 131072 --device-batch-size 8 $C &
bench 1,2 230 d32_tp2     --depth 32 --total-batch-size 131072 --device-batch-size 8 --nproc 2 $C --tp 2 &
bench 3   230 d26_1gpu_m16 --depth 26 --total-batch-size 262144 --device-batch-size 8 $C &
wait
# round 2
bench 0   180 d20_tp1     --depth 20 --total-batch-size 131072 --device-batch-size 16 $C &
bench 1,2 220 d32_tp2_sp  --depth 32 --total-batch-size 131072 --device-batch-size 8 --nproc 2 $C --tp 2 --sequence-parallel &
bench 3   180 d26_1gpu_m4 --depth 26 --total-batch-size 65536 --device-batch-size 8 $C &
wait
# round 3
bench 0,1 130 d20_tp2     --depth 20 --total-batch-size 131072 --device-batch-size 16 --nproc 2 $C --tp 2 &
bench 2,3 130 d20_tp2_sp  --depth 20 --total-batch-size 131072 --device-batch-size 16 --nproc 2 $C --tp 2 --sequence-parallel &
wait
cat $OUT/bench.csv
