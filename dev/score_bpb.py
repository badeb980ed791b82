r"""
An independent bits-per-byte check: score one checkpoint on fixed validation bytes using nothing of the
harness's own evaluation code, only its model's logits and its tokenizer.

The bytes: the first --docs documents of the parquet file --val (0: all of them; with --min-chars, only
documents of at least that many characters), one row each: [BOS] + the document's first --chars characters, or, where those
are more tokens than the model's context, the longest prefix of them that fits. Every token after the
BOS is scored (its cross-entropy from the model's logits, in fp32). Those tokens spell exactly the text
kept, so

    bpb = (sum of the scored tokens' losses in nats) / ln 2 / (UTF-8 bytes of the texts kept)

The default (--chars 0: no cut but the context) scores each document's head as far as one row holds it,
which is what a harness's packed rows of whole documents hold too; --min-chars N --chars N scores the
same number of characters of every document. It also prints the loss by position in the document and the
bpb of documents scored whole and cut, since how far into its documents a text reaches moves the mean.
--packed scores the same tokens with documents placed back to back, as many whole ones as fit a row (each
still after its own BOS): the difference from the default is what sharing a row with earlier documents, as
a harness's packed evaluation rows do, does to the score.

It runs against either harness, this one or upstream nanochat, so that both are scored on the same bytes:
--root is the checkout whose `nanochat` package is imported (put first on sys.path), --harness says how its
checkpoints load.

    python dev/score_bpb.py --harness ours --root . --checkpoint-dir $NANOCHAT_BASE_DIR/base_checkpoints/d12 \
        --tokenizer-dir $NANOCHAT_BASE_DIR/tokenizer --val data/shard_00007.parquet
    NANOCHAT_BASE_DIR=... python dev/score_bpb.py --harness upstream --root ../nanochat-92d63d4 \
        --checkpoint-dir .../base_checkpoints/d12 --val data/shard_00007.parquet

It imports nothing of this checkout (run it as a file, or with -m from this checkout), so the package imported is
the one under --root. Needs a checkpoint, the parquet file and, for speed, a GPU (it runs on a CPU too). It prints
`SCORE bpb=... bytes=... tokens=... docs=... fitted=...` (fitted: documents cut to fit the context).
"""

import os
import sys
import math
import argparse

import torch
import torch.nn.functional as F
import pyarrow.parquet as pq


def validation_texts(path, docs, min_chars, chars):
    texts = []
    for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text and len(text) >= min_chars:
                texts.append(text[:chars] if chars > 0 else text)
                if len(texts) == docs:
                    return texts
    if docs == 0 and texts:
        return texts
    sys.exit(f"score_bpb: {path} has only {len(texts)} documents of >= {max(1, min_chars)} characters (asked for {docs}): "
             f"lower --docs or --min-chars")


def fit(text, tokenizer, bos, seq_len):
    """[BOS] + the tokens of the longest prefix of text that is at most seq_len tokens, and that prefix."""
    ids = tokenizer.encode(text, prepend=bos)
    if len(ids) - 1 <= seq_len:
        return ids, text
    lo, hi = 0, len(text)  # the longest prefix that fits has lo characters: fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(text[:mid])) <= seq_len else (lo, mid)
    return tokenizer.encode(text[:lo], prepend=bos), text[:lo]


def load(args, device):
    """(model, tokenizer, max sequence length), each harness in its own evaluation precision (bf16 on a GPU). The
    imports are --root's nanochat: ours loads through checkpoint_manager.load_model, upstream through its own
    checkpoint_manager.build_model."""
    step = None if args.step < 0 else args.step
    if args.harness == "ours":
        from nanochat.checkpoint_manager import load_model
        from nanochat.tokenizer import get_tokenizer
        ckpt = os.path.abspath(args.checkpoint_dir)
        base_dir, tag = os.path.dirname(os.path.dirname(ckpt)), os.path.basename(ckpt)
        tokenizer = get_tokenizer(args.tokenizer_dir)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, meta = load_model(tag, step, device, dtype, base_dir=base_dir, tokenizer=tokenizer)
        return model, tokenizer, meta["model_config"]["sequence_len"]
    from nanochat.checkpoint_manager import build_model, find_last_step
    step = find_last_step(args.checkpoint_dir) if step is None else step
    model, tokenizer, meta = build_model(args.checkpoint_dir, step, device, phase="eval")
    return model, tokenizer, meta["model_config"]["sequence_len"]  # upstream casts to its COMPUTE_DTYPE itself


POSITION_EDGES = (0, 128, 512, 1024, 1536, 2048, 4096)  # the loss-by-position buckets, in tokens from the document's start


