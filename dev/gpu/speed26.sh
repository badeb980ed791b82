#!/bin/bash
# x4 call (session 8), one GPU per lane, with FlashAttention-4 (.carry5): --recompute-act as committed (one Function
# for ReLU^2 and c_proj that keeps h only and rebuilds relu(h)^2 in the pass making ReLU^2's gradient; speed25.sh's
# checkpointed ReLU^2 cost 3% at batch 32) at d20 batch 64, against batch 32 without it (lanes 0 and 1 swap them
# between the two rounds), and the rest of the table on the same machine.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
( with_fa4 bench 0 230 d20_L_b32 $D20 -- --window-pattern L
  with_fa4 bench 0 230 d20_L_b64_rc_2 $D20 --device-batch-size 64 -- --window-pattern L --recompute-act ) &
( with_fa4 bench 1 230 d20_L_b64_rc $D20 --device-batch-size 64 -- --window-pattern L --recompute-act
  with_fa4 bench 1 230 d20_L_b32_2 $D20 -- --window-pattern L ) &
( with_fa4 bench 2 260 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 2 230 d20_SSSL_b64_rc $D20 --device-batch-size 64 -- --window-pattern SSSL --recompute-act ) &
( with_fa4 bench 3 260 d20_fp8_b32 $D20 -- --window-pattern L --fp8
  with_fa4 bench 3 200 d12_L_b128 $D12 -- --window-pattern L ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
