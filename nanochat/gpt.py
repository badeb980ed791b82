"""
The GPT: a decoder-only transformer with no biases, every op written as its reference PyTorch math.

- token embedding, parameter-free RMSNorm, smear (each position adds a gated share of the previous token's embedding)
- blocks: x = resid_lambda * x + x0_lambda * x0 (x0: the smeared embedding), then pre-norm attention and ReLU^2 MLP
- attention: rotary (base 1e5), QK-norm then q, k scaled by 1.2, GQA, a sliding window per layer (window_sizes); on
  alternating layers (the last included) a per-token value embedding added to V through an input-dependent gate
- backout (minus a learned share of the mid-depth residual), final norm, untied lm_head, logits 15*tanh(x/15) in fp32
- Large Lookup Layers (l3.py), if configured, after some blocks: x = x + l3(x, token ids)

Ops with fast kernels ask the kernels facade first. Weights fp32 (the optimizer's precision), matmuls in the compute
dtype (no autocast). The parallel helpers wrap embed() -> run_blocks(start, end) -> head(), which pass a `Residual`;
TP swaps the Linears in place; two seams are swapped whole: `sequence` (WholeSequence: which tokens this rank holds,
what attention and the loss see) and `weights.run(module, fn, *args)` (sharding.ShardedWeights gathers for the call).
"""

import math
import functools
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from nanochat import kernels
from nanochat.common import ConfigError
from nanochat.kernels import Linear
from nanochat.l3 import L3Layer
from nanochat.moe import MoE, moe_layers, expert_parameters, inactive_expert_params

ROTARY_BASE = 100_000.0
QK_SCALE = 1.2  # q and k after QK-norm: sharper attention than unit-norm vectors give
SOFTCAP = 15.0  # logits soft-capped to (-15, 15)


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"
    # Large Lookup Layers (l3.py): inserted after these block indices; empty = none
    l3_after_layers: tuple = ()
    l3_n_emb: int = 0
    l3_d_up: int = 0
    l3_k_max: int = 512
    # mixture of experts (moe.py): routed experts (0 = dense MLPs), chosen per token, always-on ones, width, blocks
    moe_experts: int = 0
    moe_topk: int = 2
    moe_shared: int = 1
    moe_expert_dim: int = 0
    moe_layers: tuple = ()

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def to_dict(self):
        return {**asdict(self), "l3_after_layers": list(self.l3_after_layers), "moe_layers": list(self.moe_layers)}

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        if gone := [k for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_embd") if k not in d]:
            raise ConfigError(f"the model config lacks {', '.join(gone)}: the checkpoint's meta is damaged or not "
                              f"nanochat's")
        if unknown := sorted(set(d) - {f.name for f in fields(cls)} - {"l3_tied"}):
            raise ConfigError(f"the model config has keys this version does not know ({', '.join(unknown)}): resume or "
                              f"evaluate it with the version that trained it")
        d["l3_after_layers"], d["moe_layers"] = tuple(d.get("l3_after_layers", ())), tuple(d.get("moe_layers", ()))
        if d.pop("l3_tied", True) is False and d["l3_after_layers"]:  # named by checkpoints before 2026-11-24
            raise ConfigError("this checkpoint has L3 layers with separate key and value tables, which this version "
                              "does not build (one table serves as both); use the version that trained it")
        return cls(**d)


def window_sizes(config):
    """Per layer: the attention window in tokens from the pattern tiled over layers (S = a quarter of the context
    rounded to 128, L = sequence_len; the last layer L)."""
    pattern = config.window_pattern.upper()
    if not pattern or set(pattern) - {"S", "L"}:
        raise ConfigError(f"--window-pattern {config.window_pattern!r} must be a string of S and L, e.g. SSSL or L")
    short = min(config.sequence_len, max(128, 128 * round(config.sequence_len / 4 / 128)))
    sizes = [short if pattern[i % len(pattern)] == "S" else config.sequence_len for i in range(config.n_layer)]
    sizes[-1] = config.sequence_len
    return sizes


def has_value_embed(layer_idx, n_layer):  # alternating layers, the last one included
    return layer_idx % 2 == (n_layer - 1) % 2


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len, head_dim, device=None):
    """cos and sin of position * frequency, (1, seq_len, 1, head_dim/2) in fp32."""
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def rotary_norm(x, cos, sin):
    """1.2 * rms_norm(rotate(x)), x (B, T, H, D), cos/sin (1, T, 1, D/2): each pair (x_i, x_{i+D/2}) turned by its
    position's angle."""
    if kernels.takes(kernels.rotary, x):
        return kernels.rotary_norm(x, cos, sin, QK_SCALE)
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    rotated = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)
    return F.rms_norm(rotated, (x.size(-1),), eps=torch.finfo(torch.float32).eps) * QK_SCALE


