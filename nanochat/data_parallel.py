"""
Data parallelism, written out (no DDP wrapper): gradients are summed over the DP group and the optimizer's work is
shared out, no two ranks computing the same update (ZeRO-1: gradients stay whole until the step; ZeRO-3,
sharding.py, builds on the same ownership).

Collectives, all over the DP group (gloo has no AVG everywhere: gradients are summed, then divided by W):
  reduce_scatter_tensor   per Muon round: its W gradients -> this rank's matrix, summed
  reduce_scatter_tensor   per large AdamW tensor: its gradient -> this rank's rows, summed
  all_reduce              the small AdamW gradients, one flat buffer
  all_gather_into_tensor  per Muon stack: every owner's updates, in the compute dtype (half the bytes in bf16)
  all_gather_into_tensor  per large AdamW tensor: the updated rows
  broadcast_object_list   once, with overlap: rank 0's bucket launch order
  all_gather_into_tensor  for a checkpoint: the owners' optimizer state, into whole tensors
  all_reduce              the step's loss, for the log

Who updates what, each a bucket (one collective): Muon matrices of one shape form a stack, cut into rounds of W
consecutive matrices, rank r owning matrix r of every round, whole (Muon orthogonalizes whole matrices; a round's
matrices are neighbouring layers, whose gradients are final together); AdamW tensors of >= 1024 elements whose first
dim divides by W are owned by rows; the other AdamW tensors are summed as one flat buffer and updated everywhere.

Overlap (--overlap-grad-reduce): in the last micro-batch's backward (a pipeline: each chunk's last) each bucket
launches once its gradients are final (post-accumulate-grad hooks), in one order on every rank: rank 0's readiness
order in its first overlapped backward.
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from nanochat.distributed import all_gather_single, reduce_scatter_single, wait_for


class RoundRobin:
    """K same-shape matrices over W ranks; `rounds` is also how many each rank owns (the stack padded to rounds x W)."""

    def __init__(self, K, W, rank):
        self.K, self.W, self.rank = K, W, rank
        self.rounds = math.ceil(K / W)

    def owned(self, j):
        """Index of this rank's j-th matrix, or None where the padding falls."""
        i = j * self.W + self.rank
        return i if i < self.K else None

    def slot(self, i):
        """Where matrix i lands in an all-gather of the ranks' (rounds, ...) stacks."""
        return (i % self.W) * self.rounds + i // self.W

    def owner(self, i):
        return i % self.W


def large(p):
    """An AdamW tensor worth sharing out by rows (the small ones are summed as one flat buffer)."""
    return p.ndim > 0 and p.numel() >= 1024


def owned_by_rows(p, size):
    """Whether an AdamW tensor is shared out by rows over `size` ranks (else it is updated, and held, whole)."""
    return size > 1 and large(p) and p.size(0) % size == 0


def held_whole(named_params, size):
    """The large AdamW tensors (name, rows) that `size` ranks cannot share by rows, as their rows do not divide: each
    rank holds their optimizer state (and under --shard-params their weights) whole."""
    return [(n, p.size(0)) for n, p in named_params if size > 1 and large(p) and p.size(0) % size]


class GradBucket:
    """Parameters whose gradient reduction is one collective, which `launch(bucket)` starts (its work, or None)."""

    def __init__(self, kind, params, launch):
        self.kind, self.params, self.launch = kind, params, launch  # kind: "muon", "rows" or "flat"
        self.reset()

    def reset(self):
        self.remaining = len(self.params)  # members whose gradient is not final yet (overlap only; 0: ready to launch)
        self.launched = False
        self.work = self.result = None  # the collective in flight; what the step reads once it is done

    def start(self):
        self.work, self.launched = self.launch(self), True

    def wait(self):
        if self.work is not None:
            self.work.wait()


