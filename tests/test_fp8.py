"""fp8 on CPU: which layers convert, the bf16 swap for evaluation, checkpoint compatibility, the
fallback message, and ReLU^2's cast of c_fc's gradient (its Triton kernel through Triton's interpreter).
(Training speed and loss with fp8 need an SM89+ GPU: dev/LOG.md.)"""

import os
import sys

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao is a declared dependency; it is missing from this environment")

from nanochat.fp8 import is_eligible, convert_to_fp8, bf16_linears, _is_fp8, ReluSquareFp8Grad
from nanochat.gpt import GPTConfig, build_model, Linear, ReluSquare
from triton_interpreter import needs_triton, run_under_interpreter


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
    assert all(type(block.mlp.act) is ReluSquareFp8Grad for block in m.blocks)
    # tensorwise: fast accumulation in the backward matmuls as well as in the forward one
    assert all(c.use_fast_accum for c in m.blocks[0].mlp.c_fc.linear_mm_config)
    with bf16_linears(m):
        assert not any(_is_fp8(mod) for mod in m.modules())
        assert all(type(block.mlp.act) is ReluSquare for block in m.blocks)
        assert type(m.blocks[0].mlp.c_fc) is Linear
        assert m.blocks[0].mlp.c_fc.weight is params_before["blocks.0.mlp.c_fc.weight"]
        idx = torch.randint(0, 512, (1, 16))
        ref = model()  # same seed, never converted
        assert torch.allclose(m(idx), ref(idx))
    assert {name for name, mod in m.named_modules() if _is_fp8(mod)} == fp8
    assert all(type(block.mlp.act) is ReluSquareFp8Grad for block in m.blocks)


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


def grad_inputs(n=4099):
    """A gradient and pre-activations with a tail past the kernel's block, zeros and negatives in h."""
    g = torch.Generator().manual_seed(1)
    grad = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    h = torch.randn(n, generator=g).to(torch.bfloat16)
    return grad, h


def test_relu_square_backward_hands_over_torchaos_cast():
    """The gradient leaving ReLU^2 is what torchao would make of g_h = 2 relu(h) g in fp32: its tensorwise
    scale and its saturated e5m2 cast, tagged as a gradient for the fp8 matmuls."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    m = model()
    convert_to_fp8(m, "tensorwise", force=True)
    act = m.blocks[0].mlp.act
    grad, h = grad_inputs()
    h.requires_grad_()
    y = act(h)
    assert torch.equal(y, torch.relu(h.detach()).square())
    y.backward(grad)
    got = h.grad
    assert isinstance(got, Float8TrainingTensor) and got._gemm_input_role is GemmInputRole.GRAD_OUTPUT
    assert got._data.dtype == torch.float8_e5m2 and got._linear_mm_config == m.blocks[0].mlp.c_fc.linear_mm_config
    g_h = 2 * torch.relu(h.detach().float()) * grad.float()
    scale = tensor_to_scale(g_h, torch.float8_e5m2)
    assert torch.equal(got._scale, scale)
    assert torch.equal(got._data.view(torch.uint8), to_fp8_saturated(g_h * scale, torch.float8_e5m2).view(torch.uint8))


def test_fp8_gradient_reaches_the_weights_as_well_as_torchaos_own_cast():
    """End to end on CPU: c_fc's weight gradient with our cast of its incoming gradient is as close to the
    bf16 model's as with torchao casting it itself (both carry e5m2 rounding; ours casts from fp32)."""
    torch.manual_seed(0)
    idx, targets = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    grads = {}
    for variant in ("ours", "torchao", "bf16"):
        m = model()
        torch.manual_seed(1)
        for block in m.blocks:  # zero at init: no gradient would reach c_fc
            block.mlp.c_proj.weight.data.normal_(0, 0.02)
        if variant != "bf16":
            convert_to_fp8(m, "tensorwise", force=True)
        if variant == "torchao":
            for block in m.blocks:
                block.mlp.act = ReluSquare()
        with torch.autocast("cpu", torch.bfloat16):
            m(idx, targets).backward()
        grads[variant] = torch.cat([b.mlp.c_fc.weight.grad.float().flatten() for b in m.blocks])
    exact = grads["bf16"]
    err = {v: ((grads[v] - exact).norm() / exact.norm()).item() for v in ("ours", "torchao")}
    assert 0 < err["ours"] < 1.2 * err["torchao"] and err["torchao"] < 0.2, err


def test_rowwise_is_torchaos_recipe_as_it_is():
    m = model()
    convert_to_fp8(m, "rowwise", force=True)
    assert all(type(block.mlp.act) is ReluSquare for block in m.blocks)
    assert [c.use_fast_accum for c in m.blocks[0].mlp.c_fc.linear_mm_config] == [True, False, False]


def check_cast(exact):
    """The Triton cast against the PyTorch one, including saturation (a scale that pushes values past e5m2's
    largest). On a GPU bit for bit (`exact`). Triton's interpreter rounds to fp8 without carrying into the
    exponent (x.11|1 becomes x.00 instead of (x+1).00, so 127.7 gives 64, not 128): there, every value must
    match except such ones, which then are half the PyTorch value, a power of two."""
    from nanochat.fp8 import grad_to_fp8_op, reference_grad_to_fp8
    grad, h = grad_inputs()
    device = "cuda" if exact else "cpu"
    grad, h = grad.to(device), h.to(device)
    amax = (2 * torch.relu(h.float()) * grad.float()).abs().max()
    for scale in (57344.0 / amax, 4 * 57344.0 / amax):
        got = grad_to_fp8_op(grad, h, scale.float(), torch.float8_e5m2).float().cpu()
        want = reference_grad_to_fp8(grad, h, scale.float(), torch.float8_e5m2).float().cpu()
        assert want.abs().max() == 57344  # the largest value, reached or saturated to
        differ = got != want
        if exact:
            assert not differ.any(), (got - want).abs().max()
        else:
            assert differ.float().mean() < 0.05 and torch.equal(got[differ] * 2, want[differ])
            assert torch.equal(torch.frexp(want[differ]).mantissa.abs(), torch.full_like(want[differ], 0.5))


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported)."""
    check_cast(exact=False)
    print("kernels ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cast_kernel_bit_for_bit_on_gpu():
    check_cast(exact=True)


@needs_triton
def test_cast_kernel_matches_pytorch_under_triton_interpreter():
    run_under_interpreter(__file__)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
