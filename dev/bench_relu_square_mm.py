"""
The MLP's two products with ReLU^2 in their epilogues (kernels/relu_square_mm.py) against cuBLAS plus
torch.compile's ReLU^2 kernels, at one micro-batch of a depth's training shape (one GPU):
  forward:  relu(x @ W_fc^T)^2              (M, C) x (4C, C)^T
  backward: (dy @ W_proj) * 2 sqrt(y)        (M, C) x (C, 4C)
In bf16, or with --fp8 as fp8.py's tensorwise MLP runs them: e4m3 x and weights, e5m2 dy, cuBLAS's
_scaled_mm with fast accumulation, and each side timed up to its output cast to fp8 (the next product's
input), since the fused kernels hand over their amax and the separate path needs an amax pass.
Checks each against float32 math first, then times (CUDA events, median of repeats) every tile config
given with --configs, and the plain product alone for reference (TFLOP/s over the product's FLOPs). The
backward's time includes the transposed copy of W_proj it runs from.

    python -m dev.bench_relu_square_mm --depth 20 --device-batch-size 64 [--fp8]
    python -m dev.bench_relu_square_mm --configs 128,256,64,8,3,8 256,128,64,4,3,8
"""

import torch
import torch.nn.functional as F

from dev.bench_args import micro_batch_parser
from nanochat.kernels import relu_square_mm as rsm
from nanochat.common import cuda_time_ms
from nanochat.gpt import config_for_depth

parser = micro_batch_parser()
parser.add_argument("--fp8", action="store_true", help="fp8 operands (tensorwise scales), as fp8.py's MLP")
parser.add_argument("--configs", nargs="*", default=None, help="tile configs BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,stages,warps "
                    "(default: the ones relu_square_mm.CONFIGS picks)")
args = parser.parse_args()
configs = args.configs or sorted({",".join(map(str, c)) for (_, fp8), c in rsm.CONFIGS.items() if fp8 == args.fp8})

cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
M, C = args.device_batch_size * args.seq_len, cfg.n_embd
torch.manual_seed(0)
x = torch.randn(M, C, device="cuda").bfloat16()
dy = torch.randn(M, C, device="cuda").bfloat16()
w_fc = (torch.randn(4 * C, C, device="cuda") / C ** 0.5).bfloat16()
w_proj = (torch.randn(C, 4 * C, device="cuda") / (4 * C) ** 0.5).bfloat16()
tflop = 2 * M * C * 4 * C / 1e12
print(f"depth {args.depth}: M={M} tokens, C={C}; each product {tflop:.2f} TFLOP; {'fp8' if args.fp8 else 'bf16'}")
compiled = lambda fn: torch.compile(fn, dynamic=False)

if args.fp8:
    from nanochat.fp8 import E4M3, E5M2, to_fp8, scaled_mm  # the casts and products of fp8.Fp8MLP (needs torchao)

    x_op, x_inv = to_fp8(x, E4M3)
    dy_op, dy_inv = to_fp8(dy, E5M2)
    w_fc_op, w_fc_inv = to_fp8(w_fc, E4M3)
    w_proj_op, w_proj_inv = to_fp8(w_proj, E4M3)
    w_proj_t_op = w_proj_op.t().contiguous()
    fwd_scale, bwd_scale = x_inv * w_fc_inv, dy_inv * w_proj_inv
    fwd_product = lambda: scaled_mm(x_op, w_fc_op, x_inv, w_fc_inv, torch.bfloat16)
    bwd_product = lambda: scaled_mm(dy_op, w_proj_t_op, dy_inv, w_proj_inv, torch.bfloat16)
    relu_square_cast = compiled(lambda h: to_fp8(F.relu(h).square(), E4M3))
    relu_square_grad_cast = compiled(lambda g, y: to_fp8(2 * y.float().sqrt() * g, E5M2))
    cast_known_amax = compiled(to_fp8)
    y = F.relu(fwd_product()).square()
    separate_fwd = lambda: relu_square_cast(fwd_product())
    separate_bwd = lambda: relu_square_grad_cast(bwd_product(), y)

    def fused_fwd(config):  # the output, after the cast that c_proj's product needs
        y, amax = rsm._launch(x_op, w_fc_op, rsm.RELU_SQUARE, config=config, scale=fwd_scale, out_dtype=torch.bfloat16)
        cast_known_amax(y, E4M3, amax)
        return y

    def fused_bwd(config):  # the output, after the cast that c_fc's backward products need
        grad_h, amax = rsm._launch(dy_op, w_proj_t_op, rsm.RELU_SQUARE_GRAD, y=y, config=config, scale=bwd_scale,
                                   out_dtype=torch.bfloat16)
        cast_known_amax(grad_h, E5M2, amax)
        return grad_h

    ref_x, ref_dy = x_op.float() * x_inv, dy_op.float() * dy_inv
    ref_w_fc, ref_w_proj = w_fc_op.float() * w_fc_inv, w_proj_op.float() * w_proj_inv
