"""
Rotary positions then QK-norm as one custom op on CUDA (gpt.rotary_norm is the math): y = scale * rms_norm(r),
r = rotate(x), in two Triton kernels with fewer passes over memory than Inductor's (dev/LOG.md, 2026-11-21). The
backward recomputes r and the norm in registers (n = r * rstd, g = scale * dy):
    dr = rstd * (g - n * mean(g * n)),   dx = rotate^T(dr): (dr_i c - dr_{i+D/2} s, dr_i s + dr_{i+D/2} c)
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: gpt.py's math runs
    triton = None

EPS = torch.finfo(torch.float32).eps  # what F.rms_norm uses for float32 and bfloat16 inputs


if triton is not None:
    @triton.jit
    def _rotate_rows(x_ptr, cos_ptr, sin_ptr, n_rows, T, H, cs_stride, eps,
                     HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # both kernels' start: the rows rotated, as two fp32 halves, their 1/rms (ROWS, 1), cos/sin, offsets and mask
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
        offsets = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
        cs = ((rows // H) % T)[:, None] * cs_stride + cols[None, :]  # rows are (b, t, h) in order
        x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
        r1 = x1 * c + x2 * s
        r2 = x2 * c - x1 * s
        rstd = tl.math.rsqrt(tl.sum(r1 * r1 + r2 * r2, axis=1) / (2 * HALF) + eps)[:, None]
        return r1, r2, rstd, c, s, offsets, mask

    @triton.jit
    def _forward_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, T, H, cs_stride, scale, eps,
                        HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
        r1, r2, rstd, c, s, offsets, mask = _rotate_rows(x_ptr, cos_ptr, sin_ptr, n_rows, T, H, cs_stride, eps,
                                                         HALF, ROWS, BLOCK_HALF)
        k = rstd * scale
        tl.store(y_ptr + offsets, (r1 * k).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + offsets + HALF, (r2 * k).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(x_ptr, cos_ptr, sin_ptr, dy_ptr, dx_ptr, n_rows, T, H, cs_stride, scale, eps,
                         HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
        r1, r2, rstd, c, s, offsets, mask = _rotate_rows(x_ptr, cos_ptr, sin_ptr, n_rows, T, H, cs_stride, eps,
                                                         HALF, ROWS, BLOCK_HALF)
        g1 = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
        g2 = tl.load(dy_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32) * scale
        n1, n2 = r1 * rstd, r2 * rstd
        m = (tl.sum(g1 * n1 + g2 * n2, axis=1) / (2 * HALF))[:, None]
        dr1 = rstd * (g1 - n1 * m)
        dr2 = rstd * (g2 - n2 * m)
        tl.store(dx_ptr + offsets, (dr1 * c - dr2 * s).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + offsets + HALF, (dr1 * s + dr2 * c).to(dx_ptr.dtype.element_ty), mask=mask)


def supported(x):
    """Whether the kernels take x: a CUDA tensor, with Triton installed (cos/sin, fixed tables, get no gradient)."""
    return triton is not None and x.is_cuda


def _launch(kernel, x, cos, sin, scale, *inputs):
    """Run `kernel` over x (B, T, H, D)'s head vectors, cos/sin (1, T, 1, D/2) [+ dy]: y or dx, contiguous like x."""
    B, T, H, D = x.shape
    half = D // 2
    x, cos, sin = x.contiguous(), cos.contiguous().reshape(T, half), sin.contiguous().reshape(T, half)
    out = torch.empty_like(x)
    block_half = triton.next_power_of_2(half)
    rows_per_program = max(1, 2048 // block_half)  # ~4096 values of x per program
    n_rows = B * T * H
    kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x, cos, sin, *[t.contiguous() for t in inputs], out, n_rows, T, H, cos.stride(0), scale, EPS,
        HALF=half, ROWS=rows_per_program, BLOCK_HALF=block_half, num_warps=4)
    return out


@torch.library.custom_op("nanochat::rotary_norm", mutates_args=())
def rotary_norm_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    return _launch(_forward_kernel, x, cos, sin, scale)


@torch.library.custom_op("nanochat::rotary_norm_backward", mutates_args=())
def rotary_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            scale: float) -> torch.Tensor:
    return _launch(_backward_kernel, x, cos, sin, scale, dy)


# the outputs' shapes, for torch.compile's tracing: fresh contiguous tensors like x
rotary_norm_op.register_fake(lambda x, cos, sin, scale: torch.empty_like(x, memory_format=torch.contiguous_format))
rotary_norm_backward_op.register_fake(
    lambda dy, x, cos, sin, scale: torch.empty_like(x, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])  # x, cos, sin
    ctx.scale = inputs[3]


def _backward(ctx, dy):
    x, cos, sin = ctx.saved_tensors
    return rotary_norm_backward_op(dy, x, cos, sin, ctx.scale), None, None, None


rotary_norm_op.register_autograd(_backward, setup_context=_setup_context)
