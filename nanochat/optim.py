"""
One optimizer, two update rules chosen per parameter group (`kind`):

AdamW (embeddings, value embeddings, lm_head, scalars): the usual, eps 1e-10, decoupled decay.

Muon (every 2-D matrix in the blocks), per matrix G:
  1. Nesterov momentum:             M = lerp(M, G, 1 - mu);  U = lerp(G, M, mu)
  2. row equalisation:              rescale each row of U to the mean row norm
  3. orthogonalize:                 5 Polar Express iterations (arXiv 2505.16932) in the compute
                                    dtype (bf16 on GPU; fp32 under NANOCHAT_DTYPE=float32)
  4. Frobenius renormalisation:     ||U||_F = sqrt(min(rows, cols))
  5. NorMuon (arXiv 2510.05491):    per-row second moment v = lerp(v, mean(U^2, row), 1 - beta2);
                                    U /= sqrt(v) + eps, then back to the norm of step 4
  6. apply:                         W -= lr * max(1, rows/cols)^0.5 * U + lr * wd * [U*W > 0] * W
                                    (cautious weight decay: only where update and weight agree in sign)
Matrices of the same shape (and sharding) are stacked so one (compiled, on CUDA) call handles a group.

Distributed (no DDP wrapper): the gradients are reduced over the DP group (SUM, then divide: gloo
has no AVG everywhere), one collective per bucket. AdamW parameters of at least 1024 elements whose
first dim divides by the DP size are reduce-scattered, each rank updates its slice (and keeps only that
slice of state), then the slices are all-gathered (ZeRO-2 style); the rest are all-reduced as one flat
buffer and updated everywhere. Muon stacks are cut into rounds of W (DP size) consecutive matrices,
each round reduce-scattered so that rank r receives the r-th matrix of every round whole: ownership
is interleaved (r, r+W, ...), each rank orthogonalizes whole matrices, and the updates are all-gathered
and applied everywhere. Under tensor parallelism the rounds carry TP shards and each rank all-gathers
only its own matrices over the TP group before Muon (sum over DP, then gather over TP: the same
numbers on 1/W of the bytes), so Muon always sees the whole matrix and the result does not depend
on the TP degree. Replicated parameters that see only this rank's tokens under sequence parallelism
(tp_partial_grad: the lambdas, L3's tables and matrices) have their DP-reduced gradients summed over
the TP group before their update, AdamW and Muon alike.

Overlap (overlap_grad_reduce): without it every reduction starts in step(), after the whole backward,
and all of it is exposed. With it, the training step calls prepare_last_backward() right before the
backward of its last micro-batch; a post-accumulate-grad hook on every parameter counts its bucket
down, and a bucket whose gradients are all final launches its collective (async) while the rest of the
backward runs; step() launches what is left and waits only on what it reads. Buckets are the units of
ownership above (a Muon round, one large AdamW tensor, the small AdamW tensors together), so the
reduction is the same collective with or without overlap. Collectives on a group must be issued in one
order on every rank, so buckets launch in a fixed order, each as soon as it and every bucket before it
are ready: the order in which rank 0's buckets became ready in its first overlapped backward
(broadcast over DP; that first step launches everything from step()). Under PP each stage arms its
own last backward inside the schedule; under TP the hooks issue only DP collectives. With DP = 1 no
hooks are registered. Under torch.compile a whole-model graph produces every gradient at its end, so
base_train compiles block by block when overlapping (as under PP).

State is saved and loaded in a layout-free form (full tensors per parameter name, see
full_state_dict / load_full_state_dict), so a run can resume on another number of ranks.
"""

import math

import torch
import torch.distributed as dist

from nanochat import tensor_parallel as tp

# Polar Express coefficients for 5 iterations of X <- aX + (bA + cA^2)X, A = X X^T (arXiv 2505.16932,
# with the paper's safety factor): they drive singular values in (0, 1] towards 1 faster than Newton-Schulz.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
NORMUON_BETA2 = 0.95
NORMUON_EPS = 1e-10