else:
    fwd_product = lambda: x @ w_fc.t()
    bwd_product = lambda: dy @ w_proj
    relu_square = compiled(lambda h: F.relu(h).square())
    relu_square_grad = compiled(lambda g, y: 2 * y.sqrt() * g)
    y = relu_square(fwd_product())
    separate_fwd = lambda: relu_square(fwd_product())
    separate_bwd = lambda: relu_square_grad(bwd_product(), y)
    fused_fwd = lambda config: rsm._launch(x, w_fc, rsm.RELU_SQUARE, config=config)
    fused_bwd = lambda config: rsm._launch(dy, w_proj.t().contiguous(), rsm.RELU_SQUARE_GRAD, y=y, config=config)
    ref_x, ref_dy, ref_w_fc, ref_w_proj = x.float(), dy.float(), w_fc.float(), w_proj.float()


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


rows = slice(0, 4096)  # the check on a slice of the rows, in float32
ref_y = F.relu(ref_x[rows] @ ref_w_fc.t()).square()
ref_dh = (ref_dy[rows] @ ref_w_proj) * 2 * y[rows].float().sqrt()

print(f"{'':<34}{'forward':>20}{'backward':>20}")
fwd_mm = cuda_time_ms(fwd_product, args.repeats)
bwd_mm = cuda_time_ms(bwd_product, args.repeats)
print(f"{'cuBLAS product alone':<34}{fwd_mm:9.3f} ms ({tflop / fwd_mm * 1e3:4.0f} TF/s){bwd_mm:9.3f} ms ({tflop / bwd_mm * 1e3:4.0f} TF/s)")
fwd = cuda_time_ms(separate_fwd, args.repeats)
bwd = cuda_time_ms(separate_bwd, args.repeats)
label = "cuBLAS + compiled ReLU^2" + (" + cast" if args.fp8 else "")
print(f"{label:<34}{fwd:9.3f} ms{'':>11}{bwd:9.3f} ms")
for text in configs:
    config = tuple(int(v) for v in text.split(","))
    try:
        err_f = rel_err(fused_fwd(config)[rows], ref_y)
        err_b = rel_err(fused_bwd(config)[rows], ref_dh)
        f, b = cuda_time_ms(lambda: fused_fwd(config), args.repeats), cuda_time_ms(lambda: fused_bwd(config), args.repeats)
        print(f"{'fused ' + text:<34}{f:9.3f} ms ({tflop / f * 1e3:4.0f} TF/s){b:9.3f} ms ({tflop / b * 1e3:4.0f} TF/s)"
              f"   err {err_f:.1e} / {err_b:.1e}   vs separate {fwd / f:.3f}x / {bwd / b:.3f}x")
    except Exception as e:  # a config that does not compile (shared memory, registers): say so, go on
        print(f"{'fused ' + text:<34} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
