"""
Rotary positions, then QK-norm: what attention does to q and k before the product.

    r = rotate(x, cos, sin)            pairs (x_i, x_{i+D/2}) -> (x_i c + x_{i+D/2} s, x_{i+D/2} c - x_i s)
    y = scale * r / sqrt(mean(r^2) + eps)      per head vector of D values; eps = float32's epsilon

On CUDA this runs as two Triton kernels behind one custom op (so torch.compile keeps it in its graph as
one call). Each program takes a block of head vectors: the forward reads x and writes y; the backward
reads x and dy and writes dx, recomputing r and the norm from x in registers. That is 2 and 3 passes over
memory. What Inductor made of the PyTorch math took more: ~2 TB/s for the forward and three kernels
for the backward. In the d20 training profile on an H200 it took 52 ms forward and ~63-89 ms backward a
step; these kernels take 26.5 ms (4.05 TB/s) and 42.2 ms (3.8 TB/s). End to end, +2-4% tok/s at d12 and
d20 (dev/LOG.md).

Backward, with n = r / sqrt(mean(r^2) + eps) = r * rstd and g = scale * dy:
    dr = rstd * (g - n * mean(g * n)),   dx = rotate^T(dr): (dr_i c - dr_{i+D/2} s, dr_i s + dr_{i+D/2} c)
(exact even though cos and sin rounded to bf16 make the rotation not quite orthogonal).

Elsewhere (CPU, MPS) the PyTorch math runs; tests check the kernels against it through Triton's
interpreter (TRITON_INTERPRET=1).
"""

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path below is used
    triton = None

EPS = torch.finfo(torch.float32).eps  # what F.rms_norm uses for float32 and bfloat16 inputs


def rotary_tables(seq_len, head_dim, base=100_000.0, device=None):
    """cos and sin of position * frequency, (1, seq_len, 1, head_dim/2) in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]


def apply_rotary(x, cos, sin):
    """x: (B, T, H, D); cos/sin: (1, T, 1, D/2). Rotates pairs (x_i, x_{i+D/2})."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def reference_rotary_norm(x, cos, sin, scale):
    """y = scale * rms_norm(rotate(x)) for x (B, T, H, D) and cos/sin (1, T, 1, D/2): the PyTorch math (any
    device; autograd does the backward)."""
    return F.rms_norm(apply_rotary(x, cos, sin), (x.size(-1),), eps=EPS) * scale


if triton is not None:
    @triton.jit
    def _rotate_rows(x_ptr, cos_ptr, sin_ptr, n_rows, T, H, cs_stride, eps,
                     HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # this program's rows of x rotated, as two halves (fp32), their 1/rms (ROWS, 1), the rows' cos/sin,
        # offsets and mask: what both kernels start from
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
    """Whether the kernels take x: a CUDA tensor, with Triton installed. (No gradient flows to cos/sin through
    them: they are fixed tables.)"""
    return triton is not None and x.is_cuda


def _launch(kernel, x, cos, sin, *tensors, scale):
    """Launch over all head vectors of x (B, T, H, D), contiguous; cos/sin (1, T, 1, D/2)."""
    B, T, H, D = x.shape
    cos, sin = cos.reshape(T, D // 2), sin.reshape(T, D // 2)
    half = D // 2
    block_half = triton.next_power_of_2(half)
    rows_per_program = max(1, 2048 // block_half)  # ~4096 values of x per program
    n_rows = B * T * H
    kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x, cos, sin, *tensors, n_rows, T, H, cos.stride(0), scale, EPS,
        HALF=half, ROWS=rows_per_program, BLOCK_HALF=block_half, num_warps=4)


@torch.library.custom_op("nanochat::rotary_norm", mutates_args=())
def rotary_norm_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    _launch(_forward_kernel, x, cos, sin, y, scale=scale)
    return y


@torch.library.custom_op("nanochat::rotary_norm_backward", mutates_args=())
def rotary_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            scale: float) -> torch.Tensor:
    x, cos, sin, dy = x.contiguous(), cos.contiguous(), sin.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    _launch(_backward_kernel, x, cos, sin, dy, dx, scale=scale)
    return dx


@rotary_norm_op.register_fake
def _(x, cos, sin, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@rotary_norm_backward_op.register_fake
def _(dy, x, cos, sin, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, cos, sin, scale = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.scale = scale


def _backward(ctx, dy):
    x, cos, sin = ctx.saved_tensors
    return rotary_norm_backward_op(dy, x, cos, sin, ctx.scale), None, None, None


rotary_norm_op.register_autograd(_backward, setup_context=_setup_context)
