"""
Attention kernels on one GPU at a training shape (one micro-batch, bf16, the (B, T, H, D) layout the
projections produce): what kernels.attention runs without flash-attn-4 (cuDNN through SDPA for full context,
FlexAttention with a block mask for the sliding window) against FlashAttention-4 (kernels/flash_attention.py), if
installed. Checks FA4's output and gradients against the other kernel first, then times forward and
forward + backward with CUDA events (median of repeats), in TFLOP/s over the (query, key) pairs the mask
keeps (4 * D FLOPs a pair forward, 10 * D backward).

    python -m dev.bench_attention --depth 20 --device-batch-size 32
"""

import torch

from dev.bench_args import micro_batch_parser
from nanochat.kernels import flash_attention, sdpa
from nanochat.common import cuda_time_ms
from nanochat.gpt import config_for_depth, window_sizes

args = micro_batch_parser().parse_args()

cfg = config_for_depth(args.depth, sequence_len=args.seq_len, window_pattern="SSSL")
B, T, H, D = args.device_batch_size, args.seq_len, cfg.n_head, cfg.head_dim
device = torch.device("cuda", torch.cuda.current_device())
has_fa4 = flash_attention.supports(device, torch.bfloat16, D)
print(f"depth {args.depth}: B {B}, T {T}, H {H}, D {D}; {torch.cuda.get_device_name()}; "
      f"flash-attn-4 {'available' if has_fa4 else 'NOT available: timing only the PyTorch kernels'}")
sdpa.build_block_masks(T, set(window_sizes(cfg)), device)  # FlexAttention's, for the window
torch.manual_seed(0)
q, k, v, dout = (torch.randn(B, T, H, D, device=device).bfloat16() for _ in range(4))


def pytorch_kernel(window):
    """kernels.attention's kernel without FA4 (cuDNN full, FlexAttention windowed), on (B, T, H, D) tensors."""
    run = sdpa.cudnn_attention if window >= T else (lambda q, k, v: sdpa.flex_attention(q, k, v, window))
    return lambda q, k, v: run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def fa4_kernel(window):
    return lambda q, k, v: flash_attention.flash_attention(q, k, v, window)[0]


def forward_backward(fn):
    """A callable running fn's forward and backward; it returns the output and the three gradients."""
    def run():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in inputs]
    return run


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


for window in sorted(set(window_sizes(cfg)), reverse=True):
    pairs = sum(min(i + 1, window) for i in range(T)) * B * H
    name = "full context" if window >= T else f"window {window}"
    kernels = {"cuDNN (SDPA)" if window >= T else "FlexAttention": pytorch_kernel(window)}
    if has_fa4:
        kernels["FlashAttention-4"] = fa4_kernel(window)
        ref, got = (forward_backward(fn)() for fn in kernels.values())
        print(f"{name}: FA4 against {next(iter(kernels))}, relative error: " +
              ", ".join(f"{n} {rel_err(g, r):.1e}" for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)))
    for kname, fn in kernels.items():
        fwd = cuda_time_ms(lambda: fn(q, k, v), args.repeats)
        bwd = cuda_time_ms(forward_backward(fn), args.repeats) - fwd
        print(f"{name:<14} {kname:<18} forward {fwd:7.3f} ms ({4 * D * pairs / fwd / 1e9:5.0f} TFLOP/s)   "
              f"backward {bwd:7.3f} ms ({10 * D * pairs / bwd / 1e9:5.0f} TFLOP/s)")
