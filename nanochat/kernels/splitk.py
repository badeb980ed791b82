"""
Split-K weight gradients: dW = dy^T x over N tokens as `split` products over slices of the tokens (one bmm),
summed. It pays for weights with too few output tiles to fill the GPU's SMs in whole waves; whether it does is
timed per weight shape at start (tune, CUDA only). The reference is split = 1, autograd's own product.
"""

import torch
import torch.nn.functional as F

from nanochat.common import cuda_time_ms


def split_for(x, split):
    """The split for x's rows (..., in): `split` if they divide evenly, else 1."""
    return 1 if x.numel() // x.size(-1) % split else split


def weight_grad(dy, x, split):
    """dy^T @ x for dy (..., out), x (..., in) over their N leading rows: `split` products over row slices, summed."""
    dy, x = dy.reshape(-1, dy.size(-1)), x.reshape(-1, x.size(-1))
    if split == 1:
        return dy.t() @ x
    n = dy.size(0) // split
    return torch.bmm(dy.view(split, n, -1).transpose(1, 2), x.view(split, n, -1)).sum(0)


class SplitWeightGradLinear(torch.autograd.Function):
    """F.linear(x, w) whose backward computes the weight gradient with weight_grad(..., split)."""

    @staticmethod
    def forward(ctx, x, w, split):
        ctx.save_for_backward(x, w)
        ctx.split = split
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        grad_x = dy @ w if ctx.needs_input_grad[0] else None
        return grad_x, weight_grad(dy, x, ctx.split), None


@torch.no_grad()
def tune(linears, tokens, dtype, splits=(1, 2, 4), repeats=10, margin=0.03):
    """Per weight shape: the weight gradient of `tokens` rows in `dtype` timed at each split (median of `repeats`); a
    split wins only if it beats the plain product by `margin`. {(out, in): (split, ms plain, ms split)}, {} off CUDA."""
    if not linears or linears[0].weight.device.type != "cuda":
        return {}
    chosen = {}
    for shape in sorted({tuple(m.weight.shape) for m in linears}):
        times = _time_splits(tokens, *shape, dtype, [s for s in splits if tokens % s == 0], repeats)
        best = min(times, key=times.get)
        best = best if times[best] < times[1] * (1 - margin) else 1
        chosen[shape] = (best, times[1], times[best])
    return chosen


def _time_splits(tokens, out_features, in_features, dtype, splits, repeats):
    """{split: ms} of one weight gradient; its inputs are freed on return, before the next shape's."""
    dy = torch.randn(tokens, out_features, device="cuda", dtype=dtype)
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    return {s: cuda_time_ms(lambda: weight_grad(dy, x, s), repeats) for s in splits}
