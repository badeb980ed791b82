"""
Mixture of experts (--moe-experts E --moe-topk K): in the blocks --moe-layers names (default: all but the first)
the dense MLP becomes E routed ReLU^2 experts and --moe-shared N always-on ones, all of width --moe-expert-dim
(default: iso-FLOP, (K + N) x width = the dense MLP's 4 x model_dim, rounded to a multiple of 64).

Routing, per token: s = sigmoid(router(x)) (the product in the compute dtype, the sigmoid and top-k in fp32); the K
experts with the largest s + bias are chosen; their weights are their s over the sum of the chosen s. The bias (a
buffer, per expert) only selects, it never weighs: after each step it moves by MOE_BIAS_RATE x sign(mean load -
load), the loads counted over the step's micro-batches and all data-parallel ranks (and TP ranks under sequence
parallelism), so every rank keeps the same bias (DeepSeek-V3's balance without an auxiliary loss). The rate is
theirs, 1e-3: with sigmoid scores in (0, 1) a bias of a few hundredths already moves a token's choice at the margin,
and a few hundred steps can undo any skew without the choice flapping from step to step.

Dropless: every (token, expert) pair is computed. The pairs are sorted by expert once per layer, and each weight
stack runs as one grouped matmul (torch._grouped_mm: every expert's rows against its own matrix, group sizes read
on the device: no host sync, no shape that depends on the routing), in bf16 on Hopper and newer (kernels facade);
elsewhere looped_experts runs the same math expert by expert (it syncs the host: CPU, fp32, --kernels reference).
Each expert's matrix is its own 2-D parameter (blocks.i.mlp.fc.e), so Muon orthogonalizes every expert's matrix
(stacked with its same-shape peers, as it stacks the blocks' matrices), data parallelism and checkpoints take them
as any matrix; the router goes to AdamW at the lm_head's LR (it, too,
maps the hidden state to logits). The stacks are cast and stacked at each call, as a Linear casts its weight.

Counting: the scaling law and MFU use the active parameters (the router, the shared experts and K routed experts
per token): the compute a token pays. parameter_counts also gives the total, which sets memory.
"""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist

from nanochat import kernels
from nanochat.kernels import Linear

MOE_BIAS_RATE = 1e-3


def expert_dim(config):
    """Each expert's width: --moe-expert-dim, or iso-FLOP with the dense MLP (4 x model_dim over K + N)."""
    if config.moe_expert_dim:
        return config.moe_expert_dim
    return max(64, round(4 * config.n_embd / (config.moe_topk + config.moe_shared) / 64) * 64)


def moe_layers(config):
    """The block indices whose MLP is a mixture of experts."""
    if not config.moe_experts:
        return ()
    return config.moe_layers if config.moe_layers else tuple(range(1, config.n_layer))


class MoE(nn.Module):
    def __init__(self, config, dense_mlp):
        super().__init__()
        E, d, h = config.moe_experts, config.n_embd, expert_dim(config)
        self.num_experts, self.topk, self.hidden = E, config.moe_topk, h
        self.router = Linear(d, E)
        # by global expert index; under --ep a rank keeps its own (expert_parallel.place_experts)
        self.fc = nn.ParameterDict({str(e): nn.Parameter(torch.empty(h, d)) for e in range(E)})
        self.proj = nn.ParameterDict({str(e): nn.Parameter(torch.empty(d, h)) for e in range(E)})
        self.ep = None  # expert_parallel.ExpertParallel under --ep
        self.shared = dense_mlp(config, config.moe_shared * h) if config.moe_shared else None
        self.register_buffer("bias", torch.zeros(E))
        self.register_buffer("load", torch.zeros(E), persistent=False)  # (token, expert) pairs since the last step

    @torch.no_grad()
    def init_weights(self, std_in):
        """As the dense MLP: inputs uniform with std 1/sqrt(d), outputs zero (a no-op at start); the router as an
        input (a zero router would tie every score and send all tokens to the same experts)."""
        s = 3 ** 0.5 * std_in
        for w in list(self.fc.values()) + [self.router.weight]:
            nn.init.uniform_(w, -s, s)
        for w in self.proj.values():
            nn.init.zeros_(w)
        if self.shared is not None:
            nn.init.uniform_(self.shared.c_fc.weight, -s, s)
            nn.init.zeros_(self.shared.c_proj.weight)
        self.bias.zero_()
        self.load.zero_()

    def route(self, x):
        """x (n, d) -> (experts (n, K), weights (n, K) in x.dtype, pairs per expert (E,)); counts them into
        self.load."""
        scores = torch.sigmoid(self.router(x).float())
        chosen = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = pairs_per_expert(chosen, self.num_experts)
        if torch.is_grad_enabled():
            self.load += counts.to(self.load.dtype)
        return chosen, weights.to(x.dtype), counts

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, counts = self.route(x)
        w_fc, w_proj = self.stack(self.fc, x), self.stack(self.proj, x)
        experts = grouped_experts if kernels.takes_grouped_mm(x) else looped_experts
        run = functools.partial(experts, w_fc, w_proj)  # rows sorted by expert, rows per expert -> outputs
        if self.ep is not None:  # the rows go to their experts' ranks, this rank's experts run theirs
            run = functools.partial(self.ep.run, run)
        out = mixture(x, chosen, weights, counts, run)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    @staticmethod
    def stack(params, x):
        """This rank's experts' matrices as one (experts, in, out) stack in x's dtype (each transposed: x @ W^T)."""
        return torch.stack([w.to(x.dtype) for w in params.values()]).transpose(1, 2)

    @torch.no_grad()
    def step_bias(self, load):
        """After a step: move the bias toward equal load (load: pairs per expert, summed over ranks)."""
        self.bias += MOE_BIAS_RATE * torch.sign(load.mean() - load)
        self.load.zero_()


