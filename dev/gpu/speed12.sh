#!/bin/bash
# x4 call (session 6), one GPU per lane: does cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1) or a larger cuBLAS
# workspace pick faster kernels for the model's matmul shapes; a d12 profile of the current code; the loss bench.
source "$(dirname "$0")/env.sh"
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
mm3() {  # depth batch gpu: the matmul bench three ways
    export CUDA_VISIBLE_DEVICES=$3
    timeout 60 python3 -m dev.bench_matmul --depth $1 --device-batch-size $2 > $OUT/mm_d$1_default.log 2>&1
    TORCH_BLAS_PREFER_CUBLASLT=1 timeout 60 python3 -m dev.bench_matmul --depth $1 --device-batch-size $2 > $OUT/mm_d$1_lt.log 2>&1
    CUBLAS_WORKSPACE_CONFIG=:65536:8 CUBLASLT_WORKSPACE_SIZE=65536 timeout 60 python3 -m dev.bench_matmul --depth $1 \
        --device-batch-size $2 > $OUT/mm_d$1_ws.log 2>&1
    for f in default lt ws; do echo "== d$1 $f"; cat $OUT/mm_d$1_$f.log; done
}
mm3 20 32 0 &
mm3 12 128 1 &
( export CUDA_VISIBLE_DEVICES=2
  timeout 300 python3 -m dev.profile_train --depth 12 --window-pattern L --device-batch-size 128 --grad-accum 2 \
    --data-dir $NANOCHAT_DATA_DIR > $OUT/prof_d12_b128.log 2>&1; grep -v Warn $OUT/prof_d12_b128.log | head -60 ) &
( bench 3 200 d12_L_b128 $D12 -- --window-pattern L
  TORCH_BLAS_PREFER_CUBLASLT=1 bench 3 200 d12_L_b128_lt $D12 -- --window-pattern L
  CUDA_VISIBLE_DEVICES=3 timeout 60 python3 -m dev.bench_softcap_ce > $OUT/ce_d12.log 2>&1; cat $OUT/ce_d12.log ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
