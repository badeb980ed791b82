"""Rotary positions + QK-norm: the Triton kernels behind the custom op (run on CPU through Triton's
interpreter) against float64 of the PyTorch math, forward and backward."""

import os
import sys

import torch

from triton_interpreter import needs_triton, run_under_interpreter


def check_kernels():
    """Run with TRITON_INTERPRET=1 (set before Triton is imported)."""
    from nanochat.kernels.rotary import rotary_norm_op
    from nanochat.gpt import rotary_norm, rotary_tables
    g = torch.Generator().manual_seed(0)
    # (B, T, H, D, position of the first token): one head vector per program's tail, GQA-like head counts,
    # a head_dim whose half is not a power of two, and a KV-cache-like offset into the tables
    for B, T, H, D, start in ((2, 5, 3, 16, 0), (1, 7, 2, 12, 4), (3, 33, 1, 8, 0)):
        cos, sin = rotary_tables(64, D)
        cos, sin = cos[:, start:start + T], sin[:, start:start + T]
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = (torch.randn(B, T, H, D, generator=g) * 3).to(dtype)
            x[0, 0, 0] = 0  # a zero vector: eps keeps it finite
            dy = torch.randn(B, T, H, D, generator=g).to(dtype)
            c, s = cos.to(dtype), sin.to(dtype)
            mine_x = x.clone().requires_grad_()
            y = rotary_norm_op(mine_x, c, s, 1.2)  # gpt.rotary_norm's scale
            y.backward(dy)
            ref_x = x.double().requires_grad_()
            ref = rotary_norm(ref_x, c.double(), s.double())  # the math (a CPU tensor: no kernel)
            ref.backward(dy.double())
            assert y.dtype == dtype and mine_x.grad.dtype == dtype
            y_err = ((y.double() - ref).norm() / ref.norm()).item()
            g_err = ((mine_x.grad.double() - ref_x.grad).norm() / ref_x.grad.norm()).item()
            assert y_err < tol and g_err < tol, (B, T, H, D, dtype, y_err, g_err)
            assert torch.isfinite(mine_x.grad).all()
        # the op's registrations (schema, fake tensor for torch.compile, autograd) on float32 inputs
        torch.library.opcheck(rotary_norm_op, (torch.randn(B, T, H, D, requires_grad=True), cos, sin, 1.2))
    print("kernels ok")


@needs_triton
def test_kernels_match_float64_under_triton_interpreter():
    run_under_interpreter(__file__)


def test_rotation_and_norm_commute():
    """The model's math: rotating then norming equals norming then rotating (the rotation keeps the norm)."""
    from nanochat.gpt import rotary_norm, rotary_tables
    import torch.nn.functional as F
    x = torch.randn(2, 9, 3, 16, dtype=torch.float64)
    cos, sin = (t[:, :9].double() for t in rotary_tables(9, 16))
    n = F.rms_norm(x, (16,), eps=torch.finfo(torch.float32).eps)
    n1, n2 = n[..., :8], n[..., 8:]
    expected = torch.cat([n1 * cos + n2 * sin, n2 * cos - n1 * sin], dim=-1) * 1.2
    assert torch.allclose(rotary_norm(x, cos, sin), expected, atol=1e-12)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    check_kernels()
