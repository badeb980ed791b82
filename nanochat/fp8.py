"""
fp8 training linears through torchao's float8 training (dynamic scaling, `tensorwise` or `rowwise`).

- Only Linear layers whose dims are multiples of 16 and at least 128 are converted (the fp8 matmul's
  shape rules; small layers gain nothing), and never the lm_head: the logits keep bf16 precision.
- The weights stay the same fp32 Parameters: a Float8Linear keeps the Linear's weight and only casts
  it (and the activations, and the output gradients) to fp8 around each matmul. So a checkpoint has the
  same keys with or without fp8, and one saved with fp8 loads without it and vice versa.
- Evaluation and sampling run in bf16: `bf16_linears(model)` swaps every Float8Linear back to a plain
  Linear holding the very same weight Parameter, and restores the fp8 modules afterwards.
- `tensorwise` is torchao's recipe with fast accumulation in all three matmuls (torchao: the forward's
  only). `rowwise` is torchao's as it is.
- Without CUDA (or an SM89+ GPU), or without torchao, --fp8 says so and training continues without it.
It pays off only under torch.compile, which fuses the casts and scale computations.

One cast is ours, not torchao's (tensorwise recipe only). The gradient that reaches the MLP's c_fc is
g_h = 2 relu(h) * g_a, from ReLU^2's backward; c_fc's fp8 backward needs it as e5m2 twice: row-major for
the input gradient and transposed for the weight gradient (Hopper's fp8 matmuls take both operands
K-major). Left to torch.compile, the ReLU^2 backward, the casts and the transposed copy became one kernel
that wrote the transposed bytes slowly: 1.27 ms per call at d20 on an H200, against 0.46 ms for the bf16
ReLU^2 backward (dev/LOG.md, session 6). So MLP.act becomes ReluSquareFp8Grad, whose backward
- takes the tensor's amax (a reduction that torch.compile generates),
- casts g_h to e5m2 row-major in one Triton kernel (fp32 math, saturated as torchao does),
- and returns a torchao Float8TrainingTensor: torchao's backward uses an already-cast gradient as it is,
  and only its transposed copy is left to torch.compile, now a copy of 1-byte values.
In the d20 profile these kernels take 226 ms a step against 277 (dev/LOG.md, session 8); end to end that
was +0.4%, within the spread between GPUs.
Off CUDA the same cast runs in PyTorch (tests compare the two through Triton's interpreter).
"""

import dataclasses
import importlib.util
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nanochat.gpt import Linear, MLP, ReluSquare

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch cast below is used
    triton = None


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


def convert_to_fp8(model, recipe="tensorwise", device=None, force=False):
    """Convert eligible Linears in place. Returns the number converted (0 when fp8 is unavailable;
    `force` skips the device check, for tests on CPU)."""
    reason = None if force else fp8_unavailable_reason(device)
    if reason:
        print(f"WARNING: --fp8 requested but {reason}; continuing without fp8", flush=True)
        return 0
    from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":
        # torchao gives cuBLAS's fast fp8 accumulation (no periodic promotion to fp32) to the forward matmul
        # only; the two backward ones get it too: +2.4-2.9% tok/s at d20, and the equal-steps d12 loss stays
        # within the bf16 runs' spread (dev/LOG.md, session 8)
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(model, config=config, module_filter_fn=is_eligible)
    converted = sum(1 for m in model.modules() if _is_fp8(m))
    # rowwise casts c_fc's gradient twice, along different axes: an already-cast one would serve only one
    fused = 0
    for mlp in model.modules():
        if recipe == "tensorwise" and isinstance(mlp, MLP) and _is_fp8(mlp.c_fc):
            mlp.act = ReluSquareFp8Grad(mlp.c_fc)
            fused += 1
    print(f"fp8 ({recipe}): converted {converted} Linear layers"
          + (f"; {fused} MLPs cast c_fc's gradient to fp8 in ReLU^2's backward" if fused else ""), flush=True)
    return converted


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
    if isinstance(module, ReluSquareFp8Grad):
        return ReluSquare()
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
    """Run the block in bf16: fp8 Linears are temporarily replaced by plain Linears on the same weights
    (and ReLU^2 by the plain one, whose gradient a plain c_fc can take)."""
    swapped = _swap(model, _as_bf16)
    try:
        yield model
    finally:
        for parent, name, old in swapped:
            setattr(parent, name, old)


# ---- ReLU^2 whose backward casts c_fc's gradient to fp8 (see the module docstring) ----

def relu_square_grad(grad, h):
    """g_h = 2 relu(h) * g_a in fp32, the values that are scaled and cast."""
    return 2 * F.relu(h.float()) * grad.float()


def reference_grad_to_fp8(grad, h, scale, fp8_dtype):
    """The cast in PyTorch: torchao's saturated cast of g_h * scale."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (relu_square_grad(grad, h) * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


if triton is not None:
    @triton.jit
    def _grad_to_fp8_kernel(grad_ptr, h_ptr, scale_ptr, out_ptr, n, fp8_max, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = 2 * tl.maximum(h, 0.0) * g * tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
        tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("nanochat::relu_square_grad_to_fp8", mutates_args=())
def grad_to_fp8_op(grad: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """(2 relu(h) * grad * scale) saturated to fp8_dtype, row-major: one Triton kernel (a custom op, so that
    torch.compile cannot fuse the transposed copy that torchao makes of it back into this pass)."""
    grad, h = grad.contiguous(), h.contiguous()
    out = torch.empty(h.shape, dtype=fp8_dtype, device=h.device)
    n, block = h.numel(), 4096
    _grad_to_fp8_kernel[(triton.cdiv(n, block),)](grad, h, scale, out, n, torch.finfo(fp8_dtype).max,
                                                  BLOCK=block, num_warps=8)
    return out


@grad_to_fp8_op.register_fake
def _(grad, h, scale, fp8_dtype):
    return torch.empty(h.shape, dtype=fp8_dtype, device=h.device)


@torch._dynamo.allow_in_graph  # as torchao's own autograd functions: AOTAutograd traces it, Dynamo does not
class _ReluSquareFp8Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, linear_mm_config, config):
        ctx.save_for_backward(h)
        ctx.linear_mm_config, ctx.config = linear_mm_config, config
        return F.relu(h).square()

    @staticmethod
    def backward(ctx, grad):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        from torchao.float8.float8_utils import amax_to_scale
        h, = ctx.saved_tensors
        fp8_dtype = ctx.config.cast_config_grad_output.target_dtype
        amax = relu_square_grad(grad, h).abs().max()
        scale = amax_to_scale(amax, fp8_dtype, ctx.config.round_scales_to_power_of_2)  # torchao's tensorwise scale
        if triton is not None and h.is_cuda:
            data = grad_to_fp8_op(grad, h, scale, fp8_dtype)
        else:
            data = reference_grad_to_fp8(grad, h, scale, fp8_dtype)
        return Float8TrainingTensor(data, scale, grad.dtype, ctx.linear_mm_config, GemmInputRole.GRAD_OUTPUT), None, None


class ReluSquareFp8Grad(torch.nn.Module):
    """relu(h)^2 for h = fc(x), fc a tensorwise Float8Linear: the backward returns the gradient as fc's fp8
    backward wants it. Keeps fc's two configs, not fc itself (no second path to its weight)."""

    def __init__(self, fc):
        super().__init__()
        self.linear_mm_config, self.config = fc.linear_mm_config, fc.config

    def forward(self, h):
        return _ReluSquareFp8Grad.apply(h, self.linear_mm_config, self.config)
