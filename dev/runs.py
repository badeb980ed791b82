"""
The run library of the dev tools (not a tool): launch scripts.base_train in a checkout, read the run back
from its metrics.jsonl (nanochat.run_log.Run), and the statistics the tools take from a run. bench_train,
quality_ab and vs_upstream launch every run through start().

    job = runs.start(flags, "tag", tree="../other", env={"NANOCHAT_KERNELS": "reference"}, log="tag.log")
    run = job.run()                   # waits; the Run, or RunFailed with what went wrong and the log's last lines
    runs.summary(run, warmup=5)       # medians over the steps from 5 on, the peak memory, the final val bpb

A run in another tree imports that tree's nanochat: the process runs with cwd = tree. Its record is
$NANOCHAT_BASE_DIR/base_checkpoints/<model-tag>/metrics.jsonl, with NANOCHAT_BASE_DIR from the run's
environment; start() always passes --model-tag, and removes a previous run's record of that tag first.

Two things are read from a run's printout, each by one function here:
- old_tree_records: a tree from before the run record (no nanochat/run_log.py) prints its steps instead of
  recording them; its log is read into the same records, so that a comparison can take an old commit as its
  baseline. Only such trees go through it. (Upstream nanochat, another project, is read by dev/vs_upstream.py.)
"""

import os
import zlib
import re
import shutil
import sys
import json
import time
import shlex
import argparse
import statistics
import subprocess

from nanochat.run_log import Run, metrics_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--core-metric-every=-1", "--sample-every=-1"]  # no CORE, no samples: the tools time and score training


class RunFailed(Exception):
    """A run that did not give what was asked: a non-zero exit, a timeout, no step recorded, fp8 not active."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default (unless its help says it, or there is none)."""

    def _get_help_string(self, action):
        if "default:" in (action.help or "") or action.default is False or action.default in (None, "", []):
            return action.help
        return super()._get_help_string(action)


def argument_parser(doc):
    """A tool's command line: its docstring as the help, defaults shown."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_data_args(parser):
    """Where base_train finds its data and tokenizer."""
    parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR)")
    parser.add_argument("--base-dir", type=str, default=None, help="tokenizer and outputs (default: NANOCHAT_BASE_DIR)")


def data_env(args):
    """The environment settings of add_data_args' flags."""
    return {var: os.path.abspath(path) for path, var in ((args.data_dir, "NANOCHAT_DATA_DIR"),
                                                          (args.base_dir, "NANOCHAT_BASE_DIR")) if path}


def add_side_args(parser):
    """The two sides of a comparison: each a checkout, environment settings and extra base_train flags."""
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-tree", type=str, default=".", help=f"side {side.upper()}: checkout to run in")
        parser.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE",
                            help=f"side {side.upper()}: an environment setting (repeatable)")
        parser.add_argument(f"--{side}-args", type=str, default="", help=f"side {side.upper()}: extra base_train flags, one string")


def side_spec(args, side):
    """A side of add_side_args: {tree, env, extra (flags), name (for tables)}."""
    tree = check_tree(getattr(args, f"{side}_tree"), f"--{side}-tree")
    env = {}
    for item in getattr(args, f"{side}_env"):
        key, eq, value = item.partition("=")
        if not eq or not key:
            sys.exit(f"--{side}-env {item!r}: expected KEY=VALUE")
        env[key] = value
    extra = shlex.split(getattr(args, f"{side}_args"))
    name = " ".join([os.path.basename(tree)] + [f"{k}={v}" for k, v in env.items()] + extra)
    return dict(tree=tree, env=env, extra=extra, name=name)


def check_tree(path, flag):
    """The absolute root of a nanochat checkout, or exit naming the flag."""
    tree = os.path.abspath(path)
    if not os.path.exists(os.path.join(tree, "scripts", "base_train.py")):
        sys.exit(f"{flag} {tree}: no scripts/base_train.py there (give the root of a nanochat checkout)")
    return tree


def flag_value(flags, name, default=None):
    """The value of `--name=value` or `--name value` in a flag list (the last one given), else default."""
    values = [f.split("=", 1)[1] if f != name else (flags[i + 1] if i + 1 < len(flags) else None)
              for i, f in enumerate(flags) if f.startswith(name + "=") or f == name]
    return values[-1] if values else default


