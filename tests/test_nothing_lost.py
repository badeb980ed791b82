"""Nothing saved is lost: a second run on a tag is refused (or moves the first aside when told to, and `latest`
resumes it), a NaN from one rank's step keeps the checkpoint saved just before it, a checkpoint or tokenizer file
changed since it was written is refused naming the file and the newest intact step, a folder that cannot be written
or a disk too small for one checkpoint stops the run before its first step, a refused rename leaves nothing behind,
a resume refuses another model than the checkpoint's, and a rank killed under torchrun ends in one short report."""

import os
import re
import json
import time
import errno
import signal
import types
import shutil
import sys

import pytest

from conftest import run_script, run_losses, ckpt_dir, errors, Started, TINY_RUN
from nanochat import checkpoint_manager as ckpt
from nanochat.common import UserError
from nanochat.run_log import read_records

RUN = TINY_RUN + ["--warmup-steps", "1"]


def test_a_second_run_on_a_tag_is_refused_until_told_and_latest_resumes(env):
    args = RUN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "rerun"]
    run_script("scripts.base_train", args, env)
    folder, first = ckpt_dir(env, "rerun"), run_losses(env, "rerun")
    p = run_script("scripts.base_train", args, env, check=False)
    assert p.returncode == 1 and errors(p) == [
        f"ERROR: {folder} holds checkpoints up to step 4: resume it with --resume-from-step latest, train under another "
        f"--model-tag, or pass --start-over to move its files into replaced_<date>-<time>/ there and start again"]
    assert run_losses(env, "rerun") == first and ckpt.saved_steps(folder) == [2, 4]  # untouched
    p = run_script("scripts.base_train", args + ["--resume-from-step", "latest"], env)
    assert f"resuming from step 4 of {folder}" in p.stdout
    p = run_script("scripts.base_train", args + ["--start-over"], env)
    (aside,) = [f for f in os.listdir(folder) if f.startswith("replaced_")]
    assert f"moved the earlier run's 7 files into {os.path.join(folder, aside)}" in p.stdout
    assert sorted(os.listdir(os.path.join(folder, aside))) == [
        "meta_000002.json", "meta_000004.json", "metrics.jsonl", "model_000002.pt", "model_000004.pt", "optim_000002.pt",
        "optim_000004.pt"]
    assert run_losses(env, "rerun") == first  # the same run again, from the start


def test_a_resume_from_an_earlier_step_sets_the_later_ones_aside_and_never_rewrites_its_own(env):
    """Resuming from step 2 of steps 2, 4 and 6 moves 4 and 6 into replaced_<date>-<time>/ with the records of steps
    2-5 (the run would write over them, --keep-last would prune by number the steps it saves, and a later resume of
    step 6 would find no records of 2-5), once step 2 has loaded, whether or not the launch saves; a launch that stops
    before its first step leaves step 2's files as they were (it used to write them again, with its own layout's
    data states) and says step 2 is saved."""
    args = RUN + ["--num-iterations", "6", "--save-every", "2", "--model-tag", "earlier"]
    run_script("scripts.base_train", args, env)
    folder = ckpt_dir(env, "earlier")
    stop = lambda: open(os.path.join(folder, "STOP"), "w").close()  # a stop request before the first step
    before = {f: os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder) if "_000002" in f}
    stop()
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2", "--save-every", "0"], env)
    (aside,) = [f for f in os.listdir(folder) if f.startswith("replaced_")]
    assert f"the records from that step on are kept in {os.path.join(folder, aside)}" in p.stdout
    assert f"resuming from step 2: moved the 6 files of later steps into {os.path.join(folder, aside)}" in p.stdout
    assert [r["step"] for r in read_records(os.path.join(folder, aside, "metrics.jsonl")) if "loss" in r] == [
        0, 1, 2, 3, 4, 5]
    assert ckpt.saved_steps(folder) == [2] and ckpt.saved_steps(os.path.join(folder, aside)) == [4, 6]
    assert "stopped: saved step 2: resume with --resume-from-step 2" in p.stdout  # not "not saved (--save-every 0)"
    stop()
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    assert "moved the" not in p.stdout and "stopped: saved step 2: resume with --resume-from-step 2" in p.stdout
    assert [f for f in os.listdir(folder) if f.startswith("replaced_")] == [aside]
    assert {f: os.path.getmtime(os.path.join(folder, f)) for f in before} == before


