#!/bin/bash
# x4 call: sequence parallelism after the flattened-token split (#7), d32 and d20 side by side, as in tp.sh
source "$(dirname "$0")/env.sh"
C="--steps 9 --warmup 4 -- --window-pattern L"
bench 0,1 170 d32_tp2_sp --depth 32 --total-batch-size 131072 --device-batch-size 8 --nproc 2 $C --tp 2 --sequence-parallel &
bench 2,3 130 d20_tp2_sp --depth 20 --total-batch-size 131072 --device-batch-size 16 --nproc 2 $C --tp 2 --sequence-parallel &
wait
