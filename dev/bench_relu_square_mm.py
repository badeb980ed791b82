"""
The MLP's two products with ReLU^2 in their epilogues (relu_square_mm.py) against cuBLAS plus
torch.compile's ReLU^2 kernels, at one micro-batch of a depth's training shape (bf16, one GPU):
  forward:  relu(x @ W_fc^T)^2              (M, C) x (4C, C)^T
  backward: (dy @ W_proj) * 2 sqrt(y)        (M, C) x (C, 4C)
Checks each against float32 math first, then times (CUDA events, median of repeats) every tile config
given with --configs, and the plain product alone for reference (TFLOP/s over the product's FLOPs). The
backward's time includes the transposed copy of W_proj it runs from.

    python -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64
    python -m dev.bench_relu_square_mm --configs 128,256,64,8,3,8 256,128,64,4,3,8
"""

import torch
import torch.nn.functional as F

from dev.bench_args import micro_batch_parser
from nanochat import relu_square_mm as rsm
from nanochat.common import cuda_time_ms
from nanochat.gpt import config_for_depth

parser = micro_batch_parser()
parser.add_argument("--configs", nargs="*", default=sorted({",".join(map(str, c)) for c in rsm.CONFIGS.values()}),
                    help="tile configs BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,stages,warps")
args = parser.parse_args()

cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
M, C = args.device_batch_size * args.seq_len, cfg.n_embd
torch.manual_seed(0)
x = torch.randn(M, C, device="cuda").bfloat16()
dy = torch.randn(M, C, device="cuda").bfloat16()
w_fc = (torch.randn(4 * C, C, device="cuda") / C ** 0.5).bfloat16()
w_proj = (torch.randn(C, 4 * C, device="cuda") / (4 * C) ** 0.5).bfloat16()
tflop = 2 * M * C * 4 * C / 1e12
print(f"depth {args.depth}: M={M} tokens, C={C}; each product {tflop:.2f} TFLOP")

relu_square = torch.compile(lambda h: F.relu(h).square(), dynamic=False)
relu_square_grad = torch.compile(lambda g, y: 2 * y.sqrt() * g, dynamic=False)
y = relu_square(x @ w_fc.t())


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


rows = slice(0, 4096)  # the check on a slice of the rows, in float32
ref_y = F.relu(x[rows].float() @ w_fc.float().t()).square()
ref_dh = (dy[rows].float() @ w_proj.float()) * 2 * y[rows].float().sqrt()

print(f"{'':<34}{'forward':>20}{'backward':>20}")
fwd_mm = cuda_time_ms(lambda: x @ w_fc.t(), args.repeats)
bwd_mm = cuda_time_ms(lambda: dy @ w_proj, args.repeats)
print(f"{'cuBLAS product alone':<34}{fwd_mm:9.3f} ms ({tflop / fwd_mm * 1e3:4.0f} TF/s){bwd_mm:9.3f} ms ({tflop / bwd_mm * 1e3:4.0f} TF/s)")
fwd = cuda_time_ms(lambda: relu_square(x @ w_fc.t()), args.repeats)
bwd = cuda_time_ms(lambda: relu_square_grad(dy @ w_proj, y), args.repeats)
print(f"{'cuBLAS + compiled ReLU^2':<34}{fwd:9.3f} ms{'':>11}{bwd:9.3f} ms")
for text in args.configs:
    config = tuple(int(v) for v in text.split(","))
    try:
        run_fwd = lambda: rsm._launch(x, w_fc, rsm.RELU_SQUARE, config=config)
        run_bwd = lambda: rsm._launch(dy, w_proj.t().contiguous(), rsm.RELU_SQUARE_GRAD, y=y, config=config)
        err_f = rel_err(run_fwd()[rows], ref_y)
        err_b = rel_err(run_bwd()[rows], ref_dh)
        f, b = cuda_time_ms(run_fwd, args.repeats), cuda_time_ms(run_bwd, args.repeats)
        print(f"{'fused ' + text:<34}{f:9.3f} ms ({tflop / f * 1e3:4.0f} TF/s){b:9.3f} ms ({tflop / b * 1e3:4.0f} TF/s)"
              f"   err {err_f:.1e} / {err_b:.1e}   vs separate {fwd / f:.3f}x / {bwd / b:.3f}x")
    except Exception as e:  # a config that does not compile (shared memory, registers): say so, go on
        print(f"{'fused ' + text:<34} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