FIRST_TIMED_STEP = 11  # base_train leaves its first UNTIMED_STEPS + 1 steps (compilation) out of its time


def scored_tokens(flags, eval_tokens=None):
    """The validation tokens base_train scores with these flags: whole micro-batches (device batch x --max-seq-len)
    of --eval-tokens (or `eval_tokens`), at least one."""
    from nanochat.recipe import DEFAULT_SEQ_LEN
    micro = int(flag_value(flags, "--device-batch-size", 32)) * int(flag_value(flags, "--max-seq-len", DEFAULT_SEQ_LEN))
    asked = int(eval_tokens if eval_tokens is not None else flag_value(flags, "--eval-tokens"))
    return max(1, asked // micro) * micro


def counted(kept, diverged):
    """A table's runs cell: the runs counted, and the diverged ones (a NaN or infinite bpb: shown, never averaged)."""
    return f"{kept}" + (f" (+{diverged} diverged)" if diverged else "")


def call_tag(folder, name):
    """A model tag for a run of a tool's call whose results go to `folder`: two calls on one base dir keep apart
    (start() empties the tag's folder)."""
    return f"{name}_{zlib.crc32(os.path.abspath(folder).encode()):08x}"


def tree_version(tree, outputs=None):
    """A checkout's commit and a hash of its uncommitted changes ("" outside git, or where git tracks nothing): which
    code a result came from.
    outputs: a folder of the tool's own results, left out where it lies inside the checkout (they are not code)."""
    git = lambda *a: subprocess.run(["git", "-C", tree, *a], capture_output=True).stdout
    if not git("ls-files", "--", "."):  # nothing tracked here (e.g. another project's copy inside this checkout,
        return ""  # ignored): the enclosing checkout's commit is not its version
    inside = os.path.relpath(os.path.abspath(outputs), os.path.abspath(tree)) if outputs else os.pardir
    paths = ["--", ".", f":(exclude){inside}"] if not inside.startswith(os.pardir) else []
    untracked = git("ls-files", "--others", "--exclude-standard", "-z", *paths).split(b"\0")
    files = [n for n in untracked if n and os.path.isfile(os.path.join(tree, n.decode()))]  # not a linked folder
    changes = git("diff", "HEAD", *paths) + b"".join(n + open(os.path.join(tree, n.decode()), "rb").read()
                                                     for n in files)
    return git("rev-parse", "HEAD").decode().strip() + (f"+{zlib.crc32(changes):08x}" if changes else "")


def checkpoint_folder(env, model_tag):
    """base_train's folder of a run in this environment (its NANOCHAT_BASE_DIR, else the default base dir)."""
    from nanochat.checkpoint_manager import checkpoint_dir
    return checkpoint_dir(model_tag, env.get("NANOCHAT_BASE_DIR"))


def metrics_file(env, model_tag):
    return metrics_path(checkpoint_folder(env, model_tag))


# -----------------------------------------------------------------------------
# Launching


class Job:
    """A base_train process that start() launched: done() polls it, wait() ends it, run() reads it."""

    def __init__(self, cmd, tree, env, flags, model_tag, log_path, timeout, metrics):
        self.cmd, self.tree, self.flags, self.model_tag = cmd, tree, flags, model_tag
        self.log_path, self.timeout = log_path, timeout
        self.metrics = metrics  # None: a tree from before the run record
        self.t0, self.wall_s, self.text, self.timed_out = time.time(), None, None, False
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def done(self):
        """Whether the process has ended; one past its timeout is ended here."""
        if self.proc.poll() is None and self.timeout and time.time() - self.t0 > self.timeout:
            self.wait()
        return self.proc.poll() is not None

    def wait(self):
        """Wait for the end (killing the process at its timeout); returns the log's text."""
        if self.text is not None:
            return self.text
        try:
            self.proc.wait(timeout=max(1.0, self.timeout - (time.time() - self.t0)) if self.timeout else None)
        except subprocess.TimeoutExpired:
            self.stop()
            self.timed_out = True
        self.wall_s = time.time() - self.t0
        self.log.close()
        with open(self.log_path, errors="replace") as f:
            self.text = f.read()
        return self.text

    def stop(self):
        """End the process: SIGTERM, which torchrun passes on to its workers, each in a session of its own (a SIGKILL
        to torchrun would leave them running on the GPUs the queue hands on); one that does not end in a minute dies."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def failure(self):
        """Why the process failed (None if it exited 0): the exit status or timeout and the log's last lines."""
        self.wait()
        if self.timed_out:
            return f"timed out after {self.timeout} s (log {self.log_path})"
        if self.proc.returncode != 0:
            return f"exit {self.proc.returncode}: " + " / ".join(self.text.strip().splitlines()[-3:])
        return None

    def run(self):
        """The run as its record tells it, once the process has ended. RunFailed: a failure above, no step
        recorded, or --fp8 asked for but not trained in (base_train falls back to bf16 where fp8 cannot run)."""
        failure = self.failure()
        if failure:
            raise RunFailed(failure)
        path = self.metrics
        if path is None:
            path = self.log_path + ".metrics.jsonl"
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in old_tree_records(self.text, self.flags))
        try:
            run = Run(path)
        except FileNotFoundError as e:
            raise RunFailed(str(e)) from None
        if not run.series("dt"):
            raise RunFailed(f"no training step recorded in {path}")
        if "--fp8" in self.flags and not run.header.get("fp8"):
            raise RunFailed(f"--fp8 fell back to bf16 (see {self.log_path})")
        return run


