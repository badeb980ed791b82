"""fp8 on CPU: which layers convert, the bf16 swap for evaluation, checkpoint compatibility, the
fallback message, and the tensorwise MLP (Fp8MLP) against torchao's fp8 Linears, with its Triton kernels
through Triton's interpreter. (Training speed and loss with fp8 need an SM89+ GPU: dev/LOG.md.)"""

import copy
import os
import sys

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao is a declared dependency; it is missing from this environment")

from nanochat.fp8 import is_eligible, convert_to_fp8, bf16_linears, Fp8Linear, Fp8MLP, _Fp8MLP
from nanochat.gpt import GPTConfig, build_model, Linear, MLP
from triton_interpreter import needs_interpreter_37, run_under_interpreter


def model():
    torch.manual_seed(0)
    return build_model(GPTConfig(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128), "cpu")


def test_filter_picks_block_linears_only():
    assert is_eligible(torch.nn.Linear(128, 512, bias=False), "blocks.0.mlp.c_fc")
    assert not is_eligible(torch.nn.Linear(128, 120, bias=False), "x")  # not a multiple of 16
    assert not is_eligible(torch.nn.Linear(64, 512, bias=False), "x")   # below 128
    assert not is_eligible(torch.nn.Linear(128, 512, bias=False), "lm_head")
    assert not is_eligible(torch.nn.Embedding(512, 128), "wte")


def fp8_modules(m):
    return {name for name, mod in m.named_modules() if getattr(mod, "fp8", False)}


def test_convert_then_swap_for_eval_shares_weights():
    m = model()
    with torch.no_grad():  # the blocks start as identities (zero output projections): make them count
        for block in m.blocks:
            block.attn.c_proj.weight.normal_(std=0.1)
            block.mlp.c_proj.weight.normal_(std=0.1)
    ref = copy.deepcopy(m)  # never converted
    params_before = {n: p for n, p in m.named_parameters()}
    n = convert_to_fp8(m, force=True)
    # Fp8Linear for q, k, v and the attention's proj; the MLP's two in Fp8MLP
    assert n == 2 * 6
    assert fp8_modules(m) == {f"blocks.{i}.{name}" for i in range(2) for name in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp")}
    assert all(type(block.attn.c_q) is Fp8Linear for block in m.blocks)
    assert all(type(block.mlp) is Fp8MLP and type(block.mlp.c_fc) is Linear for block in m.blocks)
    # the very same Parameter objects: the optimizer keeps working on them
    assert all(p is params_before[name] for name, p in m.named_parameters())
    idx = torch.randint(0, 512, (1, 16))
    assert not torch.allclose(m(idx), ref(idx), atol=1e-3)  # fp8's rounding shows
    with bf16_linears(m):
        assert not fp8_modules(m)
        assert torch.equal(m(idx), ref(idx))
    assert len(fp8_modules(m)) == 2 * 5


def test_checkpoints_load_across_fp8():
    from nanochat.checkpoint_manager import full_model_state, load_model_state
    plain, converted = model(), model()
    convert_to_fp8(converted, force=True)
    assert plain.state_dict().keys() == converted.state_dict().keys()
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(1.0)
    load_model_state(plain, full_model_state(converted))  # fp8 -> bf16
    for (a, p), (b, q) in zip(plain.named_parameters(), converted.named_parameters()):
        assert torch.equal(p, q), a
    other = model()
    convert_to_fp8(other, force=True)
    load_model_state(other, full_model_state(plain))  # bf16 -> fp8
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), plain.parameters()))


def test_no_cuda_falls_back_with_a_message(capsys):
    m = model()
    assert convert_to_fp8(m, torch.device("cpu")) == 0
    assert "continuing without fp8" in capsys.readouterr().out
    assert not fp8_modules(m)


