import os
import sys
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.dataset import (DataError, list_parquet_files, split_files, list_row_groups, iter_documents, resolve_data_dir,
                              check_data)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_shards(d, n_shards=3, docs_per_shard=10, row_group=4):
    os.makedirs(d, exist_ok=True)
    for s in range(n_shards):
        texts = [f"shard {s} doc {i}" for i in range(docs_per_shard)]
        pq.write_table(pa.table({"text": texts}), os.path.join(d, f"shard_{s:05d}.parquet"), row_group_size=row_group)
    return d


def test_listing_sorted_and_last_is_val(tmp_path):
    d = make_shards(str(tmp_path))
    files = list_parquet_files(d)
    assert [os.path.basename(f) for f in files] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    assert split_files(d, "val") == files[-1:]
    assert split_files(d, "train") == files[:-1]


def test_striding_is_disjoint_and_complete(tmp_path):
    d = make_shards(str(tmp_path))
    files = split_files(d, "train")
    assert len(list_row_groups(files)) == 6  # 2 shards x ceil(10/4) row groups
    everything = list(iter_documents(files))
    assert len(everything) == 20
    parts = [list(iter_documents(files, start=r, step=3)) for r in range(3)]
    assert sorted(sum(parts, [])) == sorted(everything)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(parts) for b in parts[i + 1:])


def test_null_and_empty_texts_are_no_documents(tmp_path):  # the tokenizer's scripts read documents, not None
    for s in range(2):
        pq.write_table(pa.table({"text": ["a", None, "", "b"]}), os.path.join(tmp_path, f"s{s}.parquet"))
    dataset._open.cache_clear()
    assert list(iter_documents(split_files(str(tmp_path), "train"))) == ["a", "b"]


def test_corrupt_file_error_names_file(tmp_path):
    d = make_shards(str(tmp_path))
    bad = os.path.join(d, "shard_00001.parquet")
    with open(bad, "wb") as f:
        f.write(b"this is not parquet at all")
    dataset._open.cache_clear()
    with pytest.raises(DataError, match="shard_00001.parquet"):
        list(iter_documents(split_files(d, "train")))


def test_missing_text_column(tmp_path):
    d = str(tmp_path)
    for i in range(2):
        pq.write_table(pa.table({"content": ["x"]}), os.path.join(d, f"s{i}.parquet"))
    dataset._open.cache_clear()
    with pytest.raises(DataError, match="no `text` column"):
        list_row_groups(split_files(d, "train"))


def test_bundled_sample_fallback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    monkeypatch.setattr(dataset, "_notice_shown", False)
    d = resolve_data_dir()
    assert d == dataset.SAMPLE_DIR
    assert "bundled sample" in capsys.readouterr().out
    assert resolve_data_dir() == d and capsys.readouterr().out == ""  # the notice once per run
    assert len(list_parquet_files(d)) == 2
    docs = list(iter_documents(split_files(d, "val")))
    assert len(docs) == 96 and all(isinstance(t, str) and len(t) > 100 for t in docs)
    with pytest.raises(DataError, match="--data-dir"):
        resolve_data_dir(allow_sample=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no parquet shards"):  # a folder named explicitly must hold shards
        resolve_data_dir(str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"the data folder .*nowhere does not exist \(--data-dir\)"):
        resolve_data_dir(str(tmp_path / "nowhere"))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "elsewhere"))  # the flag wins, and its name is the one told
    with pytest.raises(DataError, match=r"the data folder .*nowhere does not exist \(--data-dir\)"):
        resolve_data_dir(str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"the data folder .*elsewhere does not exist \(NANOCHAT_DATA_DIR\)"):
        resolve_data_dir()


def test_shards_of_empty_strings_are_refused(tmp_path):
    """Rows whose text is "" would train on <|bos|> alone (and give val bpb inf): refused, naming the file."""
    for i in range(2):
        pq.write_table(pa.table({"text": [""] * 8}), os.path.join(tmp_path, f"s{i}.parquet"))
    dataset._open.cache_clear()
    with pytest.raises(DataError, match=r"s0.parquet: the `text` of every row of row group 0 is empty"):
        check_data(str(tmp_path))


def test_fewer_row_groups_than_ranks_are_refused_for_training(tmp_path, capsys):
    """DP rank r reads row groups r, r + dp, ...: with fewer than dp, ranks would train on the same rows."""
    d = make_shards(str(tmp_path), n_shards=3, docs_per_shard=4, row_group=4)  # 2 training row groups, 1 validation
    dataset._open.cache_clear()
    check_data(d, dp_size=2)
    assert "WARNING: the val shards" in capsys.readouterr().out  # validation only measures fewer tokens
    with pytest.raises(DataError, match=r"the train shards in .* hold 2 row group\(s\), fewer than the 3 data-parallel"):
        check_data(d, dp_size=3)


def test_offline_download_fails_fast_with_directions(tmp_path):
    # an endpoint on a closed local port stands for "no network"
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", NANOCHAT_BASE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "nanochat.dataset", "-n", "2", "--data-dir", str(tmp_path / "data")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "cannot reach the Hugging Face hub" in p.stderr + p.stdout
    assert "NANOCHAT_DATA_DIR" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr
