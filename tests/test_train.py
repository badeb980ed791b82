"""base_train end to end on CPU: exact resume, clear errors, NaN stop, signal save, DP under torchrun."""

import os
import re
import json
import signal
import sys

import pytest

from conftest import run_script, run_losses, read_run, write_damaged_shard, ckpt_dir, errors, Started, TINY_MODEL, SAMPLE_DATA

TRAIN = ["--device-batch-size", "4", "--total-batch-size", "512", "--warmup-steps", "2",
         "--embedding-lr", "0.05", "--scalar-lr", "0.05"] + TINY_MODEL


def test_exact_resume_is_bitwise(env):
    full = run_script("scripts.base_train", TRAIN + ["--num-iterations", "20", "--save-every", "5", "--keep-last", "2",
                                                     "--model-tag", "resume", "--eval-every", "-1"], env)
    losses = run_losses(env, "resume")
    smooth = read_run(env, "resume").series("loss_smooth")
    assert sorted(losses) == list(range(20))
    assert losses[19] < losses[0]  # it learns
    folder = ckpt_dir(env, "resume")
    assert sorted(f for f in os.listdir(folder) if f.startswith("meta_")) == ["meta_000015.json", "meta_000020.json"]
    resumed = run_script("scripts.base_train", TRAIN + ["--num-iterations", "20", "--save-every", "5", "--model-tag", "resume",
                                                        "--eval-every", "-1", "--resume-from-step", "15"], env)
    run = read_run(env, "resume")  # the steps before 15 kept from the first run, 15 on written by the resumed one
    assert run.header["start_step"] == 15 and sorted(run.losses()) == list(range(20))
    for s in range(15, 20):
        assert run.losses()[s] == losses[s], f"step {s}: {run.losses()[s]} != {losses[s]}"
    # the loop state came back too: the smoothed loss goes on from step 15's, the training time from step 15's, and
    # the saved token count is the steps' (a run stopped and resumed reports what one run would)
    meta15 = json.load(open(os.path.join(folder, "meta_000015.json")))
    assert meta15["tokens_seen"] == 15 * 512 and meta15["loop_state"]["total_time"] > 0
    assert run.end["training_time_s"] == pytest.approx(meta15["loop_state"]["total_time"])  # 15-19: compile warm-up
    assert run.series("loss_smooth")[19] == smooth[19], (run.series("loss_smooth")[19], smooth[19])
    # the final checkpoint of both runs holds the same weights (the first run's went aside when the resume began)
    import torch
    from nanochat.checkpoint_manager import load_checkpoint
    aside = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("replaced_")]
    assert len(aside) == 1, os.listdir(folder)
    first, again = (load_checkpoint(d, 20, load_optimizer=False)[0] for d in (aside[0], folder))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # and the rest of the loop state at step 20 as one run has it: the spike check's window, spikes, data changes
    states = [json.load(open(os.path.join(d, "meta_000020.json")))["loop_state"] for d in (aside[0], folder)]
    assert [{k: v for k, v in s.items() if k != "total_time"} for s in states] == \
        [{k: v for k, v in states[0].items() if k != "total_time"}] * 2 and len(states[0]["spike_window"]) == 20
    assert "Validation bpb:" in full.stdout and "Validation bpb:" in resumed.stdout
    assert full.stdout.split("Validation bpb:")[1].split()[0] == resumed.stdout.split("Validation bpb:")[1].split()[0]


def test_log_line_format(env):
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "3", "--model-tag", "fmt", "--warmup-steps", "5"], env,
                   process=True)  # what a process prints, once, and at its exit
    assert "note: --warmup-steps 5 runs into the warmdown (from step 1)" in p.stdout
    assert "nanobind" not in p.stderr  # no leak report at exit (the collector was frozen with triton imported)
    assert p.stdout.count("NOTICE: no parquet shards") == 1
    # a run too short to leave out the compile warm-up reports all its steps' time
    assert re.search(r"^minimum validation bpb: 4\.\d+; training time: [\d.]+s \(3 steps, compilation included\)$",
                     p.stdout, re.M), p.stdout[-500:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("step 00001/")]
    assert len(lines) == 1
    assert re.match(r"^step 00001/00003 \(33\.33%\) \| loss: \d+\.\d{6} \| grad norm: \d+\.\d{4} \| lrm: \d\.\d\d \| "
                    r"dt: [\d.]+ms \| tok/sec: [\d,]+ \| epoch: \d+ \| elapsed: \d+m\d\ds \| eta: \d+m\d\ds$", lines[0]), lines[0]
    assert "local parameters: " in p.stdout
    assert re.search(r"^Validation bpb: \d+\.\d{6}$", p.stdout, re.M)


