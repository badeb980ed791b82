"""
This harness against upstream nanochat, run side by side on one GPU in one call, on the same parquet shards,
each with its own tokenizer (trained here on the same shards if missing). Every figure is a ratio or a
difference between runs made by this script on the same machine.

    python -m dev.vs_upstream --upstream ../nanochat-92d63d4 --data-dir ~/shards --fa4-path ~/fa4site
    python -m dev.vs_upstream ... --parts speed               # one part per call; results accumulate in --work-dir
    python -m dev.vs_upstream ... --parts speed --depths 12 --seq-len 8192 --device-batches 12=8   # 8K context
    python -m dev.vs_upstream --work-dir vs_upstream --report  # the tables from what is there

Parts (--parts, comma-separated; all by default):
- speed: tok/s at d12 and d20 with 524,288-token steps and --window-pattern L (upstream has no sliding window
  without the `kernels` package), for upstream (PyTorch SDPA), ours without FlashAttention-4 (cuDNN
  attention), ours with it (--fa4-path: PYTHONPATH entries that provide flash-attn-4), and ours in fp8
  at d20. Each side tries every --device-batches value of a depth and keeps its fastest; fp8 and FA4 use
  the batch ours without FA4 chose. A figure is the median step time after the warm-up steps (compilation).
  --seq-len sets both sides' --max-seq-len (default 2048; give device batches of as many tokens).
- steps: equal steps, dev/quality_ab.py's configuration (TRAIN: d12, 200 steps of 65,536 tokens, window L, val
  bpb on 2M tokens), --runs times each: ours and upstream with their own weight-decay rule, and ours with its
  --weight-decay set so that its Muon decay equals upstream's printed one ("matched": implementation against
  implementation). Upstream keeps the decay of its ratio horizon when --num-iterations is given; ours scales it
  by D_ref / D of the steps actually run.
- walltime: equal training time at d12 and the recipe batch (524,288 tokens): each side runs the number of
  steps that takes --wall-seconds at its step time from the speed part (the same attention as this run).
  That time excludes compilation (the warm-up steps) and evaluation; each side's own schedule and decay.
- bpb: an independent check of both sides' val bpb (dev/score_bpb.py: the same validation bytes, each model's
  logits only) on the final checkpoint of each side's first equal-steps run by the code at hand, four ways: each of the first
  1,000 documents' head as far as the context holds it, one document per row (what packed rows of whole
  documents hold); the same over every document; the first selection packed several documents to a row;
  and the first 5,000 characters of documents that have them.
Quality runs do not depend on timing, so --parallel of them share the GPU at once (their compilation
overlaps); speed runs always run alone.

Our runs are launched and read through dev/runs.py (their metrics.jsonl); upstream writes no such record, so
its printout is read, by one function (upstream_row). Upstream needs rustbpe, tiktoken, pyarrow and torch; it
imports wandb at the top, so an empty wandb package is put on its PYTHONPATH. Its data must sit in
$NANOCHAT_BASE_DIR/base_data_climbmix: links to --data-dir's shards are made there. Needs a CUDA GPU. Results
go to --work-dir/results.jsonl, one JSON object per run, and the tables are printed from that file after every
part (and by --report).
"""

import os
import re
import sys
import json
import time
import shutil
import statistics
import subprocess

from dev import runs
from dev.quality_ab import TRAIN as QUALITY
from nanochat.common import fail

QUALITY_EVAL = int(runs.flag_value(QUALITY, "--eval-tokens"))  # validation tokens of every quality run
RECIPE_BATCH = 524288  # both harnesses' d12 batch (2^19), and the batch of the speed runs
WALL_DEPTH = 12  # the equal-time runs' depth
# steps run, of which the first are left out: the 11 both harnesses leave out of their own timing (compilation)
SPEED_STEPS = {12: (22, runs.FIRST_TIMED_STEP), 20: (17, runs.FIRST_TIMED_STEP)}
UPSTREAM_DECAY = re.compile(r"Scaling weight decay from [\d.]+ to ([\d.]+)")  # upstream's Muon decay, as it prints it