def relu_square(h):  # with the kernels on, a Function that keeps only its output for the backward
    return kernels.relu_square(h) if kernels.KERNELS.on else F.relu(h).square()


def softcap(logits):
    return SOFTCAP * torch.tanh(logits.float() / SOFTCAP)


def reduce_losses(losses, targets, reduction):
    """Per-token losses reduced as F.cross_entropy does with ignore_index=-1 ('mean': NaN when no target counts)."""
    if reduction == "none":
        return losses.view(targets.shape)
    return losses.sum() if reduction == "sum" else losses.sum() / (targets != -1).sum()


class WholeSequence:
    """Which tokens of the (B, T) sequences this rank holds (here all) and what the model asks of them, as KVCache and
    ContextParallel answer it: local(t), this rank's tokens; rotary, the tables at their positions; previous, each
    token's previous token's embedding for the smear (zeros before the first; embed(ids) embeds ids); attend, over
    the keys a query may see; loss, over the tokens that count; advance, after T tokens; selective_keeps, the outputs
    --recompute selective also keeps."""

    selective_keeps = ()

    def local(self, t):
        return t

    def rotary(self, cos, sin, T):
        return cos[:, :T], sin[:, :T]

    def previous(self, x, idx, embed):
        return F.pad(x[:, :-1], (0, 0, 1, 0))

    def attend(self, layer_idx, q, k, v, window):
        return kernels.attention(q, k, v, window)  # softmax(q k^T / sqrt(hd) + causal window mask) v

    def loss(self, criterion, x, lm_head, targets, reduction):
        return criterion(x, lm_head, targets, reduction)

    def advance(self, T):
        pass


VE_GATE_CHANNELS = 32  # value-embedding gate reads the first channels of the block input
SMEAR_GATE_CHANNELS = 24


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        d, hd = config.n_embd, config.head_dim
        self.c_q = Linear(d, config.n_head * hd)
        self.c_k = Linear(d, config.n_kv_head * hd)
        self.c_v = Linear(d, config.n_kv_head * hd)
        self.c_proj = Linear(config.n_head * hd, d)
        self.ve_gate = Linear(VE_GATE_CHANNELS, config.n_kv_head) if has_value_embed(layer_idx, config.n_layer) else None
        self.tp_enter = nn.Identity()  # tensor parallelism swaps in its region-entry collective

    def forward(self, x, ve, cos, sin, window, seq):
        x = self.tp_enter(x)
        B, T, _ = x.shape
        # head counts come from the (possibly tensor-parallel) weights: local heads under TP
        q, k, v = [lin(x).view(B, T, -1, self.head_dim) for lin in (self.c_q, self.c_k, self.c_v)]
        if ve is not None:  # value embedding through an input-dependent gate in (0, 2), 1 at init
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, -1, self.head_dim)
        q, k = rotary_norm(q, cos, sin), rotary_norm(k, cos, sin)
        y = seq.attend(self.layer_idx, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config, hidden=None):
        super().__init__()
        self.c_fc = Linear(config.n_embd, hidden or 4 * config.n_embd)
        self.c_proj = Linear(hidden or 4 * config.n_embd, config.n_embd)
        self.tp_enter = nn.Identity()  # tensor parallelism swaps in its region-entry collective

    def forward(self, x):
        return self.product(self.tp_enter(x))

    def product(self, x):
        if kernels.takes_fused_mlp(x, self.c_fc, self.c_proj):  # ReLU^2 inside both matmuls
            return kernels.fused_mlp(x, self.c_fc, self.c_proj)
        return self.c_proj(relu_square(self.c_fc(x)))


