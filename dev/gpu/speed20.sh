#!/bin/bash
# x4 call (session 7), one GPU per lane, all with FlashAttention-4 (.carry5): d20 bf16 and fp8 on one machine, at
# device batch 32 and 64. bf16 at 64 is expected near the H200's 139 GiB (78.7 GiB at 32), so that run uses
# expandable segments against fragmentation.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
D20="--depth 20 --steps 12 --warmup 5"
( with_fa4 bench 0 200 d20_L_b32 $D20 -- --window-pattern L; with_fa4 bench 0 200 d20_SSSL_b32 $D20 -- --window-pattern SSSL ) &
( export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; with_fa4 bench 1 300 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 2 300 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
( with_fa4 bench 3 300 d20_fp8_b32 $D20 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv; grep -h "OutOfMemory\|out of memory" $OUT/*.log | head -3
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
