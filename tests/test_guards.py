"""What keeps a run's work safe on any machine: one run per checkpoint folder (run.lock), every shard's schema
checked at the start, a full disk named (on a small tmpfs where the test may mount one; a patched free-space call
and write elsewhere), an evaluation that fails after training began (the step is saved first), a stop under
torchrun (the STOP file: exit 0; Ctrl-C: the workers save), and torchrun asking for more GPUs than there are.
A resume on other shards: tests/test_watch.py."""

import os
import re
import json
import errno
import signal
import shutil
import socket
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_script, write_damaged_shard, ckpt_dir, errors, Started, REPO, SAMPLE_DATA, TINY_RUN
from nanochat import checkpoint_manager as ckpt, run_lock
from nanochat.common import UserError
from nanochat.dataset import DataError, check_data

TINY = TINY_RUN


# -----------------------------------------------------------------------------
# One run per checkpoint folder


def write_lock(folder, host, pid):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "run.lock"), "w") as f:
        json.dump({"host": host, "pid": pid, "started": "2026-01-01 00:00:00"}, f)


def test_a_folder_in_use_is_refused_naming_its_holder(env):
    folder = ckpt_dir(env, "locked")
    lock = run_lock.take_lock(folder)  # held by this test's process
    started = json.load(open(os.path.join(folder, "run.lock")))["started"]
    p = run_script("scripts.base_train", TINY + ["--num-iterations", "2", "--model-tag", "locked"], env, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors(p) == [f"ERROR: {folder} is in use by another run (PID {os.getpid()} on {socket.gethostname()}, "
                         f"started {started}): wait for it to end or use another --model-tag"], p.stdout[-1500:]
    assert "step 00000" not in p.stdout and json.load(open(os.path.join(folder, "run.lock")))["pid"] == os.getpid()
    with pytest.raises(ckpt.CheckpointError, match="is in use by another run"):
        run_lock.take_lock(folder)  # a second lock in one process is refused too: the lock is the flock, not the PID
    run_lock.release_lock(lock)
    # a lock file of another host counts as held (its flock may not be visible from here)
    write_lock(folder, "gpu-node-7", 1)
    with pytest.raises(ckpt.CheckpointError, match=re.escape("is in use by another run (PID 1 on gpu-node-7")):
        run_lock.take_lock(folder)


def test_a_lock_whose_process_is_gone_is_taken_over_then_released(env):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(ckpt_dir(env, "stale"), socket.gethostname(), gone.pid)
    p = run_script("scripts.base_train", TINY + ["--num-iterations", "2", "--model-tag", "stale"], env)
    assert f"note: took over {ckpt_dir(env, 'stale')}/run.lock from a run that is gone (PID {gone.pid}" in p.stdout
    assert not os.path.exists(os.path.join(ckpt_dir(env, "stale"), "run.lock"))  # released at the end
    assert os.path.exists(os.path.join(ckpt_dir(env, "stale"), "meta_000002.json"))


def test_a_lock_file_nobody_holds_is_taken_whatever_it_names(tmp_path):
    """A file naming a live process of this host that holds no lock (its PID reused after a crash, or in another PID
    namespace), and an empty file (killed as it wrote), are taken over: only a held flock refuses."""
    write_lock(str(tmp_path), socket.gethostname(), 1)
    lock = run_lock.take_lock(str(tmp_path))
    assert json.load(open(tmp_path / "run.lock"))["pid"] == os.getpid()
    run_lock.release_lock(lock)
    (tmp_path / "run.lock").write_text("")
    run_lock.release_lock(run_lock.take_lock(str(tmp_path)))
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_released_while_the_next_run_opens_it_is_not_held_twice(tmp_path, monkeypatch):
    """Run B opens run.lock; run A ends (removes the file, drops its lock) before B's flock: B must lock the file now
    there, not the removed one, or a run C would take the folder too."""
    import fcntl
    import types
    a = run_lock.take_lock(str(tmp_path))
    released = []

    def flock(f, how):  # A releases between B's open and its flock
        if not released:
            released.append(run_lock.release_lock(a))
        return fcntl.flock(f, how)
    monkeypatch.setattr(run_lock, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX,
                                                                 LOCK_NB=fcntl.LOCK_NB))
    b = run_lock.take_lock(str(tmp_path))
    monkeypatch.setattr(run_lock, "fcntl", fcntl)
    with pytest.raises(ckpt.CheckpointError, match="in use by another run"):
        run_lock.take_lock(str(tmp_path))  # C
    run_lock.release_lock(b)