def process_env(env=None, gpus=None):
    """A launched process's environment: this one's plus `env`, on the GPUs `gpus` (None: as this process has it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def start(flags, model_tag, tree=REPO, env=None, nproc=1, gpus=None, log=None, timeout=None):
    """Launch `python -m scripts.base_train FLAGS --model-tag=TAG` in `tree`: under torchrun with nproc > 1,
    on the GPUs `gpus` (a list of indices for CUDA_VISIBLE_DEVICES; None: as this process has it), with this
    process's environment plus `env`, its output in the file `log` (default: TAG.log here). A fresh run (no
    --resume-from-step in FLAGS) starts in an empty folder: the tag is the tool's, and what an earlier run left under
    it (its record, checkpoints) is removed first, so that it is neither read as this run's nor refused by base_train.
    Returns the Job."""
    tree = check_tree(tree, "tree")
    env = process_env(env, gpus)
    module = ["-m", "scripts.base_train"] + list(flags) + [f"--model-tag={model_tag}"]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    if not any(f.startswith("--resume-from-step") for f in flags):
        shutil.rmtree(checkpoint_folder(env, model_tag), ignore_errors=True)
    metrics = metrics_file(env, model_tag) if os.path.exists(os.path.join(tree, "nanochat", "run_log.py")) else None
    log = os.path.abspath(log or f"{model_tag}.log")
    return Job([sys.executable] + launcher + module, tree, env, list(flags), model_tag, log, timeout, metrics)


def run_queue(queue, gpus, launch, finished, deadline=None, width=lambda task: 1):
    """Run the tasks of `queue` (a list; finished may add to it) over GPU slots (a GPU named twice in `gpus` is two):
    a task takes width(task) free slots, the first task in the queue that fits starting first; launch(task, its GPUs)
    starts its Job, finished(task, job, its GPUs) takes it when it ends, and may return a task to start at once on
    the same GPUs (the same GPUs for runs to compare: GPUs differ by 2-3%). No task starts after time.time()
    `deadline`; returns the tasks left in the queue (also those wider than `gpus`). An error on the way ends the
    runs it leaves (a run left behind would share its GPUs with the next call's)."""
    running, free = [], list(range(len(gpus)))  # [(task, job, slots)], the slots no task holds
    try:
        while running or (queue and (deadline is None or time.time() < deadline)):
            for task in list(queue):
                if width(task) <= len(free) and (deadline is None or time.time() < deadline):
                    slots, free = free[:width(task)], free[width(task):]
                    queue.remove(task)
                    running.append((task, launch(task, [gpus[s] for s in slots]), slots))
            if not running:
                break  # what is left fits no more
            time.sleep(1)
            for item in [r for r in running if r[1].done()]:
                running.remove(item)
                mine = [gpus[s] for s in item[2]]
                follow = finished(item[0], item[1], mine)
                if follow is not None and (deadline is None or time.time() < deadline):
                    running.append((follow, launch(follow, mine), item[2]))
                else:
                    free = sorted(free + item[2])
        return queue
    except BaseException:
        for _, job, _ in running:
            job.stop()
        raise


# -----------------------------------------------------------------------------
# Statistics


def median(run, key, from_step=0):
    """Median of `key` over the steps from `from_step` on (after warm-up: the first steps compile); None when
    no such step has it."""
    values = list(run.series(key, from_step).values())
    return statistics.median(values) if values else None


def summary(run, warmup=0):
    """What the tools report of a run: steps run and timed, medians from step `warmup` on of the step time
    (ms), tok/s and MFU (%), the peak memory (GiB, rank 0: the largest of its per-step peaks), the last epoch
    and the final val bpb (None where not measured)."""
    dt = run.series("dt")
    peaks = list(run.series("peak_mem_gib").values())
    step_s = median(run, "dt", warmup)
    return dict(steps=max(dt) + 1, steps_timed=len(run.series("dt", warmup)),
                step_ms=step_s * 1000 if step_s is not None else None,
                tok_per_sec=median(run, "tok_per_sec", warmup), mfu=median(run, "mfu", warmup),
                peak_mem_gib=max(peaks) if peaks else None, epoch=run.last("epoch"), val_bpb=run.last("val_bpb"))


def rank_peaks(run):
    """{rank tag: peak GiB} of a run of several processes, from its end record; {} for one process (or a run
    that recorded no end, or none on a CPU)."""
    peaks = (run.end or {}).get("peak_mem_gib", {})
    return {tag: gib for tag, gib in peaks.items() if gib is not None} if len(peaks) > 1 else {}


# -----------------------------------------------------------------------------
# Trees from before the run record: their printout, read into the same records (for them only)

OLD_STEP = re.compile(r"^step (\d+)/\d+ .*\| loss: ([\d.]+) \| lrm: ([\d.]+) \| dt: ([\d.]+)ms \| tok/sec: ([\d,]+)"
                      r"(?: \| mfu: ([\d.]+))?(?: \| epoch: (\d+))?", re.M)


def old_tree_records(text, flags):
    """The records metrics.jsonl would hold, from the log of a tree that prints its steps instead: a header
    (attention, fp8 on unless it fell back, Muon's weight decay) and per step loss_smooth (the printed loss),
    lrm, dt, tok_per_sec, mfu, epoch; val_bpb and the peak memory after the last step; every rank's peak."""
    attention = re.findall(r"^attention: (.*)$", text, re.M)
    decay = re.findall(r"Muon weight decay = ([\d.]+) x .* = ([\d.]+)", text)
    header = {"kind": "header", "attention": attention[0] if attention else "",
              "fp8": "--fp8" in flags and "continuing without fp8" not in text}
    if decay:
        header.update(weight_decay=float(decay[0][1]), flags={"weight_decay": float(decay[0][0])})
    records = [header]
    for step, loss, lrm, dt, tok, mfu, epoch in OLD_STEP.findall(text):
        record = dict(step=int(step), loss_smooth=float(loss), lrm=float(lrm), dt=float(dt) / 1000,
                      tok_per_sec=float(tok.replace(",", "")))
        record.update({k: v for k, v in (("mfu", float(mfu) if mfu else None), ("epoch", int(epoch) if epoch else None))
                       if v is not None})
        records.append(record)
    bpb = re.findall(r"^Validation bpb: ([\d.]+)", text, re.M)
    peak = re.search(r"(?<!\] )peak memory: ([\d.]+) GiB", text)  # the summary line (one process)
    last = {}
    if bpb:
        last["val_bpb"] = float(bpb[-1])
    if peak:
        last["peak_mem_gib"] = float(peak.group(1))
    if last and len(records) > 1:
        records.append(dict(step=records[-1]["step"], **last))
    # several processes: each printed its own peak at the end (`[dp=0 pp=1] peak memory: 24.70 GiB; ...`)
    peaks = {tag: float(gib) for tag, gib in re.findall(r"^(\[[^\]]*\]) peak memory: ([\d.]+) GiB", text, re.M)}
    if peaks:
        records.append({"kind": "end", "step": records[-1].get("step", 0), "peak_mem_gib": peaks})
    return records
