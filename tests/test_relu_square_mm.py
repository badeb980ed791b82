"""The MLP with ReLU^2 inside its products (relu_square_mm.py's Triton kernels, run on CPU through Triton's
interpreter): output and gradients against the module path (c_fc, ReLU^2, c_proj) in float32.

The interpreter's TMA loads and stores mishandle bfloat16 here, so the kernels are checked in float16 (the
kernel is the same for both); bfloat16 is checked on the GPU by dev/bench_relu_square_mm.py."""

import os
import sys

import pytest
import torch

from triton_interpreter import needs_interpreter_37, run_under_interpreter


def rel_err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported)."""
    from nanochat.kernels import relu_square_mm as rsm
    from nanochat.gpt import MLP, GPTConfig
    g = torch.Generator().manual_seed(0)
    # (tokens, C, weight-gradient splits): ragged tiles in every dimension (K = 40 or 96 against BLOCK_K = 64),
    # more tiles than the interpreter's 4 programs, and split weight gradients
    for M, C, fc_split, proj_split in ((300, 96, 1, 1), (200, 40, 2, 4)):
        mlp = MLP(GPTConfig(n_embd=C))
        torch.nn.init.normal_(mlp.c_fc.weight, std=C ** -0.5, generator=g)
        torch.nn.init.normal_(mlp.c_proj.weight, std=(4 * C) ** -0.5, generator=g)
        x = torch.randn(M, C, generator=g)
        dout = torch.randn(M, C, generator=g)
        # reference: the module path in float32
        ref_x = x.clone().requires_grad_()
        ref = mlp(ref_x)
        ref.backward(dout)
        ref_grads = [ref_x.grad, mlp.c_fc.weight.grad, mlp.c_proj.weight.grad]
        # the fused path in float16
        x16 = x.half().requires_grad_()
        w_fc = mlp.c_fc.weight.detach().half().requires_grad_()
        w_proj = mlp.c_proj.weight.detach().half().requires_grad_()
        out = rsm.FusedMLP.apply(x16, w_fc, w_proj, fc_split, proj_split)
        out.backward(dout.half())
        assert out.dtype == torch.float16 and out.shape == (M, C)
        errors = [rel_err(out, ref)] + [rel_err(mine, r) for mine, r in zip((x16.grad, w_fc.grad, w_proj.grad), ref_grads)]
        assert max(errors) < 5e-3, (M, C, errors)
        # smaller tiles than the default's (several per program, other groupings) agree with it up to the
        # order of the sums
        y = rsm.fc_relu_square(x16.detach(), w_fc.detach())
        grad_h = rsm.relu_square_input_grad(dout.half(), w_proj.detach(), y)
        w_proj_t = w_proj.detach().t().contiguous()
        for config in ((32, 64, 16, 2, 2, 4), (32, 32, 32, 3, 2, 4)):
            assert rel_err(rsm._launch(x16.detach(), w_fc.detach(), rsm.RELU_SQUARE, config=config), y) < 1e-3
            assert rel_err(rsm._launch(dout.half(), w_proj_t, rsm.RELU_SQUARE_GRAD, y=y, config=config), grad_h) < 1e-3
    # one row (a decoding step) whose stride a transpose left at 1: a TMA descriptor needs 16-byte row strides
    row = torch.randn(16, 1, generator=g).t().half()
    assert row.stride() == (1, 1) and rel_err(rsm.fc_relu_square(row, w_fc.detach()[:, :16]),
                                               torch.relu(row.float() @ w_fc.detach()[:, :16].float().t()).square()) < 1e-3
    # the ops' registrations (schema, fake tensors for torch.compile)
    x, w_fc, w_proj = torch.randn(64, 16).half(), torch.randn(64, 16).half(), torch.randn(16, 64).half()
    torch.library.opcheck(rsm.fc_relu_square, (x, w_fc))
    torch.library.opcheck(rsm.relu_square_input_grad, (x, w_proj, rsm.fc_relu_square(x, w_fc)))
    print("kernels ok")


@needs_interpreter_37
def test_fused_mlp_matches_the_module_path_under_triton_interpreter():
    run_under_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the bf16 kernels on the GPU)")
def test_fused_mlp_in_bf16_on_cuda(monkeypatch):
    """On the GPU in bf16, the fused path is as close to float32 math as the module path is."""
    from nanochat.gpt import MLP, GPTConfig
    from nanochat.kernels import relu_square_mm as rsm
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(n_embd=256)).cuda()
    torch.nn.init.normal_(mlp.c_fc.weight, std=256 ** -0.5)
    torch.nn.init.normal_(mlp.c_proj.weight, std=1024 ** -0.5)
    x = torch.randn(2, 300, 256, device="cuda")
    dout = torch.randn(2, 300, 256, device="cuda")
    supported = rsm.supported

    def run(dtype, fused):
        mlp.zero_grad()
        xr = x.to(dtype).detach().requires_grad_()
        monkeypatch.setattr(rsm, "supported", supported if fused else lambda x: False)
        out = mlp(xr)
        out.backward(dout.to(dtype))
        return [out, xr.grad, mlp.c_fc.weight.grad.clone(), mlp.c_proj.weight.grad.clone()]

    ref = run(torch.float32, False)
    fused, module = run(torch.bfloat16, True), run(torch.bfloat16, False)
    for f, m, r in zip(fused, module, ref):
        assert rel_err(f, r) < 1.5 * rel_err(m, r) + 1e-3, (rel_err(f, r), rel_err(m, r))


def test_fused_path_is_for_plain_modules(monkeypatch):
    """Where the kernels apply (CUDA, faked here), MLP takes the fused path with its own Linears, and the module
    path once tensor parallelism (or rowwise fp8) has swapped one of them."""
    from nanochat.gpt import MLP, GPTConfig
    from nanochat.kernels import relu_square_mm as rsm
    mlp = MLP(GPTConfig(n_embd=64))
    x = torch.randn(4, 64)
    calls = []
    monkeypatch.setattr(rsm.FusedMLP, "apply", lambda *args: calls.append(len(args)) or torch.zeros(4, 64))
    mlp(x)
    assert calls == []  # on CPU: not supported
    monkeypatch.setattr(rsm, "supported", lambda x: True)
    mlp(x)
    assert calls == [5]
    mlp.c_proj = torch.nn.Linear(256, 64, bias=False)  # e.g. a row-parallel swap
    mlp(x)
    assert calls == [5]


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
