"""The dev tools (dev/) on CPU: every tool has a main() and a --help that runs nothing; dev/runs.py launches a tiny
base_train and reads it back from its metrics.jsonl (and reads an old tree's printout into the same records);
bench_recompute's CPU smoke builds through training.setup and prints its table; bench_train's table sets the
ratios (to bf16, to one GPU, to the ideal pipeline step) and the loss agreement with the baseline from the runs'
results."""

import os
import re
import json
import importlib

import pytest

from conftest import REPO, TINY_MODEL, run_script

TOOLS = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "dev"))
               if f.endswith(".py") and f not in ("__init__.py", "runs.py"))


def test_every_tool_has_main_and_a_help_that_runs_nothing(capsys):
    assert {"bench_train", "bench_kernels", "bench_recompute", "profile_step", "quality_ab", "vs_upstream",
            "score_bpb", "comm_model", "plot_scaling", "pipeline_sim", "ladder"} <= set(TOOLS)
    for tool in TOOLS:
        module = importlib.import_module(f"dev.{tool}")
        assert callable(getattr(module, "main", None)), tool
    assert capsys.readouterr().out == ""  # importing printed nothing: no work on import
    for tool in TOOLS:  # in this process: --help prints the usage and exits before any work
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"dev.{tool}").main(["--help"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage:"), tool


def test_runs_launches_base_train_and_reads_its_metrics(env, tmp_path):
    from dev import runs
    flags = TINY_MODEL + ["--device-batch-size", "4", "--total-batch-size", "512", "--num-iterations", "3"]
    job = runs.start(flags, "dev_runs", env=env, log=str(tmp_path / "run.log"), timeout=300)
    run = job.run()
    assert sorted(run.losses()) == [0, 1, 2] and run.header["model_config"]["n_layer"] == 2
    s = runs.summary(run, warmup=1)
    assert s["steps"] == 3 and s["steps_timed"] == 2 and s["step_ms"] > 0 and s["tok_per_sec"] > 0
    assert s["val_bpb"] is not None and s["epoch"] == 1 and s["peak_mem_gib"] is None  # CPU: no peak memory
    assert run.end["training_time_s"] is None  # 3 steps: none timed (the first 11 compile), not a time of 0
    from dev.bench_train import planned_peak  # what scripts.plan predicts for the run, from its header's flags
    assert 0 < planned_peak(run.header) < 1
    older = dict(run.header, flags={k: v for k, v in run.header["flags"].items() if k != "cp_exchange"})
    assert planned_peak(older) == planned_peak(run.header)  # a tree from before --cp-exchange: no CP, no exchange
    # a run that asked for fp8 and trained in bf16 (no GPU here) is a failure, not a bf16 figure
    job = runs.start(flags + ["--fp8", "--eval-tokens", "0"], "dev_runs_fp8", env=env, log=str(tmp_path / "fp8.log"))
    try:
        job.run()
        raise AssertionError("a bf16 fallback was read as an fp8 run")
    except runs.RunFailed as e:
        assert "--fp8 fell back to bf16" in str(e)


def test_ladder_goes_on_where_a_part_stopped_and_prices_b_on_a_ladder(env, tmp_path, monkeypatch, capsys):
    """Three depths, one seed a side, in two parts: the first starts one run (--stop-after), the second the five
    left, two at a time; the table has every depth and side, and B's multipliers read off A's ladder; the plot is
    written."""
    from dev import ladder
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--depths", "1,2,3", "--ratio", "0.02", "--eval-tokens", "512", "--out", str(tmp_path),
            "--b-args=--matrix-lr=0.05",
            "--args=--device-type=cpu --aspect-ratio=32 --head-dim=32 --max-seq-len=64 --device-batch-size=4 "
            "--total-batch-size=512 --warmup-steps=1"]
    launched = lambda out: sum(line.startswith("== ") for line in out.splitlines())
    ladder.main(argv + ["--stop-after", "0.001"])
    out = capsys.readouterr().out
    assert launched(out) == 1 and "with 5 runs to go: run the same command again" in out
    ladder.main(argv + ["--gpus", "0,0,1"])  # three at a time, two of them sharing GPU 0
    out = capsys.readouterr().out
    assert "1 runs; to go: 5" in out and launched(out) == 5 and "of shared GPUs)" in out
    records = {(r["side"], r["depth"]): r for r in map(json.loads, open(tmp_path / "results.jsonl"))}
    assert all(records["B", d]["gpu"] == records["A", d]["gpu"] for d in (2, 3))  # each B on its A's GPU
    assert records["A", 3]["gpu"] == "1" and not records["A", 3]["shared"] and records["A", 2]["shared"]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in out.splitlines() if re.match(r"\| d\d", line)}
    assert sorted(rows) == [(f"d{d}", s) for d in (1, 2, 3) for s in "AB"]
    multiplier = r"[~*]{0,2}(\d+\.\d\d|\d\.\de-\d\d)"  # below 0.1 in powers of ten
    assert all(re.search(rf"\| {multiplier} \| {multiplier} \|$", rows[(f"d{d}", "B")]) for d in (1, 2, 3))
    assert os.path.getsize(tmp_path / "ladder.png") > 0 and len(open(tmp_path / "results.jsonl").readlines()) == 6
    with pytest.raises(SystemExit, match="the sides must score the same bytes"):
        ladder.main(argv + ["--a-args=--max-seq-len=128"])
    with pytest.raises(SystemExit, match="the sides must score the same bytes"):
        ladder.main(argv + ["--b-args", "--max-seq-len 128"])
    with pytest.raises(SystemExit, match="side A scores 384"):  # 512 tokens asked for in micro-batches of 192
        ladder.main(argv + ["--a-args=--device-batch-size=3"])
    ladder.main(argv + ["--data-dir", str(tmp_path / "other"), "--stop-after", "0.001"])  # other data: nothing counts
    assert "done in an earlier part" not in capsys.readouterr().out


