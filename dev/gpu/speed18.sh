#!/bin/bash
# x4 call (session 7), first of two back to back on one machine (speed19.sh is the second): carries the wiki shards
# of .carry4 and leaves them in /tmp/qdata for speed19.sh, whose carry (flash-attn-4) leaves no room for them
# under the 64 MiB a call. Lanes 0-1: the equal-steps run (d12 L, 200 steps of 65,536 tokens) without FA4 (cuDNN);
# lanes 2-3: d20 fp8 L at device batch 32 and 64 (fp8's smaller activations fit 64; bf16 at 32 uses 78.7 GiB).
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
fp8_wheels
rm -rf /tmp/qdata && cp -r .carry4/data /tmp/qdata
D20="--depth 20 --steps 12 --warmup 5"
( export CUDA_VISIBLE_DEVICES=0; run cudnn_0 240 --num-iterations=200 ) &
( export CUDA_VISIBLE_DEVICES=1; run cudnn_1 240 --num-iterations=200 ) &
( bench 2 280 d20_fp8_b32_cudnn $D20 -- --window-pattern L --fp8 ) &
( bench 3 280 d20_fp8_b64_cudnn $D20 --device-batch-size 64 -- --window-pattern L --fp8 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
