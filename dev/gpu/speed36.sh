#!/bin/bash
# single nvidia-h200 call (session 10): the fused backward with y loaded before the K loop (dev/gpu/prefetch_y.py)
# against relu_square_mm's, then the kernel bench at the chosen configs for the record. The variant did not help and
# dev/gpu/prefetch_y.py was removed afterwards (a copy of the kernel's tile loop); it is in git at commit 7a53a56.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PYTHONPATH=. timeout 200 python3 dev/gpu/prefetch_y.py 2>&1 | tee $OUT/prefetch.log | grep -v -i warn
timeout 150 python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 --configs 128,256,64,8,3,8 128,256,64,4,3,8 2>&1 | tee $OUT/mm_d20.log | grep -v -i warn
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