def test_quality_ab_runs_each_b_after_its_a_on_the_same_gpu_with_paired_seeds(env, tmp_path, monkeypatch, capsys):
    """Two runs a side over two GPUs: B run i follows A run i on A's GPU, both with seed 42 + i; the table has both
    sides, and B - A; sides that evaluate other tokens are told so."""
    from dev import quality_ab
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    toy = ("--device-type=cpu --depth=1 --aspect-ratio=32 --head-dim=32 --max-seq-len=64 --device-batch-size=4 "
           "--total-batch-size=512 --eval-tokens=512 --warmup-steps=1")
    quality_ab.main(["--runs", "2", "--num-iterations", "3", "--gpus", "0,1", "--log-dir", str(tmp_path),
                     f"--a-args={toy}", f"--b-args={toy} --matrix-lr=0.05"])
    out = capsys.readouterr().out
    launches = {(s, i): (gpu, line) for s, i, gpu, line in re.findall(r"== ([AB])(\d) on GPU (\d): (.*)", out)}
    assert len(launches) == 4 and all(launches["B", i][0] == launches["A", i][0] for i in "01")
    assert all(f"--seed={42 + int(i)} " in launches[s, i][1] for s, i in launches)
    assert re.search(r"\| A: .* \| 2 \|", out) and re.search(r"\| B: .* \| 2 \|", out) and "B - A (val bpb)" in out
    assert "val bpb of other tokens" not in out
    quality_ab.main(["--runs", "1", "--num-iterations", "2", "--log-dir", str(tmp_path), f"--a-args={toy}",
                     f"--b-args={toy} --device-batch-size=3"])  # 512 tokens asked for, micro-batches of 192
    assert "val bpb of other tokens" in capsys.readouterr().out


def test_tree_version_names_the_commit_and_the_changes_not_yet_committed(tmp_path):
    """A result's code: the commit, and a hash of the uncommitted changes (untracked files' contents included, an
    untracked link to a folder, such as a linked .venv, passed over) that changes with them."""
    import subprocess
    from dev import runs
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    clean = runs.tree_version(str(tmp_path))
    assert re.fullmatch(r"[0-9a-f]{40}", clean)
    (tmp_path / "folder").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "folder")
    assert runs.tree_version(str(tmp_path)) == clean
    (tmp_path / "new.py").write_text("y = 2\n")
    changed = runs.tree_version(str(tmp_path))
    (tmp_path / "new.py").write_text("y = 3\n")
    assert changed.startswith(clean + "+") and runs.tree_version(str(tmp_path)) not in (clean, changed)
    (tmp_path / "new.py").unlink()
    (tmp_path / "ladder_out").mkdir()  # a tool's results inside the checkout are not code
    (tmp_path / "ladder_out" / "results.jsonl").write_text("{}\n")
    assert runs.tree_version(str(tmp_path), str(tmp_path / "ladder_out")) == clean != runs.tree_version(str(tmp_path))
    assert runs.tree_version(str(tmp_path), str(tmp_path.parent / "elsewhere")) != clean  # outside: nothing left out
    (tmp_path / "ladder_out" / "upstream").mkdir()  # another project's copy inside this checkout: not our commit
    assert runs.tree_version(str(tmp_path / "ladder_out" / "upstream")) == ""
    (tmp_path / "sub").mkdir()  # a tracked folder (a harness kept inside a larger repository): that repository's
    (tmp_path / "sub" / "b.py").write_text("z = 1\n")
    git("add", "sub")
    assert runs.tree_version(str(tmp_path / "sub")).startswith(clean + "+")


