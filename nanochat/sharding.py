"""
Parameter sharding (--shard-params, ZeRO-3) on data parallelism's ownership (data_parallel.py): a rank keeps fp32
weights, gradients and optimizer state only for what it updates (a Muon matrix whole on its owner, a large AdamW
tensor by rows; small AdamW tensors stay whole everywhere), and gathers each module's weights around its call.

Collectives, all over the DP group:
  broadcast               per module call (and again before its backward, unless --keep-gathered): each Muon
                          matrix from its owner, in the compute dtype
  all_gather_into_tensor  the same, per large AdamW tensor: its rows from every rank
  reduce                  per module call's backward: each Muon matrix's gradient (compute dtype) to its owner
  reduce_scatter_tensor   the same, per large AdamW tensor: its gradient -> this rank's rows
  broadcast, all_gather   for a checkpoint or a whole copy of the model: the fp32 weights, into whole tensors
A module's gathering, and its gradients' sends, go out as one NCCL group (one launch, not one a tensor: 1.05x the
step at d32 on four GPUs, dev/LOG.md 2026-11-27).

The model calls each module holding sharded weights (the embedding, each block, each L3 layer, the lm_head) through
`ShardedWeights.run`, gpt.py's `weights` seam: gathered whole one call ahead (behind the previous module's compute),
swapped in for the call, freed after it and gathered again before its backward (not embedding tables: a lookup's
backward needs only the ids, unless --recompute runs it again), unless --keep-gathered keeps them (all but the
tables: one copy of the other weights more alive, one gather fewer). Every
micro-batch's gradients go to their owners (summed in the compute dtype, as they were made: 1.03x the step at d32 DP 4
over fp32 sums; dev/LOG.md 2026-11-27) as each module's backward ends, landing during the next's, added in fp32.

A sharded parameter carries `dp_shape` (its whole shape on this TP rank), `dp_group` and `dp_owner` (the DP rank
holding a Muon matrix; None for one held by rows); its .data is what this rank holds. Under TP, TP's embedding tables
count as lookups.
"""

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from nanochat.distributed import all_gather_single, reduce_scatter_single, wait_for


def is_dp_sharded(p):
    return getattr(p, "dp_group", None) is not None


def gather_whole(whole, p, async_op=False, rows=None):
    """Fill `whole` with sharded p's whole tensor (this TP rank's) in whole's dtype, by a collective over DP; `rows`:
    a row-held p's rows on this rank already in that dtype (else converted here)."""
    if p.dp_owner is None:
        rows = p.data.to(whole.dtype) if rows is None else rows
        return all_gather_single(whole, rows, group=p.dp_group, async_op=async_op)
    if dist.get_rank(p.dp_group) == p.dp_owner:
        whole.copy_(p.data)
    return dist.broadcast(whole, src=dist.get_global_rank(p.dp_group, p.dp_owner), group=p.dp_group, async_op=async_op)


def posted_together(group, device, post):
    """The works of the collectives post() posts; on GPUs as one NCCL group (one launch for a module's collectives:
    fewer kernels waiting on SMs for their peers), through torch's coalescing manager; gloo has no groups."""
    if device.type != "cuda":
        return post()
    with _coalescing_manager(group, device, async_ops=True) as together:
        post()
    return together.works


def whole_over_dp(t, p):
    """p's whole fp32 tensor (this TP rank's) where p is DP-sharded, else `t` (checkpoints, whole model copies)."""
    if not is_dp_sharded(p):
        return t
    whole = torch.empty(p.dp_shape, dtype=t.dtype, device=t.device)
    gather_whole(whole, p)
    return whole


def embedding_types():
    from nanochat.tensor_parallel import ColumnParallelEmbedding, VocabParallelEmbedding
    return (nn.Embedding, ColumnParallelEmbedding, VocabParallelEmbedding)


class Unit:
    """A module called through ShardedWeights.run: its sharded parameters, where each sits (module, attribute), and
    whether its backward reads each (not an embedding table, unless the forward runs again: gpt.Block --recompute)."""

    def __init__(self, module):
        self.recomputes = getattr(module, "recompute", "none") != "none"
        named = [(name.rpartition("."), p) for name, p in module.named_parameters() if is_dp_sharded(p)]
        self.params = [p for _, p in named]
        self.slots = [(module.get_submodule(owner), attr) for (owner, _, attr), _ in named]
        self.tables = [isinstance(owner, embedding_types()) for owner, _ in self.slots]
        self.backward_reads = [self.recomputes or not table for table in self.tables]
        self.prefetched = None  # a Gathered posted ahead of this unit's next call

    def swap(self, tensors):
        """Put `tensors` where the parameters sit: the whole weights for a call, the shards after it."""
        for (owner, attr), t in zip(self.slots, tensors):
            owner._parameters[attr] = t


