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
Matrices of the same shape are stacked so one (compiled, on CUDA) call handles a group.

Distributed (no DDP wrapper): the gradients are reduced inside step() over the DP group (SUM, then
divide: gloo has no AVG everywhere). AdamW parameters of at least 1024 elements whose first dim
divides by the DP size are reduce-scattered, each rank updates its slice (and keeps only that slice of state), then the slices
are all-gathered (ZeRO-2 style); the rest are all-reduced and updated everywhere. Muon stacks are
reduce-scattered along the stack so each rank owns whole matrices, orthogonalizes them, and the
updates are all-gathered and applied everywhere. Under tensor parallelism a sharded matrix's gradient
is first all-gathered over the TP group, so Muon always sees the whole matrix and the result does not
depend on the TP degree.

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


class MuonAdamW(torch.optim.Optimizer):
    """groups: dicts with kind='adamw' (lr, betas, eps, weight_decay) or kind='muon' (lr, momentum,
    weight_decay). names: {param: fully qualified name} for saving. dp_group: the data-parallel group
    (None in one process). compute_dtype: Muon's orthogonalization dtype. compile: torch.compile the
    stacked updates (CUDA)."""

    def __init__(self, groups, names, dp_group=None, compute_dtype=torch.float32, compile=False):
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
        # Muon: stacks of same-shape matrices (full shape under TP), in a fixed order on every rank
        self.muon_stacks = []
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            by_shape = {}
            for p in group["params"]:
                by_shape.setdefault(tuple(tp.full_shape(p)), []).append(p)
            for shape, params in by_shape.items():
                self.muon_stacks.append(MuonStack(group, shape, params, self.dp_size, self.dp_rank))

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

    # --- the step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self):
        self._zero_missing_grads()
        self.adamw_step += 1
        W = self.dp_size
        # 1) launch every gradient reduction (async), Muon's first: they feed the most compute.
        # Large AdamW tensors are reduce-scattered; the small ones are all-reduced as one flat buffer.
        pending, small = [], []
        for stack in self.muon_stacks:
            pending.append(("muon", stack, stack.reduce_grads_async(self.dp_group)))
        for group in self.param_groups:
            if group["kind"] != "adamw":
                continue
            for p in group["params"]:
                tp.reduce_partial_grad(p)  # sequence-parallel partial grads: sum over TP first
                if W > 1 and self._adamw_sharded(p):
                    out = torch.empty((p.size(0) // W, *p.shape[1:]), dtype=p.grad.dtype, device=p.device)
                    work = dist.reduce_scatter_tensor(out, p.grad, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
                    pending.append(("adamw", (group, p, out), work))
                else:
                    small.append((group, p))
        if small and W > 1:
            flat = torch.cat([p.grad.reshape(-1) for _, p in small])
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
            pending.append(("adamw_flat", flat, work))
        else:
            pending += [("adamw", (group, p, p.grad), None) for group, p in small]
        # 2) as each reduction lands: update, and launch the gathers (async)
        gathers = []
        for kind, item, work in pending:
            if work is not None:
                work.wait()
            if kind == "muon":
                gathers.append(item.update_and_gather_async(self._muon_update, self.compute_dtype, self.dp_group))
                continue
            if kind == "adamw_flat":  # unflatten the small tensors' grads, then update each
                offset, items = 0, []
                for group, p in small:
                    items.append((group, p, item[offset:offset + p.numel()].view_as(p)))
                    offset += p.numel()
            else:
                items = [item]
            for group, p, g in items:
                self._adamw_apply(group, p, g, gathers)
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
    padded to a multiple of W and rank r owns matrices [r*K/W, (r+1)*K/W): it keeps their momentum and
    second-moment state and computes their updates."""

    def __init__(self, group, shape, params, dp_size, dp_rank):
        self.group, self.shape, self.params = group, shape, params
        self.K = len(params)
        self.W, self.rank = dp_size, dp_rank
        self.per_rank = math.ceil(self.K / self.W)
        self.K_pad = self.per_rank * self.W
        device = params[0].device
        self.momentum = torch.zeros((self.per_rank, *shape), dtype=torch.float32, device=device)
        self.second = torch.zeros((self.per_rank, shape[0], 1), dtype=torch.float32, device=device)

    def reduce_grads_async(self, dp_group):
        """Stack the (TP-gathered) grads, pad, and reduce-scatter along the stack over DP."""
        grads = [tp.gather_full_grad(p) for p in self.params]
        stacked = torch.stack(grads + [torch.zeros_like(grads[0])] * (self.K_pad - self.K))
        if self.W == 1:
            self.local_grads = stacked
            return None
        self.local_grads = torch.empty((self.per_rank, *self.shape), dtype=stacked.dtype, device=stacked.device)
        return dist.reduce_scatter_tensor(self.local_grads, stacked, op=dist.ReduceOp.SUM, group=dp_group, async_op=True)

    def update_and_gather_async(self, update_fn, compute_dtype, dp_group):
        if self.W > 1:
            self.local_grads.div_(self.W)
        momentum = torch.tensor(self.group["momentum"], dtype=torch.float32)
        local_update = update_fn(self.local_grads, self.momentum, self.second, momentum, compute_dtype)
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
            u = tp.local_shard(self.updates[i], p).float()
            muon_apply(p.data, u, lr * shape_scale, lr * wd)
        self.updates = self.local_grads = None

    def gather_state(self, dp_group):
        if self.W == 1:
            return self.momentum, self.second
        m = torch.empty((self.K_pad, *self.shape), dtype=torch.float32, device=self.momentum.device)
        s = torch.empty((self.K_pad, self.shape[0], 1), dtype=torch.float32, device=self.second.device)
        dist.all_gather_into_tensor(m, self.momentum, group=dp_group)
        dist.all_gather_into_tensor(s, self.second, group=dp_group)
        return m, s

    def load_state(self, entries):
        lo = self.rank * self.per_rank
        for j in range(self.per_rank):
            i = lo + j
            if i < self.K:
                self.momentum[j].copy_(entries[i]["momentum"])
                self.second[j].copy_(entries[i]["second"])
