import math

import pytest
import torch
import torch.nn.functional as F

from nanochat import kernels
from nanochat.kernels import splitk, attention
from nanochat.gpt import GPT, GPTConfig, build_model, window_sizes, has_value_embed
from nanochat.recipe import config_for_depth


@pytest.mark.parametrize("depth,expected", [(12, 286e6), (20, 897e6), (24, 1.38e9), (26, 1.68e9)])
def test_parameter_counts_match_design(depth, expected):
    with torch.device("meta"):
        model = GPT(config_for_depth(depth))
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - expected) / expected < 0.02


def tiny_config(**kw):
    base = dict(sequence_len=64, vocab_size=256, n_layer=4, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")
    base.update(kw)
    return GPTConfig(**base)


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = build_model(tiny_config(), "cpu")
    idx = torch.randint(0, 256, (2, 64))
    logits = model(idx)
    assert logits.shape == (2, 64, 256) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15.0  # soft cap
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(256)) < 0.1  # tiny lm_head init: near-uniform predictions
    per_token = model(idx, idx, loss_reduction="none")
    assert per_token.shape == (2, 64)  # the targets' shape, as on CUDA and under TP
    targets = idx.clone()
    targets[:, :10] = -1  # ignored
    assert torch.isfinite(model(idx, targets))


def test_blocks_start_as_identity():
    model = build_model(tiny_config(), "cpu")
    idx = torch.randint(0, 256, (1, 16))
    h = model.embed(idx)
    out = model.run_blocks(h, idx, 0, 4)
    # zero output projections: each block only rescales/mixes x and x0 (resid 1.0, x0 0.1)
    expected = h.x
    for _ in range(4):
        expected = expected + 0.1 * h.x0
    assert torch.allclose(out.x, expected, atol=1e-6)


def test_rotary_tables_against_float64():
    """Base 100,000: the tables against cos/sin of t * base^(-2i/d) computed here (every other test builds both
    sides from the same tables)."""
    from nanochat.gpt import rotary_tables
    cos, sin = rotary_tables(16, 8)
    angle = torch.arange(16, dtype=torch.float64)[:, None] * 100_000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(cos[0, :, 0].double(), angle.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0, :, 0].double(), angle.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 31, 64])
def test_flex_attention_block_mask_is_the_band(window):
    """The FlexAttention mask (GPUs without FA4) keeps the keys band_mask keeps: the window's last `window` positions."""
    from nanochat.kernels.sdpa import block_mask, band_mask
    q, k = torch.arange(64)[:, None], torch.arange(64)[None, :]
    mask = block_mask(64, window, "cpu").mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    assert torch.equal(mask, band_mask(64, 64, 0, window, "cpu"))


def test_window_pattern_and_value_embeddings():
    cfg = config_for_depth(12, window_pattern="SSSL")
    sizes = window_sizes(cfg)
    assert sizes == [512, 512, 512, 2048] * 2 + [512, 512, 512, 2048]
    cfg = config_for_depth(5, window_pattern="S", sequence_len=1024)
    assert window_sizes(cfg) == [256, 256, 256, 256, 1024]  # last layer always full
    assert [has_value_embed(i, 5) for i in range(5)] == [True, False, True, False, True]
    assert [has_value_embed(i, 4) for i in range(4)] == [False, True, False, True]  # even depths: the last one too
    with pytest.raises(ValueError, match="window-pattern"):
        window_sizes(config_for_depth(2, window_pattern="SXL"))
    with pytest.raises(ValueError, match="model_dim 16 is under 32"), torch.device("meta"):  # was a shape error
        GPT(config_for_depth(1, aspect_ratio=16, head_dim=16))


