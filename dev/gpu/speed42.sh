#!/bin/bash
# single nvidia-h200 call (session 11): the other rows of the #5 table with fp8.Fp8MLP, on one GPU: d12 bf16 L,
# d12 bf16 SSSL, d12 fp8 (device batch 128), d20 bf16 SSSL (device batch 64); FA4.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
with_fa4 bench 0 120 d12_L_b128 $D12 -- --window-pattern L
with_fa4 bench 0 120 d12_SSSL_b128 $D12 -- --window-pattern SSSL
with_fa4 bench 0 170 d12_fp8_b128 $D12 -- --window-pattern L --fp8
with_fa4 bench 0 150 d20_SSSL_b64 $D20 --device-batch-size 64 -- --window-pattern SSSL
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
