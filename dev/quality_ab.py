"""
Quality A/B at equal steps: the same short d12 training run (200 steps of 65,536 tokens, window L, val bpb
on 2M tokens at the end) several times for each of two sides, printing every run's val bpb and each
side's median and spread. A side is a checkout (--a-tree / --b-tree: e.g. two git worktrees of two
commits), environment settings (--a-env / --b-env, e.g. NANOCHAT_KERNELS=reference to run every op on its
PyTorch reference) and extra base_train flags (--a-args / --b-args, e.g. "--fp8"). Runs alternate
A, B, A, B, ... over the given GPUs, one run per GPU at a time.

    python -m dev.quality_ab --b-env NANOCHAT_KERNELS=reference          # kernels against the reference math
    python -m dev.quality_ab --b-args "--fp8" --runs 3 --gpus 0,1,2,3    # bf16 against fp8
    python -m dev.quality_ab --a-tree ../nanochat-old --b-tree .         # two commits

base_train seeds its initialization the same way every run; on a GPU, non-deterministic kernels (atomics,
split reductions) make repeated runs differ anyway, and that run-to-run spread is what a difference
between the sides must be compared against (at this setting, ~0.01-0.02 in val bpb, with occasional loss
spikes near step 100 that end ~0.05-0.1 higher: keep every run).

Data and tokenizer: --data-dir / NANOCHAT_DATA_DIR (parquet shards, the last one is validation) and
--base-dir / NANOCHAT_BASE_DIR (the tokenizer). 200 x 65,536 tokens is ~13M tokens: with fewer training
tokens than that the run repeats data; the epoch each run ended in is printed beside its val bpb, with
the median tok/s of its steps from step 10 on (at 65,536-token steps a rough figure: compare ratios).
"""

import os
import re
import sys
import time
import shlex
import argparse
import statistics
import subprocess

TRAIN = ["--depth=12", "--window-pattern=L", "--device-batch-size=32", "--total-batch-size=65536",
         "--eval-tokens=2097152", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--save-every=0"]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
for side in ("a", "b"):
    parser.add_argument(f"--{side}-tree", type=str, default=".", help=f"side {side.upper()}: checkout to run in (default: this one)")
    parser.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                        help=f"side {side.upper()}: an environment setting (repeatable)")
    parser.add_argument(f"--{side}-args", type=str, default="", help=f"side {side.upper()}: extra base_train flags, one string")
parser.add_argument("--runs", type=int, default=4, help="runs per side")
parser.add_argument("--num-iterations", type=int, default=200, help="training steps of each run")
parser.add_argument("--gpus", type=str, default="0", help="comma-separated GPU indices; one run per GPU at a time")
parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR)")
parser.add_argument("--base-dir", type=str, default=None, help="tokenizer and outputs (default: NANOCHAT_BASE_DIR)")
parser.add_argument("--log-dir", type=str, default="quality_ab_logs", help="where each run's output goes")
parser.add_argument("--timeout", type=int, default=1200, help="seconds one run may take")
args = parser.parse_args()


def fail(msg):
    sys.exit(f"quality_ab: {msg}")


def side_spec(side):
    tree = os.path.abspath(getattr(args, f"{side}_tree"))
    if not os.path.exists(os.path.join(tree, "scripts", "base_train.py")):
        fail(f"--{side}-tree {tree}: no scripts/base_train.py there (give the root of a nanochat checkout)")
    env = {}
    for item in getattr(args, f"{side}_env"):
        key, eq, value = item.partition("=")
        if not eq or not key:
            fail(f"--{side}-env {item!r}: expected KEY=VALUE")
        env[key] = value
    extra = shlex.split(getattr(args, f"{side}_args"))
    name = " ".join([os.path.basename(tree)] + [f"{k}={v}" for k, v in env.items()] + extra)
    return dict(tree=tree, env=env, extra=extra, name=name)


sides = {"A": side_spec("a"), "B": side_spec("b")}
gpus = [g for g in args.gpus.split(",") if g]
base_env = dict(os.environ, PYTHONUNBUFFERED="1")
for flag, var in ((args.data_dir, "NANOCHAT_DATA_DIR"), (args.base_dir, "NANOCHAT_BASE_DIR")):
    if flag:
        base_env[var] = os.path.abspath(flag)
