"""
Context parallelism: each sequence of a micro-batch cut along its length over the N ranks of a CP group, for
sequences whose activations one GPU cannot hold. A ContextParallel is the model's sequence view (gpt.WholeSequence
at `model.sequence`, set by training.setup); CORE and sampling run the same weights over whole sequences.

Collectives, over the CP group, per attention layer (--cp-exchange all-gather, the default above CP 2):
  all_gather         forward: every rank's K/V (one tensor), while this rank's diagonal blocks run
  all_gather         backward: the same again (not kept from the forward: a whole sequence's K/V per layer; kept,
                     the d20 32K CP 4 step was no faster, dev/LOG.md 2026-11-28)
  reduce_scatter     backward: dK/dV of the whole sequence (in K/V's dtype) -> this rank's, behind its diagonals
or with --cp-exchange ring (point to point; the default at CP 2):
  batch_isend_irecv  forward, per ring step s: this rank's K/V (one tensor) to rank r+s, rank r-s's into a buffer
  batch_isend_irecv  backward, per step: the same K/V; then the dK/dV of rank r-s's block sent home to it, and this
                     block's received from rank r+s
and for evaluation:
  all_gather         per-token losses (loss_reduction="none")

Head-tail load balance: the T tokens are cut into 2N chunks of c = T/2N, rank r holding chunks r and 2N-1-r side by
side, so that under causal attention every rank attends to as many keys (attention_work). Only rotary (global
positions), the smear of the token before (embedded here from the whole ids every CP rank holds: no message) and the
loss's scale see the cut (ContextParallel's methods); all else in the model is per token.

Attention is one custom op, so that torch.compile keeps its messages out of its graphs. Blocks of queries x keys
merge by their log-sum-exp, in fp32. The all-gather runs each query chunk over at most three blocks (key_spans;
two with FlashAttention-4, which takes any band: its diagonal, and every key before it that some query sees);
the ring, only pairs of chunks where some key is visible (never the future, never `window` or more back), each
block sent straight to the rank that needs it (on NVLink a shift by s costs what a shift by one does) and its dK/dV
straight home. On four H200s at 32K tokens, SSSL, CP 4, the all-gather trained 1.08x as fast as the ring at d12 and
d20 (the ring's N-1 dependent steps in fewer, larger kernels); at CP 2 the ring was 1.03x as fast (d12, twice), and
the two tie since the all-gather's reorder copies went (dev/LOG.md, 2026-11-28): the ring keeps CP 2 for the
memory it saves (no gathered K/V). Hence the defaults.
"""

import torch
from torch import Tensor
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nanochat import kernels
from nanochat.distributed import all_gather_single, reduce_scatter_single, wait_for
from nanochat.gpt import WholeSequence
from nanochat.kernels.sdpa import band_mask, expand_heads, sum_heads

CONTEXTS = []  # every ContextParallel made in this process; the custom ops name theirs by index


def rank_chunks(rank, size):  # head-tail
    return rank, 2 * size - 1 - rank


def block_offset(q_chunk, k_chunk, chunk):
    """How far the first query of chunk q_chunk sits after the first key of chunk k_chunk."""
    return (q_chunk - k_chunk) * chunk


def block_visible(offset, chunk, window):
    """Whether some key of a (chunk x chunk) block `offset` back is visible (not all future, not all `window`+ back)."""
    return offset >= 0 and offset - (chunk - 1) < window


def attention_work(rank, size, sequence_len, window):
    """Query-key pairs rank `rank` attends to (one head, one sequence): equal on every rank (head-tail)."""
    c = sequence_len // (2 * size)
    offsets = [block_offset(a, b, c) for a in rank_chunks(rank, size) for b in range(2 * size)]
    return sum(int(band_mask(c, c, o, window, "cpu").sum()) for o in offsets if block_visible(o, c, window))


# --- the reference math of one block (what kernels.attention_block computes) ------------------------------------
def block_attention(q, k, v, offset, window):
    """q (B, Hq, c, D) over keys k/v (B, Hkv, c, D) `offset` tokens back: (out, lse (B, Hq, c) fp32); math in fp32."""
    if kernels.takes_attention_block(q, k, offset, window):
        return kernels.attention_block(q, k, v, offset, window)
    k, v = expand_heads(q, k, v)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~band_mask(q.size(2), k.size(2), offset, window, q.device), float("-inf"))
    lse = scores.logsumexp(-1)  # -inf where a query sees none of these keys (a band's corner): its output is 0
    return ((scores - finite(lse).unsqueeze(-1)).exp() @ v.float()).to(q.dtype), lse


