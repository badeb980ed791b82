"""
This harness against upstream nanochat, run side by side on one GPU in one call, on the same parquet shards,
each with its own tokenizer (trained here on the same shards if missing). Every figure is a ratio or a
difference between runs made by this script on the same machine.

    python -m dev.vs_upstream --upstream ../nanochat-92d63d4 --data-dir ~/shards --fa4-path ~/fa4site
    python -m dev.vs_upstream ... --parts speed               # one part per call; results accumulate in --work-dir
    python -m dev.vs_upstream --work-dir vs_upstream --report  # the table from what is there

Parts (--parts, comma-separated; all by default):
- speed: tok/s at d12 and d20 with 524,288-token steps and --window-pattern L (upstream has no sliding window
  without the `kernels` package), for upstream (PyTorch SDPA), ours without FlashAttention-4 (cuDNN
  attention), ours with it (--fa4-path: PYTHONPATH entries that provide flash-attn-4), and ours in fp8
  at d20. Each side tries every --device-batches value of a depth and keeps its fastest; fp8 and FA4 use
  the batch ours without FA4 chose. A figure is the median step time after the warm-up steps (compilation).
- steps: equal steps, d12, 200 steps of 65,536 tokens (device batch 32, window L), val bpb on 2M tokens,
  --runs times each: ours and upstream with their own weight-decay rule, and ours with its --weight-decay set
  so that its Muon decay equals upstream's printed one ("matched": implementation against implementation).
  Upstream keeps the decay of its ratio horizon when --num-iterations is given; ours scales it by D_ref / D
  of the steps actually run.
- walltime: equal training time at d12 and the recipe batch (524,288 tokens): each side runs the number of
  steps that takes --wall-seconds at its step time from the speed part (the same attention as this run).
  That time excludes compilation (the warm-up steps) and evaluation; each side's own schedule and decay.
- bpb: an independent check of both sides' val bpb (dev/score_bpb.py: the same validation bytes, each model's
  logits only) on the final checkpoint of each side's first equal-steps run, four ways: each of the first
  1,000 documents' head as far as the context holds it, one document per row (what packed rows of whole
  documents hold); the same over every document; the first selection packed several documents to a row;
  and the first 5,000 characters of documents that have them.
Quality runs do not depend on timing, so --parallel of them share the GPU at once (their compilation
overlaps); speed runs always run alone.

Upstream needs rustbpe, tiktoken, pyarrow and torch; it imports wandb at the top, so an empty wandb package
is put on its PYTHONPATH. Its data must sit in $NANOCHAT_BASE_DIR/base_data_climbmix: links to --data-dir's
shards are made there. Results go to --work-dir/results.jsonl, one JSON object per run, and the tables are
printed from that file after every part (and by --report).
"""

import os
import re
import sys
import json
import time
import shutil
import argparse
import statistics
import subprocess

QUALITY = ["--depth=12", "--window-pattern=L", "--device-batch-size=32", "--total-batch-size=65536", "--num-iterations=200"]
QUALITY_EVAL = 2097152  # validation tokens of every quality run
RECIPE_BATCH = 524288  # both harnesses' d12 batch (2^19), and the batch of the speed runs
WALL_DEPTH = 12  # the equal-time runs' depth
SPEED_STEPS = {12: (14, 6), 20: (10, 4)}  # steps run, of which the first are left out (compilation)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--upstream", type=str, help="root of an upstream nanochat checkout")
parser.add_argument("--ours", type=str, default=HERE, help="root of this harness's checkout (default: this one)")
parser.add_argument("--data-dir", type=str, default=os.environ.get("NANOCHAT_DATA_DIR"),
                    help="parquet shards with a `text` column, the last one validation (default: NANOCHAT_DATA_DIR)")
parser.add_argument("--work-dir", type=str, default="vs_upstream", help="tokenizers, checkpoints, logs, results.jsonl")
parser.add_argument("--fa4-path", type=str, default=None,
                    help="PYTHONPATH entries (os.pathsep-separated) that provide flash-attn-4, for the 'ours+FA4' rows")
parser.add_argument("--parts", type=str, default="speed,steps,walltime,bpb", help="which parts to run (see above)")
parser.add_argument("--depths", type=str, default="12,20", help="speed: depths")
parser.add_argument("--device-batches", type=str, default="12=32/64/128,20=32/64", help="speed: device batches tried per depth (each side keeps its fastest)")
parser.add_argument("--runs", type=int, default=3, help="quality: runs per setting")
parser.add_argument("--wall-seconds", type=float, default=120, help="walltime: seconds of training per run")
parser.add_argument("--parallel", type=int, default=3, help="quality: runs sharing the GPU at once")
parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
parser.add_argument("--report", action="store_true", help="only print the tables from --work-dir/results.jsonl")
args = parser.parse_args()


