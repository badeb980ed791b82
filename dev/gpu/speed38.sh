#!/bin/bash
# single nvidia-h200 call (session 11): the fp8 fused-MLP kernels (relu_square_mm.py with fp8 operands) against
# cuBLAS's _scaled_mm + compiled ReLU^2 and casts, at d20 b64 and d12 b128, over tile configs; bf16 as before.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
FP8_CONFIGS="128,256,128,8,3,8 128,256,128,4,3,8 128,256,64,8,4,8 128,128,128,8,4,8 256,128,128,8,3,8 128,256,128,8,4,8"
python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 --fp8 --configs $FP8_CONFIGS > $OUT/fp8_d20.log 2>&1
cat $OUT/fp8_d20.log
python3 -m dev.bench_relu_square_mm --depth 12 --device-batch-size 128 --fp8 --configs $FP8_CONFIGS > $OUT/fp8_d12.log 2>&1
cat $OUT/fp8_d12.log
python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 > $OUT/bf16_d20.log 2>&1
cat $OUT/bf16_d20.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