def test_a_resume_sets_its_records_and_the_later_steps_aside_into_one_folder(env):
    """Resuming (and saving) from step 2 of steps 2, 4 and 6: the records of steps 2-5 and the files of steps 4 and 6
    go into one replaced_<date>-<time>/ (they were two folders, the second named -1 when made in the same second)."""
    args = RUN + ["--num-iterations", "6", "--save-every", "2", "--model-tag", "one_aside"]
    run_script("scripts.base_train", args, env)
    folder = ckpt_dir(env, "one_aside")
    open(os.path.join(folder, "STOP"), "w").close()  # a stop request before the first step
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    (aside,) = [f for f in os.listdir(folder) if f.startswith("replaced_")]
    assert f"moved the 6 files of later steps into {os.path.join(folder, aside)}" in p.stdout
    assert ckpt.saved_steps(os.path.join(folder, aside)) == [4, 6] and ckpt.saved_steps(folder) == [2]
    assert [r["step"] for r in read_records(os.path.join(folder, aside, "metrics.jsonl")) if "loss" in r] == [
        0, 1, 2, 3, 4, 5]


def test_a_nan_on_one_rank_after_a_save_keeps_that_checkpoint(env):
    """Step 2 is saved, then rank 1's step-2 loss is NaN (the tests' fault hook): both ranks stop; the checkpoint of
    step 2 stays, named as the newest saved step (no checksums read: the other rank does not wait for them), and
    resumes."""
    args = RUN + ["--num-iterations", "6", "--save-every", "2", "--model-tag", "nan_rank", "--device-batch-size", "2"]
    p = run_script("scripts.base_train", args, dict(env, NANOCHAT_TEST_NAN_AT="2:1"), nproc=2, check=False)
    assert p.returncode == 1 and errors(p) == [
        "ERROR: loss is nan at step 2; stopping; step 2 is the newest saved there (resume with --resume-from-step 2); if it comes "
        "back there, resume from an earlier step or lower the learning rates"], p.stdout[-2000:]
    assert ckpt.saved_steps(ckpt_dir(env, "nan_rank")) == [2]
    run_script("scripts.base_train", args + ["--resume-from-step", "2"], env, nproc=2)
    assert sorted(run_losses(env, "nan_rank")) == list(range(6))
    # each DP rank went on from its own data position: rank r reads row groups r, r + 2, ... (not rank 0's)
    states = json.load(open(os.path.join(ckpt_dir(env, "nan_rank"), "meta_000006.json")))["dataloader_states"]
    assert [(s["dp_rank"], s["g"] % 2) for s in states] == [(0, 0), (1, 1)], states


