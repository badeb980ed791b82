"""
The kernel switch (nanochat.kernels): with `reference`, no kernel path runs, even where every kernel would
apply; with `auto`, each op picks its kernel where it applies. On CPU no kernel applies, so the tests fake
the availability checks (as a GPU with Triton and flash-attn-4 would answer them) and replace each kernel by
a recorder that returns the reference result, then run a small model forward and backward.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanochat import fp8, gpt, kernels
from nanochat.gpt import GPTConfig, MLP, build_model, window_sizes
from nanochat.kernels import Linear, relu_square_mm, rotary, sdpa, softcap_ce, splitk

CONFIG = GPTConfig(sequence_len=256, vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")


def math_of(fn):
    """fn with the kernels switched off: the model's own math."""
    def run(*args):
        saved, kernels.KERNELS.mode = kernels.KERNELS.mode, "reference"
        try:
            return fn(*args)
        finally:
            kernels.KERNELS.mode = saved
    return run


def fake_kernels(monkeypatch, calls, available=True, fa4=True):
    """Every availability question answers `available` (FA4's: `available and fa4`; cuDNN takes the full context
    only, as on a GPU); every kernel path appends its name to `calls` and returns what the math computes."""
    monkeypatch.setattr(kernels, "takes_fa4", lambda q: available and fa4)
    monkeypatch.setattr(kernels, "takes_cudnn", lambda q, window: available and window >= q.size(2))
    monkeypatch.setattr(kernels, "flex_block_mask", lambda q, window: window if available else None)  # the "mask"
    for module in (relu_square_mm, rotary, softcap_ce):
        monkeypatch.setattr(module, "supported", lambda x: available)

    def fa4_kernel(q, k, v, window):  # (B, T, H, D) in and out
        out = sdpa.reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
        return out.transpose(1, 2), None

    def fused_mlp(x, w_fc, w_proj, fc_split, proj_split):
        return F.relu(x @ w_fc.t()).square() @ w_proj.t()

    def head_losses(x, weight, targets, cap):
        logits = gpt.softcap(x.reshape(-1, x.size(-1)) @ weight.t())
        return F.cross_entropy(logits, targets.reshape(-1), ignore_index=-1, reduction="none")

    def fp8_mlp(x, w_fc, w_proj, use_kernels):
        calls.append(f"fp8 kernels={use_kernels}")
        return fused_mlp(x, w_fc, w_proj, 1, 1)

    def record(label, fn):
        return lambda *args: calls.append(label) or fn(*args)

    for module, name, label, fn in [
        (kernels.flash_attention, "flash_attention", "FA4", fa4_kernel),
        (sdpa, "cudnn_attention", "cuDNN", lambda q, k, v: sdpa.reference_attention(q, k, v, q.size(2))),
        (sdpa, "flex_attention", "Flex", sdpa.reference_attention),
        (relu_square_mm.FusedMLP, "apply", "fused MLP", fused_mlp),
        (relu_square_mm.ReluSquare, "apply", "ReLU^2 keeping its output", lambda h: F.relu(h).square()),
        (rotary, "rotary_norm_op", "rotary+norm", lambda x, cos, sin, scale: math_of(gpt.rotary_norm)(x, cos, sin)),
        (softcap_ce, "kernel_head_losses", "head loss", head_losses),
        (splitk.SplitWeightGradLinear, "apply", "split-K", lambda x, w, split: F.linear(x, w)),
        (splitk, "tune", "split-K tuning", lambda linears, tokens, dtype: {}),
    ]:
        monkeypatch.setattr(module, name, record(label, fn))
    monkeypatch.setattr(fp8._Fp8MLP, "apply", fp8_mlp)


def train_step(model):
    """One forward and backward (of one sequence: a windowed layer and a full one), the way training runs them (split weight gradients set where they could be)."""
    kernels.prepare_attention(CONFIG, window_sizes(CONFIG), "cpu", torch.float32)
    kernels.tune_wgrad_splits(model, CONFIG.sequence_len, torch.float32)
    for m in model.modules():
        if type(m) is Linear:
            m.wgrad_split = 2
    idx = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.sequence_len), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)
    loss.backward()
    return loss.detach()


def tiny_model():
    torch.manual_seed(0)
    model = build_model(CONFIG, "cpu")
    with torch.no_grad():  # leave the identity init, so every op matters
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def test_reference_mode_runs_no_kernel_where_all_would_apply(monkeypatch):
    calls = []
    fake_kernels(monkeypatch, calls)
    monkeypatch.setattr(kernels.KERNELS, "mode", "reference")
    loss = train_step(tiny_model())
    assert calls == []
    assert kernels.prepare_attention(CONFIG, window_sizes(CONFIG), "cpu", torch.float32) == "SDPA (reference)"
    # fp8's MLP (tensorwise) runs its products in PyTorch
    fp8_mlp = fp8.make_fp8(MLP(CONFIG))
    fp8_mlp(torch.randn(16, CONFIG.n_embd))
    assert calls == ["fp8 kernels=False"]
    # what auto runs on CPU (no kernel applies): the same loss
    monkeypatch.setattr(kernels.KERNELS, "mode", "auto")
    calls.clear()
    fake_kernels(monkeypatch, calls, available=False)
    assert torch.equal(train_step(tiny_model()), loss)
    # ReLU^2 keeping its output only, and the split-K weight gradients (which apply on CPU too, where set)
    assert set(calls) == {"ReLU^2 keeping its output", "split-K tuning", "split-K"}


