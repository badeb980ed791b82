"""
Quality A/B at equal steps: the same short training run (TRAIN: d12, 200 steps of 65,536 tokens, window L,
val bpb on 2M tokens at the end) several times for each of two sides, printing every run's val bpb and each
side's median and spread, read from the runs' metrics.jsonl (dev/runs.py). A side is a checkout (--a-tree /
--b-tree: e.g. two git worktrees of two commits), environment settings (--a-env / --b-env, e.g.
NANOCHAT_KERNELS=reference to run every op on its PyTorch reference) and extra base_train flags (--a-args /
--b-args, e.g. "--fp8"). A runs go out over the given GPUs, one run per GPU at a time, and B run i follows A run i
on the same GPU (GPUs differ by 2-3%).

    python -m dev.quality_ab --b-env NANOCHAT_KERNELS=reference          # kernels against the reference math
    python -m dev.quality_ab --b-args=--fp8 --runs 3 --gpus 0,1,2,3    # bf16 against fp8
    python -m dev.quality_ab --a-tree ../nanochat-old --b-tree .         # two commits

Run i of each side takes seed 42 + i (paired across the sides), so the run-to-run spread holds the initialization's
as well as the GPU's non-determinism (atomics, split reductions): a difference between the sides must be compared
against it (keep every run: an occasional loss spike ends a run visibly higher).

Needs GPUs (CUDA_VISIBLE_DEVICES is set per run from --gpus), data and a tokenizer as base_train does (--data-dir
/ NANOCHAT_DATA_DIR: parquet shards, the last one validation; --base-dir / NANOCHAT_BASE_DIR). 200 x 65,536
tokens is ~13M tokens: with fewer training tokens than that the run repeats data; the epoch each run ended in is
printed beside its val bpb, with the median tok/s of its steps from step 11 on (at 65,536-token steps a rough
figure: compare ratios). A run that asked for --fp8 and fell back to bf16 counts as failed. A tree from before
metrics.jsonl is read from its printout (dev/runs.py). A GPU named twice in --gpus runs two at a time (compilation
overlaps; the tok/s are then of shared GPUs).

Sides that evaluate on different rows (another --max-seq-len packs and crops the validation documents otherwise)
are compared on the same bytes with --score "SCORE_BPB FLAGS": each run keeps its final checkpoint, which
dev/score_bpb.py scores on the validation shard (the last of the data) with those flags, e.g. "--min-chars=5000
--chars=5000" (the first 5,000 characters of every document that has them, one document a row); the checkpoint
is removed after. --score may be given several times (each its own table); the scorer's whole printout, with its
loss by position in the document, goes to the log folder beside the run's log. The bytes are the same for both
sides as long as no document is cut to fit a model's context (said per run where one is: documents longer than
the shorter context are compared by their loss at each position, in those printouts). Scoring runs beside the training
runs, on the GPU its run trained on.

    python -m dev.quality_ab --a-args=--window-pattern=SSSL --b-args "--window-pattern=SSSL --max-seq-len=8192 \
        --device-batch-size=8" --score "--min-chars=5000 --chars=5000" --gpus 0,0   # 8K against 2K, equal tokens

With --b-from-a-step N, side B does not start from scratch: each B run resumes its A run's checkpoint of step N
with B's flags and trains the steps after it. The sides then share everything before N (a paired comparison:
run i of B against run i of A differs only after N), e.g. a context extension for the last 40 of 200 steps:

    python -m dev.quality_ab --a-args=--window-pattern=SSSL --b-from-a-step 160 --b-args "--window-pattern=SSSL \
        --max-seq-len=8192 --device-batch-size=8" --score "--min-chars=5000 --chars=5000" --gpus 0,0
"""

import math
import os
import re
import sys
import shlex
import shutil
import statistics
import subprocess
import concurrent.futures

from dev import runs
from nanochat.common import fail

