#!/bin/bash
# single nvidia-h200 call (session 11), a second machine: d20 b64 bf16 L then fp8 with fp8.Fp8MLP (the order of
# speed41.sh swapped), then the fp8 and fused-MLP tests on the GPU; FA4.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
with_fa4 bench 0 160 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
with_fa4 bench 0 220 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
with_fa4 timeout 100 python3 -m pytest -q -rs tests/test_fp8.py tests/test_relu_square_mm.py -p no:warnings > $OUT/pytest.log 2>&1
tail -4 $OUT/pytest.log
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
