#!/bin/bash
# x4 call: the rows of the #5 table that speed3.sh measured before the loss kernels moved out of the
# compiled graph, again with the final code (one GPU per lane)
source "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry4/whl/*.whl && export PYTHONPATH=/tmp/site
D12="--depth 12 --steps 16 --warmup 6"
D20="--depth 20 --steps 12 --warmup 5"
bench 0 200 d20_fp8_L_b32 $D20 -- --window-pattern L --fp8 &
bench 1 170 d20_SSSL_b32 $D20 -- --window-pattern SSSL &
( bench 2 120 d12_SSSL_b32 $D12 -- --window-pattern SSSL
  bench 2 90 d12_L_b32 $D12 -- --window-pattern L ) &
bench 3 150 d12_fp8_L_b32 $D12 -- --window-pattern L --fp8 &
wait
cat $OUT/bench.csv
