#!/bin/bash
# x4 call (session 7), right after speed18.sh on the same machine: the equal-steps run with FlashAttention-4 on
# lanes 0-2 (data: the shards speed18.sh left in /tmp/qdata), and d20 fp8 L at device batch 64 with FA4 on lane 3.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
[ -d /tmp/qdata ] || { echo "no /tmp/qdata: the machine was not the one speed18.sh ran on"; exit 1; }
export NANOCHAT_DATA_DIR=/tmp/qdata
source "$(dirname "$0")/equal_steps.sh"
fa4_site
fp8_wheels
D20="--depth 20 --steps 12 --warmup 5"
for g in 0 1 2; do ( export CUDA_VISIBLE_DEVICES=$g; with_fa4 run fa4_$g 240 --num-iterations=200 ) & done
( with_fa4 bench 3 280 d20_fp8_b64_fa4 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