def mlp_case(C=128, M=512, seed=0):
    """An MLP with both weights drawn (c_proj is zero at init), an input and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    mlp = MLP(GPTConfig(n_embd=C))
    torch.nn.init.normal_(mlp.c_fc.weight, std=C ** -0.5, generator=g)
    torch.nn.init.normal_(mlp.c_proj.weight, std=(4 * C) ** -0.5, generator=g)
    return mlp, torch.randn(M, C, generator=g), torch.randn(M, C, generator=g)


def run_mlp(mlp, x, dout, dtype, forward=None):
    """Output and the gradients of x, c_fc's weight and c_proj's weight, in float32, of forward (mlp itself
    unless given)."""
    mlp.zero_grad()
    xr = x.detach().to(dtype).requires_grad_()
    out = (forward or mlp)(xr)
    out.backward(dout.to(dtype))
    return [out.float(), xr.grad.float(), mlp.c_fc.weight.grad.clone(), mlp.c_proj.weight.grad.clone()]


def fused_forward(mlp, kernels):
    """_Fp8MLP on mlp's weights, with the Triton products or the PyTorch ones."""
    return lambda x: _Fp8MLP.apply(x, mlp.c_fc.weight, mlp.c_proj.weight, kernels)


def fp8_mlp(mlp):
    """A copy of mlp as convert_to_fp8 makes it (tensorwise)."""
    holder = torch.nn.Sequential(copy.deepcopy(mlp))
    assert convert_to_fp8(holder, force=True) == 2
    assert type(holder[0]) is Fp8MLP
    return holder[0]


def rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def test_fp8_mlp_follows_torchaos_tensorwise_recipe():
    """Fp8MLP's output and gradients are as far from float32 math as torchao's fp8 Linears' (same casts and
    scales; ours skips the bf16 rounding of h), and close to them."""
    from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    mlp, x, dout = mlp_case()
    exact = run_mlp(mlp, x, dout, torch.float32)
    torchao_mlp = copy.deepcopy(mlp)
    convert_to_float8_training(torchao_mlp, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    theirs, ours = run_mlp(torchao_mlp, x, dout, torch.bfloat16), run_mlp(fp8_mlp(mlp), x, dout, torch.bfloat16)
    for name, o, t, e in zip(("out", "x", "W_fc", "W_proj"), ours, theirs, exact):
        assert 0.01 < rel_err(o, e) < 1.1 * rel_err(t, e), (name, rel_err(o, e), rel_err(t, e))
        assert rel_err(o, t) < 0.5 * rel_err(t, e), (name, rel_err(o, t), rel_err(t, e))


def test_fp8_mlp_takes_the_bf16_path_for_token_counts_fp8_cannot_multiply():
    mlp, x, _ = mlp_case(M=300)  # the weight gradients' products over 300 tokens: not a multiple of 16
    assert torch.equal(fp8_mlp(mlp)(x.bfloat16()), mlp(x.bfloat16()))


def test_fp8_linear_gives_torchaos_numbers():
    """Fp8Linear is torchao's tensorwise Float8Linear (fast accumulation in all three products): the same
    output and gradients, bit for bit, but for the weight gradient in bf16, which ours returns in the
    weight's float32 and torchao rounds to bf16 first."""
    import dataclasses
    from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig
    g = torch.Generator().manual_seed(0)
    linear = Linear(256, 384)
    torch.nn.init.normal_(linear.weight, std=256 ** -0.5, generator=g)
    x, dout = torch.randn(512, 256, generator=g), torch.randn(512, 384, generator=g)
    fast = Float8GemmConfig(use_fast_accum=True)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), gemm_config_grad_input=fast,
                                 gemm_config_grad_weight=fast)
    torchao_holder, our_holder = torch.nn.Sequential(copy.deepcopy(linear)), torch.nn.Sequential(copy.deepcopy(linear))
    convert_to_float8_training(torchao_holder, config=config)
    assert convert_to_fp8(our_holder, force=True) == 1 and type(our_holder[0]) is Fp8Linear
    for dtype in (torch.float32, torch.bfloat16):
        theirs, ours = (run_linear(holder[0], x, dout, dtype) for holder in (torchao_holder, our_holder))
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        assert torch.equal(ours[2].to(dtype).float(), theirs[2])
        assert rel_err(ours[0], run_linear(linear, x, dout, torch.float32)[0]) > 0.01  # fp8, not a plain product


