"""
Tensor parallelism (Megatron-style) as small explicit pieces, applied to an initialized GPT by `parallelize`.

Collectives, all over the TP group:
  all_reduce           f's backward, g's forward (leaving a region without SP), the vocab-parallel embedding
  all_gather           entering a region with SP (tokens); whole logits for evaluation (vocab); shards -> whole
                       tensors for checkpoints (gather_full), and Muon's state of every round (gather_rounds)
  all_to_all           in the step: each Muon matrix's shards to the TP rank that runs its update whole, and the
                       update's shards back (whole_rounds, shard_rounds): TP ranks share Muon's work, not repeat it
  reduce_scatter       leaving a region with SP (tokens)
  all_reduce MAX, SUM  the vocab-parallel loss: the logits' max, the sum of exponentials, the target's logit
  all_reduce SUM       under SP, in the step: replicated parameters' partial gradients (reduce_partial_grad), and
                       MoE layers' expert loads (moe.after_step)

What is cut how (a region starts with `region_enter` at the model's `tp_enter` hook, ends in the row-parallel linear):
- attention: q/k/v column-parallel (n_head/tp query, n_kv_head/tp kv heads a rank), the output projection row-parallel,
  value embeddings and gates cut to the local kv heads; MLP: up column-, down row-parallel (fp8.Fp8MLP stays fused)
- token embedding and lm_head vocab-parallel, with a vocab-parallel soft-capped cross-entropy that never gathers
  the logits (at d32 the fp32 logits of a 32x2048 micro-batch are 8.6 GB per copy)
- sequence parallelism (optional): between the TP regions rank k holds the flattened (B*T) tokens
  [k, k+1) * B*T/tp as (B, T/tp, D): every op there is per token, and dim 0 goes through the collectives as it is
- L3 and MoE layers replicated: sharding L3's table along d would all-reduce every score, by token cut a skewed,
  data-derived allocation into unequal shards (dev/LOG.md, 2026-11-23); MoE runs under SP only (recipe), each rank
  routing its own tokens, no collective in the layer. Under SP their partial gradients are summed over TP.
A sharded parameter carries `tp_dim` (the dim it is cut along), `tp_group` and `tp_size`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nanochat.gpt import softcap, reduce_losses
from nanochat.fp8 import fp8_linear
from nanochat.moe import MoE, moe_modules


# --- Shards <-> full tensors, for the optimizer and checkpoints (identities unsharded) ---

def is_sharded(p):
    return getattr(p, "tp_dim", None) is not None


def full_shape(p):
    shape = list(p.shape)
    if is_sharded(p):
        shape[p.tp_dim] *= p.tp_size
    return tuple(shape)


def gather_full(t, p):
    """All-gather `t`, shaped like p's shard, into the full tensor (along p.tp_dim)."""
    if not is_sharded(p):
        return t
    parts = [torch.empty_like(t) for _ in range(p.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=p.tp_group)
    return torch.cat(parts, dim=p.tp_dim)


def local_shard(t, p):
    """This rank's slice of a full tensor `t` shaped like the whole of p."""
    return _my_chunk(t, p.tp_dim, p.tp_group) if is_sharded(p) else t


# Muon updates whole matrices. A stack's rounds (R matrices this DP rank updates, data_parallel.RoundRobin) are shared
# out over the TP ranks, ceil(R / tp) each, contiguous: each rank runs Muon on its rounds whole and holds their state.

def rounds_held(rounds, p):
    """The round indices this TP rank updates whole (past `rounds`: padding); all of them where p is not cut."""
    if not is_sharded(p):
        return range(rounds)
    per, rank = math.ceil(rounds / p.tp_size), dist.get_rank(p.tp_group)
    return range(rank * per, (rank + 1) * per)


def whole_rounds(shards, p):
    """(R, *shard) gradients of every round -> this rank's rounds whole, (per, *full): one all-to-all."""
    R = shards.size(0)
    pad = len(rounds_held(R, p)) * p.tp_size - R
    padded = torch.cat([shards, shards.new_zeros((pad, *shards.shape[1:]))]) if pad else shards.contiguous()
    received = torch.empty_like(padded)  # chunk k: rank k's shards of this rank's rounds
    dist.all_to_all_single(received, padded, group=p.tp_group)
    return torch.cat(received.chunk(p.tp_size), dim=p.tp_dim + 1)


def shard_rounds(whole, p, rounds):
    """The way back: this rank's (per, *full) updates -> its shard of every round's update, (rounds, *shard)."""
    sent = torch.cat(whole.chunk(p.tp_size, dim=p.tp_dim + 1))  # chunk k: rank k's shard of this rank's rounds
    received = torch.empty_like(sent)  # chunk k: this rank's shard of rank k's rounds
    dist.all_to_all_single(received, sent, group=p.tp_group)
    return received[:rounds]


def gather_rounds(held, p, rounds):
    """Every TP rank's (per, ...) state -> that of all `rounds` (for checkpoints)."""
    return _all_gather(held, 0, p.tp_group)[:rounds] if is_sharded(p) else held


def reduce_partial_grad(p, grad):
    """Under SP sum a replicated parameter's partial gradients over TP, in place (`grad`: p's or its DP-reduced)."""
    if hasattr(p, "tp_partial_grad"):
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=p.tp_partial_grad)


