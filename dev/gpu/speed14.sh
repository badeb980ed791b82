#!/bin/bash
# x4 call (session 6): more equal-steps runs (d12 L, 200 steps of 65,536 tokens), the final code on two lanes and
# the tree before this session (.carry4/old, commit 2e89d52) on the other two, three runs per lane: speed13.sh's
# new runs spiked more often (val bpb 1.5526 and 1.5419 among five) than any run before.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
old_tree
lane() {  # GPU TREE PREFIX
    export CUDA_VISIBLE_DEVICES=$1; cd $2
    for i in 1 2 3; do run $3_$1_$i 200 --num-iterations=200; done
}
lane 0 . new & lane 1 . new & lane 2 /tmp/old old & lane 3 /tmp/old old &
wait
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