def test_ladder_reads_b_off_a_s_ladder():
    from dev.ladder import equivalent
    falling = [(0.0, 3.0), (1.0, 2.0), (2.0, 1.5)]  # (log FLOPs, bpb) by depth
    assert equivalent(falling, 2.5) == (0.5, "")
    assert equivalent(falling, 1.25) == (2.5, "~")  # beyond the top: the last segment's slope
    x, mark = equivalent([(0.0, 3.0), (1.0, 3.1), (2.0, 1.0)], 2.0)  # a noisy ladder: the least-squares line
    assert mark == "*" and x == pytest.approx(1 + (2.0 - 7.1 / 3) / -1.0)
    assert equivalent([(0.0, 3.0), (1.0, 3.1), (2.0, 1.0)], 0.2)[1] == "*~"  # that line, beyond A's ladder


def test_ladder_table_prices_b_on_a_s_ladder():
    """The multipliers by hand: A's bpb falls 3 -> 2 -> 1 over 1e10 -> 1e11 -> 1e12 FLOPs (10, 20, 40 s); B's median
    over three seeds, 1.5, is reached by A at 10^11.5 FLOPs and at sqrt(20 x 40) s: B at 1e11 FLOPs and 40 s gets
    there with 3.16x less compute and 0.71x the wall clock; below A's best bpb, from its last segment (~)."""
    from dev.ladder import table
    run = lambda side, depth, seed, bpb, flops, seconds: dict(side=side, depth=depth, seed=seed, val_bpb=bpb,
                                                              tok_per_sec=1.0, flops=flops, seconds=seconds)
    results = [run("A", 1, 42, 3.0, 1e10, 10.0), run("A", 2, 42, 2.0, 1e11, 20.0), run("A", 3, 42, 1.0, 1e12, 40.0),
               run("B", 2, 42, 1.9, 1e11, 40.0), run("B", 2, 43, 1.4, 1e11, 40.0), run("B", 2, 44, 1.5, 1e11, 40.0),
               run("B", 3, 42, 0.5, 1e12, 40.0)]
    rows = {line.split("|")[1].strip() + line.split("|")[2].strip(): line for line in
            table({s: {"name": s} for s in "AB"}, [1, 2, 3], results).splitlines() if line.startswith("| d")}
    assert rows["d2B"].endswith("| 3 | 1.9000, 1.4000, 1.5000 | 1.5000 | 0.5000 | 1 | 1.000e+11 | 40.0 | 3.16 | 0.71 |")
    assert rows["d3B"].endswith("| ~3.16 | ~1.41 |") and rows["d1B"].endswith("| 0 | | | | | | | | |")
    results.append(run("B", 1, 42, 6.0, 1e10, 10.0))  # far above A's ladder: a multiplier of 1e-3
    assert table({s: {"name": s} for s in "AB"}, [1, 2, 3], results).count("| ~1.0e-03 |") == 1
    # diverged runs (a NaN bpb) are counted beside the others and change no median, spread or multiplier
    results += [run("B", 2, 45, float("nan"), 1e11, 40.0), run("A", 2, 43, float("nan"), 1e11, 20.0)]
    out = table({s: {"name": s} for s in "AB"}, [1, 2, 3], results)
    assert "| 3 (+1 diverged) | 1.9000, 1.4000, 1.5000 | 1.5000 | 0.5000 | 1 | 1.000e+11 | 40.0 | 3.16 | 0.71 |" in out
    assert "| d2 | A | 1 (+1 diverged) | 2.0000 |" in out and "nan" not in out


def test_ladder_table_names_the_runs_that_spiked():
    """A seed far from the others is explained in the table itself: its spikes stand beside its bpb."""
    from dev.ladder import table
    run = lambda side, depth, seed, bpb, **more: dict(side=side, depth=depth, seed=seed, val_bpb=bpb, tok_per_sec=1.0,
                                                      flops=10.0 ** depth, seconds=float(depth), **more)
    results = [run("A", 1, 42, 3.0), run("A", 2, 42, 2.0), run("B", 1, 42, 2.9, spikes=0),
               run("B", 2, 42, 2.5, spikes=2), run("B", 2, 43, 1.9)]  # seed 43 as an earlier part recorded it
    out = table({s: {"name": s} for s in "AB"}, [1, 2], results)
    assert "| d2 | B | 2 | 2.5000 (2 spikes), 1.9000 |" in out and "| d1 | B | 1 | 2.9000 |" in out