def test_without_file_locks_a_live_pid_of_this_host_holds_the_folder(tmp_path, monkeypatch):
    """A filesystem without flock (ENOSYS): the lock file's PID decides, as before the flock."""
    def no_locks(f, how):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    write_lock(str(tmp_path), socket.gethostname(), os.getpid())
    with pytest.raises(ckpt.CheckpointError, match=f"in use by another run \\(PID {os.getpid()} on"):
        run_lock.take_lock(str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(str(tmp_path), socket.gethostname(), gone.pid)
    run_lock.release_lock(run_lock.take_lock(str(tmp_path)))
    def not_ours(pid, sig):  # a live process of another user: signal 0 is refused, yet it is alive
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(run_lock.os, "kill", not_ours)
    write_lock(str(tmp_path), socket.gethostname(), 4242)
    with pytest.raises(ckpt.CheckpointError, match="in use by another run \\(PID 4242 on"):
        run_lock.take_lock(str(tmp_path))


def test_a_release_removes_only_its_own_lock_file_and_closes_it(tmp_path):
    """A lock file replaced since it was taken (another run's now) stays when the first run releases its own."""
    lock = run_lock.take_lock(str(tmp_path))
    os.remove(tmp_path / "run.lock")
    (tmp_path / "run.lock").write_text('{"pid": 1}')
    run_lock.release_lock(lock)
    assert (tmp_path / "run.lock").read_text() == '{"pid": 1}' and lock.closed


# -----------------------------------------------------------------------------
# The data's schema, at the start


def write_shard(path, texts):
    pq.write_table(pa.table({"text": texts}), path)


@pytest.mark.parametrize("bad", ["train", "val"])
def test_a_text_column_of_another_type_is_named_at_the_start(env, tmp_path, bad):
    """Every shard is opened at the start: a `text` column of integers stops the run before its first step,
    naming the file, whether it is a training shard or the validation shard (the last)."""
    shutil.copy(os.path.join(SAMPLE_DATA, "sample_00000.parquet"), tmp_path / "a.parquet")
    shutil.copy(os.path.join(SAMPLE_DATA, "sample_00001.parquet"), tmp_path / "c.parquet")
    wrong = tmp_path / ("b.parquet" if bad == "train" else "d.parquet")
    write_shard(wrong, list(range(100)))
    with pytest.raises(DataError, match=re.escape(f"{wrong}: its `text` column holds int64, not strings")):
        check_data(str(tmp_path))
    if bad == "val":  # and through base_train: one line, nothing trained
        p = run_script("scripts.base_train", TINY + ["--num-iterations", "2", "--data-dir", str(tmp_path),
                                                     "--model-tag", "schema"], env, check=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr and "step 00000" not in p.stdout, p.stderr[-2000:]
        assert len(errors(p)) == 1 and str(wrong) in errors(p)[0], p.stdout[-1500:]


def test_an_evaluation_that_fails_after_training_began_saves_the_step_first(env, tmp_path):
    """A validation shard whose later pages are damaged passes the start-of-run check; the final evaluation
    reaches them and fails: the step is saved first, and the run ends with one line saying so."""
    shutil.copy(os.path.join(SAMPLE_DATA, "sample_00000.parquet"), tmp_path / "a.parquet")
    write_damaged_shard(tmp_path / "b.parquet", 16)  # the validation shard: 2 row groups, the second damaged
    p = run_script("scripts.base_train", TINY + ["--num-iterations", "4", "--data-dir", str(tmp_path), "--eval-tokens",
                                                 "16384", "--model-tag", "evalfails"], env, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = errors(p)
    assert len(line) == 1 and line[0].startswith("ERROR: validation at step 4: ") and "b.parquet" in line[0], p.stdout[-1500:]
    assert line[0].endswith("(saved step 4: resume with --resume-from-step 4)"), line[0]
    assert os.path.exists(os.path.join(ckpt_dir(env, "evalfails"), "meta_000004.json"))


# -----------------------------------------------------------------------------
# A full disk


def tiny_state(mib):
    return {"w": torch.zeros(mib * 2**18)}  # mib MiB of fp32


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 9 MiB tmpfs (None where this process may not mount one)."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0 if shutil.which("mount") else False
    yield str(folder) if mounted else None
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_is_named_and_the_earlier_step_stays_intact(small_disk, tmp_path, monkeypatch):
    folder = small_disk or str(tmp_path / "patched")
    ckpt.save_stage_files(folder, 1, tiny_state(1), None)
    ckpt.save_meta(folder, 1, {"step": 1})
    if small_disk is None:  # no tmpfs here: a disk with 2 MiB free
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(9 << 20, 7 << 20, 2 << 20))
    # before writing: 9 MiB do not fit in what is free
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"the disk is full: saving step 2 in {folder} needs about "
                                                             f"9.0 MiB and ")) as e:
        ckpt.save_stage_files(folder, 2, tiny_state(9), None)
    assert str(e.value).endswith("is free; step 1 is intact there (resume with --resume-from-step 1). Free some space, "
                                 "or set NANOCHAT_BASE_DIR to a disk with room")
    # while writing: the free-space call was wrong (another writer filled the disk); a real ENOSPC on the tmpfs
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
    if small_disk is None:
        def no_space(obj, f, **kwargs):
            f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(ckpt.torch, "save", no_space)
    with pytest.raises(ckpt.CheckpointError, match="the disk is full: saving step 2 .* step 1 is intact there"):
        ckpt.save_stage_files(folder, 2, tiny_state(9), None)
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == ["meta_000001.json", "model_000001.pt"]  # no half-written file left
    assert ckpt.load_checkpoint(folder, 1, "cpu", load_optimizer=False)[0]["w"].numel() == 2**18