def flip_byte(path, offset):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_a_flipped_byte_is_refused_at_every_load_naming_the_newest_intact_step(env):
    args = RUN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "flipped"]
    run_script("scripts.base_train", args, env)
    folder = ckpt_dir(env, "flipped")
    model = os.path.join(folder, "model_000004.pt")
    flip_byte(model, os.path.getsize(model) // 2)  # inside a tensor: torch.load would take it without a word
    line = f"{model} is damaged (it no longer matches the checksum saved with it); step 2 is intact there"
    for module, extra in (("scripts.base_train", args + ["--resume-from-step", "4"]),
                          ("scripts.sample", ["--model-tag", "flipped", "--prompt", "The"]),
                          ("scripts.base_eval", ["--model-tag", "flipped", "--skip-core"]),
                          ("scripts.export_hf", ["--model-tag", "flipped", "--out", os.path.join(folder, "hf")])):
        p = run_script(module, extra, env, check=False)
        assert p.returncode == 1 and line in p.stdout + p.stderr and "Traceback" not in p.stderr, (module, p.stdout[-800:])
    p = run_script("scripts.base_train", args + ["--resume-from-step", "latest", "--num-iterations", "4"], env,
                   check=False)
    assert line in p.stdout


def test_a_damaged_tokenizer_stops_a_fresh_run(env, tmp_path):
    shutil.copytree(os.path.join(env["NANOCHAT_BASE_DIR"], "tokenizer"), tmp_path / "tokenizer")
    path = tmp_path / "tokenizer" / "tokenizer.tiktoken"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[: len(lines) // 2]) + "\n")  # cut at a line end: it would load with half its merges
    p = run_script("scripts.base_train", RUN + ["--num-iterations", "1"], dict(env, NANOCHAT_BASE_DIR=str(tmp_path)),
                   check=False)
    assert p.returncode == 1 and errors(p) == [f"ERROR: {path} no longer matches the checksum saved with it (damaged "
                                               f"since it was written): train it again with `python -m scripts.tok_train` "
                                               f"(checkpoints of the old one will not match the new one)"]


def test_a_folder_that_cannot_be_written_stops_the_run_before_its_first_step(env, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(os.path.join(env["NANOCHAT_BASE_DIR"], "tokenizer"), base / "tokenizer")
    (base / "base_checkpoints").write_text("a file where the checkpoints' folder should be")
    p = run_script("scripts.base_train", RUN + ["--num-iterations", "2", "--model-tag", "x"],
                   dict(env, NANOCHAT_BASE_DIR=str(base)), check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "step 00000" not in p.stdout
    assert errors(p) == [f"ERROR: cannot write {base}/base_checkpoints/x (Not a directory): set NANOCHAT_BASE_DIR to a "
                         f"folder you can write, or fix this one"]
    (tmp_path / "afile").write_text("a file where the base dir's parent should be")
    p = run_script("scripts.base_train", RUN + ["--num-iterations", "2"], dict(env, NANOCHAT_BASE_DIR=f"{tmp_path}/afile/b"),
                   check=False)
    assert p.returncode == 1 and errors(p) == [f"ERROR: cannot create the base dir {tmp_path}/afile/b (Not a directory): "
                                               f"set NANOCHAT_BASE_DIR to a folder you can write"]
    os.makedirs(tmp_path / "ro")  # a file where the tokenizer's folder should be: refused before it trains
    (tmp_path / "ro" / "tokenizer").write_text("a file")
    p = run_script("scripts.tok_train", ["--vocab-size", "300", "--max-chars", "10000"],
                   dict(env, NANOCHAT_BASE_DIR=str(tmp_path / "ro")), check=False)
    assert p.returncode == 1 and "ERROR: cannot write" in p.stderr and "training a" not in p.stdout


def test_a_tokenizer_trained_again_sets_another_one_aside(env, tmp_path):
    """The checkpoints trained with a tokenizer cannot load without it: training another moves it aside, whole; the
    same one trained again replaces nothing."""
    from nanochat.tokenizer import get_tokenizer
    base = dict(env, NANOCHAT_BASE_DIR=str(tmp_path))
    for vocab in (300, 300, 320):
        p = run_script("scripts.tok_train", ["--vocab-size", str(vocab), "--max-chars", "20000"], base)
        assert ("held another tokenizer" in p.stdout) == (vocab == 320), p.stdout
    aside = [d for d in os.listdir(tmp_path) if d.startswith("tokenizer.replaced_")]
    assert len(aside) == 1 and f"moved to {tmp_path / aside[0]}" in p.stdout
    assert get_tokenizer(str(tmp_path / aside[0])).get_vocab_size() == 300
    assert get_tokenizer(str(tmp_path / "tokenizer")).get_vocab_size() == 320


def test_a_start_over_that_cannot_move_the_files_is_one_line_and_frees_the_folder(tmp_path, monkeypatch):
    """--start-over whose move into replaced_<time>/ fails: the "cannot write" line, and the lock is released."""
    folder = tmp_path / "tag"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", dst)
    monkeypatch.setattr(ckpt.os, "replace", refuse)
    refused = r"^cannot write .*/replaced_[\d-]+/metrics\.jsonl \(Permission denied\)"
    with pytest.raises(ckpt.CheckpointError, match=refused):
        ckpt.lock_run(types.SimpleNamespace(rank=0), None, str(folder), fresh=True, start_over=True)
    assert not (folder / "run.lock").exists()


def test_a_refused_rename_and_a_small_disk_are_one_line_and_leave_nothing(env, monkeypatch):
    args = RUN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "refused"]
    folder = ckpt_dir(env, "refused")
    real_replace = os.replace

    def refuse_step_4(src, dst):
        if "000004" in str(dst):
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", refuse_step_4)
    p = run_script("scripts.base_train", args, env, check=False)
    monkeypatch.undo()
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert errors(p) == [f"ERROR: cannot write {folder}/model_000004.pt (Permission denied) saving step 4; step 2 is "
                         f"intact there (resume with --resume-from-step 2). Make the folder writable, or set "
                         f"NANOCHAT_BASE_DIR to one that is"], p.stdout[-1500:]
    assert sorted(os.listdir(folder)) == ["meta_000002.json", "metrics.jsonl", "model_000002.pt", "optim_000002.pt"]
    # an export onto a full disk: one line, and no partial folder for a retry to refuse as "not empty"
    import safetensors.torch

    def full_disk(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    out = os.path.join(env["NANOCHAT_BASE_DIR"], "hf_full")
    p = run_script("scripts.export_hf", ["--model-tag", "refused", "--out", out], env, check=False)
    monkeypatch.undo()
    assert p.returncode == 1 and re.fullmatch(rf"ERROR: cannot write {out}\.tmp\.\d+/model\.safetensors \(Error while "
                                              rf"serializing: .*\(os error 28\)\): nothing was exported to {out}",
                                              errors(p)[0]), errors(p)
    assert not [f for f in os.listdir(env["NANOCHAT_BASE_DIR"]) if f.startswith("hf_full")]
    # a disk without room for one checkpoint: refused before the first step, not at the first save
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, (1 << 30) - 65536, 65536))
    p = run_script("scripts.base_train", RUN + ["--num-iterations", "4", "--model-tag", "small"], env, check=False)
    assert p.returncode == 1 and "step 00000" not in p.stdout
    assert re.fullmatch(r"ERROR: the disk of \S+/small has 0\.1 MiB free and one checkpoint of this run needs about "
                        r"[\d.]+ MiB: free some space, set NANOCHAT_BASE_DIR to a disk with room, or save nothing "
                        r"\(--save-every 0\)", errors(p)[0]), errors(p)


def test_a_resume_refuses_another_model_and_records_the_trained_one(env):
    args = RUN + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "model_flags"]
    run_script("scripts.base_train", args, env)
    p = run_script("scripts.base_train", args + ["--resume-from-step", "2", "--depth", "4"], env, check=False)
    assert p.returncode == 1 and errors(p) == [
        "ERROR: resuming with another model than the checkpoint's: --depth 4 (the checkpoint's: 2); leave these flags "
        "out or give the checkpoint's values"]
    i = args.index("--depth")
    run_script("scripts.base_train", args[:i] + args[i + 2:] + ["--resume-from-step", "2"], env)  # --depth left out
    records = [json.loads(line) for line in open(os.path.join(ckpt_dir(env, "model_flags"), "metrics.jsonl"))]
    assert [r["flags"]["depth"] for r in records if r.get("kind") == "header"] == [2, 2]
    assert json.load(open(os.path.join(ckpt_dir(env, "model_flags"), "meta_000004.json")))["user_config"]["depth"] == 2


def test_a_rank_killed_under_torchrun_ends_in_one_short_report(env):
    """SIGKILL to rank 1: the survivor says, once, that another rank is gone, at which step and in which phase, and
    where to resume; no thread dumps, no 'received signal' line from torchrun's SIGTERM."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "scripts.base_train"] + RUN + ["--num-iterations", "100000", "--save-every", "3", "--model-tag", "killed",
                                          "--device-batch-size", "2"]
    proc = Started(cmd, env, "saved checkpoint for step 3")
    children = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    rank1 = next(c for c in children if "RANK=1" in open(f"/proc/{c}/environ").read().split("\0"))
    time.sleep(0.5)
    os.kill(rank1, signal.SIGKILL)
    out, err = proc.finish(timeout=120)
    assert proc.returncode != 0
    reports = [line for line in (out + err).splitlines() if "ERROR: rank" in line]
    assert len(reports) == 1 and re.search(r"ERROR: rank 0 stopped at step \d+ in '.+': another rank failed or is gone "
                                           r"\(torchrun names it\); traceback in \S+rank0\.txt; step \d+ is the newest "
                                           r"saved there \(resume with --resume-from-step \d+\)", reports[0]), (out + err)[-3000:]
    assert "Current thread" not in err and "Thread 0x" not in err and "received signal" not in out + err


def test_a_resume_from_step_0_sets_the_records_aside_and_a_logger_that_cannot_start_touches_nothing(tmp_path):
    """Records of steps a resume from step 0 trains again go aside with the file as it was (they were overwritten);
    a --tensorboard folder that cannot be written is one line, before metrics.jsonl is touched (a header-only file
    would refuse the next fresh run on the tag)."""
    from nanochat.run_log import RunLog
    path = str(tmp_path / "metrics.jsonl")
    first = RunLog(path, {"flags": {}})
    for step in range(3):
        first.log(step, loss=1.0)
    RunLog(path, {"flags": {}}, start_step=0)
    (aside,) = [f for f in os.listdir(tmp_path) if f.startswith("replaced_")]
    assert [r["step"] for r in read_records(os.path.join(tmp_path, aside, "metrics.jsonl")) if "loss" in r] == [0, 1, 2]
    assert [r.get("kind") for r in read_records(path)] == ["header", "header"]
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match=r"^--tensorboard .*/a_file/tb: cannot write there \(Not a directory\)"):
        RunLog(str(tmp_path / "fresh" / "metrics.jsonl"), {"flags": {}}, tensorboard_dir=str(tmp_path / "a_file" / "tb"))
    assert not (tmp_path / "fresh").exists()
    # a run that died before its first save left only its records: the advice names no resume
    with pytest.raises(ckpt.CheckpointError, match=re.escape("holds the records of a run that saved no checkpoint "
                                                             "(metrics.jsonl): train under another --model-tag, or")):
        ckpt.lock_run(types.SimpleNamespace(rank=0), None, str(tmp_path), fresh=True)
