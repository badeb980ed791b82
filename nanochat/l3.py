"""
Large Lookup Layers (L3; Tseng & De Sa, arXiv 2601.21461): a per-token bank of learned rows, read with attention by
the hidden state, added residually between blocks (gpt.py: x = x + l3(x, idx)). Token t owns rows [start_t, end_t)
of one table E (n_emb x d), keys and values both (tied: as good as two tables at d12, faster; dev/LOG.md, 2026-11-21):

    a   = softmax(E_t x)                  no 1/sqrt(d) scale, as in the paper
    u   = LayerNorm(W_up (E_t^T a))       no affine (W_mix absorbs a gain)
    out = W_mix [u ; x]                   W_mix zero-initialized: a no-op at start
The table is sparse (each token touches its own rows) and goes to AdamW; W_up and W_mix to Muon.

Allocation (per the paper, a uniform split loses nearly all of the gain): LZW over L3_LZW_SAMPLE_TOKENS training
tokens, each new dictionary entry crediting its last token (every token starts with one credit); r_t = clamp(lambda
* credit_t, 1, k_max) with lambda bisected so that sum r_t = n_emb, then d_t = floor(r_t) and the rows left to the
largest fractional parts (ties: lower id). Deterministic; kept as cumulative bounds in a buffer.

The lookup, three ways:
- padded (CPU reference): gather (N, max d_t, d) rows, mask the padding, softmax, weighted sum; autograd.
- blocked (CPU when the padded gather is big or mostly padding; GPU with --kernels reference): sorted by token id, the
  score matrix is block-diagonal; runs of <= L3_BLOCK_POSITIONS sorted positions with rows in a window of < 2 k_max
  rows are each a small masked attention, batched (bmm) in chunks under L3_CHUNK_BYTES; the backward recomputes each
  chunk (the table gradient in fp32). On CUDA the same blocks run as Triton kernels (kernels/l3_lookup.py).
  The cutting up (_Plan, numpy) runs on the host from a copy of the ids; in training on a planner thread, for all of a
  step's micro-batches from its start (plans_made_ahead): the lookup neither waits for the GPU nor slows its feeder.

Parallelism: replicated over TP ranks (tensor_parallel.py says why); with sequence parallelism each rank looks up
its own tokens (`token_share`) and the optimizer sums the partial gradients over TP. Dtypes follow gpt.py: fp32
parameters, compute-dtype activations, fp32 softmax and table-gradient accumulation.
"""

import bisect
import itertools
import contextlib
import collections
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

from nanochat.kernels import KERNELS, Linear, l3_lookup
from nanochat.common import ConfigError, print0, eager

L3_LZW_SAMPLE_TOKENS = 10_000_000  # enough to estimate the credit of the few thousand tokens that own most rows
L3_LZW_MAX_ENTRIES = 1 << 22  # LZW dictionary cap; cleared when full. 2^22 entries ~ 0.5 GB of Python dict
L3_ROWS_PER_TOKEN = 16  # rows per vocabulary entry when n_emb == 0 (d12: 1.5 GiB fp32 a layer, 6 GiB with AdamW)
L3_BLOCK_POSITIONS = 64  # blocked path: sorted positions per block (the M of each block's score matmul)
L3_WIDTH_ALIGN = 16  # blocked path: a chunk's window width is padded to a multiple of this (extra rows masked out)
L3_CHUNK_BYTES = 512 << 20  # blocked path: most bytes of one chunk's gathered (rows, d) tensor, in the compute dtype
L3_PADDED_MAX_BYTES = 64 << 20  # padded path (CPU): while its (N, max d_t, d) gather is this small and pads little
L3_SPARE_ROWS = 1024  # blocked path: rows the padding slots' outputs go to, in turn (one shared row made writes queue)
_PLANNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanochat-l3-planner")  # plans_made_ahead's thread


def default_n_emb(vocab_size, k_max):
    return vocab_size * min(L3_ROWS_PER_TOKEN, k_max)


# ---- Allocation: LZW credits -> rows per token ----

