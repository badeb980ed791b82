"""
The fast kernels behind one facade, and the one switch that turns them all off. gpt.py (and fp8.py for its MLP)
write every op as its reference PyTorch math and ask here first, as nanoGPT asks `self.flash`.

    op                 the reference math                        the kernel (mode "auto", where it applies)
    Linear             F.linear (Linear below)                   split-K weight gradient, per tuned shape (splitk.py)
    attention          SDPA: is_causal for the full context,     FlashAttention-4 (flash_attention.py); else
                       a dense boolean mask for a window (sdpa)  cuDNN (full) and FlexAttention (window) (sdpa.py)
    ring block + LSE   context_parallel.block_attention          FlashAttention-4, any band; else cuDNN where the
                                                                 mask is causal, none or upper (sdpa.py)
    rotary + QK-norm   gpt.rotary_norm                           Triton forward and backward (rotary.py)
    MLP                gpt.MLP: c_proj(relu(c_fc(x))^2)          ReLU^2 inside both matmuls (relu_square_mm.py);
                                                                 elsewhere ReLU^2 keeping only its output
    fp8 MLP            fp8.fc_relu_square, relu_square_input_grad  the same kernels on fp8 operands
    soft-capped loss   gpt.SoftcapCrossEntropy                   lm_head matmul + Triton loss (softcap_ce.py)
    MoE experts        moe.looped_experts: expert by expert       moe.grouped_experts (torch._grouped_mm), bf16, SM90+
    L3 lookup          l3: padded (CPU) and blocked (bmm) paths   three Triton kernels reading rows in place (l3_lookup.py)

KERNELS.mode: "auto" (default) or "reference" (every answer no), from NANOCHAT_KERNELS or --kernels (which wins);
read at each call: set it before building and compiling. The reference attention is SDPA as PyTorch dispatches it
(a hand-written softmax's (T, T) scores would not fit).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import ConfigError
from nanochat.kernels import flash_attention, relu_square_mm, rotary, sdpa, softcap_ce, splitk

MODES = ("auto", "reference")


class Kernels:
    """The switch, and what the fast paths settle before torch.compile traces (deciding in a trace is slow and
    fragile): where FlashAttention-4 runs, FlexAttention's block masks at the training length."""

    def __init__(self):
        self.mode = "auto"
        self.fa4_devices = {}  # device -> whether FlashAttention-4 runs there
        self.block_masks = {}  # (T, window, device) -> BlockMask

    @property
    def on(self):
        return self.mode == "auto"


KERNELS = Kernels()


def set_mode(name, source="--kernels "):
    """--kernels (NANOCHAT_KERNELS at import): "auto" or "reference"; None keeps the mode."""
    if name is not None:
        if name not in MODES:
            raise ConfigError(f"{source}{name!r}: use one of {', '.join(MODES)}")
        KERNELS.mode = name
    return KERNELS.mode


try:
    set_mode(os.environ.get("NANOCHAT_KERNELS", "auto"), "NANOCHAT_KERNELS=")
except ConfigError as e:  # at import, before any script's handler: one line, not a traceback
    raise SystemExit(f"ERROR: {e}") from None


# ---- Linear (split-K weight gradient) ----

class Linear(nn.Linear):
    """Bias-free; the fp32 weight is cast to the activations' dtype. wgrad_split > 1: split-K weight gradient."""

    wgrad_split = 1

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        w = self.weight.to(x.dtype)
        split = splitk.split_for(x, self.wgrad_split)
        if not KERNELS.on or split == 1 or not torch.is_grad_enabled():
            return F.linear(x, w)
        return splitk.SplitWeightGradLinear.apply(x, w, split)


def tunable_linears(model):  # not the lm_head: the loss computes its weight gradient itself (head_loss)
    return [m for m in model.modules() if type(m) is Linear and min(m.weight.shape) >= 128
            and m is not getattr(model, "lm_head", None)]


