#!/bin/bash
# x4 call (session 6), one GPU per lane: does Inductor's prefer_nd_tiling (set through a sitecustomize.py on
# PYTHONPATH, so every process of the run gets it) speed up the transposed fp8 casts that dominate fp8's elementwise
# time at d20, or bf16's kernels? Each lane runs one config with the knob and one without, in swapped orders.
source "$(dirname "$0")/env.sh"
fp8_wheels
mkdir -p /tmp/ndtiling && printf "import sys, torch._inductor.config as c\nc.triton.prefer_nd_tiling = True\nprint(\"inductor: prefer_nd_tiling\", file=sys.stderr)\n" > /tmp/ndtiling/sitecustomize.py
D20="--depth 20 --steps 12 --warmup 5"
nd() { ( export PYTHONPATH=/tmp/ndtiling:$PYTHONPATH; "$@" ); }
( bench 0 300 fp8 $D20 -- --window-pattern L --fp8 && nd bench 0 280 bf16_nd $D20 -- --window-pattern L ) &
( nd bench 1 300 fp8_nd $D20 -- --window-pattern L --fp8 && bench 1 280 bf16 $D20 -- --window-pattern L ) &
( bench 2 280 bf16_b $D20 -- --window-pattern L && nd bench 2 300 fp8_nd_b $D20 -- --window-pattern L --fp8 ) &
( nd bench 3 280 bf16_nd_b $D20 -- --window-pattern L && bench 3 300 fp8_b $D20 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
