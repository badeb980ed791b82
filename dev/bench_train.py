r"""
Training throughput: scripts.base_train for a few steps per configuration (no evaluation, samples or
checkpoints), in each tree; tok/s, MFU, step time and peak memory, each the median over the steps after warm-up
(the first steps compile) of what the run recorded in its metrics.jsonl (dev/runs.py). Rows are
configurations, columns trees: with several --tree (e.g. two git worktrees, old and new), every configuration
runs in each tree, so that they are compared on the same GPUs in the same call. Beside each measured peak stands
what scripts.plan predicts for the run's flags (its worst rank; nanochat/memory.py).

The configurations, one set per call:
  default     depths x precisions (bf16, fp8) x window patterns on one GPU, 524,288-token steps, one run at a
              time on the first GPU; fp8 also as a ratio of bf16 at the same depth, window and device batch
  --parallel  every parallel dimension against its baseline on a host of n = 2 or 4 GPUs (4 where --gpus has
              four or more), window L unless named; runs that fit side by side run at once on free GPUs (with
              several trees, a configuration's runs follow each other on the same GPUs):
                DP, TP  d20 (device batch 32, 524,288-token steps): one GPU, DP 2 and n, TP 2 x DP n/2 (against
                        DP n)
                TP      d32 (device batch 8, 131,072-token steps): one GPU, TP 2
                ZeRO-3  d32 (262,144-token steps): DP n, DP n --shard-params, TP 2 x DP n/2 (against DP n)
                PP      d26, micro-batches of 8 x 2048, m = 16: one GPU, PP n 1F1B and interleaved (V=2);
                        ideal step = one-GPU step / p x (m + (p - 1) / V) / m (the bubble of p stages over m
                        micro-batches, V chunks a rank);
                        simulated step = dev.pipeline_sim's (messages queued as NCCL runs them) from block times
                        it measures on a free GPU meanwhile (compiled, 240 GB/s a message; compute stretched as
                        in training, pipeline_sim's defaults)
                CP      32,768-token sequences, SSSL: d12 (device batch 4, 262,144-token steps) at CP 2 and n, d20
                        (2, 131,072) at CP n, against one GPU
              Every row also gives how far its losses strayed from its baseline's, step by step (the largest
              relative difference) where both have one DP size: they train on the same batches, so only float
              order separates them (the loader deals row groups out by DP rank: DP n against one GPU, or TP 2 x DP
              n/2 against DP n, train on other batches, and say so).

    python -m dev.bench_train                                   # d12 and d20, bf16 and fp8, windows L and SSSL
    python -m dev.bench_train --depths 20 --precisions bf16,fp8 --windows L --gpus 1
    python -m dev.bench_train --tree ../nanochat-old --tree .   # old against new, same GPU
    python -m dev.bench_train --depths 12 --precisions bf16 --windows L --device-batch-size 12=32 \
        --steps 30 --warmup 10 -- --l3-after-layers 5           # flags after `--` go to every run
    NANOCHAT_KERNELS=reference python -m dev.bench_train        # every op on its PyTorch reference
    python -m dev.bench_train --parallel                        # the whole parallel set on the GPUs here
    python -m dev.bench_train --parallel --gpus 0,1 --only d20  # the d20 layouts on GPUs 0 and 1
    python -m dev.bench_train --parallel --only "32K"           # context parallel against one GPU
    python -m dev.bench_train --parallel --only "=d32 one GPU,=d32 TP=2" -- --fp8      # TP 2 in fp8
    python -m dev.bench_train --parallel --only "32K CP" -- --cp-exchange ring   # the ring also at CP 4

Needs CUDA GPUs (nvidia-smi lists them, or name them with --gpus), data and a tokenizer as base_train does
(--data-dir / NANOCHAT_DATA_DIR, --base-dir / NANOCHAT_BASE_DIR). fp8 needs torchao and an SM89+ GPU (a run
that fell back to bf16 counts as failed); FlashAttention-4 is used where installed. The default device
batches fit a 141 GB H200 (d20 at 64); lower them on smaller GPUs. A layout that runs out of memory is reported
as failed. Each run appends a row to --out (CSV) and writes its output to --log-dir. A tree from before
metrics.jsonl is read from its printout (dev/runs.py).
"""

