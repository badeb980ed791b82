"""
Attention in PyTorch's own kernels, for q (B, Hq, T, D) and k/v (B, Hkv, S, D): causal, each query seeing at
most `window` keys (itself included); S > T when decoding with a KV cache (the queries sit at S-T .. S-1).
- reference_attention: SDPA as PyTorch dispatches it, is_causal for the full context and a boolean mask for a
  window (any device, any length, KV caches)
- cudnn_attention: the full context on CUDA, SDPA pinned to cuDNN first (faster than its flash backend on Hopper)
- flex_attention: a sliding window on CUDA at the training length, with a block mask that skips the masked blocks
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend


def dense_mask(T, S, window, device):
    """Boolean (T, S) mask: causal and at most `window` tokens back (the token itself included)."""
    q_pos = torch.arange(S - T, S, device=device)[:, None]
    k_pos = torch.arange(S, device=device)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


def reference_attention(q, k, v, window):
    T, S = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if window >= S and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(T, S, window, q.device), enable_gqa=gqa)


def cudnn_attention(q, k, v):
    """Full causal context on CUDA, S == T."""
    if q.size(1) != k.size(1):  # cuDNN/flash in SDPA want equal head counts: expand k/v
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# FlexAttention is imported where it is used: importing it loads torch's compiler, seconds in every process
def block_mask(T, window, device):
    """FlexAttention's block mask of a sliding window at length T (device indexed)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return create_block_mask(sliding_causal, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device)


@functools.cache
def _flex_compiled():
    """FlexAttention only runs fast compiled; compiled once, it is also fast inside an eager model."""
    from torch.nn.attention.flex_attention import flex_attention as flex
    return torch.compile(flex, dynamic=False)


def flex_attention(q, k, v, mask):
    """A sliding window at the length its block mask was built for (S == T)."""
    return _flex_compiled()(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
