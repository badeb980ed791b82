"""The soft-capped cross-entropy of the lm_head's logits: the Triton path (run on CPU through Triton's
interpreter) against float64 truth, and the PyTorch path the model uses off CUDA."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import needs_interpreter_37, run_under_interpreter


def make_inputs(dtype, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, d = 37, 16
    x = torch.randn(N, d, generator=g)
    w = torch.randn(V, d, generator=g) * 5  # logits with a spread of ~20
    w[:7] = 500 * x[5] / x[5].square().sum()  # row 5 saturates the tanh at +15 on 7 columns ...
    x[6] = -x[5]  # ... and row 6 at -15
    targets = torch.randint(0, V, (N,), generator=g)
    targets[5] = 2  # a saturated target
    targets[3] = targets[10] = -1  # ignored
    return x.to(dtype), w.to(dtype), targets


def truth(x, w, targets, reduction):
    """float64 loss and the gradients of x and w. The logits are rounded to the inputs' dtype first, as the
    matmul under test rounds them."""
    raw = (x @ w.t()).double().requires_grad_()
    loss = F.cross_entropy(15 * torch.tanh(raw / 15), targets, ignore_index=-1, reduction=reduction)
    return loss, raw


def compare(loss_fn, dtype, V, reduction):
    """Max loss error and the relative errors of both gradients, against truth()."""
    x, w, targets = make_inputs(dtype, V)
    weights = torch.rand(x.size(0)) if reduction == "none" else torch.tensor(0.37)
    mine_x, mine_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = loss_fn(mine_x, mine_w, targets, reduction)
    (loss.double() * weights).sum().backward()
    assert torch.equal(mine_x.detach(), x) and torch.equal(mine_w.detach(), w)  # inputs left as they were
    ref_loss, raw = truth(x, w, targets, reduction)
    (ref_loss * weights).sum().backward()
    ref_gx, ref_gw = raw.grad @ w.double(), raw.grad.t() @ x.double()
    loss_err = (loss.double() - ref_loss).abs().max().item()
    gx_err = ((mine_x.grad.double() - ref_gx).norm() / ref_gx.norm()).item()
    gw_err = ((mine_w.grad.double() - ref_gw).norm() / ref_gw.norm()).item()
    assert mine_x.grad.dtype == dtype and torch.isfinite(mine_x.grad).all() and torch.isfinite(mine_w.grad).all()
    assert mine_x.grad[3].abs().max() == 0 and mine_x.grad[10].abs().max() == 0  # ignored rows get no gradient
    with torch.no_grad():  # evaluation: the loss-only kernel gives the same losses
        assert torch.allclose(loss_fn(x, w, targets, reduction), loss.detach(), rtol=1e-6, atol=1e-6)
    return loss_err, gx_err, gw_err


def kernel_loss(x, w, targets, reduction):
    from nanochat.kernels.softcap_ce import kernel_head_losses
    from nanochat.gpt import reduce_losses, SOFTCAP
    return reduce_losses(kernel_head_losses(x, w, targets, SOFTCAP), targets, reduction)


def model_loss(x, w, targets, reduction):
    """gpt.SoftcapCrossEntropy, the model's math (CPU tensors: no kernel)."""
    from types import SimpleNamespace
    from nanochat.gpt import SoftcapCrossEntropy
    return SoftcapCrossEntropy()(x, SimpleNamespace(weight=w), targets, reduction)


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        # bf16: the gradient of the logits and the products are rounded to bf16
        for V in (1000, 4096, 5000):  # one block, exactly one full block, several blocks with a ragged end
            for reduction in ("mean", "sum", "none"):  # a scalar spread over the rows, and a weight per row
                loss_err, gx_err, gw_err = compare(kernel_loss, dtype, V, reduction)
                assert loss_err < 1e-4 and gx_err < tol and gw_err < tol, (dtype, V, reduction, loss_err, gx_err, gw_err)
    # small logits (|raw| << the cap) over a ragged block: a padded column counted would show (exp(0) each)
    from nanochat.kernels.softcap_ce import kernel_head_losses
    x, w, targets = make_inputs(torch.float32, 33)
    x, w = x.requires_grad_(), (w / 50).requires_grad_()
    ref, _ = truth(x.detach(), w.detach(), targets, "none")
    losses = kernel_head_losses(x, w, targets, 15.0)
    assert (losses.double() - ref).abs().max() < 1e-5
    weights = torch.rand(x.size(0))  # a weight per row, backward twice through a kept graph (as the reference allows)
    (losses * weights).sum().backward(retain_graph=True)
    first = x.grad.clone()
    (losses * weights).sum().backward()
    assert torch.allclose(x.grad, 2 * first, rtol=1e-5, atol=1e-7)
    for bad in (-100, 33):  # refused, as F.cross_entropy refuses them: not a loss of 0, or another row's logit
        wrong = targets.clone()
        wrong[0] = bad
        try:
            kernel_head_losses(x, w, wrong, 15.0)
            raise AssertionError(f"target {bad} taken")
        except RuntimeError as e:
            assert "targets: -1 or token ids" in str(e), e
    print("kernels ok")


@needs_interpreter_37
def test_kernel_matches_float64_under_triton_interpreter():
    run_under_interpreter(__file__)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_pytorch_path_matches_float64(reduction):
    loss_err, gx_err, gw_err = compare(model_loss, torch.float32, 1000, reduction)
    assert loss_err < 1e-4 and gx_err < 1e-5 and gw_err < 1e-5


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
