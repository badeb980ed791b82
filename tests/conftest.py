"""Shared fixtures: a tiny tokenizer trained on the bundled sample, in a temporary base dir that the
scripts under test also use (NANOCHAT_BASE_DIR)."""

import os
import sys
import subprocess

import pytest

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


def run_script(module, args, env, nproc=1, timeout=600, check=True):
    """Run `python -m module args` (or torchrun with nproc processes); returns CompletedProcess."""
    if nproc == 1:
        cmd = [sys.executable, "-m", module] + list(args)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module] + list(args)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\nSTDOUT:\n{p.stdout[-6000:]}\nSTDERR:\n{p.stderr[-6000:]}")
    return p


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