def muon_update(grads, momentum_buf, second_buf, momentum, compute_dtype: torch.dtype):
    """Steps 1-5 for a stack of matrices (K, m, n). Updates the two state buffers in place and returns
    the update (K, m, n) in fp32."""
    momentum_buf.lerp_(grads, 1 - momentum)
    u = grads.lerp(momentum_buf, momentum)
    # row equalisation: every row gets the mean row norm
    row_norms = u.norm(dim=-1, keepdim=True)
    u = u * (row_norms.mean(dim=-2, keepdim=True) / (row_norms + 1e-7))
    # Polar Express on the wide orientation (fewer FLOPs for A = X X^T)
    x = u.to(compute_dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    if tall:
        x = x.mT
    u = x.float()
    target_norm = math.sqrt(min(u.size(-2), u.size(-1)))
    u = u * (target_norm / (u.norm(dim=(-2, -1), keepdim=True) + 1e-7))
    # NorMuon: normalize each row (output neuron) by its running RMS, keep the overall norm
    second_buf.lerp_(u.square().mean(dim=-1, keepdim=True), 1 - NORMUON_BETA2)
    u = u / (second_buf.sqrt() + NORMUON_EPS)
    u = u * (target_norm / (u.norm(dim=(-2, -1), keepdim=True) + 1e-7))
    return u


def muon_apply(p, u, step_size, decay):
    """Step 6 on one matrix (or its TP shard): the update plus cautious weight decay."""
    mask = (u * p) > 0
    p.sub_(step_size * u + decay * mask * p)


def adamw_update(p, g, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd):
    """One AdamW step on a tensor (or a slice of one), in place."""
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.lerp_(g.square(), 1 - beta2)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    denom = (exp_avg_sq / bias2).sqrt() + eps
    p.mul_(1 - lr * wd)
    p.sub_(exp_avg / denom * (lr / bias1))


class GradBucket:
    """Parameters whose DP gradient reduction is one collective: a round of a Muon stack, one large
    AdamW tensor (reduce-scattered), or the small AdamW tensors (one flat all-reduce). `launch` starts
    the collective and returns its work handle (None when nothing is in flight)."""

    def __init__(self, kind, params, launch):
        self.kind, self.params, self.launch = kind, params, launch
        self.reset()

    def reset(self):
        self.remaining = len(self.params)  # members whose gradient is not final yet (overlap only)
        self.ready = False
        self.work = None
        self.launched = False
        self.result = None  # what step() reads once the work is done: the reduced slice / flat buffer

    def start(self):
        self.work = self.launch(self)
        self.launched = True

    def wait(self):
        if self.work is not None:
            self.work.wait()


class MuonAdamW(torch.optim.Optimizer):
    """groups: dicts with kind='adamw' (lr, betas, eps, weight_decay) or kind='muon' (lr, momentum,
    weight_decay). names: {param: fully qualified name} for saving. dp_group: the data-parallel group
    (None in one process). compute_dtype: Muon's orthogonalization dtype. compile: torch.compile the
    stacked updates (CUDA). overlap_grad_reduce: start each bucket's DP reduction from a gradient hook
    during the last micro-batch's backward (see prepare_last_backward); no hooks when DP is 1."""

    def __init__(self, groups, names, dp_group=None, compute_dtype=torch.float32, compile=False,
                 overlap_grad_reduce=False):
        for g in groups:
            g["initial_lr"] = g["lr"]
        super().__init__(groups, {})
        self.names = names
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.compute_dtype = compute_dtype
        self.adamw_step = 0
        self._muon_update = torch.compile(muon_update, dynamic=False) if compile else muon_update
        self._adamw_update = torch.compile(adamw_update, dynamic=False) if compile else adamw_update
        # Muon: stacks of same-shape matrices (full shape under TP, and split the same way), in a fixed
        # order on every rank
        self.muon_stacks = []
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            by_shape = {}
            for p in group["params"]:
                key = (tuple(tp.full_shape(p)), getattr(p, "tp_dim", None), getattr(p, "tp_partial_grad", False))
                by_shape.setdefault(key, []).append(p)
            for (shape, _, _), params in by_shape.items():
                self.muon_stacks.append(MuonStack(group, shape, params, self.dp_size, self.dp_rank))
        # the buckets, in the default launch order: Muon's first (they feed the most compute), then the
        # large AdamW tensors one by one, then the small ones as one flat buffer
        self.muon_buckets = [GradBucket("muon", stack.round_params(g), self._round_launcher(stack, g))
                             for stack in self.muon_stacks for g in range(stack.per_rank)]
        self.adamw_buckets, small, self._adamw_group = [], [], {}
        for group in self.param_groups:
            if group["kind"] != "adamw":
                continue
            for p in group["params"]:
                self._adamw_group[p] = group
                if self._adamw_sharded(p):
                    self.adamw_buckets.append(GradBucket("adamw", [p], self._launch_adamw_scatter))
                else:
                    small.append(p)
        if small:
            self.adamw_buckets.append(GradBucket("adamw_flat", small, self._launch_adamw_flat))
        self.buckets = self.muon_buckets + self.adamw_buckets
        # overlap: a hook per parameter counts down its bucket; buckets launch in one order agreed by
        # every DP rank (rank 0's readiness order of the first overlapped backward), so that the
        # collectives of a group are issued in the same sequence everywhere
        self.overlap = overlap_grad_reduce and self.dp_size > 1
        self._armed = False
        self._launch_order = None
        self._first_ready = []
        self._next_launch = 0
        self.launched_in_backward = 0  # buckets the last step's backward launched (for logs and tests)
        if self.overlap:
            self._bucket_of = {p: b for b in self.buckets for p in b.params}
            for p in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    # --- helpers ------------------------------------------------------------------

    def _zero_missing_grads(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:  # e.g. unused value-embedding rows never make grad None, but a
                    p.grad = torch.zeros_like(p)  # stage/layer that did not run would

    def _adamw_sharded(self, p):
        return self.dp_size > 1 and p.ndim > 0 and p.size(0) % self.dp_size == 0 and p.numel() >= 1024

    def _adamw_state(self, p, numel_shape):
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros(numel_shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(numel_shape, dtype=torch.float32, device=p.device)
        return state

    # --- the gradient reductions (DP), one collective per bucket -----------------------

    def _round_launcher(self, stack, g):
        return lambda bucket: stack.reduce_round_async(g, self.dp_group)

    def _launch_adamw_scatter(self, bucket):
        p, = bucket.params
        W = self.dp_size
        bucket.result = torch.empty((p.size(0) // W, *p.shape[1:]), dtype=p.grad.dtype, device=p.device)
        return dist.reduce_scatter_tensor(bucket.result, p.grad, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)

    def _launch_adamw_flat(self, bucket):
        if self.dp_size == 1:  # nothing to reduce: step() reads the gradients in place
            return None
        bucket.result = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        return dist.all_reduce(bucket.result, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)

    def prepare_last_backward(self):
        """Call right before the backward of a step's last micro-batch: from then on each bucket's DP
        reduction starts (async) as soon as all its gradients are final. A no-op without overlap."""
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
        """Rank 0's readiness order, then the buckets that were never ready in it (their parameters got
        no gradient from the last micro-batch), in the default order."""
        index = {id(b): i for i, b in enumerate(self.buckets)}
        seen = [[index[id(b)] for b in self._first_ready]]
        dist.broadcast_object_list(seen, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        order = [self.buckets[i] for i in seen[0]]
        return order + [b for b in self.buckets if all(b is not o for o in order)]

    # --- the step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self):
        self._zero_missing_grads()
        self.adamw_step += 1
        if self._armed and self._launch_order is None:
            self._launch_order = self._agree_on_launch_order()
        self._armed = False
        # 1) launch every reduction the backward has not launched yet (all of them without overlap)
        for b in self._launch_order or self.buckets:
            if not b.launched:
                b.start()
        # 2) as the reductions land: Muon updates (then their all-gathers, async), AdamW updates (then
        # the all-gathers of the sharded ones)
        gathers = []
        rounds = iter(self.muon_buckets)
        for stack in self.muon_stacks:
            for _ in range(stack.per_rank):
                next(rounds).wait()
            gathers.append(stack.update_and_gather_async(self._muon_update, self.compute_dtype, self.dp_group))
        for b in self.adamw_buckets:
            b.wait()
            if b.kind == "adamw":
                p, = b.params
                self._adamw_apply(self._adamw_group[p], p, b.result, gathers)
                continue
            offset = 0  # the flat buffer: unflatten, then update each
            for p in b.params:
                g = p.grad if b.result is None else b.result[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self._adamw_apply(self._adamw_group[p], p, g, gathers)
        for b in self.buckets:
            b.reset()
        # 3) as each gather lands: write parameters / apply Muon updates
        for kind, item, work in gathers:
            if work is not None:
                work.wait()
            if kind == "muon":
                item.apply()
            else:
                p, full = item
                p.data.copy_(full)

    def _adamw_apply(self, group, p, g, gathers):
        """Average the reduced grad, update p (or this rank's slice of it, then queue the all-gather)."""
        W = self.dp_size
        tp.reduce_partial_grad(p, g)  # sequence-parallel partial grads: sum over TP too
        if W > 1:
            g.div_(W)
        beta1, beta2 = group["betas"]
        # LR, decay and step go in as tensors so the compiled update is not recompiled when they change
        args = (torch.tensor(self.adamw_step, dtype=torch.float32), torch.tensor(group["lr"]), beta1, beta2,
                group["eps"], torch.tensor(group["weight_decay"]))
        if W > 1 and self._adamw_sharded(p):
            rows = p.size(0) // W
            local = p.data[self.dp_rank * rows:(self.dp_rank + 1) * rows]
            state = self._adamw_state(p, local.shape)
            self._adamw_update(local, g, state["exp_avg"], state["exp_avg_sq"], *args)
            full = torch.empty_like(p.data)
            work = dist.all_gather_into_tensor(full, local.contiguous(), group=self.dp_group, async_op=True)
            gathers.append(("adamw", (p, full), work))
        else:
            state = self._adamw_state(p, p.shape)
            self._adamw_update(p.data, g, state["exp_avg"], state["exp_avg_sq"], *args)

    # --- layout-free state ----------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self, keep=True):
        """{'adamw_step': n, 'params': {name: {buffer: full fp32 tensor on CPU}}}. A collective: every
        rank of the DP and TP groups must call it; ranks with keep=False (not writing) keep nothing."""
        out = {}
        for group in self.param_groups:
            if group["kind"] != "adamw":
                continue
            for p in group["params"]:
                state = self._adamw_state(p, self._adamw_local_shape(p))
                entry = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    t = state[key]
                    if self._adamw_sharded(p):
                        full = torch.empty((t.size(0) * self.dp_size, *t.shape[1:]), dtype=t.dtype, device=t.device)
                        dist.all_gather_into_tensor(full, t.contiguous(), group=self.dp_group)
                        t = full
                    full = tp.gather_full(t, p)
                    if keep:
                        entry[key] = full.cpu()
                if keep:
                    out[self.names[p]] = entry
        for stack in self.muon_stacks:
            momentum, second = stack.gather_state(self.dp_group)
            if keep:
                for i, p in enumerate(stack.params):
                    out[self.names[p]] = {"momentum": momentum[i].cpu(), "second": second[i].cpu()}
        return {"adamw_step": self.adamw_step, "params": out}

    def _adamw_local_shape(self, p):
        if self._adamw_sharded(p):
            return (p.size(0) // self.dp_size, *p.shape[1:])
        return tuple(p.shape)

    @torch.no_grad()
    def load_full_state_dict(self, sd):
        """Take this rank's part of a layout-free state (see full_state_dict)."""
        self.adamw_step = sd["adamw_step"]
        params = sd["params"]
        for group in self.param_groups:
            if group["kind"] != "adamw":
                continue
            for p in group["params"]:
                name = self.names[p]
                if name not in params:
                    raise KeyError(f"optimizer state has no entry for {name}")
                state = self._adamw_state(p, self._adamw_local_shape(p))
                for key in ("exp_avg", "exp_avg_sq"):
                    t = tp.local_shard(params[name][key], p)
                    if self._adamw_sharded(p):
                        rows = t.size(0) // self.dp_size
                        t = t[self.dp_rank * rows:(self.dp_rank + 1) * rows]
                    state[key].copy_(t)
        for stack in self.muon_stacks:
            stack.load_state([params[self.names[p]] for p in stack.params])


class MuonStack:
    """Same-shape Muon matrices of one group, stacked. With K matrices and W DP ranks, the stack is
    padded to a multiple of W and cut into rounds of W consecutive matrices; rank r owns matrix r of
    every round (matrices r, r+W, r+2W, ...): it keeps their momentum and second-moment state and
    computes their updates. A round is one reduce-scatter, and the matrices of a round are neighbouring
    layers, whose gradients become final close together in the backward."""

    def __init__(self, group, shape, params, dp_size, dp_rank):
        self.group, self.shape, self.params = group, shape, params
        self.K = len(params)
        self.W, self.rank = dp_size, dp_rank
        self.per_rank = math.ceil(self.K / self.W)
        self.K_pad = self.per_rank * self.W
        device = params[0].device
        self.momentum = torch.zeros((self.per_rank, *shape), dtype=torch.float32, device=device)
        self.second = torch.zeros((self.per_rank, shape[0], 1), dtype=torch.float32, device=device)
        self.local_grads = None

    def round_params(self, g):
        return self.params[g * self.W:(g + 1) * self.W]

    def _slot(self, i):
        """Where matrix i lands in an all-gather of the ranks' (per_rank, ...) stacks."""
        return (i % self.W) * self.per_rank + i // self.W

    def reduce_round_async(self, g, dp_group):
        """Reduce-scatter round g's gradients (TP shards as they are) over DP: this rank receives the
        sum of its matrix of the round into local_grads[g]."""
        grads = [p.grad for p in self.round_params(g)]
        if self.local_grads is None:
            self.local_grads = torch.empty((self.per_rank, *grads[0].shape), dtype=grads[0].dtype, device=grads[0].device)
        if self.W == 1:
            self.local_grads[g].copy_(grads[0])
            return None
        stacked = torch.stack(grads + [torch.zeros_like(grads[0])] * (self.W - len(grads)))
        return dist.reduce_scatter_tensor(self.local_grads[g:g + 1], stacked, op=dist.ReduceOp.SUM, group=dp_group, async_op=True)

    def update_and_gather_async(self, update_fn, compute_dtype, dp_group):
        # under TP, gather the whole matrices of this rank's rounds (summing over DP first and gathering
        # over TP after is the same sum, on 1/W of the bytes)
        p0 = self.params[0]
        grads = self.local_grads
        if tp.is_sharded(p0):
            grads = torch.stack([tp.gather_full(grads[j], p0) for j in range(self.per_rank)])
        tp.reduce_partial_grad(p0, grads)  # replicated matrices under sequence parallelism (L3): sum over TP
        if self.W > 1:
            grads.div_(self.W)
        momentum = torch.tensor(self.group["momentum"], dtype=torch.float32)
        local_update = update_fn(grads, self.momentum, self.second, momentum, compute_dtype)
        self.local_grads = None
        # send the update in the compute dtype: half the bytes in bf16, exact in fp32
        local_update = local_update.to(compute_dtype)
        if self.W == 1:
            self.updates = local_update
            return ("muon", self, None)
        self.updates = torch.empty((self.K_pad, *self.shape), dtype=compute_dtype, device=local_update.device)
        return ("muon", self, dist.all_gather_into_tensor(self.updates, local_update, group=dp_group, async_op=True))

    def apply(self):
        lr, wd = self.group["lr"], self.group["weight_decay"]
        shape_scale = max(1.0, self.shape[0] / self.shape[1]) ** 0.5  # from the full shape, not the shard
        for i, p in enumerate(self.params):
            u = tp.local_shard(self.updates[self._slot(i)], p).float()
            muon_apply(p.data, u, lr * shape_scale, lr * wd)
        self.updates = None

    def gather_state(self, dp_group):
        """(momentum, second) of the K matrices, in stack order."""
        if self.W == 1:
            return self.momentum, self.second
        m = torch.empty((self.K_pad, *self.shape), dtype=torch.float32, device=self.momentum.device)
        s = torch.empty((self.K_pad, self.shape[0], 1), dtype=torch.float32, device=self.second.device)
        dist.all_gather_into_tensor(m, self.momentum, group=dp_group)
        dist.all_gather_into_tensor(s, self.second, group=dp_group)
        slots = [self._slot(i) for i in range(self.K)]
        return m[slots], s[slots]

    def load_state(self, entries):
        for j in range(self.per_rank):
            i = j * self.W + self.rank
            if i < self.K:
                self.momentum[j].copy_(entries[i]["momentum"])
                self.second[j].copy_(entries[i]["second"])