import os
import re
import sys
import csv
import json
import math
import time
import subprocess
from dataclasses import dataclass, field

from dev import runs
from nanochat.common import fail

STEPS = {12: (16, 6), 20: (12, 5)}  # (steps, warm-up) per depth of the default set; others take d20's
DEVICE_BATCH = {12: 128, 20: 64}  # the default set's device batch per depth; others take 32
PARALLEL_STEPS = (9, 4)


@dataclass
class Config:
    label: str
    depth: int
    device_batch: int
    total_batch: int
    steps: int
    warmup: int
    flags: list = field(default_factory=list)  # base_train flags beyond depth, batches and steps
    nproc: int = 1
    baseline: str = ""       # the label of the row this one is a ratio of
    baseline_name: str = ""  # what that row is, in the ratio's cell
    stages: int = 0          # pipeline stages, micro-batches per step, schedule, virtual chunks: the ideal and
    microbatches: int = 0    # simulated steps
    schedule: str = ""
    virtual: int = 1

    @property
    def dp(self):  # the loader deals row groups out by DP rank: layouts of one DP size train on the same batches
        return self.nproc // math.prod(int(runs.flag_value(self.flags, f, 1)) for f in ("--tp", "--pp", "--cp"))

    def base_train_flags(self, extra):
        return [f"--depth={self.depth}", f"--num-iterations={self.steps}", f"--total-batch-size={self.total_batch}",
                f"--device-batch-size={self.device_batch}", "--eval-tokens=0", "--save-every=0"] + runs.QUIET + \
            self.flags + extra


def default_configs(args):
    batch = dict(DEVICE_BATCH)
    for item in filter(None, args.device_batch_size.split(",")):
        d, _, b = item.partition("=")
        if not (d.isdigit() and b.isdigit()):
            fail(f"--device-batch-size {args.device_batch_size!r}: expected DEPTH=BATCH pairs, e.g. 12=128,20=64")
        batch[int(d)] = int(b)
    precisions = [p for p in args.precisions.split(",") if p]
    if any(p not in ("bf16", "fp8") for p in precisions):
        fail(f"--precisions {args.precisions!r}: use bf16 and/or fp8")
    configs = []
    for depth in (int(d) for d in args.depths.split(",") if d):
        steps, warmup = STEPS.get(depth, STEPS[20])
        b = batch.get(depth, 32)
        for window in (w for w in args.windows.split(",") if w):
            for precision in precisions:
                configs.append(Config(f"d{depth} {precision} {window} b{b}", depth, b, args.total_batch_size, steps,
                                      warmup, ["--window-pattern", window] + (["--fp8"] if precision == "fp8" else []),
                                      baseline=f"d{depth} bf16 {window} b{b}" if precision == "fp8" else "",
                                      baseline_name="bf16"))
    return configs


def parallel_configs(n=4):
    """The parallel set on a host of n GPUs (2, or 4: the widest layouts take n), each layout against its baseline."""
    configs = []

    def row(label, depth, device_batch, total, flags=(), nproc=1, baseline="", baseline_name="one GPU", window="L",
            **pipeline):
        configs.append(Config(label, depth, device_batch, total, *PARALLEL_STEPS, ["--window-pattern", window, *flags],
                              nproc, baseline, baseline_name, **pipeline))
    row("d20 one GPU", 20, 32, 524288)
    for dp in sorted({2, n}):
        row(f"d20 DP={dp}", 20, 32, 524288, nproc=dp, baseline="d20 one GPU")
    row(f"d20 TP=2 x DP={n // 2}", 20, 32, 524288, ["--tp", "2"], n, f"d20 DP={n}", f"DP {n}")
    row("d32 one GPU", 32, 8, 131072)
    row("d32 TP=2", 32, 8, 131072, ["--tp", "2"], 2, "d32 one GPU")
    row(f"d32 DP={n}", 32, 8, 262144, nproc=n)
    row(f"d32 DP={n} sharded", 32, 8, 262144, ["--shard-params"], n, f"d32 DP={n}", "plain DP")
    row(f"d32 TP=2 x DP={n // 2}", 32, 8, 262144, ["--tp", "2"], n, f"d32 DP={n}", f"DP {n}")
    row("d26 m=16 one GPU", 26, 8, 8 * 2048 * 16)
    for schedule, virtual, name in (("1f1b", 1, "1f1b"), ("interleaved", 2, "interleaved V=2")):
        row(f"d26 m=16 PP={n} {name}", 26, 8, 8 * 2048 * 16, ["--pp", str(n), f"--pp-schedule={schedule}",
            f"--pp-virtual={virtual}"], n, "d26 m=16 one GPU", stages=n, microbatches=16, schedule=schedule,
            virtual=virtual)
    for depth, device_batch, total, cps in ((12, 4, 262144, sorted({2, n})), (20, 2, 131072, [n])):
        one, flags = f"d{depth} 32K one GPU", ["--max-seq-len", "32768"]
        row(one, depth, device_batch, total, flags, window="SSSL")
        for cp in cps:
            row(f"d{depth} 32K CP={cp}", depth, device_batch, total, flags + ["--cp", str(cp)], cp, one, window="SSSL")
    return configs