class Gathered:
    """One gathering of a unit's weights: whole tensors in the compute dtype, filled by collectives posted here."""

    def __init__(self, weights, unit):
        self.weights, self.unit = weights, unit
        self.wholes = [torch.empty(p.dp_shape, dtype=weights.dtype, device=p.device) for p in unit.params]
        self.works, self.reading, self.previous, self.output, self.done = [], [], None, None, False
        weights.count(sum(t.numel() * t.element_size() for t in self.wholes))
        self.fill(range(len(self.wholes)))

    def fill(self, which):
        """Post the gathers of wholes[i], i in `which`. Refilling a tensor autograd saved is no change (the same values
        again), so its version counter is kept from here until wait() (gloo writes the results when they arrive)."""
        if not which:
            return
        self.versions = torch.autograd._unsafe_preserve_version_counter(tuple(self.wholes[i] for i in which))
        self.versions.__enter__()
        # row-held tensors' rows in the compute dtype, made before the NCCL group opens (an error inside one would
        # leave it open) and held until wait(): the group's work does not hold the inputs of its all-gathers
        params = [self.unit.params[i] for i in which]
        rows = [p.data.to(self.weights.dtype, copy=True) if p.dp_owner is None else None for p in params]
        self.reading += [r for r in rows if r is not None]
        self.works += posted_together(self.weights.group, self.wholes[0].device, lambda: [
            gather_whole(self.wholes[i], p, True, r) for i, p, r in zip(which, params, rows)])

    def wait(self):
        wait_for(self.works)
        if self.works:
            self.versions.__exit__(None, None, None)
        for t in self.reading:  # read by now: freed, not left to NCCL's watchdog
            t.untyped_storage().resize_(0)
        self.works, self.reading = [], []

    def release(self, which=None):
        """Free the whole tensors' storage (all, or `which`); the tensors stay, empty, for autograd."""
        self.wait()
        for i in range(len(self.wholes)) if which is None else which:
            self._resize(self.wholes[i], 0)

    def _resize(self, t, nbytes):
        """t's storage to `nbytes` (0: freed), counted; its version counter kept, as autograd checks it."""
        self.weights.count(nbytes - t.untyped_storage().nbytes())
        with torch.autograd._unsafe_preserve_version_counter(t):
            t.untyped_storage().resize_(nbytes)

    def emptied(self):
        """The whole tensors the backward reads that are empty (to be gathered again)."""
        return [i for i, reads in enumerate(self.unit.backward_reads)
                if reads and self.wholes[i].untyped_storage().nbytes() == 0]

    def refill(self):
        """Before the backward: the whole tensors it reads, gathered again into the same tensors."""
        which = self.emptied()
        for t in (self.wholes[i] for i in which):
            self._resize(t, t.numel() * t.element_size())
        self.fill(which)


def feeds(grad_fn, x, depth=4):
    """Whether the op `grad_fn` (a module's output) is among the last `depth` ops that made tensor x."""
    frontier = [getattr(x, "grad_fn", None)]
    for _ in range(depth):
        if any(f is grad_fn for f in frontier):
            return True
        frontier = [g for f in frontier if f is not None for g, _ in f.next_functions]
    return False


class _Gather(torch.autograd.Function):
    """A gathering's whole weights as autograd outputs of the shards, so that their gradients come back here to be
    sent home (send_gradients); the shards get none directly (it lands in .grad when its send completes)."""

    @staticmethod
    def forward(ctx, gathered, *shards):
        ctx.gathered = gathered
        return tuple(gathered.wholes)

    @staticmethod
    def backward(ctx, *grads):
        gathered, ctx.gathered = ctx.gathered, None  # it holds this node's outputs: a cycle the collector cannot see
        gathered.weights.send_gradients(gathered, grads)
        return (None,) * (len(grads) + 1)


