"""
nanochat's GPT for transformers (AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)), importing nothing
from nanochat, with nanochat/gpt.py's math (equal fp32 logits) and parameter names:
- token embedding, RMSNorm (no weight), smear: x[t] += smear_lambda * sigmoid(smear_gate(x[t][:24])) * x[t-1]
- blocks: x = resid_lambda * x + x0_lambda * x0; x += attn(norm(x)); x += mlp(norm(x)), MLP = relu(.)^2
- attention: rotary (base 1e5, pairs (i, i + D/2)), then RMSNorm of q and k scaled by 1.2, GQA, causal with a
  per-layer sliding window (config.window_sizes); value embeddings on alternating layers (last included),
  added to V through the gate 2 * sigmoid(ve_gate(x[:32]))
- optional L3 layers after some blocks: x += W_mix [LayerNorm(W_up(V_t^T softmax(K_t x))) ; x]
- backout: subtract backout_lambda * (the input of block n_layer // 2) before the final norm
- untied lm_head; logits 15 * tanh(raw / 15) in fp32
SDPA takes the windows and padding (left or right) as one boolean mask; a token after padding smears in zeros;
generate passes the token before the first new one as smear_prev_ids.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel, GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nanochat import NanochatConfig

# transformers 5.24 renamed `past_key_values` (argument and output) to `cache`: forward takes either
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

VE_GATE_CHANNELS = 32
SMEAR_GATE_CHANNELS = 24
QK_SCALE = 1.2
L3_CHUNK_ROWS = 1 << 24  # L3 lookup: at most this many gathered table rows x positions at once


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def has_value_embed(layer_idx, n_layer):
    return layer_idx % 2 == (n_layer - 1) % 2


def rotary(positions, head_dim, base, dtype):
    """cos, sin (1, T, 1, D/2) for integer positions (T,), computed in fp32, returned in `dtype`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    return freqs.cos()[None, :, None, :].to(dtype), freqs.sin()[None, :, None, :].to(dtype)


def rotary_norm(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    r = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)
    return F.rms_norm(r, (x.size(-1),), eps=torch.finfo(torch.float32).eps) * QK_SCALE


class Linear(nn.Linear):
    """Bias-free; the weight is cast to the activations' dtype (fp32 weights can run a bf16 forward)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.n_embd // config.n_head
        d, q_dim, kv_dim = config.n_embd, config.n_head * self.head_dim, config.n_kv_head * self.head_dim
        self.c_q, self.c_k, self.c_v = Linear(d, q_dim), Linear(d, kv_dim), Linear(d, kv_dim)
        self.c_proj = Linear(q_dim, d)
        self.ve_gate = Linear(VE_GATE_CHANNELS, config.n_kv_head) if has_value_embed(layer_idx, config.n_layer) else None

    def forward(self, x, ve, cos, sin, mask, cache):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.c_q, self.c_k, self.c_v))
        if ve is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(B, T, -1, self.head_dim)
        q, k, v = rotary_norm(q, cos, sin).transpose(1, 2), rotary_norm(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # no mask: full context, no cache, no padding
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=q.size(1) != k.size(1))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.resid_lambda = nn.Parameter(torch.ones(()))
        self.x0_lambda = nn.Parameter(torch.zeros(()))
        kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
        self.value_embed = nn.Embedding(config.vocab_size, kv_dim) if has_value_embed(layer_idx, config.n_layer) else None

    def forward(self, x, x0, idx, cos, sin, mask, cache):
        x = self.resid_lambda.to(x.dtype) * x + self.x0_lambda.to(x.dtype) * x0
        ve = self.value_embed(idx).to(x.dtype) if self.value_embed is not None else None
        x = x + self.attn(norm(x), ve, cos, sin, mask, cache)
        return x + self.mlp(norm(x))


class L3Layer(nn.Module):
    """Large Lookup Layer: token t attends with the hidden state over its rows bounds[t]:bounds[t+1] of the table
    (keys and values), gathered padded to the longest row range, in chunks of positions."""

    def __init__(self, config):
        super().__init__()
        d = config.n_embd
        self.d_up = config.l3_d_up or 4 * d
        self.key_table = nn.Parameter(torch.zeros(config.l3_n_emb, d))
        self.w_up = Linear(d, self.d_up)
        self.w_mix = Linear(self.d_up + d, d)
        self.register_buffer("bounds", torch.zeros(config.vocab_size + 1, dtype=torch.int64))
        self.register_buffer("rows_per_token", torch.zeros((), dtype=torch.float32))

    def lookup(self, x, ids):
        """x (N, d), ids (N,) -> (N, d): softmax over the token's rows of E x, then those rows of E."""
        start = self.bounds[ids]
        count = self.bounds[ids + 1] - start
        slot = torch.arange(int(count.max()), device=x.device)
        valid = slot < count[:, None]
        e = self.key_table.to(x.dtype)[torch.where(valid, start[:, None] + slot, 0)]
        scores = (e @ x.unsqueeze(-1)).squeeze(-1).to(torch.promote_types(x.dtype, torch.float32))
        a = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        return (a.to(x.dtype).unsqueeze(1) @ e).squeeze(1)

    def forward(self, x, idx):
        B, T, d = x.shape
        flat, ids = x.reshape(B * T, d), idx.reshape(B * T)
        widest = max(1, int((self.bounds[1:] - self.bounds[:-1]).max()))
        step = max(1, L3_CHUNK_ROWS // widest)
        h = torch.cat([self.lookup(flat[i:i + step], ids[i:i + step]) for i in range(0, B * T, step)])
        u = F.layer_norm(self.w_up(h.view(B, T, -1)), (self.d_up,))
        return self.w_mix(torch.cat([u, x], dim=-1))


def attention_mask_4d(q_len, past_len, window, attention_mask, device):
    """Boolean (B or 1, 1, T, S): causal, at most `window` keys back (the query included), no padded key but
    the query itself (a padded query row stays finite)."""
    S = past_len + q_len
    q_pos = torch.arange(past_len, S, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    mask = (k_pos <= q_pos) & (q_pos - k_pos < window)
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, None, :S].bool() | (k_pos == q_pos))
    return mask


class NanochatForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanochatConfig
    base_model_prefix = "nanochat"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _input_embed_layer = "wte"  # get_input_embeddings(); get_output_embeddings() finds lm_head by its name

    def _init_weights(self, module):
        """The weights always come from a checkpoint; nothing is trained from this init."""

    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.smear_gate = Linear(SMEAR_GATE_CHANNELS, 1)
        self.smear_lambda = nn.Parameter(torch.zeros(()))
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.backout_lambda = nn.Parameter(torch.zeros(()))
        self.lm_head = Linear(config.n_embd, config.vocab_size)
        self.l3 = nn.ModuleDict({str(i): L3Layer(config) for i in config.l3_after_layers})
        self.post_init()

    def embed(self, idx, smear_prev_ids, prev_valid):
        x = norm(self.wte(idx))
        first = norm(self.wte(smear_prev_ids)) if smear_prev_ids is not None else torch.zeros_like(x[:, :1])
        prev = torch.cat([first, x[:, :-1]], dim=1)
        if prev_valid is not None:
            prev = prev * prev_valid[..., None].to(prev.dtype)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))
        return x + gate * prev

    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, labels=None,
                smear_prev_ids=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cfg = self.config
        cache = cache if cache is not None else past_key_values  # either name (see CACHE_FIELD)
        T = input_ids.size(1)
        if T == 0:
            raise ValueError("input_ids is empty: give at least one token (documents start with <|bos|>)")
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache is not None and not isinstance(cache, DynamicCache):  # a static cache hands back unfilled slots
            raise ValueError(f"nanochat decodes with transformers' DynamicCache, not {type(cache).__name__}: leave "
                             f"cache_implementation (generate) at its default")
        past_len = cache.get_seq_length() if cache is not None else 0
        if past_len > 0 and smear_prev_ids is None:
            raise ValueError("decoding with a cache needs smear_prev_ids (B, 1), the token before input_ids "
                             "(generate passes it; or call without a cache)")
        S = past_len + T
        if attention_mask is not None and bool(attention_mask[:, :S].all()):
            attention_mask = None  # no padding: the plain causal path
        # the smear reads zeros after a padded position
        prev_valid = F.pad(attention_mask[:, :S], (1, 0))[:, past_len:S] if attention_mask is not None else None
        x0 = x = self.embed(input_ids, smear_prev_ids, prev_valid)
        cos, sin = rotary(torch.arange(past_len, S, device=x.device), cfg.n_embd // cfg.n_head, cfg.rotary_base, x.dtype)
        plain = attention_mask is None and past_len == 0  # with a window >= T: no mask, SDPA's causal path
        masks = {w: None if plain and w >= T else attention_mask_4d(T, past_len, w, attention_mask, x.device)
                 for w in set(cfg.window_sizes)}  # one per window size
        x_mid = None  # the input of block n_layer // 2, for the backout
        for i, block in enumerate(self.blocks):
            if i == cfg.n_layer // 2:
                x_mid = x
            x = block(x, x0, input_ids, cos, sin, masks[cfg.window_sizes[i]], cache)
            if str(i) in self.l3:
                x = x + self.l3[str(i)](x, input_ids)
        x = x - self.backout_lambda.to(x) * x_mid.to(x.device)  # device_map="auto": the blocks on several devices
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = cfg.softcap * torch.tanh(self.lm_head(norm(x)).float() / cfg.softcap)
        loss = None if labels is None else F.cross_entropy(  # labels are the inputs (transformers' convention): shift
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].to(logits.device).reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        T = inputs["input_ids"].size(1)
        if input_ids.size(1) > T:  # the cache holds the rest: the smear needs the token before
            inputs["smear_prev_ids"] = input_ids[:, -T - 1:-T]
        return inputs
