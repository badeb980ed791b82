"""
The FlashAttention-4 custom op's plumbing, on CPU (where the op runs its PyTorch math): the window
convention and the log-sum-exp against an independent float64 computation, the gradients through the
registered backward against autograd through SDPA, the op's registration (opcheck), and that
torch.compile keeps it as one node. The CUDA kernels themselves are checked against cuDNN/FlexAttention
by dev/bench_attention.py on a GPU, and by the CUDA test at the end where one is present.
"""

import pytest
import torch
import torch.nn.functional as F

from nanochat import kernels
from nanochat.kernels.flash_attention import flash_attention as fa_op, math_attention
from nanochat.kernels.sdpa import dense_mask


def _inputs(B=2, T=12, Hq=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    return [t.to(device) for t in (q, k, v)]


def _sdpa(q, k, v, window):
    """What kernels.attention computes without FA4: SDPA over (B, H, T, D) with an explicit causal band."""
    T = q.size(1)
    mask = dense_mask(T, T, window, q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", [12, 5, 1])
def test_output_and_lse_match_float64(window):
    q, k, v = _inputs()
    out, lse = fa_op(q, k, v, window)
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd, vd = (t.repeat_interleave(2, dim=2) for t in (kd, vd))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / 4.0  # sqrt(D) = 4
    i = torch.arange(12)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # key j seen by query i
    scores = scores.masked_fill(~keep, float("-inf"))
    expected_lse = scores.logsumexp(-1)
    expected_out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vd)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-5, atol=1e-5)
    if window == 1:  # each query sees only itself: the output is its own value vector
        torch.testing.assert_close(out, v.repeat_interleave(2, dim=2))


@pytest.mark.parametrize("window", [12, 4])
def test_gradients_match_autograd_through_sdpa(window):
    q, k, v = (t.requires_grad_() for t in _inputs(seed=1))
    dout = torch.randn_like(q)
    fa_op(q, k, v, window)[0].backward(dout)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _sdpa(q, k, v, window).backward(dout)
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


def test_opcheck():
    q, k, v = (t.requires_grad_() for t in _inputs(T=8, Hq=2, Hkv=2, D=8))
    torch.library.opcheck(fa_op, (q, k, v, 3))
    torch.library.opcheck(fa_op, (q, k, v, 8))


def test_compiles_as_one_graph():
    q, k, v = (t.requires_grad_() for t in _inputs(seed=2))
    compiled = torch.compile(lambda q, k, v: fa_op(q, k, v, 6)[0].square().sum(), fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _sdpa(q, k, v, 6).square().sum().backward()
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


def test_not_used_off_gpu():
    assert not kernels.fa4_runs("cpu", torch.bfloat16, 128)


@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.fa4_runs("cuda", torch.bfloat16, 128)),
                    reason="needs flash-attn-4 on an sm90/sm100 GPU")
@pytest.mark.parametrize("window", [256, 64])
def test_kernels_match_reference_on_gpu(window):
    q, k, v = (t.bfloat16().requires_grad_() for t in _inputs(B=2, T=256, Hq=4, Hkv=4, D=128, device="cuda"))
    dout = torch.randn_like(q)
    out, lse = fa_op(q, k, v, window)
    out.backward(dout)
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = math_attention(qf, kf, vf, window)
    ref.backward(dout.float())
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
    for g, r in zip(got, [ref] + [t.grad for t in (qf, kf, vf)]):
        assert ((g.float() - r).norm() / r.norm()).item() < 2e-2