RECOMPUTE_MODES = ("none", "selective", "block")


class Block(nn.Module):
    """Pre-norm attention and MLP around the residual stream. `recompute` (training.setup; only when training with
    grad) recomputes activations in the backward: "block" keeps the block's inputs, "selective" also the outputs of
    the ops the kernels and the sequence view name. Under TP the region's collectives run again, in the same order."""

    recompute = "none"

    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MoE(config, MLP) if layer_idx in moe_layers(config) else MLP(config)
        self.resid_lambda = nn.Parameter(torch.empty(()))
        self.x0_lambda = nn.Parameter(torch.empty(()))
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embed = nn.Embedding(config.vocab_size, kv_dim) if has_value_embed(layer_idx, config.n_layer) else None

    def forward(self, x, x0, idx, cos, sin, window, seq):
        if self.recompute == "none" or not (self.training and torch.is_grad_enabled()):
            return self._forward(x, x0, idx, cos, sin, window, seq)
        # non-reentrant: works under torch.compile and with inputs that need no grad; no RNG state (no randomness)
        context = {}
        if self.recompute == "selective":  # the outputs of these ops are saved, and the recompute reuses them
            context["context_fn"] = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
                                                      list(kernels.SELECTIVE_KEEPS + seq.selective_keeps))
        return torch.utils.checkpoint.checkpoint(self._forward, x, x0, idx, cos, sin, window, seq,
                                                 use_reentrant=False, preserve_rng_state=False, **context)

    def _forward(self, x, x0, idx, cos, sin, window, seq):
        x = self.resid_lambda.to(x.dtype) * x + self.x0_lambda.to(x.dtype) * x0
        ve = self.value_embed(idx).to(x.dtype) if self.value_embed is not None else None
        x = x + self.attn(norm(x), ve, cos, sin, window, seq)
        return x + self.mlp(norm(x))


class SoftcapCrossEntropy(nn.Module):
    """Soft-capped fp32 logits, then cross-entropy (ignore_index=-1). It applies the lm_head itself, so that matmul
    and loss can be one kernel; tensor parallelism swaps in a vocab-parallel twin."""
    logits = staticmethod(softcap)

    def forward(self, x, lm_head, targets, reduction="mean"):
        weight = lm_head.weight.to(x.dtype)
        if kernels.takes(kernels.softcap_ce, x):
            return reduce_losses(kernels.head_losses(x, weight, targets, SOFTCAP), targets, reduction)
        logits = softcap(F.linear(x, weight))
        losses = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction="none")
        return reduce_losses(losses, targets, reduction)


@dataclass
class Residual:
    """Between blocks and stages: the residual x, the embedding x0 every block mixes in, x_mid for backout (or None)."""
    x: torch.Tensor
    x0: torch.Tensor
    x_mid: torch.Tensor = None


