#!/bin/bash
# single nvidia-h200 call (session 10): the MLP's products with ReLU^2 in their epilogues (relu_square_mm.py)
# against cuBLAS + compiled ReLU^2, over tile configs, at d20 device batch 64 and d12 device batch 128.
# Ran at commit bca4219, whose kernel took 8-value configs (also: split epilogue, warp-specialize) and read W_proj
# as it lies for the backward; the bench now takes 6 values and always runs the backward from a transposed copy.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
CONFIGS="128,256,64,8,3,8,1,0 128,256,64,8,3,8,0,0 128,256,64,8,4,8,1,0 128,128,64,8,4,4,0,0 128,128,64,8,4,8,0,0
 128,128,64,8,5,4,1,0 256,128,64,8,3,8,1,0 128,256,64,8,3,8,1,1 128,128,64,8,4,4,0,1 128,256,64,16,3,8,1,0
 64,256,64,8,4,4,1,0 128,256,64,4,3,8,1,0"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python3 -c "import triton; print('triton', triton.__version__)"
timeout 280 python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 --configs $CONFIGS 2>&1 | tee $OUT/mm_d20.log | grep -v -i warn
timeout 250 python3 -m dev.bench_relu_square_mm --depth 12 --device-batch-size 128 --configs $CONFIGS 2>&1 | tee $OUT/mm_d12.log | grep -v -i warn
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
