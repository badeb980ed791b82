#!/bin/bash
# x4 call (session 9), one GPU per lane, FlashAttention-4 (.carry5). Session 9's profile (speed27.sh) had every
# input-gradient matmul 12-14% slower than the forward product of the same dimensions; gpt.input_grad now
# multiplies by a transposed copy of the weight, so that cuBLAS gets the forward's operand layout. New tree
# against /tmp/ref (input_grad patched back to dy @ w); lanes 0 and 1 swap the order. SM clock and power sampled.
# Ran on an uncommitted tree with gpt.input_grad (dy @ w.t().contiguous().t() in _LinearFunction's backward, which
# every Linear used); it gained 0.2-0.3%, so it was reverted and this patch no longer applies.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
patched_tree /tmp/ref nanochat/gpt.py 's/return dy @ w.t().contiguous().t()/return dy @ w/'
clock_log
( ( cd /tmp/ref && with_fa4 bench 0 230 base_d20_L_b32 $D20 -- --window-pattern L )
  with_fa4 bench 0 230 new_d20_L_b32 $D20 -- --window-pattern L ) &
( with_fa4 bench 1 230 new_d20_L_b32_2 $D20 -- --window-pattern L
  ( cd /tmp/ref && with_fa4 bench 1 230 base_d20_L_b32_2 $D20 -- --window-pattern L ) ) &
( CUDA_VISIBLE_DEVICES=2 with_fa4 timeout 300 python3 -m dev.profile_train --depth 20 --window-pattern L --device-batch-size 32 \
    --grad-accum 8 --data-dir $NANOCHAT_DATA_DIR --active 1 --top 40 > $OUT/prof_new_d20.log 2>&1
  with_fa4 bench 2 200 new_d12_L_b128 $D12 -- --window-pattern L ) &
( ( cd /tmp/ref && with_fa4 bench 3 200 base_d12_L_b128 $D12 -- --window-pattern L )
  with_fa4 bench 3 230 new_d20_L_b64_rc $D20 --device-batch-size 64 -- --window-pattern L --recompute-act ) &
wait %2 %3 %4 %5
kill $CLOCK_LOG
cat $OUT/bench.csv
grep -v -i "warn\|Failed to load" $OUT/prof_new_d20.log | head -45
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
