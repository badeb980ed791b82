import numpy as np
import pytest
import torch

from nanochat.dataloader import BestFitPacker, DataLoader, reshard_states
from nanochat.dataset import SAMPLE_DIR

B, T = 4, 256


def packer(tokenizer, **kw):
    kw.setdefault("buffer_docs", 64)
    return BestFitPacker(tokenizer, B, T, "train", SAMPLE_DIR, **kw)


def test_rows_start_with_bos_and_are_full(tokenizer):
    p = packer(tokenizer)
    bos = tokenizer.get_bos_token_id()
    for _ in range(5):
        block = p.next_block()
        assert block.shape == (B, T + 1)
        assert (block[:, 0] == bos).all()
        assert (block >= 0).all() and (block < tokenizer.get_vocab_size()).all()  # no padding
    assert 0 < p.crop_fraction < 1  # of what was taken out: 5 blocks' tokens and what was cropped away, not the buffer
    assert p.crop_fraction == p.tokens_cropped / (5 * B * (T + 1) + p.tokens_cropped)


def test_rows_are_whole_documents_best_fit(tokenizer):
    # every BOS-delimited piece of a row, except the last, is a complete document
    p = packer(tokenizer)
    bos = tokenizer.get_bos_token_id()
    from nanochat.dataset import iter_documents, split_files
    docs = {tuple(ids) for ids in tokenizer.encode(list(iter_documents(split_files(SAMPLE_DIR, "train"))), prepend=bos)}
    p.lengths = TakenLengths(p.lengths)
    block = p.next_block()
    assert any((row == bos).sum() > 1 for row in block)  # some rows hold several documents
    for row in block:
        starts = np.flatnonzero(row == bos).tolist() + [T + 1]
        for a, b in zip(starts[:-2], starts[1:-1]):
            assert tuple(row[a:b].tolist()) in docs
    # best fit: each document placed is the longest in the buffer that fits the row's space; none fits: the shortest
    taken = iter(p.lengths.taken)
    for _ in range(B):
        pos = 0
        while pos < T + 1:
            lengths, length = next(taken)
            space = T + 1 - pos
            fits = [n for n in lengths if n <= space]
            assert length == (max(fits) if fits else min(lengths)), (space, length, sorted(lengths))
            pos += min(length, space)
    assert next(taken, None) is None


class TakenLengths(list):
    """The packer's sorted buffer lengths, recording the buffer and the length each time one is taken."""

    def __init__(self, lengths):
        super().__init__(lengths)
        self.taken = []

    def pop(self, j):
        self.taken.append((list(self), self[j]))
        return super().pop(j)


def test_loader_yields_shifted_targets(tokenizer):
    loader = DataLoader(tokenizer, B, T, "train", "cpu", data_dir=SAMPLE_DIR, buffer_docs=64)
    x, y, state = next(loader)
    assert x.shape == y.shape == (B, T) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert set(state) >= {"g", "buffer", "dp_rank", "dp_size"}


@pytest.mark.parametrize("keep_remainder", [False, True])
def test_exact_resume_from_state(tokenizer, keep_remainder):
    p = packer(tokenizer, keep_remainder=keep_remainder)
    for _ in range(3):
        p.next_block()
    state = p.state()
    expected = [p.next_block() for _ in range(4)]
    q = packer(tokenizer, keep_remainder=keep_remainder, state=state)
    for e in expected:
        assert np.array_equal(q.next_block(), e)


def test_state_resumes_at_another_row_length(tokenizer):
    """A context extension resumes a state saved at one row length at another: the state holds documents, not
    rows, so the longer rows go on with the same buffered documents and the next row groups."""
    p = packer(tokenizer, keep_remainder=True)  # cropped pieces (offset > 0) in the buffer too
    for _ in range(3):
        p.next_block()
    q = BestFitPacker(tokenizer, 1, 4 * T, "train", SAMPLE_DIR, buffer_docs=64, keep_remainder=True, state=p.state())
    assert q.g == p.g and q.refs == p.refs and any(offset > 0 for _, _, offset in q.refs)
    assert all(np.array_equal(a, b) for a, b in zip(q.docs, p.docs))
    assert q.next_block().shape == (1, 4 * T + 1)