# --- The collectives --------------------------------------------------------------
# `funcol` returns new tensors, which torch.compile traces (gloo and NCCL alike). Each is waited on explicitly:
# compiled under torch 2.11, results only converted by torch.as_tensor gave wrong TP gradients, as if read unwaited.

def _all_gather(x, dim, group):
    """Concatenate every rank's x along dim (all_gather works on dim 0: move dim to the front)."""
    return funcol.wait_tensor(funcol.all_gather_tensor(x.movedim(dim, 0).contiguous(), 0, group)).movedim(0, dim)


def _all_reduce(x, group):
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def _my_chunk(x, dim, group):
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def _by_tokens(fn):
    """fn on the flattened tokens: the token split of sequence parallelism, (B, T, D) <-> this rank's (B, T/tp, D)."""
    def on_tokens(x, group):
        B, T, D = x.shape
        return fn(x.reshape(B * T, D), group).view(B, -1, D)
    return on_tokens


_gather_tokens = _by_tokens(lambda x, g: _all_gather(x, 0, g))
_reduce_scatter_tokens = _by_tokens(  # summed over the ranks, this rank's tokens kept
    lambda x, g: funcol.wait_tensor(funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, g)))
_my_tokens = _by_tokens(lambda x, g: _my_chunk(x, 0, g))


def _conjugate(name, forward, backward):
    """`forward(x, group)` in the forward, its conjugate `backward(grad, group)` after: an autograd function behind a
    plain function. A Function's bound `apply` kept on a module (Collective) is traced by torch 2.11's compiler as
    Python, which breaks the graph at each collective: the whole compiled TP model then ran its blocks eagerly."""
    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None
    function = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
    return lambda x, group: function.apply(x, group)


# the conjugate pairs, (forward, backward):
_CopyToTP = _conjugate("CopyToTP", lambda x, g: x, _all_reduce)  # f: identity, all-reduce (enter a region)
_ReduceFromTP = _conjugate("ReduceFromTP", _all_reduce, lambda x, g: x)  # g: all-reduce, identity (leave a region)
_GatherSequence = _conjugate("GatherSequence", _gather_tokens, _reduce_scatter_tokens)  # enter a region, with SP
_ScatterSequence = _conjugate("ScatterSequence", _reduce_scatter_tokens, _gather_tokens)  # leave a region, with SP
_SplitSequence = _conjugate("SplitSequence", _my_tokens, _gather_tokens)  # after the embedding, with SP
_GatherVocab = _conjugate("GatherVocab", lambda x, g: _all_gather(x, x.dim() - 1, g),  # whole logits (evaluation)
                          lambda x, g: _my_chunk(x, x.dim() - 1, g))


class Collective(nn.Module):
    """One of the collectives above as a module, for the model's hooks (tp_enter, embed_exit, token_share)."""

    def __init__(self, fn, group):
        super().__init__()
        self.fn, self.group = fn, group

    def forward(self, x):
        return self.fn(x, self.group)


def region_enter(group, sequence_parallel):
    """Where a TP region starts (attention, MLP, lm_head input): f, or the sequence all-gather."""
    return Collective(_GatherSequence if sequence_parallel else _CopyToTP, group)


# --- Sharded layers: each holds only its shard, `tp_dim` says along which dim ------

def _shard_parameter(full, dim, layout):
    p = nn.Parameter(full.detach().chunk(layout.tp_size, dim=dim)[layout.tp_rank].clone())
    p.tp_dim, p.tp_size, p.tp_group = dim, layout.tp_size, layout.tp_group
    return p


def _linear(module, x):
    """x @ W^T for a sharded linear: in fp8 (the shard's own scale, fp8.py) when made from an fp8 one (`fp8` kept)."""
    return fp8_linear(x, module.weight) if module.fp8 else F.linear(x, module.weight.to(x.dtype))


class ColumnParallelLinear(nn.Module):
    """W cut along its outputs (rows), which stay sharded; as the lm_head it enters the TP region itself (`enter`)."""

    def __init__(self, linear, layout, enter=None):
        super().__init__()
        self.weight = _shard_parameter(linear.weight, 0, layout)
        self.fp8, self.enter = getattr(linear, "fp8", False), enter or nn.Identity()

    def forward(self, x):
        return _linear(self, self.enter(x))


