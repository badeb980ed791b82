"""
Depth ladder: does a change pay, in compute and in wall clock? Trains side A (the baseline) and side B (the change)
at several depths on the same data and tokens per scaling parameter (--ratio), a few seeds each, scores every run's
final model on the same validation tokens, and prints per depth and side the val bpb (each run's, with the loss or
gradient-norm spikes it had; median and spread over the seeds), tok/s, training FLOPs and seconds, and B's two
multipliers:

- compute multiplier: the training FLOPs A needs to reach B's bpb, read off A's ladder (log FLOPs against bpb,
  interpolated between A's depths), divided by B's FLOPs. Above 1, B gets there with less compute;
- wall-clock multiplier: the same in seconds of training (steps x the median step time from step 10 on: compilation
  left out). A multiplier read beyond the ends of A's ladder is extrapolated from its nearest segment (marked ~);
  where A's bpb does not fall with every step up the ladder (noise), a least-squares line is used (marked *, *~ beyond the ends).

The sides are given as in dev/quality_ab.py (a checkout, environment settings, extra base_train flags); --args
go to both. Both sides must train at the same --max-seq-len (the same validation tokens then hold the same bytes).
A plot of bpb against FLOPs and against seconds goes to <out>/ladder.png.

    python -m dev.ladder --b-args=--l3-after-layers=5                           # dense against L3: d8 d10 d12
    python -m dev.ladder --b-args=--fp8 --depths 8,10,12,14 --seeds 3 --ratio 4 --gpus 0,1,2,3
    python -m dev.ladder --a-tree ../nanochat-old --b-tree .                    # two commits

The defaults (d8, d10, d12, one seed a side) are the short ladder. Its runs are short: most of a run is start-up,
compilation and the final evaluation (at --ratio 0.25 on one H100, 80-100 s a run of which 10-60 s trained: 12
minutes for the six; on one H200 two at a time, --gpus 0,0, with 131,072-token steps: 7.6 minutes), and a run of fewer steps than --warmup-steps (40) never reaches its peak learning rate (at
0.25, d8-d12 train 33-53 steps): take --ratio 1 or more to judge a change. A long ladder runs in parts: each
finished run is kept in <out>/results.jsonl, --stop-after MINUTES starts no run after that many minutes, and the
same command again runs only what is missing (a run of another configuration, data or commit, or of
uncommitted changes since, is never counted). A runs go out over --gpus, one per GPU at a time, and each B run
follows its A run (same depth and seed) on the same GPU (GPUs differ by 2-3%); a GPU named twice runs two at a time,
and the tok/s, seconds and wall-clock multipliers of its runs are then of a shared GPU (the table says so, and when
its runs came from several kinds of GPU). Needs data and a tokenizer as base_train does (--data-dir, --base-dir).
"""

import os
import json
import math
import shlex
import time
import statistics

from dev import runs

