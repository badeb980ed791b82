"""
Pretraining text as parquet shards (a `text` column, one document per row), sorted by name; the LAST one is
validation. The folder: --data-dir, else NANOCHAT_DATA_DIR, else $NANOCHAT_BASE_DIR/base_data or, when that is
empty, the bundled sample (a fresh checkout trains offline). `python -m nanochat.dataset -n 8` downloads shards.
"""

import os
import time
import argparse
import itertools
from functools import lru_cache

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.common import UserError, get_base_dir

# Default remote dataset: pre-shuffled FineWeb-Edu shards (~0.1 GB, ~250M chars each) on the HF hub.
REMOTE_REPO = "karpathy/fineweb-edu-100b-shuffle"
REMOTE_NUM_SHARDS = 1823
SAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_data")


class DataError(UserError):
    """Missing, unreadable or malformed data; the message says which file and what to do."""


def default_data_dir():
    return os.environ.get("NANOCHAT_DATA_DIR") or os.path.join(get_base_dir(), "base_data")


def list_parquet_files(data_dir):
    names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
    return sorted(os.path.join(data_dir, f) for f in names if f.endswith(".parquet"))


_notice_shown = False


def resolve_data_dir(data_dir=None, allow_sample=True, quiet=False):
    """A named folder (argument or NANOCHAT_DATA_DIR) must hold shards; an empty default falls back to the sample."""
    source = "--data-dir" if data_dir else "NANOCHAT_DATA_DIR"  # the flag wins over the variable
    explicit = data_dir or os.environ.get("NANOCHAT_DATA_DIR")
    data_dir = explicit or default_data_dir()
    if list_parquet_files(data_dir):
        return data_dir
    if explicit and not os.path.isdir(data_dir):
        raise DataError(f"the data folder {data_dir} does not exist ({source}): fix the path, or download shards "
                        f"with `python -m nanochat.dataset -n 8`")
    if explicit or not allow_sample:
        raise DataError(f"no parquet shards in {data_dir}. Download some with `python -m nanochat.dataset -n 8`, "
                        f"or point --data-dir / NANOCHAT_DATA_DIR at a folder of parquet files with a `text` column")
    global _notice_shown
    if not quiet and not _notice_shown and int(os.environ.get("RANK", 0)) == 0:  # once per run, not per process
        print(f"NOTICE: no parquet shards in {data_dir}; using the small bundled sample in {SAMPLE_DIR} "
              f"(Wikipedia, CC BY-SA). For real runs: `python -m nanochat.dataset -n 8` or --data-dir.", flush=True)
        _notice_shown = True
    return SAMPLE_DIR


@lru_cache(maxsize=64)  # a run may list thousands of shards: each open one holds a file descriptor until evicted
def _open(path):
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path} is not a readable parquet file ({type(e).__name__}: {e}). "
                        f"Delete or re-download it; the data folder must hold only parquet shards.") from None
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path} has no `text` column (columns: {pf.schema_arrow.names})")
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: its `text` column holds {kind}, not strings; write one document per row as a "
                        f"string column")
    return pf


def split_files(data_dir, split):
    assert split in ("train", "val"), split
    files = list_parquet_files(data_dir)
    if len(files) < 2:
        raise DataError(f"{data_dir} holds {len(files)} parquet shard(s); need at least 2 (the last is validation)")
    return files[:-1] if split == "train" else files[-1:]


def list_row_groups(files):  # the global list of (file, row_group) pairs; opening each file validates it
    return [(f, i) for f in files for i in range(_open(f).num_row_groups)]


def row_group_rows(path, index):  # from the footer: nothing is read
    return _open(path).metadata.row_group(index).num_rows


def check_data(data_dir=None, dp_size=1):
    """The resolved data folder, after opening every shard and reading each split's first row group: a bad file
    fails the run at the start, not hours later at the first evaluation. DP rank r reads row groups r, r + dp_size, ...
    (dataloader.py), so with fewer row groups than ranks some ranks would read the same rows: refused for training."""
    data_dir = resolve_data_dir(data_dir)
    for split in ("train", "val"):
        row_groups = list_row_groups(split_files(data_dir, split))
        if not row_groups:
            raise DataError(f"the {split} shards in {data_dir} hold no rows")
        if len(row_groups) < dp_size:
            same = (f"the {split} shards in {data_dir} hold {len(row_groups)} row group(s), fewer than the {dp_size} "
                    f"data-parallel ranks, so some ranks read the same rows")
            if split == "train":
                raise DataError(f"{same}: write more shards, or shards in smaller row groups (pyarrow's "
                                f"row_group_size), or train on fewer ranks")
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"WARNING: {same}: the validation loss covers fewer distinct tokens than --eval-tokens", flush=True)
        path, index = row_groups[0]
        if not any(read_row_group(path, index)):
            raise DataError(f"{path}: the `text` of every row of row group {index} is empty; a model cannot learn from "
                            f"it. Check how the shard was written (one document per row in the `text` column)")
    return data_dir


