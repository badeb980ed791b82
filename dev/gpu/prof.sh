#!/bin/bash
# h200 call: where an L3 step's time goes (d12, 32 x 2048 per step as in the equal-steps runs), dense for reference
source "$(dirname "$0")/env.sh"
P="python3 -m dev.profile_train --depth 12 --window-pattern L --device-batch-size 32 --grad-accum 1 --warmup 6 --active 4 --data-dir $NANOCHAT_DATA_DIR"
timeout 150 $P > $OUT/prof_dense.log 2>&1; head -8 $OUT/prof_dense.log | grep -v Warn
timeout 200 $P --l3-after-layers 5 --l3-tied 0 --l3-k-max 128 --trace $OUT/l3_trace.json > $OUT/prof_l3.log 2>&1; grep -v Warn $OUT/prof_l3.log | head -60
gzip -f $OUT/l3_trace.json; ls -la $OUT