def block_attention_backward(dout, q, k, v, out, lse, offset, window):
    """(dq, dk, dv) of one block from the merged output and log-sum-exp of all blocks: with those, the block's
    probabilities are already the whole row's softmax, and each gradient is this block's share of the total."""
    if kernels.takes_attention_block(q, k, offset, window):
        return kernels.attention_block_backward(dout, q, k, v, out, lse, offset, window)
    kv_heads, scale = k.size(1), q.size(-1) ** -0.5
    k, v = expand_heads(q, k, v)
    qf, kf, vf, doutf = q.float(), k.float(), v.float(), dout.float()
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~band_mask(q.size(2), k.size(2), offset, window, q.device), float("-inf"))
    probs = (scores - lse.unsqueeze(-1)).exp()
    dv = probs.transpose(-1, -2) @ doutf
    dscores = probs * (doutf @ vf.transpose(-1, -2) - (doutf * out.float()).sum(-1, keepdim=True))
    return sum_heads(kv_heads, (dscores @ kf) * scale, (dscores.transpose(-1, -2) @ qf) * scale, dv)


# --- this rank's share of the sequence -------------------------------------------------------------------------
class ContextParallel(WholeSequence):
    """This rank's chunks of each sequence; --recompute selective keeps CP attention (a rerun would exchange again)."""

    def __init__(self, layout, sequence_len, device, exchange):
        if exchange not in ("all-gather", "ring"):
            raise ValueError(f"context parallelism exchanges K/V by 'all-gather' or 'ring', not {exchange!r}")
        self.layout, self.size, self.rank, self.exchange = layout, layout.cp_size, layout.cp_rank, exchange
        self.sequence_len, self.chunk = sequence_len, sequence_len // (2 * layout.cp_size)
        self.chunks = rank_chunks(self.rank, self.size)
        self.positions = self.positions_of(self.rank).to(device)
        # where every rank's tokens sit, in the order an all-gather stacks them (for the gathered losses)
        self.gather_order = torch.cat([self.positions_of(r) for r in range(self.size)]).argsort().to(device)
        self.schedules = {}  # window -> [(step, receive, send)]
        self.id = len(CONTEXTS)
        CONTEXTS.append(self)

    def positions_of(self, rank):
        c = self.chunk
        return torch.cat([torch.arange(k * c, (k + 1) * c) for k in rank_chunks(rank, self.size)])

    def local(self, t):
        """This rank's tokens of (B, T, ...) ids, targets or tables: (B, 2c, ...)."""
        if t.size(1) != self.sequence_len:
            raise ValueError(f"context parallelism cuts sequences of {self.sequence_len} tokens; got {t.size(1)}")
        return t.index_select(1, self.positions)

    @property
    def selective_keeps(self):
        return (torch.ops.nanochat.cp_attention.default,)

    def rotary(self, cos, sin, T):
        """The tables at this rank's chunks' global positions."""
        return cos.index_select(1, self.positions), sin.index_select(1, self.positions)

    def previous(self, x, idx, embed):
        """For each of this rank's tokens, the embedding of the token before it (zeros before position 0): inside a
        chunk its neighbour in x, at a chunk's start the token before it in idx, embedded here by `embed`."""
        c, parts = self.chunk, []
        for j, chunk in enumerate(self.chunks):
            start = chunk * c
            before = embed(idx[:, start - 1:start]) if start > 0 else torch.zeros_like(x[:, :1])
            parts += [before, x[:, j * c:(j + 1) * c - 1]]
        return torch.cat(parts, dim=1)

    def attend(self, layer_idx, q, k, v, window):
        """This rank's queries q (B, Hq, 2c, D) over the whole sequence's keys (k/v (B, Hkv, 2c, D) here)."""
        return cp_attention(q, k, v, window, self.id)[0]

    def loss(self, criterion, x, lm_head, targets, reduction):
        """Loss on this rank's tokens of the (B, T) targets. "mean": this rank's sum x N / all target tokens (its CP
        mean is the whole mean); "none": every token's loss (B, T), all-gathered over CP (evaluation); "sum": mine."""
        mine = self.local(targets)
        if reduction == "mean":
            return criterion(x, lm_head, mine, "sum") * self.size / (targets != -1).sum()
        losses = criterion(x, lm_head, mine, reduction)
        if reduction == "sum":
            return losses
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(losses.contiguous(), 0, self.layout.cp_group))
        B = losses.size(0)
        return gathered.view(self.size, B, -1).transpose(0, 1).reshape(B, -1).index_select(1, self.gather_order)

    # --- the ring ----------------------------------------------------------------------------------------------
    def visible_pairs(self, q_rank, k_rank, window):
        """[(a, b, offset)]: q_rank's query chunk a (0 or 1) sees some keys of k_rank's chunk b, offset apart."""
        pairs = [(a, b, block_offset(qc, kc, self.chunk)) for a, qc in enumerate(rank_chunks(q_rank, self.size))
                 for b, kc in enumerate(rank_chunks(k_rank, self.size))]
        return [(a, b, offset) for a, b, offset in pairs if block_visible(offset, self.chunk, window)]

    def schedule(self, window):
        """[(step, receive, send)], s = 1 .. N-1: whether rank r-s's K/V are needed here, and this rank's at r+s.
        Every rank posts in this order, so two messages between one pair (K/V, then dK/dV back) match in order."""
        if window not in self.schedules:
            N, r = self.size, self.rank
            self.schedules[window] = [(s, bool(self.visible_pairs(r, (r - s) % N, window)),
                                       bool(self.visible_pairs((r + s) % N, r, window))) for s in range(1, N)]
        return self.schedules[window]

    def _exchange(self, tensor, step, receive, send, like=None):
        """Post step's messages: `tensor` to rank r+step, a buffer like it (or `like`) from rank r-step: (the requests,
        the buffer or None), for wait_for. A negative step runs the ring backwards (the dK/dV going home)."""
        ops, buffer = [], None
        if send:
            ops.append(dist.P2POp(dist.isend, tensor, self.layout.peer(cp=(self.rank + step) % self.size)))
        if receive:
            buffer = torch.empty_like(tensor if like is None else like)
            ops.append(dist.P2POp(dist.irecv, buffer, self.layout.peer(cp=(self.rank - step) % self.size)))
        return (dist.batch_isend_irecv(ops) if ops else []), buffer

    def _halves(self, t):
        return t[:, :, :self.chunk], t[:, :, self.chunk:]

    def _copied_halves(self, t):
        """Halves that several blocks read: copied once where cuDNN takes them (contiguous inputs, sdpa.py);
        FlashAttention-4 reads 16-bit ones in place."""
        return list(self._halves(t)) if kernels.block_bands(t) else [h.contiguous() for h in self._halves(t)]

    def _ring(self, mine, window):
        """(step, whether my K/V went to r+step, r-step's K/V or None) per step, own first; each posted a step ahead."""
        steps = self.schedule(window)
        pending = self._exchange(mine, *steps[0]) if steps else None
        yield 0, False, mine
        for i, (step, _, send) in enumerate(steps):
            buffer = wait_for(*pending)
            pending = self._exchange(mine, *steps[i + 1]) if i + 1 < len(steps) else None
            yield step, send, buffer

    def _merged(self, blocks, q):
        """(out in q's dtype, lse) of this rank's queries from each query chunk's blocks [(out, lse)], merged."""
        out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)  # contiguous, as the fake
        for a, parts in enumerate(blocks):
            for whole, part in zip((out, lse), merge(parts)):
                self._halves(whole)[a].copy_(part)
        return out, lse

    def ring_forward(self, q, k, v, window):
        """(out, lse) of this rank's queries over every visible block (their outputs held until the merge: at most a
        sequence's length of them, in the compute dtype)."""
        blocks, qs = [[], []], self._copied_halves(q)  # per query chunk: its blocks' (out, lse)
        for step, _, kv in self._ring(torch.stack([k, v]), window):  # K/V: one message per step
            for a, b, offset in self.visible_pairs(self.rank, (self.rank - step) % self.size, window):  # none without kv
                kb, vb = self._halves(kv[0])[b], self._halves(kv[1])[b]
                blocks[a].append(block_attention(qs[a], kb, vb, offset, window))
        return self._merged(blocks, q)

    def ring_backward(self, dout, q, k, v, out, lse, window):
        """(dq, dk, dv) from the gradient of the merged output."""
        qs, douts, outs, lses = (self._copied_halves(t) for t in (q, dout, out, lse))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = self._halves(dq)
        homecoming = []  # (requests, buffer): dK/dV of this rank's block from the ranks that used it
        for step, send, kv in self._ring(torch.stack([k, v]), window):
            # this rank's share of the gradients of rank r-step's block: into dq, and its dK/dV (fp32)
            dkv = None if kv is None else torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for a, b, offset in self.visible_pairs(self.rank, (self.rank - step) % self.size, window):  # none without kv
                kb, vb, dkb, dvb = (self._halves(t)[b] for t in (kv[0], kv[1], dkv[0], dkv[1]))
                grads = block_attention_backward(douts[a], qs[a], kb, vb, outs[a], lses[a], offset, window)
                for total, grad in zip((dqs[a], dkb, dvb), grads):
                    total.add_(grad)
            if step == 0:
                dkv_mine = dkv
            else:  # home: the dK/dV of rank r-s's block go back to it; this block's come from rank r+s (roles reversed)
                homecoming.append(self._exchange(dkv, -step, send, kv is not None, like=dkv_mine))
        for pair in homecoming:
            buffer = wait_for(*pair)
            if buffer is not None:
                dkv_mine += buffer
        # copies: a custom op's outputs may not alias each other (dK and dV share the buffer)
        return dq.to(q.dtype), dkv_mine[0].to(k.dtype, copy=True), dkv_mine[1].to(v.dtype, copy=True)

    # --- the all-gather: every rank's K/V at once, each query chunk over the keys it sees in at most three blocks --
    def key_spans(self, chunk, window, bands=False):
        """[(first key, end, offset)]: the keys query chunk `chunk` sees, as blocks the kernels take whole: its own
        chunk (causal), the keys before it that all its queries see (none), and those only some see: a chunk's length
        one window back (upper), or less where the sequence starts (a band); with `bands` (FlashAttention-4) all the
        keys before it as one band. Offset: first query - first key."""
        c, start = self.chunk, chunk * self.chunk
        all_see = max(0, start + c - window)  # keys from here to `start` are in every query's window
        spans = [(start, start + c, 0)]
        if bands:  # from the first key the first query sees
            first = max(0, start - window + 1)
            return spans + ([(first, start, start - first)] if first < start else [])
        some_see = max(0, start - window)
        if all_see < start:
            spans.append((all_see, start, start - all_see))
        if some_see < min(all_see, start):
            spans.append((some_see, min(all_see, start), start - some_see))
        return spans

    def _pieces(self, lo, hi):
        """Where keys lo .. hi-1 sit among every rank's (N, 2, B, Hkv, 2c, D), as [(rank, first, count)] in order."""
        c, N, pieces = self.chunk, self.size, []
        for chunk in range(lo // c, (hi - 1) // c + 1):
            first = max(lo, chunk * c)
            rank, half = (chunk, 0) if chunk < N else (2 * N - 1 - chunk, 1)  # head-tail: chunk r and 2N-1-r on rank r
            pieces.append((rank, half * c + first - chunk * c, min(hi, (chunk + 1) * c) - first))
        return pieces

    def _span(self, gathered, lo, hi):
        """K and V of keys lo .. hi-1, each contiguous (as the kernels take them), from every rank's gathered K/V."""
        kv = torch.cat([gathered[r, ..., first:first + n, :] for r, first, n in self._pieces(lo, hi)], dim=-2)
        return kv[0], kv[1]

    def _post_gather(self, kv):
        """Every rank's K/V (N, 2, B, Hkv, 2c, D), in rank order, and the all-gather's handle."""
        gathered = kv.new_empty((self.size * kv.size(0), *kv.shape[1:]))  # gloo wants every rank's along dim 0
        work = all_gather_single(gathered, kv, group=self.layout.cp_group, async_op=True)
        return gathered.view(self.size, *kv.shape), work

    def gather_forward(self, q, k, v, window):
        """(out, lse) of this rank's queries: own chunks' diagonals while every rank's K/V are gathered, then the rest."""
        qs, kv = self._copied_halves(q), torch.stack([k, v])
        gathered, work = self._post_gather(kv)
        bands = kernels.block_bands(q)
        blocks = [[block_attention(qa, ka, va, 0, window)]
                  for qa, ka, va in zip(qs, self._halves(kv[0]), self._halves(kv[1]))]
        work.wait()
        for a, chunk in enumerate(self.chunks):
            for lo, hi, offset in self.key_spans(chunk, window, bands)[1:]:
                blocks[a].append(block_attention(qs[a], *self._span(gathered, lo, hi), offset, window))
        return self._merged(blocks, q)

    def gather_backward(self, dout, q, k, v, out, lse, window):
        """(dq, dk, dv); dK/dV off the diagonals summed over CP by a reduce-scatter, behind the diagonals' backward."""
        qs, douts, outs, lses = (self._copied_halves(t) for t in (q, dout, out, lse))
        kv = torch.stack([k, v])
        gathered, work = self._post_gather(kv)
        bands = kernels.block_bands(q)
        work.wait()
        # every rank's dK/dV, as the reduce-scatter takes them, summed in K/V's dtype: a key's share from this rank
        # comes from at most two spans (one per query chunk), and adding two values rounds once, as an fp32 sum would
        by_rank = torch.zeros_like(gathered)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqs = self._halves(dq)
        for a, chunk in enumerate(self.chunks):
            for lo, hi, offset in self.key_spans(chunk, window, bands)[1:]:
                dq_a, *dkv_span = block_attention_backward(douts[a], qs[a], *self._span(gathered, lo, hi), outs[a],
                                                           lses[a], offset, window)
                dqs[a].add_(dq_a)
                at = 0
                for r, first, n in self._pieces(lo, hi):
                    for i, grad in enumerate(dkv_span):
                        by_rank[r, i, ..., first:first + n, :] += grad[..., at:at + n, :]
                    at += n
        del gathered
        dkv = by_rank.new_empty(by_rank.shape[1:])
        work = reduce_scatter_single(dkv, by_rank.flatten(0, 1), group=self.layout.cp_group, async_op=True)
        diagonal = [block_attention_backward(*args, 0, window)
                    for args in zip(douts, qs, self._halves(kv[0]), self._halves(kv[1]), outs, lses)]
        work.wait()
        for a, (dq_a, _, _) in enumerate(diagonal):
            dqs[a].add_(dq_a)
        # the diagonals' share added to the others' in one rounding (in K/V's dtype on a GPU, as an fp32 sum would)
        dk, dv = (torch.cat([d[1 + i] for d in diagonal], dim=2).add_(dkv[i]) for i in (0, 1))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def finite(lse):
    """lse with -inf (a query that saw no key yet) as 0, so that exp(-inf - it) is 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge(parts):
    """(out fp32, lse) of some queries from their blocks' partial [(out, lse)]: each out weighted by exp(its lse - the
    total's) and added in place, one pass over each."""
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    total = None
    for out, part_lse in parts:
        weight = (part_lse - finite(lse)).exp().unsqueeze(-1)
        total = out.float() * weight if total is None else total.addcmul_(out, weight)
    return total, lse


def ring_in_one_process(q, k, v, dout, N, window):
    """What the ring computes, every rank's blocks in one process (for checks): (out, dq, dk, dv) of whole sequences
    q (B, Hq, T, D), k/v (B, Hkv, T, D), from blocks of T/2N tokens merged, the backward from the merged output."""
    c = q.size(2) // (2 * N)
    blocks = [(slice(qc * c, (qc + 1) * c), slice(kc * c, (kc + 1) * c), qc, block_offset(qc, kc, c))
              for qc in range(2 * N) for kc in range(qc + 1) if block_visible(block_offset(qc, kc, c), c, window)]
    parts = {}
    for qs, ks, qc, offset in blocks:
        parts.setdefault(qc, []).append(block_attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], offset, window))
    merged = {qc: merge(p) for qc, p in parts.items()}
    outs = {qc: (out.to(q.dtype), lse) for qc, (out, lse) in merged.items()}
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for qs, ks, qc, offset in blocks:
        grads = block_attention_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], *outs[qc], offset, window)
        for total, grad, where in zip((dq, dk, dv), grads, (qs, ks, ks)):
            total[:, :, where] += grad
    return torch.cat([outs[i][0] for i in range(2 * N)], dim=2), dq, dk, dv