def test_a_run_whose_disk_fills_up_stops_with_one_line(env, small_disk):
    """base_train saving every 2 steps into a folder with room for one checkpoint: the step-4 save is refused with
    the sizes and the intact step; the run exits 1 without a traceback."""
    if small_disk is None:
        pytest.skip("cannot mount a tmpfs here (the free-space check is tested with a patched call above)")
    tag = "fulldisk"
    os.makedirs(os.path.dirname(ckpt_dir(env, tag)), exist_ok=True)
    os.symlink(small_disk, ckpt_dir(env, tag))
    with open(os.path.join(small_disk, "filler"), "wb") as f:  # the tiny model's checkpoint is 3 MiB: room for one
        f.write(b"\0" * (5 << 19))
    p = run_script("scripts.base_train", TINY + ["--num-iterations", "6", "--save-every", "2", "--model-tag", tag], env,
                   check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "saved checkpoint for step 2" in p.stdout, p.stdout[-2000:]
    assert len(errors(p)) == 1 and re.match(
        rf"ERROR: the disk is full: saving step 4 in {re.escape(ckpt_dir(env, tag))} needs about [\d.]+ MiB and "
        r"[\d.]+ MiB is free; step 2 is intact there \(resume with --resume-from-step 2\)", errors(p)[0]), p.stdout[-1500:]
    assert not [f for f in os.listdir(small_disk) if ".tmp." in f]
    os.remove(ckpt_dir(env, tag))


# -----------------------------------------------------------------------------
# Stopping under torchrun; more processes than GPUs


def start_torchrun(env, tag):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "scripts.base_train"] + TINY + ["--num-iterations", "100000", "--model-tag", tag, "--device-batch-size", "2"]
    return Started(cmd, env, "step 00003/", start_new_session=True)  # its own process group, as a terminal's job


