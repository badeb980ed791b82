"""
Attention in PyTorch's own kernels, for q (B, Hq, T, D) and k/v (B, Hkv, S, D): causal, each query seeing at
most `window` keys (itself included); S > T when decoding with a KV cache (the queries sit at S-T .. S-1).
- reference_attention: SDPA as PyTorch dispatches it, is_causal or a boolean window mask (any device, length, cache)
- cudnn_attention: the full context on CUDA, SDPA pinned to cuDNN first (faster than its flash backend on Hopper)
- flex_attention: a sliding window on CUDA at the training length, with a block mask that skips the masked blocks
- block_attention(_backward): one block of context parallelism's ring (queries and keys `offset` apart) with its
  log-sum-exp, and its backward from the merged output and log-sum-exp (the section below says which blocks)
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend


def band_mask(T, S, offset, window, device):
    """Boolean (T, S): 0 <= query - key position < window, for T queries from position `offset` and S keys from 0."""
    distance = offset + torch.arange(T, device=device)[:, None] - torch.arange(S, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def expand_heads(q, k, v):
    """k/v with as many heads as q (GQA), as cuDNN and the reference blocks want."""
    g = q.size(1) // k.size(1)
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def sum_heads(kv_heads, dq, dk, dv):
    """(dq, dk, dv), dk/dv of expanded heads summed back over the query heads that shared a kv head."""
    if kv_heads != dk.size(1):
        dk, dv = (t.unflatten(1, (kv_heads, -1)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def reference_attention(q, k, v, window):
    T, S = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if window >= S and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(T, S, S - T, window, q.device), enable_gqa=gqa)


def cudnn_attention(q, k, v):
    k, v = expand_heads(q, k, v)  # cuDNN/flash in SDPA want equal head counts
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


_flex = None  # FlexAttention compiled, by prepare_flex


def prepare_flex():
    """FlexAttention runs fast only compiled (then also in an eager model). Compiled here, before any trace
    (kernels.prepare_attention): a cached builder called from a traced model makes Dynamo warn at every start."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention as flex
        _flex = torch.compile(flex, dynamic=False)


def flex_attention(q, k, v, mask):
    return _flex(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))


# --- one block of the ring (context_parallel.py): q (B, H, T, D), k/v (B, H, S, D) with equal head counts ----------
# cuDNN through PyTorch returns the log-sum-exp and takes it back in the backward, for a block's three masks when the
# window is whole chunks (the recipe's quarter context is N/2 chunks at CP N): the causal triangle, none, and the
# strict upper triangle (query i sees key j iff j > i: keys one window back), the reversed causal triangle less a row
# and a column. Other bands take the reference math (FlashAttention-4 takes any band, where installed): PyTorch's
# memory-efficient kernel takes a bias mask but gave NaNs and wrong gradients on rows that see no key.


def block_kind(T, S, offset, window):
    """A block's mask: "causal" (the diagonal, full window), "none" (all keys), "upper" (keys j > query i) or "band"."""
    if offset == 0 and T == S and window >= T:
        return "causal"
    if offset >= S - 1 and offset + T - 1 < window:
        return "none"
    if offset == window and T == S and offset >= S:
        return "upper"
    return "band"


def _forward(q, k, v, causal):
    # contiguous: PyTorch's cuDNN attention (2.11) keys its plans on less than every stride, and one made for a layout
    # gave wrong results on another of the same shape (seen running the CP block tests in a row; dout alone: not enough)
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse.reshape(q.size(0), q.size(1), q.size(2))  # cuDNN's is (B, H, T, 1)


def _backward(dout, q, k, v, out, lse, causal):
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))  # as in _forward
    no_rng, T, S = torch.empty((), dtype=torch.long, device=q.device), q.size(2), k.size(2)
    # None below: no bias, no cumulative sequence lengths (not the variable-length kernels)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), no_rng, no_rng, None, None, None, T, S, 0.0, causal)


def _upper(t):
    """An upper triangle block's queries (all but the last) or keys (all but the first) reversed: the causal one."""
    return t.flip(2)


def block_attention(q, k, v, offset, window):
    """(out, lse): the block's attention and each query's log-sum-exp of scaled scores, (B, H, T) fp32; -inf and
    zeros on a query that sees none of the keys. Not for "band" blocks."""
    kind = block_kind(q.size(2), k.size(2), offset, window)
    if kind != "upper":
        return _forward(q, k, v, kind == "causal")
    out, lse = _forward(_upper(q[:, :, :-1]), _upper(k[:, :, 1:]), _upper(v[:, :, 1:]), True)
    out = torch.cat([out.flip(2), torch.zeros_like(out[:, :, :1])], dim=2)  # the last query sees no key
    return out, torch.cat([lse.flip(2), torch.full_like(lse[:, :, :1], float("-inf"))], dim=2)


def block_attention_backward(dout, q, k, v, out, lse, offset, window):
    """(dq, dk, dv) of one block from the merged output and log-sum-exp over all blocks: the kernel's softmax is
    then the whole row's, so the block's share of each gradient comes out directly."""
    kind = block_kind(q.size(2), k.size(2), offset, window)
    if kind != "upper":
        return _backward(dout, q, k, v, out, lse, kind == "causal")
    dq, dk, dv = _backward(*(_upper(t[:, :, :-1]) for t in (dout, q)), _upper(k[:, :, 1:]), _upper(v[:, :, 1:]),
                           _upper(out[:, :, :-1]), lse[:, :, :-1].flip(2), True)
    zero = torch.zeros_like(dq[:, :, :1])
    return torch.cat([dq.flip(2), zero], dim=2), torch.cat([zero, dk.flip(2)], dim=2), torch.cat([zero, dv.flip(2)], dim=2)
