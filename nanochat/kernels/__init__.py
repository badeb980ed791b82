"""
The model's ops that have fast kernels, behind one facade, and the one switch that turns them off.

gpt.py calls one function per op; each picks its fastest path here, from the files beside this one, where
every kernel sits beside its reference:

    op             reference (the plain PyTorch math)                   kernels (mode "auto", where they apply)
    Linear         F.linear                                             split-K weight gradient (splitk.py), per
                                                                        weight shape where tune_wgrad_splits found it faster
    attention      F.scaled_dot_product_attention: is_causal for the    FlashAttention-4 (flash_attention.py); else
                   full context, a dense boolean mask for a window      cuDNN (full) and FlexAttention (window) (sdpa.py)
    mlp            c_proj(relu(c_fc(x))^2), autograd                    ReLU^2 inside the matmuls (relu_square_mm.py);
                                                                        else ReLU^2 keeping only its output
    rotary_norm    rms_norm(rotate(x)) * scale (rotary.py)              Triton forward and backward (rotary.py)
    head_loss      cross-entropy of 15 tanh(x W^T / 15), fp32           lm_head matmul + Triton loss (softcap_ce.py)

The switch: `mode`, "auto" (the default) or "reference", from NANOCHAT_KERNELS and the scripts' --kernels
flag (which wins). "reference" sends every op above to its reference math on every device, so an edit to the
math runs everywhere as written; fp8 (fp8.py) then runs its MLP's products in PyTorch as well. It is read at
each call: set it before building and compiling the model. The reference's attention is SDPA, i.e. whichever
backend PyTorch picks for it (flash or memory-efficient on a GPU, its C++ math on a CPU), not a hand-written
softmax: the (T, T) scores of every layer would not fit a training batch. On CPU, "auto" and "reference"
differ only in the MLP's backward (relu(h) rebuilt as sqrt(relu(h)^2), equal within rounding).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.kernels import flash_attention, relu_square_mm, rotary, sdpa, softcap_ce, splitk
# no kernels, but the model's too: the rotary tables, and the soft cap of the logits for sampling and evaluation
from nanochat.kernels.rotary import rotary_tables
from nanochat.kernels.softcap_ce import softcap

MODES = ("auto", "reference")
mode = os.environ.get("NANOCHAT_KERNELS", "auto")
if mode not in MODES:
    raise ValueError(f"NANOCHAT_KERNELS={mode!r}: use one of {', '.join(MODES)}")


def set_mode(name):
    """--kernels: "auto" or "reference"; None keeps NANOCHAT_KERNELS (default auto)."""
    global mode
    if name is not None:
        if name not in MODES:
            raise ValueError(f"--kernels {name!r}: use one of {', '.join(MODES)}")
        mode = name
    return mode


def fused():
    return mode == "auto"


# --- Linear (split-K weight gradient) ---------------------------------------------


class Linear(nn.Linear):
    """A bias-free linear whose fp32 weight is cast to the activations' dtype for the matmul. wgrad_split
    s > 1 (set by set_wgrad_splits) computes its weight gradient as s products over slices of the tokens."""

    wgrad_split = 1

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        w = self.weight.to(x.dtype)
        split = splitk.split_for(x, self.wgrad_split)
        if not fused() or split == 1 or not torch.is_grad_enabled():
            return F.linear(x, w)
        return splitk.SplitWeightGradLinear.apply(x, w, split)


def tunable_linears(model):
    # not the lm_head: the loss computes its weight gradient itself (head_loss)
    return [m for m in model.modules() if type(m) is Linear and min(m.weight.shape) >= 128
            and m is not getattr(model, "lm_head", None)]


def tune_wgrad_splits(model, tokens, dtype):
    """Per weight shape of the model's Linears (both dims >= 128), the split-K that makes its weight gradient
    fastest on this GPU: {(out, in): (split, ms plain, ms split)} for set_wgrad_splits; {} off CUDA and in
    reference mode."""
    return splitk.tune(tunable_linears(model), tokens, dtype) if fused() else {}


def set_wgrad_splits(model, chosen):
    for m in tunable_linears(model):
        m.wgrad_split = chosen.get(tuple(m.weight.shape), (1,))[0]


# --- attention --------------------------------------------------------------------


def prepare_attention(config, window_sizes, device, dtype):
    """Before torch.compile traces the model (deciding inside the trace is slow and fragile): settle which
    kernel trains here, and for FlexAttention build the block masks of this model's sliding windows at the
    training length. Returns the kernel's name, for the log."""
    device = torch.device(device)
    if not fused():
        return "SDPA (reference)"
    if device.type != "cuda":
        return "SDPA"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if flash_attention.supports(device, dtype, config.head_dim):
        return "FlashAttention-4"
    sdpa.build_block_masks(config.sequence_len, set(window_sizes), device)
    windowed = min(window_sizes) < config.sequence_len
    return "SDPA (cuDNN)" + (" + FlexAttention for the sliding windows" if windowed else "")