def lzw_credits(tokens, vocab_size, max_entries=L3_LZW_MAX_ENTRIES):
    """Per token (int64): 1 + the new LZW dictionary entries (n-grams) ending with it, over `tokens`. Keys are prefix
    code * vocab + token (faster than tuples)."""
    tokens = np.asarray(tokens.cpu() if torch.is_tensor(tokens) else tokens, dtype=np.int64).reshape(-1)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{tokens.min()}, {tokens.max()}]")
    credits, table = [1] * vocab_size, {}
    next_code, limit = vocab_size, vocab_size + max_entries
    w = int(tokens[0]) if tokens.size else 0  # code of the current prefix; single tokens are their own codes
    step = 1 << 20  # tolist() a slice at a time: a list of 10M Python ints alone would take ~400 MB
    for lo in range(1, tokens.size, step):
        for c in tokens[lo:lo + step].tolist():
            key = w * vocab_size + c
            if (code := table.get(key)) is None:  # prefix + c is new: add it, credit its last token, restart from c
                table[key] = next_code
                next_code += 1
                credits[c] += 1
                w = c
                if next_code == limit:
                    table.clear()
                    next_code = vocab_size
            else:
                w = code
    return np.asarray(credits, dtype=np.int64)


def allocate_rows(credits, n_emb, k_max):
    """Rows per token d_t (int64 array) by the module docstring's rule: 1 <= d_t <= k_max, sum d_t == n_emb."""
    c = np.asarray(credits, dtype=np.float64)
    V = c.size
    if not V <= n_emb <= V * k_max:
        raise ValueError(f"L3 n_emb={n_emb:,} must lie in [vocab, vocab * k_max] = [{V:,}, {V * k_max:,}] "
                         f"(every token owns 1 to k_max={k_max} rows); change --l3-n-emb or --l3-k-max")
    if not (c > 0).all():
        raise ValueError("LZW credits must be positive (lzw_credits starts every token at 1)")
    # sum_t clamp(lam * c_t, 1, k_max) grows continuously from V (lam = 0) to V * k_max (lam = hi)
    lo, hi = 0.0, k_max / c.min()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if np.clip(mid * c, 1, k_max).sum() >= n_emb else (mid, hi)
    r = np.clip(hi * c, 1, k_max)  # sum(r) >= n_emb by a hair, so the rows left are <= the sum of the fractions
    d = np.floor(r).astype(np.int64)
    order = np.lexsort((np.arange(V), d - r))  # largest fractional part first, then lower token id
    d[order[:n_emb - int(d.sum())]] += 1
    return d


def uniform_rows(vocab_size, n_emb):
    return n_emb // vocab_size + (np.arange(vocab_size) < n_emb % vocab_size).astype(np.int64)


def sample_training_tokens(tokenizer, data_dir, n_tokens):
    """The first n_tokens (all, if fewer) of the training shards, int32: documents in order, each after a <|bos|>."""
    from nanochat.dataset import iter_documents, split_files, resolve_data_dir
    docs = iter_documents(split_files(resolve_data_dir(data_dir, quiet=True), "train"))
    parts, total = [], 0
    while total < n_tokens and (batch := list(itertools.islice(docs, 64))):
        for ids in tokenizer.encode(batch, prepend=tokenizer.get_bos_token_id()):
            parts.append(np.asarray(ids, dtype=np.int32))
            total += len(ids)
    return np.concatenate(parts)[:n_tokens] if parts else np.zeros(0, dtype=np.int32)