EVAL_TOKENS = 2 ** 21  # the final val bpb of every run: the same 2M validation tokens


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    runs.add_side_args(parser)
    parser.add_argument("--args", type=str, default="", help="base_train flags for both sides, one string")
    parser.add_argument("--depths", type=str, default="8,10,12",
                        help="comma-separated depths, two or more (three or more to trust the multipliers)")
    parser.add_argument("--seeds", type=int, default=1, help="runs per depth and side (seeds 42, 43, ...)")
    parser.add_argument("--ratio", type=float, default=1.0, help="tokens per scaling parameter at every depth")
    parser.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="validation tokens of each run's score")
    parser.add_argument("--gpus", type=str, default="0",
                        help="comma-separated GPU indices, one run on each at a time (a GPU named twice: two)")
    parser.add_argument("--stop-after", type=float, default=None, metavar="MINUTES",
                        help="start no run after this many minutes (the same command again goes on)")
    parser.add_argument("--out", type=str, default="ladder_out", help="logs, results.jsonl and ladder.png")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one run may take")
    runs.add_data_args(parser)
    args = parser.parse_args(argv)
    depths = sorted({int(d) for d in args.depths.split(",") if d})
    if len(depths) < 2:
        raise SystemExit(f"--depths {args.depths}: give at least two depths (three or more to trust the multipliers)")
    common = shlex.split(args.args)
    sides = {"A": runs.side_spec(args, "a"), "B": runs.side_spec(args, "b")}
    seq = {s: runs.flag_value(common + spec["extra"], "--max-seq-len") for s, spec in sides.items()}
    if seq["A"] != seq["B"]:
        raise SystemExit(f"--max-seq-len {seq['A']} (A) and {seq['B']} (B): the sides must score the same bytes")
    for s, spec in sides.items():  # base_train scores whole micro-batches: the same tokens only if both divide
        if (scored := runs.scored_tokens(common + spec["extra"], args.eval_tokens)) != args.eval_tokens:
            raise SystemExit(f"--eval-tokens {args.eval_tokens}: side {s} scores {scored} (whole micro-batches): the "
                             f"sides must score the same bytes; give a multiple of both sides' micro-batches")
    shell = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NANOCHAT_")}
    for s, spec in sides.items():  # what a run's result depends on: its code, data, settings and flags
        spec["config"] = json.dumps([spec["tree"], runs.tree_version(spec["tree"], args.out),
                                     {**shell, **runs.data_env(args)}, spec["env"], common + spec["extra"], args.ratio,
                                     args.eval_tokens])
        print(f"side {s}: {spec['name']}")

    # what earlier parts finished, of this configuration
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.jsonl")
    results = []
    if os.path.exists(results_path):
        with open(results_path) as f:
            results = [r for r in map(json.loads, f) if r["config"] == sides[r["side"]]["config"]]
    done = {(r["side"], r["depth"], r["seed"]) for r in results}
    todo = [(s, d, 42 + k) for d in depths for k in range(args.seeds) for s in "AB" if (s, d, 42 + k) not in done]
    follows = {("A", d, seed): ("B", d, seed) for s, d, seed in todo if s == "B" and ("A", d, seed) in todo}
    queue = [task for task in todo if task not in follows.values()]  # a B whose A is to run goes after it
    if done:
        print(f"done in an earlier part ({results_path}): {len(done)} runs; to go: {len(todo)}")
    all_gpus = [g for g in args.gpus.split(",") if g]

    def launch(task, gpus):
        s, depth, seed = task
        spec = sides[s]
        flags = [f"--depth={depth}", f"--target-param-data-ratio={args.ratio}", f"--seed={seed}", "--eval-every=-1",
                 f"--eval-tokens={args.eval_tokens}", "--save-every=0"] + runs.QUIET + common + spec["extra"]
        job = runs.start(flags, runs.call_tag(args.out, f"ladder_{s}_d{depth}_s{seed}"), tree=spec["tree"], gpus=gpus, timeout=args.timeout,
                         env={**runs.data_env(args), **spec["env"]},
                         log=os.path.join(args.out, f"{s}_d{depth}_s{seed}.log"))
        print(f"== {s} d{depth} seed {seed} on GPU {gpus[0]}: {' '.join(job.cmd[1:])} (log {job.log_path})", flush=True)
        return job

    def finished(task, job, gpus):  # the run's record; then its B run, on the same GPU
        record_run(task, job, gpus)
        return follows.get(task)

    def record_run(task, job, gpus):
        s, depth, seed = task
        try:
            run = job.run()
        except runs.RunFailed as e:
            print(f"   {s} d{depth} seed {seed}: failed: {e}", flush=True)
            return
        h, steps = run.header, max(run.series("dt")) + 1
        if "flops_per_token" not in h:  # a tree from before the run record prints no FLOPs
            print(f"   {s} d{depth} seed {seed}: failed: its tree records no FLOPs per token (too old for a ladder)")
            return
        summary = runs.summary(run, min(runs.FIRST_TIMED_STEP, steps // 2))
        if summary["val_bpb"] is None:
            print(f"   {s} d{depth} seed {seed}: failed: no val bpb recorded (see {job.log_path})", flush=True)
            return
        record = dict(config=sides[s]["config"], side=s, depth=depth, seed=seed, val_bpb=summary["val_bpb"],
                      spikes=len(run.series("spikes")),  # steps where a loss or gradient-norm spike began
                      tok_per_sec=summary["tok_per_sec"], steps=steps, seconds=steps * summary["step_ms"] / 1000,
                      flops=h["flops_per_token"] * h["total_batch_size"] * steps, log=job.log_path,
                      device=h.get("device"), gpu=gpus[0], shared=all_gpus.count(gpus[0]) > 1)
        results.append(record)
        with open(results_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"   {s} d{depth} seed {seed}: " + ("diverged, " if not math.isfinite(record["val_bpb"]) else "") +
              f"val bpb {record['val_bpb']:.4f}, {record['spikes']} spikes, "
              f"{record['tok_per_sec']:,.0f} tok/s, "
              f"{record['flops']:.3e} FLOPs, {record['seconds']:.1f} s", flush=True)

    deadline = time.time() + 60 * args.stop_after if args.stop_after is not None else None
    runs.run_queue(queue, all_gpus, launch, finished, deadline)
    recorded = {(r["side"], r["depth"], r["seed"]) for r in results}
    left = [task for task in todo if task not in recorded]  # not started, or failed: the next part runs them
    print(table(sides, depths, results))
    if any(r.get("shared") for r in results):
        print("(GPUs named twice ran two runs at once: tok/s, seconds and the wall-clock multipliers are of shared GPUs)")
    if len(devices := sorted({r["device"] for r in results if r.get("device")})) > 1:
        print(f"(runs on {', '.join(devices)}: tok/s, seconds and the wall-clock multipliers mix them)")
    plot(sides, depths, results, os.path.join(args.out, "ladder.png"))
    if left:
        why = f"stopped after {args.stop_after} minutes" if deadline and time.time() >= deadline else "runs failed"
        print(f"\n{why}, with {len(left)} runs to go: run the same command again")


def per_depth(results, side, depths):
    """{depth: the side's runs there that did not diverge} for the depths where it has any (a diverged run's bpb,
    NaN or infinite, is shown in the table and never enters a median, a spread, a ladder or the plot)."""
    return {d: rs for d in depths if (rs := [r for r in results if r["side"] == side and r["depth"] == d
                                             and math.isfinite(r["val_bpb"])])}


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def equivalent(ladder, bpb):
    """log x at which A's ladder [(log x, bpb) by depth] reaches `bpb`, and a mark: "" interpolated, "~" from the
    nearest segment beyond the ends, "*" from a least-squares line (A's bpb does not fall at every step; "*~" beyond
    the ends)."""
    xs, ys = zip(*sorted(ladder))
    if all(b < a for a, b in zip(ys, ys[1:])):
        k = next((i for i in range(len(ys) - 1) if ys[i + 1] <= bpb <= ys[i]), None)
        mark = "" if k is not None else "~"
        k = k if k is not None else (0 if bpb > ys[0] else len(ys) - 2)
        return xs[k] + (bpb - ys[k]) * (xs[k + 1] - xs[k]) / (ys[k + 1] - ys[k]), mark
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    x = mx + (bpb - my) / slope if slope < 0 else math.nan
    return x, "*~" if not math.isnan(x) and not xs[0] <= x <= xs[-1] else "*"


def table(sides, depths, results):
    """Per depth and side: runs, bpb (each, median, spread), tok/s, FLOPs, seconds; B's multipliers."""
    a, b = per_depth(results, "A", depths), per_depth(results, "B", depths)
    ladders = {key: [(math.log(med(rs, key)), med(rs, "val_bpb")) for rs in a.values()] for key in ("flops", "seconds")}
    lines = ["", "| depth | side | runs | val bpb (each) | median | spread | tok/s | training FLOPs | seconds | "
             "compute x | wall-clock x |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in depths:
        for s, rs in (("A", a.get(d)), ("B", b.get(d))):
            diverged = sum(r["side"] == s and r["depth"] == d and not math.isfinite(r["val_bpb"]) for r in results)
            runs_cell = runs.counted(len(rs or []), diverged)
            if not rs:
                lines.append(f"| d{d} | {s} | {runs_cell} | | | | | | | | |")
                continue
            rs = sorted(rs, key=lambda r: r["seed"])
            bpbs = [r["val_bpb"] for r in rs]
            each = [f"{r['val_bpb']:.4f}" + (f" ({r['spikes']} spikes)" if r.get("spikes") else "") for r in rs]
            mult = {}
            for key in ("flops", "seconds"):
                if s == "B" and len(ladders[key]) >= 2:
                    x, mark = equivalent(ladders[key], statistics.median(bpbs))
                    m = math.exp(x) / med(rs, key) if not math.isnan(x) else math.nan
                    mult[key] = "n/a" if math.isnan(m) else f"{mark}{m:.2f}" if m >= 0.1 else f"{mark}{m:.1e}"
            lines.append(f"| d{d} | {s} | {runs_cell} | {', '.join(each)} | "
                         f"{statistics.median(bpbs):.4f} | {max(bpbs) - min(bpbs):.4f} | "
                         f"{med(rs, 'tok_per_sec'):,.0f} | "
                         f"{med(rs, 'flops'):.3e} | {med(rs, 'seconds'):.1f} | {mult.get('flops', '')} | "
                         f"{mult.get('seconds', '')} |")
    lines.append("\nA: " + sides["A"]["name"] + "\nB: " + sides["B"]["name"])
    return "\n".join(lines)


def plot(sides, depths, results, path):
    """bpb against training FLOPs and against seconds, both sides, median and spread per depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "flops", "training FLOPs"), (axes[1], "seconds", "training seconds")):
        for s in "AB":
            points = per_depth(results, s, depths)
            if not points:
                continue
            xs = [med(rs, key) for rs in points.values()]
            ys = [med(rs, "val_bpb") for rs in points.values()]
            spread = [[y - min(r["val_bpb"] for r in rs) for y, rs in zip(ys, points.values())],
                      [max(r["val_bpb"] for r in rs) - y for y, rs in zip(ys, points.values())]]
            ax.errorbar(xs, ys, yerr=spread, marker="o", capsize=3, label=f"{s}: {sides[s]['name']}")
            for x, y, d in zip(xs, ys, points):
                ax.annotate(f"d{d}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("val bpb")
        if ax.get_legend_handles_labels()[0]:  # a part whose runs all failed draws none
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
