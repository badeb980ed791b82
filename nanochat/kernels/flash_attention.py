"""
FlashAttention-4 for training on Hopper and Blackwell: the optional `flash-attn-4` package's kernels (CuTe DSL,
compiled on first use) as one custom op, one node in torch.compile's graph. Sliding windows run natively (tiles
outside the band skipped), in the projections' (B, T, H, D) layout. CUDA only (tests register the math on CPU).

    out, lse = flash_attention(q, k, v, window)     q: (B, T, Hq, D), k/v: (B, T, Hkv, D), bf16
    out: causal attention, each query seeing at most `window` keys (itself included); lse (B, Hq, T), fp32: each
    query's log-sum-exp of scaled scores, for the backward.
    block_forward / block_backward: a context-parallel block (context_parallel.py, through the kernels facade), any
    band of keys in one call, its window as FA's left/right bounds (block_window); uncompiled, outside any graph.
"""

import functools
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
    """Whether FlashAttention-4 runs on this device: the package imports and the GPU is sm90 (Hopper) or sm100."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (9, 10) and _fa4() is not None


def inputs_supported(dtype, head_dim):
    """bf16 or fp16 inputs, a head dim both archs compile (8-128, by 8)."""
    return dtype in (torch.bfloat16, torch.float16) and 8 <= head_dim <= 128 and head_dim % 8 == 0


def _left(window, T):
    """FA4's window_size_left: keys at most `window - 1` positions back, or None for the full causal context."""
    return window - 1 if window < T else None


def block_window(offset, window, T, S):
    """FA4's (window_size_left, window_size_right) for T queries over S keys whose first query sits `offset` tokens
    after the first key, each query seeing the keys 0 .. window-1 back: FA aligns query i with key i + S - T, so the
    band is [i + offset - window + 1, i + offset] around it; None where a side does not bind within the keys."""
    right = offset - (S - T)
    left = window - 1 - right
    return (None if offset + T - window <= 0 else left), (None if offset >= S - 1 else right)


def block_forward(q, k, v, left, right):
    """(out, lse) of q (B, T, Hq, D) over k/v (B, S, Hkv, D) (views whose last dim is contiguous) in a band."""
    return _fa4()._flash_attn_fwd(q, k, v, window_size_left=left, window_size_right=right, return_lse=True)[:2]


def block_backward(dout, q, k, v, out, lse, left, right):
    return _fa4()._flash_attn_bwd(q, k, v, out, dout, lse, window_size_left=left, window_size_right=right)


@torch.library.custom_op("nanochat::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    # [:2]: (out, lse) first (later flash-attn-4 versions return two more after them)
    return _fa4()._flash_attn_fwd(q, k, v, causal=True, window_size_left=_left(window, q.size(1)), return_lse=True)[:2]


@torch.library.custom_op("nanochat::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fa4()._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=_left(window, q.size(1)))


# the outputs' shapes, for torch.compile's tracing: the kernels return fresh contiguous tensors, lse (B, Hq, T)
flash_attention.register_fake(
    lambda q, k, v, window: (q.new_empty(q.shape), q.new_empty(q.size(0), q.size(2), q.size(1), dtype=torch.float32)))
flash_attention_backward.register_fake(
    lambda dout, q, k, v, out, lse, window: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)  # q, k, v, out, lse
    ctx.window = inputs[3]


def _backward(ctx, dout, dlse):
    # lse is an output only for the backward's sake: nothing downstream differentiates it (dlse is None)
    dq, dk, dv = flash_attention_backward(dout.contiguous(), *ctx.saved_tensors, ctx.window)
    return dq, dk, dv, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)
