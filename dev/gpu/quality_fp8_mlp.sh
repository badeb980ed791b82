#!/bin/bash
# single nvidia-h200 call (session 11): the equal-steps quality run (d12 L, 200 steps of 65,536 tokens, the real
# shards of .carry4; cuDNN attention) in fp8 with fp8.Fp8MLP, in bf16, and in fp8 with the fp8.py before
# (4cf5bed, carried as .carry4/old_fp8.py: torchao's Float8Linear MLP), one after another on one GPU.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
fp8_wheels
rm -rf /tmp/ref && mkdir /tmp/ref && cp -r nanochat scripts dev /tmp/ref/ && cp $CARRY/old_fp8.py /tmp/ref/nanochat/fp8.py
run fp8 200 --num-iterations=200 --fp8
run bf16 200 --num-iterations=200
( cd /tmp/ref && run ref_fp8 200 --num-iterations=200 --fp8 )
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
