#!/bin/bash
# single nvidia-h200 call (session 11): where fp8's d20 step goes with fp8.Fp8MLP (device batch 64, grad accum 4 =
# 524,288 tokens, FA4), the kernel table of dev.profile_train.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
with_fa4 timeout 400 python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 64 --grad-accum 4 \
    --fp8 --data-dir $NANOCHAT_DATA_DIR --active 1 --top 45 > $OUT/profile_fp8.log 2>&1
tail -75 $OUT/profile_fp8.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