def tune_wgrad_splits(model, tokens, dtype):
    """splitk.tune over the model's tunable Linears, for set_wgrad_splits; {} off CUDA and in reference mode."""
    return splitk.tune(tunable_linears(model), tokens, dtype) if KERNELS.on else {}


def set_wgrad_splits(model, chosen):
    for m in tunable_linears(model):
        m.wgrad_split = chosen.get(tuple(m.weight.shape), (1,))[0]


# ---- attention ----

def fa4_runs(device, dtype, head_dim):
    """Whether FlashAttention-4 runs here (flash_attention.device_supported, asked once per device)."""
    device = torch.device(device)
    if device not in KERNELS.fa4_devices:
        KERNELS.fa4_devices[device] = flash_attention.device_supported(device)
    return KERNELS.fa4_devices[device] and flash_attention.inputs_supported(dtype, head_dim)


def prepare_attention(config, window_sizes, device, dtype):
    """Settle which kernel trains here (FlexAttention: build its block masks at the training length); its name."""
    device = torch.device(device)
    if not KERNELS.on:
        return "SDPA (reference)"
    if device.type != "cuda":
        return "SDPA"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if fa4_runs(device, dtype, config.head_dim):
        return "FlashAttention-4"
    T = config.sequence_len
    for window in set(window_sizes):
        if window < T and (T, window, str(device)) not in KERNELS.block_masks:
            KERNELS.block_masks[T, window, str(device)] = sdpa.block_mask(T, window, device)
            sdpa.prepare_flex()
    return "SDPA (cuDNN)" + (" + FlexAttention for the sliding windows" if min(window_sizes) < T else "")


def fa4_takes_blocks(device, dtype, head_dim):
    """Whether CP blocks go to FlashAttention-4 by default here: any band of keys in one call (cuDNN takes the causal,
    unmasked and upper-triangle blocks of whole chunks, on contiguous copies)."""
    return KERNELS.on and fa4_runs(device, dtype, head_dim)


def attention_block_name(device, dtype, head_dim):
    """What computes a ring block's attention here, for the log."""
    on = KERNELS.on and torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if on and fa4_takes_blocks(device, dtype, head_dim):
        return "FlashAttention-4, each band in one call"
    return "cuDNN; bands that are not whole chunks in the reference math" if on else "the reference math"


def block_bands(q, backend=None):
    """Whether FlashAttention-4 takes a CP block of q's (B, Hq, T, D) view as it is: asked for (backend "fa4"), or by
    default (None) where fa4_takes_blocks."""
    return backend == "fa4" or backend is None and fa4_takes_blocks(q.device, q.dtype, q.size(-1))


def takes_attention_block(q, k, offset, window, backend=None):
    """Whether a kernel takes a CP block (context_parallel.py): FlashAttention-4 any (where it runs, or asked for by
    `backend`), cuDNN (CUDA, 16-bit) all but a "band" (sdpa.block_kind)."""
    if block_bands(q, backend):
        return True
    return (KERNELS.on and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and sdpa.block_kind(q.size(2), k.size(2), offset, window) != "band")


def attention_block(q, k, v, offset, window, backend=None):
    """(out, lse) of a CP block. backend None: FlashAttention-4 where it runs, else cuDNN; or "fa4" / "cudnn"."""
    if block_bands(q, backend):
        left, right = flash_attention.block_window(offset, window, q.size(2), k.size(2))
        out, lse = flash_attention.block_forward(*(t.transpose(1, 2) for t in (q, k, v)), left, right)
        return out.transpose(1, 2), lse
    return sdpa.block_attention(q, *sdpa.expand_heads(q, k, v), offset, window)