def reference_attention(q, k, v, window):
    """softmax(q k^T / sqrt(d) + mask) v with explicit loops over heads (GQA by repetition)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T, S = q.size(2), k.size(2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    qpos = torch.arange(S - T, S)[:, None]
    kpos = torch.arange(S)[None, :]
    allowed = (kpos <= qpos) & (qpos - kpos < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return F.softmax(scores, -1) @ v


@pytest.mark.parametrize("window", [3, 16, 64])
@pytest.mark.parametrize("S_minus_T", [0, 5])
def test_attention_matches_reference(window, S_minus_T):
    torch.manual_seed(0)
    T = 16
    q = torch.randn(2, 4, T, 8)
    k = torch.randn(2, 2, T + S_minus_T, 8)
    v = torch.randn(2, 2, T + S_minus_T, 8)
    assert torch.allclose(attention(q, k, v, window), reference_attention(q, k, v, window), atol=1e-5)


def test_sliding_window_limits_context():
    # block 0 has a 128-token window at context 512: position 300 cannot see token 0, position 100 can
    torch.manual_seed(0)
    cfg = tiny_config(sequence_len=512, window_pattern="S", n_layer=2)
    assert window_sizes(cfg) == [128, 512]  # the last layer is always full
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        for p in model.parameters():  # leave the identity init so attention matters
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 256, (1, 512))
    other = idx.clone()
    other[0, 0] = (idx[0, 0] + 1) % 256

    def block0(ids):
        return model.run_blocks(model.embed(ids), ids, 0, 1).x[0]

    a, b = block0(idx), block0(other)
    assert torch.equal(a[300], b[300])
    assert not torch.allclose(a[100], b[100])


def test_estimate_flops_formula():
    cfg = config_for_depth(12, window_pattern="L")
    with torch.device("meta"):
        m = GPT(cfg)
    matmul = m.matmul_parameters()
    assert m.estimate_flops() == 6 * matmul + 12 * 6 * 128 * 2048 * 12
    cfg = config_for_depth(12, window_pattern="SSSL")
    with torch.device("meta"):
        m2 = GPT(cfg)
    assert m2.estimate_flops() == 6 * matmul + 12 * 6 * 128 * (512 * 9 + 2048 * 3)
    # causal: the mean number of keys a query attends to, min(t + 1, window), by brute force
    mean_keys = [sum(min(t + 1, w) for t in range(2048)) / 2048 for w in (512, 2048)]
    assert m2.estimate_flops(causal=True) == pytest.approx(6 * matmul + 12 * 6 * 128 * (mean_keys[0] * 9 + mean_keys[1] * 3))
    assert mean_keys[1] == 2049 / 2
    assert m.num_scaling_params() == sum(p.numel() for n, p in m.named_parameters()
                                         if (n.startswith("blocks.") and p.ndim == 2 and "value_embed" not in n)
                                         or n in ("lm_head.weight", "smear_gate.weight"))


def test_meta_build_then_init_is_deterministic():
    torch.manual_seed(1)
    a = build_model(tiny_config(), "cpu")
    torch.manual_seed(1)
    b = build_model(tiny_config(), "cpu")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.count_nonzero(a.blocks[0].attn.c_proj.weight) == 0
    assert torch.count_nonzero(a.blocks[0].mlp.c_proj.weight) == 0


def perturbed_model():
    """A tiny model (C = 128, so 4C = 512) moved off its init, where zero output projections would zero most
    gradients."""
    torch.manual_seed(0)
    model = build_model(tiny_config(n_embd=128, n_head=2, n_kv_head=1), "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.mark.parametrize("split", [2, 4])
def test_split_weight_gradient_matches_autograd(monkeypatch, split):
    """Linears with wgrad_split > 1 (what tune_wgrad_splits picks on a GPU for some shapes) give the same
    loss and, within rounding, the same gradients."""
    model = perturbed_model()
    idx = torch.randint(0, 256, (2, 64))

    def loss_and_grads():
        model.zero_grad()
        loss = model(idx, idx)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain = loss_and_grads()
    assert kernels.tune_wgrad_splits(model, 128, torch.float32) == {}  # CPU: nothing to tune
    tunable = kernels.tunable_linears(model)
    assert len(tunable) == 4 * 4  # q, attention proj, MLP fc and proj per block (k, v are 64 wide; not the lm_head)
    kernels.set_wgrad_splits(model, {tuple(m.weight.shape): (split, 0.0, 0.0) for m in tunable})
    calls = []
    real = splitk.weight_grad
    monkeypatch.setattr(splitk, "weight_grad", lambda dy, x, s: calls.append(s) or real(dy, x, s))
    split_loss, split_grads = loss_and_grads()
    assert calls == [split] * len(tunable)
    assert torch.equal(plain_loss, split_loss)
    assert plain.keys() == split_grads.keys()
    for name in plain:
        torch.testing.assert_close(split_grads[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_relu_square_keeps_only_its_output(monkeypatch):
    """ReLU^2's backward rebuilds relu(h) as sqrt(relu(h)^2): the same gradients as autograd's through
    F.relu(h).square() (the reference, --kernels reference), and the backward keeps one (tokens, 4C) tensor a
    layer (relu(h)^2, which c_proj needs for its weight gradient anyway), where autograd keeps relu(h) as well."""
    model = perturbed_model()
    idx = torch.randint(0, 256, (3, 64))

    def loss_grads_and_hidden_saved():
        model.zero_grad()
        saved = set()  # the distinct (tokens, 4C) activations kept for the backward
        keep = lambda t: saved.add(t.data_ptr()) if t.dim() and t.shape[-1] == 512 and t.numel() == 3 * 64 * 512 else None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
            loss = model(idx, idx)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, len(saved)

    loss, grads, hidden_saved = loss_grads_and_hidden_saved()
    monkeypatch.setattr(kernels.KERNELS, "mode", "reference")
    plain_loss, plain, plain_hidden = loss_grads_and_hidden_saved()
    assert torch.equal(loss, plain_loss) and grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    n_layer = len(model.blocks)
    assert plain_hidden == 2 * n_layer and hidden_saved == n_layer