def harness(side):
    return "upstream" if side == "upstream" else "ours"


# -----------------------------------------------------------------------------
# The two harnesses of one call: where they run, with which environment and flags, and what their runs gave


class Comparison:
    def __init__(self, args):
        self.args = args
        self.work = os.path.abspath(args.work_dir)
        self.results_path = os.path.join(self.work, "results.jsonl")
        self.call = time.strftime("%Y-%m-%d %H:%M:%S")  # this invocation: ratios are taken within one
        self.upstream = os.path.abspath(args.upstream) if args.upstream else None
        self.ours = os.path.abspath(args.ours)
        self.data_dir = os.path.abspath(args.data_dir) if args.data_dir else None
        self.fa4_path = os.pathsep.join(os.path.abspath(p) for p in args.fa4_path.split(os.pathsep)) if args.fa4_path else None

    def load_results(self):
        if not os.path.exists(self.results_path):
            return []
        with open(self.results_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def record(self, row):
        row.setdefault("call", self.call)
        row.setdefault("version", runs.tree_version(self.tree(row["side"]), self.work) if "side" in row else "")
        with open(self.results_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def tree(self, side):
        return self.upstream if side == "upstream" else self.ours

    def env(self, side):
        env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=os.path.join(self.work, "inductor"))
        path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["NANOCHAT_BASE_DIR"] = os.path.join(self.work, harness(side))
        if side == "upstream":
            path.insert(0, os.path.join(self.work, "stubs"))
        else:
            env["NANOCHAT_DATA_DIR"] = self.data_dir
            if side.endswith("FA4"):
                path.insert(0, self.fa4_path)
        env["PYTHONPATH"] = os.pathsep.join(path)
        return env

    def start(self, side, flags, tag):
        """base_train in either harness: the recipe flags (with --eval-tokens=N: validation on N tokens at the
        end, 0 = none) plus 'no extras'."""
        eval_tokens = int(runs.flag_value(flags, "--eval-tokens", 0))
        if side == "upstream":  # evaluates only with --eval-every > 0; always saves at the end
            steps = runs.flag_value(flags, "--num-iterations")
            evals = [f"--eval-every={steps}", f"--eval-tokens={eval_tokens}"] if eval_tokens else ["--eval-every=-1"]
            flags = ["--run=dummy"] + [f for f in flags if not f.startswith("--eval-tokens=")] + runs.QUIET + evals
        else:
            flags = flags + runs.QUIET + ["--eval-every=-1"] + ([] if eval_tokens else ["--save-every=0"])
        job = runs.start(flags, tag, tree=self.tree(side), env=self.env(side), timeout=self.args.timeout,
                         log=os.path.join(self.work, "logs", f"{tag}.log"))
        print(f"== {tag} ({side}): {' '.join(job.cmd[2:])}", flush=True)
        return job

    def finish(self, job, side, warmup=0):
        """Wait for a run of `side`; its result row (None if it failed), with the median step time over the steps
        from `warmup` on."""
        row = dict(side=side, tag=job.model_tag, log=os.path.basename(job.log_path))
        try:
            if side == "upstream":
                failure = job.failure()
                if failure:
                    raise runs.RunFailed(failure)
                row.update(upstream_row(job.text, warmup))
            else:
                run = job.run()
                s = runs.summary(run, warmup)
                row.update(steps=s["steps"], step_ms=s["step_ms"], steps_timed=s["steps_timed"],
                           peak_gib=round(s["peak_mem_gib"], 2) if s["peak_mem_gib"] else None, val_bpb=s["val_bpb"],
                           muon_decay=round(run.header["weight_decay"], 5) if "weight_decay" in run.header else None,
                           attention=run.header.get("attention", ""))
                if side.endswith("FA4") and row["attention"] != "FlashAttention-4":  # --fa4-path gave no working FA4
                    raise runs.RunFailed(f"it ran {row['attention'] or 'unknown attention'}, not FlashAttention-4 (check "
                                         f"that --fa4-path imports: PYTHONPATH=... python -c 'import flash_attn.cute')")
        except runs.RunFailed as e:
            print(f"   {row['tag']}: failed: {e}", flush=True)
            return None
        return row

    def drop_checkpoint(self, row):
        """Checkpoints are ~1-3 GB each: only the ones the bpb part scores are kept."""
        shutil.rmtree(os.path.join(self.work, harness(row["side"]), "base_checkpoints", row["tag"]), ignore_errors=True)


def upstream_row(text, warmup):
    """Upstream's run from its printout (it writes no metrics.jsonl): steps, the median step time over the steps
    from `warmup` on, peak memory, final val bpb, Muon's weight decay. RunFailed if no step after warm-up printed."""
    steps = [(int(n), float(dt)) for n, dt in re.findall(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+) ?ms", text, re.M)]
    timed = [dt for n, dt in steps if n >= warmup]
    if not timed:
        raise runs.RunFailed(f"no step from {warmup} on printed: " + " / ".join(text.strip().splitlines()[-3:]))
    bpb = re.findall(r"Validation bpb: ([\d.]+)", text)
    decay = UPSTREAM_DECAY.findall(text)
    peak = re.search(r"^Peak memory usage: ([\d.]+) ?MiB", text, re.M)  # its max_memory_allocated, as ours
    attention = "FlashAttention-3" if re.search(r"Using Flash Attention 3", text) else \
        "PyTorch SDPA" if re.search(r"using PyTorch SDPA", text) else ""
    return dict(steps=steps[-1][0] + 1, step_ms=statistics.median(timed), steps_timed=len(timed),
                peak_gib=round(float(peak.group(1)) / 1024, 2) if peak else None,
                val_bpb=float(bpb[-1]) if bpb else None, muon_decay=float(decay[0]) if decay else None,
                attention=attention)


# -----------------------------------------------------------------------------
# Preparation: data links, the wandb stub, each side's tokenizer


def prepare(c):
    shards = sorted(f for f in os.listdir(c.data_dir) if f.endswith(".parquet"))
    if len(shards) < 2:
        fail(f"--data-dir {c.data_dir} needs at least 2 parquet shards (train, then validation last); found {len(shards)}")
    up_data = os.path.join(c.work, "upstream", "base_data_climbmix")
    os.makedirs(up_data, exist_ok=True)
    marker = os.path.join(c.work, "data_dir")  # the links and both tokenizers below are of one data dir
    if os.path.exists(marker) and open(marker).read() != c.data_dir:
        fail(f"--work-dir {c.work} was prepared from --data-dir {open(marker).read()}: give that one, or another "
             f"--work-dir for {c.data_dir}")
    with open(marker, "w") as f:
        f.write(c.data_dir)
    for f in shards:
        link = os.path.join(up_data, f)
        if not os.path.lexists(link):
            os.symlink(os.path.join(c.data_dir, f), link)
    os.makedirs(os.path.join(c.work, "stubs", "wandb"), exist_ok=True)
    open(os.path.join(c.work, "stubs", "wandb", "__init__.py"), "a").close()
    for side, marker in (("ours", "tokenizer.tiktoken"), ("upstream", "tokenizer.pkl")):
        if os.path.exists(os.path.join(c.work, side, "tokenizer", marker)):
            continue
        cmd = [sys.executable, "-m", "scripts.tok_train"] + (["--data-dir", c.data_dir] if side == "ours" else ["--max-chars=2000000000"])
        print(f"== training {side}'s tokenizer: {' '.join(cmd[1:])}", flush=True)
        p = subprocess.run(cmd, cwd=c.tree(side), env=c.env(side), capture_output=True, text=True)
        if p.returncode != 0:
            fail(f"{side}'s tokenizer training failed: {(p.stdout + p.stderr).strip().splitlines()[-1:]}")


# -----------------------------------------------------------------------------
# Parts


def speed(c):
    args = c.args
    batches = {int(d): [int(b) for b in bs.split("/")] for d, _, bs in
               (item.partition("=") for item in args.device_batches.split(",") if item)}
    sides = ["upstream", "ours"] + (["ours+FA4"] if c.fa4_path else [])
    for depth in [int(d) for d in args.depths.split(",") if d]:
        n_steps, warmup = SPEED_STEPS.get(depth, SPEED_STEPS[20])
        ours_rows = []  # this depth's runs of ours without FA4: the fastest batch is the one FA4 and fp8 use
        for side in sides + (["ours+FA4 fp8" if c.fa4_path else "ours fp8"] if depth >= 20 else []):
            tried = batches.get(depth, [32]) if side in ("upstream", "ours") else \
                [max(ours_rows, key=lambda r: r["tok_s"])["device_batch"] if ours_rows else batches.get(depth, [32])[0]]
            for b in tried:
                flags = [f"--depth={depth}", "--window-pattern=L", f"--max-seq-len={args.seq_len}",
                         f"--device-batch-size={b}", f"--total-batch-size={RECIPE_BATCH}", f"--num-iterations={n_steps}",
                         "--eval-tokens=0"] + (["--fp8"] if "fp8" in side else [])
                harness_side = side.replace(" fp8", "")
                job = c.start(harness_side, flags, f"speed_{side.replace(' ', '_').replace('+', '_')}_d{depth}_"
                                                   f"t{args.seq_len}_b{b}")
                row = c.finish(job, harness_side, warmup)
                if row is None:
                    continue
                row.update(part="speed", side=side, depth=depth, seq_len=args.seq_len, device_batch=b,
                           tok_s=RECIPE_BATCH / row["step_ms"] * 1000)
                print(f"   {row['tok_s']:,.0f} tok/s ({row['step_ms']:.1f} ms/step, {row['steps_timed']} steps timed; "
                      f"{row['attention']})", flush=True)
                c.record(row)
                c.drop_checkpoint(row)
                if side == "ours":
                    ours_rows.append(row)


def run_queue(c, jobs, keep=lambda row: False):
    """jobs: (side, flags or a function giving them at start, tag, part, extra fields), --parallel at a time on this
    GPU (runs.run_queue, which ends the runs left going if it fails). keep(row): whether the run's checkpoint stays."""
    def launch(spec, _):
        side, flags, tag, _, _ = spec
        return c.start(side, flags() if callable(flags) else flags, tag)

    def finished(spec, job, _):
        side, _, _, part, extra = spec
        row = c.finish(job, side)
        if row is not None:
            row.update(part=part, **extra)
            print(f"   {row['tag']}: val bpb {row['val_bpb']}, Muon decay {row['muon_decay']}, {row['steps']} steps", flush=True)
            c.record(row)
            if not keep(row):
                c.drop_checkpoint(row)

    runs.run_queue(list(jobs), [None] * c.args.parallel, launch, finished)


def quality_side(c):
    return "ours+FA4" if c.fa4_path else "ours"


def steps_part(c):
    stamp = time.strftime("%H%M%S")
    runs_n = c.args.runs
    own = [(quality_side(c), QUALITY, f"steps_ours_{i}_{stamp}", "steps", dict(setting="own rule")) for i in range(runs_n)]
    up = [("upstream", QUALITY, f"steps_upstream_{i}_{stamp}", "steps", dict(setting="own rule")) for i in range(runs_n)]

    def matched_flags():
        """ours with --weight-decay scaled so that its Muon decay is upstream's, read from the first runs (ours
        records it in its metrics.jsonl header, upstream prints it at start)."""
        ours_metrics = runs.metrics_file(c.env(quality_side(c)), f"steps_ours_0_{stamp}")
        up_log = os.path.join(c.work, "logs", f"steps_upstream_0_{stamp}.log")
        for _ in range(300):
            try:
                header = runs.Run(ours_metrics).header
            except FileNotFoundError:
                header = None
            target = UPSTREAM_DECAY.findall(open(up_log).read()) if os.path.exists(up_log) else []
            if header and target:
                break
            time.sleep(2)
        else:
            fail("the first equal-steps runs did not give their Muon weight decay (see their logs)")
        scale = float(target[0]) / header["weight_decay"]
        return QUALITY + [f"--weight-decay={header['flags']['weight_decay'] * scale:.6g}"]

    matched = [(quality_side(c), matched_flags, f"steps_matched_{i}_{stamp}", "steps", dict(setting="decay matched"))
               for i in range(runs_n)]
    jobs = [j for trio in zip(own, up, matched) for j in trio]  # interleaved, so drift hits every setting alike
    run_queue(c, jobs, keep=lambda row: row["setting"] == "own rule" and f"_0_{stamp}" in row["tag"])  # for the bpb part


def walltime_part(c):
    stamp = time.strftime("%H%M%S")
    speed_rows = [r for r in c.load_results() if r["part"] == "speed" and r["depth"] == WALL_DEPTH
                  and r.get("seq_len", 2048) == 2048]  # the runs below train at the default context
    sides = (quality_side(c), "upstream")
    both = [call for call in {r.get("call", "") for r in speed_rows}  # both sides calibrated on one machine
            if all(any(r["side"] == side and r.get("call", "") == call for r in speed_rows) for side in sides)]
    speed_rows = [r for r in speed_rows if both and r.get("call", "") == max(both)]
    per_side = []
    for side in sides:
        rows = [r for r in speed_rows if r["side"] == side]
        if not rows:
            fail(f"walltime needs the speed part's d{WALL_DEPTH} figure of {side!r} in {c.results_path}: run --parts speed first")
        best = max(rows, key=lambda r: r["tok_s"])
        n = max(1, round(c.args.wall_seconds * 1000 / best["step_ms"]))
        flags = [f"--depth={WALL_DEPTH}", "--window-pattern=L", f"--device-batch-size={best['device_batch']}",
                 f"--total-batch-size={RECIPE_BATCH}", f"--num-iterations={n}", f"--eval-tokens={QUALITY_EVAL}"]
        per_side.append([(side, flags, f"wall_{harness(side)}_{i}_{stamp}", "walltime",
                          dict(setting=f"{c.args.wall_seconds:.0f} s", calibration_step_ms=best["step_ms"]))
                         for i in range(c.args.runs)])
    run_queue(c, [j for pair in zip(*per_side) for j in pair])


SCORER_SELECTIONS = {  # dev/score_bpb.py's text and rows, four ways (its docstring)
    "heads": [],  # each document's head, as far as one row of the context holds it
    "heads, all documents": ["--docs=0"],  # the same over the whole validation file
    "heads, packed": ["--packed"],  # the first selection's tokens, several documents to a row
    "5000 chars": ["--min-chars=5000", "--chars=5000"],  # the first 5,000 characters of documents that have them
}


def bpb_part(c):
    val = os.path.join(c.data_dir, sorted(f for f in os.listdir(c.data_dir) if f.endswith(".parquet"))[-1])
    rows = c.load_results()
    for side in (quality_side(c), "upstream"):
        ckpts = os.path.join(c.work, harness(side), "base_checkpoints")
        version = runs.tree_version(c.tree(side), c.work)  # a run of this code, not of an earlier version
        saved = [r for r in rows if r["part"] == "steps" and r["side"] == side and r.get("setting") == "own rule"
                 and r.get("version") == version and os.path.isdir(os.path.join(ckpts, r["tag"]))]
        if not saved:
            fail(f"bpb needs a saved equal-steps run of {side!r} by this code in {c.work}: run --parts steps first")
        run = saved[0]
        for selection, flags in SCORER_SELECTIONS.items():
            cmd = [sys.executable, os.path.join(c.ours, "dev", "score_bpb.py"), "--harness", harness(side),
                   "--root", c.tree(side), "--checkpoint-dir", os.path.join(ckpts, run["tag"]), "--val", val] + flags + \
                (["--tokenizer-dir", os.path.join(c.work, "ours", "tokenizer")] if harness(side) == "ours" else [])
            print(f"== scoring {run['tag']}: {' '.join(cmd[1:])}", flush=True)
            try:
                p = subprocess.run(cmd, cwd=c.tree(side), env=c.env(side), capture_output=True, text=True,
                                   timeout=c.args.timeout)
            except subprocess.TimeoutExpired:
                print(f"   failed: not done in {c.args.timeout} s", flush=True)
                continue
            m = re.search(r"SCORE bpb=([\d.]+) bytes=(\d+) tokens=(\d+) docs=(\d+) fitted=(\d+)", p.stdout)
            if p.returncode != 0 or not m:
                print(f"   failed: {(p.stdout + p.stderr).strip().splitlines()[-3:]}", flush=True)
                continue
            positions = re.search(r"^loss by position.*$", p.stdout, re.M)
            kinds = re.search(r"^bpb of documents.*$", p.stdout, re.M)
            row = dict(part="bpb", side=side, tag=run["tag"], selection=selection, own_bpb=run["val_bpb"],
                       score_bpb=float(m.group(1)), bytes=int(m.group(2)), tokens=int(m.group(3)), docs=int(m.group(4)),
                       fitted=int(m.group(5)), by_position=positions.group(0) if positions else "",
                       by_kind=kinds.group(0) if kinds else "")
            print(f"   own {row['own_bpb']:.4f}, independent {row['score_bpb']:.4f} ({row['tokens']:,} tokens, "
                  f"{row['bytes']:,} bytes, {row['fitted']} documents cut to the context)\n   {row['by_position']}\n   {row['by_kind']}", flush=True)
            c.record(row)


# -----------------------------------------------------------------------------
# The tables


def spread(values):
    v = sorted(values)
    return f"{statistics.median(v):.4f} ({v[0]:.4f} - {v[-1]:.4f}, n={len(v)})" if v else "-"


def report(rows):
    speed_rows = [r for r in rows if r["part"] == "speed"]
    if speed_rows:
        # each call's rows apart: GPUs differ by 2-3%, so a ratio is taken within one call
        print("\n| depth | context | call | side | device batch | tok/s | vs upstream | step ms | peak GiB | attention |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        key = lambda r: (r["depth"], r.get("seq_len", 2048), r.get("call", ""))
        for depth, seq_len, call in sorted({key(r) for r in speed_rows}):
            best = {}
            for r in speed_rows:
                if key(r) == (depth, seq_len, call) and (r["side"] not in best or r["tok_s"] > best[r["side"]]["tok_s"]):
                    best[r["side"]] = r
            up = best.get("upstream")
            for side, r in best.items():
                ratio = f"{r['tok_s'] / up['tok_s']:.3f}x" if up else "-"
                print(f"| d{depth} | {seq_len:,} | {call or '-'} | {side} | {r['device_batch']} | {r['tok_s']:,.0f} | "
                      f"{ratio} | {r['step_ms']:.1f} | {r['peak_gib'] or '-'} | {r['attention'][:60]} |")
            bf16 = [best[s] for s in ("ours+FA4", "ours") if s in best]
            for fp8 in [best[s] for s in ("ours+FA4 fp8", "ours fp8") if s in best]:
                same = next((b for b in bf16 if ("FA4" in b["side"]) == ("FA4" in fp8["side"])), None)
                if same:
                    print(f"| d{depth} | | {call or '-'} | {fp8['side']} / {same['side']} | | "
                          f"{fp8['tok_s'] / same['tok_s']:.3f}x (fp8 / bf16) | | | | |")
    quality = [r for r in rows if r["part"] in ("steps", "walltime")]
    if quality:
        print("\n| setting | side | val bpb: median (min - max, n) | each run | Muon decay | steps |")
        print("| --- | --- | --- | --- | --- | --- |")
        keys = []
        key = lambda r: (r["part"], r.get("setting"), harness(r["side"]), r.get("version", ""))  # runs of one code
        for r in quality:
            if key(r) not in keys:
                keys.append(key(r))
        for part, setting, side, version in keys:
            same = [r for r in quality if key(r) == (part, setting, side, version)]
            vals = [r["val_bpb"] for r in same if r["val_bpb"] is not None]
            label = ("equal steps, " + setting) if part == "steps" else f"equal time ({setting} training)"
            side += f" ({version[:12]})" if version else ""
            print(f"| {label} | {side} | {spread(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | "
                  f"{same[0]['muon_decay']} | {', '.join(str(r['steps']) for r in same)} |")
    for r in [r for r in rows if r["part"] == "bpb"]:
        print(f"\nindependent bpb, {r['side']} ({r['tag']}, {r.get('selection', '5000 chars')}): own {r['own_bpb']:.4f}, "
              f"scorer {r['score_bpb']:.4f}, difference {r['own_bpb'] - r['score_bpb']:+.4f} ({r['docs']} docs, "
              f"{r['bytes']:,} bytes, {r['tokens']:,} tokens)")


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    parser.add_argument("--upstream", type=str, help="root of an upstream nanochat checkout")
    parser.add_argument("--ours", type=str, default=runs.REPO, help="root of this harness's checkout")
    parser.add_argument("--data-dir", type=str, default=os.environ.get("NANOCHAT_DATA_DIR"),
                        help="parquet shards with a `text` column, the last one validation (default: NANOCHAT_DATA_DIR)")
    parser.add_argument("--work-dir", type=str, default="vs_upstream", help="tokenizers, checkpoints, logs, results.jsonl")
    parser.add_argument("--fa4-path", type=str, default=None,
                        help="PYTHONPATH entries (os.pathsep-separated) that provide flash-attn-4, for the 'ours+FA4' rows")
    parser.add_argument("--parts", type=str, default="speed,steps,walltime,bpb", help="which parts to run (see above)")
    parser.add_argument("--depths", type=str, default="12,20", help="speed: depths")
    parser.add_argument("--device-batches", type=str, default="12=32/64/128,20=32/64",
                        help="speed: device batches tried per depth (each side keeps its fastest)")
    parser.add_argument("--seq-len", type=int, default=2048, help="speed: both sides' --max-seq-len")
    parser.add_argument("--runs", type=int, default=3, help="quality: runs per setting")
    parser.add_argument("--wall-seconds", type=float, default=120, help="walltime: seconds of training per run")
    parser.add_argument("--parallel", type=int, default=3, help="quality: runs sharing the GPU at once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--report", action="store_true", help="only print the tables from --work-dir/results.jsonl")
    args = parser.parse_args(argv)

    c = Comparison(args)
    if args.report:
        report(c.load_results())
        return
    if not c.upstream or not os.path.exists(os.path.join(c.upstream, "scripts", "base_train.py")):
        fail(f"--upstream {args.upstream}: give the root of an upstream nanochat checkout (with scripts/base_train.py)")
    if not c.data_dir or not os.path.isdir(c.data_dir):
        fail(f"--data-dir {args.data_dir}: give a folder of parquet shards (or set NANOCHAT_DATA_DIR)")
    if c.fa4_path and not any(os.path.isdir(os.path.join(p, "flash_attn")) for p in c.fa4_path.split(os.pathsep)):
        fail(f"--fa4-path {args.fa4_path}: no flash_attn package there")
    parts = {"speed": speed, "steps": steps_part, "walltime": walltime_part, "bpb": bpb_part}
    names = [p for p in args.parts.split(",") if p]
    if any(name not in parts for name in names):
        fail(f"--parts {args.parts!r}: use some of {', '.join(parts)}")
    os.makedirs(c.work, exist_ok=True)
    prepare(c)
    for name in names:
        parts[name](c)
    report(c.load_results())


if __name__ == "__main__":
    main()