def test_impossible_batch_split(env):
    p = run_script("scripts.base_train", TINY_MODEL + ["--device-batch-size", "3", "--total-batch-size", "512",
                                                       "--num-iterations", "2"], env, check=False)
    assert p.returncode != 0
    assert "is not a multiple of" in p.stdout and "Traceback" not in p.stderr


def test_missing_tokenizer(env, tmp_path):
    e = dict(env, NANOCHAT_BASE_DIR=str(tmp_path))
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "2"], e, check=False)
    assert p.returncode != 0 and "tok_train" in p.stdout and "Traceback" not in p.stderr


def test_no_data(env, tmp_path):
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "2", "--data-dir", str(tmp_path)], env, check=False)
    assert p.returncode != 0 and "no parquet shards in" in p.stdout and "Traceback" not in p.stderr


def test_corrupt_shard(env, tmp_path):
    import shutil
    from nanochat.dataset import SAMPLE_DIR
    shutil.copy(os.path.join(SAMPLE_DIR, "sample_00000.parquet"), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "2", "--data-dir", str(tmp_path)], env, check=False)
    assert p.returncode != 0 and "b.parquet is not a readable parquet file" in p.stdout and "Traceback" not in p.stderr


def test_nan_loss_stops_with_step(env):
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "5", "--scalar-lr", "1e30", "--model-tag", "nan",
                                                  "--eval-every", "-1"], env, check=False)
    assert p.returncode != 0
    assert "loss is nan at step" in p.stdout or "loss is inf at step" in p.stdout


def test_diverged_weights_are_never_saved(env):
    """Saving every step: weights that went non-finite are not saved (the run stops), and a non-finite loss stops it
    keeping every checkpoint, each saved with finite weights, the newest named; every one of them loads."""
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "6", "--scalar-lr", "1e30", "--model-tag", "diverge",
                                                  "--eval-every", "-1", "--save-every", "1"], env, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "nanobind" not in p.stderr
    assert ("the optimizer's state are not finite at step" in p.stdout or
            re.search(r"loss is nan at step (\d+); stopping; step \1 is the newest saved there \(resume with --resume-from-step \1\)",
                      p.stdout)), p.stdout[-1500:]
    from nanochat import checkpoint_manager as ckpt
    d = ckpt_dir(env, "diverge")
    for step in ckpt.saved_steps(d):
        ckpt.load_checkpoint(d, step)  # raises on weights that are not finite


def test_sample_and_eval_refuse_nonfinite_weights(env):
    import torch
    run_script("scripts.base_train", TRAIN + ["--num-iterations", "1", "--model-tag", "poisoned", "--eval-every", "-1"], env)
    path = os.path.join(ckpt_dir(env, "poisoned"), "model_000001.pt")
    state = torch.load(path, weights_only=True)
    state["lm_head.weight"][0, 0] = float("nan")
    torch.save(state, path)
    from nanochat.common import file_checksum  # as if saved so (by a version that did not check): its checksum holds
    meta_path = os.path.join(ckpt_dir(env, "poisoned"), "meta_000001.json")
    meta = json.load(open(meta_path))
    meta["checksums"]["model_000001.pt"] = file_checksum(path)
    json.dump(meta, open(meta_path, "w"))
    for module, extra in (("scripts.sample", ["--prompt", "The"]), ("scripts.base_eval", ["--skip-core"])):
        p = run_script(module, ["--model-tag", "poisoned"] + extra, env, check=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (module, p.stderr[-500:])
        assert "has weights that are not finite (lm_head.weight): the run had diverged" in p.stdout + p.stderr, module


def test_sigterm_saves_then_exits(env):
    cmd = [sys.executable, "-m", "scripts.base_train"] + TRAIN + ["--num-iterations", "100000", "--model-tag", "sig",
                                                                  "--eval-every", "-1"]
    proc = Started(cmd, env, "step 00003/")  # wait until it trains
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.finish(timeout=120)
    assert proc.returncode == 0, err
    folder = ckpt_dir(env, "sig")
    metas = [f for f in os.listdir(folder) if f.startswith("meta_")]
    assert len(metas) == 1
    meta = json.load(open(os.path.join(folder, metas[0])))
    step = meta["loop_state"]["step"]
    assert step >= 3 and len(meta["dataloader_states"]) == 1 and f"saved checkpoint for step {step}" in out
    # the last line: the step saved and the flag that resumes it
    assert out.splitlines()[-1] == f"stopped: saved step {step}: resume with --resume-from-step {step}", out[-500:]


def test_dp2_torchrun_then_resume_at_dp1(env):
    """The README's torchrun line (torchrun reads the script's flags too: `--run=NAME` once matched its --run-path)."""
    args = TRAIN + ["--num-iterations", "4", "--save-every", "2", "--model-tag=dp2", "--wandb-run=dummy", "--eval-every", "-1",
                    "--device-batch-size", "2"]
    p = run_script("scripts.base_train", args, env, nproc=2, process=True)  # the real torchrun command line
    assert p.stdout.count("local parameters: ") == 2
    assert "[dp=0]" in p.stdout and "[dp=1]" in p.stdout
    assert p.stdout.count("NOTICE: no parquet shards") == 1  # the sample-data notice once per run, not per process
    assert len(run_losses(env, "dp2")) == 4
    meta = json.load(open(os.path.join(ckpt_dir(env, "dp2"), "meta_000002.json")))
    assert [s["dp_rank"] for s in meta["dataloader_states"]] == [0, 1]
    r = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)  # one process now
    assert "resharded the data position from dp 2 to dp 1" in r.stdout
    assert sorted(run_losses(env, "dp2")) == [0, 1, 2, 3] and read_run(env, "dp2").header["start_step"] == 2


