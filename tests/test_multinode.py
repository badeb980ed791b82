"""Two nodes on localhost (gloo, CPU): two torchrun agents (c10d rendezvous) give the same losses as one node with as
many processes, with per-node data copies and base dirs; the ranks of a pooled run with a node size of its own stand
for the nodes where no launcher is under test (a node whose data differs, DP2 x TP2 over two nodes); and a rank that
stops making progress produces hang reports instead of a silent hang."""

import os
import sys
import time
import shutil
import signal
import subprocess

from conftest import run_script, run_on_pool, run_losses, TINY_MODEL, REPO
from parallel_harness import _free_port

TRAIN = ["--device-batch-size", "2", "--total-batch-size", "512", "--warmup-steps", "2", "--num-iterations", "3",
         "--eval-every", "-1", "--save-every", "0"] + TINY_MODEL
SAMPLE = os.path.join(REPO, "nanochat", "sample_data")


def start_node(node_rank, nproc, port, args, env, log_dir):
    """One torchrun agent as node `node_rank` of 2; stdout and stderr go to files in log_dir."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "-m", "scripts.base_train"] + args
    out = open(os.path.join(log_dir, f"node{node_rank}.out"), "w")
    err = open(os.path.join(log_dir, f"node{node_rank}.err"), "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True)


def read(log_dir, node, stream):
    with open(os.path.join(log_dir, f"node{node}.{stream}")) as f:
        return f.read()


def run_two_nodes(nproc, args, envs, log_dir, timeout=300):
    """Both agents to the end; returns (stdout, stderr) of both together."""
    port = _free_port()
    nodes = [start_node(n, nproc, port, args, envs[n], log_dir) for n in range(2)]
    try:
        for p in nodes:
            p.wait(timeout=timeout)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    out = read(log_dir, 0, "out") + read(log_dir, 1, "out")
    err = read(log_dir, 0, "err") + read(log_dir, 1, "err")
    assert all(p.returncode == 0 for p in nodes), f"STDOUT:\n{out[-6000:]}\nSTDERR:\n{err[-6000:]}"
    return out, err


def node_local_envs(env, tmp_path):
    """Each node its own base dir (a copy of the tokenizer) and its own copy of the data."""
    envs = []
    for n in range(2):
        base = tmp_path / f"node{n}_base"
        shutil.copytree(os.path.join(env["NANOCHAT_BASE_DIR"], "tokenizer"), base / "tokenizer")
        data = tmp_path / f"node{n}_data"
        shutil.copytree(SAMPLE, data)
        envs.append(dict(env, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_DIR=str(data)))
    return envs


def test_two_nodes_dp2_with_node_local_data_match_one_node(env, tmp_path):
    run_script("scripts.base_train", TRAIN + ["--model-tag", "one_node"], env, nproc=2)
    one = run_losses(env, "one_node")
    envs = node_local_envs(env, tmp_path)
    out, _ = run_two_nodes(1, TRAIN + ["--save-every", "2", "--model-tag", "two_nodes"], envs, str(tmp_path))
    assert len(one) == 3 and run_losses(envs[0], "two_nodes") == one
    assert "world 2 = dp 2 x tp 1 x pp 1" in out
    # node-local base dirs: rank 0 warns that the other node cannot see the checkpoint folder
    assert "is not visible from" in out
    # a resume there: rank 1's own error (no checkpoint on its node) is the one printed; then a node holding an
    # older step than rank 0's newest is refused, the ranks named, not resumed at two steps
    from nanochat.checkpoint_manager import checkpoint_dir
    resume = TRAIN + ["--model-tag", "two_nodes", "--resume-from-step", "latest"]
    p = run_on_pool("scripts.base_train", resume, envs, nproc=2, per_node=1)
    assert p.returncode != 0 and "ERROR: no checkpoint in " + checkpoint_dir("two_nodes", envs[1]["NANOCHAT_BASE_DIR"]) \
        in p.stdout, p.stdout[-3000:]
    mine, theirs = (checkpoint_dir("two_nodes", e["NANOCHAT_BASE_DIR"]) for e in envs)
    shutil.copytree(mine, theirs)
    os.remove(os.path.join(theirs, "meta_000003.json"))
    p = run_on_pool("scripts.base_train", resume, envs, nproc=2, per_node=1)
    assert p.returncode != 0 and "the ranks would resume different checkpoints: rank 1" in p.stdout, p.stdout[-3000:]
    # the same step everywhere, but rank 1's copy damaged: its error is the one printed, not "another rank failed"
    shutil.copy(os.path.join(mine, "meta_000003.json"), theirs)
    model = next(os.path.join(theirs, f) for f in sorted(os.listdir(theirs)) if f.startswith("model_000003"))
    with open(model, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    p = run_on_pool("scripts.base_train", resume, envs, nproc=2, per_node=1)
    assert p.returncode != 0 and "no longer matches the checksum saved with it" in p.stdout, p.stdout[-3000:]
    # a node whose copy of the data differs (one more shard) is refused at the start, naming the ranks
    first = sorted(f for f in os.listdir(SAMPLE) if f.endswith(".parquet"))[0]
    shutil.copy(os.path.join(SAMPLE, first), os.path.join(envs[1]["NANOCHAT_DATA_DIR"], "0_extra.parquet"))
    p = run_on_pool("scripts.base_train", TRAIN, envs, nproc=2, per_node=1)
    assert p.returncode != 0
    assert "the data differs between ranks" in p.stdout and "give every node the same shards" in p.stdout


def test_two_nodes_dp2_tp2_shared_folder_match_one_node(env, tmp_path):
    args = TRAIN + ["--tp", "2"]
    run_script("scripts.base_train", args + ["--model-tag", "one_node_tp2"], env, nproc=4)
    one = run_losses(env, "one_node_tp2")
    p = run_on_pool("scripts.base_train", args + ["--model-tag", "two_nodes_tp2"], env, nproc=4, per_node=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(one) == 3 and run_losses(env, "two_nodes_tp2") == one
    assert "world 4 = dp 2 x tp 2 x pp 1" in p.stdout


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_stalled_rank_gives_hang_reports_not_a_silent_hang(env, tmp_path):
    """Node 1's training process is stopped (SIGSTOP) after the first steps: node 0's rank reports its
    step, phase and last collective (and its stacks) once it has waited --dist-timeout, and ends by itself
    (at twice that at the latest) instead of waiting forever."""
    envs = node_local_envs(env, tmp_path)
    args = TRAIN + ["--num-iterations", "1000", "--dist-timeout", "10"]  # room for a slow start-up on a busy machine
    port = _free_port()
    nodes = [start_node(n, 1, port, args, envs[n], str(tmp_path)) for n in range(2)]
    stopped = None
    try:
        deadline = time.time() + 240
        while "step 00002/" not in read(str(tmp_path), 0, "out") + read(str(tmp_path), 1, "out"):
            assert time.time() < deadline and all(p.poll() is None for p in nodes), "training did not start"
            time.sleep(0.5)
        stopped = _children(nodes[1].pid)[0]
        os.kill(stopped, signal.SIGSTOP)
        nodes[0].wait(timeout=120)  # bounded: the waiting side must end by itself
        assert nodes[0].returncode != 0
        err = read(str(tmp_path), 0, "err")
        # the watchdog's report at --dist-timeout, or the same record from gloo's own timeout error (also
        # --dist-timeout: whichever comes first), then the end: the watchdog's at twice it, or the error's
        assert ("HANG? longer than --dist-timeout 10s in rank " in err or "FAILED with RuntimeError in rank " in err) \
            and ", phase '" in err, err[-4000:]
        assert "GIVING UP (exit 1) after twice --dist-timeout 10s" in err or "FAILED with RuntimeError in rank " in err, err[-4000:]
        reports = os.path.join(envs[0]["NANOCHAT_BASE_DIR"], "hang_reports")
        (name,) = [f for f in os.listdir(reports) if f.startswith("rank")]
        text = open(os.path.join(reports, name)).read()
        assert ", phase '" in text and "last collective: " in text and 'File "' in text  # the record and the stacks
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_watchdog_reports_a_stalled_phase_then_ends_the_process(tmp_path):
    """The stalled rank's side (in a process of its own: the watchdog ends it): its record and stacks
    once the phase outlasts the timeout, nothing while phases move on or a long one makes progress, exit status 1 at
    twice the timeout."""
    script = f"""
