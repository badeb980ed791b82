"""scripts/base_eval.py and scripts/sample.py end to end on a tiny checkpoint: the CORE table and
line, the CSV, the report section, bpb, data parallel under torchrun, and clear errors."""

import os
import re
import csv

import pytest

from conftest import run_script, script_env, TINY_MODEL, CORE_BUNDLE as BUNDLE, CORE_TASKS
TAG = "evaltest"
EVAL = ["--model-tag", TAG, "--eval-bundle", BUNDLE, "--max-per-task", "4", "--eval-tokens", "512",
        "--device-batch-size", "4"]
CORE_LINE = re.compile(r"^CORE \((\d+)/(\d+) tasks\): (-?\d+\.\d{4})$", re.M)


@pytest.fixture(scope="module")
def checkpoint(base_dir):
    """A 2-step tiny model saved under the tag `evaltest`."""
    run_script("scripts.base_train", TINY_MODEL + ["--device-batch-size", "4", "--total-batch-size", "512",
                                                   "--num-iterations", "2", "--model-tag", TAG], script_env(base_dir))
    return TAG


@pytest.fixture(scope="module")
def single_run(base_dir, checkpoint):
    """base_eval in one process: (stdout, CSV rows, report section text)."""
    p = run_script("scripts.base_eval", EVAL, script_env(base_dir))
    with open(os.path.join(base_dir, "base_eval", f"{TAG}_000002.csv")) as f:
        rows = list(csv.reader(f))
    with open(os.path.join(base_dir, "report", "base-model-evaluation.md")) as f:
        section = f.read()
    return p.stdout, rows, section


def test_base_eval_table_core_csv_and_report(single_run):
    from nanochat.core_eval import load_bundle
    stdout, rows, section = single_run
    tasks, missing = load_bundle(BUNDLE)
    assert [t.label for t in tasks] == CORE_TASKS and missing == ["absent"]
    for t in tasks:  # the table: every task that ran, 4 items each
        assert re.search(rf"^\| {t.label} \| 4 \| \d\.\d{{4}} \| -?\d\.\d{{4}} \|$", stdout, re.M), t.label
    assert "missing (no data file in the bundle, left out of CORE): absent" in stdout
    m = CORE_LINE.search(stdout)
    assert m and m.group(1, 2) == ("3", "4")
    assert re.search(r"^train bpb: \d+\.\d{6}$", stdout, re.M) and re.search(r"^val bpb: \d+\.\d{6}$", stdout, re.M)
    # the CSV: one row per task, then CORE = the mean of the centered accuracies
    assert rows[0] == ["task", "accuracy", "centered", "note"]
    assert [r[0] for r in rows[1:-1]] == [t.label for t in tasks] and rows[-1][:2] == ["CORE", ""]
    assert rows[-1][3] == "3 of 4 tasks, 4 items a task"  # what the score stands on, for export_hf's model card
    centered = [float(r[2]) for r in rows[1:-1]]
    assert float(rows[-1][2]) == pytest.approx(sum(centered) / 3, abs=1e-5)
    assert f"{float(rows[-1][2]):.4f}" == m.group(3)
    # the report section carries the keys the summary reads, and the table
    for key in ("train bpb", "val bpb", "CORE"):
        assert re.search(rf"^- {key}: -?\d", section, re.M), key
    assert "| task | items | accuracy | centered |" in section and "| capitals | 4 |" in section


def test_base_eval_data_parallel_matches_one_process(base_dir, checkpoint, single_run):
    p = run_script("scripts.base_eval", EVAL + ["--skip-bpb"], script_env(base_dir), nproc=2)
    assert CORE_LINE.search(p.stdout).group(0) == CORE_LINE.search(single_run[0]).group(0)
    table = [l for l in p.stdout.splitlines() if l.startswith("| ")]
    assert table == [l for l in single_run[0].splitlines() if l.startswith("| ")]
    # tensor parallel: the checkpoint cut over two ranks, the same bits per byte (sums in another order)
    p = run_script("scripts.base_eval", EVAL + ["--skip-core", "--tp", "2"], script_env(base_dir), nproc=2)
    bpb = lambda out: [float(v) for v in re.findall(r"^(?:train|val) bpb: (\d+\.\d{6})$", out, re.M)]
    assert len(bpb(p.stdout)) == 2 and bpb(p.stdout) == pytest.approx(bpb(single_run[0]), rel=1e-5), p.stdout[-1500:]


def test_base_eval_offline_without_bundle_says_what_to_do(tmp_path):
    env = dict(script_env(str(tmp_path)), NANOCHAT_EVAL_BUNDLE_URL="http://127.0.0.1:9/x.zip")
    p = run_script("scripts.base_eval", ["--max-per-task", "4"], env, check=False)
    assert p.returncode == 1
    assert "could not download the CORE eval bundle" in p.stdout and "--eval-bundle DIR" in p.stdout
    assert "Traceback" not in p.stderr


