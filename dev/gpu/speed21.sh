#!/bin/bash
# x4 call (session 7), one GPU per lane, all with FlashAttention-4 (.carry5): does fp8 pay at d20 on the attention
# projections (q/k/v/proj, 1280 x 1280: a third of the linear FLOPs, and four casts of inputs and gradients for
# it), or only on the MLP? A copy of the tree in /tmp/mlp8 has fp8.is_eligible also refuse `.attn.` modules.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
rm -rf /tmp/mlp8 && mkdir /tmp/mlp8 && cp -r nanochat scripts dev /tmp/mlp8/
sed -i 's/fqn.endswith("lm_head"):/fqn.endswith("lm_head") or ".attn." in fqn:/' /tmp/mlp8/nanochat/fp8.py
grep -q '".attn." in fqn' /tmp/mlp8/nanochat/fp8.py || { echo "patch failed"; exit 1; }
D20="--depth 20 --steps 12 --warmup 5"
( with_fa4 bench 0 200 d20_L_b32 $D20 -- --window-pattern L ) &
( with_fa4 bench 1 230 d20_fp8_b32 $D20 -- --window-pattern L --fp8 ) &
( cd /tmp/mlp8 && with_fa4 bench 2 230 d20_fp8mlp_b32 $D20 -- --window-pattern L --fp8 ) &
( cd /tmp/mlp8 && with_fa4 bench 3 230 d20_fp8mlp_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv; grep -h "converted" $OUT/*.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