def test_resume_with_other_recipe_is_refused(env):
    args = TRAIN + ["--num-iterations", "2", "--model-tag", "recipe", "--eval-every", "-1"]
    run_script("scripts.base_train", args, env)
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "3", "--model-tag", "recipe", "--eval-every", "-1",
                                                  "--resume-from-step", "2"], env, check=False)
    assert p.returncode != 0 and "--num-iterations was 2, now 3" in p.stdout and "Traceback" not in p.stderr


def test_context_extension_goes_on_with_the_schedule_at_a_longer_context(env):
    """--stop-at-step, then a resume with a longer --max-seq-len: the horizon (here from --target-flops, whose
    FLOPs per token grow with the context) and the schedule stay, the windows and the checkpoint follow."""
    flops = 1278480 * 512 * 6  # 6 steps of 512 tokens of this model at context 256 (5 at 512, were it re-derived)
    args = TRAIN + ["--target-flops", str(flops), "--model-tag", "extend", "--eval-every", "-1", "--window-pattern", "SL"]
    short = ["--max-seq-len", "256", "--device-batch-size", "2"]
    p = run_script("scripts.base_train", args + short + ["--stop-at-step", "3", "--eval-every", "3"], env)
    assert "training from step 0 to 6" in p.stdout
    assert p.stdout.splitlines()[-1] == "stopped: saved step 3: resume with --resume-from-step 3", p.stdout[-500:]
    folder = ckpt_dir(env, "extend")
    assert sorted(f for f in os.listdir(folder) if f.startswith("meta_")) == ["meta_000003.json"]
    refused = run_script("scripts.base_train", args + short + ["--resume-from-step", "3", "--stop-at-step", "3"], env,
                         check=False)
    assert refused.returncode != 0 and "--stop-at-step 3 is not after the step this run starts at (3)" in refused.stdout
    r = run_script("scripts.base_train", args + ["--max-seq-len", "512", "--device-batch-size", "1",
                                                 "--resume-from-step", "3"], env)
    assert ("context extension at step 3: 256 -> 512 tokens a sequence (windows 128/256 -> 128/512); the schedule, "
            "batch, optimizer state and data position go on") in r.stdout
    assert "training from step 3 to 6" in r.stdout and "Validation bpb:" in r.stdout
    losses = run_losses(env, "extend")
    assert sorted(losses) == list(range(6)) and max(losses[s] for s in (3, 4, 5)) < losses[0]  # it goes on learning
    # the validation at the stop (step 3, at the old context) is kept in the records, and the final one
    assert sorted(read_run(env, "extend").series("val_bpb")) == [3, 6]
    meta = json.load(open(os.path.join(folder, "meta_000006.json")))
    assert meta["model_config"]["sequence_len"] == 512
    assert meta["loop_state"]["context_lengths"] == [[0, 256], [3, 512]]
    # a resume that leaves --max-seq-len out keeps the checkpoint's context; a shorter one is refused
    i = args.index("--max-seq-len")
    unset = args[:i] + args[i + 2:] + ["--device-batch-size", "1", "--resume-from-step", "6"]
    kept = run_script("scripts.base_train", unset, env)
    assert "training from step 6 to 6" in kept.stdout and "context extension" not in kept.stdout
    shorter = run_script("scripts.base_train", unset + ["--max-seq-len", "256"], env, check=False)
    assert shorter.returncode != 0 and "--max-seq-len 256 is shorter than step 6's context (512)" in shorter.stdout