def test_base_eval_unknown_tag(base_dir, checkpoint):
    p = run_script("scripts.base_eval", ["--model-tag", "nope", "--skip-core", "--skip-bpb"], script_env(base_dir), check=False)
    assert p.returncode == 1 and "no checkpoints for model tag 'nope'" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.parametrize("script, flags, message", [
    ("scripts.base_eval", ["--device-batch-size", "0"], "--device-batch-size 0 must be positive"),
    ("scripts.base_eval", ["--eval-tokens", "0"], "--eval-tokens 0 positive or -1"),
    ("scripts.base_eval", ["--device-type", "gpu"], "--device-type=gpu: cuda, cpu or mps"),
    ("scripts.base_eval", ["--tp", "2"], "launch with torchrun --nproc_per_node=2 -m scripts.base_eval ..."),
    ("scripts.sample", ["--top-k", "-3", "--max-tokens", "0"], "ERROR: --max-tokens 0: 1 or more; --top-k -3: 0 or more"),
    ("scripts.sample", ["--temperature", "nan"], "--temperature nan: finite, 0 or more"),
    ("scripts.sample", ["--device-type", "gpu"], "--device-type=gpu: cuda, cpu or mps"),
])
def test_bad_flags_are_one_line(base_dir, checkpoint, script, flags, message):
    p = run_script(script, ["--model-tag", TAG, "--skip-core"] * (script == "scripts.base_eval") + flags,
                   script_env(base_dir), check=False)
    assert p.returncode == 1 and message in p.stdout + p.stderr and "Traceback" not in p.stderr, (p.stdout, p.stderr)


def test_sample_prompts_and_report(base_dir, checkpoint):
    args = ["--model-tag", TAG, "--prompt", "The", "--prompt", "A city", "--num-samples", "2", "--max-tokens", "8",
            "--temperature", "0.8", "--seed", "1", "--report"]
    p = run_script("scripts.sample", args, script_env(base_dir))
    lines = [l for l in p.stdout.splitlines() if l.startswith("--- [")]
    assert len(lines) == 4 and lines[0].startswith("--- [1/2] The") and lines[2].startswith("--- [1/2] A city")
    p = run_script("scripts.sample", [a if a != "1" else "2" for a in args[:-1]], script_env(base_dir))
    assert [l for l in p.stdout.splitlines() if l.startswith("--- [")] != lines  # --seed reaches the sampler
    with open(os.path.join(base_dir, "report", "base-model-samples.md")) as f:
        assert len(re.findall(r"^\d\. `'(The|A city)", f.read(), re.M)) == 4


def test_sample_reads_prompts_from_stdin(base_dir, checkpoint):
    samples = []
    for flags in (["--temperature", "0"], ["--temperature", "2", "--top-k", "1"]):  # top-k 1 is greedy at any temperature
        p = run_script("scripts.sample", ["--model-tag", TAG, "--max-tokens", "4"] + flags, script_env(base_dir),
                       check=False, input="Hello\n\nWorld\n")
        assert p.returncode == 0, p.stderr
        samples.append([l for l in p.stdout.splitlines() if l.startswith("--- [")])
    lines = samples[0]
    assert len(lines) == 2 and lines[0].startswith("--- [1/1] Hello") and lines[1].startswith("--- [1/1] World")
    assert samples[1] == lines  # --top-k reaches the sampler


def test_checkpoint_with_another_tokenizer_is_refused(base_dir, checkpoint, tmp_path):
    """Another tokenizer of the same vocab size (two special tokens' ids swapped) would load and give garbage."""
    import json
    import shutil
    other = tmp_path / "other"
    shutil.copytree(os.path.join(base_dir, "tokenizer"), other / "tokenizer")
    shutil.copytree(os.path.join(base_dir, "base_checkpoints", TAG), other / "base_checkpoints" / TAG)
    meta_path = other / "tokenizer" / "tokenizer.json"
    meta = json.loads(meta_path.read_text())
    ids = meta["special_tokens"]
    ids["<|user_start|>"], ids["<|user_end|>"] = ids["<|user_end|>"], ids["<|user_start|>"]
    meta_path.write_text(json.dumps(meta))
    for module, extra in (("scripts.sample", ["--prompt", "The"]), ("scripts.base_eval", ["--skip-core"])):
        p = run_script(module, ["--model-tag", TAG] + extra, script_env(str(other)), check=False)
        out = p.stdout + p.stderr
        assert p.returncode == 1 and "Traceback" not in p.stderr, (module, out[-800:])
        assert re.search(r"was trained with tokenizer [0-9a-f]{16}, but the tokenizer in .*other/tokenizer is [0-9a-f]{16}", out), module


def test_sample_without_checkpoints_says_where_runcpu_put_them(base_dir, tmp_path, monkeypatch):
    """Where runs/runcpu.sh has run (its folder exists), the "not found" lines point there; elsewhere they do not."""
    import shutil
    from nanochat import common
    monkeypatch.setattr(common, "RUNCPU_BASE_DIR", str(tmp_path / "runcpu_home"))
    hint = f"runs/runcpu.sh keeps its tokenizer and checkpoints under {tmp_path / 'runcpu_home'}"
    base = tmp_path / "base"
    p = run_script("scripts.sample", ["--prompt", "The"], script_env(str(base)), check=False)
    out = p.stdout + p.stderr  # nothing at all: the tokenizer is missing first; runcpu never ran: no hint
    assert p.returncode == 1 and "no tokenizer in" in out and "runs/runcpu.sh" not in out, out
    os.makedirs(tmp_path / "runcpu_home")
    p = run_script("scripts.sample", ["--prompt", "The"], script_env(str(base)), check=False)
    assert p.returncode == 1 and "no tokenizer in" in p.stdout + p.stderr and hint in p.stdout + p.stderr
    shutil.copytree(os.path.join(base_dir, "tokenizer"), base / "tokenizer")
    p = run_script("scripts.sample", ["--prompt", "The"], script_env(str(base)), check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "no checkpoints in" in out and hint in out


def test_base_eval_skip_core_is_said_in_the_report(base_dir, checkpoint):
    run_script("scripts.base_eval", ["--model-tag", TAG, "--skip-core", "--eval-tokens", "512", "--device-batch-size", "4"],
               script_env(base_dir))
    with open(os.path.join(base_dir, "report", "base-model-evaluation.md")) as f:
        assert "- CORE: skipped (--skip-core)" in f.read()
