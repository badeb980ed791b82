"""
Byte-level BPE: trained with rustbpe (Rust, parallel), used through tiktoken (fast encode/decode). Saved under
$NANOCHAT_BASE_DIR/tokenizer/ in plain, non-executable files:
  tokenizer.tiktoken   one line per mergeable token: base64(bytes) rank   (tiktoken's own format)
  tokenizer.json       the split pattern, the special tokens with their ids, and the two other files' checksums
  token_bytes.pt       int32 tensor: the byte length of each token (0 for specials), for bits per byte
A file failing its checksum is refused at load (a tokenizer.tiktoken cut at a line end would load part of its merges).
"""

import os
import json
import base64
import hashlib

import torch

from nanochat.common import UserError, get_base_dir, atomic_write, base_dir_hint, file_checksum, read_json

RETRAIN = "train it again with `python -m scripts.tok_train` (checkpoints of the old one will not match the new one)"

# GPT-4's split, but numbers in groups of 1-2 digits (not 1-3): fewer number tokens leave a small vocab more words
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""

SPECIAL_TOKENS = ["<|bos|>",  # begins every document; the others are reserved for chat fine-tuning
                  "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]


class TokenizerError(UserError):
    """A missing or damaged tokenizer."""


def default_tokenizer_dir():
    return os.path.join(get_base_dir(), "tokenizer")


class Tokenizer:
    """A tiktoken Encoding plus the few conveniences training needs."""

    def __init__(self, mergeable_ranks: dict, pattern: str, special_tokens: dict, directory=None):
        import tiktoken
        self.mergeable_ranks, self.pattern, self.special_tokens = mergeable_ranks, pattern, special_tokens
        self.enc = tiktoken.Encoding(name="nanochat", pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=special_tokens)
        self.bos_token_id = special_tokens["<|bos|>"]
        self.directory = directory  # the folder it was loaded from or saved to

    @property
    def hash(self):
        """16 hex digits of a SHA-256 of merges, pattern and specials, which checkpoints record (another tokenizer
        of the same vocab size would load silently)."""
        h = hashlib.sha256(self.pattern.encode())
        for tok, rank in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(tok).to_bytes(4, "little") + tok)
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        return h.hexdigest()[:16]

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size, pattern=SPLIT_PATTERN):
        import rustbpe
        n_merged = vocab_size - len(SPECIAL_TOKENS)
        if n_merged < 256:
            raise TokenizerError(f"vocab_size {vocab_size} is too small: need at least {256 + len(SPECIAL_TOKENS)} "
                                 f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(text_iterator, n_merged, pattern=pattern)
        ranks = {bytes(k): v for k, v in bpe.get_mergeable_ranks()}
        if len(ranks) != n_merged:  # the text ran out of pairs to merge before reaching the target size
            raise TokenizerError(f"training produced only {len(ranks)} tokens of the {n_merged} asked for; "
                                 f"give it more text (--max-chars) or ask for a smaller --vocab-size")
        specials = {name: n_merged + i for i, name in enumerate(SPECIAL_TOKENS)}
        return cls(ranks, pattern, specials)

    def save(self, directory):
        """tokenizer.json last, with the other files' checksums: it makes the tokenizer whole."""
        os.makedirs(directory, exist_ok=True)
        lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}" for tok, rank in
                 sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])]
        atomic_write(os.path.join(directory, "tokenizer.tiktoken"), ("\n".join(lines) + "\n").encode())
        atomic_write(os.path.join(directory, "token_bytes.pt"), lambda f: torch.save(self.token_bytes(), f))
        meta = {"pattern": self.pattern, "special_tokens": self.special_tokens,
                "checksums": {f: file_checksum(os.path.join(directory, f)) for f in ("tokenizer.tiktoken", "token_bytes.pt")}}
        atomic_write(os.path.join(directory, "tokenizer.json"), json.dumps(meta, indent=2).encode())
        self.directory = directory

    @classmethod
    def load(cls, directory):
        ranks_path, meta_path = os.path.join(directory, "tokenizer.tiktoken"), os.path.join(directory, "tokenizer.json")
        if not (os.path.exists(ranks_path) and os.path.exists(meta_path)):
            raise TokenizerError(f"no tokenizer in {directory}: train one with `python -m scripts.tok_train`, or set "
                                 f"NANOCHAT_BASE_DIR to where one was trained" + base_dir_hint())
        check_file(directory, "tokenizer.tiktoken")
        ranks = {}
        with open(ranks_path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        tok, rank = line.split()
                        ranks[base64.b64decode(tok, validate=True)] = int(rank)
                    except ValueError:  # binascii.Error too
                        raise TokenizerError(f"{ranks_path} is damaged at line {line_no} (expected `base64 rank`): "
                                             f"{RETRAIN}") from None
        try:
            meta = read_json(meta_path)
            return cls(ranks, meta["pattern"], meta["special_tokens"], directory)
        except (ValueError, KeyError, TypeError) as e:  # bad JSON, or merges that do not make a tokenizer
            raise TokenizerError(f"the tokenizer in {directory} is damaged ({type(e).__name__}: {e}): {RETRAIN}") from None

    def get_vocab_size(self):
        return self.enc.n_vocab

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode_special(self, name):
        return self.special_tokens[name]

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """A string -> ids, a list of strings -> lists of ids; special-token text is plain text. prepend/append: an id
        or a special token's name."""
        as_ids = lambda t: [] if t is None else [t if isinstance(t, int) else self.special_tokens[t]]
        pre, post = as_ids(prepend), as_ids(append)
        if isinstance(text, str):
            return pre + self.enc.encode_ordinary(text) + post
        return [pre + ids + post for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]

    def decode(self, ids):
        """Text of the ids, U+FFFD where they cut a UTF-8 character (decode_bytes gives the exact bytes)."""
        return self.enc.decode(list(ids), errors="replace")

    def decode_bytes(self, ids):
        return self.enc.decode_bytes(list(ids))

    def id_to_token(self, token_id):
        return self.enc.decode_single_token_bytes(token_id)

    def token_bytes(self):
        specials = set(self.special_tokens.values())
        return torch.tensor([0 if i in specials else len(self.id_to_token(i)) for i in range(self.get_vocab_size())],
                            dtype=torch.int32)


def check_file(directory, name):
    """The file matches tokenizer.json's checksum (a tokenizer from before checksums: not checked)."""
    try:
        checksums = read_json(os.path.join(directory, "tokenizer.json")).get("checksums", {})
    except (OSError, ValueError, AttributeError):
        return  # named by the load itself
    if name in checksums and file_checksum(path := os.path.join(directory, name)) != checksums[name]:
        raise TokenizerError(f"{path} no longer matches the checksum saved with it (damaged since it was written): "
                             f"{RETRAIN}")


def get_tokenizer(directory=None):
    return Tokenizer.load(directory or default_tokenizer_dir())


def get_token_bytes(device="cpu", directory=None):
    directory = directory or default_tokenizer_dir()
    path = os.path.join(directory, "token_bytes.pt")
    if not os.path.exists(path):
        raise TokenizerError(f"no token_bytes.pt in {directory}: train a tokenizer with `python -m scripts.tok_train`")
    check_file(directory, "token_bytes.pt")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, or not tensors
        raise TokenizerError(f"{path} is damaged ({type(e).__name__}): train the tokenizer again with "
                             f"`python -m scripts.tok_train`") from None
