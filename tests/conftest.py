"""Shared fixtures: a tiny tokenizer trained on the bundled sample, in a temporary base dir that the
scripts under test also use (NANOCHAT_BASE_DIR)."""

import io
import os
import gc
import sys
import runpy
import inspect
import importlib
import importlib.util
import signal
import tempfile
import traceback
import subprocess
import contextlib
from unittest import mock

import pytest
import torch

torch.set_num_threads(1)  # as the scripts run under script_env (OMP_NUM_THREADS=1): two test workers share two cores

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE_DATA = os.path.join(REPO, "nanochat", "sample_data")  # the shards bundled with the package
CORE_BUNDLE = os.path.join(REPO, "tests", "fixtures", "core_bundle")  # a small CORE bundle written for the tests
CORE_TASKS = ["capitals", "pronouns", "counting"]  # one task of each type; the bundle also lists `absent`, with no file
TINY_VOCAB = 1024


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A base dir holding a tokenizer (vocab 1024) trained on the bundled sample."""
    d = tmp_path_factory.mktemp("nanochat_base")
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(d))
    env.pop("NANOCHAT_DATA_DIR", None)
    subprocess.run([sys.executable, "-m", "scripts.tok_train", "--vocab-size", str(TINY_VOCAB), "--max-chars", "3000000"],
                   cwd=REPO, env=env, check=True, capture_output=True)
    return str(d)


def script_env(base_dir):
    """Environment for the scripts under test: the test base dir, fp32, one thread, and no GPU: they run on the CPU,
    as on CI, on a machine with GPUs too (the same checks in no more time, as a GPU would compile every tiny model,
    and no torchrun rank left without a GPU of its own)."""
    e = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, NANOCHAT_DTYPE="float32", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    e.pop("NANOCHAT_DATA_DIR", None)
    return e


@pytest.fixture
def env(base_dir, monkeypatch):
    """script_env for subprocesses; this process points at the test base dir too."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    return script_env(base_dir)


@pytest.fixture
def tokenizer(base_dir):
    from nanochat.tokenizer import get_tokenizer
    return get_tokenizer(os.path.join(base_dir, "tokenizer"))


def run_script(module, args, env, nproc=1, timeout=600, check=True, process=False, input=None):
    """Run `python -m module args` as torchrun would with nproc processes: by default in this process (one rank) or
    on the test session's pool of ranks (parallel_harness.spawn), where no interpreter starts and nothing is imported
    again; with process=True in a new process, or under the real torchrun. Returns a CompletedProcess (under the
    pool: the ranks' output one after the other, the largest exit status)."""
    if not process:
        cmd = [module] + list(args)
        p = run_in_process(module, args, env, input) if nproc == 1 else run_on_pool(module, args, env, nproc)
    else:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        cmd = [sys.executable] + launcher + ["-m", module] + list(args)
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\nSTDOUT:\n{p.stdout[-6000:]}\nSTDERR:\n{p.stderr[-6000:]}")
    return p


class Started:
    """A script started in a new process, its stdout read line by line up to a line with `until`; its stderr goes to
    a temporary file (a pipe nobody reads would stall the script once some warnings filled it)."""

    def __init__(self, cmd, env, until, **popen):
        self.err_file = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.err_file, text=True,
                                     **popen)
        self.pid, self.out = self.proc.pid, ""
        while until not in self.out:
            line = self.proc.stdout.readline()
            assert line, self.stderr()[-3000:]
            self.out += line

    def stderr(self):
        self.err_file.seek(0)
        return self.err_file.read()

    def finish(self, timeout):
        """(all of stdout, stderr) once it has exited; its exit status in .returncode."""
        rest, _ = self.proc.communicate(timeout=timeout)
        self.out, self.returncode = self.out + rest, self.proc.returncode
        return self.out, self.stderr()


