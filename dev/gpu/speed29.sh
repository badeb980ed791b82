#!/bin/bash
# x4 call (session 9), one GPU per lane, FlashAttention-4 (.carry5). ReLU^2 now keeps only its output (relu(h) =
# sqrt of it in the backward), so bf16 d20 keeps one (tokens, 4C) activation a layer instead of two and fits device
# batch 64 without recomputing anything. New tree against /tmp/ref (ReLU^2 patched back to plain autograd); lanes 0
# and 1 swap the order. speed28.sh found these GPUs at their 700 W power limit (SM clock ~1575 MHz) while training.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
patched_tree /tmp/ref nanochat/gpt.py 's/return _ReluSquare.apply(h)/return F.relu(h).square()/'
clock_log
( ( cd /tmp/ref && with_fa4 bench 0 230 ref_d20_L_b32 $D20 -- --window-pattern L )
  with_fa4 bench 0 230 new_d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 1 230 new_d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L
  ( cd /tmp/ref && with_fa4 bench 1 230 ref_d20_L_b32_2 $D20 -- --window-pattern L ) ) &
( with_fa4 bench 2 230 new_d20_L_b32 $D20 -- --window-pattern L
  with_fa4 bench 2 200 new_d12_L_b128 $D12 -- --window-pattern L ) &
( with_fa4 bench 3 230 new_d20_L_b64_3 $D20 --device-batch-size 64 -- --window-pattern L
  with_fa4 bench 3 230 new_d20_SSSL_b64 $D20 --device-batch-size 64 -- --window-pattern SSSL ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
