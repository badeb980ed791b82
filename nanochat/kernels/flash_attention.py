"""
FlashAttention-4 for training on Hopper and Blackwell: the kernels of the optional `flash-attn-4` package (CuTe
DSL, compiled on first use) behind one custom op, which torch.compile keeps as one node in its graph.

    out, lse = flash_attention(q, k, v, window)     q: (B, T, Hq, D), k/v: (B, T, Hkv, D), bf16
    out: causal attention, each query seeing at most `window` keys (itself included); lse (B, Hq, T), fp32: each
    query's log-sum-exp of scaled scores, which the backward needs.

Sliding windows run natively (the kernels skip the tiles outside the band), in the (B, T, H, D) layout the
projections produce. Off the GPU the op runs the same math in PyTorch (math_attention), which the CPU tests use
to check its plumbing: shapes, the window convention, the log-sum-exp, the gradients through its backward.
"""

import functools
import math
import warnings

import torch


@functools.cache
def _fa4():
    """The package's interface module, or None if it is not installed (or cannot load: said once)."""
    try:
        from flash_attn.cute import interface
    except ImportError:
        return None
    except Exception as e:  # installed but broken (e.g. a CUDA library mismatch): fall back, but say why
        warnings.warn(f"flash-attn-4 is installed but failed to import ({type(e).__name__}: {e}); "
                      f"using PyTorch's attention kernels instead")
        return None
    return interface


def device_supported(device):
    """Whether FlashAttention-4 runs on this device: the package imports and the GPU is sm90 (Hopper) or sm100
    (Blackwell). The facade asks once per device, before torch.compile traces the model."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10) and _fa4() is not None


def inputs_supported(dtype, head_dim):
    """bf16 or fp16 inputs, a head dim both archs compile (8-128, by 8)."""
    return dtype in (torch.bfloat16, torch.float16) and 8 <= head_dim <= 128 and head_dim % 8 == 0


def _left(window, T):
    """FA4's window_size_left: keys at most `window - 1` positions back, or None for the full causal context."""
    return window - 1 if window < T else None


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


@torch.library.custom_op("nanochat::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        out, lse = _fa4()._flash_attn_fwd(q, k, v, causal=True, window_size_left=_left(window, q.size(1)),
                                          return_lse=True)
        return out, lse
    return math_attention(q, k, v, window)


@torch.library.custom_op("nanochat::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        return _fa4()._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=_left(window, q.size(1)))
    return math_attention_backward(dout, q, k, v, out, window)


@flash_attention.register_fake
def _(q, k, v, window):
    B, T, H, _ = q.shape  # the kernels return fresh contiguous tensors
    return q.new_empty(q.shape), q.new_empty(B, H, T, dtype=torch.float32)


@flash_attention_backward.register_fake
def _(dout, q, k, v, out, lse, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window = window


def _backward(ctx, dout, dlse):
    # lse is an output only for the backward's sake: nothing downstream differentiates it (dlse is None)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(dout.contiguous(), q, k, v, out, lse, ctx.window)
    return dq, dk, dv, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)
