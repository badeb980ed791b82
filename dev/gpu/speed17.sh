#!/bin/bash
# x4 call (session 7), one GPU per lane: the #5 table with FlashAttention-4 (carried in .carry5 with torchao, one
# training shard cut to 4 row groups and a 16-document validation shard). Lane 3 runs the same tree without FA4
# on the path (cuDNN), for the same-machine gain, bf16 and fp8.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
D20="--depth 20 --steps 12 --warmup 5"
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
( with_fa4 bench 0 280 d20_L_fa4 $D20 -- --window-pattern L; with_fa4 bench 0 280 d20_fp8_fa4 $D20 -- --window-pattern L --fp8 ) &
( with_fa4 bench 1 280 d20_SSSL_fa4 $D20 -- --window-pattern SSSL; with_fa4 bench 1 280 d20_fp8_fa4_b $D20 -- --window-pattern L --fp8 ) &
( with_fa4 bench 2 180 d12_L_fa4 $D12 -- --window-pattern L; with_fa4 bench 2 180 d12_SSSL_fa4 $D12 -- --window-pattern SSSL
  with_fa4 bench 2 180 d12_fp8_fa4 $D12 -- --window-pattern L --fp8 ) &
( bench 3 280 d20_L_cudnn $D20 -- --window-pattern L; bench 3 280 d20_fp8_cudnn $D20 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