def mixture(x, chosen, weights, counts, experts):
    """sum_k weights[:, k] * expert_{chosen[:, k]}(x) for x (n, d), counts (E,) the pairs per expert (route's): the
    (token, expert) pairs sorted by expert, their rows through experts(rows, rows per expert) (grouped_experts or
    looped_experts, or expert parallelism around one), the outputs weighted and summed back to their tokens in a
    fixed order (no atomic adds)."""
    K = chosen.size(1)
    order = torch.argsort(chosen.flatten(), stable=True)
    y = experts(x[order // K], counts) * weights.flatten()[order, None]
    pairs = torch.empty_like(y)
    pairs[order] = y  # back in token order: the K pairs of a token side by side
    return pairs.view(x.size(0), K, -1).sum(1)


def pairs_per_expert(chosen, num_experts):
    """How many (token, expert) pairs each expert got, as a fixed-shape sum (torch.bincount's output shape depends on
    the data, which splits the compiled graph around every MoE layer)."""
    flat = chosen.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_experts(w_fc, w_proj, rows, counts):
    """Rows sorted by expert, counts[e] of them for expert e -> relu(rows W_fc^T)^2 W_proj^T, each row by its expert:
    two grouped matmuls, the group ends read on the device."""
    ends = torch.cumsum(counts, 0).to(torch.int32)
    return torch._grouped_mm(F.relu(torch._grouped_mm(rows, w_fc, offs=ends)).square(), w_proj, offs=ends)


def looped_experts(w_fc, w_proj, rows, counts):
    """The same, expert by expert with plain matmuls (the reference; it reads the counts on the host)."""
    outs = [F.relu(r @ w_fc[e]).square() @ w_proj[e] for e, r in enumerate(rows.split(counts.tolist()))]
    return torch.cat(outs)


def extra_activation_bytes(config, tokens, recompute, ep=1):
    """What one MoE layer keeps for the backward beyond a dense MLP, at `tokens` tokens of a micro-batch, in bf16
    (the planner's term; counted by saved-tensor hooks on CPU, not fitted to GPU peaks): per token the K gathered
    rows and their outputs (K d each), the K hidden rows twice (K h: the ReLU^2 and the second product's input),
    the shared experts' hidden as a dense MLP's, less the dense MLP's 10 bytes per unit of width; and the two
    (E, d, h) weight stacks (E / ep under --ep; the rows an EP rank receives are taken as many as it sends). Under
    --recompute a block keeps only its inputs (the stacks are made again)."""
    if recompute != "none":
        return 0
    d, h, K = config.n_embd, expert_dim(config), config.moe_topk
    per_token = 2 * (2 * K * d + 2 * K * h) + 10 * config.moe_shared * h / 4 - 10 * d
    return tokens * per_token + 2 * config.moe_experts // ep * d * h * 2


def moe_modules(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model):
    """The routed experts' matrices this rank holds (all, or its share under --ep)."""
    return [p for m in moe_modules(model) for d in (m.fc, m.proj) for p in d.values()]


def inactive_expert_params(model):
    """Of the routed experts' weights, those a token does not run through: all but K experts per MoE layer (counted
    before expert parallelism places the experts)."""
    return sum((len(m.fc) - m.topk) * 2 * m.hidden * m.router.in_features for m in moe_modules(model))


def after_step(model, groups, pp_group=None):
    """The loads since the last step summed over `groups` (the ranks that saw other tokens: DP x CP, and TP under
    sequence parallelism), each bias moved by them; returns the worst layer's load imbalance, max / mean pairs per
    expert, over the pipeline's stages too (pp_group; a device tensor; None for a model without MoE). Under
    --recompute a block's forward runs twice: its loads double, their balance does not change."""
    if not model.config.moe_experts:
        return None
    layers = moe_modules(model)  # under PP, this stage's (maybe none)
    imbalance = torch.zeros((), device=model.cos.device)
    if layers:
        loads = torch.stack([m.load for m in layers])
        for group in groups:
            if group is not None:  # None: a group of one
                dist.all_reduce(loads, group=group)
        for m, load in zip(layers, loads):
            m.step_bias(load)
        imbalance = (loads.max(1).values / loads.mean(1).clamp(min=1)).max()
    if pp_group is not None:
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=pp_group)
    return imbalance