os.makedirs(args.log_dir, exist_ok=True)
for s, spec in sides.items():
    print(f"side {s}: {spec['name']}")

queue = [(s, i) for i in range(args.runs) for s in ("A", "B")]  # alternate, so that drift hits both sides alike
running = {}  # gpu -> (side, run index, process, log file, start time)
results = {"A": [], "B": []}  # (val bpb, median tok/s, run index)


def start(gpu, s, i):
    spec = sides[s]
    log_path = os.path.abspath(os.path.join(args.log_dir, f"{s}{i}.log"))
    cmd = [sys.executable, "-m", "scripts.base_train"] + TRAIN + [f"--num-iterations={args.num_iterations}",
                                                                   f"--model-tag=quality_ab_{s}{i}"] + spec["extra"]
    env = {**base_env, **spec["env"], "CUDA_VISIBLE_DEVICES": gpu}
    print(f"== {s}{i} on GPU {gpu}: {' '.join(cmd[1:])} (in {spec['tree']}; log {log_path})", flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=spec["tree"], env=env, stdout=log, stderr=subprocess.STDOUT)
    running[gpu] = (s, i, proc, log, time.time())


def finish(gpu):
    s, i, proc, log, _ = running.pop(gpu)
    log.close()
    text = open(log.name).read()
    bpb = re.findall(r"^Validation bpb: ([\d.]+)", text, re.M)
    epoch = re.findall(r"^step \d+/\d+ .*\| epoch: (\d+)", text, re.M)
    # tok/s of the steps after compilation (step 10 on); at 65,536-token steps a rough figure, for ratios only
    tok = [float(t.replace(",", "")) for n, t in re.findall(r"^step (\d+)/\d+ .*\| tok/sec: ([\d,]+)", text, re.M) if int(n) >= 10]
    if proc.returncode != 0 or not bpb:
        print(f"   {s}{i}: failed (exit {proc.returncode}); see {log.name}", flush=True)
        return
    if "continuing without fp8" in text:  # --fp8 asked for, but base_train fell back to bf16: not this side's setting
        print(f"   {s}{i}: failed: --fp8 fell back to bf16 (see {log.name})", flush=True)
        return
    tok_s = statistics.median(tok) if tok else None
    results[s].append((float(bpb[-1]), tok_s, i))
    print(f"   {s}{i}: val bpb {bpb[-1]} (epoch {epoch[-1] if epoch else '?'}), "
          f"{f'{tok_s:,.0f}' if tok_s else '?'} tok/s", flush=True)


def median_tok(s):
    toks = [t for _, t, _ in results[s] if t]
    return f"{statistics.median(toks):,.0f}" if toks else ""


while queue or running:
    for gpu in gpus:
        if gpu not in running and queue:
            start(gpu, *queue.pop(0))
    time.sleep(5)
    for gpu in list(running):
        s, i, proc, log, t0 = running[gpu]
        if proc.poll() is None and time.time() - t0 > args.timeout:
            proc.kill()
            proc.wait()
        if proc.poll() is not None:
            finish(gpu)

print()
print("| side | runs | val bpb (each run) | median | spread (min - max) | mean +- stdev | tok/s (median of runs) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for s, spec in sides.items():
    vals = [v for v, _, _ in sorted(results[s], key=lambda r: r[2])]
    if not vals:
        print(f"| {s}: {spec['name']} | 0 | all failed | | | | |")
        continue
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    print(f"| {s}: {spec['name']} | {len(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | {statistics.median(vals):.4f} | "
          f"{min(vals):.4f} - {max(vals):.4f} | {statistics.mean(vals):.4f} +- {sd:.4f} | {median_tok(s)} |")
if results["A"] and results["B"]:
    a, b = [v for v, _, _ in results["A"]], [v for v, _, _ in results["B"]]
    # how often a B run is below an A run, over all pairs (0.5 = no difference; ties count half)
    wins = sum((y < x) + 0.5 * (y == x) for x in a for y in b) / (len(a) * len(b))
    print(f"\nB - A: median {statistics.median(b) - statistics.median(a):+.4f}; "
          f"a B run is lower than an A run in {wins:.0%} of the {len(a) * len(b)} pairs")