def list_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        fail("no GPU found (nvidia-smi failed): this tool times training on CUDA GPUs; name them with --gpus 0,1,...")
    return list(range(len(out.splitlines())))


def launch(config, tree, args, gpus):
    """Start one configuration in one tree on the first config.nproc of `gpus`: its Job."""
    name = os.path.basename(tree)
    # one tag a run, also across commands side by side on other GPUs (a shared tag: one run refused, records mixed)
    on = "-".join(map(str, gpus[:config.nproc]))
    label = re.sub(r"[^\w.-]", "_", f"{name} {args.trees.index(tree)} {config.label} gpu {on}")
    job = runs.start(config.base_train_flags(args.extra), f"bench_{label}", tree=tree, env=runs.data_env(args),
                     nproc=config.nproc, gpus=gpus[:config.nproc], timeout=args.timeout,
                     log=os.path.join(args.log_dir, f"{label}.log"))
    print(f"== {name}: {config.label} on GPU {','.join(map(str, gpus[:config.nproc]))}: {' '.join(job.cmd[1:])}",
          flush=True)
    return job


BLOCK_TIMES = "block times"  # the task that times a pipelined configuration's blocks on one GPU


def measure_blocks(config, tree, args, gpus):
    """Start dev.pipeline_sim --measure in `tree` for the model and micro-batch of pipelined `config` (compiled, as
    training runs them) on the first of `gpus`: its Job, writing the block times to a JSON beside the logs."""
    path = os.path.join(args.log_dir, f"blocks_{args.trees.index(tree)}.json")
    cmd = [sys.executable, "-m", "dev.pipeline_sim", "--measure", str(config.depth), "--batch", str(config.device_batch),
           "--seq", "2048", "--compile", "inductor", "--out", path]
    print(f"== {os.path.basename(tree)}: block times of d{config.depth} on GPU {gpus[0]}", flush=True)
    env = runs.process_env(runs.data_env(args), gpus[:1])
    job = runs.Job(cmd, tree, env, [], BLOCK_TIMES, path.replace(".json", ".log"), args.timeout, None)
    job.blocks_path = path
    return job


def read_blocks(job):
    if (failure := job.failure()) is not None:
        print(f"   block times: failed: {failure}", flush=True)
        return None
    with open(job.blocks_path) as f:
        return json.load(f)


def simulated(pipelined, trees, blocks):
    """{(label, tree): the step dev.pipeline_sim prices for a pipelined configuration with its tree's block times,
    messages queued as NCCL runs them (ms)}."""
    from dev.pipeline_sim import P2P_GBPS, price
    out = {}
    for c in pipelined:
        for tree in trees:
            if blocks.get(tree):
                out[(c.label, tree)] = price(blocks[tree], c.schedule, c.stages, c.microbatches, c.virtual, P2P_GBPS)[-1]
    return out


