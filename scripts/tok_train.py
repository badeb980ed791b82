"""
Train the BPE tokenizer on the training shards and save it under $NANOCHAT_BASE_DIR/tokenizer/.

    python -m scripts.tok_train --max-chars 2000000000 --vocab-size 32768
"""

import os
import time
import argparse

from nanochat.common import HelpWithDefaults, UserError, atomic_write
from nanochat.dataset import resolve_data_dir, split_files, iter_documents
from nanochat.tokenizer import Tokenizer, TokenizerError, default_tokenizer_dir, get_tokenizer
from nanochat import report

parser = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer (rustbpe)",
                                 formatter_class=HelpWithDefaults)
parser.add_argument("--max-chars", type=int, default=2_000_000_000, help="characters of training text to use at most")
parser.add_argument("--doc-cap", type=int, default=10_000, help="characters taken from each document at most")
parser.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens included")
parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR or base_data)")
args = parser.parse_args()

try:
    out_dir = default_tokenizer_dir()  # a base dir that cannot be made: one line
    data_dir = resolve_data_dir(args.data_dir)
    train_files = split_files(data_dir, "train")
    os.makedirs(out_dir, exist_ok=True)  # where the tokenizer goes must take files before anything is trained
    atomic_write(os.path.join(out_dir, ".write_probe"), b"")
    os.remove(os.path.join(out_dir, ".write_probe"))
except UserError as e:
    raise SystemExit(f"ERROR: {e}")
except OSError as e:
    raise SystemExit(f"ERROR: cannot write {e.filename or out_dir} ({e.strerror}): set NANOCHAT_BASE_DIR to a folder "
                     f"you can write")
print(f"training a {args.vocab_size:,}-token BPE on up to {args.max_chars:,} chars of {len(train_files)} shards in {data_dir}")

stats = {"chars": 0, "docs": 0}
t0 = time.time()


def text_iterator():
    next_report = args.max_chars // 10
    for doc in iter_documents(train_files):
        doc = doc[:args.doc_cap]
        yield doc
        stats["chars"] += len(doc)
        stats["docs"] += 1
        if stats["chars"] >= next_report:
            print(f"  read {stats['chars']:,} chars, {stats['docs']:,} docs ({time.time() - t0:.1f}s)", flush=True)
            next_report += args.max_chars // 10
        if stats["chars"] >= args.max_chars:
            return


try:
    tokenizer = Tokenizer.train_from_iterator(text_iterator(), args.vocab_size)
except UserError as e:  # the tokenizer's, or the data's (a shard read on the way)
    raise SystemExit(f"ERROR: {e}")
train_time = time.time() - t0
try:
    try:  # another tokenizer there: set aside, not overwritten (checkpoints trained with it cannot load without it)
        other = get_tokenizer(out_dir).hash != tokenizer.hash
    except TokenizerError:  # none there (or damaged: kept aside too)
        other = os.path.exists(os.path.join(out_dir, "tokenizer.json"))
    if other:
        aside = f"{out_dir}.replaced_{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(out_dir, aside)
        print(f"NOTICE: {out_dir} held another tokenizer: moved to {aside} (the checkpoints trained with it need it back "
              f"there to load)")
    tokenizer.save(out_dir)
except OSError as e:  # a disk that filled up while training
    raise SystemExit(f"ERROR: cannot write {e.filename or out_dir} ({e.strerror}): the tokenizer was trained but not "
                     f"saved; free some space and run again")
print(f"trained on {stats['chars']:,} chars ({stats['docs']:,} docs) in {train_time:.2f}s; saved to {out_dir}")

# sanity check: the exact bytes come back, special tokens included
sample = "Hello world! The year 2024 has 365 days. 日本語 🙂 <|bos|>\n\tdone"
ids = tokenizer.encode(sample, prepend="<|bos|>")
assert tokenizer.decode(ids[1:]) == sample, "round trip failed"
token_bytes = tokenizer.token_bytes()
nonzero = token_bytes[token_bytes > 0].float()
report.log_section("Tokenizer training", [
    {"data dir": data_dir, "max chars": args.max_chars, "doc cap": args.doc_cap, "vocab size": args.vocab_size},
    {"chars used": stats["chars"], "docs used": stats["docs"], "train time (s)": round(train_time, 2)},
    {"token bytes min": int(nonzero.min()), "token bytes max": int(nonzero.max()),
     "token bytes mean": round(nonzero.mean().item(), 3), "special tokens": int((token_bytes == 0).sum())}])
