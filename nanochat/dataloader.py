"""
Best-fit BOS packing of documents into (B, T) batches.

Every row of a (B, T+1) token block starts with <|bos|> and is filled with whole documents, no padding:
keep a buffer of tokenized documents sorted by length; for each row, repeatedly take the LARGEST
document that still fits the space left (best fit); when none fits, crop the SHORTEST one to fill the
row exactly. Cropped tokens are dropped, or with keep_remainder=True put back into the buffer as a new
piece that starts with <|bos|>. inputs = block[:, :-1], targets = block[:, 1:].

Data order: the global list of (shard, row group) is read as an endless sequence g = 0, 1, 2, ...
(row group g % N, epoch g // N + 1); DP rank r of n reads g = r, r+n, r+2n, ...  TP and PP peers share
a DP rank and so see the same batches.

Resume: each batch comes with a small state (next g, and a reference (g, row, token offset) for every
buffered document) that rebuilds the buffer exactly: same DP size -> bit-exact continuation;
another DP size -> `reshard_states` continues from the same position with every buffered document kept.
"""

import bisect
import queue
import atexit
import threading

import numpy as np
import torch

from nanochat.dataset import (resolve_data_dir, split_files, list_row_groups, read_row_group, row_group_rows,
                              no_text_error, DataError)


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
        if len(self.row_groups) == 0:
            raise DataError(f"the {split} shards in {data_dir} hold no row groups")
        self.N = len(self.row_groups)
        # a buffer as large as the data would hold copies of the same documents from several epochs at
        # once (a small shard read again and again): at most half of what this rank reads in an epoch
        rows_per_rank = sum(row_group_rows(*rg) for rg in self.row_groups) // dp_size
        self.buffer_docs = max(1, min(buffer_docs, rows_per_rank // 2))
        # the buffer: lengths sorted ascending, with the token arrays and references in the same order
        self.lengths, self.docs, self.refs = [], [], []
        self.g = dp_rank
        self.tokens_in, self.tokens_cropped = 0, 0
        self.epoch = 1
        if state is not None:
            self._restore(state)

    # --- reading ----------------------------------------------------------------

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

    def _pop(self, i):
        self.lengths.pop(i)
        return self.docs.pop(i), self.refs.pop(i)

    def _refill(self):
        reads = 0  # at most N row groups per refill: data with little text cannot fill the buffer
        while len(self.docs) < self.buffer_docs and reads < self.N:
            for row, tokens in self._tokenize_rows(self.g).items():
                self._insert(tokens, (self.g, row, 0))
                self.tokens_in += len(tokens)
            self.g += self.dp_size
            reads += 1
        if not self.docs:
            raise no_text_error(self.files)

    # --- packing ----------------------------------------------------------------

    def next_block(self):
        """A (B, T+1) int32 array, every row starting with <|bos|>."""
        block = np.empty((self.B, self.T + 1), dtype=np.int32)
        for b in range(self.B):
            pos = 0
            while pos < self.T + 1:
                self._refill()
                space = self.T + 1 - pos
                i = bisect.bisect_right(self.lengths, space) - 1  # the largest document that fits
                if i >= 0:
                    tokens, (g, _, _) = self._pop(i)
                    block[b, pos:pos + len(tokens)] = tokens
                    pos += len(tokens)
                else:  # nothing fits: crop the shortest document to fill the row exactly
                    tokens, (g, row, offset) = self._pop(0)
                    block[b, pos:] = tokens[:space]
                    pos += space
                    rest = len(tokens) - space
                    if self.keep_remainder:
                        # piece(o) = [bos] + doc[1 + o:]; taking `space` tokens of piece(o) leaves piece(o + space - 1)
                        new_offset = offset + space - 1
                        self._insert(np.concatenate([[self.bos], tokens[space:]]).astype(np.int32), (g, row, new_offset))
                        self.tokens_in += 1  # the new bos
                    else:
                        self.tokens_cropped += rest
                self.epoch = max(self.epoch, g // self.N + 1)  # the newest epoch whose data was packed
        return block

    # --- state ------------------------------------------------------------------

    def state(self):
        return {"g": self.g, "buffer": [list(r) for r in self.refs], "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "epoch": self.epoch, "tokens_in": self.tokens_in, "tokens_cropped": self.tokens_cropped}

    def _restore(self, state):
        self.g = state["g"]
        self.epoch = state.get("epoch", 1)
        self.tokens_in, self.tokens_cropped = state.get("tokens_in", 0), state.get("tokens_cropped", 0)
        by_g = {}
        for g, row, _ in state["buffer"]:
            by_g.setdefault(g, []).append(row)
        tokenized = {g: self._tokenize_rows(g, rows) for g, rows in by_g.items()}
        for g, row, offset in state["buffer"]:  # saved in sorted order: re-inserting keeps ties in order
            full = tokenized[g][row]
            tokens = full if offset == 0 else np.concatenate([[self.bos], full[1 + offset:]]).astype(np.int32)
            self._insert(tokens, (g, row, offset))

    @property
    def crop_fraction(self):
        return self.tokens_cropped / max(1, self.tokens_in)


def reshard_states(states, new_dp_size):
    """Turn the per-rank states saved at one DP size into states for another: continue after the
    furthest row group any rank had read, and share the buffered documents out round-robin.
    No states (a checkpoint from before the first step) means fresh loaders."""
    states = [s for s in states if s is not None]
    if not states:
        return [None] * new_dp_size
    old = len(states)
    if old == new_dp_size:
        return [dict(s) for s in states]
    start = max(s["g"] for s in states) - old + 1  # every row group below this was read, or is skipped
    refs = [ref for s in states for ref in s["buffer"]]
    refs.sort(key=lambda r: (r[0], r[1], r[2]))
    new_states = []
    for r in range(new_dp_size):
        mine = refs[r::new_dp_size]
        new_states.append({"g": start + r, "buffer": mine, "dp_rank": r, "dp_size": new_dp_size,
                           "epoch": max(s.get("epoch", 1) for s in states),
                           "tokens_in": sum(s.get("tokens_in", 0) for s in states) // new_dp_size,
                           "tokens_cropped": sum(s.get("tokens_cropped", 0) for s in states) // new_dp_size})
    return new_states


class DataLoader:
    """Yields (inputs, targets, state) forever: (B, T) int64 tensors on `device` and the state after
    this batch. A background thread packs the next batches while the model computes; close() stops it
    (also at interpreter exit) so no native call is cut off mid-way."""

    def __init__(self, tokenizer, B, T, split, device, data_dir=None, dp_rank=0, dp_size=1, state=None,
                 keep_remainder=False, prefetch=2, buffer_docs=512):
        self.packer = BestFitPacker(tokenizer, B, T, split, data_dir, dp_rank, dp_size,
                                    buffer_docs=buffer_docs, keep_remainder=keep_remainder, state=state)
        self.device = torch.device(device) if isinstance(device, str) else device
        self.pin = self.device.type == "cuda"
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
                if self.pin:
                    block = block.pin_memory()
                stats = {"epoch": self.packer.epoch, "crop_fraction": self.packer.crop_fraction}
                self._put((block, self.packer.state(), stats))
        except BaseException as e:  # hand the error to the consumer instead of dying silently
            self._put(e)

    def _put(self, item):
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

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
