"""
The model's matmul shapes on one GPU, one at a time, in their three roles: forward (x @ W^T),
input gradient (dy @ W) and weight gradient (dy^T @ x), bf16, timed with CUDA events (median of
repeats), in TFLOP/s. For the weight gradient also two other ways of getting the same product: the
transposed one, (x^T @ dy)^T, and with the token dim split into s chunks as one bmm plus a sum (a
manual split-K, for outputs too small to fill the GPU's SMs in whole waves; kernels.tune_wgrad_splits
makes that choice per shape at the start of training). The roles run in order on a warm GPU: the
first of each shape can come out a few % faster than an equal product timed later.

    python -m dev.bench_matmul --depth 20 --device-batch-size 32
"""

import torch

from dev.bench_args import micro_batch_parser
from nanochat.common import cuda_time_ms
from nanochat.gpt import config_for_depth

parser = micro_batch_parser()
parser.add_argument("--vocab", type=int, default=32768)
args = parser.parse_args()

d = config_for_depth(args.depth).n_embd
M = args.device_batch_size * args.seq_len
shapes = {"attention q/k/v/proj": (d, d), "MLP up": (d, 4 * d), "MLP down": (4 * d, d), "lm_head": (d, args.vocab)}


print(f"depth {args.depth}: d {d}, {M} tokens per micro-batch; {torch.cuda.get_device_name()}, "
      f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
print(f"{'linear':<22} {'(in, out)':<14} {'role':<28} {'ms':>7} {'TFLOP/s':>8}")
for name, (n_in, n_out) in shapes.items():
    x = torch.randn(M, n_in, device="cuda").bfloat16()
    w = torch.randn(n_out, n_in, device="cuda").bfloat16()
    dy = torch.randn(M, n_out, device="cuda").bfloat16()
    flop = 2 * M * n_in * n_out
    roles = {"forward x @ W^T": lambda: x @ w.t(),
             "input grad dy @ W": lambda: dy @ w,
             "weight grad dy^T @ x": lambda: dy.t() @ x,
             "weight grad (x^T @ dy)^T": lambda: (x.t() @ dy).t()}
    for s in (2, 3, 4):
        if M % s == 0:
            roles[f"weight grad split-K {s} (bmm)"] = (
                lambda s=s: torch.bmm(dy.view(s, M // s, n_out).transpose(1, 2), x.view(s, M // s, n_in)).sum(0))
    for role, fn in roles.items():
        ms = cuda_time_ms(fn, args.repeats)
        print(f"{name:<22} {str((n_in, n_out)):<14} {role:<28} {ms:7.3f} {flop / ms / 1e9:8.1f}")
    del x, w, dy
