"""
The MLP's ReLU^2 inside its matmuls (CUDA: Triton, with Hopper's TMA loads and stores):

    forward:   y  = relu(x @ W_fc^T)^2              c_fc's product, ReLU^2 in its epilogue
    backward:  dh = (dy @ W_proj) * 2 sqrt(y)        c_proj's input gradient, ReLU^2's backward in its epilogue

Separate, ReLU^2 costs one more pass over the (tokens, 4C) activation each way: time, and power at the power limit
(dev/LOG.md, 2026-11-22). The backward needs only y (relu(h) = sqrt(y)), which c_proj keeps anyway. With fp8
operands (fp8.Fp8MLP) the accumulator is scaled by the operands' inverse scales, and the amax of the stored 16-bit
values returned for the next cast. Persistent: one program per SM walks the output tiles, grouped along M so that
concurrent tiles share A's rows in L2. Elsewhere (CPU, no Triton, shapes TMA cannot describe, TP's Linears) the MLP
runs ReluSquare between its Linears. Tests run the kernels in Triton's interpreter.
"""

import torch
import torch.nn.functional as F

from nanochat.kernels.splitk import weight_grad

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: relu_square between the Linears is used
    triton = None

RELU_SQUARE, RELU_SQUARE_GRAD = 0, 1  # the two epilogues

# per (epilogue, fp8 operands): (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps), tuned on H200s (dev/LOG.md)
CONFIGS = {(RELU_SQUARE, False): (128, 256, 64, 8, 3, 8), (RELU_SQUARE_GRAD, False): (128, 256, 64, 4, 3, 8),
           (RELU_SQUARE, True): (128, 256, 128, 8, 3, 8), (RELU_SQUARE_GRAD, True): (128, 256, 128, 4, 3, 8)}


