"""
Training throughput benchmark: runs scripts.base_train for a fixed number of steps (no evaluation,
sampling or checkpoints) and reports what users compare: tok/s, MFU, step time and peak memory,
taken as medians over the steps after warm-up (the first steps include compilation).

    python -m dev.bench_train --depth 12 --steps 30 --warmup 10 -- --window-pattern L
    python -m dev.bench_train --nproc 2 --depth 20 -- --tp 2

Everything after `--` is passed to base_train. One line of results is appended to --out (CSV).
"""

import os
import re
import sys
import csv
import time
import argparse
import statistics
import subprocess

parser = argparse.ArgumentParser(description="Benchmark base_train throughput")
parser.add_argument("--depth", type=int, default=12)
parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run")
parser.add_argument("--warmup", type=int, default=10, help="steps excluded from the statistics")
parser.add_argument("--total-batch-size", type=int, default=524288)
parser.add_argument("--device-batch-size", type=int, default=32)
parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun) ")
parser.add_argument("--label", type=str, default="", help="name of this configuration in the results")
parser.add_argument("--out", type=str, default="bench_results.csv", help="CSV to append the result to")
args, extra = parser.parse_known_args()
extra = [a for a in extra if a != "--"]

cmd = ["-m", "scripts.base_train", f"--depth={args.depth}", f"--num-iterations={args.steps}",
       f"--total-batch-size={args.total_batch_size}", f"--device-batch-size={args.device_batch_size}",
       "--eval-tokens=0", "--core-metric-every=-1", "--sample-every=-1", "--save-every=0", "--model-tag=bench"] + extra
if args.nproc > 1:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"] + cmd
else:
    cmd = [sys.executable] + cmd
print(" ".join(cmd), flush=True)
t0 = time.time()
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
lines = []
for line in proc.stdout:
    sys.stdout.write(line)
    lines.append(line)
proc.wait()
wall = time.time() - t0
if proc.returncode != 0:
    raise SystemExit(f"base_train failed with exit code {proc.returncode}")

steps = []
for line in lines:
    m = re.match(r"^step (\d+)/\d+ .*\| dt: ([\d.]+)ms \| tok/sec: ([\d,]+)(?: \| mfu: ([\d.]+))?", line)
    if m:
        steps.append((int(m.group(1)), float(m.group(2)), float(m.group(3).replace(",", "")), float(m.group(4)) if m.group(4) else None))
timed = [s for s in steps if s[0] >= args.warmup]
if not timed:
    raise SystemExit(f"no steps after the {args.warmup} warm-up steps were logged")
dt = statistics.median(s[1] for s in timed)
tok = statistics.median(s[2] for s in timed)
mfus = [s[3] for s in timed if s[3] is not None]
mfu = statistics.median(mfus) if mfus else None
# one process prints its peak memory once; several print one line each, tagged with their place in the grid
per_rank = re.findall(r"^(\[[^\]]*\]) peak memory: ([\d.]+) GiB", "".join(lines), re.M)
single = re.search(r"peak memory: ([\d.]+) GiB", "".join(lines))
mems = {tag: float(v) for tag, v in per_rank} or ({"": float(single.group(1))} if single else {})
result = {"label": args.label or f"d{args.depth} {' '.join(extra)}".strip(), "depth": args.depth, "nproc": args.nproc,
          "batch": args.total_batch_size, "steps timed": len(timed), "step ms (median)": round(dt, 2),
          "tok/s (median)": round(tok), "mfu % (median)": round(mfu, 2) if mfu else "", "peak mem GiB (max)": max(mems.values()) if mems else "",
          "peak mem per rank": " ".join(f"{t}{v}" for t, v in sorted(mems.items())) if len(mems) > 1 else "",
          "wall s": round(wall, 1), "args": " ".join(extra)}
print("RESULT " + " | ".join(f"{k}: {v}" for k, v in result.items()), flush=True)
new = not os.path.exists(args.out)
with open(args.out, "a", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(result))
    if new:
        w.writeheader()
    w.writerow(result)
