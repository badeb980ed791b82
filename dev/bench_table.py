"""
The throughput table: tok/s, MFU and peak memory of base_train on one GPU for every combination of
depths x precisions x window patterns, at the recipe's 524,288-token steps (dev/bench_train.py, one run
after another on the same GPU). Given several trees (--tree, e.g. two git worktrees of two commits), each
configuration runs in each tree in turn, so that old and new are compared on the same GPU in the same call.

    python -m dev.bench_table                                   # d12 and d20, bf16 and fp8, windows L and SSSL
    python -m dev.bench_table --depths 20 --precisions bf16,fp8 --windows L --gpu 1
    python -m dev.bench_table --tree ../nanochat-old --tree .   # old against new, same GPU
    NANOCHAT_KERNELS=reference python -m dev.bench_table        # every op on its PyTorch reference

Data and tokenizer: --data-dir / NANOCHAT_DATA_DIR (a folder of parquet shards; the last is validation)
and --base-dir / NANOCHAT_BASE_DIR (where the tokenizer is, from `python -m scripts.tok_train`).
fp8 needs torchao and an SM89+ GPU; FlashAttention-4 is used where installed (`pip install -e ".[fa4]"`).
The device batch sizes are the ones that fit a 141 GB H200 (d20 at 64); lower them on smaller GPUs.
"""

import os
import csv
import sys
import argparse
import subprocess

# steps and warm-up per depth: compilation takes the first steps; the medians are over the rest
STEPS = {12: (16, 6), 20: (12, 5)}
DEVICE_BATCH = {12: 128, 20: 64}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--depths", type=str, default="12,20", help="comma-separated depths")
parser.add_argument("--precisions", type=str, default="bf16,fp8", help="comma-separated, from bf16 and fp8")
parser.add_argument("--windows", type=str, default="L,SSSL", help="comma-separated --window-pattern values")
parser.add_argument("--device-batch-size", type=str, default="",
                    help="per depth, e.g. 12=128,20=64 (default: " + ",".join(f"{d}={b}" for d, b in DEVICE_BATCH.items()) +
                         "; depths not listed use 32)")
parser.add_argument("--steps", type=int, default=0, help="steps per run (default: 16 at d12, 12 otherwise)")
parser.add_argument("--warmup", type=int, default=0, help="steps left out of the medians (default: 6 at d12, 5 otherwise)")
parser.add_argument("--tree", action="append", default=[],
                    help="a checkout to run the benchmark in (repeatable; default: this one). Each tree runs its own "
                         "dev/bench_train.py and scripts/base_train.py")
parser.add_argument("--gpu", type=str, default="0", help="the GPU to run on (CUDA_VISIBLE_DEVICES)")
parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR)")
parser.add_argument("--base-dir", type=str, default=None, help="tokenizer and outputs (default: NANOCHAT_BASE_DIR)")
parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (compilation included)")
parser.add_argument("--out", type=str, default="bench_table.csv", help="CSV the runs append to")
args = parser.parse_args()


def fail(msg):
    sys.exit(f"bench_table: {msg}")


depths = [int(d) for d in args.depths.split(",") if d]
precisions = [p for p in args.precisions.split(",") if p]
windows = [w for w in args.windows.split(",") if w]
if any(p not in ("bf16", "fp8") for p in precisions):
    fail(f"--precisions {args.precisions!r}: use bf16 and/or fp8")
batch = dict(DEVICE_BATCH)
for item in filter(None, args.device_batch_size.split(",")):
    d, _, b = item.partition("=")
    if not (d.isdigit() and b.isdigit()):
        fail(f"--device-batch-size {args.device_batch_size!r}: expected DEPTH=BATCH pairs, e.g. 12=128,20=64")
    batch[int(d)] = int(b)
trees = [os.path.abspath(t) for t in (args.tree or ["."])]
for t in trees:
    if not os.path.exists(os.path.join(t, "dev", "bench_train.py")):
        fail(f"--tree {t}: no dev/bench_train.py there (give the root of a nanochat checkout)")
env = dict(os.environ, CUDA_VISIBLE_DEVICES=args.gpu, PYTHONUNBUFFERED="1")
for flag, var in ((args.data_dir, "NANOCHAT_DATA_DIR"), (args.base_dir, "NANOCHAT_BASE_DIR")):
    if flag:
        env[var] = os.path.abspath(flag)
out = os.path.abspath(args.out)

rows = []  # (tree, depth, precision, window, result dict or None)
for depth in depths:
    steps, warmup = STEPS.get(depth, STEPS[20])
    steps, warmup = args.steps or steps, args.warmup or warmup
    for window in windows:
        for precision in precisions:
            for tree in trees:
                label = f"{os.path.basename(tree)} d{depth} {precision} {window} b{batch.get(depth, 32)}"
                cmd = [sys.executable, "-m", "dev.bench_train", "--depth", str(depth), "--steps", str(steps),
                       "--warmup", str(warmup), "--device-batch-size", str(batch.get(depth, 32)),
                       "--label", label, "--out", out, "--", "--window-pattern", window]
                cmd += ["--fp8"] if precision == "fp8" else []
                print(f"== {label}: {' '.join(cmd[1:])}", flush=True)
                try:
                    p = subprocess.run(cmd, cwd=tree, env=env, timeout=args.timeout, capture_output=True, text=True)
                    ok = p.returncode == 0
                    tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
                    if precision == "fp8" and "continuing without fp8" in p.stdout:  # base_train fell back to bf16
                        ok, tail = False, [l for l in p.stdout.splitlines() if "continuing without fp8" in l]
                except subprocess.TimeoutExpired:
                    ok, tail = False, [f"timed out after {args.timeout} s"]
                result = None
                if ok:
                    with open(out, newline="") as f:
                        result = [r for r in csv.DictReader(f) if r["label"] == label][-1]
                    print(f"   {result['tok/s (median)']} tok/s, MFU {result['mfu % (median)']}%, "
                          f"{result['peak mem GiB (max)']} GiB", flush=True)
                else:
                    print("   failed: " + " / ".join(tail), flush=True)
                rows.append((tree, depth, precision, window, result))

# the table: fp8 as a ratio of bf16 at the same depth, window, batch and tree
bf16 = {(t, d, w): float(r["tok/s (median)"]) for t, d, p, w, r in rows if r and p == "bf16"}
print()
print("| tree | model | precision | window | device batch | tok/s | MFU | peak memory |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for tree, depth, precision, window, r in rows:
    name = os.path.basename(tree)
    if r is None:
        print(f"| {name} | d{depth} | {precision} | {window} | {batch.get(depth, 32)} | failed | | |")
        continue
    tok = float(r["tok/s (median)"])
    ratio = f" ({tok / bf16[(tree, depth, window)]:.3f}x)" if precision == "fp8" and (tree, depth, window) in bf16 else ""
    mfu = f"{float(r['mfu % (median)']):.1f}%" + ("*" if precision == "fp8" else "") if r["mfu % (median)"] else ""
    print(f"| {name} | d{depth} | {precision} | {window} | {batch.get(depth, 32)} | {tok:,.0f}{ratio} | {mfu} | "
          f"{r['peak mem GiB (max)']} GiB |")
if "fp8" in precisions:
    print("\n* MFU against the bf16 peak; fp8 ratios against bf16 at the same depth, window and device batch.")
print(f"(results appended to {out})")
