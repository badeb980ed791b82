"""
The FlashAttention-4 custom op's plumbing, on CPU, where the op's math in PyTorch (below, registered as its CPU
kernel, as flash kernels compute it) stands in for the kernels: the window convention and the log-sum-exp
against an independent float64 computation, the gradients through the registered backward against autograd
through SDPA, the op's registration (opcheck), and that torch.compile keeps it as one node. The CUDA kernels
themselves are checked against the same math where a GPU with flash-attn-4 is present (the last test), and
timed against cuDNN/FlexAttention by `python -m dev.bench_kernels attention`.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from nanochat import kernels
from nanochat.kernels.flash_attention import flash_attention as fa_op, flash_attention_backward
from nanochat.kernels.sdpa import band_mask


def _probabilities(q, k, window):
    """Softmax probabilities P (B, Hq, T, T) and lse (B, Hq, T), fp32, with k already expanded to Hq heads."""
    T, D = q.size(1), q.size(3)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(D)
    pos = torch.arange(T, device=q.device)
    offset = pos[:, None] - pos[None, :]  # query position - key position
    scores = scores.masked_fill((offset < 0) | (offset >= window), float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return (scores - lse[..., None]).exp(), lse


def _expand(t, heads):
    return t.repeat_interleave(heads // t.size(2), dim=2)  # GQA: each kv head serves heads/Hkv query heads


def math_attention(q, k, v, window):
    """The op's forward in PyTorch: (out, lse) as the kernels return them."""
    p, lse = _probabilities(q, _expand(k, q.size(2)), window)
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand(v, q.size(2)).float())
    return out.to(q.dtype).contiguous(), lse.contiguous()


def math_attention_backward(dout, q, k, v, out, window):
    """The op's backward in PyTorch, as flash kernels compute it (recomputing P):
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D);
    under GQA the query heads that share a kv head add their dK and dV."""
    Hq, Hkv, D = q.size(2), k.size(2), q.size(3)
    ke, ve = _expand(k, Hq).float(), _expand(v, Hq).float()
    p, _ = _probabilities(q, ke, window)
    dout = dout.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
    ds = p * (dp - (dout * out.float()).sum(-1).transpose(1, 2)[..., None]) / math.sqrt(D)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    dk, dv = (t.unflatten(2, (Hkv, Hq // Hkv)).sum(3) for t in (dk, dv))
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()



fa_op.register_kernel("cpu")(math_attention)
flash_attention_backward.register_kernel("cpu")(
    lambda dout, q, k, v, out, lse, window: math_attention_backward(dout, q, k, v, out, window))


def test_window_goes_to_fa4_as_its_left_size():
    """The CPU kernel above takes our window (keys in (i - window, i]); FA4 takes window_size_left, the keys a query
    sees besides its own: window - 1, or None for the whole causal context. The op converts with _left, which the
    CPU kernel never calls, so the conversion is checked here."""
    from nanochat.kernels.flash_attention import _left
    assert (_left(4, 12), _left(1, 12), _left(12, 12), _left(4096, 2048)) == (3, 0, None, None)


def _inputs(B=2, T=12, Hq=4, Hkv=2, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=dtype)
    return [t.to(device) for t in (q, k, v)]


def _sdpa(q, k, v, window):
    """What kernels.attention computes without FA4: SDPA over (B, H, T, D) with an explicit causal band."""
    T = q.size(1)
    mask = band_mask(T, T, 0, window, q.device)
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
