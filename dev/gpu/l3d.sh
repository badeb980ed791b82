#!/bin/bash
# x4 call (session 4), one GPU per lane: three more equal-steps runs each of dense and tied L3, three tied
# L3 runs for dense's wall time (166 steps: 199 steps of dense took 24.9 s, a tied L3 step 0.1508 s in
# l3c.sh), and the throughput of both at the recipe's 524,288-token batch (grad accum 8)
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
L3="--l3-after-layers 5 --l3-tied"
( export CUDA_VISIBLE_DEVICES=0; for i in 4 5 6; do run dense_$i 185 --num-iterations=200; done ) &
( export CUDA_VISIBLE_DEVICES=1; for i in 4 5 6; do run l3_tied_$i 185 --num-iterations=200 $L3; done ) &
( export CUDA_VISIBLE_DEVICES=2; for i in 1 2 3; do run l3_tied_eqtime_$i 185 --num-iterations=166 $L3; done ) &
( bench 3 170 d12_L_b32 --depth 12 --steps 16 --warmup 6 -- --window-pattern L
  bench 3 200 d12_L_b32_l3_tied --depth 12 --steps 16 --warmup 6 -- --window-pattern L $L3 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
