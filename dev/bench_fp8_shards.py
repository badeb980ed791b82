"""
fp8 against bf16 for the matmuls one rank of a tensor-parallel model runs, on one GPU: each linear of a block
at its shard's shape (by default d32 at --tp 2: the q, k, v column shards n_embd -> its heads, attention's
c_proj row shard, and the MLP's shard n_embd -> 4 n_embd / tp -> n_embd), forward + backward of one
micro-batch, compiled as training compiles them (the fp8 casts and amaxes fuse only under torch.compile).
fp8 is fp8.py's Fp8Linear and Fp8MLP (ReLU^2 inside the products); bf16 is kernels.Linear and gpt.MLP (its
fused ReLU^2 kernels). Weights fp32 as in training, activations bf16; CUDA events, median of --repeats.
One GPU has no TP group, so the global-amax all-reduces that fp8 adds under TP (12 fp32 scalars per block
and micro-batch, fp8.py's docstring) are not in these times: a multi-GPU run measures them.

    python -m dev.bench_fp8_shards                                  # d32 at TP=2, 16 x 2048 tokens
    python -m dev.bench_fp8_shards --depth 26 --tp 4 --device-batch-size 8
"""

import copy

import torch

from dev.bench_args import micro_batch_parser
from nanochat.common import cuda_time_ms, fail
from nanochat.gpt import config_for_depth, MLP
from nanochat.kernels import Linear

parser = micro_batch_parser()
parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree whose per-rank shapes are timed")
parser.set_defaults(depth=32, device_batch_size=16)
args = parser.parse_args()

if not torch.cuda.is_available():
    fail("dev.bench_fp8_shards times fp8 matmuls on a CUDA GPU (SM89+, with torchao); this machine has none")
from nanochat.fp8 import convert_to_fp8, fp8_unavailable_reason
from nanochat.tensor_parallel import check_tp_size
if reason := fp8_unavailable_reason(torch.device("cuda")):
    fail(f"dev.bench_fp8_shards: {reason}")
cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
try:
    check_tp_size(cfg, args.tp)
except ValueError as e:
    fail(str(e))

C, hd, tp = cfg.n_embd, cfg.head_dim, args.tp
M = args.device_batch_size * args.seq_len
q_out, kv_out = cfg.n_head * hd // tp, cfg.n_kv_head * hd // tp
mlp = MLP(cfg)
mlp.c_fc, mlp.c_proj = Linear(C, 4 * C // tp), Linear(4 * C // tp, C)  # this rank's shard of the MLP
shards = [("q (column)", Linear(C, q_out)), ("k (column)", Linear(C, kv_out)), ("v (column)", Linear(C, kv_out)),
          ("attention c_proj (row)", Linear(q_out, C)), ("MLP c_fc (column) + c_proj (row)", mlp)]
torch.manual_seed(0)


def fwd_bwd_ms(module, n_in, n_out):
    """Forward + backward (input and weight gradients) of the compiled module on one micro-batch."""
    step = torch.compile(module, dynamic=False)
    x = torch.randn(M, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, n_out, device="cuda", dtype=torch.bfloat16)
    params = list(module.parameters())
    return cuda_time_ms(lambda: torch.autograd.grad(step(x), [x, *params], dy), args.repeats)


pairs = []  # (name, bf16 module, its fp8 copy), converted before the table (convert_to_fp8 prints a line)
for name, module in shards:
    module = module.cuda()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=p.size(1) ** -0.5)
    holder = torch.nn.Sequential(copy.deepcopy(module))
    assert convert_to_fp8(holder, torch.device("cuda")) > 0, name
    pairs.append((name, module, holder[0]))

print(f"depth {args.depth} at TP={tp}, one rank's shards: n_embd {C}, {M:,} tokens per micro-batch "
      f"({args.device_batch_size} x {args.seq_len}); {torch.cuda.get_device_name()}; forward + backward, compiled")
print(f"{'linear':<36}{'(in, out)':>16}{'bf16 ms':>10}{'fp8 ms':>10}{'bf16/fp8':>10}")
total_bf16 = total_fp8 = 0.0
for name, module, fp8_module in pairs:
    n_in, n_out = (C, C) if module is mlp else (module.in_features, module.out_features)
    shape = f"({C}, {4 * C // tp}, {C})" if module is mlp else f"({n_in}, {n_out})"
    bf16_ms, fp8_ms = fwd_bwd_ms(module, n_in, n_out), fwd_bwd_ms(fp8_module, n_in, n_out)
    total_bf16, total_fp8 = total_bf16 + bf16_ms, total_fp8 + fp8_ms
    print(f"{name:<36}{shape:>16}{bf16_ms:10.3f}{fp8_ms:10.3f}{bf16_ms / fp8_ms:9.3f}x")
print(f"{'a block (sum of the above)':<36}{'':>16}{total_bf16:10.3f}{total_fp8:10.3f}{total_bf16 / total_fp8:9.3f}x")
