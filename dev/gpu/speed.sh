#!/bin/bash
# h200 call: where the time of a 524,288-token bf16 step goes at d12 and d20 (window L), and what
# Inductor's coordinate-descent tuning of its Triton kernels buys
source "$(dirname "$0")/env.sh"
P="python3 -m dev.profile_train --window-pattern L --warmup 4 --active 2 --data-dir $NANOCHAT_DATA_DIR"
timeout 170 $P --depth 12 --device-batch-size 32 --grad-accum 8 > $OUT/prof_d12.log 2>&1; grep -v Warn $OUT/prof_d12.log | head -75
timeout 200 $P --depth 20 --device-batch-size 32 --grad-accum 8 > $OUT/prof_d20.log 2>&1; grep -v Warn $OUT/prof_d20.log | head -75
bench 0 150 d12_base --depth 12 --steps 16 --warmup 6 -- --window-pattern L
TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 bench 0 200 d12_cdt --depth 12 --steps 16 --warmup 6 -- --window-pattern L
