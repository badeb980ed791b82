"""
A pipeline stage compiled against eager (one GPU, no process group): forward and backward of one
micro-batch through a stage of --blocks blocks of a --depth model, as a pipeline stage runs them
(Pipeline.forward / backward: the received residual in, the output's gradients from the next stage), in
three ways:
  eager        the blocks as written
  per block    each block compiled on its own (compile_for_training with overlapped gradient reduction)
  stage graph  the stage's blocks as one graph (compile_for_training under a pipeline: model.run_blocks)
Reports ms per micro-batch (median of --repeats, CUDA events), the first call (compilation; the per-block
variant runs last and may reuse kernels inductor cached for the stage graph) and the peak memory of each.

    python -m dev.bench_stage_compile                         # d26, a stage of 13 blocks, micro-batch 16 x 2048
    python -m dev.bench_stage_compile --depth 2 --blocks 2 --seq-len 64 --device-batch-size 2 --repeats 3   # CPU smoke
"""

import time
import statistics

import torch

from dev.bench_args import micro_batch_parser
from nanochat.common import autodetect_device_type, get_compute_dtype, cuda_time_ms
from nanochat.gpt import config_for_depth, build_model, window_sizes, Residual
from nanochat import kernels

parser = micro_batch_parser()
parser.add_argument("--blocks", type=int, default=13, help="blocks in the stage (the model's first ones)")
parser.set_defaults(depth=26, device_batch_size=16)
args = parser.parse_args()

device = torch.device(autodetect_device_type())
cuda = device.type == "cuda"
dtype = get_compute_dtype(device.type)
config = config_for_depth(args.depth, sequence_len=args.seq_len)
torch.manual_seed(0)
model = build_model(config, device, dtype)
print(f"d{args.depth}, a stage of blocks [0, {args.blocks}), micro-batch {args.device_batch_size} x {args.seq_len}, "
      f"{dtype}; attention: {kernels.prepare_attention(config, window_sizes(config), device, dtype)}", flush=True)
B, T, C = args.device_batch_size, args.seq_len, config.n_embd
x = torch.randn(B, T, C, device=device, dtype=dtype)
x0 = torch.randn(B, T, C, device=device, dtype=dtype)
idx = torch.randint(0, config.vocab_size, (B, T), device=device)
grads = [torch.randn(B, T, C, device=device, dtype=dtype) for _ in range(2)]


def stage_step(run_blocks):
    """A stage's forward of one micro-batch and its backward from the next stage's gradients."""
    h = Residual(x.detach().requires_grad_(True), x0.detach().requires_grad_(True))
    out = run_blocks(h, idx, 0, args.blocks)
    torch.autograd.backward([out.x, out.x0], grads)
    for p in model.parameters():
        p.grad = None


def time_ms(fn):
    if cuda:
        return cuda_time_ms(fn, args.repeats)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(name, run_blocks):
    t0 = time.perf_counter()
    stage_step(run_blocks)  # compiles, if compiled
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - t0
    ms = time_ms(lambda: stage_step(run_blocks))
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if cuda else "n/a"
    return [name, ms, f"{first:.1f}", peak]


rows = [measure("eager", model.run_blocks)]
print(rows[-1], flush=True)
# as compile_for_training does it: the stage graph first (the per-block variant compiles the blocks in place)
rows.append(measure("stage graph", torch.compile(model.run_blocks, dynamic=False)))
print(rows[-1], flush=True)
for i in range(args.blocks):
    model.blocks[i].compile(dynamic=False)
rows.append(measure("per block", model.run_blocks))

print(f"\n{'variant':<12} | {'ms / micro-batch':>16} | {'vs eager':>8} | {'first call s':>12} | peak GiB")
print("-" * 70)
for name, ms, first, peak in rows:
    print(f"{name:<12} | {ms:>16.2f} | {rows[0][1] / ms:>7.2f}x | {first:>12} | {peak}")