def rows_of(docs, seq_len, packed):
    """The rows scored, as lists of documents (each a dict whose "ids" are [BOS] + tokens): one per row, or with
    --packed as many whole documents as fit one row of seq_len + 1 tokens, in file order."""
    if not packed:
        return [[doc] for doc in docs]
    rows, row, used = [], [], 0
    for doc in docs:
        if row and used + len(doc["ids"]) > seq_len + 1:
            rows.append(row)
            row, used = [], 0
        row.append(doc)
        used += len(doc["ids"])
    return rows + [row]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--harness", choices=["ours", "upstream"], required=True, help="how the checkpoint loads")
    parser.add_argument("--root", type=str, required=True, help="the checkout whose nanochat package to import")
    parser.add_argument("--checkpoint-dir", type=str, required=True, help="folder of model_<step>.pt files")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step (default: %(default)s = the last)")
    parser.add_argument("--tokenizer-dir", type=str, default=None,
                        help="ours: the tokenizer folder (upstream reads $NANOCHAT_BASE_DIR/tokenizer)")
    parser.add_argument("--val", type=str, required=True, help="parquet file with a `text` column")
    parser.add_argument("--docs", type=int, default=1000, help="documents scored (default: %(default)s; 0 = every "
                                                               "document of --val)")
    parser.add_argument("--min-chars", type=int, default=0, help="skip documents shorter than this (default: %(default)s "
                                                                 "= none)")
    parser.add_argument("--chars", type=int, default=0, help="characters of each document kept at most (default: "
                                                             "%(default)s = as many as the context holds)")
    parser.add_argument("--packed", action="store_true", help="several whole documents to a row, in file order: the "
                        "same tokens, each with the documents before it in its row as context")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root)
    if not os.path.isdir(os.path.join(root, "nanochat")):
        sys.exit(f"score_bpb: --root {root} has no nanochat package")
    sys.path.insert(0, root)  # before anything imports nanochat: the package scored is --root's

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    texts = validation_texts(args.val, args.docs, args.min_chars, args.chars)
    model, tokenizer, seq_len = load(args, device)
    bos = tokenizer.get_bos_token_id()
    docs = []
    for text in texts:
        ids, kept = fit(text, tokenizer, bos, seq_len)
        docs.append(dict(ids=ids, bytes=len(kept.encode("utf-8")), fitted=len(kept) < len(text),
                         kind="cut" if len(kept) < len(text) or 0 < args.chars <= len(kept) else "whole"))
    nats, tokens, n_bytes = 0.0, 0, 0
    by_kind = {"whole": [0.0, 0], "cut": [0.0, 0]}  # (nats, bytes) of documents scored whole, and cut
    by_position = torch.zeros(len(POSITION_EDGES), 2, dtype=torch.float64)  # (nats, tokens) per bucket
    with torch.inference_mode():
        for row in rows_of(docs, seq_len, args.packed):
            flat = [t for doc in row for t in doc["ids"]]
            x = torch.tensor(flat[:-1], device=device)[None]
            y = torch.tensor(flat[1:], device=device)
            row_losses = F.cross_entropy(model(x)[0].float(), y, reduction="none").double().cpu()
            start = 0
            for doc in row:  # a document's tokens after its BOS; the targets that are the next BOS are left out
                losses = row_losses[start:start + len(doc["ids"]) - 1]
                start += len(doc["ids"])
                doc_nats = losses.sum().item()
                nats, tokens, n_bytes = nats + doc_nats, tokens + losses.numel(), n_bytes + doc["bytes"]
                by_kind[doc["kind"]][0] += doc_nats
                by_kind[doc["kind"]][1] += doc["bytes"]
                for i, lo in enumerate(POSITION_EDGES):
                    hi = POSITION_EDGES[i + 1] if i + 1 < len(POSITION_EDGES) else seq_len
                    part = losses[lo:hi]
                    by_position[i] += torch.tensor([part.sum().item(), part.numel()], dtype=torch.float64)
    print("loss by position in the document (nats per token): " + ", ".join(
        f"{lo}-: {s / n:.4f} ({int(n):,})" for lo, (s, n) in zip(POSITION_EDGES, by_position.tolist()) if n))
    print("bpb of documents scored whole / cut: " + ", ".join(
        f"{k} {n / math.log(2) / b:.4f} ({b:,} bytes)" for k, (n, b) in by_kind.items() if b))
    print(f"SCORE bpb={nats / math.log(2) / n_bytes:.6f} bytes={n_bytes} tokens={tokens} docs={len(docs)} "
          f"fitted={sum(doc['fitted'] for doc in docs)}",
          flush=True)


if __name__ == "__main__":
    main()
