"""Generation (nanochat/engine.py): with the KV cache, greedy decoding equals recomputing the whole
sequence every step (full attention, GQA, sliding windows); sampling is reproducible; stop tokens stop."""

import math

import pytest
import torch

from nanochat.gpt import GPTConfig, build_model, window_sizes
from nanochat.engine import generate, sample_next

V = 128


def random_gpt(**config):
    """A tiny GPT whose every weight does something: the real init zeroes the output projections and
    the gates (blocks start as identity), which would hide a wrong cache or mask."""
    model = build_model(GPTConfig(**config), "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and not name.endswith(("wte.weight", "value_embed.weight")):
                p.normal_(0.0, 1.0 / math.sqrt(p.size(1)))
            elif p.ndim == 0:  # residual, x0, smear and backout lambdas: all on
                p.uniform_(0.2, 0.8)
    model.eval()
    return model


@torch.no_grad()
def generate_naive(model, prompt, max_tokens):
    """Greedy generation that recomputes the whole sequence at each step (the reference)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids], dtype=torch.long, device=model.cos.device))[:, -1]
        ids.append(int(logits.argmax(dim=-1)))
    return ids[len(prompt):]


CONFIGS = {
    "full attention": dict(sequence_len=64, vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="L"),
    "GQA": dict(sequence_len=64, vocab_size=V, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, window_pattern="L"),
    "sliding window + GQA": dict(sequence_len=512, vocab_size=V, n_layer=2, n_head=4, n_kv_head=1, n_embd=64,
                                 window_pattern="SL"),
}


@pytest.mark.parametrize("name,prompt_len,max_tokens", [
    ("full attention", 10, 30),
    ("GQA", 10, 30),
    ("sliding window + GQA", 120, 40),  # decoding crosses the 128-token window
    ("sliding window + GQA", 150, 12),  # the prompt alone is longer than the window
])
def test_kv_cache_generation_equals_naive(name, prompt_len, max_tokens):
    torch.manual_seed(0)
    model = random_gpt(**CONFIGS[name])
    prompt = torch.randint(0, V, (prompt_len,)).tolist()
    expected = generate_naive(model, prompt, max_tokens)
    assert generate(model, prompt, max_tokens, temperature=0.0)[0] == expected
    # several rows decode from one prefill, each equal to the single-row result
    assert generate(model, prompt, max_tokens, num_samples=3, temperature=0.0) == [expected] * 3


def test_the_sliding_window_matters_in_that_test():
    torch.manual_seed(0)
    model = random_gpt(**CONFIGS["sliding window + GQA"])
    assert window_sizes(model.config)[0] == 128
    full = build_model(GPTConfig(**dict(CONFIGS["sliding window + GQA"], window_pattern="L")), "cpu")
    full.load_state_dict(model.state_dict())
    idx = torch.randint(0, V, (1, 160))
    with torch.no_grad():
        assert not torch.allclose(model(idx)[:, -1], full(idx)[:, -1])
        assert torch.allclose(model(idx)[:, :128], full(idx)[:, :128], atol=1e-5)  # identical inside the window


def test_sampling_is_reproducible_with_a_seed():
    torch.manual_seed(0)
    model = random_gpt(**CONFIGS["GQA"])
    prompt = list(range(1, 9))
    a = generate(model, prompt, 20, num_samples=4, temperature=1.0, top_k=10, seed=7)
    assert a == generate(model, prompt, 20, num_samples=4, temperature=1.0, top_k=10, seed=7)
    assert len(a) == 4 and all(len(row) == 20 for row in a)
    assert generate(model, prompt, 20, num_samples=4, temperature=1.0, top_k=10, seed=8) != a  # the seed is used
    with pytest.raises(ValueError, match="the prompt is empty: give at least one token"):
        generate(model, [], 3)
    # top-k 1 leaves only the most likely token: greedy, whatever the temperature
    greedy = generate(model, prompt, 20, temperature=0.0)[0]
    assert generate(model, prompt, 20, num_samples=2, temperature=2.0, top_k=1, seed=3) == [greedy] * 2


def test_top_k_samples_among_k_tokens_even_when_logits_tie():
    logits, g = torch.zeros(200, 10), torch.Generator().manual_seed(0)  # ten equal logits: a tie at the k-th value
    assert len(set(sample_next(logits, 1.0, 3, g).tolist())) == 3


def test_stop_tokens_stop():
    torch.manual_seed(0)
    model = random_gpt(**CONFIGS["full attention"])
    prompt = list(range(1, 9))
    greedy = generate(model, prompt, 30, temperature=0.0)[0]
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    out = generate(model, prompt, 30, temperature=0.0, stop_tokens=(stop,))[0]
    assert out == greedy[:greedy.index(stop) + 1]  # the stop token is kept, nothing after it
    # sampled rows stop independently
    rows = generate(model, prompt, 30, num_samples=4, temperature=1.0, seed=1, stop_tokens=(stop,))
    for row in rows:
        assert stop not in row[:-1] and (row[-1] == stop or len(row) == 30)


def test_temperature_shapes_the_distribution():
    """Logits [0, 1] sampled at temperature T pick 1 with probability sigmoid(1 / T) (greedy and top-k 1 alone
    cannot see a temperature ignored)."""
    logits = torch.tensor([[0.0, 1.0]]).expand(40_000, 2)
    g = torch.Generator().manual_seed(0)
    for temperature in (0.5, 2.0):
        ones = sample_next(logits, temperature, None, g).float().mean().item()
        assert abs(ones - torch.sigmoid(torch.tensor(1.0 / temperature)).item()) < 0.01, (temperature, ones)