@torch.library.custom_op("nanochat::cp_attention", mutates_args=())
def cp_attention(q: Tensor, k: Tensor, v: Tensor, window: int, view: int) -> tuple[Tensor, Tensor]:
    cp = CONTEXTS[view]
    return (cp.ring_forward if cp.exchange == "ring" else cp.gather_forward)(q, k, v, window)


@torch.library.custom_op("nanochat::cp_attention_backward", mutates_args=())
def cp_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window: int,
                          view: int) -> tuple[Tensor, Tensor, Tensor]:
    cp = CONTEXTS[view]
    return (cp.ring_backward if cp.exchange == "ring" else cp.gather_backward)(dout, q, k, v, out, lse, window)


cp_attention.register_fake(
    lambda q, k, v, window, view: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)))
cp_attention_backward.register_fake(
    lambda dout, q, k, v, out, lse, window, view: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))


def _setup_context(ctx, inputs, output):
    (q, k, v, window, view), (out, lse) = inputs, output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window, ctx.view = window, view


def _backward(ctx, dout, dlse):
    # lse is an output for the backward's sake only: nothing downstream differentiates it
    q, k, v, out, lse = ctx.saved_tensors
    return *cp_attention_backward(dout.contiguous(), q, k, v, out, lse, ctx.window, ctx.view), None, None


cp_attention.register_autograd(_backward, setup_context=_setup_context)