# what --recompute selective keeps rather than runs again in the backward (gpt.Block): the outputs of the ops
# that cost the most to recompute per byte kept, the attention kernel (on every path above) and the fused
# ReLU^2 product (relu_square_mm.py: the MLP's first matmul, in bf16 or fp8). The rest of the block (norms,
# q/k/v and output projections, rotary, the value-embedding gate) runs again. The unfused MLP (tensor
# parallelism, reference mode, CPU) has no one op to keep: there the MLP's first product runs again too.
# FlexAttention, a higher-order op, is not among them: with it the windowed layers' attention runs again.
SELECTIVE_KEEPS = (
    torch.ops.nanochat.flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.nanochat.fc_relu_square.default,
    torch.ops.nanochat.fc_relu_square_fp8.default,
)


def attention(q, k, v, window):
    """Causal attention, each query seeing at most `window` keys (itself included), q (B, Hq, T, D) and k/v
    (B, Hkv, S, D); S > T when decoding with a KV cache, which takes the reference."""
    if fused() and q.size(2) == k.size(2):
        if flash_attention.takes(q):  # FA4 takes the (B, T, H, D) layout: the transposes are views
            out, _ = flash_attention.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
            return out.transpose(1, 2)
        if sdpa.cudnn_takes(q, window):
            return sdpa.cudnn_attention(q, k, v)
        if sdpa.flex_takes(q, window):
            return sdpa.flex_attention(q, k, v, window)
    return sdpa.reference_attention(q, k, v, window)


# --- the MLP, rotary + QK-norm, the head's loss ------------------------------------------


def mlp(x, c_fc, c_proj):
    """c_proj(relu(c_fc(x))^2). The fused kernels take the plain Linears only: tensor parallelism swaps in its
    own, which take the module path (fp8 replaces the whole MLP: fp8.Fp8MLP)."""
    if not fused():
        return c_proj(relu_square_mm.reference_relu_square(c_fc(x)))
    if type(c_fc) is Linear and type(c_proj) is Linear and relu_square_mm.supported(x):
        rows = x.reshape(-1, x.size(-1))
        out = relu_square_mm.FusedMLP.apply(rows, c_fc.weight.to(x.dtype), c_proj.weight.to(x.dtype),
                                            splitk.split_for(rows, c_fc.wgrad_split),
                                            splitk.split_for(rows, c_proj.wgrad_split))
        return out.view_as(x)
    return c_proj(relu_square_mm.relu_square(c_fc(x)))


def rotary_norm(x, cos, sin, scale):
    """scale * rms_norm(rotate(x)) for x (B, T, H, D) and cos/sin (1, T, 1, D/2)."""
    if fused() and rotary.supported(x):
        return rotary.rotary_norm_op(x, cos, sin, scale)
    return rotary.reference_rotary_norm(x, cos, sin, scale)


def head_loss(x, weight, targets, reduction="mean"):
    """Cross-entropy (ignore_index=-1) of the soft-capped logits x @ weight^T, in fp32; reduction 'mean'
    (over the targets that count), 'sum' or 'none' (the targets' shape)."""
    if fused() and softcap_ce.supported(x):
        return softcap_ce.kernel_head_loss(x, weight, targets, reduction)
    return softcap_ce.reference_head_loss(x, weight, targets, reduction)