def test_bad_flags_are_clear_errors(env):
    cases = [(["--l3-after-layers", "4,x"], "must be comma-separated block indices"),
             (["--l3-after-layers", "7"], "block indices must be in 0..1"),
             (["--l3-after-layers", "0", "--l3-d-up", "-8"], "--l3-d-up -8 must be positive"),
             (["--tp", "2"], "need 2 processes"),
             (["--device-batch-size", "0"], "--device-batch-size 0, --tp 1, --pp 1"),
             (["--head-dim", "0"], "--head-dim (0) positive"),
             (["--stop-at-step", "0", "--keep-last", "-2"], "--stop-at-step: positive, or -1; --keep-last: positive, or -1"),
             (["--stop-at-step", "2"], "--stop-at-step 2 is past the run's last step (1)"),
             (["--stop-at-step", "1", "--save-every", "0"], "--stop-at-step saves the step it stops at")]
    for flags, message in cases:  # each refused before step 0: in this process
        p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "1"] + flags, env, check=False)
        assert p.returncode != 0 and message in p.stdout + p.stderr, (flags, p.stdout[-500:], p.stderr[-500:])
        assert "Traceback" not in p.stderr, flags


def test_resume_carries_on_the_loop_state_saved_with_the_step(env):
    """The minimum validation bpb, the spike count and the steps where new data began come back from the meta (set
    here by hand to values the resumed steps cannot reach, so that a value started afresh shows)."""
    args = TRAIN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "loopstate", "--eval-every", "-1"]
    run_script("scripts.base_train", args, env)
    path = os.path.join(ckpt_dir(env, "loopstate"), "meta_000002.json")
    meta = json.load(open(path))
    meta["loop_state"].update(min_val_bpb=0.5, spike_count=7, new_data_at=[1])
    with open(path, "w") as f:
        json.dump(meta, f)
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "minimum validation bpb: 0.500000" in p.stdout and "spikes (loss or grad norm): 7" in p.stdout, p.stdout[-800:]
    with open(os.path.join(env["NANOCHAT_BASE_DIR"], "report", "base-model-training.md")) as f:
        assert "- data: new shards from step 1 on (--resume-on-new-data)" in f.read()


def test_resume_at_the_final_step_wraps_up(env):
    args = TRAIN + ["--num-iterations", "2", "--model-tag", "final", "--eval-every", "-1"]
    run_script("scripts.base_train", args, env)
    meta_path = os.path.join(ckpt_dir(env, "final"), "meta_000002.json")
    meta = json.load(open(meta_path))
    meta["dataloader_states"][0]["epoch"] = 3  # as if the data had been read three times: the report says so
    json.dump(meta, open(meta_path, "w"))
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "training from step 2 to 2" in p.stdout and "Validation bpb:" in p.stdout
    report = open(os.path.join(env["NANOCHAT_BASE_DIR"], "report", "base-model-training.md")).read()
    assert "- epoch: 3" in report and "- tok/sec (last step): n/a (no step this launch)" in report  # not 0


def test_l3_run_resumes_bitwise_with_its_allocation(env):
    """An L3 run resumes bitwise: the LZW allocation (skewed: 4 rows a token on average, 1 to 16) comes back from the
    checkpoint instead of being computed again (with the uniform split left by init_weights the losses would differ)."""
    args = TRAIN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "l3", "--eval-every", "-1",
                    "--l3-after-layers", "0", "--l3-n-emb", "4096", "--l3-k-max", "16"]
    full = run_script("scripts.base_train", args, env)
    assert "L3 allocation:" in full.stdout and "L3 rows per token: min 1, " in full.stdout  # skewed, not uniform
    losses = run_losses(env, "l3")
    resumed = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "L3 allocation:" not in resumed.stdout
    again = run_losses(env, "l3")
    for s in (2, 3):
        assert again[s] == losses[s], f"step {s}: {again[s]} != {losses[s]}"


