"""
Rotary + QK-norm on one GPU at a training shape (q of one micro-batch, bf16): the custom op's Triton
kernels (kernels/rotary.py) against what torch.compile makes of the same PyTorch math. Checks the op against
float64 first, then times forward and forward + backward with CUDA events (median of repeats), with the
bandwidth over the bytes each must move (forward: read x, write y; backward: read x and dy, write dx).

    python -m dev.bench_rotary_norm --depth 20 --device-batch-size 32
"""

import torch

from dev.bench_args import micro_batch_parser
from nanochat.common import cuda_time_ms
from nanochat.gpt import config_for_depth
from nanochat.kernels.rotary import rotary_norm_op, reference_rotary_norm, rotary_tables

args = micro_batch_parser().parse_args()

cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
B, T, H, D = args.device_batch_size, args.seq_len, cfg.n_head, cfg.head_dim
torch.manual_seed(0)
x = torch.randn(B, T, H, D, device="cuda").bfloat16()
dy = torch.randn(B, T, H, D, device="cuda").bfloat16()
cos, sin = (t[:, :T].to("cuda", torch.bfloat16) for t in rotary_tables(T, D))

# --- correctness on the first sequence, against float64 of the same bf16 inputs ---
xs = x[:1].clone().requires_grad_()
rotary_norm_op(xs, cos, sin, 1.2).backward(dy[:1])
ref_x = x[:1].double().requires_grad_()
ref = reference_rotary_norm(ref_x, cos.double(), sin.double(), 1.2)
ref.backward(dy[:1].double())
y = rotary_norm_op(x[:1], cos, sin, 1.2)
print(f"vs float64 on one sequence: output relative error {((y.double() - ref).norm() / ref.norm()).item():.2e}, "
      f"gradient relative error {((xs.grad.double() - ref_x.grad).norm() / ref_x.grad.norm()).item():.2e}")

compiled = torch.compile(reference_rotary_norm, dynamic=False)


def forward(fn):
    return lambda: fn(x, cos, sin, 1.2)


def forward_backward(fn):
    def run():
        xr = x.detach().requires_grad_()
        fn(xr, cos, sin, 1.2).backward(dy)
    return run


gb = x.numel() * x.element_size() / 1e9
for name, fn in (("torch.compile of the PyTorch math", compiled), ("custom op (Triton kernels)", rotary_norm_op)):
    fwd = cuda_time_ms(forward(fn), args.repeats)
    both = cuda_time_ms(forward_backward(fn), args.repeats)
    print(f"{name:<36} forward {fwd:6.3f} ms ({2 * gb / fwd:.2f} TB/s)   "
          f"forward + backward {both:6.3f} ms ({5 * gb / both:.2f} TB/s over 5 passes of {gb:.2f} GB)")