class RowParallelLinear(nn.Module):
    """W cut along its inputs (columns): sums the ranks' partial outputs to leave the TP region."""

    def __init__(self, linear, layout, sequence_parallel):
        super().__init__()
        self.weight = _shard_parameter(linear.weight, 1, layout)
        self.group, self.sequence_parallel, self.fp8 = layout.tp_group, sequence_parallel, getattr(linear, "fp8", False)

    def forward(self, x):
        return self.reduce(_linear(self, x))

    def reduce(self, partial):
        """g or the SP reduce-scatter (also for fp8.Fp8MLP, whose product is its own)."""
        return (_ScatterSequence if self.sequence_parallel else _ReduceFromTP)(partial, self.group)


class ColumnParallelEmbedding(nn.Module):
    """A table cut along the embedding dim (value embeddings: one slice per local kv head); no collective."""

    def __init__(self, embedding, layout):
        super().__init__()
        self.weight = _shard_parameter(embedding.weight, 1, layout)

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class VocabParallelEmbedding(nn.Module):
    """The token table cut along the vocabulary: each rank looks up the ids it owns, g sums the parts."""

    def __init__(self, embedding, layout):
        super().__init__()
        self.weight = _shard_parameter(embedding.weight, 0, layout)
        self.group, self.vocab_start = layout.tp_group, layout.tp_rank * self.weight.size(0)

    def forward(self, idx):
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.weight.size(0))
        out = F.embedding(local.clamp(0, self.weight.size(0) - 1), self.weight) * mine.unsqueeze(-1)
        return _ReduceFromTP(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary, never gathered (three all-reduces)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        n_local = logits.size(-1)
        logits_max = funcol.wait_tensor(funcol.all_reduce(logits.max(dim=-1).values, "max", group))
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.clamp(0, n_local - 1)
        target_logit = _all_reduce(shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine, group)
        valid = targets >= 0
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine, valid)
        return (sum_exp.log() - target_logit) * valid

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None


class VocabParallelSoftcapCrossEntropy(nn.Module):
    """The vocab-parallel twin of gpt.SoftcapCrossEntropy (same interface)."""

    def __init__(self, vocab_size, layout):
        super().__init__()
        self.group, self.vocab_start = layout.tp_group, layout.tp_rank * (vocab_size // layout.tp_size)

    def logits(self, raw):
        """Full soft-capped logits (every rank gets all of them): for evaluation and sampling."""
        return softcap(_GatherVocab(raw.float(), self.group))

    def forward(self, x, lm_head, targets, reduction="mean"):
        logits = softcap(lm_head(x)).flatten(0, -2)
        loss = _VocabParallelCrossEntropy.apply(logits, targets.reshape(-1), self.vocab_start, self.group)
        return reduce_losses(loss, targets, reduction)


def parallelize(model, layout, sequence_parallel=False):
    """Shard an initialized GPT in place (a TP degree recipe.Setting.check accepted); ranks start with equal weights."""
    group = layout.tp_group
    for block in model.blocks:
        # a region each: attention, and the MLP unless it is an MoE (replicated, module docstring)
        mlp = [] if isinstance(block.mlp, MoE) else [(block.mlp, ("c_fc",))]
        for module, columns in [(block.attn, ("c_q", "c_k", "c_v"))] + mlp:
            module.tp_enter = region_enter(group, sequence_parallel)
            for name in columns:
                setattr(module, name, ColumnParallelLinear(getattr(module, name), layout))
            module.c_proj = RowParallelLinear(module.c_proj, layout, sequence_parallel)
        if block.attn.ve_gate is not None:  # one gate per kv head: keep the local heads' rows
            block.attn.ve_gate = ColumnParallelLinear(block.attn.ve_gate, layout)
            block.value_embed = ColumnParallelEmbedding(block.value_embed, layout)
    model.wte = VocabParallelEmbedding(model.wte, layout)
    model.lm_head = ColumnParallelLinear(model.lm_head, layout, region_enter(group, sequence_parallel))
    model.criterion = VocabParallelSoftcapCrossEntropy(model.config.vocab_size, layout)
    if sequence_parallel:
        model.embed_exit = Collective(_SplitSequence, group)
        for layer in model.l3.values():  # replicated: each rank looks up its own token ids, (B, T) -> (B, T/tp)
            layer.token_share = Collective(lambda idx, g: _my_tokens(idx.unsqueeze(-1), g).squeeze(-1), group)
        # replicated parameters that see this rank's tokens only: partial gradients
        lambdas = [model.backout_lambda] + [p for b in model.blocks for p in (b.resid_lambda, b.x0_lambda)]
        for p in lambdas + list(model.l3.parameters()) + [p for m in moe_modules(model) for p in m.parameters()]:
            p.tp_partial_grad = group  # the group its gradient is summed over (tp_group is a shard's)
    return model
