#!/bin/bash
# x4 call (session 10), one GPU per lane, FlashAttention-4 (.carry5): the #5 table with the MLP's ReLU^2 inside its
# products (relu_square_mm.py). bf16 and fp8 at d20 device batch 64 on lanes 0 and 1 in swapped order (the fp8 ratio
# like for like); lane 2 the module path (/tmp/ref) and SSSL; lane 3 d12 (new, ref, SSSL, fp8). SM clock and power
# sampled.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
patched_tree /tmp/ref nanochat/gpt.py 's/if self.fused_kernels_take(x):/if False:/'
clock_log
( with_fa4 bench 0 230 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
  with_fa4 bench 0 230 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
( with_fa4 bench 1 230 d20_fp8_b64_2 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 1 230 d20_L_b64_2 $D20 --device-batch-size 64 -- --window-pattern L ) &
( ( cd /tmp/ref && with_fa4 bench 2 230 ref_d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L )
  with_fa4 bench 2 230 d20_SSSL_b64 $D20 --device-batch-size 64 -- --window-pattern SSSL ) &
( with_fa4 bench 3 150 d12_L_b128 $D12 -- --window-pattern L
  ( cd /tmp/ref && with_fa4 bench 3 150 ref_d12_L_b128 $D12 -- --window-pattern L )
  with_fa4 bench 3 150 d12_SSSL_b128 $D12 -- --window-pattern SSSL
  with_fa4 bench 3 150 d12_fp8_b128 $D12 -- --window-pattern L --fp8 ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
