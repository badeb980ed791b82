#!/bin/bash
# single nvidia-h200 call (session 9), FlashAttention-4 (.carry5): d20 bf16 L b32 on a GPU that runs alone (no
# neighbours in the same host drawing power), twice around a profile of the same configuration; the profile's
# trace and Inductor's generated kernels come back too, to read which fused kernels are slow.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,clocks.max.mem,temperature.gpu --format=csv
with_fa4 bench 0 280 d20_L_b32 $D20 -- --window-pattern L
with_fa4 timeout 300 python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 32 --grad-accum 8 \
    --data-dir $NANOCHAT_DATA_DIR --active 1 --top 90 --trace /tmp/trace.json > $OUT/prof_d20.log 2>&1
grep -v -i "warn\|Failed to load" $OUT/prof_d20.log | head -120
with_fa4 bench 0 280 d20_L_b32_2 $D20 -- --window-pattern L
nvidia-smi --query-gpu=temperature.gpu,clocks.sm,power.draw --format=csv
cat $OUT/bench.csv
gzip -c /tmp/trace.json > $OUT/trace.json.gz
( cd $TORCHINDUCTOR_CACHE_DIR && find . -name "*.py" | tar czf $OUT/inductor_py.tgz -T - )
ls -la $OUT
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
