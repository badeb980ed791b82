#!/bin/bash
# x4 call (session 4), one GPU per lane: tied L3 with its lookup plans built on the CPU in the loader thread
# (l3.HostPlanner) against dense, in the equal-steps configuration; its profile; at the recipe's batch; and
# at dense's wall time (the step count computed from the first dense and L3 runs of this call).
# HostPlanner did not pay and was reverted (dev/LOG.md); the same commands now build the plan in the forward,
# the same computation.
source "$(dirname "$0")/env.sh"
source "$(dirname "$0")/equal_steps.sh"
L3="--l3-after-layers 5 --l3-tied"
train_s() {  # seconds of steps 1.. of a finished run's log
    python3 -c "import re,sys; print(sum(float(m) for s, m in re.findall(r'^step (\d+)/\d+ .*dt: ([\d.]+)ms', open(sys.argv[1]).read(), re.M) if int(s) >= 1) / 1000)" $1
}
( export CUDA_VISIBLE_DEVICES=0; for i in 7 8; do run dense_$i 185 --num-iterations=200; done ) &
( export CUDA_VISIBLE_DEVICES=1; for i in 7 8; do run l3_tied_$i 185 --num-iterations=200 $L3; done ) &
( export CUDA_VISIBLE_DEVICES=2
  timeout 200 python3 -m dev.profile_train --depth 12 --window-pattern L --device-batch-size 32 --grad-accum 1 --warmup 6 \
    --active 4 --data-dir $NANOCHAT_DATA_DIR $L3 > $OUT/prof_l3_host.log 2>&1; grep -v Warn $OUT/prof_l3_host.log | head -8
  for t in $(seq 150); do  # at most 300 s for both first runs to finish
      [ "$(grep -l "minimum validation bpb" $OUT/dense_7.log $OUT/l3_tied_7.log 2>/dev/null | wc -l)" = 2 ] && break
      sleep 2
  done
  d=$(train_s $OUT/dense_7.log); l=$(train_s $OUT/l3_tied_7.log)
  n=$(python3 -c "print(round(1 + 199 * $d / $l))"); echo "dense 199 steps ${d}s, tied L3 ${l}s -> equal time: $n steps"
  for i in 1 2; do run l3_tied_eqtime_h$i 185 --num-iterations=$n $L3; done ) &
( bench 3 170 d12_L_b32 --depth 12 --steps 16 --warmup 6 -- --window-pattern L
  bench 3 200 d12_L_b32_l3_tied --depth 12 --steps 16 --warmup 6 -- --window-pattern L $L3 ) &
wait
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
