"""The soft-capped cross-entropy: the Triton kernels (run on CPU through Triton's interpreter) against
float64 truth, and the PyTorch path the model uses off CUDA."""

import os
import sys
import subprocess
import importlib.util

import pytest
import torch
import torch.nn.functional as F


def truth(raw, targets, reduction):
    """float64 loss and gradient of the same inputs, by autograd."""
    x = raw.double().requires_grad_()
    loss = F.cross_entropy(15 * torch.tanh(x / 15), targets, ignore_index=-1, reduction=reduction)
    return loss, x


def compare(loss_fn, dtype, V, reduction, seed=0, scratch=False):
    g = torch.Generator().manual_seed(seed)
    N = 37
    raw = (torch.randn(N, V, generator=g) * 20).to(dtype)
    raw[5, :7] = 1e4  # saturated tanh
    raw[6, 3] = -1e4
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3] = targets[10] = -1  # ignored
    weights = torch.rand(N, generator=g) if reduction == "none" else torch.tensor(0.37)
    mine = raw.clone().requires_grad_()
    logits = mine * 1 if scratch else mine  # scratch: an intermediate the loss may overwrite, as in the model
    loss = loss_fn(logits, targets, reduction, scratch=scratch) if scratch else loss_fn(logits, targets, reduction)
    (loss.double() * weights).sum().backward()
    if not scratch:
        assert torch.equal(mine.detach(), raw)  # the input is left as it was
    ref_loss, ref = truth(raw, targets, reduction)
    (ref_loss * weights).sum().backward()
    loss_err = (loss.double() - ref_loss).abs().max().item()
    grad_err = ((mine.grad.double() - ref.grad).norm() / ref.grad.norm()).item()
    assert mine.grad.dtype == dtype and torch.isfinite(mine.grad).all()
    assert mine.grad[3].abs().max() == 0 and mine.grad[10].abs().max() == 0  # ignored rows get no gradient
    return loss_err, grad_err


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported)."""
    from nanochat.softcap_ce import kernel_loss
    for dtype, grad_tol in ((torch.float32, 1e-5), (torch.bfloat16, 6e-3)):
        # bf16: the gradient is rounded to bf16 (the interpreter truncates: up to 2^-8 relative)
        for V in (1000, 4096, 5000):  # one block, exactly one full block, several blocks with a ragged end
            for reduction in ("mean", "sum", "none"):
                for scratch in (False, True):
                    loss_err, grad_err = compare(kernel_loss, dtype, V, reduction, scratch=scratch)
                    assert loss_err < 1e-4 and grad_err < grad_tol, (dtype, V, reduction, scratch, loss_err, grad_err)
    print("kernels ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pip install triton)")
def test_kernels_match_float64_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and "kernels ok" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_pytorch_path_matches_float64(reduction):
    from nanochat.softcap_ce import softcap_cross_entropy  # on CPU tensors: the PyTorch path
    loss_err, grad_err = compare(softcap_cross_entropy, torch.float32, 1000, reduction)
    assert loss_err < 1e-4 and grad_err < 1e-5


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