def test_keep_remainder_crops_nothing(tokenizer, tmp_path):
    p = packer(tokenizer, keep_remainder=True)
    for _ in range(5):
        p.next_block()
    assert p.tokens_cropped == 0
    # one document many rows long: its pieces, each led by a new <|bos|>, put back together are the document
    import pyarrow as pa
    import pyarrow.parquet as pq
    text = " ".join(f"word{i} of a long document" for i in range(60))
    for name in ("a", "b"):  # the last shard is the validation split
        pq.write_table(pa.table({"text": [text]}), tmp_path / f"{name}.parquet")
    p = BestFitPacker(tokenizer, 1, 31, "train", str(tmp_path), keep_remainder=True)
    doc, bos = tokenizer.encode(text), tokenizer.get_bos_token_id()
    rows = [p.next_block()[0] for _ in range(len(doc) // 31 + 2)]
    stream = [t for row in rows for t in row.tolist() if t != bos]
    assert len(doc) > 3 * 32 and stream[:len(doc)] == doc


def test_dp_ranks_read_disjoint_row_groups(tokenizer):
    a = packer(tokenizer, dp_rank=0, dp_size=2)
    b = packer(tokenizer, dp_rank=1, dp_size=2)
    a.next_block(), b.next_block()
    ga = {ref[0] for ref in a.refs}
    gb = {ref[0] for ref in b.refs}
    assert ga and gb and all(g % 2 == 0 for g in ga) and all(g % 2 == 1 for g in gb)


def test_reshard_keeps_position_and_buffer(tokenizer):
    ranks = [packer(tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    for p in ranks:
        p.next_block()
    states = [p.state() for p in ranks]
    new = reshard_states(states, 1)
    assert len(new) == 1
    assert new[0]["g"] == max(s["g"] for s in states) - 1
    assert sorted(map(tuple, new[0]["buffer"])) == sorted(tuple(r) for s in states for r in s["buffer"])
    q = packer(tokenizer, state=new[0])  # resumes and keeps packing
    assert q.next_block().shape == (B, T + 1)
    three = reshard_states(states, 3)
    assert sum(len(s["buffer"]) for s in three) == sum(len(s["buffer"]) for s in states)
    # the newest epoch any rank reached, and the token counts shared out (the crop fraction stays what it was)
    states = [dict(states[0], epoch=1), dict(states[1], epoch=2)]
    total = sum(s["tokens_in"] for s in states)
    assert reshard_states(states, 1)[0]["epoch"] == 2 and reshard_states(states, 1)[0]["tokens_in"] == total
    assert 0 <= total - sum(s["tokens_in"] for s in reshard_states(states, 3)) < 3
    assert reshard_states(states, 2) == states
    assert [s["g"] for s in three] == [three[0]["g"] + r for r in range(3)]


def test_past_an_epoch_and_with_equal_lengths_a_state_resumes_exactly(tokenizer, tmp_path):
    """A split of 16 short documents of one length (ties in the best fit) read several times over: the epoch advances,
    and a state taken past the first epoch restores the epoch and the token counts, and the same rows follow."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"the river {w} runs past the old mill town" for w in "abcdefghijklmnop"]
    for i in range(2):
        pq.write_table(pa.table({"text": texts}), tmp_path / f"s{i}.parquet", row_group_size=4)
    p = BestFitPacker(tokenizer, 2, 32, "train", str(tmp_path), buffer_docs=8)
    for _ in range(12):
        p.next_block()
    assert p.epoch >= 3
    state = p.state()
    q = BestFitPacker(tokenizer, 2, 32, "train", str(tmp_path), buffer_docs=8, state=state)
    assert q.state() == state and q.crop_fraction == p.crop_fraction
    for _ in range(6):
        assert np.array_equal(q.next_block(), p.next_block())


def test_reshard_without_states_means_fresh_loaders():
    # a checkpoint taken before the first step holds no data state
    assert reshard_states([None], 2) == [None, None]
    assert reshard_states([], 1) == [None]


def test_small_shard_is_not_buffered_in_several_copies(tokenizer):
    """The buffer holds at most half an epoch: with the default 512 documents it held the bundled sample's 480
    training articles plus repeats, and reached epoch 4 after 11% of its tokens."""
    p = BestFitPacker(tokenizer, B, T, "train", SAMPLE_DIR)  # the default buffer size
    for _ in range(40):
        p.next_block()
        held = [(g % p.N, row) for g, row, _ in p.refs]
        assert len(held) == len(set(held)), "a document is in the buffer twice"
    assert p.epoch == 1


def test_rows_of_empty_text_are_skipped_and_no_text_is_refused(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from nanochat.dataset import DataError
    texts = ["", "a real document about rivers and towns"] * 8
    for i in range(2):
        pq.write_table(pa.table({"text": texts}), tmp_path / f"s{i}.parquet", row_group_size=4)
    bos = tokenizer.get_bos_token_id()
    block = BestFitPacker(tokenizer, 2, 16, "train", str(tmp_path)).next_block()
    assert not ((block[:, :-1] == bos) & (block[:, 1:] == bos)).any()  # no BOS-only documents
    empty = tmp_path / "empty"
    empty.mkdir()
    for i in range(2):  # check_data refuses this at the start; a loader given it must not spin forever
        pq.write_table(pa.table({"text": [""] * 8}), empty / f"s{i}.parquet", row_group_size=4)
    with pytest.raises(DataError, match=r"the shards s0.parquet in .* hold no text"):
        BestFitPacker(tokenizer, 2, 16, "train", str(empty)).next_block()