def fail(msg):
    sys.exit(f"vs_upstream: {msg}")


work = os.path.abspath(args.work_dir)
results_path = os.path.join(work, "results.jsonl")


def load_results():
    if not os.path.exists(results_path):
        return []
    with open(results_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record(row):
    with open(results_path, "a") as f:
        f.write(json.dumps(row) + "\n")


# -----------------------------------------------------------------------------
# The two harnesses: where they run, with which environment and flags


def side_env(side):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"))
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if side == "upstream":
        env["NANOCHAT_BASE_DIR"] = os.path.join(work, "upstream")
        path.insert(0, os.path.join(work, "stubs"))
    else:
        env["NANOCHAT_BASE_DIR"] = os.path.join(work, "ours")
        env["NANOCHAT_DATA_DIR"] = data_dir
        if side.endswith("FA4"):
            path.insert(0, fa4_path)
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def tree(side):
    return upstream if side == "upstream" else ours


def train_cmd(side, flags, tag, eval_tokens):
    """base_train's command line in either harness: the given recipe flags plus 'no extras'."""
    common = [f"--model-tag={tag}", "--core-metric-every=-1", "--sample-every=-1"]
    if side == "upstream":  # evaluates only with --eval-every > 0; always saves at the end
        steps = next(int(f.split("=")[1]) for f in flags if f.startswith("--num-iterations="))
        evals = [f"--eval-every={steps}", f"--eval-tokens={eval_tokens}"] if eval_tokens else ["--eval-every=-1"]
        return [sys.executable, "-m", "scripts.base_train", "--run=dummy"] + flags + common + evals
    return [sys.executable, "-m", "scripts.base_train"] + flags + common + [f"--eval-tokens={eval_tokens}", "--eval-every=-1"] + \
        ([] if eval_tokens else ["--save-every=0"])


def start(side, flags, tag, eval_tokens):
    os.makedirs(os.path.join(work, "logs"), exist_ok=True)
    log_path = os.path.join(work, "logs", f"{tag}.log")
    cmd = train_cmd(side, flags, tag, eval_tokens)
    print(f"== {tag} ({side}): {' '.join(cmd[2:])}", flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=tree(side), env=side_env(side), stdout=log, stderr=subprocess.STDOUT)
    return dict(side=side, tag=tag, proc=proc, log=log, t0=time.time(), fp8="--fp8" in flags)


def finish(run, warmup=0):
    """Wait for a run; parse its log into a result row (None if it failed), with the median step time over
    the steps from `warmup` on."""
    try:
        run["proc"].wait(timeout=max(1, args.timeout - (time.time() - run["t0"])))
    except subprocess.TimeoutExpired:
        run["proc"].kill()
        run["proc"].wait()
    run["log"].close()
    text = open(run["log"].name).read()
    steps = [(int(n), float(dt)) for n, dt in re.findall(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+) ?ms", text, re.M)]
    timed = [dt for n, dt in steps if n >= warmup]
    bpb = re.findall(r"Validation bpb: ([\d.]+)", text)
    decay = re.findall(r"Muon weight decay = .* = ([\d.]+)", text) or re.findall(r"Scaling weight decay from [\d.]+ to ([\d.]+)", text)
    peak = re.search(r"peak memory: ([\d.]+) GiB", text)
    if run["proc"].returncode != 0 or not timed:
        print(f"   {run['tag']}: failed (exit {run['proc'].returncode}): {' / '.join(text.strip().splitlines()[-3:])}", flush=True)
        return None
    if run["fp8"] and "continuing without fp8" in text:  # base_train fell back to bf16: not this run's setting
        print(f"   {run['tag']}: failed: --fp8 fell back to bf16", flush=True)
        return None
    attention = (re.findall(r"^attention: (.*)$", text, re.M) or [""])[0]
    if run["side"].endswith("FA4") and attention != "FlashAttention-4":  # --fa4-path did not provide a working FA4
        print(f"   {run['tag']}: failed: it ran {attention or 'unknown attention'}, not FlashAttention-4 "
              f"(check that --fa4-path imports: PYTHONPATH=... python -c 'import flash_attn.cute')", flush=True)
        return None
    return dict(side=run["side"], tag=run["tag"], log=run["log"].name, steps=steps[-1][0] + 1,
                step_ms=statistics.median(timed), steps_timed=len(timed), peak_gib=float(peak.group(1)) if peak else None,
                val_bpb=float(bpb[-1]) if bpb else None, muon_decay=float(decay[0]) if decay else None,
                attention=attention)


def drop_checkpoint(row):
    """Checkpoints are ~1-3 GB each: only the ones the bpb part scores are kept."""
    harness = "upstream" if row["side"] == "upstream" else "ours"
    shutil.rmtree(os.path.join(work, harness, "base_checkpoints", row["tag"]), ignore_errors=True)


# -----------------------------------------------------------------------------
# Preparation: data links, the wandb stub, each side's tokenizer


def prepare():
    shards = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    if len(shards) < 2:
        fail(f"--data-dir {data_dir} needs at least 2 parquet shards (train, then validation last); found {len(shards)}")
    up_data = os.path.join(work, "upstream", "base_data_climbmix")
    os.makedirs(up_data, exist_ok=True)
    for f in shards:
        link = os.path.join(up_data, f)
        if not os.path.lexists(link):
            os.symlink(os.path.join(data_dir, f), link)
    os.makedirs(os.path.join(work, "stubs", "wandb"), exist_ok=True)
    open(os.path.join(work, "stubs", "wandb", "__init__.py"), "a").close()
    for side, marker in (("ours", "tokenizer.tiktoken"), ("upstream", "tokenizer.pkl")):
        if os.path.exists(os.path.join(work, side, "tokenizer", marker)):
            continue
        cmd = [sys.executable, "-m", "scripts.tok_train"] + (["--data-dir", data_dir] if side == "ours" else ["--max-chars=2000000000"])
        print(f"== training {side}'s tokenizer: {' '.join(cmd[1:])}", flush=True)
        p = subprocess.run(cmd, cwd=tree(side), env=side_env(side), capture_output=True, text=True)
        if p.returncode != 0:
            fail(f"{side}'s tokenizer training failed: {(p.stdout + p.stderr).strip().splitlines()[-1:]}")
    return shards


# -----------------------------------------------------------------------------
# Parts


def speed():
    batches = {int(d): [int(b) for b in bs.split("/")] for d, _, bs in
               (item.partition("=") for item in args.device_batches.split(",") if item)}
    sides = ["upstream", "ours"] + (["ours+FA4"] if fa4_path else [])
    for depth in [int(d) for d in args.depths.split(",") if d]:
        n_steps, warmup = SPEED_STEPS.get(depth, (10, 4))
        ours_rows = []  # this depth's runs of ours without FA4: the fastest batch is the one FA4 and fp8 use
        for side in sides + (["ours+FA4 fp8" if fa4_path else "ours fp8"] if depth >= 20 else []):
            tried = batches.get(depth, [32]) if side in ("upstream", "ours") else \
                [max(ours_rows, key=lambda r: r["tok_s"])["device_batch"] if ours_rows else batches.get(depth, [32])[0]]
            for b in tried:
                flags = [f"--depth={depth}", "--window-pattern=L", f"--device-batch-size={b}",
                         f"--total-batch-size={RECIPE_BATCH}", f"--num-iterations={n_steps}"] + (["--fp8"] if "fp8" in side else [])
                run = start(side.replace(" fp8", ""), flags, f"speed_{side.replace(' ', '_').replace('+', '_')}_d{depth}_b{b}", 0)
                row = finish(run, warmup)
                if row is None:
                    continue
                row.update(part="speed", side=side, depth=depth, device_batch=b, tok_s=RECIPE_BATCH / row["step_ms"] * 1000)
                print(f"   {row['tok_s']:,.0f} tok/s ({row['step_ms']:.1f} ms/step, {row['steps_timed']} steps timed; "
                      f"{row['attention']})", flush=True)
                record(row)
                drop_checkpoint(row)
                if side == "ours":
                    ours_rows.append(row)


def run_queue(jobs, keep=lambda row: False):
    """jobs: (side, flags or a function giving them at start, tag, part, extra fields); --parallel at a time.
    keep(row): whether the run's checkpoint stays."""
    running = []
    while jobs or running:
        while jobs and len(running) < args.parallel:
            side, flags, tag, part, extra = jobs.pop(0)
            flags = flags() if callable(flags) else flags
            running.append((start(side, flags, tag, QUALITY_EVAL), part, extra))
        time.sleep(2)
        for item in [r for r in running if r[0]["proc"].poll() is not None or time.time() - r[0]["t0"] > args.timeout]:
            running.remove(item)
            run, part, extra = item
            row = finish(run)
            if row is not None:
                row.update(part=part, **extra)
                print(f"   {row['tag']}: val bpb {row['val_bpb']}, Muon decay {row['muon_decay']}, {row['steps']} steps", flush=True)
                record(row)
                if not keep(row):
                    drop_checkpoint(row)


def quality_side():
    return "ours+FA4" if fa4_path else "ours"


def steps_part():
    stamp = time.strftime("%H%M%S")
    own = [(quality_side(), QUALITY, f"steps_ours_{i}_{stamp}", "steps", dict(setting="own rule")) for i in range(args.runs)]
    up = [("upstream", QUALITY, f"steps_upstream_{i}_{stamp}", "steps", dict(setting="own rule")) for i in range(args.runs)]

    def matched_flags():
        """ours with --weight-decay scaled so that its printed Muon decay is upstream's (read from the first
        runs' logs, which print it at start)."""
        logs = [os.path.join(work, "logs", f"steps_{s}_0_{stamp}.log") for s in ("ours", "upstream")]
        for _ in range(300):
            found = [re.findall(r"Muon weight decay = ([\d.]+) x .* = ([\d.]+)", open(logs[0]).read()) if os.path.exists(logs[0]) else [],
                     re.findall(r"Scaling weight decay from [\d.]+ to ([\d.]+)", open(logs[1]).read()) if os.path.exists(logs[1]) else []]
            if all(found):
                break
            time.sleep(2)
        else:
            fail("the first equal-steps runs did not print their Muon weight decay (see their logs)")
        (ours_wd, ours_decay), = found[0][:1]
        target = float(found[1][0])
        return QUALITY + [f"--weight-decay={float(ours_wd) * target / float(ours_decay):.6g}"]

    matched = [(quality_side(), matched_flags, f"steps_matched_{i}_{stamp}", "steps", dict(setting="decay matched"))
               for i in range(args.runs)]
    jobs = [j for trio in zip(own, up, matched) for j in trio]  # interleaved, so drift hits every setting alike
    run_queue(jobs, keep=lambda row: row["setting"] == "own rule" and f"_0_{stamp}" in row["tag"])  # for the bpb part


def walltime_part():
    stamp = time.strftime("%H%M%S")
    speed_rows = [r for r in load_results() if r["part"] == "speed" and r["depth"] == WALL_DEPTH]
    per_side = []
    for side in (quality_side(), "upstream"):
        rows = [r for r in speed_rows if r["side"] == side]
        if not rows:
            fail(f"walltime needs the speed part's d{WALL_DEPTH} figure of {side!r} in {results_path}: run --parts speed first")
        best = max(rows, key=lambda r: r["tok_s"])
        n = max(1, round(args.wall_seconds * 1000 / best["step_ms"]))
        flags = [f"--depth={WALL_DEPTH}", "--window-pattern=L", f"--device-batch-size={best['device_batch']}",
                 f"--total-batch-size={RECIPE_BATCH}", f"--num-iterations={n}"]
        name = "ours" if side.startswith("ours") else "upstream"
        per_side.append([(side, flags, f"wall_{name}_{i}_{stamp}", "walltime",
                          dict(setting=f"{args.wall_seconds:.0f} s", calibration_step_ms=best["step_ms"])) for i in range(args.runs)])
    run_queue([j for pair in zip(*per_side) for j in pair])


SCORER_SELECTIONS = {  # dev/score_bpb.py's text and rows, four ways (its docstring)
    "heads": [],  # each document's head, as far as one row of the context holds it
    "heads, all documents": ["--docs=0"],  # the same over the whole validation file
    "heads, packed": ["--packed"],  # the first selection's tokens, several documents to a row
    "5000 chars": ["--min-chars=5000", "--chars=5000"],  # the first 5,000 characters of documents that have them
}


def bpb_part():
    val = os.path.join(data_dir, sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))[-1])
    rows = load_results()
    for side in (quality_side(), "upstream"):
        runs = [r for r in rows if r["part"] == "steps" and r["side"] == side and r.get("setting") == "own rule"
                and os.path.isdir(os.path.join(work, "upstream" if side == "upstream" else "ours", "base_checkpoints", r["tag"]))]
        if not runs:
            fail(f"bpb needs a saved equal-steps run of {side!r} in {work}: run --parts steps first")
        run = runs[0]
        harness = "upstream" if side == "upstream" else "ours"
        ckpt = os.path.join(work, harness, "base_checkpoints", run["tag"])
        for selection, flags in SCORER_SELECTIONS.items():
            cmd = [sys.executable, os.path.join(ours, "dev", "score_bpb.py"), "--harness", harness, "--root", tree(side),
                   "--checkpoint-dir", ckpt, "--val", val] + flags + \
                (["--tokenizer-dir", os.path.join(work, "ours", "tokenizer")] if harness == "ours" else [])
            print(f"== scoring {run['tag']}: {' '.join(cmd[1:])}", flush=True)
            p = subprocess.run(cmd, cwd=tree(side), env=side_env(side), capture_output=True, text=True, timeout=args.timeout)
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
            record(row)


