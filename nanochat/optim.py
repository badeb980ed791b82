"""
One optimizer, two update rules chosen per parameter group (`kind`):

AdamW (embeddings, value embeddings, lm_head, scalars): the usual, eps 1e-10, decoupled decay.

Muon (every 2-D matrix in the blocks), per matrix G:
  1. Nesterov momentum:             M = lerp(M, G, 1 - mu);  U = lerp(G, M, mu)
  2. row equalisation:              rescale each row of U to the mean row norm
  3. orthogonalize:                 5 Polar Express iterations (arXiv 2505.16932) in the compute dtype
  4. Frobenius renormalisation:     ||U||_F = sqrt(min(rows, cols))
  5. NorMuon (arXiv 2510.05491):    per-row second moment v = lerp(v, mean(U^2, row), 1 - beta2);
                                    U /= sqrt(v) + eps, then back to the norm of step 4
  6. apply:                         W -= lr * max(1, rows/cols)^0.5 * U + lr * wd * [U*W > 0] * W
                                    (cautious weight decay: only where update and weight agree in sign)
Matrices of the same shape are stacked so one (compiled, on CUDA) call updates a group.

The step starts the data-parallel reductions the backward has not (data_parallel.py), updates what this rank owns as
its gradients land and applies the owners' all-gathered updates. Under TP Muon sees whole matrices, so the result
does not depend on the TP degree: the TP ranks of an owner share its matrices out, each receiving the shards of its
share (summed over DP) by one all-to-all, updating them whole and returning the update's shards by another
(tensor_parallel.whole_rounds); each rank applies its shard. State is saved as whole tensors per parameter name: a
run resumes on any number of ranks.
"""

import math

import torch
import torch.distributed as dist

from nanochat import tensor_parallel as tp
from nanochat.common import UserError

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


PARAM_GROUPS = ("embeddings", "lm_head", "scalars", "matrices", "l3_tables", "moe_routers", "moe_experts")  # its order