def _pool_rank(rank, module, args, envs, port, nproc, per_node, out_dir):
    """One rank of run_on_pool: the environment torchrun gives its workers, then the module as a script."""
    env = dict(envs[rank], RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RUN_ID=f"pool{port}")
    hook = sys.excepthook
    try:
        p = run_in_process(module, args, env)
    finally:
        sys.excepthook = hook  # nanochat.watchdog chains its own
    torch.save({"code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}, os.path.join(out_dir, f"rank{rank}.pt"))


def run_on_pool(module, args, env, nproc, per_node=None):
    """The ranks as torchrun would start them, on the pool; env: one environment, or one per rank (the nodes of a
    multi-node run, per_node ranks each)."""
    import tempfile
    from parallel_harness import spawn, _free_port
    envs = env if isinstance(env, list) else [env] * nproc
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_pool_rank, (module, list(args), envs, _free_port(), nproc, per_node or nproc, out_dir), nproc)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(nproc)]
    return subprocess.CompletedProcess([module] + list(args), max(r["code"] for r in ranks),
                                       "".join(r["stdout"] for r in ranks), "".join(r["stderr"] for r in ranks))


def run_in_process(module, args, env, input=None):
    """`python -m module args` with environment `env`, run here as its own process would run it: sys.argv, the
    environment, stdout and stderr, the exit status (a traceback to stderr where it raises), no GPU where env hides
    them; and what a script changes in the process (signal handlers, the stop request, the garbage collector, the
    kernels' switch, the random generator) restored after."""
    from nanochat import signals, kernels
    saved_env, saved_argv, saved_cwd, saved_stdin = dict(os.environ), sys.argv, os.getcwd(), sys.stdin
    saved_kernels, saved_rng = kernels.KERNELS.mode, torch.get_rng_state()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out, err, code = io.StringIO(), io.StringIO(), 0
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module] + list(args)
    sys.stdin = io.StringIO(input or "")
    os.chdir(REPO)
    no_gpu = mock.patch("torch.cuda.is_available", return_value=False) if env.get("CUDA_VISIBLE_DEVICES") == "" \
        else contextlib.nullcontext()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_gpu:
            with open(importlib.util.find_spec(module).origin) as f:
                has_main = "\ndef main(" in f.read()
            if not has_main:  # a script written at module level (importing it would run it)
                runpy.run_module(module, run_name="__main__")
            else:  # its main(), as `if __name__ == "__main__"` calls it (without running the module again)
                main = importlib.import_module(module).main
                main(list(args)) if inspect.signature(main).parameters else main()
    except SystemExit as e:
        if isinstance(e.code, str):
            err.write(e.code + "\n")
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        err.write(traceback.format_exc())
        code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.stdin = saved_argv, saved_stdin
        os.chdir(saved_cwd)
        for s, h in handlers.items():
            signal.signal(s, h)
        signals._stop_signal, signals._stop_file, signals._announced = None, None, False
        kernels.KERNELS.mode = saved_kernels
        torch.set_rng_state(saved_rng)
        gc.unfreeze()
        gc.enable()
    return subprocess.CompletedProcess([module] + list(args), code, out.getvalue(), err.getvalue())

def write_damaged_shard(path, docs):
    """A shard of the sample's first `docs` documents in row groups of 8, whose last row group's pages are
    damaged (its footer is sound): it passes the start-of-run check and fails when that row group is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = pq.read_table(os.path.join(SAMPLE_DATA, "sample_00000.parquet")).column("text").to_pylist()[:docs]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=8, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    last = meta.row_group(meta.num_row_groups - 1).column(0)
    start = last.dictionary_page_offset or last.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 64, start + last.total_compressed_size - 64):  # the pages, not the footer
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def ckpt_dir(env, tag):
    """The checkpoint folder of base_train's --model-tag tag; env: the run's environment."""
    return os.path.join(env["NANOCHAT_BASE_DIR"], "base_checkpoints", tag)


def errors(p):
    """The ERROR lines of a finished script's stdout."""
    return [line for line in p.stdout.splitlines() if line.startswith("ERROR: ")]


def read_run(env, tag):
    """A base_train run as its metrics.jsonl tells it (nanochat.run_log.Run); env: the run's environment."""
    from nanochat.run_log import Run
    return Run(os.path.join(ckpt_dir(env, tag), "metrics.jsonl"))


def run_losses(env, tag):
    """{step: loss} of a base_train run, from its metrics.jsonl."""
    return read_run(env, tag).losses()


# the smallest model the scripts can build: 2 layers, dim 64, 2 heads of 32, context 64
TINY_MODEL = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
              "--core-metric-every", "-1", "--sample-every", "-1", "--eval-tokens", "2048"]
# ... trained on steps of 512 tokens in micro-batches of 4 sequences, with no evaluation during training
TINY_RUN = TINY_MODEL + ["--device-batch-size", "4", "--total-batch-size", "512", "--eval-every", "-1"]
