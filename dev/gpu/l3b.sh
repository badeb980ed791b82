#!/bin/bash
# h200 call: the dense equal-steps run again (run-to-run noise of val bpb and the loss curve), and L3 with
# k_max 512 (the full default table) on the same configuration as l3.sh
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
run dense_rerun 170 --num-iterations=200
run l3_k512 220 --num-iterations=200 --l3-after-layers 5 --l3-tied 0
grep -E "^step 00([0-9]{2}0|199)/" $OUT/dense_rerun.log | cut -d'|' -f2 | tr '\n' ' '