def measure(config, tree, args, job):
    """The ended run of one configuration in one tree: its CSV row (appended to --out), or None when it failed."""
    name = os.path.basename(tree)
    try:
        run = job.run()
    except runs.RunFailed as e:
        print(f"   {name}: {config.label}: failed: {e}", flush=True)
        return None
    s = runs.summary(run, config.warmup)
    if not s["steps_timed"]:
        print(f"   {name}: {config.label}: failed: no step after the {config.warmup} of warm-up (flags after --?)")
        return None
    causal = causal_share(run.header) if s["mfu"] else None
    planned = planned_peak(run.header)
    peaks = {tag: round(gib, 2) for tag, gib in runs.rank_peaks(run).items()}
    row = {"tree": tree, "label": config.label, "depth": config.depth, "nproc": config.nproc,
           "batch": config.total_batch, "steps timed": s["steps_timed"], "step ms (median)": round(s["step_ms"], 2),
           "tok/s (median)": round(s["tok_per_sec"]), "mfu % (median)": round(s["mfu"], 2) if s["mfu"] else "",
           "causal mfu %": round(s["mfu"] * causal, 2) if causal else "",
           "peak mem GiB (max)": max(peaks.values()) if peaks else round(s["peak_mem_gib"], 2) if s["peak_mem_gib"] else "",
           "peak mem per rank": " ".join(f"{t}{v}" for t, v in sorted(peaks.items())),
           "planned GiB": round(planned, 2) if planned else "",
           "first step s": round(next(iter(run.series("dt").values()), 0.0), 1),  # mostly compilation
           "wall s": round(job.wall_s, 1), "args": " ".join(config.flags + args.extra),
           "losses": " ".join(f"{loss:.6f}" for _, loss in sorted(run.losses().items()))}
    print(f"   {name}: {config.label}: {row['tok/s (median)']:,} tok/s, step {row['step ms (median)']} ms" +
          (f", MFU {row['mfu % (median)']}%" if row["mfu % (median)"] else "") +
          (f", peak {row['peak mem GiB (max)']} GiB" if row["peak mem GiB (max)"] else "") +
          f"; first step {row['first step s']} s, {row['wall s']} s from launch to exit", flush=True)
    append_csv(args.out, row)
    return row


def causal_share(header):
    """The run's FLOPs per token with attention counted causally (gpt.attention_flops) over those its MFU counts
    (the recipe's: each query at its whole window); None for headers without a model config."""
    from nanochat.gpt import GPT, GPTConfig
    if "model_config" not in header:
        return None
    import torch
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict(header["model_config"]))
    return model.estimate_flops(causal=True) / model.estimate_flops()


def planned_peak(header):
    """scripts.plan's peak for the run (GiB, its worst rank), from the flags and layout its header records; None for
    headers without them (old trees)."""
    from nanochat.gpt import GPTConfig
    from nanochat.memory import worst_rank_peak, GIB
    from nanochat.recipe import Setting
    if "model_config" not in header or "layout" not in header:
        return None
    f, layout = header["flags"], header["layout"]  # flags a tree did not have yet: their defaults
    cp = layout.get("cp", 1)
    setting = Setting(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=cp, ep=f.get("ep", 1),
                      cp_exchange=f.get("cp_exchange", "ring") if cp > 1 else None,
                      pp_schedule=f.get("pp_schedule", "1f1b"), pp_virtual=f.get("pp_virtual", 1), sequence_parallel=f.get("sequence_parallel", False),
                      shard_params=f.get("shard_params", False), keep_gathered=f.get("keep_gathered", False),
                      device_batch=f["device_batch_size"], total_batch=header["total_batch_size"],
                      recompute=f.get("recompute", "none"), fp8=header.get("fp8", False))
    return worst_rank_peak(GPTConfig.from_dict(header["model_config"]), setting) / GIB