# the equal-steps configuration (dev/vs_upstream.py's steps part runs it too)
TRAIN = ["--depth=12", "--window-pattern=L", "--device-batch-size=32", "--total-batch-size=65536",
         "--num-iterations=200", "--eval-tokens=2097152"]


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    runs.add_side_args(parser)
    parser.add_argument("--b-from-a-step", type=int, default=-1, metavar="N",
                        help="each B run resumes its A run's checkpoint of step N with B's flags (-1: B runs from scratch)")
    parser.add_argument("--runs", type=int, default=4, help="runs per side")
    parser.add_argument("--num-iterations", type=int, default=int(runs.flag_value(TRAIN, "--num-iterations")),
                        help="training steps of each run")
    parser.add_argument("--gpus", type=str, default="0", help="comma-separated GPU indices; one run per index at a time "
                                                              "(an index named twice runs two)")
    parser.add_argument("--score", action="append", default=[], metavar="SCORE_BPB_FLAGS",
                        help="also score each run's final checkpoint with dev/score_bpb.py and these flags (repeatable)")
    runs.add_data_args(parser)
    parser.add_argument("--log-dir", type=str, default="quality_ab_logs", help="where each run's output goes")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds one run may take")
    args = parser.parse_args(argv)

    sides = {"A": runs.side_spec(args, "a"), "B": runs.side_spec(args, "b")}
    gpus = [g for g in args.gpus.split(",") if g]
    for s, spec in sides.items():
        print(f"side {s}: {spec['name']}")
    fork = args.b_from_a_step
    if fork != -1 and not 0 < fork < args.num_iterations:
        fail(f"--b-from-a-step {fork} must be a step inside the runs (1 to {args.num_iterations - 1})")
    saves = f"--save-every={fork}" if fork > 0 else "--save-every=" + ("-1" if args.score else "0")
    flags = [f for f in TRAIN if not f.startswith("--num-iterations=")] + \
        [f"--num-iterations={args.num_iterations}", "--eval-every=-1", saves] + runs.QUIET
    tok_from = {"A": runs.FIRST_TIMED_STEP, "B": runs.FIRST_TIMED_STEP + max(fork, 0)}

    # B run i after A run i on the same GPU (a forked one from A's step N)
    queue = [("A", i) for i in range(args.runs)]
    seq = {s: runs.flag_value(flags + spec["extra"], "--max-seq-len") for s, spec in sides.items()}
    scored = {s: runs.scored_tokens(flags + spec["extra"]) for s, spec in sides.items()}
    other_bytes = seq["A"] != seq["B"] or scored["A"] != scored["B"]
    tag = lambda s, i: runs.call_tag(args.log_dir, f"quality_ab_{s}{i}")
    results = {"A": [], "B": []}  # [val bpb, median tok/s, run index, scored bpbs (None where failed)]
    scoring = concurrent.futures.ThreadPoolExecutor(max_workers=len(gpus))  # beside the runs: each is one process

    def launch(task, gpus):
        s, i = task
        spec = sides[s]
        resume = [f"--resume-from-step={fork}"] if s == "B" and fork > 0 else []
        job = runs.start(flags + [f"--seed={42 + i}"] + spec["extra"] + resume, tag(s, i), tree=spec["tree"],
                         env={**runs.data_env(args), **spec["env"]}, gpus=gpus, timeout=args.timeout,
                         log=os.path.join(args.log_dir, f"{s}{i}.log"))
        print(f"== {s}{i} on GPU {gpus[0]}: {' '.join(job.cmd[1:])} (in {spec['tree']}; log {job.log_path})", flush=True)
        return job

    def finished(task, job, gpus):  # the run's result; after an A run, its B run on the same GPU
        s, i = task
        try:
            summary = runs.summary(job.run(), tok_from[s])
        except runs.RunFailed as e:
            print(f"   {s}{i}: failed: {e}", flush=True)
            return ("B", i) if s == "A" and fork == -1 else None
        if s == "A" and fork > 0:  # B's run i starts from this one's step N, in a folder of its own
            copy_step(runs.checkpoint_folder(side_env(args, sides["A"]), job.model_tag),
                      runs.checkpoint_folder(side_env(args, sides["B"]), tag("B", i)), fork)
        record(s, i, summary, job, gpus)
        return ("B", i) if s == "A" else None

    def record(s, i, summary, job, gpus):
        if summary["val_bpb"] is None:
            print(f"   {s}{i}: failed: no val bpb recorded (see {job.log_path})", flush=True)
            return
        tok = summary["tok_per_sec"]
        scored = scoring.submit(score, args, sides[s], job, gpus[0]) if args.score else None
        results[s].append([summary["val_bpb"], tok, i, scored])
        print(f"   {s}{i}: " + ("diverged, " if not math.isfinite(summary["val_bpb"]) else "") +
              f"val bpb {summary['val_bpb']:.6f} (epoch {summary['epoch']}), "
              f"{f'{tok:,.0f}' if tok else '?'} tok/s", flush=True)

    runs.run_queue(queue, gpus, launch, finished)
    for s in results:
        for r in results[s]:
            r[3] = r[3].result() if r[3] is not None else []
            if r[3]:
                print(f"   {s}{r[2]}: score_bpb bpb " + ", ".join(f"{v:.6f}" if v else "failed" for v in r[3]))

    measures = [(lambda r: r[0], "val bpb")] + [(lambda r, k=k: r[3][k], f"score_bpb bpb ({flags})")
                                                  for k, flags in enumerate(args.score)]
    if other_bytes:
        print(f"\n(val bpb of other tokens: --max-seq-len {seq['A']} and {seq['B']}, {scored['A']} and {scored['B']} "
              f"tokens scored; compare with --score)")
    kept = lambda v: v is not None and math.isfinite(v)  # a diverged run's NaN is counted, never averaged
    for column, what in measures:
        print(f"\n| side | runs | {what} (each run) | median | spread (min - max) | mean +- stdev | tok/s (median of runs) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for s, spec in sides.items():
            vals = [column(r) for r in sorted(results[s], key=lambda r: r[2]) if kept(column(r))]
            diverged = sum(column(r) is not None and not kept(column(r)) for r in results[s])
            count = runs.counted(len(vals), diverged)
            if not vals:
                print(f"| {s}: {spec['name']} | {count} | all failed or diverged | | | | |")
                continue
            toks = [r[1] for r in results[s] if r[1]]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            print(f"| {s}: {spec['name']} | {count} | {', '.join(f'{v:.4f}' for v in vals)} | "
                  f"{statistics.median(vals):.4f} | {min(vals):.4f} - {max(vals):.4f} | {statistics.mean(vals):.4f} +- "
                  f"{sd:.4f} | {f'{statistics.median(toks):,.0f}' if toks else ''} |")
        a = [column(r) for r in results["A"] if kept(column(r))]
        b = [column(r) for r in results["B"] if kept(column(r))]
        if a and b:
            # how often a B run is below an A run, over all pairs (0.5 = no difference; ties count half)
            wins = sum((y < x) + 0.5 * (y == x) for x in a for y in b) / (len(a) * len(b))
            print(f"\nB - A ({what}): median {statistics.median(b) - statistics.median(a):+.4f}; "
                  f"a B run is lower than an A run in {wins:.0%} of the {len(a) * len(b)} pairs")
        if fork > 0:  # B's run i continues A's run i: their difference is the effect, without the run-to-run spread
            by_run = {s: {r[2]: column(r) for r in results[s] if kept(column(r))} for s in ("A", "B")}
            pairs = [by_run["B"][i] - by_run["A"][i] for i in sorted(by_run["B"]) if i in by_run["A"]]
            if pairs:
                print(f"B run i - A run i ({what}): {', '.join(f'{d:+.4f}' for d in pairs)}; median "
                      f"{statistics.median(pairs):+.4f}")


def side_env(args, spec):
    """The environment of a side's processes (without its GPU)."""
    return {**os.environ, **runs.data_env(args), **spec["env"]}


def copy_step(src, dst, step):
    """Step `step`'s checkpoint files and the metrics up to it, from one run's folder into a new one."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    names = [n for n in os.listdir(src) if f"_{step:06d}" in n] + ["metrics.jsonl"]
    if not any(n.startswith("meta_") for n in names):
        fail(f"{src} holds no checkpoint of step {step} to continue from")
    for name in names:
        shutil.copy2(os.path.join(src, name), dst)


def score(args, spec, job, gpu):
    """The run's final checkpoint scored by dev/score_bpb.py with each --score's flags on the validation shard (the
    last of the data), then removed: [bpb, or None (the reason printed) where scoring failed]; each printout is
    kept in <log dir>/<run>.score<k>.txt."""
    env = {**side_env(args, spec), "CUDA_VISIBLE_DEVICES": str(gpu)}
    from nanochat.common import get_base_dir
    from nanochat.dataset import list_parquet_files, resolve_data_dir
    base_dir = env.get("NANOCHAT_BASE_DIR") or get_base_dir()
    ckpt = runs.checkpoint_folder(env, job.model_tag)
    val = list_parquet_files(resolve_data_dir(env.get("NANOCHAT_DATA_DIR"), quiet=True))[-1]
    cmd = [sys.executable, os.path.join(runs.REPO, "dev", "score_bpb.py"), "--harness", "ours", "--root", spec["tree"],
           "--checkpoint-dir", ckpt, "--tokenizer-dir", os.path.join(base_dir, "tokenizer"), "--val", val]
    scores = []
    for k, flags in enumerate(args.score):
        try:
            p = subprocess.run(cmd + shlex.split(flags), cwd=spec["tree"], env=env, capture_output=True, text=True,
                               timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"   scoring {job.model_tag} ({flags}) failed: not done in {args.timeout} s", flush=True)
            scores.append(None)
            continue
        with open(os.path.splitext(job.log_path)[0] + f".score{k}.txt", "w") as f:
            f.write(p.stdout + p.stderr)
        m = re.search(r"SCORE bpb=([\d.]+)", p.stdout)
        if p.returncode != 0 or not m:
            print(f"   scoring {job.model_tag} ({flags}) failed: {(p.stdout + p.stderr).strip().splitlines()[-3:]}",
                  flush=True)
        scores.append(float(m.group(1)) if p.returncode == 0 and m else None)
        cut = re.search(r"docs=(\d+) fitted=(\d+)", p.stdout)
        if cut and int(cut.group(2)):
            print(f"   {job.model_tag} ({flags}): {cut.group(2)} of {cut.group(1)} documents cut to its context", flush=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return scores


if __name__ == "__main__":
    main()
