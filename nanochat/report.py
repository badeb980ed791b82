"""
The run report: each stage writes its section in $NANOCHAT_BASE_DIR/report/ (stages run, fail and re-run alone);
generate() stitches them into report.md with a summary, loss curve, wall time and cost, and the stages not run.

    python -m nanochat.report reset               # start a new report (writes the environment section)
    python -m nanochat.report stage NAME SECONDS  # record a stage's wall time
    python -m nanochat.report generate            # write report.md
"""

import os
import re
import sys
import json
import time
import socket
import datetime
import platform
import subprocess
from pathlib import Path

from nanochat.common import UserError, atomic_write, get_base_dir, get_rank, read_json

# Sections in the order the pipeline produces them; anything else is appended after.
SECTION_ORDER = ["Environment", "Tokenizer training", "Tokenizer evaluation", "Base model training",
                 "Base model evaluation", "Base model samples", "Stage wall times"]
# What the summary table shows: {section: [(key as written by the stage, label)]}
SUMMARY_KEYS = {
    "Tokenizer evaluation": [("val ours bytes/token", "tokenizer bytes/token (val)")],
    "Base model training": [("parameters", "parameters"), ("tokens trained", "tokens trained"),
                            ("minimum validation bpb", "min val bpb (training)"),
                            ("training time (min)", "training time (min)"), ("mfu (%)", "MFU (%)")],
    "Base model evaluation": [("train bpb", "train bpb"), ("val bpb", "val bpb"), ("CORE", "CORE")],
    "Stage wall times": [("total of stages (min)", "pipeline wall time (min)")],
}
GPU_HOUR_USD = float(os.environ.get("NANOCHAT_GPU_HOUR_USD", "3.0"))  # the stated price for the cost line


def report_dir():
    d = os.path.join(get_base_dir(), "report")
    os.makedirs(d, exist_ok=True)
    return d


def slug(title):
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _format_value(v):
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.6f}".rstrip("0").rstrip(".")
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def log_section(title, items):
    """Write one stage's section (rank 0 only): dicts become `- key: value` lines, strings stay as they are."""
    if get_rank() != 0:
        return
    lines = [f"## {title}", f"_timestamp: {datetime.datetime.now():%Y-%m-%d %H:%M:%S}_", ""]
    for item in items:
        lines += [f"- {k}: {_format_value(v)}" for k, v in item.items()] if isinstance(item, dict) else [str(item)]
        lines.append("")
    Path(report_dir(), f"{slug(title)}.md").write_text("\n".join(lines) + "\n")


def environment():
    import torch

    def git(*args):  # "" without git or outside a checkout
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                                  cwd=os.path.dirname(__file__)).stdout.strip()
        except Exception:
            return ""
    dirty = " (dirty)" if git("status", "--porcelain") else ""
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu cores": os.cpu_count(),
            "git commit": (git("rev-parse", "--short", "HEAD") or "unknown") + dirty,
            "git branch": git("rev-parse", "--abbrev-ref", "HEAD") or "unknown", "gpus": "none (cpu)"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({"gpus": f"{torch.cuda.device_count()} x {props.name}",
                     "gpu memory (GiB)": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda})
    return info


def reset():
    if get_rank() != 0:
        return
    d = report_dir()
    for f in os.listdir(d):
        if f.endswith((".md", ".csv", ".png", ".json")):
            os.remove(os.path.join(d, f))
    Path(d, "run.json").write_text(json.dumps({"start_time": time.time()}))
    log_section("Environment", [environment()])


def log_stage_time(name, seconds, mode="replace"):
    """Record how long a pipeline stage took (speedrun.sh calls this after each stage): replacing the time of its last
    run, or added to it (mode "add": a training resumed after a stop)."""
    path = os.path.join(report_dir(), "stages.json")
    stages = read_json(path, {})
    stages[name] = stages.get(name, 0) * (mode == "add") + float(seconds)
    atomic_write(path, json.dumps(stages).encode())  # a stage cut off mid-write leaves the earlier times
    rows = ["| stage | wall time |", "| --- | --- |"] + [f"| {k} | {v / 60:.2f} min |" for k, v in stages.items()]
    log_section("Stage wall times", [{"total of stages (min)": round(sum(stages.values()) / 60, 2)}, "\n".join(rows)])


