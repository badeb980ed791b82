"""
Data parallelism, written out (no DDP wrapper): every DP rank runs its own micro-batches; gradients are summed over
the DP group, and the optimizer's work is shared out so that no two ranks compute the same update (ZeRO-2:
optimizer state and updates sharded). With --shard-params (ZeRO-3) the weights and gradients are shared out the
same way: a rank keeps fp32 weights, gradients and state only for what it updates, and gathers each module's
weights in the compute dtype around its call (ShardedWeights, below).

Collectives, all over the DP group (gloo has no AVG everywhere: gradients are summed, then divided by W):
  reduce_scatter_tensor   per Muon round: its W gradients -> this rank's matrix, summed
  reduce_scatter_tensor   per large AdamW tensor: its gradient -> this rank's rows, summed
  all_reduce              the small AdamW gradients, one flat buffer
  all_gather_into_tensor  per Muon stack: every owner's updates, in the compute dtype (half the bytes in bf16)
  all_gather_into_tensor  per large AdamW tensor: the updated rows
  broadcast_object_list   once, with overlap: rank 0's bucket launch order
  all_gather_into_tensor  for a checkpoint: the owners' optimizer state, into whole tensors
  all_reduce              the step's loss, for the log
With --shard-params, in place of the first two and the two update all-gathers:
  broadcast               per module call (and again before its backward, unless --keep-gathered): each Muon
                          matrix from its owner, in the compute dtype
  all_gather_into_tensor  the same, per large AdamW tensor: its rows from every rank
  reduce                  per module call's backward: each Muon matrix's gradient (fp32) to its owner
  reduce_scatter_tensor   the same, per large AdamW tensor: its gradient -> this rank's rows
  broadcast, all_gather   for a checkpoint or a whole copy of the model: the fp32 weights, into whole tensors

Who updates what, each a bucket (one collective): Muon matrices of one shape form a stack, cut into rounds of W
consecutive matrices, rank r owning matrix r of every round, whole (Muon orthogonalizes whole matrices; a round's
matrices are neighbouring layers, whose gradients are final together); AdamW tensors of >= 1024 elements whose
first dim divides by W are owned by rows; the other AdamW tensors are summed as one flat buffer and updated on
every rank. The owners' updates are then all-gathered.

Overlap (--overlap-grad-reduce): the step calls prepare_last_backward() before its last micro-batch's backward;
a post-accumulate-grad hook on every parameter counts its bucket down, and a bucket whose gradients are final
launches its collective while the backward runs on. Buckets launch in one order on every rank (collectives on
a group must), each once it and every bucket before it are ready: rank 0's readiness order in its first
overlapped backward (broadcast; that step launches everything after the backward).

Parameter sharding (--shard-params): the ownership above is also where the weights live. A Muon matrix is held
whole (fp32) by its owner and by no other rank; an AdamW tensor owned by rows is held by rows; the small AdamW
tensors stay whole on every rank. The model calls each sharded module through `ShardedWeights.run` (gpt.py's
`weights` seam: the embedding, each block, each L3 layer, the lm_head): the module's weights are gathered whole
in the compute dtype (posted one call ahead: the next module's gather runs behind this one's compute), swapped in
for the call, and freed after it; before the module's backward they are gathered again (its gradients need them),
or with --keep-gathered kept from the forward (one more copy of the weights alive, no second gather). Embedding
tables are not gathered again: a lookup's backward needs only the ids. When a module's backward ends, each of its
gradients goes to its owner at once (fp32, summed over the ranks), and lands in the owner's .grad while the next
module's backward runs; every micro-batch sends its own. Under recompute the module's whole weights are swapped in
again for its backward, where the forward runs again.
"""

import math
from functools import partial

import torch
import torch.nn as nn
import torch.distributed as dist


