"""
fp8 training linears: torchao's float8 training with tensorwise dynamic scaling, and an MLP of our own that
follows the same recipe with ReLU^2 fused into its products. (torchao's rowwise recipe measured 0.94x of bf16
at d20 and was dropped on 2026-11-23: dev/LOG.md.)

- Only Linear layers whose dims are multiples of 16 and at least 128 are converted (the fp8 matmul's
  shape rules; small layers gain nothing), and never the lm_head: the logits keep bf16 precision.
- The weights stay the same fp32 Parameters, cast to fp8 (as are the activations and the output
  gradients) around each matmul. So a checkpoint has the same keys with or without fp8, and one saved
  with fp8 loads without it and vice versa.
- Evaluation and sampling run in bf16: `bf16_linears(model)` swaps the fp8 modules for plain ones holding
  the very same weight Parameters, and restores them afterwards.
- The recipe is torchao's tensorwise one with fast accumulation in all three matmuls (torchao: the
  forward's only).
- Without CUDA (or an SM89+ GPU), or without torchao, --fp8 says so and training continues without it.
It pays off only under torch.compile, which fuses the casts and amax reductions.

The MLP with tensorwise scaling is Fp8MLP, not torchao's: c_proj(relu(c_fc(x))^2) as one autograd
Function. With torchao's Float8Linear for c_fc and c_proj, ReLU^2 stays between them as separate passes over
the (tokens, 4C) activation: c_fc writes h, an amax pass and a cast pass read it; in the backward, c_proj's
product writes its input gradient, and passes for ReLU^2's gradient, its amax and its cast read it again.
Fp8MLP puts ReLU^2 inside the products, as relu_square_mm.FusedMLP does in bf16 (kernels/relu_square_mm.py, whose
kernel also returns the amax of what it writes):

    forward:   x, W_fc, W_proj -> e4m3
               y = relu(x W_fc^T)^2                fused, with amax(y)
               out = (y -> e4m3) W_proj^T          _scaled_mm
    backward:  dout -> e5m2
               dh = (dout W_proj) * 2 sqrt(y)      fused, with amax(dh); relu(h) = sqrt(y)
               dx = (dh -> e5m2) W_fc              _scaled_mm, as are the two weight gradients

It keeps x in e4m3 and y in bf16 for the backward. The casts are torchao's: scale = fp8 max / amax, in
fp32, saturated. Each matmul gives both operands K-major (Hopper's fp8 rule), so the backward makes
transposed fp8 copies of dh, dout, x and y. Off CUDA (tests), and with the kernels switched off (--kernels
reference), the two fused products run in PyTorch; tests check the kernels against them through Triton's
interpreter, and the module against torchao's.
"""

import dataclasses
import importlib.util
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanochat.kernels import Linear, fused, relu_square_mm
from nanochat.gpt import MLP

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # activations and weights; gradients


def is_eligible(module, fqn):
    """The filter: a bias-free Linear with both dims multiples of 16 and >= 128, not the lm_head."""
    if not isinstance(module, torch.nn.Linear) or fqn.endswith("lm_head"):
        return False
    n_in, n_out = module.in_features, module.out_features
    return n_in % 16 == 0 and n_out % 16 == 0 and min(n_in, n_out) >= 128


def fp8_unavailable_reason(device):
    if device.type != "cuda":
        return f"fp8 needs a CUDA GPU (device is {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"fp8 matmuls need compute capability 8.9+ ({torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)})"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    return None


def convert_to_fp8(model, device=None, force=False):
    """Convert eligible Linears in place. Returns the number converted (0 when fp8 is unavailable;
    `force` skips the device check, for tests on CPU)."""
    reason = None if force else fp8_unavailable_reason(device)
    if reason:
        print(f"WARNING: --fp8 requested but {reason}; continuing without fp8", flush=True)
        return 0
    from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    # torchao gives cuBLAS's fast fp8 accumulation (no periodic promotion to fp32) to the forward matmul
    # only; the two backward ones get it too: +2.4-2.9% tok/s at d20, and the equal-steps d12 loss stays
    # within the bf16 runs' spread (dev/LOG.md)
    fast = Float8GemmConfig(use_fast_accum=True)
    config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    mlps = len(_swap(model, lambda m: _rehouse(m, Fp8MLP) if type(m) is MLP and _mlp_is_eligible(m) else None))
    ours = {f"{name}.{linear}" for name, m in model.named_modules() if isinstance(m, Fp8MLP) for linear in ("c_fc", "c_proj")}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: is_eligible(m, fqn) and fqn not in ours)
    converted = sum(1 for m in model.modules() if _is_fp8(m))
    print(f"fp8 (tensorwise): converted {converted + 2 * mlps} Linear layers"
          + (f", {2 * mlps} of them in {mlps} MLPs with ReLU^2 fused into their fp8 products" if mlps else ""), flush=True)
    return converted + 2 * mlps


def _mlp_is_eligible(mlp):
    return is_eligible(mlp.c_fc, "c_fc") and is_eligible(mlp.c_proj, "c_proj")


def _rehouse(module, cls):
    """A cls instance holding module's children (the same objects: nothing is copied)."""
    new = cls.__new__(cls)
    torch.nn.Module.__init__(new)
    for name, child in module.named_children():
        setattr(new, name, child)
    return new


def _is_fp8(module):
    return type(module).__name__ == "Float8Linear"


