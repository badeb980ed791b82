#!/bin/bash
# x4 call 2: pipeline parallelism (#8) at d26, micro-batches of 8 x 2048: PP=2 with m=4 and 16 (1F1B vs
# GPipe, side by side on GPUs 0,1 and 2,3), then PP=4 with m=16 (1F1B, and GPipe for its memory).
source "$(dirname "$0")/env.sh"
C="--steps 9 --warmup 4 -- --window-pattern L"
bench 0,1 150 d26_pp2_1f1b_m4   --depth 26 --total-batch-size 65536 --device-batch-size 8 --nproc 2 $C --pp 2 --pp-schedule 1f1b &
bench 2,3 150 d26_pp2_gpipe_m4  --depth 26 --total-batch-size 65536 --device-batch-size 8 --nproc 2 $C --pp 2 --pp-schedule gpipe &
wait
bench 0,1 170 d26_pp2_1f1b_m16  --depth 26 --total-batch-size 262144 --device-batch-size 8 --nproc 2 $C --pp 2 --pp-schedule 1f1b &
bench 2,3 170 d26_pp2_gpipe_m16 --depth 26 --total-batch-size 262144 --device-batch-size 8 --nproc 2 $C --pp 2 --pp-schedule gpipe &
wait
bench 0,1,2,3 130 d26_pp4_1f1b_m16  --depth 26 --total-batch-size 262144 --device-batch-size 8 --nproc 4 $C --pp 4 --pp-schedule 1f1b --pp-print-schedule
bench 0,1,2,3 130 d26_pp4_gpipe_m16 --depth 26 --total-batch-size 262144 --device-batch-size 8 --nproc 4 $C --pp 4 --pp-schedule gpipe
grep -h -E "pipeline:|pp=.*peak memory" $OUT/d26_pp*.log
cat $OUT/bench.csv