# -----------------------------------------------------------------------------
# The tables


def spread(values):
    v = sorted(values)
    return f"{statistics.median(v):.4f} ({v[0]:.4f} - {v[-1]:.4f}, n={len(v)})" if v else "-"


def report():
    rows = load_results()
    speed_rows = [r for r in rows if r["part"] == "speed"]
    if speed_rows:
        print("\n| depth | side | device batch | tok/s | vs upstream | step ms | peak GiB | attention |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for depth in sorted({r["depth"] for r in speed_rows}):
            best = {}
            for r in speed_rows:
                if r["depth"] == depth and (r["side"] not in best or r["tok_s"] > best[r["side"]]["tok_s"]):
                    best[r["side"]] = r
            up = best.get("upstream")
            for side, r in best.items():
                ratio = f"{r['tok_s'] / up['tok_s']:.3f}x" if up else "-"
                print(f"| d{depth} | {side} | {r['device_batch']} | {r['tok_s']:,.0f} | {ratio} | {r['step_ms']:.1f} | "
                      f"{r['peak_gib'] or '-'} | {r['attention'][:60]} |")
            bf16 = [best[s] for s in ("ours+FA4", "ours") if s in best]
            for fp8 in [best[s] for s in ("ours+FA4 fp8", "ours fp8") if s in best]:
                same = next((b for b in bf16 if ("FA4" in b["side"]) == ("FA4" in fp8["side"])), None)
                if same:
                    print(f"| d{depth} | {fp8['side']} / {same['side']} | | | {fp8['tok_s'] / same['tok_s']:.3f}x (fp8 / bf16) | | | |")
    quality = [r for r in rows if r["part"] in ("steps", "walltime")]
    if quality:
        print("\n| setting | side | val bpb: median (min - max, n) | each run | Muon decay | steps |")
        print("| --- | --- | --- | --- | --- | --- |")
        keys = []
        for r in quality:
            key = (r["part"], r.get("setting"), "upstream" if r["side"] == "upstream" else "ours")
            if key not in keys:
                keys.append(key)
        for part, setting, side in keys:
            runs = [r for r in quality if (r["part"], r.get("setting"), "upstream" if r["side"] == "upstream" else "ours") == (part, setting, side)]
            vals = [r["val_bpb"] for r in runs if r["val_bpb"] is not None]
            label = ("equal steps, " + setting) if part == "steps" else f"equal time ({setting} training)"
            print(f"| {label} | {side} | {spread(vals)} | {', '.join(f'{v:.4f}' for v in vals)} | "
                  f"{runs[0]['muon_decay']} | {', '.join(str(r['steps']) for r in runs)} |")
    for r in [r for r in rows if r["part"] == "bpb"]:
        print(f"\nindependent bpb, {r['side']} ({r['tag']}, {r.get('selection', '5000 chars')}): own {r['own_bpb']:.4f}, "
              f"scorer {r['score_bpb']:.4f}, difference {r['own_bpb'] - r['score_bpb']:+.4f} ({r['docs']} docs, "
              f"{r['bytes']:,} bytes, {r['tokens']:,} tokens)")


if args.report:
    report()
    sys.exit(0)
if not args.upstream or not os.path.exists(os.path.join(args.upstream, "scripts", "base_train.py")):
    fail(f"--upstream {args.upstream}: give the root of an upstream nanochat checkout (with scripts/base_train.py)")
if not args.data_dir or not os.path.isdir(args.data_dir):
    fail(f"--data-dir {args.data_dir}: give a folder of parquet shards (or set NANOCHAT_DATA_DIR)")
if args.fa4_path and not any(os.path.isdir(os.path.join(p, "flash_attn")) for p in args.fa4_path.split(os.pathsep)):
    fail(f"--fa4-path {args.fa4_path}: no flash_attn package there")
upstream, ours, data_dir = os.path.abspath(args.upstream), os.path.abspath(args.ours), os.path.abspath(args.data_dir)
fa4_path = os.pathsep.join(os.path.abspath(p) for p in args.fa4_path.split(os.pathsep)) if args.fa4_path else None
os.makedirs(work, exist_ok=True)
prepare()
parts = {"speed": speed, "steps": steps_part, "walltime": walltime_part, "bpb": bpb_part}
for name in [p for p in args.parts.split(",") if p]:
    if name not in parts:
        fail(f"--parts {args.parts!r}: use some of {', '.join(parts)}")
    parts[name]()
report()