def attention_block_backward(dout, q, k, v, out, lse, offset, window, backend=None):
    """(dq, dk, dv); dk/dv summed back over the query heads that shared a kv head."""
    if block_bands(q, backend):
        left, right = flash_attention.block_window(offset, window, q.size(2), k.size(2))
        grads = flash_attention.block_backward(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, left, right)
        return tuple(g.transpose(1, 2) for g in grads)
    return sdpa.sum_heads(k.size(1), *sdpa.block_attention_backward(dout, q, *sdpa.expand_heads(q, k, v), out, lse,
                                                                    offset, window))


# what --recompute selective keeps rather than reruns (gpt.Block): the outputs that cost most to recompute per byte,
# attention's (every path but FlexAttention, a higher-order op) and the fused ReLU^2 product's (bf16 or fp8); the
# unfused MLP (TP, reference mode, CPU) has no one op to keep
SELECTIVE_KEEPS = (
    torch.ops.nanochat.flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.nanochat.fc_relu_square.default,
    torch.ops.nanochat.fc_relu_square_fp8.default,
)


def takes_fa4(q):
    return q.is_cuda and fa4_runs(q.device, q.dtype, q.size(-1))


def takes_cudnn(q, window):  # cuDNN through SDPA: the full context on CUDA
    return q.is_cuda and window >= q.size(2)


def flex_block_mask(q, window):
    """FlexAttention's block mask for this window at q's length where prepare_attention built one (CUDA, training
    length), else None: other lengths (CORE's) take the reference rather than recompile."""
    return KERNELS.block_masks.get((q.size(2), window, str(q.device)))


def attention(q, k, v, window):
    """Causal windowed attention (shapes and window: sdpa.py); decoding with a KV cache (S > T) takes the reference."""
    if KERNELS.on and q.size(2) == k.size(2):
        if takes_fa4(q):  # FA4 takes the (B, T, H, D) layout: the transposes are views
            out, _ = flash_attention.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window)
            return out.transpose(1, 2)
        if takes_cudnn(q, window):
            return sdpa.cudnn_attention(q, k, v)
        if (mask := flex_block_mask(q, window)) is not None:
            return sdpa.flex_attention(q, k, v, mask)
    return sdpa.reference_attention(q, k, v, window)


# ---- the MLP, rotary + QK-norm, the head's loss: a question, then the kernel ----

def takes(kernel, x):
    """Whether a kernel module (relu_square_mm: the fp8 MLP too; rotary; softcap_ce: the head's loss) takes x."""
    return KERNELS.on and kernel.supported(x)


def takes_fused_mlp(x, c_fc, c_proj):
    """The plain Linears only: tensor parallelism's take the module path; fp8 replaces the whole MLP (Fp8MLP)."""
    return type(c_fc) is Linear and type(c_proj) is Linear and takes(relu_square_mm, x)


def fused_mlp(x, c_fc, c_proj):
    rows = x.reshape(-1, x.size(-1))
    out = relu_square_mm.FusedMLP.apply(rows, c_fc.weight.to(x.dtype), c_proj.weight.to(x.dtype),
                                        splitk.split_for(rows, c_fc.wgrad_split), splitk.split_for(rows, c_proj.wgrad_split))
    return out.view_as(x)


def relu_square(h):
    return relu_square_mm.ReluSquare.apply(h)


fc_relu_square_fp8 = relu_square_mm.fc_relu_square_fp8
relu_square_input_grad_fp8 = relu_square_mm.relu_square_input_grad_fp8


def rotary_norm(x, cos, sin, scale):
    return rotary.rotary_norm_op(x, cos, sin, scale)


def takes_grouped_mm(x):
    """MoE's experts as two grouped matmuls (moe.grouped_experts): bf16 on Hopper (SM90), where torch.compile takes
    them; not yet on Blackwell (SM100: reported non-zero weight gradients for experts given no rows, pytorch#172439)."""
    return (KERNELS.on and x.is_cuda and x.dtype == torch.bfloat16
            and (9, 0) <= torch.cuda.get_device_capability(x.device) < (10, 0))


def head_losses(x, weight, targets, cap):
    return softcap_ce.kernel_head_losses(x, weight, targets, cap)