class RoundRobin:
    """K same-shape matrices shared out over W ranks: rounds of W consecutive matrices, rank r owning matrix
    r of every round. `rounds` is also how many matrices each rank owns (the stack padded to rounds x W)."""

    def __init__(self, K, W, rank):
        self.K, self.W, self.rank = K, W, rank
        self.rounds = math.ceil(K / W)

    def round(self, g):
        """Indices of round g's matrices."""
        return range(g * self.W, min((g + 1) * self.W, self.K))

    def owned(self, j):
        """Index of this rank's j-th matrix, or None where the padding falls."""
        i = j * self.W + self.rank
        return i if i < self.K else None

    def slot(self, i):
        """Where matrix i lands in an all-gather of the ranks' (rounds, ...) stacks."""
        return (i % self.W) * self.rounds + i // self.W

    def owner(self, i):
        """The rank that owns matrix i."""
        return i % self.W


def owned_by_rows(p, size):
    """Whether an AdamW tensor is shared out by rows over `size` ranks (else it is updated, and held, whole)."""
    return size > 1 and p.ndim > 0 and p.size(0) % size == 0 and p.numel() >= 1024


class GradBucket:
    """Parameters whose gradient reduction is one collective. `launch(bucket)` starts it and returns its work
    handle (None when nothing is in flight)."""

    def __init__(self, kind, params, launch):
        self.kind, self.params, self.launch = kind, params, launch  # kind: "muon", "rows" or "flat"
        self.reset()

    def reset(self):
        self.remaining = len(self.params)  # members whose gradient is not final yet (overlap only)
        self.ready = self.launched = False
        self.work = self.result = None  # the collective in flight; what the step reads once it is done

    def start(self):
        self.work = self.launch(self)
        self.launched = True

    def wait(self):
        if self.work is not None:
            self.work.wait()