class ResidentWeights:
    def run(self, module, fn, *args):  # every weight whole on this rank, in its module
        return fn(*args)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.window_sizes = window_sizes(config)
        if config.n_embd < VE_GATE_CHANNELS:  # the gates read the residual's first channels
            raise ConfigError(f"model_dim {config.n_embd} is under {VE_GATE_CHANNELS}, the channels the value-embedding "
                              f"gate reads: raise --depth or --aspect-ratio")
        self.backout_layer = config.n_layer // 2  # x_mid = the input of this block
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.smear_gate = Linear(SMEAR_GATE_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.empty(()))
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.backout_lambda = nn.Parameter(torch.empty(()))
        self.lm_head = Linear(config.n_embd, config.vocab_size)
        self.criterion = SoftcapCrossEntropy()
        self.embed_exit = nn.Identity()  # sequence parallelism swaps in a split along the sequence
        # the hook for Large Lookup Layers: {block index: layer}, run after that block as x = x + layer(x, idx)
        self.l3 = nn.ModuleDict({str(i): L3Layer.from_config(config) for i in config.l3_after_layers})
        self.rotary_len = config.sequence_len * 10  # rotary tables: generation may run past the training context
        cos, sin = rotary_tables(self.rotary_len, config.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.compute_dtype = torch.float32
        self.sequence = WholeSequence()  # context_parallel.ContextParallel under --cp
        self.weights = ResidentWeights()  # sharding.ShardedWeights under --shard-params

    @torch.no_grad()
    def init_weights(self):
        cfg = self.config
        s = math.sqrt(3) / math.sqrt(cfg.n_embd)  # uniform(-s, s) has std 1/sqrt(fan_in)
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)  # followed by a norm, so scale is free
        nn.init.zeros_(self.smear_gate.weight)
        self.smear_lambda.fill_(0.0)  # smear starts off
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            for lin in (attn.c_q, attn.c_k, attn.c_v) + ((mlp.c_fc,) if isinstance(mlp, MLP) else ()):
                nn.init.uniform_(lin.weight, -s, s)
            nn.init.zeros_(attn.c_proj.weight)  # output projections at zero: blocks start as identity
            if isinstance(mlp, MLP):
                nn.init.zeros_(mlp.c_proj.weight)
            else:
                mlp.init_weights(1 / math.sqrt(cfg.n_embd))
            if attn.ve_gate is not None:
                nn.init.zeros_(attn.ve_gate.weight)  # gate = 2*sigmoid(0) = 1
            if block.value_embed is not None:
                nn.init.uniform_(block.value_embed.weight, -s, s)
            block.resid_lambda.fill_(1.0)
            block.x0_lambda.fill_(0.1)
        self.backout_lambda.fill_(0.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for layer in self.l3.values():
            layer.init_weights()
        cos, sin = rotary_tables(self.rotary_len, cfg.head_dim, device=self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def embed(self, idx, seq=None):
        """Token embedding, norm, smear. Returns the Residual that enters block 0 (this rank's tokens of idx)."""
        return self.weights.run(self.wte, self._embed, idx, seq or self.sequence)

    def _embed(self, idx, seq):
        x = norm(self.wte(seq.local(idx)).to(self.compute_dtype))
        # smear: x[t] += lambda * sigmoid(gate(x[t])) * x[t-1]
        prev = seq.previous(x, idx, lambda ids: norm(self.wte(ids).to(self.compute_dtype)))
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))
        x = self.embed_exit(x + gate * prev)
        return Residual(x=x, x0=x)

    def run_blocks(self, h: Residual, idx, start, end, seq=None):
        """Blocks start..end-1 (and the L3 layers placed after them). idx: the whole sequences' ids."""
        seq = seq or self.sequence
        idx = seq.local(idx)
        cos, sin = seq.rotary(self.cos, self.sin, idx.size(1))
        if cos.size(1) != idx.size(1):
            raise ValueError(f"a sequence of {idx.size(1)} tokens runs past the rotary table ({self.rotary_len} positions)")
        cos, sin = cos.to(self.compute_dtype), sin.to(self.compute_dtype)
        return self._blocks(h, idx, cos, sin, start, end, seq)

    def _blocks(self, h: Residual, idx, cos, sin, start, end, seq):
        """run_blocks' loop up to the first L3 layer, that layer, then the rest by recursion: L3's lookup breaks the
        compiled graph, and torch.compile resumes after a break outside a loop but not inside one (there each block
        became a graph of its own, the code between them eager, and past 8 blocks the rest ran eagerly)."""
        l3_at = [i for i in range(start, end) if str(i) in self.l3]
        stop = l3_at[0] + 1 if l3_at else end
        x, x_mid = h.x, h.x_mid
        for i in range(start, stop):
            if i == self.backout_layer:
                x_mid = x
            block = self.blocks[i]
            x = self.weights.run(block, block, x, h.x0, idx, cos, sin, self.window_sizes[i], seq)
        if not l3_at:
            return Residual(x=x, x0=h.x0, x_mid=x_mid)
        layer = self.l3[str(l3_at[0])]
        x = x + self.weights.run(layer, layer, x, idx)
        return self._blocks(Residual(x=x, x0=h.x0, x_mid=x_mid), idx, cos, sin, stop, end, seq)

    def head(self, h: Residual, targets=None, loss_reduction="mean", positions=None, seq=None):
        """Backout, final norm, lm_head, soft-cap (fp32), and the loss if targets (the whole sequences'; the sequence
        view says which count here) are given. positions: index tensors selecting the tokens wanted (evaluation)."""
        x = h.x
        if h.x_mid is not None:
            x = x - self.backout_lambda.to(x.dtype) * h.x_mid
        if positions is not None:
            x = x[positions]
        return self.weights.run(self.lm_head, self._logits_or_loss, norm(x), targets, loss_reduction,
                                seq or self.sequence)

    def _logits_or_loss(self, x, targets, loss_reduction, seq):
        if targets is None:
            return self.criterion.logits(self.lm_head(x))
        return seq.loss(self.criterion, x, self.lm_head, targets, loss_reduction)

    def forward(self, idx, targets=None, loss_reduction="mean", kv_cache=None, positions=None):
        seq = kv_cache or self.sequence
        h = self.run_blocks(self.embed(idx, seq), idx, 0, self.config.n_layer, seq)
        seq.advance(idx.size(1))
        return self.head(h, targets, loss_reduction, positions, seq)

    def matmul_parameters(self):
        """The linears a token runs through: the blocks' (MoE: router, shared and K routed experts), L3's, lm_head."""
        linears = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return linears + sum(p.numel() for p in expert_parameters(self)) - inactive_expert_params(self)

    def num_scaling_params(self):
        """What the scaling laws count: the transformer's active matrices + lm_head."""
        return self.matmul_parameters() - sum(p.numel() for layer in self.l3.values() for p in layer.dense_parameters())

    def attention_flops(self, layer_idx, causal=False):
        """Attention FLOPs per token of one layer: 12 * heads * head_dim * the window (the scaling-law recipe's and
        upstream nanochat's count), or with causal=True the mean min(t + 1, window): what skipping masked tiles does."""
        cfg = self.config
        T, W = cfg.sequence_len, min(self.window_sizes[layer_idx], cfg.sequence_len)
        context = (W * (W + 1) / 2 + (T - W) * W) / T if causal else W
        return 12 * cfg.n_head * cfg.head_dim * context

    def estimate_flops(self, causal=False):
        """Training FLOPs per token: 6 * matmul params + attention_flops, plus L3's lookups and W_up / W_mix."""
        attn = sum(self.attention_flops(i, causal) for i in range(self.config.n_layer))
        return 6 * self.num_scaling_params() + attn + sum(layer.estimate_flops() for layer in self.l3.values())

    def parameter_counts(self):  # for the start-of-run printout
        total = sum(p.numel() for p in self.parameters())
        embed = self.wte.weight.numel() + sum(b.value_embed.weight.numel() for b in self.blocks if b.value_embed is not None)
        sparse = sum(p.numel() for layer in self.l3.values() for p in layer.table_parameters())
        return {"total": total, "embeddings": embed, "l3 tables (sparse)": sparse,
                "matmul": self.matmul_parameters(), "scaling": self.num_scaling_params(),
                "active": total - sparse - inactive_expert_params(self)}


def build_model(config, device, compute_dtype=torch.float32):  # on meta (no memory, no init cost), then materialized
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    model.compute_dtype = compute_dtype
    return model
