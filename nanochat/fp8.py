"""
fp8 training linears, torchao's tensorwise recipe: one dynamic scale per tensor (fp8 max / amax in fp32, saturated;
e4m3 for activations and weights, e5m2 for gradients), on one device and under TP alike (rowwise was slower), with
cuBLAS's fast accumulation in all three products (torchao: the forward's only; all three was faster at equal loss,
dev/LOG.md 2026-11-21); tests check it against torchao's Float8Linear.

- Converted in place (make_fp8): Linears with dims multiples of 16 and at least 128 (fp8 matmul shape rules; small
  layers gain nothing), never the lm_head or an MoE router (logits keep bf16 precision). The fp32 Parameters are cast
  around each matmul: checkpoints are the same with or without fp8. Evaluation runs bf16 (bf16_linears).
- Without an SM89+ GPU or torchao, --fp8 says so and training goes on without it. It pays only compiled.
- _Fp8MLP fuses ReLU^2 into the products (relu_square_mm.py's kernels, else the math below): y = relu(x W_fc^T)^2
  and dh = (dout W_proj) * 2 sqrt(y), each with its amax for the next cast. Each matmul takes both operands K-major
  (Hopper's fp8 rule), so the backward makes transposed fp8 copies.
- Under TP each shard is cast with its own amax, with no collective: a shard's scale is at least as fine as the
  whole tensor's, so TP follows TP=1 within fp8's noise, on other roundings (tests/test_fp8_parallel.py). The
  whole tensor's amax (an all-reduce per cast, ~3,000 syncs of the ranks a d32 step) made TP 2 in fp8 slower than
  one GPU in fp8 (dev/LOG.md, 2026-11-27).
"""

import importlib.util
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanochat import kernels
from nanochat.kernels import Linear
from nanochat.gpt import MLP

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # activations and weights; gradients


def is_eligible(module, fqn):  # the filter of the module docstring
    if not isinstance(module, torch.nn.Linear) or fqn.endswith(("lm_head", "router")):
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
    """Convert eligible Linears in place, before TP (parallelize keeps the fp8 flag in each twin): MLPs to Fp8MLP, the
    rest to Fp8Linear. Returns how many Linears (0 without fp8; `force` skips the device check, for CPU)."""
    if not force and (reason := fp8_unavailable_reason(device)):
        print(f"WARNING: --fp8 requested but {reason}; continuing without fp8", flush=True)
        return 0
    mlps = [m for m in model.modules() if type(m) is MLP and is_eligible(m.c_fc, "c_fc") and is_eligible(m.c_proj, "c_proj")]
    in_mlps = {id(m.c_fc) for m in mlps} | {id(m.c_proj) for m in mlps}
    linears = [m for name, m in model.named_modules() if type(m) is Linear and id(m) not in in_mlps and is_eligible(m, name)]
    for m in mlps + linears:
        make_fp8(m)
    n = len(linears) + 2 * len(mlps)
    print(f"fp8 (tensorwise): converted {n} Linear layers" + (f", {2 * len(mlps)} of them in {len(mlps)} MLPs "
          "with ReLU^2 fused into their fp8 products" if mlps else ""), flush=True)
    return n


def make_fp8(module):
    module.__class__ = Fp8MLP if isinstance(module, MLP) else Fp8Linear
    module.fp8 = True
    return module


@contextmanager
def bf16_linears(model):
    on = [m for m in model.modules() if getattr(m, "fp8", False)]
    for m in on:
        m.fp8 = False
    try:
        yield model
    finally:
        for m in on:
            m.fp8 = True


# ---- casts and products ----

