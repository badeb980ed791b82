#!/bin/bash
# x4 call (session 8), one GPU per lane, all with FlashAttention-4 (.carry5): the README table with this session's
# fp8 (ReLU^2 casting c_fc's gradient, fast accumulation in the backward matmuls), in two rounds. Lane 2's second
# run is fp8 as session 7 left it (a copy of the tree in /tmp/old with both changes patched out), on the same GPU
# as its first: what the two bought.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
patched_tree /tmp/old nanochat/fp8.py 's/if recipe == "tensorwise" and isinstance(mlp, MLP)/if False and isinstance(mlp, MLP)/; s/^    if recipe == "tensorwise":$/    if False:/'
( with_fa4 bench 0 230 d20_L_b32 $D20 -- --window-pattern L
  with_fa4 bench 0 200 d12_L_b128 $D12 -- --window-pattern L ) &
( with_fa4 bench 1 230 d20_SSSL_b32 $D20 -- --window-pattern SSSL
  with_fa4 bench 1 200 d12_SSSL_b128 $D12 -- --window-pattern SSSL ) &
( with_fa4 bench 2 260 d20_fp8_b32 $D20 -- --window-pattern L --fp8
  cd /tmp/old && with_fa4 bench 2 260 d20_fp8_s7_b32 $D20 -- --window-pattern L --fp8 ) &
( with_fa4 bench 3 260 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
  with_fa4 bench 3 200 d12_fp8_b128 $D12 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv; grep -h "converted" $OUT/*.log | sort | uniq -c
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