def allocate_for_model(model, tokenizer, data_dir, layout, sample_tokens=L3_LZW_SAMPLE_TOKENS):
    """Compute the LZW allocation on global rank 0 from the training shards; broadcast it to every L3 layer."""
    layers = list(model.l3.values())
    if not layers:
        return
    V, n_emb, k_max = layers[0].vocab_size, layers[0].n_emb, layers[0].k_max
    if any((l.vocab_size, l.n_emb, l.k_max) != (V, n_emb, k_max) for l in layers):
        raise ValueError("all L3 layers of a model must share vocab_size, n_emb and k_max (one allocation)")
    counts = torch.zeros(V, dtype=torch.int64, device=layers[0].bounds.device)
    mean_rows = torch.zeros(1, dtype=torch.float64, device=counts.device)
    if layout.rank == 0:
        t0 = time.time()
        tokens = sample_training_tokens(tokenizer, data_dir, sample_tokens)
        if tokens.size < sample_tokens:
            print0(f"NOTICE: the training shards hold only {tokens.size:,} tokens; L3's LZW ran on all of them "
                   f"(L3_LZW_SAMPLE_TOKENS = {sample_tokens:,})")
        credits = lzw_credits(tokens, V)
        d = allocate_rows(credits, n_emb, k_max)
        counts.copy_(torch.from_numpy(d))
        mean_rows.fill_(float((np.bincount(tokens, minlength=V) * d).sum() / max(1, tokens.size)))
        top100 = np.sort(d)[::-1][:100].sum() / n_emb
        print0(f"L3 allocation: {tokens.size:,} training tokens (tokenized, LZW: {time.time() - t0:.1f}s), "
               f"{int(credits.sum()) - V:,} dictionary entries; {n_emb:,} rows over {V:,} tokens, k_max {k_max}")
        print0(f"L3 rows per token: min {d.min()}, median {np.median(d):g}, max {d.max()}; "
               f"top-100 tokens hold {100 * top100:.1f}% of the table; {(d == k_max).sum()} tokens at k_max; "
               f"a training token reads {mean_rows.item():.1f} rows on average")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(counts, src=0)
        dist.broadcast(mean_rows, src=0)
    for layer in layers:
        layer.set_allocation(counts, mean_rows.item())


# ---- The lookup h = E_t^T softmax(E_t x): padded and blocked (Triton's kernels: kernels/l3_lookup.py) ----

def lookup_padded(x, ids, table, bounds):
    """x (N, d), ids (N,) -> h (N, d). Padding slots read row 0 with weight exactly 0: they add no gradient to it."""
    start = bounds[ids]
    count = bounds[ids + 1] - start
    slot = torch.arange(int(count.max()), device=x.device)
    valid = slot < count[:, None]
    rows = table[torch.where(valid, start[:, None] + slot, 0)].to(x.dtype)  # gathered first: its gradient sums in fp32
    scores = (rows @ x.unsqueeze(-1)).squeeze(-1).to(torch.promote_types(x.dtype, torch.float32))
    a = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return (a.to(x.dtype).unsqueeze(1) @ rows).squeeze(1)


