#!/bin/bash
# single nvidia-h200 call (session 11): fp8.Fp8MLP (the tensorwise MLP with ReLU^2 in its fp8 products). The
# kernel bench, then d20 b64 end to end: fp8 with it, fp8 with the fp8.py before (4cf5bed, carried as
# .carry5/old/fp8.py; its MLP is torchao's Float8Linear), bf16; then the fp8 and fused-MLP tests on the GPU. FlashAttention-4 (.carry5).
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
rm -rf /tmp/ref && mkdir /tmp/ref && cp -r nanochat scripts dev /tmp/ref/ && cp $CARRY/old/fp8.py /tmp/ref/nanochat/fp8.py
python3 -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 --fp8 > $OUT/kernels.log 2>&1; cat $OUT/kernels.log
with_fa4 bench 0 170 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
( cd /tmp/ref && with_fa4 bench 0 170 ref_d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 )
with_fa4 bench 0 170 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
with_fa4 timeout 150 python3 -m pytest -q -rs tests/test_fp8.py tests/test_relu_square_mm.py -p no:warnings > $OUT/pytest.log 2>&1
tail -6 $OUT/pytest.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