def param_groups(model, embedding_lr, unembedding_lr, matrix_lr, scalar_lr, weight_decay, l3_table_lr=None):
    """Each parameter's update rule and LR; the embeddings', L3 tables' (the embeddings' LR unless given) and lm_head's
    AdamW LRs scale with (model_dim/768)^-0.5 (tuned at d12); MoE routers take the lm_head's (moe.py says why)."""
    dim_scale = (model.config.n_embd / 768) ** -0.5
    from nanochat.moe import expert_parameters
    table_ids = {id(p) for layer in model.l3.values() for p in layer.table_parameters()}
    expert_ids = {id(p) for p in expert_parameters(model)}
    params = {group: [] for group in PARAM_GROUPS}
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            params["lm_head"].append(p)
        elif name == "wte.weight" or name.endswith("value_embed.weight"):
            params["embeddings"].append(p)
        elif id(p) in table_ids:
            params["l3_tables"].append(p)
        elif name.endswith("mlp.router.weight"):
            params["moe_routers"].append(p)
        elif id(p) in expert_ids:  # MoE's routed experts
            params["moe_experts"].append(p)
        elif p.ndim == 2 and name.startswith(("blocks.", "l3.")):
            params["matrices"].append(p)
        else:  # lambdas, smear gate, L3 norms
            params["scalars"].append(p)
    adamw = dict(kind="adamw", betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    muon = dict(kind="muon", lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
    rules = {"embeddings": dict(adamw, lr=embedding_lr * dim_scale), "scalars": dict(adamw, lr=scalar_lr),
             "lm_head": dict(adamw, lr=unembedding_lr * dim_scale), "matrices": muon}
    table_lr = embedding_lr if l3_table_lr is None else l3_table_lr
    rules |= {"l3_tables": dict(adamw, lr=table_lr * dim_scale), "moe_routers": rules["lm_head"], "moe_experts": muon}
    return [dict(rules[group], name=group, params=params[group]) for group in PARAM_GROUPS if params[group]]


def split_experts(groups, expert_parallel):
    """(groups reduced over all DP ranks, the experts' group): under --ep experts reduce over the ranks holding them."""
    is_experts = [expert_parallel and g["name"] == "moe_experts" for g in groups]
    return [g for g, e in zip(groups, is_experts) if not e], [g for g, e in zip(groups, is_experts) if e]


def muon_update(grads, momentum_buf, second_buf, momentum, compute_dtype: torch.dtype):
    """Steps 1-5 on a stack (K, m, n): updates the state buffers in place, returns the fp32 update (K, m, n)."""
    momentum_buf.lerp_(grads, 1 - momentum)
    u = grads.lerp(momentum_buf, momentum)
    row_norms = u.norm(dim=-1, keepdim=True)  # step 2: every row to the mean row norm
    u = u * (row_norms.mean(dim=-2, keepdim=True) / (row_norms + 1e-7))
    tall = u.size(-2) > u.size(-1)  # Polar Express on the wide orientation (fewer FLOPs for A = X X^T)
    x = u.to(compute_dtype).mT if tall else u.to(compute_dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    u = (x.mT if tall else x).float()
    target_norm = math.sqrt(min(u.size(-2), u.size(-1)))
    u = u * (target_norm / (u.norm(dim=(-2, -1), keepdim=True) + 1e-7))
    second_buf.lerp_(u.square().mean(dim=-1, keepdim=True), 1 - NORMUON_BETA2)  # step 5: NorMuon
    u = u / (second_buf.sqrt() + NORMUON_EPS)
    u = u * (target_norm / (u.norm(dim=(-2, -1), keepdim=True) + 1e-7))
    return u


def adamw_update(p, g, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd):
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.lerp_(g.square(), 1 - beta2)
    denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt() + eps
    p.mul_(1 - lr * wd)
    p.sub_(exp_avg / denom * (lr / (1 - beta1 ** step)))


def muon_stacks(groups):
    """[(group, full shape, params)]: Muon's matrices by shape (full under TP, split alike), in one order everywhere."""
    stacks = []
    for group in (g for g in groups if g["kind"] == "muon"):
        by_shape = {}
        for p in group["params"]:
            key = (tuple(tp.full_shape(p)), getattr(p, "tp_dim", None), hasattr(p, "tp_partial_grad"))
            by_shape.setdefault(key, []).append(p)
        stacks += [(group, shape, params) for (shape, _, _), params in by_shape.items()]
    return stacks


class MuonStack:
    """Same-shape Muon matrices of one group (full shape under TP), and the state of the rounds this rank updates
    (`held`: under TP, its share of the owned rounds, padding included)."""

    def __init__(self, group, shape, params, owner):
        self.group, self.shape, self.params, self.owner = group, shape, params, owner
        self.cut = tp.is_sharded(params[0])  # under TP: the TP ranks share the rounds out, each updating its share
        self.held = tp.rounds_held(owner.rounds, params[0])
        device = params[0].device
        self.momentum = torch.zeros((len(self.held), *shape), dtype=torch.float32, device=device)
        self.second = torch.zeros((len(self.held), shape[0], 1), dtype=torch.float32, device=device)

    def apply(self, updates):
        """Step 6 on every matrix of the stack (this rank's TP shard of it), from the all-gathered updates (shards)."""
        for i, p in enumerate(self.params):
            self._apply(p, updates[self.owner.slot(i)])

    def apply_owned(self, updates):
        """Step 6 on this rank's own matrices from its updates (rounds, ...), where the weights are sharded."""
        for j in range(self.owner.rounds):
            if (i := self.owner.owned(j)) is not None:
                self._apply(self.params[i], updates[j])

    def _apply(self, p, update):  # on one matrix or its TP shard
        shape_scale = max(1.0, self.shape[0] / self.shape[1]) ** 0.5  # from the full shape, not the shard
        u, w, lr = update.float(), p.data, self.group["lr"]
        w.sub_(lr * shape_scale * u + lr * self.group["weight_decay"] * ((u * w) > 0) * w)


class MuonAdamW(torch.optim.Optimizer):
    """groups: from param_groups; names: {param: name} for saving; dp: the data_parallel.DataParallel over
    muon_stacks(groups) and the AdamW tensors, which reduces the gradients and says who updates what; compile: the
    stacked updates; counts_replicated: this rank counts the parameters whole on every TP rank in the gradient norm
    (TP rank 0 does); expert_dp: under --ep, the experts' stacks' DataParallel (split_experts)."""

    def __init__(self, groups, names, dp, compute_dtype=torch.float32, compile=False, counts_replicated=True,
                 expert_dp=None):
        for g in groups:
            g["initial_lr"] = g["lr"]
        super().__init__(groups, {})
        self.names, self.counts_replicated, self.dp = names, counts_replicated, dp
        self.grad_norms = None  # after a step: (the global gradient norm, then each of PARAM_GROUPS'), a device tensor
        self.compute_dtype = compute_dtype
        self.adamw_step = 0
        self._muon_update = torch.compile(muon_update, dynamic=False) if compile else muon_update
        self._adamw_update = torch.compile(adamw_update, dynamic=False) if compile else adamw_update
        self.adamw_group = {p: g for g in self.param_groups if g["kind"] == "adamw" for p in g["params"]}
        self.dps = [dp] + ([expert_dp] if expert_dp is not None else [])
        # (its DataParallel, its index there, the stack)
        self.muon_stacks = [(d, s, MuonStack(group, shape, params, owner))
                            for d, mine in zip(self.dps, split_experts(self.param_groups, expert_dp is not None))
                            for s, ((group, shape, params), owner) in enumerate(zip(muon_stacks(mine), d.owners))]
        if compile:  # a graph per shape: past torch's 8 per function one would run eagerly (MoE + L3 at d20: 9 shapes)
            limit = len(self.muon_stacks) + len(self.adamw_group)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)

    def _adamw_state(self, p):
        if not (state := self.state[p]):
            shape = self.dp.rows_held(p).shape if self.dp.owns_rows(p) else p.shape
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self):
        self.adamw_step += 1
        for d in self.dps:
            d.finish_backward()
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is None):
            p.grad = torch.zeros_like(p)  # a stage or layer that did not run
        self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for g in self.param_groups for p in g["params"])
        W, sharded = self.dp.size, self.dp.shard_params
        for d in self.dps:
            d.launch_remaining()
        pending = []  # (what applies it, its all-gather's result, the work to wait for)
        # the gradient norm per group, from the reduced gradients held anyway: the squares of what this rank alone
        # holds (its Muon matrices and AdamW rows; the rest on DP rank 0, and TP rank 0 where whole)
        squares = torch.zeros(len(PARAM_GROUPS), dtype=torch.float32, device=self.param_groups[0]["params"][0].device)
        # Muon, stack by stack as rounds land: steps 1-5 on this rank's whole matrices, updates sent in compute dtype
        for d, s, stack in self.muon_stacks:
            grads = d.reduced_muon_grads(s)
            p0, cut = stack.params[0], stack.cut
            if cut:  # this TP rank's share of the rounds, whole
                grads = tp.whole_rounds(grads, p0)
            tp.reduce_partial_grad(p0, grads)  # replicated matrices under sequence parallelism (L3): sum over TP
            if W > 1:  # the sum over every DP rank's tokens (an expert's: over its ranks, which saw all the tokens)
                grads.div_(W)
            if self.counts_replicated or cut:
                squares[PARAM_GROUPS.index(stack.group["name"])] += grads.float().square().sum()
            momentum = torch.tensor(stack.group["momentum"], dtype=torch.float32)
            update = self._muon_update(grads, stack.momentum, stack.second, momentum, self.compute_dtype)
            update = update.to(self.compute_dtype)
            if cut:  # back to this rank's shard of every round's update
                update = tp.shard_rounds(update, p0, stack.owner.rounds)
            if sharded:  # only this rank holds the matrices it owns: nothing to send
                stack.apply_owned(update)
            else:
                pending.append((stack.apply, *d.gather_muon_updates(s, update)))
        # AdamW, bucket by bucket: this rank's rows (then all-gathered) or the whole tensor
        for p, g in self.dp.reduced_adamw_grads():
            tp.reduce_partial_grad(p, g)
            if W > 1:
                g.div_(W)
            group = self.adamw_group[p]
            if (self.dp.owns_rows(p) or self.dp.rank == 0) and (tp.is_sharded(p) or self.counts_replicated):
                squares[PARAM_GROUPS.index(group["name"])] += g.float().square().sum()
            state = self._adamw_state(p)
            # LR, decay and step go in as tensors so the compiled update is not recompiled when they change
            args = (torch.tensor(self.adamw_step, dtype=torch.float32), torch.tensor(group["lr"]), *group["betas"],
                    group["eps"], torch.tensor(group["weight_decay"]))
            target = self.dp.rows_held(p) if self.dp.owns_rows(p) else p.data
            self._adamw_update(target, g, state["exp_avg"], state["exp_avg_sq"], *args)
            if self.dp.owns_rows(p) and not sharded:
                pending.append((p.data.copy_, *self.dp.gather_rows(target)))
        for d in self.dps:
            d.finish_step()
        if dist.is_initialized():  # every rank's part: DP ranks, TP shards, pipeline stages
            dist.all_reduce(squares)
        self.grad_norms = torch.cat([squares.sum().sqrt().view(1), squares.sqrt()])
        for apply, full, work in pending:
            if work is not None:
                work.wait()
            apply(full)

    def held_bytes(self):
        """Bytes this rank holds: the weights, the last step's gradients (before clearing), the optimizer state."""
        # each storage once and whole: a shard kept as a view of its whole tensor holds all of it
        size = lambda ts: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())
        weights = size(p.data for g in self.param_groups for p in g["params"])
        state = [t for _, _, stack in self.muon_stacks for t in (stack.momentum, stack.second)] + \
            [t for s in self.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"weights": weights, "gradients": getattr(self, "grad_bytes", 0), "state": size(state)}

    # --- layout-free state ----------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self, keep=lambda name: True):
        """{'adamw_step': n, 'params': {name passing `keep`: {buffer: whole fp32 CPU tensor}}}; a DP+TP collective."""
        out = {}
        for p in self.adamw_group:
            state = self._adamw_state(p)
            for key in ("exp_avg", "exp_avg_sq"):
                t = self.dp.gather_row_state(state[key]) if self.dp.owns_rows(p) else state[key]
                full = tp.gather_full(t, p)  # every TP rank takes part in the gather
                if keep(self.names[p]):
                    out.setdefault(self.names[p], {})[key] = full.cpu()
        for d, s, stack in self.muon_stacks:
            momentum, second = (d.gather_stack_state(s, tp.gather_rounds(t, stack.params[0], stack.owner.rounds))
                                for t in (stack.momentum, stack.second))
            for i, p in enumerate(stack.params):
                if keep(self.names[p]):
                    out[self.names[p]] = {"momentum": momentum[i].cpu(), "second": second[i].cpu()}
        return {"adamw_step": self.adamw_step, "params": out}

    @torch.no_grad()
    def load_full_state_dict(self, sd):
        """Take this rank's part of a layout-free state (see full_state_dict)."""
        params = sd["params"]
        everything = list(self.adamw_group) + [p for _, _, stack in self.muon_stacks for p in stack.params]
        if missing := [self.names[p] for p in everything if self.names[p] not in params]:  # before any state changes
            raise UserError(f"the optimizer state has no entry for {len(missing)} of the model's parameters "
                            f"({', '.join(missing[:3])}): it was saved for another model")
        self.adamw_step = sd["adamw_step"]
        for p in self.adamw_group:
            state = self._adamw_state(p)
            for key in ("exp_avg", "exp_avg_sq"):
                t = tp.local_shard(params[self.names[p]][key], p)
                state[key].copy_(self.dp.my_rows(t) if self.dp.owns_rows(p) else t)
        for _, _, stack in self.muon_stacks:
            for h, j in enumerate(stack.held):
                if (i := stack.owner.owned(j)) is not None:  # None past the last round too
                    entry = params[self.names[stack.params[i]]]
                    stack.momentum[h].copy_(entry["momentum"])
                    stack.second[h].copy_(entry["second"])