def test_the_switch_covers_l3s_lookup(monkeypatch):
    """L3's lookup kernels (faked as available, recorded, computing the blocked path's math): never in reference mode."""
    import dataclasses
    from nanochat import l3
    from nanochat.kernels import l3_lookup
    calls = []
    monkeypatch.setattr(l3_lookup, "supported", lambda x: True)
    monkeypatch.setattr(l3_lookup.Lookup, "apply", lambda x, keys, table, plan, into: calls.append("L3") or
                        l3._BlockedLookup.apply(x, keys, table, plan, l3.L3_CHUNK_BYTES, into))
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(CONFIG, l3_after_layers=(0,), l3_n_emb=512, l3_k_max=8), "cpu")
    model.l3["0"].path = "blocked"  # the path GPUs take (CPU would pick padded at this size)
    for mode, expected in (("reference", []), ("auto", ["L3"])):
        monkeypatch.setattr(kernels.KERNELS, "mode", mode)
        calls.clear()
        train_step(model)
        assert calls == expected, mode


def test_auto_mode_picks_every_kernel_where_it_applies(monkeypatch):
    monkeypatch.setattr(kernels.KERNELS, "mode", "auto")
    n_layer = CONFIG.n_layer
    calls = []
    fake_kernels(monkeypatch, calls)
    model = tiny_model()
    train_step(model)
    linears = sum(type(m) is Linear for m in model.modules()) - 1  # all but the lm_head (the head loss's)
    assert calls.count("FA4") == n_layer
    assert calls.count("rotary+norm") == 2 * n_layer  # q and k
    assert calls.count("fused MLP") == n_layer
    assert calls.count("head loss") == 1
    assert calls.count("split-K tuning") == 1
    assert calls.count("split-K") == linears - 2 * n_layer  # not the MLP's own: the fused MLP splits them itself
    assert not {"ReLU^2 keeping its output", "cuDNN", "Flex"} & set(calls)
    # without flash-attn-4: cuDNN for the full context (the L layer), FlexAttention for the window (S)
    calls.clear()
    fake_kernels(monkeypatch, calls, fa4=False)
    train_step(tiny_model())
    assert calls.count("cuDNN") == 1 and calls.count("Flex") == 1 and "FA4" not in calls
    # decoding with a KV cache (more keys than queries) takes the reference: cuDNN's and FA4's causal masks align
    # the queries with the first keys, not the last
    calls.clear()
    for fa4 in (True, False):
        fake_kernels(monkeypatch, calls, fa4=fa4)
        q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 9, 16)
        assert torch.equal(kernels.attention(q, kv, kv, 256), sdpa.reference_attention(q, kv, kv, 256))
    assert calls == []
    # fp8's MLP uses its Triton products
    fp8.make_fp8(MLP(CONFIG))(torch.randn(16, CONFIG.n_embd))
    assert calls[-1] == "fp8 kernels=True"


CHECK_ENVIRONMENT = """
import importlib, os
from nanochat import kernels
print(kernels.KERNELS.mode, kernels.set_mode(None))
os.environ["NANOCHAT_KERNELS"] = "off"
try:
    importlib.reload(kernels)
except SystemExit as e:  # a bad value at import: one line, no traceback
    print(e)
"""


def test_the_switch_comes_from_the_environment_and_the_flag():
    out = subprocess.run([sys.executable, "-c", CHECK_ENVIRONMENT], env={**os.environ, "NANOCHAT_KERNELS": "reference"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["reference reference", "ERROR: NANOCHAT_KERNELS='off': use one of auto, reference"]
    before = kernels.KERNELS.mode
    try:
        assert kernels.set_mode("reference") == "reference" and kernels.set_mode(None) == "reference"
        with pytest.raises(ValueError, match="--kernels 'fast'"):  # a ConfigError, a ValueError too
            kernels.set_mode("fast")
    finally:
        kernels.set_mode(before)


def test_base_train_takes_the_flag(env):
    from conftest import run_script, read_run, TINY_MODEL
    p = run_script("scripts.base_train", ["--device-batch-size", "4", "--total-batch-size", "512", "--num-iterations", "2",
                                          "--model-tag", "reference", "--kernels", "reference"] + TINY_MODEL, env)
    run = read_run(env, "reference")
    assert "attention: SDPA (reference)" in p.stdout and sorted(run.losses()) == [0, 1]
    assert run.header["kernels"] == "reference" and run.header["attention"] == "SDPA (reference)"