OLD_LOG = """attention: SDPA (cuDNN)
LR scale sqrt(B/2^19) = 0.3536; Muon weight decay = 0.28 x 0.3536 x D_ref/D 100.8500 = 9.98400; total FLOPs 1e15
step 00000/00002 (0.00%) | loss: 10.397000 | lrm: 0.03 | dt: 9000.00ms | tok/sec: 7,282 | mfu: 1.10 | epoch: 1
step 00001/00002 (50.00%) | loss: 10.100000 | lrm: 0.05 | dt: 110.50ms | tok/sec: 593,080 | mfu: 55.20 | epoch: 1
[dp=0 pp=0] peak memory: 40.61 GiB; allocated after the last step: 3.00 GiB
[dp=0 pp=1] peak memory: 24.70 GiB; allocated after the last step: 2.00 GiB
Validation bpb: 1.470300
minimum validation bpb: 1.470300; peak memory: 40.61 GiB
"""


def test_old_tree_printout_reads_as_records(tmp_path):
    from dev import runs
    path = tmp_path / "old.metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs.old_tree_records(OLD_LOG, ["--fp8"])))
    run = runs.Run(str(path))
    assert run.header["attention"] == "SDPA (cuDNN)" and run.header["fp8"] and run.header["weight_decay"] == 9.984
    s = runs.summary(run, warmup=1)
    assert s["steps"] == 2 and s["step_ms"] == 110.5 and s["tok_per_sec"] == 593080 and s["mfu"] == 55.2
    assert s["val_bpb"] == 1.4703 and s["peak_mem_gib"] == 40.61
    assert runs.rank_peaks(run) == {"[dp=0 pp=0]": 40.61, "[dp=0 pp=1]": 24.7}