def test_a_stop_that_comes_during_a_save_ends_the_run_after_it(env, monkeypatch):
    """The STOP file created while step 2 is being saved: the run stops there (step 2 saved, nothing after it)."""
    from nanochat import checkpoint_manager
    save_meta, tag = checkpoint_manager.save_meta, "stop_in_save"

    def save_then_stop(ckpt_dir, step, meta, *rest):
        save_meta(ckpt_dir, step, meta, *rest)
        if step == 2:
            open(os.path.join(ckpt_dir, "STOP"), "w").close()
    monkeypatch.setattr(checkpoint_manager, "save_meta", save_then_stop)
    p = run_script("scripts.base_train", TINY + ["--num-iterations", "6", "--save-every", "2", "--model-tag", tag], env)
    assert p.stdout.splitlines()[-1] == "stopped: saved step 2: resume with --resume-from-step 2", p.stdout[-1500:]
    assert checkpoint_manager.saved_steps(ckpt_dir(env, tag)) == [2]


@pytest.mark.parametrize("how", ["STOP file", "Ctrl-C"])
def test_a_stop_under_torchrun_saves_and_says_how_to_resume(env, how):
    """The STOP file: the workers save and torchrun exits 0. Ctrl-C reaches torchrun too, which then exits 1
    whatever its workers did (the README says so); the workers still save and print the same last line."""
    tag = f"stop_{how.split()[0].lower().replace('-', '')}"
    proc = start_torchrun(env, tag)
    if how == "STOP file":
        open(os.path.join(ckpt_dir(env, tag), "STOP"), "w").close()
    else:
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.finish(timeout=120)
    step = int(re.search(r"saved checkpoint for step (\d+)", out).group(1))
    assert out.splitlines()[-1] == f"stopped: saved step {step}: resume with --resume-from-step {step}", out[-1000:]
    assert os.path.exists(os.path.join(ckpt_dir(env, tag), f"meta_{step:06d}.json"))
    assert not os.path.exists(os.path.join(ckpt_dir(env, tag), "run.lock"))
    if how == "STOP file":
        assert proc.returncode == 0 and not os.path.exists(os.path.join(ckpt_dir(env, tag), "STOP")), err[-2000:]


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    from nanochat.distributed import compute_init
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match=re.escape("torchrun started 2 processes on this node, which has 1 GPU(s): one "
                                                  "GPU per process; use --nproc_per_node=1 (or --device-type=cpu)")):
        compute_init("cuda")


def test_stop_file_is_polled_and_removed(tmp_path):
    """signals: creating the file is a stop request; the poll that finds it removes it (a resume goes on)."""
    code = f"""
import os
from nanochat import signals
signals.install_stop_handlers({str(tmp_path / 'STOP')!r})
assert not signals.stop_requested()
open({str(tmp_path / 'STOP')!r}, "w").close()
assert signals.stop_requested() and not os.path.exists({str(tmp_path / 'STOP')!r}) and signals.stop_requested()
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "found " in p.stdout, p.stderr


def test_ctrl_c_is_acknowledged_at_once_and_a_second_stops_now():
    """The first Ctrl-C says at once that the run will stop after its step, with a save (a first step compiles for
    minutes); a second ends the process there (what was saved is whole); SIGTERM waits to be said by the run."""
    code = """
import os, signal
from nanochat import signals
signals.install_stop_handlers()
os.kill(os.getpid(), signal.SIGTERM)
assert signals.stop_requested()
signals._stop_signal = signals._announced = None
os.kill(os.getpid(), signal.SIGINT)
assert signals.stop_requested()
print("still running", flush=True)
os.kill(os.getpid(), signal.SIGINT)
print("not reached", flush=True)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGINT and "still running" in p.stdout and "not reached" not in p.stdout, p.stderr
    assert p.stdout.splitlines()[0] == "received signal 15: stopping at the next step or evaluation batch", p.stdout
    assert p.stderr.splitlines() == ["received Ctrl-C: stopping after this step or evaluation batch, with a save "
                                     "(Ctrl-C again: now)", "Ctrl-C again: stopping now, without saving"], p.stderr
