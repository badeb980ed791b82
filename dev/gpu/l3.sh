#!/bin/bash
# h200 call: L3 (#9) after the lookup rework, on the equal-steps configuration (d12, L, 65,536-token
# batches, 200 steps, one L3 layer after block 5, k_max 128): dense vs L3 at equal steps; a smaller table
# if L3 is under 80% of dense; then L3 at dense's wall time. Last, if time is left: fp8 vs bf16 curves (#5).
source "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry4/whl/*.whl && export PYTHONPATH=/tmp/site
T0=$(date +%s)
source "$(dirname "$0")/equal_steps.sh"
run dense 170 --num-iterations=200
run l3_k128 200 --num-iterations=200 --l3-after-layers 5 --l3-tied 0 --l3-k-max 128
read dense_tok dense_bpb _ <<< "$(summary dense)"; read l3_tok l3_bpb _ <<< "$(summary l3_k128)"
best=l3_k128; best_tok=$l3_tok; best_args="--l3-after-layers 5 --l3-tied 0 --l3-k-max 128"
if [ $((l3_tok * 10)) -lt $((dense_tok * 8)) ]; then
    run l3_k128_half 200 --num-iterations=200 --l3-after-layers 5 --l3-tied 0 --l3-k-max 128 --l3-n-emb 262144
    read h_tok h_bpb _ <<< "$(summary l3_k128_half)"
    if [ $h_tok -gt $best_tok ]; then best=l3_k128_half; best_tok=$h_tok; best_args="$best_args --l3-n-emb 262144"; fi
fi
steps=$(( 200 * best_tok / dense_tok ))
echo "equal time: $best at $steps steps (tok/s ratio $best_tok / $dense_tok)"
run ${best}_equal_time 200 --num-iterations=$steps $best_args
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then run dense_fp8 150 --num-iterations=200 --fp8; fi
paste <(grep -E "^step 00([0-9]{2}0|199)/" $OUT/dense.log | cut -d'|' -f2) <(grep -E "^step 00([0-9]{2}0|199)/" $OUT/dense_fp8.log 2>/dev/null | cut -d'|' -f2) | head -25