def _swap(model, make):
    """Replace modules by make(module) where it returns one; returns the (parent, name, old) list."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                swapped.append((parent, name, child))
    return swapped


def _as_bf16(module):
    if isinstance(module, Fp8MLP):
        return _rehouse(module, MLP)
    if not _is_fp8(module):
        return None
    lin = Linear.__new__(Linear)
    torch.nn.Module.__init__(lin)
    lin.in_features, lin.out_features = module.in_features, module.out_features
    lin.weight = module.weight  # the same Parameter: nothing is copied
    lin.bias = None
    return lin


@contextmanager
def bf16_linears(model):
    """Run the block in bf16: fp8 Linears are temporarily replaced by plain Linears on the same weights,
    and each Fp8MLP by a plain MLP holding the same Linears."""
    swapped = _swap(model, _as_bf16)
    try:
        yield model
    finally:
        for parent, name, old in swapped:
            setattr(parent, name, old)


# ---- the tensorwise MLP (see the module docstring) ----

def to_fp8(t, dtype, amax=None):
    """torchao's tensorwise cast: t * scale saturated to dtype, scale = dtype's max / amax(t) in fp32.
    Returns the fp8 data and 1 / scale, which undoes it in a product."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    scale = amax_to_scale(t.abs().max() if amax is None else amax, dtype)
    return to_fp8_saturated(t.float() * scale, dtype), scale.reciprocal()


def scaled_mm(a, b, a_inv, b_inv, out_dtype):
    """a @ b^T for fp8 a (M, K) and b (N, K), both K-major, times a_inv * b_inv; fast accumulation."""
    return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=True)


def fc_relu_square(x8, w_fc8, scale, out_dtype, kernels):
    """relu(x8 @ w_fc8^T * scale)^2 in out_dtype and its amax: the Triton kernel, or PyTorch (`kernels` False)."""
    if kernels:
        return relu_square_mm.fc_relu_square_fp8(x8, w_fc8, scale, out_dtype)
    y = F.relu(x8.float() @ w_fc8.float().t() * scale).square().to(out_dtype)
    return y, y.abs().max().float()


def relu_square_input_grad(dy8, w_proj8_t, y, scale, kernels):
    """(dy8 @ w_proj8_t^T * scale) * 2 sqrt(y) in y's dtype and its amax: the Triton kernel, or PyTorch."""
    if kernels:
        return relu_square_mm.relu_square_input_grad_fp8(dy8, w_proj8_t, y, scale)
    grad_h = (dy8.float() @ w_proj8_t.float().t() * scale * 2 * y.float().sqrt()).to(y.dtype)
    return grad_h, grad_h.abs().max().float()


class _Fp8MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_fc, w_proj, kernels):
        x8, x_inv = to_fp8(x, E4M3)
        w_fc8, w_fc_inv = to_fp8(w_fc, E4M3)
        y, y_amax = fc_relu_square(x8, w_fc8, x_inv * w_fc_inv, x.dtype, kernels)
        y8, y_inv = to_fp8(y, E4M3, y_amax)
        w_proj8, w_proj_inv = to_fp8(w_proj, E4M3)
        ctx.save_for_backward(x8, x_inv, w_fc8, w_fc_inv, w_proj8, w_proj_inv, y, y_amax)
        ctx.kernels, ctx.w_dtype = kernels, w_fc.dtype
        return scaled_mm(y8, w_proj8, y_inv, w_proj_inv, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_inv, w_fc8, w_fc_inv, w_proj8, w_proj_inv, y, y_amax = ctx.saved_tensors
        dout8, dout_inv = to_fp8(grad_out, E5M2)
        grad_h, grad_h_amax = relu_square_input_grad(dout8, w_proj8.t().contiguous(), y, dout_inv * w_proj_inv, ctx.kernels)
        dh8, dh_inv = to_fp8(grad_h, E5M2, grad_h_amax)
        grad_x = scaled_mm(dh8, w_fc8.t().contiguous(), dh_inv, w_fc_inv, grad_out.dtype)
        grad_w_fc = scaled_mm(dh8.t().contiguous(), x8.t().contiguous(), dh_inv, x_inv, ctx.w_dtype)
        y8, y_inv = to_fp8(y, E4M3, y_amax)  # c_proj's input again, cast as in the forward
        grad_w_proj = scaled_mm(dout8.t().contiguous(), y8.t().contiguous(), dout_inv, y_inv, ctx.w_dtype)
        return grad_x, grad_w_fc, grad_w_proj, None


class Fp8MLP(MLP):
    """The MLP in tensorwise fp8 with ReLU^2 fused into its products (_Fp8MLP), on the MLP's own c_fc and
    c_proj Linears (made by _rehouse: the same weights and checkpoint keys; tp_enter rides along for the way
    back). The Triton kernels run on CUDA for 16-bit activations; elsewhere, and in reference mode
    (nanochat.kernels' switch), the PyTorch products do.
    The weight gradients are products over the tokens, and fp8 products need every dim a multiple of 16:
    other token counts (never training's, B x 2048) take the bf16 path."""

    def forward(self, x):
        rows = x.reshape(-1, x.size(-1))
        if rows.size(0) % 16:
            return super().forward(x)
        use_kernels = fused() and relu_square_mm.supported(x)
        return _Fp8MLP.apply(rows, self.c_fc.weight, self.c_proj.weight, use_kernels).view_as(x)