def test_bench_recompute_cpu_smoke(env):
    p = run_script("dev.bench_recompute", ["--depths", "2", "--seq-len", "64", "--device-batch-size", "2", "--batches",
                                           "1,2", "--steps", "2", "--warmup", "1"], env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    table = p.stdout.split("\n\n")[-1].splitlines()
    assert table[0].split(" | ")[0].strip() == "depth" and [r.split("|")[1].strip() for r in table[2:]] == \
        ["none", "selective", "block"]


def test_run_queue_packs_runs_of_several_gpus(monkeypatch):
    """runs.run_queue: a run takes as many free GPUs as it needs, the first that fits starts first (a one-GPU run
    beside a two-GPU one), never two on one GPU; one wider than the host is left in the queue."""
    from dev import runs
    monkeypatch.setattr(runs.time, "sleep", lambda s: None)
    clock, started, busy = [0], [], set()

    class Job:  # ends two ticks of the queue's loop after it starts
        def __init__(self, gpus):
            self.end = clock[0] + 2
        def done(self):
            clock[0] += 1
            return clock[0] >= self.end

    def launch(task, gpus):
        assert not busy & set(gpus) and len(gpus) == task[1]
        busy.update(gpus)
        started.append((task[0], tuple(gpus)))
        return Job(gpus)

    def finished(task, job, gpus):
        busy.difference_update(gpus)
    left = runs.run_queue([("a", 4), ("b", 2), ("c", 1), ("d", 2), ("e", 8)], [0, 1, 2, 3], launch, finished,
                          width=lambda task: task[1])
    assert left == [("e", 8)] and [s[0] for s in started] == ["a", "b", "c", "d"]
    assert started[:3] == [("a", (0, 1, 2, 3)), ("b", (0, 1)), ("c", (2,))]  # c beside b; d when two are free


def test_a_job_past_its_timeout_ends_torchrun_s_workers_too(tmp_path):
    """torchrun starts each worker in a session of its own: a Job that only killed torchrun at its timeout left them
    running on the GPUs the queue then handed to the next run."""
    import sys
    import time
    from dev import runs
    (tmp_path / "sleeper.py").write_text("import os, time\nopen(os.path.join(os.path.dirname(__file__), "
                                         "f\"worker{os.environ['RANK']}.pid\"), 'w').write(str(os.getpid()))\n"
                                         "time.sleep(300)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "sleeper.py"]
    job = runs.Job(cmd, str(tmp_path), runs.process_env({"OMP_NUM_THREADS": "1"}), [], "x", str(tmp_path / "log"),
                   None, None)
    pid_files = [tmp_path / f"worker{r}.pid" for r in (0, 1)]
    for _ in range(600):  # the workers are up
        if all(f.exists() and f.read_text() for f in pid_files):
            break
        time.sleep(0.1)
    job.timeout = time.time() - job.t0  # its time is up now
    assert job.done() and job.timed_out
    for f in pid_files:
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def test_vs_upstream_refuses_a_work_dir_prepared_from_other_data(tmp_path, capsys):
    """Its links to the shards and both tokenizers are of the data it was prepared from: another --data-dir would
    have mixed the two sets' shards in upstream's runs."""
    from types import SimpleNamespace
    from dev.vs_upstream import prepare
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir()
    for name in ("shard_00000.parquet", "shard_00001.parquet"):
        (data / name).write_bytes(b"")
    work.mkdir()
    (work / "data_dir").write_text("/elsewhere")
    with pytest.raises(SystemExit):
        prepare(SimpleNamespace(data_dir=str(data), work=str(work)))
    assert "was prepared from --data-dir /elsewhere" in capsys.readouterr().out


def test_vs_upstream_scores_only_a_run_of_the_code_at_hand(tmp_path, capsys):
    """The bpb check scores an equal-steps run's checkpoint only where that run was made by the tree as it is now."""
    from types import SimpleNamespace
    from dev import runs
    from dev.vs_upstream import bpb_part
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir()
    (data / "shard_00000.parquet").write_bytes(b"")
    (work / "ours" / "base_checkpoints" / "steps_ours_0").mkdir(parents=True)
    row = dict(part="steps", side="ours", setting="own rule", tag="steps_ours_0", val_bpb=1.5,
               version=runs.tree_version(runs.REPO, str(work)) + "-another")
    c = SimpleNamespace(data_dir=str(data), work=str(work), fa4_path=None, load_results=lambda: [row],
                        tree=lambda side: runs.REPO)
    with pytest.raises(SystemExit):
        bpb_part(c)
    assert "needs a saved equal-steps run of 'ours' by this code" in capsys.readouterr().out


def test_vs_upstream_reads_upstream_s_printout():
    """Upstream writes no run record: its steps from the warm-up on, its peak (printed in MiB) and its attention."""
    from dev.vs_upstream import upstream_row
    text = ("WARNING: Flash Attention 3 not available, using PyTorch SDPA fallback\n"
            "step 00000/00003 (0.00%) | loss: 10.0 | dt: 9000.00ms | tok/sec: 1\n"
            "step 00001/00003 (33.33%) | loss: 9.0 | dt: 930.00ms | tok/sec: 2\n"
            "step 00002/00003 (66.67%) | loss: 8.0 | dt: 926.00ms | tok/sec: 2\n"
            "Peak memory usage: 94248.96MiB\nValidation bpb: 1.6240\n")
    row = upstream_row(text, warmup=1)
    assert (row["steps"], row["step_ms"], row["steps_timed"], row["peak_gib"], row["val_bpb"], row["attention"]) == \
        (3, 928.0, 2, 92.04, 1.624, "PyTorch SDPA")


def test_vs_upstream_runs_its_quality_runs_parallel_at_a_time(monkeypatch):
    """Its queue: at most --parallel runs at once, flags made at start, each run's row recorded with its part, only
    the checkpoints asked for kept."""
    from types import SimpleNamespace
    from dev import runs, vs_upstream
    monkeypatch.setattr(runs.time, "sleep", lambda s: None)
    live, recorded, dropped, most = [], [], [], [0]

    class Job:
        def __init__(self, tag):
            self.tag, self.polls = tag, 0
            live.append(tag)
            most[0] = max(most[0], len(live))

        def done(self):
            self.polls += 1
            if self.polls == 3:
                live.remove(self.tag)
            return self.polls >= 3

    c = SimpleNamespace(args=SimpleNamespace(parallel=2), start=lambda side, flags, tag: Job(tag),
                        finish=lambda job, side: dict(tag=job.tag, side=side, val_bpb=1.0, muon_decay=0.1, steps=3),
                        record=recorded.append, drop_checkpoint=lambda row: dropped.append(row["tag"]))
    jobs = [("ours", ["--x"], f"t{i}", "steps", dict(setting="own rule")) for i in range(4)]
    jobs.append(("upstream", lambda: ["--made-now"], "t4", "walltime", {}))
    vs_upstream.run_queue(c, jobs, keep=lambda row: row["tag"] == "t0")
    assert most[0] == 2 and [r["tag"] for r in recorded] == ["t0", "t1", "t2", "t3", "t4"]
    assert recorded[0]["setting"] == "own rule" and recorded[4]["part"] == "walltime"
    assert dropped == ["t1", "t2", "t3", "t4"]


def test_vs_upstream_takes_each_ratio_within_one_call(capsys):
    """Two calls on two machines: each call's ours over its own upstream, never the best of one over the other's."""
    from dev.vs_upstream import report
    row = lambda call, side, tok_s: dict(part="speed", call=call, side=side, depth=12, seq_len=2048, device_batch=32,
                                         tok_s=tok_s, step_ms=1.0, peak_gib=None, attention="")
    report([row("1", "ours", 179806), row("1", "upstream", 169132), row("2", "ours", 186000), row("2", "upstream", 163000)])
    out = capsys.readouterr().out
    assert "1.063x" in out and "1.141x" in out and "1.100x" not in out


def test_run_queue_runs_a_follow_up_on_the_same_gpus(monkeypatch):
    """runs.run_queue: a task that finished() hands on starts at once on the GPUs its predecessor had (a
    configuration's runs in two trees compared on the same GPUs), even with another task waiting for them."""
    from dev import runs
    monkeypatch.setattr(runs.time, "sleep", lambda s: None)
    started = []

    class Job:
        def __init__(self):
            self.polls = 0
        def done(self):
            self.polls += 1
            return self.polls >= 2

    def launch(task, gpus):
        started.append((task, tuple(gpus)))
        return Job()

    def finished(task, job, gpus):
        return (task[0], "new") if task[1] == "old" else None
    runs.run_queue([("a", "old"), ("b", "old"), ("c", "old")], [0, 1], launch, finished)
    gpus = dict(started)
    assert len(started) == 6 and all(gpus[(t, "new")] == gpus[(t, "old")] for t in "abc")
    assert started.index((("c", "old"), gpus[("c", "old")])) > started.index((("a", "new"), gpus[("a", "new")]))


def test_run_queue_ends_the_runs_it_leaves_when_it_fails():
    """An error while taking one run's result (a CSV of other columns: SystemExit) ends the runs still going, which
    would otherwise share their GPUs with the next call's."""
    from dev import runs

    class Job:
        def __init__(self, task):
            self.task, self.stopped = task, False

        def done(self):
            return self.task == "a"

        def stop(self):
            self.stopped = True
    jobs = {}
    launch = lambda task, gpus: jobs.setdefault(task, Job(task))

    def finished(task, job, gpus):
        raise SystemExit("--out has other columns")
    with pytest.raises(SystemExit):
        runs.run_queue(["a", "b"], [0, 1], launch, finished)
    assert jobs["b"].stopped and not jobs["a"].stopped


def test_bench_train_table_ratios():
    from dev import bench_train
    configs = [c for c in bench_train.parallel_configs() if c.label.startswith("d26 m=16")]
    trees = ["/old", "/new"]
    row = lambda tok, step, peaks="", losses="": {"tok/s (median)": tok, "step ms (median)": step, "mfu % (median)": "",
                                                  "peak mem GiB (max)": 50.0, "peak mem per rank": peaks, "losses": losses}
    results = {(c.label, t): None for c in configs for t in trees}
    results[("d26 m=16 one GPU", "/old")] = row(38000, 3438.4, losses="10.0 8.0 6.0")
    results[("d26 m=16 PP=4 1f1b", "/old")] = row(118000, 1107.0, "[dp=0 pp=0]35.0 [dp=0 pp=1]27.8 [dp=0 pp=2]19.9 [dp=0 pp=3]12.7",
                                                  losses="10.0 8.004 6.0")
    results[("d26 m=16 PP=4 1f1b", "/new")] = dict(row(121540, 1100.0), **{"planned GiB": 55.0})
    simulated = {("d26 m=16 PP=4 1f1b", "/old"): 1000.0}  # dev.pipeline_sim's step for it
    lines = bench_train.table(configs, trees, results, simulated).splitlines()
    pp4 = next(line for line in lines if line.startswith("| d26 m=16 PP=4 1f1b |")).split(" | ")
    ideal = 3438.4 / 4 * (16 + 4 - 1) / 16
    assert pp4[2] == "3.105x one GPU" and pp4[4] == f"{1107.0 / ideal:.3f} (ideal {ideal:,.0f} ms)"
    assert pp4[5] == "1.107 (simulated 1,000 ms)"
    assert pp4[6] == "35.0 / 27.8 / 19.9 / 12.7 GiB" and pp4[7] == "5.0e-04" and pp4[-1].rstrip(" |") == "1.030"
    assert "MFU" not in lines[0]  # no run measured one: the column is left out
    assert "| 50.0 GiB (planned 55.0, 1.100x) |" in " | ".join(pp4)  # the new tree's peak against scripts.plan's
    results[("d26 m=16 PP=4 interleaved V=2", "/old")] = row(120000, 1050.0)  # its ideal: half 1F1B's bubble
    interleaved = next(line for line in bench_train.table(configs, trees, results).splitlines()
                       if line.startswith("| d26 m=16 PP=4 interleaved")).split(" | ")
    ideal = 3438.4 / 4 * (16 + 3 / 2) / 16
    assert interleaved[4] == f"{1050.0 / ideal:.3f} (ideal {ideal:,.0f} ms)"
    # DP 2 reads other row groups than one GPU: its losses are not compared; TP 2 x DP 2 against DP 4 neither
    dp = [c for c in bench_train.parallel_configs() if c.label.startswith("d20")]
    results = {(c.label, "/old"): row(1.0, 1.0, losses="10.0 8.0") for c in dp}
    cells = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[-1].rstrip(" |")
             for line in bench_train.table(dp, ["/old"], results).splitlines()[2:]}
    assert [c.dp for c in dp] == [1, 2, 4, 2, 1, 1] and cells["d20 DP=2"] == cells["d20 TP=2 x DP=2"] == "other batches"
    assert cells["d20 32K CP=4"] == "0.0e+00"  # CP ranks read the same sequences as one GPU


def test_pipeline_sim_measures_blocks_and_prices_every_schedule(env, tmp_path):
    """pipeline_sim on the CPU: every block's F, backward and kept bytes of a small model, then the table of
    layouts priced with them (each schedule at p=4 where its chunks fit), then one layout."""
    times = tmp_path / "d4.json"
    run = lambda *args: run_script("dev.pipeline_sim", args, env).stdout  # in this process
    run("--measure", "4", "--batch", "1", "--seq", "32", "--reps", "1", "--out", str(times))
    measured = json.loads(times.read_text())
    assert len(measured["blocks"]) == 4 and all(b["F"] > 0 and b["backward"] > 0 and b["bytes"] > 0 for b in measured["blocks"])
    assert measured["optimizer"]["all"] > max(measured["optimizer"]["embed"], measured["optimizer"]["head"]) > 0
    table = run("--times", str(times), "--table")
    for schedule in ("gpipe", "1f1b"):
        assert f"| 4 | 16 | {schedule} |" in table
    assert "interleaved" not in table  # 8 chunks > 4 blocks
    assert "queued messages" in table
    one = run("--times", str(times), "--schedule", "interleaved", "--stages", "2", "--microbatches", "4")
    assert one.splitlines()[-1].startswith("interleaved, p=2, m=4, V=2: step ")


def test_pipeline_sim_prices_messages_by_what_they_carry_and_blocks_by_their_kind():
    """A message's bytes are what train_step sends: x, x0 (and x_mid past the backout layer) and the ids forward,
    the gradients of the chunk's inputs backward. A block that timed slow once is priced as its kind."""
    from dev.pipeline_sim import chunk_layout, price
    blocks = [{"F": 1.0, "backward": 2.0, "bytes": 100 + i % 2} for i in range(26)]  # two kinds, alternating
    measured = {"depth": 26, "batch": 2, "seq": 64, "n_embd": 1664, "blocks": blocks,
                "embed": {"F": 0.1, "backward": 0.2, "bytes": 5}, "head": {"F": 1.5, "backward": 3.0, "bytes": 7}}
    times, kept, flops, sizes = chunk_layout(measured, 4, 1)  # blocks [0, 7), [7, 14), [14, 21), [21, 26); backout 13
    activation, ids = 2 * 64 * 1664 * 2, 2 * 64 * 8
    assert [sizes["F", c] for c in range(3)] == [2 * activation + ids, 3 * activation + ids, 3 * activation + ids]
    assert [sizes["B", c] for c in range(1, 4)] == [2 * activation, 3 * activation, 3 * activation]
    assert kept[0] == sum(b["bytes"] for b in blocks[:7]) + 5 and kept[3] == sum(b["bytes"] for b in blocks[21:]) + 7
    assert flops[3] > 6 / 7 * flops[2]  # five blocks and the head's FLOPs, as Pipeline.chunk_costs counts them
    step = price(measured, "1f1b", 4, 8, 1, 100.0, 1.0, 0.0)[-1]
    blocks[5] = dict(blocks[5], F=2.0, backward=4.0)  # one slow sample
    assert price(measured, "1f1b", 4, 8, 1, 100.0, 1.0, 0.0)[-1] == step
    # then the slowest rank's optimizer step, once every rank is done: rank 0's, 7 blocks and the embedding
    measured["optimizer"] = {"all": 30.0, "embed": 2.0, "head": 2.0}  # 1 ms a block
    assert price(measured, "1f1b", 4, 8, 1, 100.0, 1.0, 0.0)[-1] == pytest.approx(step + 7 * 1.0 + 2.0)
    # interleaved V=2: rank r holds chunks r and r + 4; the slowest, rank 0, blocks 0-2 with the embedding and
    # blocks 12-15 (chunks [0, 3), [3, 6), [6, 9), [9, 12), [12, 16), [16, 20), [20, 24), [24, 26)): 9 ms
    del measured["optimizer"]
    step = price(measured, "interleaved", 4, 8, 2, 100.0, 1.0, 0.0)[-1]
    measured["optimizer"] = {"all": 30.0, "embed": 2.0, "head": 2.0}
    assert price(measured, "interleaved", 4, 8, 2, 100.0, 1.0, 0.0)[-1] == pytest.approx(step + 3 + 4 + 2.0)


def test_pipeline_sim_stretches_compute_under_load_and_beside_resident_nccl_kernels():
    """--sustained scales every forward and backward (with free messages, the step but the optimizer's), --call-ms
    adds to each; --contention slows only the compute that runs while an NCCL kernel is resident on its rank: a rank waiting idle for a message is not slowed
    (p=2, m=1: each rank's receive spans only its idle time), interleaving's messages posted beside compute are."""
    from dev.pipeline_sim import _covered, price
    blocks = [{"F": 1.0, "backward": 2.0, "bytes": 100} for _ in range(26)]
    measured = {"depth": 26, "batch": 2, "seq": 64, "n_embd": 1664, "blocks": blocks,
                "embed": {"F": 0.1, "backward": 0.2, "bytes": 5}, "head": {"F": 1.5, "backward": 3.0, "bytes": 7}}
    queued = lambda *layout, gbps=100.0, sustained=1.0, contention=0.0, call_ms=0.0: price(
        measured, *layout, gbps, sustained, contention, call_ms)[-1]
    bare = queued("1f1b", 4, 8, 1, gbps=1e12)
    # --call-ms: each forward and backward costs that much more; p=2, m=1 runs four calls one after another
    assert queued("1f1b", 2, 1, 1, gbps=1e12, call_ms=0.5) == pytest.approx(queued("1f1b", 2, 1, 1, gbps=1e12) + 2.0)
    assert queued("1f1b", 4, 8, 1, gbps=1e12, sustained=1.5) == pytest.approx(1.5 * bare)
    measured["optimizer"] = {"all": 30.0, "embed": 2.0, "head": 2.0}  # 1 ms a block: rank 0's 7 and the embedding's 2
    assert queued("1f1b", 4, 8, 1, gbps=1e12, sustained=1.5) == pytest.approx(1.5 * bare + 9.0)  # the step as timed
    del measured["optimizer"]
    assert queued("1f1b", 2, 1, 1, contention=0.5) == queued("1f1b", 2, 1, 1)
    plain, slowed = queued("interleaved", 4, 8, 2), queued("interleaved", 4, 8, 2, contention=0.5)
    assert plain * 1.05 < slowed < plain * 1.5
    assert _covered([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(0.4)  # overlapping intervals counted once


def test_pipeline_sim_contention_by_hand():
    """Two ranks, two forwards each (1 ms on rank 0, 3 ms on rank 1), messages of 0.5 ms; rank 1 posts both receives
    at once. Rank 0's second forward [1, ...) runs beside its first send's kernel, resident [1, 1.5]; rank 1's first
    forward [1.5, ...) beside its second receive's, resident from 1.5 (the stream frees) until that message lands.
    At contention 0.5 compute beside a kernel runs at 2/3 speed, so a run takes its time + overlap / 3."""
    from dev.pipeline_sim import replay_queued
    F = lambda i, c: ("F", i, c)
    actions = [[F(0, 0), F(1, 0)], [F(0, 1), F(1, 1)]]
    programs = [[("run", F(0, 0)), ("send", F(0, 0)), ("run", F(1, 0)), ("send", F(1, 0))],
                [("recv", F(0, 0)), ("recv", F(1, 0)), ("run", F(0, 1)), ("run", F(1, 1))]]
    duration = lambda a: 1.0 if a[2] == 0 else 3.0
    assert replay_queued(actions, programs, duration, lambda a: 0.5) == pytest.approx(7.5)
    second = 1 + 0.5 / 3  # rank 0's F(1, 0): [1, 2 1/6], its message lands at 2 2/3
    first = 3 + (second + 1 + 0.5 - 1.5) / 3  # rank 1's F(0, 1) from 1.5, beside the receive until 2 2/3
    assert replay_queued(actions, programs, duration, lambda a: 0.5, contention=0.5) == pytest.approx(1.5 + first + 3, rel=1e-4)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_queued_replay_is_the_simulation_when_messages_are_free(schedule, virtual):
    """pipeline_sim.replay_queued with free messages gives simulate()'s step; with a message time it can only be
    longer than simulate() charging that time as a fixed delay (the messages then also wait for their turn)."""
    from dev.pipeline_sim import replay_queued
    from nanochat.pipeline_schedules import message_order, simulate, stage_actions
    p, m = 4, 8
    actions = [stage_actions(schedule, p, m, r, virtual) for r in range(p)]
    costs = [1.0 + 0.37 * ((3 * c) % 5) for c in range(p * virtual)]  # uneven chunks
    duration = lambda a: costs[a[2]] * (1 if a[0] == "F" else 2)
    programs = [message_order(actions, r, costs) for r in range(p)]
    step = lambda p2p: max(events[-1][2] for events in simulate(actions, duration, lambda a: p2p))
    assert replay_queued(actions, programs, duration, lambda a: 0.0) == pytest.approx(step(0.0))
    assert replay_queued(actions, programs, duration, lambda a: 0.3) >= step(0.3) - 1e-9
