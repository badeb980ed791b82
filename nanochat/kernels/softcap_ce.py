"""
The training loss on CUDA as one function: the lm_head matmul, then the soft-capped cross-entropy in one Triton kernel
(gpt.SoftcapCrossEntropy is the math).

    raw = x @ W^T                      z = cap * tanh(raw / cap)          loss_i = logsumexp(z_i) - z_i[t_i]
    d loss_i / d raw_ij = (softmax(z_i)_j - [j == t_i]) * (1 - (z_ij / cap)^2)

One program per row of the (N, V) logits: one read for the logsumexp (|z| <= cap: exp(z - cap) cannot overflow, so
no running maximum) and the loss; when a gradient is wanted, a second read overwrites the row with d loss_i / d raw_i.
The backward only scales the two small products: no fp32 copy of the logits is stored (dev/LOG.md, 2026-11-21).
"""

import torch

from nanochat.common import eager

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path below is used
    triton = None

if triton is not None:
    # With y = raw / CAP, u = exp(2y) and r = 1 / (u + 1):
    #   tanh(y) = 1 - 2r,   z - CAP = -2 CAP r,   1 - tanh(y)^2 = 4 r (1 - r)
    # so each logit costs two exponentials and one reciprocal (base 2: exp(a) = exp2(a log2(e))); the kernel is
    # bound by these instructions, not by HBM
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _r(raw, CAP: tl.constexpr):
        return 1.0 / (tl.math.exp2(raw.to(tl.float32) * (2.0 * LOG2E / CAP)) + 1.0)

    @triton.jit
    def _loss_kernel(raw_ptr, targets_ptr, loss_ptr, V, row_stride,
                     CAP: tl.constexpr, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = raw_ptr + row * row_stride
        full = V // BLOCK * BLOCK  # whole blocks need no mask; a ragged end gets one masked block
        acc = tl.zeros([BLOCK], dtype=tl.float32)  # sum of exp(z - CAP) <= V: no overflow, no running max
        for start in range(0, full, BLOCK):
            acc += tl.math.exp2(_r(tl.load(row_ptr + start + tl.arange(0, BLOCK)), CAP) * (-2.0 * CAP * LOG2E))
        if full < V:
            cols = full + tl.arange(0, BLOCK)
            r = _r(tl.load(row_ptr + cols, mask=cols < V, other=0.0), CAP)
            acc += tl.where(cols < V, tl.math.exp2(r * (-2.0 * CAP * LOG2E)), 0.0)
        lse = tl.log(tl.sum(acc, axis=0)) + CAP
        target = tl.load(targets_ptr + row)
        z_target = CAP * (1.0 - 2.0 * _r(tl.load(row_ptr + tl.maximum(target, 0)), CAP))
        tl.store(loss_ptr + row, tl.where(target >= 0, lse - z_target, 0.0))
        if WRITE_GRAD:
            # the row's gradient over the row itself (each block is read before this program writes it):
            # p = exp(z - lse) = exp2((CAP - lse) log2(e) - 2 CAP log2(e) r)
            base = (CAP - lse) * LOG2E
            keep = tl.where(target >= 0, 4.0, 0.0)  # the 4 of 4 r (1 - r); ignored rows get a zero gradient
            target = target.to(tl.int32)  # compared with int32 columns (an int64 compare costs per logit)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < V
                r = _r(tl.load(row_ptr + cols, mask=mask, other=0.0), CAP)
                p = tl.math.exp2(base + r * (-2.0 * CAP * LOG2E))
                d = (p - tl.where(tl.arange(0, BLOCK) == target - start, 1.0, 0.0)) * (r * (1.0 - r) * keep)
                tl.store(row_ptr + cols, d.to(raw_ptr.dtype.element_ty), mask=mask)


def _row_losses(raw, targets, write_grad, cap):
    """Per-row losses (N,) fp32 of (N, V) logits (last dim contiguous); write_grad: raw becomes d loss / d raw."""
    N, V = raw.shape
    loss = torch.empty(N, dtype=torch.float32, device=raw.device)
    block = min(triton.next_power_of_2(V), 4096)
    _loss_kernel[(N,)](raw, targets, loss, V, raw.stride(0), CAP=cap, BLOCK=block, WRITE_GRAD=write_grad,
                       num_warps=8 if block >= 2048 else 4)
    return loss


class _HeadLoss(torch.autograd.Function):
    """x (N, d), weight (V, d) in the compute dtype, targets (N,) int64 (-1: ignored, loss 0) -> fp32 losses (N,)."""

    @staticmethod
    def forward(ctx, x, weight, targets, cap):
        raw = x @ weight.t()
        loss = _row_losses(raw, targets, True, cap)
        ctx.save_for_backward(x, weight, raw)  # raw now holds the gradient of each row's loss
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, grad_raw = ctx.saved_tensors
        # almost always one scalar for every row: it scales the two small products, not the (N, V) gradient
        scale = grad_loss[:1].float() if grad_loss.stride(0) == 0 else None
        if scale is None:  # a weight per row (rare): one more pass over the gradient (not in place: kept for a 2nd)
            grad_raw = (grad_raw * grad_loss.unsqueeze(1)).to(grad_raw.dtype)
        grad_x = grad_raw @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_raw.t() @ x if ctx.needs_input_grad[1] else None
        for grad in (grad_x, grad_w):
            if grad is not None and scale is not None:
                grad.mul_(scale)
        return grad_x, grad_w, None, None


def supported(x):  # whether the kernel takes the activations x
    return triton is not None and x.is_cuda


@eager  # run eagerly: traced into a compiled graph, the in-place gradient would make
def kernel_head_losses(x, weight, targets, cap):  # AOTAutograd copy the logits first
    """Per-token losses (N,) of x (..., d) and weight (V, d) in the compute dtype, targets (...) (-1: ignored); on
    CUDA, and in tests on CPU tensors under TRITON_INTERPRET=1."""
    flat_x, flat_targets = x.reshape(-1, x.size(-1)), targets.reshape(-1).contiguous()
    # as F.cross_entropy refuses them (no host sync): another negative would be a loss of 0 that the mean still counts,
    # an id past the vocabulary a read of another row
    torch._assert_async(((flat_targets >= -1) & (flat_targets < weight.size(0))).all(), "targets: -1 or token ids")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _HeadLoss.apply(flat_x, weight, flat_targets, cap)
    return _row_losses(flat_x @ weight.t(), flat_targets, False, cap)  # evaluation: the loss only
