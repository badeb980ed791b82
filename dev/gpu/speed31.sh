#!/bin/bash
# single nvidia-h200 call (session 9), FlashAttention-4 (.carry5): where bf16 d20's time goes at device batch 64
# (which ReLU^2 keeping only its output made fit), between a bench of it and one of d12, on one more machine.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
with_fa4 bench 0 230 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
with_fa4 timeout 300 python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 64 --grad-accum 4 \
    --data-dir $NANOCHAT_DATA_DIR --active 1 --top 60 --trace /tmp/trace.json > $OUT/prof_d20_b64.log 2>&1
grep -v -i "warn\|Failed to load" $OUT/prof_d20_b64.log | head -40
with_fa4 bench 0 200 d12_L_b128 $D12 -- --window-pattern L
cat $OUT/bench.csv
gzip -c /tmp/trace.json > $OUT/trace.json.gz
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
