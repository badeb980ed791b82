"""
Inference with a KV cache: prefill runs the prompt once (batch 1), then num_samples copies of the cache decode
one token per step. At temperature 0 this equals recomputing the whole sequence every step (tests/test_engine.py).
"""

import torch
import torch.nn.functional as F

from nanochat import kernels
from nanochat.gpt import WholeSequence


class KVCache(WholeSequence):
    """The model's sequence view while decoding (gpt.WholeSequence): a call's tokens follow, and attend to, the `pos`
    cached ones. Per layer, keys and values of shape (B, H_kv, max_len, D)."""

    def __init__(self, batch_size, max_len):
        self.batch_size, self.max_len = batch_size, max_len
        self.k, self.v = {}, {}
        self.pos = 0
        self.last_embedding = None  # for the smear: the embedding of the last token seen

    def rotary(self, cos, sin, T):
        return cos[:, self.pos:self.pos + T], sin[:, self.pos:self.pos + T]

    def previous(self, x, idx, embed):
        """The embedding before each position of x: the cached last one (zeros at the start), then x's own."""
        first = self.last_embedding if self.last_embedding is not None else torch.zeros_like(x[:, :1])
        self.last_embedding = x[:, -1:]
        return torch.cat([first, x[:, :-1]], dim=1)

    def attend(self, layer_idx, q, k, v, window):
        T = k.size(2)
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache full: {self.pos} + {T} > {self.max_len} tokens")
        if layer_idx not in self.k:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k[layer_idx], self.v[layer_idx] = k.new_empty(shape), v.new_empty(shape)
        keys, values = self.k[layer_idx][:, :, :self.pos + T], self.v[layer_idx][:, :, :self.pos + T]
        keys[:, :, self.pos:], values[:, :, self.pos:] = k, v  # this call's, after the cached ones
        return kernels.attention(q, keys, values, window)

    def advance(self, T):
        self.pos += T

    def expand(self, batch_size):  # a batch-1 cache (after prefill) copied to batch_size rows
        assert self.batch_size == 1
        out = KVCache(batch_size, self.max_len)
        out.pos = self.pos
        out.k, out.v = ({i: t.expand(batch_size, -1, -1, -1).clone() for i, t in kv.items()} for kv in (self.k, self.v))
        out.last_embedding = self.last_embedding.expand(batch_size, -1, -1).clone()
        return out


def sample_next(logits, temperature, top_k, generator):
    """logits (B, V) -> next ids (B,). temperature 0 = greedy."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k > 0:  # exactly k candidates: a tie at the k-th value is cut where topk cuts it
        values, ids = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
        return ids.gather(-1, torch.multinomial(F.softmax(values, dim=-1), 1, generator=generator)).squeeze(-1)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt, max_tokens, num_samples=1, temperature=1.0, top_k=None, seed=42, stop_tokens=()):
    """num_samples lists of new ids after `prompt`, each ending at its first stop token (kept) or max_tokens."""
    if not len(prompt):
        raise ValueError("the prompt is empty: give at least one token (documents start with <|bos|>)")
    device = model.cos.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(1, len(prompt) + max_tokens)
    logits = model(torch.tensor([prompt], dtype=torch.long, device=device), kv_cache=cache)[:, -1]
    cache, logits = cache.expand(num_samples), logits.expand(num_samples, -1)
    out, done = [[] for _ in range(num_samples)], [False] * num_samples
    for _ in range(max_tokens):
        next_ids = sample_next(logits, temperature, top_k, generator)
        for i, t in enumerate(next_ids.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = t in stop_tokens
        if all(done):
            break
        logits = model(next_ids[:, None], kv_cache=cache)[:, -1]
    return out


SAMPLE_PROMPTS = ["The capital of France is", "The chemical symbol of gold is",
                  "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                  "The planets of the solar system are:", "My favorite color is"]


def sample_completions(model, tokenizer, prompts=SAMPLE_PROMPTS, max_tokens=16, temperature=0.0):
    """Greedy completions of a few fixed prompts, as strings (what base_train prints)."""
    bos = tokenizer.get_bos_token_id()
    new = [generate(model, tokenizer.encode(p, prepend=bos), max_tokens, temperature=temperature, stop_tokens=(bos,))[0]
           for p in prompts]
    return [p + tokenizer.decode([t for t in n if t != bos]) for p, n in zip(prompts, new)]