def append_csv(path, row):
    new = not os.path.exists(path)
    if not new:
        with open(path, newline="") as f:
            if next(csv.reader(f), None) != list(row):
                fail(f"--out {path} has other columns (written by another version?): give a new file")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def table(configs, trees, results, simulated=None):
    """The markdown table: a row per configuration; per tree tok/s, its ratio to the baseline row, MFU, step
    time, its ratio to the ideal pipeline step and to the simulated one, peak memory; with several trees, each tree's
    tok/s over the first's. Columns with nothing in them are left out. results: {(label, tree): CSV row or None};
    simulated: {(label, tree): dev.pipeline_sim's step, ms}."""
    names = [os.path.basename(t) for t in trees]
    prefix = (lambda n: f"{n} ") if len(trees) > 1 else (lambda n: "")
    header = ["configuration"]
    for n in names:
        header += [prefix(n) + h for h in ("tok/s", "vs baseline", "MFU", "causal MFU", "step", "vs ideal",
                                            "vs simulated", "peak memory", "loss vs baseline")]
    header += [f"{n} / {names[0]} tok/s" for n in names[1:]]
    rows, by_label = [], {c.label: c for c in configs}
    for c in configs:
        row = [c.label]
        for tree in trees:
            r = results.get((c.label, tree))
            if r is None:
                row += ["failed", "", "", "", "", "", "", "", ""]
                continue
            tok, step = r["tok/s (median)"], r["step ms (median)"]
            base = results.get((c.baseline, tree))
            vs_base = f"{tok / base['tok/s (median)']:.3f}x {c.baseline_name}" if base else ""
            mfu = f"{r['mfu % (median)']:.1f}%" + ("*" if "--fp8" in c.flags else "") if r["mfu % (median)"] else ""
            vs_ideal = ""
            if base and c.stages:
                bubble = (c.stages - 1) / c.virtual  # interleaving's V chunks a rank shrink it V-fold
                ideal = base["step ms (median)"] / c.stages * (c.microbatches + bubble) / c.microbatches
                vs_ideal = f"{step / ideal:.3f} (ideal {ideal:,.0f} ms)"
            sim = (simulated or {}).get((c.label, tree))
            vs_sim = f"{step / sim:.3f} (simulated {sim:,.0f} ms)" if sim else ""
            peaks = re.findall(r"\]([\d.]+)", r["peak mem per rank"])  # "[dp=0 pp=0]40.6 [dp=0 pp=1]24.7"
            peak = " / ".join(peaks) if peaks else r["peak mem GiB (max)"]
            peak_cell = f"{peak} GiB" if peak != "" else ""
            if r.get("planned GiB") and r["peak mem GiB (max)"]:  # scripts.plan's worst rank against the largest peak
                peak_cell += f" (planned {r['planned GiB']}, {float(r['planned GiB']) / float(r['peak mem GiB (max)']):.3f}x)"
            causal = f"{r['causal mfu %']:.1f}%" if r.get("causal mfu %") not in (None, "") else ""
            same_data = by_label.get(c.baseline, c).dp == c.dp
            row += [f"{tok:,}", vs_base, mfu, causal, f"{step:,.1f} ms", vs_ideal, vs_sim, peak_cell,
                    loss_difference(r, base) if same_data or not base else "other batches"]
        first = results.get((c.label, trees[0]))
        for tree in trees[1:]:
            r = results.get((c.label, tree))
            row.append(f"{r['tok/s (median)'] / first['tok/s (median)']:.3f}" if r and first else "")
        rows.append(row)
    keep = [i for i in range(len(header)) if i == 0 or any(r[i] for r in rows)]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    if any("--fp8" in c.flags for c in configs):
        lines.append("\n* MFU against the bf16 peak; fp8 ratios against bf16 at the same depth, window and device batch.")
    return "\n".join(lines)


