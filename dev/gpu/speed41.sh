#!/bin/bash
# single nvidia-h200 call (session 11): the d20 rows of the #5 table with fp8.Fp8MLP, on one GPU: fp8, bf16 L,
# fp8 with the fp8.py before (4cf5bed, .carry5/old/fp8.py: torchao's MLP); device batch 64, FA4.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
rm -rf /tmp/ref && mkdir /tmp/ref && cp -r nanochat scripts dev /tmp/ref/ && cp $CARRY/old/fp8.py /tmp/ref/nanochat/fp8.py
with_fa4 bench 0 220 d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8
with_fa4 bench 0 160 d20_L_b64 $D20 --device-batch-size 64 -- --window-pattern L
( cd /tmp/ref && with_fa4 bench 0 200 ref_d20_fp8_b64 $D20 --device-batch-size 64 -- --window-pattern L --fp8 )
cat $OUT/bench.csv
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
