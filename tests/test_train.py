"""base_train end to end on CPU: exact resume, clear errors, NaN stop, signal save, DP under torchrun."""

import os
import json
import signal
import subprocess
import sys


from conftest import run_script, parse_losses, TINY_MODEL, REPO

TRAIN = ["--device-batch-size", "4", "--total-batch-size", "512", "--warmup-steps", "2",
         "--embedding-lr", "0.05", "--scalar-lr", "0.05"] + TINY_MODEL


def test_exact_resume_is_bitwise(env):
    full = run_script("scripts.base_train", TRAIN + ["--num-iterations", "20", "--save-every", "10", "--model-tag", "resume",
                                                     "--eval-every", "-1"], env)
    losses = parse_losses(full.stdout)
    assert sorted(losses) == list(range(20))
    assert losses[19] < losses[0]  # it learns
    resumed = run_script("scripts.base_train", TRAIN + ["--num-iterations", "20", "--save-every", "10", "--model-tag", "resume",
                                                        "--eval-every", "-1", "--resume-from-step", "10"], env)
    again = parse_losses(resumed.stdout)
    assert sorted(again) == list(range(10, 20))
    for s in range(10, 20):
        assert again[s] == losses[s], f"step {s}: {again[s]} != {losses[s]}"
    # the final checkpoint of both runs holds the same weights
    ckpt_dir = os.path.join(env["NANOCHAT_BASE_DIR"], "base_checkpoints", "resume")
    assert os.path.exists(os.path.join(ckpt_dir, "meta_000020.json"))
    assert "Validation bpb:" in full.stdout and "Validation bpb:" in resumed.stdout
    assert full.stdout.split("Validation bpb:")[1].split()[0] == resumed.stdout.split("Validation bpb:")[1].split()[0]


def test_log_line_format(env):
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "3", "--model-tag", "fmt"], env)
    lines = [l for l in p.stdout.splitlines() if l.startswith("step 00001/")]
    assert len(lines) == 1
    import re
    assert re.match(r"^step 00001/00003 \(33\.33%\) \| loss: \d+\.\d{6} \| lrm: \d\.\d\d \| dt: [\d.]+ms \| "
                    r"tok/sec: [\d,]+ \| epoch: \d+$", lines[0]), lines[0]
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


def test_sigterm_saves_then_exits(env):
    cmd = [sys.executable, "-m", "scripts.base_train"] + TRAIN + ["--num-iterations", "100000", "--model-tag", "sig",
                                                                  "--eval-every", "-1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ""
    while "step 00003/" not in out:  # wait until it trains
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        out += line
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=120)
    out += rest
    assert proc.returncode == 0, err
    assert "saved checkpoint for step" in out
    ckpt_dir = os.path.join(env["NANOCHAT_BASE_DIR"], "base_checkpoints", "sig")
    metas = [f for f in os.listdir(ckpt_dir) if f.startswith("meta_")]
    assert len(metas) == 1
    meta = json.load(open(os.path.join(ckpt_dir, metas[0])))
    assert meta["loop_state"]["step"] >= 3 and len(meta["dataloader_states"]) == 1


def test_dp2_torchrun_then_resume_at_dp1(env):
    """The README's torchrun line (torchrun reads the script's flags too: `--run=NAME` once matched its --run-path)."""
    args = TRAIN + ["--num-iterations", "4", "--save-every", "2", "--model-tag=dp2", "--wandb-run=dummy", "--eval-every", "-1",
                    "--device-batch-size", "2"]
    p = run_script("scripts.base_train", args, env, nproc=2)
    assert p.stdout.count("local parameters: ") == 2
    assert "[dp=0]" in p.stdout and "[dp=1]" in p.stdout
    assert len(parse_losses(p.stdout)) == 4
    meta = json.load(open(os.path.join(env["NANOCHAT_BASE_DIR"], "base_checkpoints", "dp2", "meta_000002.json")))
    assert [s["dp_rank"] for s in meta["dataloader_states"]] == [0, 1]
    r = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)  # one process now
    assert "resharded the data position from dp 2 to dp 1" in r.stdout
    assert sorted(parse_losses(r.stdout)) == [2, 3]


def test_resume_with_other_recipe_is_refused(env):
    args = TRAIN + ["--num-iterations", "2", "--model-tag", "recipe", "--eval-every", "-1"]
    run_script("scripts.base_train", args, env)
    p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "3", "--model-tag", "recipe", "--eval-every", "-1",
                                                  "--resume-from-step", "2"], env, check=False)
    assert p.returncode != 0 and "--num-iterations was 2, now 3" in p.stdout and "Traceback" not in p.stderr


def test_bad_flags_are_clear_errors(env):
    for flags, message in [(["--l3-after-layers", "4,x"], "must be comma-separated block indices"),
                           (["--l3-after-layers", "7"], "block indices must be in 0..1"),
                           (["--tp", "2"], "need 2 processes"),
                           (["--device-batch-size", "0"], "--device-batch-size must be at least 1"),
                           (["--head-dim", "0"], "--head-dim (0) positive")]:
        p = run_script("scripts.base_train", TRAIN + ["--num-iterations", "1"] + flags, env, check=False)
        assert p.returncode != 0 and message in p.stdout, (flags, p.stdout[-500:], p.stderr[-500:])
        assert "Traceback" not in p.stderr, flags


def test_resume_at_the_final_step_wraps_up(env):
    args = TRAIN + ["--num-iterations", "2", "--model-tag", "final", "--eval-every", "-1"]
    run_script("scripts.base_train", args, env)
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "training from step 2 to 2" in p.stdout and "Validation bpb:" in p.stdout


def test_l3_run_resumes_bitwise_with_its_allocation(env):
    """An L3 run (tied, the default) resumes bitwise: the LZW allocation comes back from the checkpoint
    instead of being computed again (with the uniform split left by init_weights the losses would differ)."""
    args = TRAIN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "l3", "--eval-every", "-1",
                    "--l3-after-layers", "0", "--l3-k-max", "8"]
    full = run_script("scripts.base_train", args, env)
    assert "L3 allocation:" in full.stdout and '"l3_tied": true' in full.stdout
    resumed = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "L3 allocation:" not in resumed.stdout
    losses, again = parse_losses(full.stdout), parse_losses(resumed.stdout)
    assert sorted(again) == [2, 3]
    for s in (2, 3):
        assert again[s] == losses[s], f"step {s}: {again[s]} != {losses[s]}"
