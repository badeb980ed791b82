"""
The parallel table: throughput and memory per GPU of tensor and pipeline parallel layouts against the same
model on one GPU (dev/bench_train.py under torchrun, window L, one layout after another on GPUs 0..n-1).

  tensor parallel:   d32 (device batch 8) and d20 (device batch 16), 131,072-token steps:
                     one GPU, --tp 2, --tp 2 --sequence-parallel
  pipeline parallel: d26, micro-batches of 8 x 2048, m = micro-batches per step (4 or 16):
                     one GPU, --pp 2 and --pp 4 with the 1f1b and gpipe schedules;
                     ideal step = one-GPU step / p x (m + p - 1) / m (the bubble of p stages over m micro-batches)

    python -m dev.bench_parallel                      # every layout that fits the GPUs nvidia-smi lists
    python -m dev.bench_parallel --gpus 2 --only d20  # the d20 rows on two GPUs

Data and tokenizer: --data-dir / NANOCHAT_DATA_DIR and --base-dir / NANOCHAT_BASE_DIR, as for base_train.
A layout that runs out of memory (gpipe keeps all m micro-batches' activations) is reported as failed.
"""

import os
import csv
import sys
import argparse
import subprocess

C = ["--steps", "9", "--warmup", "4"]
# (name, group for the one-GPU baseline, nproc, bench_train flags, base_train flags)
LAYOUTS = []
for depth, dbs in ((32, 8), (20, 16)):
    base = ["--depth", str(depth), "--total-batch-size", "131072", "--device-batch-size", str(dbs)]
    LAYOUTS += [(f"d{depth} one GPU", f"d{depth}", 1, base, []),
                (f"d{depth} TP=2", f"d{depth}", 2, base, ["--tp", "2"]),
                (f"d{depth} TP=2 SP", f"d{depth}", 2, base, ["--tp", "2", "--sequence-parallel"])]
for m in (4, 16):
    base = ["--depth", "26", "--total-batch-size", str(8 * 2048 * m), "--device-batch-size", "8"]
    LAYOUTS.append((f"d26 m={m} one GPU", f"d26 m={m}", 1, base, []))
    for p in (2, 4):
        if p == 4 and m == 4:
            continue  # 4 micro-batches over 4 stages is mostly bubble
        for schedule in ("1f1b", "gpipe"):
            LAYOUTS.append((f"d26 m={m} PP={p} {schedule}", f"d26 m={m}", p, base,
                            ["--pp", str(p), "--pp-schedule", schedule]))

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all that nvidia-smi lists)")
parser.add_argument("--only", type=str, default="", help="run only the layouts whose name contains this, e.g. d20 or PP=4")
parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR)")
parser.add_argument("--base-dir", type=str, default=None, help="tokenizer and outputs (default: NANOCHAT_BASE_DIR)")
parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (compilation included)")
parser.add_argument("--out", type=str, default="bench_parallel.csv", help="CSV the runs append to")
args = parser.parse_args()

gpus = args.gpus
if gpus <= 0:
    try:
        gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.splitlines())
    except (OSError, subprocess.CalledProcessError):
        sys.exit("bench_parallel: nvidia-smi failed; pass the number of GPUs with --gpus N")
layouts = [l for l in LAYOUTS if args.only in l[0]]
skipped = [l[0] for l in layouts if l[2] > gpus]
layouts = [l for l in layouts if l[2] <= gpus]
if not layouts:
    sys.exit(f"bench_parallel: no layout matches --only {args.only!r} on {gpus} GPU(s)")
env = dict(os.environ, PYTHONUNBUFFERED="1")
for flag, var in ((args.data_dir, "NANOCHAT_DATA_DIR"), (args.base_dir, "NANOCHAT_BASE_DIR")):
    if flag:
        env[var] = os.path.abspath(flag)
out = os.path.abspath(args.out)
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

results = {}
for name, group, nproc, bench_flags, train_flags in layouts:
    cmd = [sys.executable, "-m", "dev.bench_train", "--nproc", str(nproc), "--label", name, "--out", out] + \
          bench_flags + C + ["--", "--window-pattern", "L"] + train_flags
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    run_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(nproc)))
    try:
        p = subprocess.run(cmd, cwd=root, env=run_env, timeout=args.timeout, capture_output=True, text=True)
        ok, tail = p.returncode == 0, (p.stdout + p.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        ok, tail = False, [f"timed out after {args.timeout} s"]
    if ok:
        with open(out, newline="") as f:
            results[name] = [r for r in csv.DictReader(f) if r["label"] == name][-1]
        r = results[name]
        print(f"   {r['tok/s (median)']} tok/s, step {r['step ms (median)']} ms, peak {r['peak mem GiB (max)']} GiB", flush=True)
    else:
        print("   failed: " + " / ".join(tail), flush=True)

print()
print("| layout | tok/s | vs one GPU | step | vs ideal | peak memory per GPU |")
print("| --- | --- | --- | --- | --- | --- |")
for name, group, nproc, _, train_flags in layouts:
    r = results.get(name)
    if r is None:
        print(f"| {name} | failed | | | | |")
        continue
    one = results.get(f"{group} one GPU")
    tok, step = float(r["tok/s (median)"]), float(r["step ms (median)"])
    vs_one = f"{tok / float(one['tok/s (median)']):.2f}x" if one and nproc > 1 else ""
    vs_ideal = ""
    if one and "--pp" in train_flags:
        p, m = nproc, int(group.split("m=")[1])
        ideal = float(one["step ms (median)"]) / p * (m + p - 1) / m
        vs_ideal = f"{step / ideal:.3f} (ideal {ideal:,.0f} ms)"
    mem = r["peak mem per rank"] or f"{r['peak mem GiB (max)']}"
    print(f"| {name} | {tok:,.0f} | {vs_one} | {step:,.1f} ms | {vs_ideal} | {mem} GiB |")
if skipped:
    print(f"\nnot run (more processes than the {gpus} GPU(s)): " + ", ".join(skipped))
print(f"(results appended to {out})")
