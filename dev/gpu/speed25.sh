#!/bin/bash
# x4 call (session 8), one GPU per lane, with FlashAttention-4 (.carry5): bf16 with ReLU^2's output recomputed in
# the backward (a checkpointed region: torch.compile no longer keeps the (B, T, 4C) tensor for c_proj's weight
# gradient) against the tree without it (/tmp/old), at d20 batch 32 and 64 (bf16 at 64 ran out of memory before)
# and d12 batch 128. Two rounds; lanes 0 and 1 swap old and new between them. It ran on an uncommitted tree whose
# ReluSquare.forward was `return checkpoint(relu_square, x, use_reentrant=False)` (torch.utils.checkpoint); the
# committed --recompute-act replaced it, so the patch below no longer applies.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
patched_tree /tmp/old nanochat/gpt.py 's/return checkpoint(relu_square, x, use_reentrant=False)/return relu_square(x)/'
( cd /tmp/old && with_fa4 bench 0 230 d20_L_b32_old $D20 -- --window-pattern L
  cd - && with_fa4 bench 0 260 d20_L_b64_rc_2 $D20 --device-batch-size 64 -- --window-pattern L ) &
( with_fa4 bench 1 260 d20_L_b64_rc $D20 --device-batch-size 64 -- --window-pattern L
  cd /tmp/old && with_fa4 bench 1 230 d20_L_b32_old_2 $D20 -- --window-pattern L ) &
( with_fa4 bench 2 230 d20_L_b32_rc $D20 -- --window-pattern L
  with_fa4 bench 2 200 d12_L_b128_rc $D12 -- --window-pattern L ) &
( with_fa4 bench 3 260 d20_SSSL_b64_rc $D20 --device-batch-size 64 -- --window-pattern SSSL
  cd /tmp/old && with_fa4 bench 3 200 d12_L_b128_old $D12 -- --window-pattern L ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