def shard_listing(data_dir):
    """[name, bytes, [[rows, row groups of that many rows], ...]] per shard (run-length coded: mostly one size): what
    a run's data position means. A checkpoint records it; ranks reading their own copies (one per node) must agree."""
    listing = []
    for f in list_parquet_files(data_dir):
        runs = itertools.groupby(row_group_rows(f, i) for i in range(_open(f).num_row_groups))
        listing.append([os.path.basename(f), os.path.getsize(f), [[rows, len(list(n))] for rows, n in runs]])
    return listing


def listing_changes(saved, now):
    """What differs between two shard listings, in words (empty when they are the same)."""
    saved, now = {s[0]: s[1:] for s in saved}, {s[0]: s[1:] for s in now}
    changes = [f"{name} removed" for name in saved if name not in now]
    changes += [f"{name} added" for name in now if name not in saved]
    for name in (n for n in saved if n in now and saved[n] != now[n]):
        (size_a, runs_a), (size_b, runs_b) = saved[name], now[name]
        rows_a, rows_b = ([rows for rows, count in runs for _ in range(count)] for runs in (runs_a, runs_b))
        if len(rows_a) != len(rows_b):
            what = f"{len(rows_a)} -> {len(rows_b)} row groups"
        elif rows_a != rows_b:
            i = next(i for i, (a, b) in enumerate(zip(rows_a, rows_b)) if a != b)
            what = f"row group {i}: {rows_a[i]} -> {rows_b[i]} rows"
        else:
            what = f"{size_a:,} -> {size_b:,} bytes"
        changes.append(f"{name} changed ({what})")
    return changes


def read_row_group(path, index):
    pf = _open(path)  # outside the try: its own errors say more
    try:
        return pf.read_row_group(index, columns=["text"]).column("text").to_pylist()
    except Exception as e:
        raise DataError(f"cannot read row group {index} of {path} ({type(e).__name__}: {e}); the file may be corrupt") from None


def iter_documents(files, start=0, step=1):  # documents of row groups start, start+step, ... (one pass)
    row_groups = list_row_groups(files)
    for i in range(start, len(row_groups), step):
        yield from filter(None, read_row_group(*row_groups[i]))  # a null or empty text is no document


def download_shards(num_shards, data_dir=None, repo_id=REMOTE_REPO, workers=8, retries=5):
    """The first num_shards-1 shards and the last (validation) from the hub; finished files skipped (an interrupted
    one starts over: huggingface_hub keeps no partial file)."""
    try:
        from huggingface_hub import hf_hub_download, get_hf_file_metadata, hf_hub_url
    except ImportError:
        raise DataError("downloading needs huggingface_hub: pip install huggingface-hub") from None
    from concurrent.futures import ThreadPoolExecutor
    data_dir = data_dir or default_data_dir()
    os.makedirs(data_dir, exist_ok=True)
    num_shards = max(2, min(num_shards, REMOTE_NUM_SHARDS))
    names = [f"shard_{i:05d}.parquet" for i in [*range(num_shards - 1), REMOTE_NUM_SHARDS - 1]]
    todo = [n for n in names if not os.path.exists(os.path.join(data_dir, n))]
    print(f"{len(names) - len(todo)}/{len(names)} shards already in {data_dir}; downloading {len(todo)} from {repo_id}", flush=True)
    if not todo:
        return data_dir
    try:  # fail in seconds, with directions, when the hub cannot be reached (offline machines)
        get_hf_file_metadata(hf_hub_url(repo_id, todo[0], repo_type="dataset"), timeout=10)
    except Exception as e:
        raise DataError(f"cannot reach the Hugging Face hub to download {repo_id} ({type(e).__name__}: {e}).\n"
                        f"Offline? Copy parquet shards (a `text` column; the last file is validation) into "
                        f"{data_dir}, or pass --data-dir DIR / set NANOCHAT_DATA_DIR=DIR.") from None

    def fetch(name):
        for attempt in range(1, retries + 1):
            try:
                return hf_hub_download(repo_id, name, repo_type="dataset", local_dir=data_dir)
            except Exception as e:  # network hiccups: back off and retry
                if attempt == retries:
                    raise DataError(f"failed to download {name} after {retries} attempts: {e}") from None
                print(f"{name}: attempt {attempt} failed ({type(e).__name__}); retrying in {2 ** attempt}s", flush=True)
                time.sleep(2 ** attempt)
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, path in enumerate(pool.map(fetch, todo), 1):
            print(f"[{i}/{len(todo)}] {os.path.basename(path)} ({time.time() - t0:.0f}s)", flush=True)
    return data_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Download pretraining shards from the Hugging Face hub")
    parser.add_argument("-n", "--num-shards", type=int, default=8, help="shards to fetch (the last one is validation)")
    parser.add_argument("--data-dir", type=str, default=None, help="destination (default: NANOCHAT_DATA_DIR or $NANOCHAT_BASE_DIR/base_data)")
    parser.add_argument("--repo", type=str, default=REMOTE_REPO, help="Hugging Face dataset repo")
    parser.add_argument("-w", "--workers", type=int, default=8, help="parallel downloads")
    args = parser.parse_args()
    try:
        download_shards(args.num_shards, args.data_dir, args.repo, args.workers)
    except DataError as e:
        raise SystemExit(f"ERROR: {e}")