class DataParallel:
    """The gradient reduction and the sharing out of one optimizer's parameters over the DP group (None: one
    rank, where every method is a local no-op or copy). muon_stacks: lists of same-shape matrices; adamw_params:
    the AdamW tensors; both in one order on every rank. shard_params: the weights are shared out too (ZeRO-3):
    shard() then cuts them and returns the ShardedWeights the model calls its modules through."""

    def __init__(self, muon_stacks, adamw_params, group=None, overlap=False, shard_params=False):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.muon_stacks = muon_stacks
        self.owners = [RoundRobin(len(params), self.size, self.rank) for params in muon_stacks]
        self.row_params = [p for p in adamw_params if owned_by_rows(p, self.size)]
        self.by_rows = set(self.row_params)
        self.shard_params, self.weights = shard_params, None
        self.muon_grads = [None] * len(muon_stacks)  # per stack: this rank's summed (rounds, *shape) gradients
        # the buckets, in the default launch order: Muon's first (they feed the most compute), then the large
        # AdamW tensors one by one, then the small ones as one flat buffer. With sharded weights the first two
        # kinds travel during the backward instead (ShardedWeights.send_gradients).
        self.muon_buckets = [] if shard_params else \
            [[GradBucket("muon", [params[i] for i in owner.round(g)], partial(self._reduce_round, s, g))
              for g in range(owner.rounds)] for s, (params, owner) in enumerate(zip(muon_stacks, self.owners))]
        self.adamw_buckets = [] if shard_params else \
            [GradBucket("rows", [p], self._reduce_rows) for p in adamw_params if self.owns_rows(p)]
        small = [p for p in adamw_params if not self.owns_rows(p)]
        if small:
            self.adamw_buckets.append(GradBucket("flat", small, self._reduce_flat))
        self.buckets = [b for stack in self.muon_buckets for b in stack] + self.adamw_buckets
        self.overlap = overlap and self.size > 1 and not shard_params  # sharded: each module's gradients go at once
        self._armed, self._launch_order, self._first_ready, self._next_launch = False, None, [], 0
        self.launched_in_backward = 0  # buckets the last step's backward launched (for logs and tests)
        if self.overlap:
            self._bucket_of = {p: b for b in self.buckets for p in b.params}
            for p in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def owns_rows(self, p):
        """Whether an AdamW tensor is shared out by rows (else it is updated on every rank)."""
        return p in self.by_rows

    def my_rows(self, t):
        """This rank's rows of a whole tensor."""
        rows = t.size(0) // self.size
        return t[self.rank * rows:(self.rank + 1) * rows]

    def rows_held(self, p):
        """This rank's rows of an AdamW tensor owned by rows: all it holds when the weights are sharded."""
        return p.data if self.shard_params else self.my_rows(p.data)

    def shard(self, model, keep_gathered=False):
        """Cut the model's weights to what this rank owns (shard_params); returns the ShardedWeights."""
        self.weights = ShardedWeights(model, self, keep_gathered)
        return self.weights

    def finish_backward(self):
        """Before the step reads any gradient: the sharded gradients still travelling, landed."""
        if self.weights is not None:
            self.weights.finish()

    # --- the reductions, one collective per bucket -----------------------------------

    def _reduce_round(self, s, g, bucket):
        """Muon stack s, round g: this rank's matrix of the round, summed over DP, into muon_grads[s][g]."""
        grads = [p.grad for p in bucket.params]
        if self.muon_grads[s] is None:
            self.muon_grads[s] = torch.empty((self.owners[s].rounds, *grads[0].shape), dtype=grads[0].dtype,
                                             device=grads[0].device)
        if self.size == 1:
            self.muon_grads[s][g].copy_(grads[0])
            return None
        stacked = torch.stack(grads + [torch.zeros_like(grads[0])] * (self.size - len(grads)))
        return dist.reduce_scatter_tensor(self.muon_grads[s][g:g + 1], stacked, op=dist.ReduceOp.SUM,
                                          group=self.group, async_op=True)

    def _reduce_rows(self, bucket):
        p, = bucket.params
        bucket.result = torch.empty_like(self.my_rows(p.grad))
        return dist.reduce_scatter_tensor(bucket.result, p.grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _reduce_flat(self, bucket):
        if self.size == 1:  # nothing to reduce: the step reads the gradients in place
            return None
        bucket.result = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        return dist.all_reduce(bucket.result, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    # --- overlap with the backward ---------------------------------------------------

    def prepare_last_backward(self):
        """Call right before the backward of a step's last micro-batch: from then on each bucket's reduction
        starts (async) as soon as all its gradients are final. A no-op without overlap."""
        if not self.overlap:
            return
        for b in self.buckets:
            b.reset()
        self._armed, self._next_launch, self._first_ready = True, 0, []
        self.launched_in_backward = 0

    @torch.no_grad()
    def _grad_ready(self, p):
        """post-accumulate-grad hook: p's gradient is final for this step."""
        if not self._armed:
            return
        b = self._bucket_of[p]
        b.remaining -= 1
        if b.remaining > 0:
            return
        b.ready = True
        if self._launch_order is None:  # the first overlapped backward only records the order
            self._first_ready.append(b)
            return
        order = self._launch_order
        while self._next_launch < len(order) and order[self._next_launch].ready:
            order[self._next_launch].start()
            self._next_launch += 1
            self.launched_in_backward += 1

    def _agree_on_launch_order(self):
        """Rank 0's readiness order, then the buckets that were never ready in it (their parameters got no
        gradient from the last micro-batch), in the default order."""
        index = {id(b): i for i, b in enumerate(self.buckets)}
        seen = [[index[id(b)] for b in self._first_ready]]
        dist.broadcast_object_list(seen, src=dist.get_global_rank(self.group, 0), group=self.group)
        order = [self.buckets[i] for i in seen[0]]
        return order + [b for b in self.buckets if all(b is not o for o in order)]

    # --- what the optimizer's step calls ---------------------------------------------

    def launch_remaining(self):
        """Start every reduction the backward has not started (all of them without overlap)."""
        if self._armed and self._launch_order is None:
            self._launch_order = self._agree_on_launch_order()
        self._armed = False
        for b in self._launch_order or self.buckets:
            if not b.launched:
                b.start()

    def reduced_muon_grads(self, s):
        """Stack s: this rank's matrices' gradients, summed over DP (TP shards as they are): (rounds, *shape)."""
        if self.shard_params:  # already summed into the owners' .grad during the backward
            params, owner = self.muon_stacks[s], self.owners[s]
            return torch.stack([params[i].grad if (i := owner.owned(j)) is not None else
                                params[0].new_zeros(params[0].dp_shape) for j in range(owner.rounds)])
        for b in self.muon_buckets[s]:
            b.wait()
        grads, self.muon_grads[s] = self.muon_grads[s], None
        return grads

    def reduced_adamw_grads(self):
        """(p, summed gradient) for every AdamW tensor, bucket by bucket as they land: this rank's rows of the
        tensors owned by rows, the whole gradient of the others."""
        if self.shard_params:  # the rows' gradients landed in .grad during the backward
            yield from ((p, p.grad) for p in self.row_params)
        for b in self.adamw_buckets:
            b.wait()
            if b.kind == "rows":
                yield b.params[0], b.result
                continue
            offset = 0  # the flat buffer, unflattened
            for p in b.params:
                yield p, (p.grad if b.result is None else b.result[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def gather_muon_updates(self, s, updates):
        """Every owner's (rounds, ...) updates of stack s, all-gathered: (full stack, work), matrix i at slot(i)."""
        if self.size == 1:
            return updates, None
        full = torch.empty((self.owners[s].rounds * self.size, *updates.shape[1:]), dtype=updates.dtype,
                           device=updates.device)
        return full, dist.all_gather_into_tensor(full, updates, group=self.group, async_op=True)

    def gather_rows(self, rows):
        """Every owner's rows of an AdamW tensor, all-gathered: (whole tensor, work)."""
        full = torch.empty((rows.size(0) * self.size, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        return full, dist.all_gather_into_tensor(full, rows.contiguous(), group=self.group, async_op=True)

    def finish_step(self):
        for b in self.buckets:
            b.reset()

    def mean_loss(self, loss):
        """The step's loss averaged over the DP ranks (for the log)."""
        if self.size == 1:
            return loss
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.group)
        return loss / self.size

    # --- optimizer state, whole (for checkpoints) -----------------------------------

    def gather_stack_state(self, s, local):
        """A stack's per-owner state (rounds, ...) -> the state of its K matrices, in stack order (blocking)."""
        if self.size == 1:
            return local
        full, work = self.gather_muon_updates(s, local)
        work.wait()
        return full[[self.owners[s].slot(i) for i in range(self.owners[s].K)]]

    def gather_row_state(self, local):
        full, work = self.gather_rows(local)
        work.wait()
        return full


# --- Parameter sharding (--shard-params, ZeRO-3) ----------------------------------------------------------------
# A sharded parameter carries `dp_shape` (its whole shape on this TP rank), `dp_group` and `dp_owner` (the DP rank
# holding a Muon matrix whole; None for an AdamW tensor held by rows); its .data is what this rank holds (the whole
# matrix on its owner, nothing elsewhere; this rank's rows).


def is_dp_sharded(p):
    return getattr(p, "dp_group", None) is not None


def gather_whole(whole, p, async_op=False):
    """Fill `whole` with sharded parameter p's whole tensor (this TP rank's), in whole's dtype: a Muon matrix
    broadcast from its owner, an AdamW tensor's rows all-gathered. A collective over the DP group."""
    if p.dp_owner is None:
        return dist.all_gather_into_tensor(whole, p.data.to(whole.dtype), group=p.dp_group, async_op=async_op)
    if dist.get_rank(p.dp_group) == p.dp_owner:
        whole.copy_(p.data)
    return dist.broadcast(whole, src=dist.get_global_rank(p.dp_group, p.dp_owner), group=p.dp_group, async_op=async_op)


def whole_over_dp(t, p):
    """p's whole fp32 tensor (this TP rank's) where p is sharded (checkpoints, whole copies of the model); `t`, what
    this rank holds of it, where it is not."""
    if not is_dp_sharded(p):
        return t
    whole = torch.empty(p.dp_shape, dtype=t.dtype, device=t.device)
    gather_whole(whole, p)
    return whole


def embedding_types():
    """The modules whose weight is a lookup table (a lookup's backward needs only the ids, not the table)."""
    from nanochat.tensor_parallel import ColumnParallelEmbedding, VocabParallelEmbedding
    return (nn.Embedding, ColumnParallelEmbedding, VocabParallelEmbedding)


class Unit:
    """A module called through ShardedWeights.run: its sharded parameters, where each sits (module, attribute),
    and whether its backward reads each: not an embedding table (a lookup's backward needs only the ids), unless the
    module's forward runs again in its backward (gpt.Block under --recompute)."""

    def __init__(self, module):
        self.recomputes = getattr(module, "recompute", "none") != "none"
        self.params, self.slots, self.backward_reads = [], [], []
        for name, p in module.named_parameters():
            if is_dp_sharded(p):
                owner_name, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                self.params.append(p)
                self.slots.append((owner, attr))
                self.backward_reads.append(self.recomputes or not isinstance(owner, embedding_types()))
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
        for p, t in zip(unit.params, self.wholes):  # what the model's kernels read off a weight (fp8 under TP)
            for attr in ("tp_dim", "tp_size", "tp_group"):
                if hasattr(p, attr):
                    setattr(t, attr, getattr(p, attr))
        self.works, self.previous, self.output, self.done = [], None, None, False
        weights.count(sum(t.numel() * t.element_size() for t in self.wholes))
        self.fill(range(len(self.wholes)))

    def fill(self, which):
        """Post the collectives that fill wholes[i] for i in `which`: each Muon matrix broadcast from its owner, each
        AdamW tensor's rows all-gathered, in the compute dtype. Refilling a tensor that autograd saved in the forward
        is no change to it (the same values again): its version counter is kept from here until wait() (gloo writes
        the results when they arrive)."""
        which = list(which)
        if not which:
            return
        self.versions = torch.autograd._unsafe_preserve_version_counter(tuple(self.wholes[i] for i in which))
        self.versions.__enter__()
        self.works += [gather_whole(self.wholes[i], self.unit.params[i], async_op=True) for i in which]

    def wait(self):
        for work in self.works:
            work.wait()
        if self.works:
            self.versions.__exit__(None, None, None)
        self.works = []
        return self.wholes

    def release(self, which=None):
        """Free the whole tensors' memory (all, or those in `which`): the tensors stay, empty (autograd keeps them
        for the backward)."""
        self.wait()
        for i in range(len(self.wholes)) if which is None else which:
            t = self.wholes[i]
            self.weights.count(-t.untyped_storage().nbytes())
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.untyped_storage().resize_(0)

    def unread(self):
        """The whole tensors the module's backward does not read (Unit.backward_reads)."""
        return [i for i, reads in enumerate(self.unit.backward_reads) if not reads]

    def emptied(self):
        """The whole tensors the backward reads that are empty (to be gathered again)."""
        return [i for i, reads in enumerate(self.unit.backward_reads)
                if reads and self.wholes[i].untyped_storage().nbytes() == 0]

    def refill(self):
        """Before the backward: the whole tensors it reads, gathered again into the same tensors."""
        which = self.emptied()
        for i in which:
            t = self.wholes[i]
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.untyped_storage().resize_(t.numel() * t.element_size())
            self.weights.count(t.numel() * t.element_size())
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
    """A gathering's whole weights as autograd outputs of the shards, so that their gradients come back here: the
    backward sends them to their owners (ShardedWeights.send_gradients) and gives the shards none directly (a
    gradient lands in its owner's .grad when its send completes)."""

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
    """The weights of a model sharded over the DP group (module docstring): cuts them at construction, then runs
    each sharded module's call with its whole weights (run) and sends the gradients home (send_gradients)."""

    def __init__(self, model, dp, keep_gathered=False):
        self.group, self.rank, self.keep = dp.group, dp.rank, keep_gathered
        self.dtype = model.compute_dtype
        owner = {p: stack_owner.owner(i) for params, stack_owner in zip(dp.muon_stacks, dp.owners)
                 for i, p in enumerate(params)}
        with torch.no_grad():
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
        self.sent = []      # (parameter, its gradient landing here or None, the send's work, the buffer it reads)
        self.gathered_bytes = self.gathered_peak = 0  # whole weights alive now, and the most at once

    def count(self, nbytes):
        self.gathered_bytes += nbytes
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def run(self, module, fn, *args):
        """fn(*args) with `module`'s whole weights in place: wait for their gathering (posted one call ahead), post
        the next module's, call, put the shards back, free the whole weights (gathered again for the backward,
        unless --keep-gathered) and arrange the backward's part."""
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
        gathered.release(None if not self.keep else gathered.unread())
        # the module called before this one, if its output is this one's input (a few ops away: an L3 layer's sum,
        # the head's norm); not a module of another micro-batch that a pipeline ran in between
        chain = self.chain
        gathered.previous = chain if chain is not None and args and feeds(chain.output, args[0]) else None
        gathered.output, self.chain = x.grad_fn, gathered
        if gathered.emptied() or unit.recomputes:
            x.register_hook(lambda grad: self.before_backward(gathered))
        return out

    def before_backward(self, gathered):
        """A module's backward is about to run: its whole weights gathered again (and the module's before it in the
        forward posted ahead), and under recompute put in place, where the forward that runs again reads them."""
        self.chain = None  # a backward has begun: the next forward starts a new chain
        gathered.refill()
        gathered.wait()
        previous = gathered.previous
        if previous is not None and not previous.done:
            previous.refill()
        if gathered.unit.recomputes:
            gathered.unit.swap(gathered.wholes)

    def send_gradients(self, gathered, grads):
        """A module's backward has ended: each gradient of its whole weights, in fp32, summed over the ranks into its
        owner (a Muon matrix) or into each rank's rows (an AdamW tensor), and the whole weights freed. The sends of
        the module before land now, so that at most two modules' whole gradients are alive."""
        unit = gathered.unit
        if unit.recomputes:
            unit.swap(unit.params)
        earlier = len(self.sent)
        for p, grad in zip(unit.params, grads):
            # a fresh fp32 buffer: the collective sums into it
            g = torch.zeros(p.dp_shape, device=p.device) if grad is None else grad.to(torch.float32, copy=True).contiguous()
            if p.dp_owner is None:
                landing = torch.empty_like(p.data, dtype=torch.float32)
                work = dist.reduce_scatter_tensor(landing, g, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                landing = g if self.rank == p.dp_owner else None
                work = dist.reduce(g, dst=dist.get_global_rank(self.group, p.dp_owner), op=dist.ReduceOp.SUM,
                                   group=self.group, async_op=True)
            self.sent.append((p, landing, work, g))
        gathered.release()
        gathered.done, gathered.wholes, gathered.previous, gathered.output, self.chain = True, [], None, None, None
        self.land(self.sent[:earlier])
        self.sent = self.sent[earlier:]

    @staticmethod
    def land(sent):
        for p, landing, work, _ in sent:
            work.wait()
            if landing is not None:
                p.grad = landing if p.grad is None else p.grad.add_(landing)

    def finish(self):
        """Before the optimizer step: every gradient landed; gatherings posted ahead dropped (the step changes the
        weights they hold)."""
        self.land(self.sent)
        self.sent, self.chain = [], None
        for unit in self.units.values():
            if unit.prefetched is not None:
                unit.prefetched.release()
                unit.prefetched = None
