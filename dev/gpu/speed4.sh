#!/bin/bash
# x4 call: the loss kernels outside the compiled graph (memory), d12 at device batch 128, and the
# equal-steps quality run with the Triton loss against the same run with the loss torch.compile makes
# (a copy of the tree with the model's loss switched back), side by side.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
D12="--depth 12 --steps 16 --warmup 6"
rm -rf /tmp/old && mkdir /tmp/old && cp -r nanochat scripts dev /tmp/old/
sed -i 's/return softcap_cross_entropy(raw, targets, reduction, scratch=True)/return reference_loss(raw, targets, reduction)/; s/from nanochat.softcap_ce import softcap, softcap_cross_entropy/from nanochat.softcap_ce import softcap, softcap_cross_entropy, reference_loss/' /tmp/old/nanochat/gpt.py
grep -c "reference_loss(raw" /tmp/old/nanochat/gpt.py
( CUDA_VISIBLE_DEVICES=0 run quality_triton_loss 240 --num-iterations=200 ) &
( cd /tmp/old && CUDA_VISIBLE_DEVICES=1 run quality_compiled_loss 240 --num-iterations=200 ) &
( bench 2 170 d12_L_b128 $D12 --device-batch-size 128 -- --window-pattern L
  bench 2 150 d12_L_b32 $D12 -- --window-pattern L ) &
( bench 3 170 d12_SSSL_b128 $D12 --device-batch-size 128 -- --window-pattern SSSL
  bench 3 200 d20_L_b32 --depth 20 --steps 12 --warmup 5 -- --window-pattern L ) &
wait
grep -h "val bpb" $OUT/quality_*.log | tail -4
cat $OUT/bench.csv