def run_linear(linear, x, dout, dtype):
    """Output, x's gradient and the weight's, in float32."""
    linear.zero_grad()
    xr = x.detach().to(dtype).requires_grad_()
    out = linear(xr)
    out.backward(dout.to(dtype))
    return [out.float(), xr.grad.float(), linear.weight.grad.clone()]


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported): the fused fp8 products (Triton) against
    their PyTorch versions, alone and inside _Fp8MLP, with ragged tiles (K = 48 or 96 against BLOCK_K = 128)
    and more tiles than the interpreter's 4 programs; in float16, as the interpreter mishandles bfloat16."""
    from nanochat import fp8
    from nanochat.kernels import relu_square_mm as rsm
    for C, M in ((96, 300), (48, 200)):
        mlp, x, dout = mlp_case(C, M)
        x8, x_inv = fp8.to_fp8(x.half(), fp8.E4M3)
        w_fc8, w_fc_inv = fp8.to_fp8(mlp.c_fc.weight.detach(), fp8.E4M3)
        dout8, dout_inv = fp8.to_fp8(dout.half(), fp8.E5M2)
        w_proj8_t, w_proj_inv = fp8.to_fp8(mlp.c_proj.weight.detach().t().contiguous(), fp8.E4M3)
        results = {}
        for kernels in (True, False):
            y, y_amax = fp8.fc_relu_square(x8, w_fc8, x_inv * w_fc_inv, torch.float16, kernels)
            grad_h, grad_h_amax = fp8.relu_square_input_grad(dout8, w_proj8_t, y, dout_inv * w_proj_inv, kernels)
            results[kernels] = y, grad_h
            assert y.dtype == grad_h.dtype == torch.float16 and y.shape == grad_h.shape == (M, 4 * C)
            # 0-d, as the casts' own amax: compiled _scaled_mm wants its two scales of one rank
            assert y_amax.shape == grad_h_amax.shape == () and y_amax == y.abs().max() and grad_h_amax == grad_h.abs().max()
        for mine, ref in zip(results[True], results[False]):
            assert rel_err(mine, ref) < 1e-3
        # the whole MLP with the kernels and without: both sides cast what they get to fp8 in the same way
        kernel_run, pytorch_run = (run_mlp(mlp, x, dout, torch.float16, fused_forward(mlp, kernels)) for kernels in (True, False))
        for mine, ref in zip(kernel_run, pytorch_run):
            assert rel_err(mine, ref) < 1e-2
    x8, w8 = torch.randn(64, 16).to(fp8.E4M3), torch.randn(64, 16).to(fp8.E4M3)
    scale = torch.tensor(0.5)
    y, _ = rsm.fc_relu_square_fp8(x8, w8, scale, torch.float16)
    # (not opcheck's test_schema: its mutation check does arithmetic that CPU fp8 tensors lack)
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(rsm.fc_relu_square_fp8, (x8, w8, scale, torch.float16), test_utils=checks)
    torch.library.opcheck(rsm.relu_square_input_grad_fp8, (torch.randn(64, 16).to(fp8.E5M2), w8, y, scale), test_utils=checks)
    print("kernels ok")


@needs_interpreter_37
def test_fp8_mlp_kernels_match_pytorch_under_triton_interpreter():
    run_under_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an SM89+ CUDA GPU")
def test_fp8_mlp_kernels_on_gpu():
    """On the GPU in bf16: the Triton products give what the PyTorch ones give, up to the order of sums."""
    mlp, x, dout = mlp_case(256, 592)  # 16 x 37: ragged against the kernels' 128-row tiles
    mlp, x, dout = mlp.cuda(), x.cuda(), dout.cuda()
    runs = [run_mlp(mlp, x, dout, torch.bfloat16, fused_forward(mlp, kernels)) for kernels in (True, False)]
    for mine, ref in zip(*runs):
        assert rel_err(mine, ref) < 2e-2


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
