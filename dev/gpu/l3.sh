#!/bin/bash
# h200 call: L3 (#9) after the lookup rework, on the equal-steps configuration (d12, L, 65,536-token
# batches, 200 steps, one L3 layer after block 5, k_max 128): dense vs L3 at equal steps; a smaller table
# if L3 is under 80% of dense; then L3 at dense's wall time. Last, if time is left: fp8 vs bf16 curves (#5).
source "$(dirname "$0")/env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry4/whl/*.whl && export PYTHONPATH=/tmp/site
T0=$(date +%s)
T="python3 -m scripts.base_train --depth=12 --window-pattern=L --device-batch-size=32 --total-batch-size=65536 --eval-tokens=2097152 --eval-every=-1 --core-metric-every=-1 --sample-every=-1 --save-every=0"
summary() {  # NAME: median tok/s of steps >= 10, final val bpb, peak memory
python3 - "$OUT/$1.log" <<'PY'
import re, sys, statistics
text = open(sys.argv[1]).read()
tok = [float(m.group(2).replace(",", "")) for m in re.finditer(r"^step (\d+)/\d+ .*tok/sec: ([\d,]+)", text, re.M) if int(m.group(1)) >= 10]
bpb = re.findall(r"Validation bpb: ([\d.]+)", text)
mem = re.findall(r"peak memory: ([\d.]+) GiB", text)
print(f"{int(statistics.median(tok)) if tok else 0} {bpb[-1] if bpb else 'nan'} {mem[-1] if mem else 'nan'}")
PY
}
run() {  # NAME SECONDS ARGS...
    local name=$1 secs=$2; shift 2
    timeout -k 10 $secs $T --model-tag $name "$@" > $OUT/$name.log 2>&1
    echo "== $name (exit $?): tok/s, val bpb, peak GiB = $(summary $name)"; grep -E "^L3 rows|Error|Traceback" $OUT/$name.log | head -3
}
run dense 170 --num-iterations=200
run l3_k128 200 --num-iterations=200 --l3-after-layers 5 --l3-k-max 128
read dense_tok dense_bpb _ <<< "$(summary dense)"; read l3_tok l3_bpb _ <<< "$(summary l3_k128)"
best=l3_k128; best_tok=$l3_tok; best_args="--l3-after-layers 5 --l3-k-max 128"
if [ $((l3_tok * 10)) -lt $((dense_tok * 8)) ]; then
    run l3_k128_half 200 --num-iterations=200 --l3-after-layers 5 --l3-k-max 128 --l3-n-emb 262144
    read h_tok h_bpb _ <<< "$(summary l3_k128_half)"
    if [ $h_tok -gt $best_tok ]; then best=l3_k128_half; best_tok=$h_tok; best_args="$best_args --l3-n-emb 262144"; fi
fi
steps=$(( 200 * best_tok / dense_tok ))
echo "equal time: $best at $steps steps (tok/s ratio $best_tok / $dense_tok)"
run ${best}_equal_time 200 --num-iterations=$steps $best_args
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then run dense_fp8 150 --num-iterations=200 --fp8; fi
paste <(grep -E "^step 00([0-9]{2}0|199)/" $OUT/dense.log | cut -d'|' -f2) <(grep -E "^step 00([0-9]{2}0|199)/" $OUT/dense_fp8.log 2>/dev/null | cut -d'|' -f2) | head -25
