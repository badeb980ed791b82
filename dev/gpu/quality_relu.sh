#!/bin/bash
# single nvidia-h200 call (session 9): the equal-steps quality run (d12 L, 200 steps of 65,536 tokens, the real
# shards of .carry4; cuDNN attention, no FA4 on this carry) with ReLU^2 keeping only its output, then with ReLU^2
# patched back to plain autograd (/tmp/ref), on the same GPU.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
patched_tree /tmp/ref nanochat/gpt.py 's/return _ReluSquare.apply(h)/return F.relu(h).square()/'
run new 280 --num-iterations=200
( cd /tmp/ref && run ref 280 --num-iterations=200 )
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
