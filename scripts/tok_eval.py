"""
Tokenizer compression, bytes per token on train and val text: ours, and GPT-2's and GPT-4's when tiktoken can
load them (offline and not cached: skipped). Usage: `python -m scripts.tok_eval --max-chars 10000000`
"""

import os
import argparse

from nanochat.common import HelpWithDefaults, UserError, fail
from nanochat.dataset import resolve_data_dir, split_files, iter_documents
from nanochat.tokenizer import get_tokenizer
from nanochat import report

parser = argparse.ArgumentParser(description="Evaluate tokenizer compression", formatter_class=HelpWithDefaults)
parser.add_argument("--max-chars", type=int, default=10_000_000, help="characters of each split to encode")
parser.add_argument("--data-dir", type=str, default=None)
args = parser.parse_args()
if args.max_chars < 1:
    fail(f"--max-chars {args.max_chars}: give at least 1")


def take_text(files, max_chars):
    docs, n = [], 0
    for doc in iter_documents(files):
        docs.append(doc[:max_chars - n])
        n += len(docs[-1])
        if n >= max_chars:
            break
    return docs


try:
    tokenizer = get_tokenizer()
    data_dir = resolve_data_dir(args.data_dir)
    texts = {split: take_text(split_files(data_dir, split), args.max_chars) for split in ("train", "val")}
except UserError as e:  # the data's, the tokenizer's, or a base dir that cannot be made
    raise SystemExit(f"ERROR: {e}")
if empty := [split for split, docs in texts.items() if not docs]:
    raise SystemExit(f"ERROR: no text in the {' and '.join(empty)} split of {data_dir}: nothing to measure")


def reference_encoder(name):
    """The batch encoder of tiktoken's encoding `name`, or None: cached (TIKTOKEN_CACHE_DIR), or downloaded if the host
    answers in seconds (an offline machine could otherwise hang on the download)."""
    import socket
    import tiktoken
    try:
        if not os.environ.get("TIKTOKEN_CACHE_DIR"):
            socket.create_connection(("openaipublic.blob.core.windows.net", 443), timeout=3).close()
        return tiktoken.get_encoding(name).encode_ordinary_batch
    except Exception:
        return None


encoders = {"ours": tokenizer.encode}
for name, tiktoken_name in [("gpt2", "gpt2"), ("gpt4", "cl100k_base")]:
    if (encode := reference_encoder(tiktoken_name)) is None:
        print(f"skipped {name} ({tiktoken_name}): tiktoken cannot load it here (offline and not cached)")
    else:
        encoders[name] = encode

rows, flat = ["| split | encoding | bytes | tokens | bytes/token |", "| --- | --- | --- | --- | --- |"], {}
print(f"{'split':<6} {'encoding':<8} {'bytes':>12} {'tokens':>11} {'bytes/token':>12}")
for split, docs in texts.items():
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    for name, encode in encoders.items():
        n_tokens = sum(len(ids) for ids in encode(docs))
        ratio = n_bytes / n_tokens
        print(f"{split:<6} {name:<8} {n_bytes:>12,} {n_tokens:>11,} {ratio:>12.4f}")
        rows.append(f"| {split} | {name} | {n_bytes:,} | {n_tokens:,} | {ratio:.4f} |")
        flat[f"{split} {name} bytes/token"] = round(ratio, 4)

report.log_section("Tokenizer evaluation", [{"vocab size": tokenizer.get_vocab_size()}, flat, "\n".join(rows)])
