"""fp8 on CPU: which layers convert, the bf16 swap for evaluation, checkpoint compatibility, and the
fallback message. (fp8 matmuls themselves need an SM89+ GPU; their speed and loss are in dev/LOG.md.)"""

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao is a declared dependency; it is missing from this environment")

from nanochat.fp8 import is_eligible, convert_to_fp8, bf16_linears, _is_fp8
from nanochat.gpt import GPTConfig, build_model, Linear


def model():
    torch.manual_seed(0)
    return build_model(GPTConfig(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128), "cpu")


def test_filter_picks_block_linears_only():
    assert is_eligible(torch.nn.Linear(128, 512, bias=False), "blocks.0.mlp.c_fc")
    assert not is_eligible(torch.nn.Linear(128, 120, bias=False), "x")  # not a multiple of 16
    assert not is_eligible(torch.nn.Linear(64, 512, bias=False), "x")   # below 128
    assert not is_eligible(torch.nn.Linear(128, 512, bias=False), "lm_head")
    assert not is_eligible(torch.nn.Embedding(512, 128), "wte")


def test_convert_then_swap_for_eval_shares_weights():
    m = model()
    params_before = {n: p for n, p in m.named_parameters()}
    n = convert_to_fp8(m, "tensorwise", force=True)
    fp8 = {name for name, mod in m.named_modules() if _is_fp8(mod)}
    assert n == len(fp8) == 2 * 6  # q, k, v, proj, fc, mlp proj per block
    assert "lm_head" not in fp8 and "blocks.0.attn.ve_gate" not in fp8 and "blocks.1.attn.ve_gate" not in fp8
    # the very same Parameter objects: the optimizer keeps working on them
    assert all(p is params_before[name] for name, p in m.named_parameters())
    with bf16_linears(m):
        assert not any(_is_fp8(mod) for mod in m.modules())
        assert type(m.blocks[0].mlp.c_fc) is Linear
        assert m.blocks[0].mlp.c_fc.weight is params_before["blocks.0.mlp.c_fc.weight"]
        idx = torch.randint(0, 512, (1, 16))
        ref = model()  # same seed, never converted
        assert torch.allclose(m(idx), ref(idx))
    assert {name for name, mod in m.named_modules() if _is_fp8(mod)} == fp8


def test_checkpoints_load_across_fp8():
    from nanochat.checkpoint_manager import full_model_state, load_model_state
    plain, converted = model(), model()
    convert_to_fp8(converted, "rowwise", force=True)
    assert plain.state_dict().keys() == converted.state_dict().keys()
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(1.0)
    load_model_state(plain, full_model_state(converted))  # fp8 -> bf16
    for (a, p), (b, q) in zip(plain.named_parameters(), converted.named_parameters()):
        assert torch.equal(p, q), a
    other = model()
    convert_to_fp8(other, "tensorwise", force=True)
    load_model_state(other, full_model_state(plain))  # bf16 -> fp8
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), plain.parameters()))


def test_no_cuda_falls_back_with_a_message(capsys):
    m = model()
    assert convert_to_fp8(m, "tensorwise", torch.device("cpu")) == 0
    assert "continuing without fp8" in capsys.readouterr().out
    assert not any(_is_fp8(mod) for mod in m.modules())
