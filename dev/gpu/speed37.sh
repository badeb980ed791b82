#!/bin/bash
# single nvidia-h200 call (session 10): the model, fused-MLP and fp8 tests on the GPU, where the CUDA-only ones run
# (the fused MLP in bf16 against the module path; the fp8 cast kernel bit for bit), FA4 on the path.
CARRY=.carry5
source "$(dirname "$0")/env.sh"
fa4_site
fp8_wheels
with_fa4 timeout 400 python3 -m pytest -q -rs tests/test_relu_square_mm.py tests/test_model.py tests/test_fp8.py \
    tests/test_flash_attention.py -p no:warnings > $OUT/pytest.log 2>&1
tail -8 $OUT/pytest.log
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
