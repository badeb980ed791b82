#!/bin/bash
# h200 call: the fused cross-entropy kernels, then d12/d20 bf16 throughput after the loader and loss changes
source "$(dirname "$0")/env.sh"
timeout 120 python3 -m dev.bench_softcap_ce 2>&1 | grep -v Warn | tee $OUT/ce.log
bench 0 150 d12_L_b32 --depth 12 --steps 16 --warmup 6 -- --window-pattern L
bench 0 150 d12_L_b128 --depth 12 --steps 16 --warmup 6 --device-batch-size 128 -- --window-pattern L
bench 0 200 d20_L_b32 --depth 20 --steps 14 --warmup 5 -- --window-pattern L
# CUDA graphs (Inductor's reduce-overhead mode), as an experiment on a copy of the training script
sed 's/model = torch.compile(model, dynamic=False)/model = torch.compile(model, dynamic=False, mode="reduce-overhead")/' scripts/base_train.py > scripts/base_train_graphs.py
grep -c reduce-overhead scripts/base_train_graphs.py
sed -i 's/"scripts.base_train"/os.environ.get("NANOCHAT_TRAIN_MODULE", "scripts.base_train")/' dev/bench_train.py
NANOCHAT_TRAIN_MODULE=scripts.base_train_graphs bench 0 180 d12_L_b32_graphs --depth 12 --steps 16 --warmup 6 -- --window-pattern L
cat $OUT/bench.csv