def plot_loss_curve(metrics, png_path):
    """Training loss (and val bpb where measured) vs step from metrics.jsonl; a note when it cannot plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(loss-curve figure skipped: matplotlib is not installed; `pip install matplotlib`)"
    from nanochat.run_log import Run
    run = Run(metrics)
    losses, vals = run.series("loss_smooth"), run.series("val_bpb")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(losses), list(losses.values()), label="train loss (nats/token, EMA)")
    ax.set(xlabel="step", ylabel="train loss")
    if vals:
        ax2 = ax.twinx()
        ax2.plot(list(vals), list(vals.values()), "o-", color="tab:red", label="val bpb")
        ax2.set_ylabel("val bpb")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def generate():
    d = report_dir()
    sections = {f[:-3]: Path(d, f).read_text() for f in os.listdir(d) if f.endswith(".md") and f != "report.md"}
    ordered = [slug(t) for t in SECTION_ORDER if slug(t) in sections]
    ordered += sorted(k for k in sections if k not in ordered)
    out = ["# nanochat run report", "", f"_generated: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}_", ""]
    # per section, its `- key: value` lines (values as written)
    pairs = {k: dict(re.findall(r"^- ([^:\n]+): (.*)$", text, re.M)) for k, text in sections.items()}
    train = pairs.get("base-model-training", {})
    rows = [(label, pairs[slug(section)][key]) for section, keys in SUMMARY_KEYS.items() for key, label in keys
            if key in pairs.get(slug(section), {})]
    stages, start = read_json(os.path.join(d, "stages.json"), {}), read_json(os.path.join(d, "run.json"), {}).get("start_time")
    if stages or start:  # the stages' own times where recorded: not the waits between them, nor a later regeneration
        wall = sum(stages.values()) if stages else time.time() - start
        # GPUs billed: those the training used, else every visible one (environment)
        m = re.match(r"(\d+) x", pairs.get("environment", {}).get("gpus", ""))
        n_gpus = int(train["gpus used"].replace(",", "")) if "gpus used" in train else int(m.group(1) if m else 0)
        rows.append(("total wall time", f"{wall / 3600:.2f} h ({wall / 60:.1f} min" +
                     (", the stages' sum)" if stages else ", since the report was started)")))
        rows.append((f"cost at ${GPU_HOUR_USD:.2f}/GPU-hour (NANOCHAT_GPU_HOUR_USD)",
                     f"${wall / 3600 * n_gpus * GPU_HOUR_USD:.2f} ({n_gpus} GPUs)" if n_gpus else "$0.00 (CPU run)"))
    out += ["## Summary", "", "| metric | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    if absent := [t for t in SECTION_ORDER if slug(t) not in sections]:
        out += [f"Not in this report (the stage did not run, or did not finish): {', '.join(absent)}.", ""]
    if (metrics := train.get("metrics")) and os.path.exists(metrics):
        note = plot_loss_curve(metrics, os.path.join(d, "loss_curve.png"))
        out += ["## Loss curve", "", note if note else "![loss curve](loss_curve.png)", ""]
    out += [sections[key] for key in ordered]
    path = os.path.join(d, "report.md")
    Path(path).write_text("\n".join(out))
    return path


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "generate"
    try:
        if cmd == "reset":
            reset()
            print(f"new report started in {report_dir()}")
        elif cmd == "generate":
            print(f"wrote {generate()}")
        elif cmd == "stage" and len(sys.argv) in (4, 5) and sys.argv[3].replace(".", "", 1).isdigit() and \
                sys.argv[4:] in ([], ["add"], ["replace"]):
            log_stage_time(*sys.argv[2:])
        else:
            raise SystemExit("usage: python -m nanochat.report [reset | generate | stage NAME SECONDS [add|replace]]")
    except UserError as e:  # e.g. a base dir that cannot be made
        raise SystemExit(f"ERROR: {e}") from None
