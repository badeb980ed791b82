#!/bin/bash
# x4 call: the equal-steps quality run (d12, 200 steps of 65,536 tokens), twice with the Triton loss
# and twice with the loss torch.compile makes (a copy of the tree with the model's loss switched back),
# side by side: is the val bpb difference between the two losses larger than run-to-run noise?
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
rm -rf /tmp/old && mkdir /tmp/old && cp -r nanochat scripts dev /tmp/old/
sed -i 's/return softcap_cross_entropy(raw, targets, reduction, scratch=True)/return reference_loss(raw, targets, reduction)/; s/from nanochat.softcap_ce import softcap, softcap_cross_entropy/from nanochat.softcap_ce import softcap, softcap_cross_entropy, reference_loss/' /tmp/old/nanochat/gpt.py
grep -c "reference_loss(raw" /tmp/old/nanochat/gpt.py
( CUDA_VISIBLE_DEVICES=0 run quality_triton_2 240 --num-iterations=200 ) &
( CUDA_VISIBLE_DEVICES=1 run quality_triton_3 240 --num-iterations=200 ) &
( cd /tmp/old && CUDA_VISIBLE_DEVICES=2 run quality_compiled_2 240 --num-iterations=200 ) &
( cd /tmp/old && CUDA_VISIBLE_DEVICES=3 run quality_compiled_3 240 --num-iterations=200 ) &
wait
