"""Watching a run: the spike rule (nanochat.run_log.SpikeWatch), and base_train end to end on a data change: a
resume that finds other shards is refused naming them; --resume-on-new-data goes on (the report says so: into
shards added after the saved ones, else from the start), and
the jump in loss on the new text is warned about and counted; TensorBoard gets the numbers metrics.jsonl holds.
The gradient norms themselves: tests/test_training.py and tests/test_parallel.py."""

import os
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_script, read_run, ckpt_dir, SAMPLE_DATA, TINY_RUN
from nanochat.dataset import listing_changes
from nanochat.run_log import SpikeWatch

TINY = TINY_RUN + ["--warmup-steps", "2", "--embedding-lr", "0.05", "--scalar-lr", "0.05"]


def test_spike_rule():
    watch = SpikeWatch(window=50, min_steps=20)
    for step in range(19):  # too few steps to judge: nothing is a spike yet
        assert watch.check(10.0 if step == 18 else 3.0, 1.0) == []
    assert watch.check(3.1, 1.0) == []  # within 1.2x of the median (3.0)
    assert watch.check(3.7, 1.0) == [("loss", 3.7, pytest.approx(3.7 / 3.0), 3.0, 20)]
    assert watch.check(3.0, 3.5) == [("grad norm", 3.5, 3.5, 1.0, 21)]  # the loss came back: that spike ended
    assert watch.check(3.0, 4.0) == []  # still above: the same spike
    assert [s[0] for s in watch.check(float("inf"), float("nan"))] == ["loss"]  # the grad norm spike goes on
    assert len(watch.history) == 23  # the non-finite step is judged, not kept
    assert watch.check(3.0, 1.0) == [] and watch.check(3.0, 5.0)[0][0] == "grad norm"  # a new one
    assert watch.check(3.0, 9.0, judge=False) == [] and len(watch.history) == 26  # not judged (the LR warmup)
    for _ in range(60):
        watch.check(3.0, 1.0)
    assert len(watch.history) == 50
    assert SpikeWatch(history=watch.history).history == watch.history  # as a checkpoint restores it
    assert watch.check(3.0, 5.0)[0][0] == "grad norm"
    resumed = SpikeWatch(history=watch.history, spiking=sorted(watch.spiking))  # a save in the middle of that spike
    assert resumed.check(3.0, 5.0) == watch.check(3.0, 5.0) == []  # the same spike: not reported again


def test_wandb_gets_the_runs_steps_and_a_resume_goes_on_in_its_run(tmp_path, monkeypatch):
    import sys
    import types
    from nanochat.run_log import RunLog
    calls = []

    class FakeRun:
        id = "run42"
        log = staticmethod(lambda record, step=None: calls.append(("log", step)))
        finish = staticmethod(lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw["id"], kw["resume"])) or FakeRun()))
    path = str(tmp_path / "metrics.jsonl")
    log = RunLog(path, {"flags": {}}, 0, wandb_run="x")
    for step in range(3):
        log.log(step, loss=1.0)
    log.finish()
    RunLog(path, {"flags": {}}, 2, wandb_run="x").log(2, loss=1.0)  # resumed from step 2
    assert calls == [("init", None, None), ("log", 0), ("log", 1), ("log", 2), ("init", "run42", "allow"), ("log", 2)]


def test_listing_changes_say_what_changed():
    saved = [["a.parquet", 100, [[8, 3], [5, 1]]], ["b.parquet", 50, [[8, 1]]], ["c.parquet", 10, [[1, 1]]]]
    assert listing_changes(saved, saved) == []
    now = [["a.parquet", 100, [[8, 2], [5, 1]]], ["b.parquet", 51, [[8, 1]]], ["d.parquet", 10, [[1, 1]]]]
    assert listing_changes(saved, now) == ["c.parquet removed", "d.parquet added", "a.parquet changed (4 -> 3 row groups)",
                                           "b.parquet changed (50 -> 51 bytes)"]
    now = [["a.parquet", 100, [[8, 2], [7, 1], [5, 1]]]] + saved[1:]
    assert listing_changes(saved, now) == ["a.parquet changed (row group 2: 8 -> 7 rows)"]


def write_folder(folder, texts_by_name):
    folder.mkdir()
    for name, texts in texts_by_name.items():
        pq.write_table(pa.table({"text": texts}), folder / name, row_group_size=32)


