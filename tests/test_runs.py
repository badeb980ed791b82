"""The pipeline scripts end to end at CPU scale: speedrun.sh (the runcpu settings) writes a report whose
numbers are the ones the stages printed, skips finished stages when re-run with their settings, and runs a stage
again with the ones after it when its settings changed or its training was stopped; scaling_laws.sh and
miniseries.sh fill their CSVs on the bundled sample (the CORE bundle is the tests' own small one)."""

import os
import re
import csv
import subprocess
import sys


from conftest import REPO, SAMPLE_DATA, CORE_BUNDLE as BUNDLE, read_run
TINY = ("--aspect-ratio 32 --head-dim 32 --max-seq-len 128 --window-pattern SL --device-batch-size 8 "
        "--total-batch-size 2048 --warmup-steps 3 --eval-tokens 8192")


def bash(script, env, timeout=900):
    p = subprocess.run(["bash", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} failed:\n{p.stdout[-5000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_speedrun_cpu_scale_report(tmp_path, env):
    e = dict(env, NANOCHAT_BASE_DIR=str(tmp_path), PYTHON=sys.executable, NPROC="1", DEPTH="2", MODEL_TAG="tiny",
             DEVICE_BATCH_SIZE="8", NANOCHAT_DATA_DIR=SAMPLE_DATA, EVAL_BUNDLE=BUNDLE,
             TOK_ARGS="--vocab-size 1024 --max-chars 3000000", TRAIN_ARGS=TINY + " --num-iterations 12 --eval-every 5",
             EVAL_ARGS="--max-per-task 4 --eval-tokens 8192")
    stopped = bash("speedrun.sh", dict(e, TRAIN_ARGS=e["TRAIN_ARGS"] + " --stop-at-step 6"))  # a stop is no finish
    assert "training stopped before its last step" in stopped and "--- eval" not in stopped
    import json  # the stopped launch's time is in the report's stage times too (the resumed launch's adds to it)
    stopped_time = json.load(open(tmp_path / "report" / "stages.json"))["train"]
    out = bash("speedrun.sh", e)  # the training's settings changed: it runs again (resumes), and the stages after it
    times = json.load(open(tmp_path / "report" / "stages.json"))
    assert times["train"] >= stopped_time and not os.path.exists(tmp_path / "speedrun" / "train.stopped")
    assert "--- tokenizer: done before" in out and "training from step 6 to 12" in out and "--- eval\n" in out
    report = open(tmp_path / "report" / "report.md").read()
    for section in ("## Summary", "## Environment", "## Tokenizer training", "## Tokenizer evaluation",
                    "## Base model training", "## Base model evaluation", "## Base model samples", "## Stage wall times",
                    "git commit:", "cost at", "| capitals |"):
        assert section in report, section
    assert "![loss curve](loss_curve.png)" in report and os.path.exists(tmp_path / "report" / "loss_curve.png")
    run = read_run(e, "tiny")  # the run's metrics.jsonl, which the loss curve is drawn from
    assert sorted(run.losses()) == list(range(12)) and sorted(run.series("val_bpb")) == [5, 10, 12]
    assert f"- metrics: {run.path}" in report
    # the numbers in the report are the ones the stages printed
    val_bpb = re.search(r"^val bpb: ([\d.]+)$", out, re.M).group(1)
    core = re.search(r"^CORE \(3/4 tasks\): (-?[\d.]+)$", out, re.M).group(1)
    assert f"| val bpb | {val_bpb}" in report
    reported = re.search(r"^\| CORE \| (-?[\d.]+) \|$", report, re.M).group(1)  # 6 decimals, printed with 4
    assert f"{float(reported):.4f}" == core, (reported, core)
    final = re.search(r"^Validation bpb: ([\d.]+)$", out, re.M).group(1)
    assert f"- final validation bpb: {final}" in report
    assert "- tokens trained: 24,576" in report  # 12 steps x 2048 tokens
    bpt = re.search(r"^val\s+ours\s+[\d,]+\s+[\d,]+\s+([\d.]+)$", stopped, re.M).group(1)  # tok_eval ran then
    assert f"- val ours bytes/token: {bpt}" in report
    assert os.path.exists(tmp_path / "speedrun.log")
    # a second run skips what finished and still writes the report
    again = bash("speedrun.sh", e)
    for stage in ("data", "tokenizer", "tok_eval", "train", "eval", "sample"):
        assert f"--- {stage}: done before, skipping" in again
    assert "speedrun finished" in again
    # a training setting changed after the run finished: a wrap-up again (its time adds to the training's, not
    # replaces it), then the stages after it; those before it stay done
    wrap = bash("speedrun.sh", dict(e, TRAIN_ARGS=e["TRAIN_ARGS"] + " --sample-every -1"))
    assert "--- tok_eval: done before" in wrap and "training from step 12 to 12" in wrap and "--- eval\n" in wrap \
        and "--- sample\n" in wrap, wrap[-3000:]
    assert json.load(open(tmp_path / "report" / "stages.json"))["train"] >= times["train"]
    # another horizon on the same tag: the resume is refused, and speedrun says what works within it
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO, env=dict(e, RATIO="13"), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 1 and "give another MODEL_TAG=NAME (or TRAIN_ARGS=--start-over" in p.stdout, p.stdout[-2000:]


def test_scaling_laws_and_miniseries_small(tmp_path, env, base_dir):
    e = dict(env, PYTHON=sys.executable, NANOCHAT_DATA_DIR=SAMPLE_DATA, DEPTHS="2", FLOPS="3e10 1e11", TRAIN_ARGS=TINY)
    bash("runs/scaling_laws.sh", e)
    rows = list(csv.DictReader(open(os.path.join(base_dir, "scaling_laws.csv"))))
    assert [(r["budget"], r["depth"]) for r in rows] == [("3e10", "2"), ("1e11", "2")]
    for r in rows:  # what was done is within a step of the budget
        assert abs(float(r["flops"]) - float(r["budget"])) / float(r["budget"]) < 0.1
    for r in rows:
        assert float(r["val_bpb"]) > 0 and int(r["params"]) > int(r["scaling_params"]) > 0
    # more FLOPs, more tokens for the same depth
    assert int(rows[1]["tokens"]) > int(rows[0]["tokens"])
    again = bash("runs/scaling_laws.sh", e)  # goes on where it stopped: nothing is trained again
    assert again.count("in " + os.path.join(base_dir, "scaling_laws.csv") + " already, skipped") == 2, again
    assert list(csv.DictReader(open(os.path.join(base_dir, "scaling_laws.csv")))) == rows
    p = subprocess.run([sys.executable, "-m", "dev.plot_scaling", os.path.join(base_dir, "scaling_laws.csv"),
                        "--out", str(tmp_path / "s.png")], cwd=REPO, env=e, capture_output=True, text=True)
    assert p.returncode == 0 and "best val bpb per FLOP budget" in p.stdout
    e = dict(e, DEPTHS="2", RATIO="0.5", EVAL_BUNDLE=BUNDLE, EVAL_ARGS="--max-per-task 2 --eval-tokens 8192")
    bash("runs/miniseries.sh", e)
    rows = list(csv.DictReader(open(os.path.join(base_dir, "miniseries.csv"))))
    assert len(rows) == 1 and rows[0]["depth"] == "2" and float(rows[0]["val_bpb"]) > 0 and rows[0]["core"] != ""
    assert float(rows[0]["flops"]) > 0


def test_a_failing_run_prints_its_error(tmp_path, env):
    e = dict(env, PYTHON=sys.executable, NANOCHAT_BASE_DIR=str(tmp_path), DEPTHS="2", FLOPS="1e11",
             TRAIN_ARGS="--no-such-flag")
    p = subprocess.run(["bash", "runs/scaling_laws.sh"], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "FAILED: scripts.base_train" in p.stderr and "unrecognized arguments: --no-such-flag" in p.stderr, p.stderr


def test_the_shell_scripts_import_what_the_package_has():
    """Every `from nanochat... import ...` inside the shell scripts names what exists: speedrun's download branch,
    which the runs above skip (they bring their data), once imported a function from the wrong module."""
    import glob
    import importlib
    scripts = glob.glob(os.path.join(REPO, "*.sh")) + glob.glob(os.path.join(REPO, "runs", "*.sh"))
    imports = [(path, module, name.strip()) for path in scripts
               for module, names in re.findall(r"^from (nanochat[\w.]*) import ([\w, ]+)$", open(path).read(), re.M)
               for name in names.split(",")]
    assert any(name == "config_for_depth" for _, _, name in imports), imports  # the pattern still finds them
    for path, module, name in imports:
        assert hasattr(importlib.import_module(module), name), (os.path.basename(path), module, name)

