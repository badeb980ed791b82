#!/bin/bash
# x4 call (session 10), one GPU per lane: the equal-steps quality run (d12 L, 200 steps of 65,536 tokens, the real
# shards of .carry4; cuDNN attention, no FA4 on this carry) with the MLP's ReLU^2 inside its products
# (relu_square_mm.py) on lanes 0 and 2, and with the module path (/tmp/ref) on lanes 1 and 3.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
patched_tree /tmp/ref nanochat/gpt.py 's/if self.fused_kernels_take(x):/if False:/'
( CUDA_VISIBLE_DEVICES=0 run new 290 --num-iterations=200 ) &
( cd /tmp/ref && CUDA_VISIBLE_DEVICES=1 run ref 290 --num-iterations=200 ) &
( CUDA_VISIBLE_DEVICES=2 run new_2 290 --num-iterations=200 ) &
( cd /tmp/ref && CUDA_VISIBLE_DEVICES=3 run ref_2 290 --num-iterations=200 ) &
wait
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