def test_new_data_is_refused_then_continued_with_the_flag_and_its_loss_spike_is_warned(env, tmp_path):
    """24 steps on text that repeats one sentence (the loss falls far), then a resume on English prose under
    the same shard names: refused without the flag; with it, the data starts over, the loss and gradient norm
    jump, and the step is warned about, counted in the summary and the report, and marked in metrics.jsonl."""
    repeated = tmp_path / "repeated"
    write_folder(repeated, {"shard_0.parquet": ["the cat sat on the mat. " * 40] * 256,
                            "shard_1.parquet": ["the cat sat on the mat. " * 40] * 32})
    prose = tmp_path / "prose"
    prose.mkdir()
    for i in range(2):
        os.symlink(os.path.join(SAMPLE_DATA, f"sample_0000{i}.parquet"), prose / f"shard_{i}.parquet")
    tb = tmp_path / "tb"
    fast = ["--matrix-lr", "0.5", "--unembedding-lr", "0.5", "--embedding-lr", "2", "--warmdown-ratio", "0",
            "--weight-decay", "0"]  # learn the sentence within a few steps
    flags = TINY + fast + ["--num-iterations", "26", "--save-every", "8", "--model-tag", "newdata"]
    run_script("scripts.base_train", flags + ["--data-dir", str(repeated), "--tensorboard", str(tb)], env)
    # the same names, other files
    resume = flags + ["--data-dir", str(prose), "--resume-from-step", "24"]
    p = run_script("scripts.base_train", resume, env, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [line for line in p.stdout.splitlines() if line.startswith("ERROR")] == [
        f"ERROR: the shards in {prose} differ from those step 24 was trained on: shard_0.parquet changed "
        f"(8 -> 15 row groups); shard_1.parquet changed (1 -> 3 row groups). Put the saved shards back, or pass "
        f"--resume-on-new-data to read the new data"], p.stdout[-1500:]
    p = run_script("scripts.base_train", resume + ["--resume-on-new-data", "--tensorboard", str(tb)], env)
    assert f"note: the shards in {prose} differ from step 24's (2 changes); --resume-on-new-data: reading them from " \
           f"the start" in p.stdout
    spike = re.search(r"^step 00024 \| WARNING: loss spike: ([\d.]+) is ([\d.]+)x the median of the previous 24 steps "
                      r"\(([\d.]+)\)$", p.stdout, re.M)
    assert spike and float(spike.group(2)) > 10, p.stdout[-3000:]  # from about 0.4 to above 4
    run = read_run(env, "newdata")
    assert run.steps[24]["spikes"] == ["loss", "grad norm"] and "spikes" not in run.steps[23]
    assert abs(run.steps[24]["loss"] - float(spike.group(1))) < 1e-4
    # counted over both launches (the first had spikes of its own: a high LR on one sentence), as recorded
    count = sum(len(r.get("spikes", [])) for r in run.steps.values())
    assert f"; spikes (loss or grad norm): {count}" in p.stdout
    with open(os.path.join(env["NANOCHAT_BASE_DIR"], "report", "base-model-training.md")) as f:
        report = f.read()
    assert "- data: new shards from step 24 on (--resume-on-new-data)" in report
    positions = [json.load(open(os.path.join(ckpt_dir(env, "newdata"), f"meta_0000{s}.json")))["dataloader_states"][0]
                 for s in (24, 26)]  # the new data read from its start, not from step 24's place in the old
    assert positions[1]["g"] < positions[0]["g"] and positions[1]["epoch"] == 1, positions
    assert f"- spikes (loss or grad norm): {count}\n" in report
    # TensorBoard holds what metrics.jsonl does: the first launch's steps up to 24, the resumed launch's from there
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"loss", "grad_norm", "grad_norm_matrices", "lrm", "val_bpb"} <= set(events.Tags()["scalars"])
    grad_norm = {e.step: e.value for e in events.Scalars("grad_norm")}
    assert sorted(grad_norm) == list(range(26))
    assert all(abs(grad_norm[s] - run.steps[s]["grad_norm"]) <= 1e-6 * run.steps[s]["grad_norm"] for s in range(26))
    # through a restart mark at step 24, where every reader drops the first launch's 24 and 25 (EventAccumulator
    # also drops them unmarked, seeing the steps go back)
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    starts = [e.step for f in sorted(tb.iterdir()) for e in EventFileLoader(str(f)).Load()
              if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [24], starts



def test_added_shards_continue_the_data_position(env, tmp_path):
    """More shards downloaded after the saved ones (the old validation shard now trains, a new one validates): with
    --resume-on-new-data the position goes on into them, where other shards start the data over (test above)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        os.symlink(os.path.join(SAMPLE_DATA, f"sample_0000{i}.parquet"), data / f"shard_{i}.parquet")
    flags = TINY + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "added", "--data-dir", str(data)]
    run_script("scripts.base_train", flags, env)
    os.symlink(os.path.join(SAMPLE_DATA, "sample_00000.parquet"), data / "shard_2.parquet")
    p = run_script("scripts.base_train", flags + ["--resume-from-step", "2", "--resume-on-new-data"], env)
    assert "the saved training shards lead the new ones: the data position goes on into the added shards" in p.stdout
    first = json.load(open(os.path.join(ckpt_dir(env, "added"), "meta_000002.json")))["dataloader_states"][0]
    later = json.load(open(os.path.join(ckpt_dir(env, "added"), "meta_000004.json")))["dataloader_states"][0]
    # not started over: the documents of the row groups read by step 2 that step 4 still holds are ones step 2 held
    # (read again from the start, the buffer would hold some that steps 1-2 packed)
    held, old = set(map(tuple, first["buffer"])), [tuple(r) for r in later["buffer"] if r[0] < first["g"]]
    assert old and set(old) <= held and later["g"] >= first["g"], (first, later)

def test_an_unknown_flag_names_the_nearest(capsys):
    from nanochat.recipe import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--run=d12"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "base_train: error: unrecognized arguments: --run=d12 (did you mean --wandb-run?); see --help\n")
