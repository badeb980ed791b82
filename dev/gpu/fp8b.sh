#!/bin/bash
# x4 call (session 4), one GPU per lane: fp8 with the current code, both recipes, against bf16 on the same machine
source "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry4/whl/*.whl && export PYTHONPATH=/tmp/site
D12="--depth 12 --steps 16 --warmup 6"
D20="--depth 20 --steps 12 --warmup 5"
bench 0 330 d20_bf16_L $D20 -- --window-pattern L &
bench 1 330 d20_fp8_tensorwise_L $D20 -- --window-pattern L --fp8 --fp8-recipe tensorwise &
bench 2 330 d20_fp8_rowwise_L $D20 -- --window-pattern L --fp8 --fp8-recipe rowwise &
( bench 3 160 d12_fp8_rowwise_L $D12 -- --window-pattern L --fp8 --fp8-recipe rowwise
  bench 3 150 d12_fp8_tensorwise_L $D12 -- --window-pattern L --fp8 --fp8-recipe tensorwise ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
