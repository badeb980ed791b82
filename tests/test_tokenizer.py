import os

import pytest
import torch

from nanochat.tokenizer import Tokenizer, SPECIAL_TOKENS, TokenizerError, get_token_bytes

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 1234567890, 3.14159, -42, 2024-11-21.",
    "日本語のテキストと中文，한국어 text.",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "tabs\tand\nnewlines\r\n  indented   spaces  ",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
    "<|bos|> looks special but is plain text here",
    "\u200b zero-width, \u00e9 vs e\u0301 combining",
]


def test_round_trip_varied_text(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode_bytes(ids) == text.encode("utf-8")


def test_batch_encode_matches_single(tokenizer):
    batch = tokenizer.encode(TEXTS, prepend="<|bos|>", append="<|assistant_end|>")
    for text, ids in zip(TEXTS, batch):
        assert ids[0] == tokenizer.get_bos_token_id()
        assert ids[-1] == tokenizer.encode_special("<|assistant_end|>")
        assert ids[1:-1] == tokenizer.encode(text)


def test_split_utf8_bytes_round_trip(tokenizer):
    # every prefix of the ids decodes to a prefix of the exact bytes, even mid-character
    text = "🙂日本🚀é"
    ids = tokenizer.encode(text)
    full = text.encode("utf-8")
    for k in range(len(ids) + 1):
        assert full.startswith(tokenizer.decode_bytes(ids[:k]))
    assert b"".join(tokenizer.id_to_token(i) for i in ids) == full


def test_special_tokens(tokenizer):
    ids = [tokenizer.encode_special(name) for name in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert tokenizer.get_bos_token_id() == tokenizer.encode_special("<|bos|>")
    assert max(ids) == tokenizer.get_vocab_size() - 1
    # special-token text in the input is not turned into the special id
    assert tokenizer.get_bos_token_id() not in tokenizer.encode("<|bos|>")
    assert tokenizer.decode([tokenizer.get_bos_token_id()]) == "<|bos|>"


def test_token_bytes(tokenizer, base_dir):
    tb = get_token_bytes(directory=os.path.join(base_dir, "tokenizer"))
    assert tb.dtype == torch.int32 and tb.numel() == tokenizer.get_vocab_size()
    special = {tokenizer.encode_special(n) for n in SPECIAL_TOKENS}
    for i in range(tokenizer.get_vocab_size()):
        expected = 0 if i in special else len(tokenizer.id_to_token(i))
        assert tb[i].item() == expected
    assert (tb[:256] == 1).all()  # the 256 byte tokens come first


def test_saved_files_are_plain_text(base_dir):
    d = os.path.join(base_dir, "tokenizer")
    for name in ("tokenizer.tiktoken", "tokenizer.json"):
        with open(os.path.join(d, name), "rb") as f:
            f.read().decode("ascii")  # no binary / pickle content


def test_save_load_same_encoding(tokenizer, tmp_path):
    tokenizer.save(str(tmp_path))
    loaded = Tokenizer.load(str(tmp_path))
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.special_tokens == tokenizer.special_tokens


def test_missing_tokenizer_message(tmp_path):
    with pytest.raises(TokenizerError, match="scripts.tok_train"):
        Tokenizer.load(str(tmp_path))


def test_vocab_too_small():
    with pytest.raises(TokenizerError, match="too small"):
        Tokenizer.train_from_iterator(iter(["abc"]), vocab_size=100)


def test_numbers_split_in_pairs(tokenizer):
    # the split pattern never merges 3+ digits: the vocabulary trained on the sample (its years and counts) holds
    # pairs of digits, never more, and a long number encodes in pieces of at most 2
    digits = lambda i: sum(c.isdigit() for c in tokenizer.id_to_token(i).decode(errors="replace"))
    assert max(digits(i) for i in range(tokenizer.get_vocab_size()) if i not in tokenizer.special_tokens.values()) == 2
    assert all(digits(i) <= 2 for i in tokenizer.encode("1234567 and 9876543210"))


def test_tok_train_reads_the_training_shards_only(env, tmp_path):
    """The last shard is validation: the tokenizer must not learn its text (bits per byte would be judged on text the
    vocabulary was fitted to). The validation shard alone holds "q", repeated: had it been read, "qq" would merge."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import run_script
    from nanochat.tokenizer import get_tokenizer
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"text": ["the cat sat on the mat, and the dog ran. " * 20] * 50}), data / "shard_0.parquet")
    pq.write_table(pa.table({"text": ["qqqqqqqqqqqqqqqq " * 200] * 50}), data / "shard_1.parquet")
    run_script("scripts.tok_train", ["--vocab-size", "272", "--data-dir", str(data)], dict(env, NANOCHAT_BASE_DIR=str(tmp_path)))
    tokenizer = get_tokenizer(str(tmp_path / "tokenizer"))
    assert len(tokenizer.encode("qqqqqqqq")) == 8 and len(tokenizer.encode(" the cat")) < 8
