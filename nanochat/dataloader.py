"""
Best-fit BOS packing into (B, T) batches: each row of a (B, T+1) block starts with <|bos|> and holds whole documents,
no padding. From a length-sorted buffer of tokenized documents, a row takes the LARGEST that fits; when none fits, the
SHORTEST is cropped to fill it (the rest dropped, or with keep_remainder kept as a new <|bos|> piece). A document
longer than a row never fits, so it is read only when the buffer holds nothing shorter: such documents gather in the
buffer, and over many epochs of small data some are never read (upstream nanochat's packing does the same).
Data order: DP rank r of n (TP and PP peers share one) reads row group g % N of the global (shard, row group) list,
epoch g // N + 1, for g = r, r+n, ... A small state per batch (the next g; (g, row, offset) per buffered document)
rebuilds the buffer exactly: a resume is bit-exact at the same DP size; reshard_states continues at another.
"""

import os
import bisect
import queue
import atexit
import threading
import contextlib

import numpy as np
import torch

from nanochat.dataset import resolve_data_dir, split_files, list_row_groups, read_row_group, row_group_rows, DataError


class BestFitPacker:
    """The packing itself, on one DP rank's stream of row groups. Not thread-safe; see DataLoader."""

    def __init__(self, tokenizer, B, T, split="train", data_dir=None, dp_rank=0, dp_size=1,
                 buffer_docs=512, keep_remainder=False, tokenizer_threads=4, state=None):
        self.tokenizer, self.B, self.T = tokenizer, B, T
        self.bos = tokenizer.get_bos_token_id()
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.keep_remainder, self.threads = keep_remainder, tokenizer_threads
        data_dir = resolve_data_dir(data_dir, quiet=(split == "val"))
        self.files = split_files(data_dir, split)
        self.row_groups = list_row_groups(self.files)
        if not self.row_groups:
            raise DataError(f"the {split} shards in {data_dir} hold no row groups")
        self.N = len(self.row_groups)
        # a buffer as large as the data would hold copies of the same documents from several epochs at
        # once (a small shard read again and again): at most half of what this rank reads in an epoch
        rows_per_rank = sum(row_group_rows(*rg) for rg in self.row_groups) // dp_size
        self.buffer_docs = max(1, min(buffer_docs, rows_per_rank // 2))
        # the buffer: lengths sorted ascending, with the token arrays and references in the same order
        self.lengths, self.docs, self.refs = [], [], []
        state = state or {"g": dp_rank, "buffer": []}  # fresh: this rank's first row group next, nothing buffered
        self.g, self.epoch = state["g"], state.get("epoch", 1)
        self.tokens_in, self.tokens_cropped = state.get("tokens_in", 0), state.get("tokens_cropped", 0)
        buffer = state["buffer"]  # rebuilt: its documents tokenized again, a row group at a time
        groups = {g for g, _, _ in buffer}
        tokenized = {g: self._tokenize_rows(g, [r for h, r, _ in buffer if h == g]) for g in groups}
        for g, row, offset in buffer:  # saved in sorted order: re-inserting keeps ties in order
            full = tokenized[g][row]
            tokens = full if offset == 0 else np.concatenate([[self.bos], full[1 + offset:]]).astype(np.int32)
            self._insert(tokens, (g, row, offset))

    def _tokenize_rows(self, g, rows=None):
        """{row: int32 array of [bos] + tokens} for row group g (all rows with text, or the given ones)."""
        texts = read_row_group(*self.row_groups[g % self.N])
        rows = [r for r in range(len(texts)) if texts[r]] if rows is None else sorted(set(rows))
        ids = self.tokenizer.encode([texts[r] for r in rows], prepend=self.bos, num_threads=self.threads)
        return {r: np.asarray(x, dtype=np.int32) for r, x in zip(rows, ids)}

    def _insert(self, tokens, ref):
        i = bisect.bisect_right(self.lengths, len(tokens))
        self.lengths.insert(i, len(tokens))
        self.docs.insert(i, tokens)
        self.refs.insert(i, ref)

    def _refill(self):
        reads = 0  # at most N row groups per refill: data with little text cannot fill the buffer
        while len(self.docs) < self.buffer_docs and reads < self.N:
            for row, tokens in self._tokenize_rows(self.g).items():
                self._insert(tokens, (self.g, row, 0))
                self.tokens_in += len(tokens)
            self.g += self.dp_size
            reads += 1
        if not self.docs:
            names = ", ".join(os.path.basename(f) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
            raise DataError(f"the shards {names} in {os.path.dirname(self.files[0])} hold no text (every row's `text` "
                            f"is empty): check how they were written (one document per row in the `text` column)")

    def next_block(self):
        """A (B, T+1) int32 array, every row starting with <|bos|>."""
        block = np.empty((self.B, self.T + 1), dtype=np.int32)
        for b in range(self.B):
            pos = 0
            while pos < self.T + 1:
                self._refill()
                space = self.T + 1 - pos
                i = bisect.bisect_right(self.lengths, space) - 1  # the largest document that fits
                j = max(i, 0)  # when nothing fits (i = -1), the shortest one
                self.lengths.pop(j)
                tokens, (g, row, offset) = self.docs.pop(j), self.refs.pop(j)
                n = len(tokens) if i >= 0 else space  # nothing fits: crop the shortest to fill the row exactly
                block[b, pos:pos + n] = tokens[:n]
                pos += n
                if i < 0 and self.keep_remainder:
                    # piece(o) = [bos] + doc[1 + o:]; taking `space` tokens of piece(o) leaves piece(o + space - 1)
                    piece = np.concatenate([[self.bos], tokens[space:]]).astype(np.int32)
                    self._insert(piece, (g, row, offset + space - 1))
                    self.tokens_in += 1  # the new bos
                elif i < 0:
                    self.tokens_cropped += len(tokens) - space
                self.epoch = max(self.epoch, g // self.N + 1)  # the newest epoch whose data was packed
        return block

    def state(self):
        return {"g": self.g, "buffer": [list(r) for r in self.refs], "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "epoch": self.epoch, "tokens_in": self.tokens_in, "tokens_cropped": self.tokens_cropped}

    @property
    def crop_fraction(self):
        """Of the tokens taken out of the buffer (packed, or cropped away), the share cropped away."""
        return self.tokens_cropped / max(1, self.tokens_in - sum(self.lengths))


def reshard_states(states, new_dp_size):
    """States saved at one DP size, for another: continue after the furthest row group any rank had read,
    buffered documents shared out round-robin. No states (saved before the first step): fresh loaders."""
    states = [s for s in states if s is not None]
    if not states:
        return [None] * new_dp_size
    old = len(states)
    if old == new_dp_size:
        return [dict(s) for s in states]
    start = max(s["g"] for s in states) - old + 1  # every row group below this was read, or is skipped
    refs = sorted((ref for s in states for ref in s["buffer"]), key=lambda r: (r[0], r[1], r[2]))
    shared = {"dp_size": new_dp_size, "epoch": max(s.get("epoch", 1) for s in states),
              **{k: sum(s.get(k, 0) for s in states) // new_dp_size for k in ("tokens_in", "tokens_cropped")}}
    return [{"g": start + r, "buffer": refs[r::new_dp_size], "dp_rank": r, **shared} for r in range(new_dp_size)]


class DataLoader:
    """Yields (inputs, targets, state after this batch) forever, (B, T) int64 on `device`. A thread packs the
    next `prefetch` batches while the model computes; close() (also at exit) stops it between native calls."""

    def __init__(self, tokenizer, B, T, split, device, data_dir=None, dp_rank=0, dp_size=1, state=None,
                 keep_remainder=False, prefetch=2, buffer_docs=512):
        self.packer = BestFitPacker(tokenizer, B, T, split, data_dir, dp_rank, dp_size, buffer_docs=buffer_docs,
                                    keep_remainder=keep_remainder, state=state)
        self.device = torch.device(device)
        self.queue = queue.Queue(maxsize=prefetch)
        self.stats = {"epoch": self.packer.epoch, "crop_fraction": self.packer.crop_fraction}  # until a batch arrives
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._produce, daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _produce(self):
        try:
            while not self.stopping.is_set():
                block = torch.from_numpy(self.packer.next_block()).long()
                if self.device.type == "cuda":
                    block = block.pin_memory()
                stats = {"epoch": self.packer.epoch, "crop_fraction": self.packer.crop_fraction}
                self._put((block, self.packer.state(), stats))
        except BaseException as e:  # hand the error to the consumer instead of dying silently
            self._put(e)

    def _put(self, item):
        while not self.stopping.is_set():  # a timeout, so that close() is seen while the queue is full
            with contextlib.suppress(queue.Full):
                return self.queue.put(item, timeout=0.1)

    def close(self):
        self.stopping.set()
        self.thread.join()
        atexit.unregister(self.close)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        block, state, self.stats = item
        block = block.to(self.device, non_blocking=True)
        return block[:, :-1], block[:, 1:], state