class ShardedWeights:
    """A model's weights sharded over the DP group: cut at construction, whole in `run`, gradients sent home."""

    def __init__(self, model, dp, keep_gathered=False):
        self.group, self.rank, self.keep, self.dtype = dp.group, dp.rank, keep_gathered, model.compute_dtype
        owner = {p: stack_owner.owner(i) for params, stack_owner in zip(dp.muon_stacks, dp.owners)
                 for i, p in enumerate(params)}
        for p in model.parameters():
            if not (p in owner or dp.owns_rows(p)):
                continue  # the small AdamW tensors stay whole on every rank
            p.dp_shape, p.dp_group, p.dp_owner = tuple(p.shape), self.group, owner.get(p)
            if p.dp_owner is None:
                p.data = dp.my_rows(p.data).clone()
            elif p.dp_owner != self.rank:
                p.data = p.data.new_empty(0)
        self.units = {}     # module -> Unit
        self.next = {}      # unit -> the unit called after it last time (whose gathering a call posts ahead)
        self.last = None
        self.chain = None   # the latest gathering of the forward running (the backward posts the one before ahead)
        self.sent = ([], [])  # the last module's sends (send_gradients) and their works, landing after the next's
        self.gathered_bytes = self.gathered_peak = 0  # whole weights alive now, and the most at once

    def count(self, nbytes):
        self.gathered_bytes += nbytes
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def run(self, module, fn, *args):
        """fn(*args) with `module`'s whole weights in place (module docstring), arranging the backward's part."""
        if module not in self.units:
            self.units[module] = Unit(module)
        unit = self.units[module]
        if self.last is not None:
            self.next[self.last] = unit
        self.last = unit
        if not unit.params:
            return fn(*args)
        gathered, unit.prefetched = unit.prefetched or Gathered(self, unit), None
        gathered.wait()
        after = self.next.get(unit)
        # posted ahead: the next module's gathering, but not the token embedding's, which starts a forward (nothing
        # runs before it to hide it behind, and it would reach across the optimizer step)
        if after is not None and any(after.backward_reads) and after.prefetched is None:
            after.prefetched = Gathered(self, after)
        training = torch.is_grad_enabled()
        if training:
            gathered.wholes = list(_Gather.apply(gathered, *unit.params))
        unit.swap(gathered.wholes)
        try:
            out = fn(*args)
        finally:
            unit.swap(unit.params)
        x = out if torch.is_tensor(out) else getattr(out, "x", None)  # a tensor, or gpt.Residual
        if not (training and x is not None and x.requires_grad):
            gathered.release()
            return out
        # kept: all but the embedding tables (a recompute's lookup gathers its table again: before_backward)
        gathered.release([i for i, table in enumerate(unit.tables) if table] if self.keep else None)
        # the module called before this one, if its output is this one's input (a few ops away: an L3 layer's sum,
        # the head's norm); not a module of another micro-batch that a pipeline ran in between
        gathered.previous = self.chain if self.chain and args and feeds(self.chain.output, args[0]) else None
        gathered.output, self.chain = x.grad_fn, gathered
        if gathered.emptied() or unit.recomputes:
            x.register_hook(lambda grad: self.before_backward(gathered))
        return out

    def before_backward(self, gathered):
        """Its whole weights gathered again (the previous module's posted ahead), and swapped in under recompute."""
        self.chain = None  # a backward has begun: the next forward starts a new chain
        gathered.refill()
        gathered.wait()
        previous = gathered.previous
        if previous is not None and not previous.done:
            previous.refill()
        if gathered.unit.recomputes:
            gathered.unit.swap(gathered.wholes)

    def send_gradients(self, gathered, grads):
        """After a module's backward: gradients sent home, weights freed, the previous module's sends land (two
        modules' at most in flight)."""
        unit = gathered.unit
        if unit.recomputes:
            unit.swap(unit.params)
        sends = []  # (parameter, its gradient landing here or None, the buffer the collective sums into)
        for p, grad in zip(unit.params, grads):
            g = (torch.zeros(p.dp_shape, device=p.device, dtype=self.dtype) if grad is None
                 else grad.to(self.dtype, copy=True).contiguous())
            if p.dp_owner is None:
                landing = torch.empty_like(p.data, dtype=self.dtype)  # this rank's rows of the sum
            else:
                landing = g if self.rank == p.dp_owner else None  # the owner's sum lands in place
            sends.append((p, landing, g))
        earlier = self.sent
        self.sent = (sends, posted_together(self.group, sends[0][2].device, lambda: [self.send(*s) for s in sends]))
        gathered.release()
        gathered.done, gathered.wholes, gathered.previous, gathered.output, self.chain = True, [], None, None, None
        self.land(earlier)

    def send(self, p, landing, g):
        """g summed over DP to p's owner (a Muon matrix) or as rows to every rank (landing): the collective's work."""
        if p.dp_owner is None:
            return reduce_scatter_single(landing, g, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return dist.reduce(g, dst=dist.get_global_rank(self.group, p.dp_owner), op=dist.ReduceOp.SUM,
                           group=self.group, async_op=True)

    @staticmethod
    def land(sent):
        """Wait for a module's sends (send_gradients) and add what landed here to each p.grad."""
        params, works = sent
        wait_for(works)
        for p, landing, g in params:
            if landing is not None:
                p.grad = landing.float() if p.grad is None else p.grad.add_(landing)
            for t in (landing, g):  # sent, or landed and summed: freed now (an NCCL group holds its buffers until
                if t is not None and t is not p.grad:  # its watchdog reaps them: 3.4 GiB more at d32 DP 4)
                    t.untyped_storage().resize_(0)

    def finish(self):
        """Before the step: every gradient landed, gatherings posted ahead dropped (the step changes their weights)."""
        self.land(self.sent)
        self.sent, self.chain = ([], []), None
        for unit in self.units.values():
            if unit.prefetched is not None:
                unit.prefetched.release()
                unit.prefetched = None