import time
from nanochat.common import Progress
from nanochat.watchdog import Watchdog
watch = Watchdog(3, timeout_s=0.5, report_dir={str(tmp_path)!r}, poll_s=0.05)
for step in range(10):  # phases that move on in time are never reported
    watch.phase("optimizer step", step=step)
    time.sleep(0.1)
watch.phase("val bpb", step=6)  # 1.5 s, three timeouts, but each batch is progress
progress = Progress("val bpb", 100)
for i in range(15):
    time.sleep(0.1)
    progress.update(i)
watch.phase("forward/backward", step=7)
watch.collective("loss all-reduce over DP")
time.sleep(30)
"""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and time.time() - t0 < 20, (p.returncode, p.stderr[-3000:])
    text = (tmp_path / "rank3.txt").read_text()
    record = "rank 3: step 7, phase 'forward/backward', no progress for"
    assert f"HANG? longer than --dist-timeout 0.5s in {record}" in text
    assert "last collective: loss all-reduce over DP" in text and 'File "<string>"' in text  # the stacks
    assert f"GIVING UP (exit 1) after twice --dist-timeout 0.5s in {record}" in p.stderr
    assert text.count("HANG?") == 1 and "optimizer step" not in text and "val bpb" not in text


def test_one_failure_line_per_run_though_an_earlier_run_left_its_marker(tmp_path, monkeypatch):
    """Under one torchrun id the first rank to fail prints the run's line, the next prints none; a marker an
    earlier run left under the same id (torchrun's default --rdzv-id is "none") is cleared when a run starts."""
    from nanochat.watchdog import Watchdog
    for k, v in dict(TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    (tmp_path / "failed_none_127.0.0.1_29500").write_text("")  # left by the last run under this id
    watches = [Watchdog(rank, timeout_s=60, report_dir=str(tmp_path)) for rank in (0, 1)]
    monkeypatch.setenv("MASTER_PORT", "29501")  # another run at the same time, on the same base dir
    other = Watchdog(0, timeout_s=60, report_dir=str(tmp_path))
    try:
        watches[1].phase("optimizer step", step=5)
        line = watches[1].failure(RuntimeError("boom"), lambda: "step 4 is intact there")
        assert line == (f"rank 1 stopped at step 5 in 'optimizer step': RuntimeError: boom; traceback in "
                        f"{tmp_path}/rank1.txt; step 4 is intact there")
        assert watches[0].failure(RuntimeError("Connection reset by peer"), lambda: "") is None
        assert "FAILED rank 0" in (tmp_path / "rank0.txt").read_text()
        assert other.failure(RuntimeError("boom"), lambda: "").startswith("rank 0 stopped at step None")  # its own line
    finally:
        for w in watches + [other]:
            w.stop()