def to_fp8(t, dtype, amax=None):
    """torchao's tensorwise cast: t * scale saturated to dtype, scale = dtype's max / amax(t) in fp32. Returns the fp8
    data and 1 / scale, which undoes it in a product."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
    scale = amax_to_scale(t.abs().max() if amax is None else amax, dtype)
    return to_fp8_saturated(t.float() * scale, dtype), scale.reciprocal()


def scaled_mm(a, b, a_inv, b_inv, out_dtype):
    """a @ b^T for fp8 a (M, K) and b (N, K), both K-major, times a_inv * b_inv; fast accumulation."""
    return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=True)


# ---- the linear ----

class _Fp8Linear(torch.autograd.Function):
    """x (M, K) @ w (N, K)^T."""

    @staticmethod
    def forward(ctx, x, w):
        x8, x_inv = to_fp8(x, E4M3)
        w8, w_inv = to_fp8(w, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.w_dtype = w.dtype
        return scaled_mm(x8, w8, x_inv, w_inv, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        dout8, dout_inv = to_fp8(grad_out, E5M2)
        grad_x = scaled_mm(dout8, w8.t().contiguous(), dout_inv, w_inv, grad_out.dtype)
        grad_w = scaled_mm(dout8.t().contiguous(), x8.t().contiguous(), dout_inv, x_inv, ctx.w_dtype)
        return grad_x, grad_w


def fp8_linear(x, weight):
    """x @ weight^T in tensorwise fp8, for a whole weight or a TP shard. Token counts not a multiple of 16 (as fp8
    products need; training's B x 2048 always is) take F.linear."""
    rows = x.reshape(-1, x.size(-1))
    if rows.size(0) % 16:
        return F.linear(x, weight.to(x.dtype))
    out = _Fp8Linear.apply(rows, weight)
    return out.view(*x.shape[:-1], out.size(-1))


class Fp8Linear(Linear):
    def forward(self, x):
        return fp8_linear(x, self.weight) if self.fp8 else super().forward(x)


# ---- the MLP (see the module docstring) ----

def fc_relu_square(x8, w_fc8, scale, out_dtype, use_kernels):
    if use_kernels:
        return kernels.fc_relu_square_fp8(x8, w_fc8, scale, out_dtype)
    y = F.relu(x8.float() @ w_fc8.float().t() * scale).square().to(out_dtype)
    return y, y.abs().max().float()


def relu_square_input_grad(dy8, w_proj8_t, y, scale, use_kernels):
    if use_kernels:
        return kernels.relu_square_input_grad_fp8(dy8, w_proj8_t, y, scale)
    grad_h = (dy8.float() @ w_proj8_t.float().t() * scale * 2 * y.float().sqrt()).to(y.dtype)
    return grad_h, grad_h.abs().max().float()


class _Fp8MLP(torch.autograd.Function):
    """The MLP on x (M, C) (under TP: on this rank's shards of W_fc and W_proj, whose partial sum it returns)."""

    @staticmethod
    def forward(ctx, x, w_fc, w_proj, use_kernels):
        x8, x_inv = to_fp8(x, E4M3)
        w_fc8, w_fc_inv = to_fp8(w_fc, E4M3)
        y, y_amax = fc_relu_square(x8, w_fc8, x_inv * w_fc_inv, x.dtype, use_kernels)
        y8, y_inv = to_fp8(y, E4M3, y_amax)
        w_proj8, w_proj_inv = to_fp8(w_proj, E4M3)
        ctx.save_for_backward(x8, x_inv, w_fc8, w_fc_inv, w_proj8, w_proj_inv, y, y_amax)
        ctx.use_kernels, ctx.w_dtype = use_kernels, w_fc.dtype
        return scaled_mm(y8, w_proj8, y_inv, w_proj_inv, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_inv, w_fc8, w_fc_inv, w_proj8, w_proj_inv, y, y_amax = ctx.saved_tensors
        dout8, dout_inv = to_fp8(grad_out, E5M2)
        grad_h, grad_h_amax = relu_square_input_grad(dout8, w_proj8.t().contiguous(), y, dout_inv * w_proj_inv,
                                                     ctx.use_kernels)
        dh8, dh_inv = to_fp8(grad_h, E5M2, grad_h_amax)
        grad_x = scaled_mm(dh8, w_fc8.t().contiguous(), dh_inv, w_fc_inv, grad_out.dtype)
        grad_w_fc = scaled_mm(dh8.t().contiguous(), x8.t().contiguous(), dh_inv, x_inv, ctx.w_dtype)
        y8, y_inv = to_fp8(y, E4M3, y_amax)  # c_proj's input again, cast as in the forward (its amax saved)
        grad_w_proj = scaled_mm(dout8.t().contiguous(), y8.t().contiguous(), dout_inv, y_inv, ctx.w_dtype)
        return grad_x, grad_w_fc, grad_w_proj, None


class Fp8MLP(MLP):
    """gpt.MLP with ReLU^2 fused into its fp8 products (_Fp8MLP) while `fp8` is on (token counts not a multiple of
    16: gpt.MLP's path). Under TP: this rank's partial sum, which c_proj.reduce sums."""

    def product(self, x):
        rows = x.reshape(-1, x.size(-1))
        if not self.fp8 or rows.size(0) % 16:
            return super().product(x)
        out = _Fp8MLP.apply(rows, self.c_fc.weight, self.c_proj.weight,
                            kernels.takes(kernels.relu_square_mm, x)).view_as(x)
        return self.c_proj.reduce(out) if hasattr(self.c_proj, "reduce") else out