def test_cpu_batch_that_cannot_fit_is_refused_with_the_flags_to_change(env):
    # 8192 x 2048 tokens a micro-batch: hundreds of GiB; the kernel used to kill the run without a word
    p = run_script("scripts.base_train", TINY_MODEL[:6] + ["--max-seq-len", "2048", "--device-batch-size", "8192",
                                                          "--total-batch-size", str(8192 * 2048), "--num-iterations", "1"],
                   env, check=False, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "training on the CPU with micro-batches of 8192 x 2048 tokens needs about" in p.stdout
    assert "lower --device-batch-size" in p.stdout


def test_cpu_memory_counts_the_attention_mask(monkeypatch):
    """On the CPU the attention's (T, T) band mask is built whole: a long enough sequence is refused for it before the
    run starts, whatever else fits (it failed allocating the mask)."""
    from types import SimpleNamespace
    from nanochat import memory
    monkeypatch.setattr(memory, "available_memory", lambda: 100 * 2 ** 30)
    config = SimpleNamespace(n_layer=1, n_embd=32, vocab_size=64)
    assert memory.cpu_memory_error(10 ** 5, config, 1, 2 ** 14) is None  # 2.4 GB of mask
    assert "micro-batches of 1 x 131072 tokens needs about" in memory.cpu_memory_error(10 ** 5, config, 1, 2 ** 17)


def corrupt_last_row_group(tmp_path):
    """A data folder whose first shard (a.parquet) has a sound footer but damaged pages in its last row group:
    it passes the start-of-run check and fails when that row group is read."""
    import shutil
    write_damaged_shard(tmp_path / "a.parquet", 64)
    shutil.copy(os.path.join(SAMPLE_DATA, "sample_00001.parquet"), tmp_path / "b.parquet")
    return str(tmp_path)


def test_corrupt_page_mid_training_saves_then_names_the_file(env, tmp_path):
    """A shard whose footer is fine but whose later pages are not passes check_data and fails mid-run: the run
    saves a checkpoint, then stops with one line naming the file."""
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "200", "--data-dir", corrupt_last_row_group(tmp_path),
                                                  "--model-tag", "corrupt", "--eval-every", "-1"], env, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    error = errors(p)
    assert len(error) == 1 and "a.parquet" in error[0] and "resume with --resume-from-step" in error[0], p.stdout[-1500:]
    assert "saved checkpoint for step" in p.stdout


def test_data_error_on_one_rank_of_two_saves_and_names_the_file(env, tmp_path):
    """Two data-parallel ranks read different row groups: when one of them hits the damaged one, both stop at
    the same step (they agree on the error), save that step, and the run ends with the failing rank's line."""
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "200", "--data-dir", corrupt_last_row_group(tmp_path),
                                                  "--model-tag", "corrupt_dp2", "--eval-every", "-1",
                                                  "--device-batch-size", "2"], env, nproc=2, check=False)
    assert p.returncode != 0 and "NameError" not in p.stderr, p.stderr[-3000:]
    error = errors(p)
    assert len(error) == 1 and "a.parquet" in error[0], p.stdout[-2000:]
    step = int(re.search(r"resume with --resume-from-step (\d+)", error[0]).group(1))
    assert f"saved checkpoint for step {step}" in p.stdout
    meta = json.load(open(os.path.join(ckpt_dir(env, "corrupt_dp2"), f"meta_{step:06d}.json")))
    assert [s["dp_rank"] for s in meta["dataloader_states"]] == [0, 1]


def test_sigterm_during_evaluation_stops_within_seconds_and_saves(env):
    import time
    cmd = [sys.executable, "-m", "scripts.base_train"] + TRAIN + ["--num-iterations", "100", "--model-tag", "sigeval",
                                                                  "--eval-every", "3", "--eval-tokens", "100000000"]
    proc = Started(cmd, env, "step 00002/")  # the next thing is the step-3 evaluation: hours of it at 10^8 tokens
    time.sleep(3)
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.finish(timeout=60)
    assert time.time() - t0 < 30 and proc.returncode == 0, err[-2000:]
    assert "saved checkpoint for step 3" in out and "Traceback" not in err