if triton is not None:
    @triton.jit
    def _finish(acc, c_desc, y_desc, scale, amax_ptr, off_m, off_n, EPILOGUE: tl.constexpr, FP8: tl.constexpr):
        """The epilogue on an fp32 tile of A @ B, stored at (off_m, off_n). FP8: `scale` undoes the operands' scales;
        the largest |value| stored goes to amax_ptr."""
        if FP8:
            acc = acc * scale
        if EPILOGUE == 0:  # RELU_SQUARE
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        else:  # RELU_SQUARE_GRAD: y = relu(h)^2, so relu(h) = sqrt(y)
            y = y_desc.load([off_m, off_n]).to(tl.float32)
            acc = acc * (2.0 * tl.sqrt(y))
        out = acc.to(c_desc.dtype)
        if FP8:  # the amax of the values as stored (tiles past the edges hold zeros)
            tl.atomic_max(amax_ptr, tl.max(tl.abs(out.to(tl.float32))))
        c_desc.store([off_m, off_n], out)

    @triton.jit
    def _mm_kernel(a_desc, b_desc, c_desc, y_desc, scale_ptr, amax_ptr, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_PROGRAMS: tl.constexpr, EPILOGUE: tl.constexpr, FP8: tl.constexpr):
        # C = epilogue(A @ B^T) for A (M, K) and B (N, K)
        scale = tl.load(scale_ptr) if FP8 else 1.0
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles_per_group = GROUP_M * tiles_n
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
            # grouped order: GROUP_M row-tiles x every column-tile, column by column
            first_m = tile // tiles_per_group * GROUP_M
            group_rows = min(tiles_m - first_m, GROUP_M)
            in_group = tile % tiles_per_group
            off_m = (first_m + in_group % group_rows) * BLOCK_M
            off_n = in_group // group_rows * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([off_n, k]).T, acc)
            # two half-width stores (and y loads): half the shared memory, so 128 x 256 tiles keep 3 pipeline stages
            left, right = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))
            _finish(left, c_desc, y_desc, scale, amax_ptr, off_m, off_n, EPILOGUE, FP8)
            _finish(right, c_desc, y_desc, scale, amax_ptr, off_m, off_n + BLOCK_N // 2, EPILOGUE, FP8)


def _launch(a, b, epilogue, y=None, config=None, scale=None, out_dtype=None):
    """epilogue(a @ b^T) (M, N) for a (M, K), b (N, K), y (M, N), contiguous and aligned: 16-bit, or fp8 with `scale`
    (one fp32 element undoing both operands' scales) and a 16-bit out_dtype, then also the output's amax (0-d fp32)."""
    fp8 = scale is not None
    block_m, block_n, block_k, group_m, stages, warps = config or CONFIGS[epilogue, fp8]
    (M, K), N = a.shape, b.size(0)
    c = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    amax = torch.zeros((), dtype=torch.float32, device=a.device) if fp8 else None
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(b, [block_n, block_k])
    c_desc = TensorDescriptor.from_tensor(c, [block_m, block_n // 2])
    y_desc = TensorDescriptor.from_tensor(y, [block_m, block_n // 2]) if y is not None else c_desc
    # one program per SM; under the interpreter (tests) a few, so that the persistent loop runs more than once
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    programs = min(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), sms)
    _mm_kernel[(programs,)](a_desc, b_desc, c_desc, y_desc, scale, amax, M, N, K,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                            NUM_PROGRAMS=programs, EPILOGUE=epilogue, FP8=fp8, num_stages=stages, num_warps=warps)
    return (c, amax) if fp8 else c


def supported(x):
    """Whether the kernels take x (..., C): CUDA, Triton, 16-bit, rows a multiple of 16 bytes for TMA (weights too)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.size(-1) % 8 == 0


def _tma_ready(t):
    """t contiguous and 16-byte aligned, its row stride too, as a TMA descriptor needs (a copy only if it is not: a
    single row may count as contiguous with any stride)."""
    t = t.contiguous()
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("nanochat::fc_relu_square", mutates_args=())
def fc_relu_square(x: torch.Tensor, w_fc: torch.Tensor) -> torch.Tensor:
    """relu(x @ w_fc^T)^2 for x (M, C) and w_fc (4C, C)."""
    return _launch(_tma_ready(x), _tma_ready(w_fc), RELU_SQUARE)


@torch.library.custom_op("nanochat::relu_square_input_grad", mutates_args=())
def relu_square_input_grad(dy: torch.Tensor, w_proj: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(dy @ w_proj) * 2 sqrt(y), ReLU^2's input gradient, for dy (M, C), w_proj (C, 4C) and y (M, 4C) = its output."""
    # from a transposed copy of w_proj: B read as the forward reads it, (N, K), beats (K, N) at d20 (dev/LOG.md)
    return _launch(_tma_ready(dy), w_proj.t().contiguous(), RELU_SQUARE_GRAD, y=_tma_ready(y))


@torch.library.custom_op("nanochat::fc_relu_square_fp8", mutates_args=())
def fc_relu_square_fp8(x8: torch.Tensor, w_fc8: torch.Tensor, scale: torch.Tensor,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """relu(x8 @ w_fc8^T * scale)^2 in out_dtype and its amax, for x8 (M, C) and w_fc8 (4C, C) in fp8."""
    return _launch(_tma_ready(x8), _tma_ready(w_fc8), RELU_SQUARE, scale=scale, out_dtype=out_dtype)


@torch.library.custom_op("nanochat::relu_square_input_grad_fp8", mutates_args=())
def relu_square_input_grad_fp8(dy8: torch.Tensor, w_proj8_t: torch.Tensor, y: torch.Tensor,
                               scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy8 @ w_proj8_t^T * scale) * 2 sqrt(y) in y's dtype and its amax, for fp8 dy8 (M, C) and w_proj8_t (4C, C)."""
    return _launch(_tma_ready(dy8), _tma_ready(w_proj8_t), RELU_SQUARE_GRAD, y=_tma_ready(y), scale=scale,
                   out_dtype=y.dtype)


# the outputs' shapes and dtypes, for torch.compile's tracing (fresh contiguous tensors; the amax is 0-d fp32)
fc_relu_square.register_fake(lambda x, w_fc: x.new_empty((x.size(0), w_fc.size(0))))
relu_square_input_grad.register_fake(lambda dy, w_proj, y: torch.empty_like(y, memory_format=torch.contiguous_format))
fc_relu_square_fp8.register_fake(lambda x8, w_fc8, scale, out_dtype: (
    x8.new_empty((x8.size(0), w_fc8.size(0)), dtype=out_dtype), scale.new_empty(())))
relu_square_input_grad_fp8.register_fake(lambda dy8, w_proj8_t, y, scale: (
    torch.empty_like(y, memory_format=torch.contiguous_format), scale.new_empty(())))


# ---- the MLP around the kernels, and without them ----

class FusedMLP(torch.autograd.Function):
    """c_proj(relu(c_fc(x))^2) for x (tokens, C); keeps what the unfused path keeps (x, y = relu(h)^2) and splits the
    weight gradients as the Linears would."""

    @staticmethod
    def forward(ctx, x, w_fc, w_proj, fc_split, proj_split):
        y = fc_relu_square(x, w_fc)
        ctx.save_for_backward(x, w_fc, w_proj, y)
        ctx.splits = fc_split, proj_split
        return y @ w_proj.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, w_fc, w_proj, y = ctx.saved_tensors
        fc_split, proj_split = ctx.splits
        grad_h = relu_square_input_grad(grad_out, w_proj, y)
        grad_x = grad_h @ w_fc if ctx.needs_input_grad[0] else None
        return grad_x, weight_grad(grad_h, x, fc_split), weight_grad(grad_out, y, proj_split), None, None


class ReluSquare(torch.autograd.Function):
    """relu(h)^2 keeping only y for the backward, 2 sqrt(y) dy (dev/LOG.md, 2026-11-22). In bf16, sqrt(y) is
    relu(h) to within half of y's rounding error, finer than h's own bf16 rounding."""

    @staticmethod
    def forward(ctx, h):
        y = F.relu(h).square()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return 2 * y.sqrt() * dy
