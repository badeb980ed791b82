# Sourced by l3.sh and l3b.sh: the equal-steps training command (d12, L, 65,536-token batches) and
# `run NAME SECONDS ARGS...`, which trains it into $OUT/NAME.log and prints its summary.
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