class DataParallel:
    """One optimizer's gradient reduction and sharing out over the DP group (None: one rank, methods local); muon_stacks
    (same-shape matrices) and adamw_params alike on every rank. shard_params: ZeRO-3 (training.setup sets `weights`)."""

    def __init__(self, muon_stacks, adamw_params, group=None, overlap=False, shard_params=False):
        self.group = group
        self.size, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
        self.muon_stacks = muon_stacks
        self.owners = [RoundRobin(len(params), self.size, self.rank) for params in muon_stacks]
        self.row_params = [p for p in adamw_params if owned_by_rows(p, self.size)]
        self.by_rows = set(self.row_params)
        self.shard_params, self.weights = shard_params, None
        self.muon_grads = [None] * len(muon_stacks)  # per stack: this rank's summed (rounds, *shape) gradients
        # the default launch order: Muon's first (they feed the most compute), then the large AdamW tensors, then
        # the small ones; with sharded weights only the small ones (the rest travel in ShardedWeights' backward)
        self.muon_buckets = [] if shard_params else \
            [[GradBucket("muon", params[g * self.size:(g + 1) * self.size], partial(self._reduce_round, s, g))
              for g in range(owner.rounds)] for s, (params, owner) in enumerate(zip(muon_stacks, self.owners))]
        self.adamw_buckets = [] if shard_params else \
            [GradBucket("rows", [p], self._reduce_rows) for p in adamw_params if self.owns_rows(p)]
        small = [p for p in adamw_params if not self.owns_rows(p)]
        if small:
            self.adamw_buckets.append(GradBucket("flat", small, self._reduce_flat))
        self.buckets = [b for stack in self.muon_buckets for b in stack] + self.adamw_buckets
        self.overlap = overlap and self.size > 1 and not shard_params  # sharded: each module's gradients go at once
        self._armed, self._launch_order, self._first_ready, self._final = False, None, [], set()
        self.launched_in_backward = 0  # buckets the last step's backward launched (for logs and tests)
        if self.overlap:
            self._bucket_of = {p: b for b in self.buckets for p in b.params}
            for p in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def owns_rows(self, p):
        return p in self.by_rows

    def my_rows(self, t):
        return t.chunk(self.size)[self.rank]  # owned by rows: the first dim divides by the size

    def rows_held(self, p):
        """This rank's rows of an AdamW tensor owned by rows: all it holds when the weights are sharded."""
        return p.data if self.shard_params else self.my_rows(p.data)

    def finish_backward(self):
        """Before the step reads any gradient: the sharded gradients still travelling, landed."""
        if self.weights is not None:
            self.weights.finish()

    # --- the reductions, one collective per bucket -----------------------------------
    def _reduce_round(self, s, g, bucket):
        """Muon stack s, round g: this rank's matrix of the round, summed over DP, into muon_grads[s][g]."""
        grads = [p.grad for p in bucket.params]
        if self.muon_grads[s] is None:
            self.muon_grads[s] = grads[0].new_empty((self.owners[s].rounds, *grads[0].shape))
        if self.size == 1:
            self.muon_grads[s][g].copy_(grads[0])
            return None
        stacked = torch.stack(grads + [torch.zeros_like(grads[0])] * (self.size - len(grads)))
        return reduce_scatter_single(self.muon_grads[s][g:g + 1], stacked, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)

    def _reduce_rows(self, bucket):
        p, = bucket.params
        bucket.result = torch.empty_like(self.my_rows(p.grad))
        return reduce_scatter_single(bucket.result, p.grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def _reduce_flat(self, bucket):
        if self.size == 1:  # nothing to reduce: the step reads the gradients in place
            return None
        bucket.result = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        return dist.all_reduce(bucket.result, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    # --- overlap with the backward ---------------------------------------------------
    def prepare_last_backward(self, params=None):
        """Call right before the last backward adding to `params`' gradients (None: all of them; a pipeline arms
        each chunk's before its last backward); a no-op without overlap (module docstring)."""
        if not self.overlap:
            return
        if not self._armed:  # the step's first: every bucket reset
            self.finish_step()
            self._armed, self._first_ready, self.launched_in_backward, self._final = True, [], 0, set()
        self._final.update(self._bucket_of if params is None else params)

    @torch.no_grad()
    def _grad_ready(self, p):
        """post-accumulate-grad hook: p's gradient is final for this step once p is armed."""
        if not self._armed or p not in self._final:
            return
        b = self._bucket_of[p]
        b.remaining -= 1
        if b.remaining > 0:
            return
        if self._launch_order is None:  # the first overlapped backward only records the order
            self._first_ready.append(b)
            return
        order = self._launch_order  # launched in order: the first launched_in_backward of them
        while self.launched_in_backward < len(order) and order[self.launched_in_backward].remaining <= 0:
            order[self.launched_in_backward].start()
            self.launched_in_backward += 1

    def _agree_on_launch_order(self):
        """Rank 0's readiness order, then the buckets never ready (no gradient from the last micro-batch)."""
        seen = [[self.buckets.index(b) for b in self._first_ready]]
        dist.broadcast_object_list(seen, src=dist.get_global_rank(self.group, 0), group=self.group)
        order = [self.buckets[i] for i in seen[0]]
        return order + [b for b in self.buckets if b not in order]

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
        """(p, summed gradient) per AdamW tensor as buckets land: this rank's rows where owned by rows, else whole."""
        if self.shard_params:  # the rows' gradients landed in .grad during the backward
            yield from ((p, p.grad) for p in self.row_params)
        for b in self.adamw_buckets:
            b.wait()
            if b.kind == "rows":
                yield b.params[0], b.result
            else:  # the flat buffer, unflattened (one rank: the gradients in place)
                parts = [None] * len(b.params) if b.result is None else b.result.split([p.numel() for p in b.params])
                yield from ((p, p.grad if g is None else g.view_as(p)) for p, g in zip(b.params, parts))

    def gather_muon_updates(self, s, updates):
        """Every owner's (rounds, ...) updates of stack s, all-gathered: (full stack, work), matrix i at slot(i)."""
        if self.size == 1:
            return updates, None
        full = updates.new_empty((self.owners[s].rounds * self.size, *updates.shape[1:]))
        return full, all_gather_single(full, updates, group=self.group, async_op=True)

    def gather_rows(self, rows):
        """Every owner's rows of an AdamW tensor, all-gathered: (whole tensor, work)."""
        full = rows.new_empty((rows.size(0) * self.size, *rows.shape[1:]))
        return full, all_gather_single(full, rows.contiguous(), group=self.group, async_op=True)

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
        return wait_for([work], full)