class _Plan:
    """One batch cut up on the host (numpy; in training on the planner thread), then moved to the device in one copy.
    Positions sorted by token id (`order`) are cut into blocks of a few sorted positions whose rows lie in one window:
    block b holds sorted positions slot[b] (padding repeats its first, and `target` sends its output to one of
    L3_SPARE_ROWS rows after the n positions') and reads rows lo[b] + [0, width), of which slot s owns [rel_start,
    rel_end). Blocks come widest first: a chunk (i, j, w) of blocks [i, j), padded to width w, slices every array."""

    def __init__(self, ids, bounds, block, window, pin=False):
        n = ids.size
        self.n, self.block = n, block
        self.fingerprint = int(ids.astype(np.int64) @ np.arange(1, n + 1))  # which ids: lookup checks it
        # a stable sort of 16-bit keys is a radix sort in numpy (~10x a 64-bit one's speed at 64K positions)
        order = np.argsort(ids.astype(np.uint16) if len(bounds) <= 1 << 16 else ids, kind="stable")
        sid = ids[order]
        start, end = bounds[sid], bounds[sid + 1]
        # groups of `block` sorted positions, split where a first row moves into the next window-sized stretch after
        # the group's first row; window >= every token's row count (k_max), so a block's rows span < 2 windows
        group = np.arange(n) // block
        stretch = (start - start[group * block]) // window
        new = np.ones(n, dtype=bool)
        new[1:] = (group[1:] != group[:-1]) | (stretch[1:] != stretch[:-1])
        first = np.flatnonzero(new)
        count = np.diff(first, append=n)
        width = end[first + count - 1] - start[first]  # ends are sorted: the last one is the max
        by_width = np.argsort(-width, kind="stable")
        first, count, lo = first[by_width], count[by_width], start[first[by_width]]
        self.widths = width[by_width].tolist()
        valid = np.arange(block) < count[:, None]
        slot = first[:, None] + np.where(valid, np.arange(block), 0)
        target = np.where(valid, slot, n + np.arange(slot.size).reshape(slot.shape) % L3_SPARE_ROWS)
        klo, wpad, off, base, self.scratch = l3_lookup.scratch_layout(first, count, lo, width[by_width], block)
        parts = [order, slot, target, start[slot] - lo[:, None], end[slot] - lo[:, None], lo, start, end, first, count,
                 klo, wpad, off, base]
        self.packed = torch.from_numpy(np.concatenate([p.ravel() for p in parts]).astype(np.int64))
        self.packed = self.packed.pin_memory() if pin else self.packed  # pinned: queued behind the GPU's work
        self.sizes, self.on_device = [p.size for p in parts], None

    def to(self, device):
        """(order, slot, target, rel_start, rel_end, lo, and for the Triton kernels each sorted position's rows start,
        end, each block's first, count, klo, wpad, off, and each position's base) on `device`, copied once (the
        layers of a model share it)."""
        if self.on_device is None:
            parts = torch.split(self.packed.to(device, non_blocking=True), self.sizes)
            self.on_device = [p.view(-1, self.block) if 0 < i < 5 else p for i, p in enumerate(parts)]
        return self.on_device

    def chunks(self, max_rows):
        """(i, j, w): blocks [i, j) gathering <= max_rows rows (blocks x max(w, block)), widths within 2x of the
        chunk's widest (padding at most doubles the work); w a multiple of L3_WIDTH_ALIGN (Hopper: 16-byte rows)."""
        widths, chunks, i = self.widths, [], 0
        ascending = [-w for w in widths]
        while i < len(widths):
            w = -(-widths[i] // L3_WIDTH_ALIGN) * L3_WIDTH_ALIGN
            j = min(i + max(1, max_rows // max(w, self.block)), bisect.bisect_right(ascending, -widths[i] / 2))
            chunks.append((i, j, w))
            i = j
        return chunks


def _block_attention(xb, kb, mask, acc):
    """softmax over each slot's own rows, in fp32 (`acc`) from the compute dtype's scores."""
    return torch.softmax(torch.where(mask, torch.bmm(xb, kb.transpose(1, 2)), float("-inf")), dim=-1, dtype=acc)


class _BlockedLookup(torch.autograd.Function):
    """h = E_t^T softmax(E_t x) by blocks of sorted positions (_Plan); the backward recomputes each chunk's softmax.
    tc: the table in x's dtype (L3Layer.table_in: one cast of the table beats casting the larger gathered blocks)."""

    @staticmethod
    def forward(ctx, x, table, tc, plan, chunk_bytes, sum_into):
        acc = torch.promote_types(x.dtype, torch.float32)
        order, slot, target, rel_start, rel_end, lo = plan.to(x.device)[:6]
        # rows a chunk may gather: a row costs its channels, or its column of fp32 scores (block entries) if more
        chunks = plan.chunks(max(1, chunk_bytes // max(table.size(1) * x.element_size(), 4 * plan.block)))
        xs = x.index_select(0, order)
        hs = x.new_empty(x.size(0) + L3_SPARE_ROWS, tc.size(1))  # + the padding slots' rows
        span, saved = torch.arange(chunks[0][2] if chunks else 0, device=x.device), []
        for i, j, w in chunks:
            rows = (lo[i:j, None] + span[:w]).clamp_(max=tc.size(0) - 1)  # the window; past the table's end: masked
            mask = (span[:w] >= rel_start[i:j, :, None]) & (span[:w] < rel_end[i:j, :, None])
            eb = tc[rows]
            a = _block_attention(xs[slot[i:j]], eb, mask, acc)
            hs.index_copy_(0, target[i:j].flatten(), torch.bmm(a.to(x.dtype), eb).flatten(0, 1))
            saved += [slot[i:j], target[i:j].flatten(), rows, mask]
        # the plan's tensors as saved tensors, so that autograd frees them after the backward (not ctx's attributes)
        ctx.save_for_backward(xs, tc, order, *saved)
        ctx.table_dtype = table.dtype
        ctx.param = sum_into  # in a training step: the table parameter whose .grad the backward sums into in place
        return torch.empty_like(x).index_copy_(0, order, hs[:x.size(0)])

    @staticmethod
    def backward(ctx, grad_h):
        xs, tc, order, *flat = ctx.saved_tensors
        chunks = [flat[i:i + 4] for i in range(0, len(flat), 4)]  # (slot, target, rows, mask) each
        acc = torch.promote_types(xs.dtype, torch.float32)
        gs = F.pad(grad_h.to(xs.dtype).index_select(0, order), (0, 0, 0, L3_SPARE_ROWS))  # padding slots read zeros
        dxs = xs.new_empty(xs.size(0) + L3_SPARE_ROWS, xs.size(1))  # + the padding slots' rows
        # fp32 table gradient: an unchecked (rows clamped) index_put summing duplicates in order (index_add_: slower)
        de = l3_lookup.table_gradient(ctx.param, tc, acc)
        for slot, target, rows, mask in chunks:
            xb, eb, gb = xs[slot], tc[rows], gs[target].view(*slot.shape, -1)
            a = _block_attention(xb, eb, mask, acc)
            da = torch.bmm(gb, eb.transpose(1, 2)).to(acc)
            ds = torch.ops.aten._softmax_backward_data(da, a, -1, acc).to(xs.dtype)  # a (da - sum(a da)), one pass
            dxs.index_copy_(0, target, torch.bmm(ds, eb).flatten(0, 1))
            # a row's gradient as a key and as a value, ds^T x + a^T g, summed inside one bmm (K = 2 block); on CUDA
            # in fp32 straight from the accumulators (a bf16 product cast moved 6 GB more a micro-batch at d12)
            lhs, rhs = torch.cat([ds, a.to(xs.dtype)], dim=1).transpose(1, 2), torch.cat([xb, gb], dim=1)
            grad_rows = (torch.bmm(lhs, rhs, out_dtype=acc) if lhs.is_cuda and lhs.dtype != acc else
                         torch.bmm(lhs, rhs).to(acc)).flatten(0, 1)
            torch.ops.aten._index_put_impl_(de, (rows.flatten(),), grad_rows, accumulate=True, unsafe=True)
        dx = torch.empty_like(xs).index_copy_(0, order, dxs[:xs.size(0)])
        return dx, de.to(ctx.table_dtype), None, None, None, None


def choose_path(x, ids, bounds):
    """"blocked" on CUDA; on CPU "padded" while its gather is <= L3_PADDED_MAX_BYTES and <= 1.5x the useful rows."""
    if x.is_cuda or ids.numel() == 0:  # (an empty batch has no widest token to pad to)
        return "blocked"
    count = bounds[ids + 1] - bounds[ids]
    padded_slots = ids.numel() * int(count.max())
    small = padded_slots * x.size(1) * x.element_size() <= L3_PADDED_MAX_BYTES
    return "padded" if small and 2 * padded_slots <= 3 * int(count.sum()) else "blocked"


# ---- The layer ----

class L3Layer(nn.Module):
    def __init__(self, vocab_size, d_model, n_emb, d_up=None, k_max=512):
        super().__init__()
        d_up = d_up or 4 * d_model  # 0: a config saved before --l3-d-up's default became the width (recipe.py)
        if k_max < 1 or d_up < 1:  # ConfigError: one line naming the flag, from base_train too
            raise ConfigError(f"--l3-k-max {k_max} and --l3-d-up {d_up} must be positive (--l3-d-up 0: the width)")
        if not vocab_size <= n_emb <= vocab_size * k_max:
            raise ConfigError(f"L3 n_emb={n_emb:,} must lie in [vocab, vocab * k_max] = [{vocab_size:,}, "
                              f"{vocab_size * k_max:,}]; change --l3-n-emb or --l3-k-max")
        self.vocab_size, self.d_model, self.n_emb, self.d_up, self.k_max = vocab_size, d_model, n_emb, d_up, k_max
        self.key_table = nn.Parameter(torch.empty(n_emb, d_model))  # the keys, and the values
        self.w_up = Linear(d_model, d_up)
        self.w_mix = Linear(d_up + d_model, d_model)
        # token t owns rows bounds[t]:bounds[t+1]; saved in checkpoints (the allocation is data-derived)
        self.register_buffer("bounds", torch.zeros(vocab_size + 1, dtype=torch.int64))
        # mean rows a training token reads (token-frequency-weighted): what estimate_flops charges
        self.register_buffer("rows_per_token", torch.zeros((), dtype=torch.float32))
        self.path = "auto"  # or "blocked" / "padded", to force one (tests, benchmarks)
        self.token_share = nn.Identity()  # sequence parallelism swaps in this rank's share of the token ids
        self.plans_ahead = collections.deque()  # Futures from plan_ahead; a lookup takes the first
        self.bounds_on_host = (None, None)  # (the buffer's identity and version, a numpy copy)
        self.step_casts = None  # in a training step (plans_made_ahead): the table's casts, made once for the step

    @classmethod
    def from_config(cls, config):
        n_emb = config.l3_n_emb or default_n_emb(config.vocab_size, config.l3_k_max)
        return cls(config.vocab_size, config.n_embd, n_emb, d_up=config.l3_d_up, k_max=config.l3_k_max)

    @torch.no_grad()
    def init_weights(self):
        """Table and W_up uniform, std 1/sqrt(d): scores E_t x start with std ~ rms(x), soft but not flat (as values
        their scale is free: a LayerNorm follows W_up). W_mix zero. Uniform allocation until allocate_for_model."""
        s = math.sqrt(3) / math.sqrt(self.d_model)
        nn.init.uniform_(self.key_table, -s, s)
        nn.init.uniform_(self.w_up.weight, -s, s)
        nn.init.zeros_(self.w_mix.weight)
        rows = uniform_rows(self.vocab_size, self.n_emb)
        self.set_allocation(rows, float((rows * rows).sum() / self.n_emb))  # ~n_emb / vocab rows per token

    @torch.no_grad()
    def set_allocation(self, rows, rows_per_token):
        rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
        if rows.shape != (self.vocab_size,) or rows.sum() != self.n_emb or rows.min() < 1 or rows.max() > self.k_max:
            raise ValueError(f"an L3 allocation needs {self.vocab_size} entries in [1, {self.k_max}] summing to "
                             f"{self.n_emb}; got shape {tuple(rows.shape)}, sum {int(rows.sum())}, "
                             f"range [{int(rows.min())}, {int(rows.max())}]")
        self.bounds.copy_(F.pad(torch.cumsum(rows, 0), (1, 0)))
        self.rows_per_token.fill_(rows_per_token)

    def table_parameters(self):
        return [self.key_table]

    def dense_parameters(self):
        return [self.w_up.weight, self.w_mix.weight]

    def estimate_flops(self):
        """Useful training FLOPs per token: 6 * (W_up + W_mix params) + 12 r d, r the mean rows a training token reads
        (scores and mix 2 r d each forward, twice that backward; k_max on the meta device); masked tiles not counted."""
        r = self.k_max if self.rows_per_token.is_meta else float(self.rows_per_token)
        return 6 * sum(p.numel() for p in self.dense_parameters()) + 12 * r * self.d_model

    def plan_ahead(self, idx):
        """A Future of the plan (_Plan) of a forward's lookup: the copy of this rank's share of the ids to the host is
        queued now, behind the GPU's work; the planner thread waits for it and plans while this one queues more (a copy
        at the lookup, as in evaluation and sampling, drains the queue and idles the GPU while the host plans)."""
        ids = self.token_share(idx).reshape(-1)
        bounds, done = self.host_bounds(), None
        if ids.is_cuda:
            ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True).copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        def plan():
            if done is not None:
                done.synchronize()
            return _Plan(ids.numpy(), bounds, L3_BLOCK_POSITIONS, self.k_max, pin=done is not None)
        return _PLANNER.submit(plan)

    def host_bounds(self):
        """bounds as a numpy array, copied again only after the buffer changed (an allocation, a loaded checkpoint)."""
        key = (self.bounds.data_ptr(), self.bounds._version)
        if self.bounds_on_host[0] != key:
            self.bounds_on_host = (key, self.bounds.cpu().numpy())
        return self.bounds_on_host[1]

    @eager  # data-dependent sizes; W_up, the LayerNorm and W_mix around it compile
    def lookup(self, x, ids):
        """h = E_t^T softmax(E_t x) for x (N, d), ids (N,) -> (N, d) in x.dtype."""
        plan = self.plans_ahead.popleft().result() if self.plans_ahead else None  # taken whichever path runs
        if plan is not None and plan.n != ids.numel():
            raise RuntimeError(f"L3: the lookup planned ahead ({plan.n} ids) is not this lookup's ({ids.numel()}): "
                               f"forwards ran out of the order their plans were queued in")
        if plan is not None:  # as many ids, but the same ones? Checked on the device: no wait for it
            torch._assert_async((ids * torch.arange(1, ids.numel() + 1, device=ids.device)).sum() == plan.fingerprint,
                                "L3: the lookup planned ahead is of other ids: forwards ran out of their plans' order")
        path = choose_path(x, ids, self.bounds) if self.path == "auto" else self.path
        if path == "padded":
            return lookup_padded(x, ids, self.key_table, self.bounds)
        plan = plan or _Plan(ids.cpu().numpy(), self.host_bounds(), L3_BLOCK_POSITIONS, self.k_max, pin=x.is_cuda)
        sum_into = self.key_table if self.step_casts is not None and self.key_table.is_leaf else None  # in a step
        if KERNELS.on and l3_lookup.supported(x):
            return l3_lookup.Lookup.apply(x, self.key_table, self.table_in(x.dtype), plan, sum_into)
        return _BlockedLookup.apply(x, self.key_table, self.table_in(x.dtype), plan, L3_CHUNK_BYTES, sum_into)

    def table_in(self, dtype):
        """The table in `dtype` for the blocked lookup: cast once a training step (the optimizer changes it only between
        steps; 0.86 ms a cast at d12), else at each call; never kept when gathered (sharded: not a leaf)."""
        if self.step_casts is None or not self.key_table.is_leaf:
            return self.key_table.detach().to(dtype)
        key = (dtype, self.key_table.data_ptr())  # a tensor swapped in for the parameter gets a cast of its own
        if key not in self.step_casts:
            self.step_casts[key] = self.key_table.detach().to(dtype)
        return self.step_casts[key]

    def forward(self, x, idx):
        """x (B, T, d) hidden states, idx (B, T) token ids -> (B, T, d) to add to the residual stream."""
        idx = self.token_share(idx)
        B, T, d = x.shape
        h = self.lookup(x.reshape(B * T, d), idx.reshape(B * T).long()).view(B, T, d)
        u = F.layer_norm(self.w_up(h), (self.d_up,))
        return self.w_mix(torch.cat([u, x], dim=-1))


def plan_lookups(layers, idx):
    """Queue one plan of a forward's lookups for each of `layers` (idx: this rank's (B, T) ids): they see the same ids
    (the same share under sequence parallelism) and share one allocation (allocate_for_model)."""
    plan = layers[0].plan_ahead(idx)
    for layer in layers:
        layer.plans_ahead.append(plan)


@contextlib.contextmanager
def plans_made_ahead(model, inputs):
    """A training step: every micro-batch's lookup (inputs, the (B, T) micro-batches) is planned on the planner thread
    from its start, its ids' copy queued behind the loader's copies to the GPU, so that no lookup in the step drains
    the GPU's queue or plans on this thread; each L3 layer's forwards take the plans in order, and must take them all.
    A pipeline stage that reads no data (inputs None) plans each chunk's from the ids it receives (Pipeline.forward)."""
    layers = list(model.l3.values())
    for idx in inputs if layers else []:
        if idx is not None:
            plan_lookups(layers, model.sequence.local(idx))
    for layer in layers:
        layer.step_casts = {}  # the table cast once for the step (L3Layer.table_in), its gradient summed in place
    try:
        yield
        if any(layer.plans_ahead for layer in layers):
            raise RuntimeError("L3: a training step left micro-batch plans untaken (fewer lookups than micro-batches)")
    finally:
        for layer in layers:
            layer.plans_ahead.clear()
            layer.step_casts = None