def loss_difference(row, base):
    """The largest relative difference between a run's per-step losses and its baseline's, over the steps both
    ran ("" where either recorded none)."""
    if not base or not row.get("losses") or not base.get("losses"):
        return ""
    pairs = list(zip(map(float, row["losses"].split()), map(float, base["losses"].split())))
    return f"{max(abs(a - b) / abs(b) for a, b in pairs):.1e}"


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    parser.add_argument("--parallel", action="store_true", help="the parallel layouts instead of the default set")
    parser.add_argument("--only", type=str, default="", help="run only the configurations whose label contains one of "
                        "these (comma-separated), e.g. d20 or PP=4 (=LABEL: that label alone)")
    parser.add_argument("--depths", type=str, default="12,20", help="default set: comma-separated depths")
    parser.add_argument("--precisions", type=str, default="bf16,fp8", help="default set: comma-separated, from bf16 and fp8")
    parser.add_argument("--windows", type=str, default="L,SSSL", help="default set: comma-separated --window-pattern values")
    parser.add_argument("--device-batch-size", type=str, default="", help="default set: per depth, e.g. 12=128,20=64 (empty: " +
                        ",".join(f"{d}={b}" for d, b in DEVICE_BATCH.items()) + "; depths not listed use 32)")
    parser.add_argument("--total-batch-size", type=int, default=524288, help="default set: tokens per step")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0: 16 at d12, 12 at other depths of the "
                                                             f"default set, {PARALLEL_STEPS[0]} in the parallel set)")
    parser.add_argument("--warmup", type=int, default=0, help="steps left out of the medians (0: 6 at d12, 5 at other depths, "
                                                              f"{PARALLEL_STEPS[1]} in the parallel set)")
    parser.add_argument("--tree", action="append", default=[], help="a checkout to run in (repeatable; default: this one)")
    parser.add_argument("--gpus", type=str, default="", help="comma-separated GPU indices; a run of n processes takes n of "
                        "them (the parallel set: free ones; the default set: the first n) (empty: all nvidia-smi lists)")
    runs.add_data_args(parser)
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (compilation included)")
    parser.add_argument("--out", type=str, default="bench_train.csv", help="CSV the runs append to")
    parser.add_argument("--log-dir", type=str, default="bench_train_logs", help="where each run's output goes")
    parser.add_argument("extra", nargs="*", help="after --: base_train flags for every run")
    args = parser.parse_args(argv)
    args.out, args.log_dir = os.path.abspath(args.out), os.path.abspath(args.log_dir)  # runs start in their tree

    trees = args.trees = [runs.check_tree(t, "--tree") for t in (args.tree or ["."])]
    if len(set(trees)) < len(trees):  # results are kept by tree: the same tree twice would be one column
        fail(f"--tree: {' '.join(args.tree)} names a checkout twice; for a noise check, run the command twice")
    gpus = [int(g) for g in args.gpus.split(",") if g] if args.gpus else list_gpus()
    if len(set(gpus)) < len(gpus):
        fail(f"--gpus {args.gpus}: a GPU named twice (a layout's ranks need GPUs of their own)")
    picks = [p for p in args.only.split(",") if p] or [""]
    wanted = lambda label: any(label == p[1:] if p.startswith("=") else p in label for p in picks)
    configs = parallel_configs(4 if len(gpus) >= 4 else 2) if args.parallel else default_configs(args)
    configs = [c for c in configs if wanted(c.label)]
    for c in configs:
        c.steps, c.warmup = args.steps or c.steps, args.warmup or c.warmup
        if c.steps <= c.warmup:
            fail(f"--steps {c.steps} with --warmup {c.warmup} leaves no step to time for {c.label}: give more steps")
    skipped = [c.label for c in configs if c.nproc > len(gpus)]
    configs = [c for c in configs if c.nproc <= len(gpus)]
    if not configs:
        fail(f"no configuration matches --only {args.only!r} on {len(gpus)} GPU(s)")

    # the parallel set packs its runs side by side on free GPUs; the default set runs one at a time on the first
    results, blocks, t0 = {}, {}, time.time()
    # priced by dev.pipeline_sim from block times measured beside them, unless flags after -- change the blocks
    reshaped = [f for f in ("--device-batch-size", "--max-seq-len", "--window-pattern", "--fp8", "--recompute")
                if any(e == f or e.startswith(f + "=") for e in args.extra)]
    pipelined = [c for c in configs if c.stages] if not reshaped else []
    # a configuration's runs in the trees one after the other on the same GPUs (finished hands on the next tree)
    queue = [(BLOCK_TIMES, tree) for tree in trees if pipelined] + [(c, trees[0]) for c in configs]

    def start(task, mine):
        return measure_blocks(pipelined[0], task[1], args, mine) if task[0] is BLOCK_TIMES else launch(*task, args, mine)

    def finished(task, job, _):
        config, tree = task
        if config is BLOCK_TIMES:
            blocks[tree] = read_blocks(job)
        else:
            results[(config.label, tree)] = measure(config, tree, args, job)
            if tree != trees[-1]:
                return config, trees[trees.index(tree) + 1]
    runs.run_queue(queue, gpus, start, finished, width=lambda task: getattr(task[0], "nproc", 1) if args.parallel
                   else len(gpus))
    print("\n" + table(configs, trees, results, simulated(pipelined, trees, blocks)))
    print(f"\n{len(results)} runs in {(time.time() - t0) / 60:.1f} minutes")
    if skipped:
        print(f"\nnot run (more processes than the {len(gpus)} GPU(s)): " + ", ".join(skipped))
    if reshaped and any(c.stages for c in configs):
        print(f"(no simulated pipeline steps: {' '.join(reshaped)} after -- would time other blocks than the runs')")
    print(f"(results appended to {args.out})")


if __name__ == "__main__":
    main()
