"""
Where does a training step's GPU time go? Builds the model, optimizer and data as base_train does,
runs a few warm-up steps (compilation), then profiles a few steps with torch.profiler and prints the
kernels by total GPU time, grouped into matmuls, attention, optimizer and the rest; and the wall time
of the same steps, so the gap (GPU idle: host syncs, launch overhead, eager code) shows.

    python -m dev.profile_train --depth 12 --window-pattern L --data-dir DIR [--fp8] [--l3-after-layers 5]
"""

import time
import argparse
from collections import defaultdict

import torch

from nanochat.common import compute_init, get_compute_dtype
from nanochat.gpt import config_for_depth, build_model, prepare_attention
from nanochat.optim import MuonAdamW
from nanochat.dataloader import DataLoader
from nanochat.tokenizer import get_tokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--depth", type=int, default=12)
parser.add_argument("--window-pattern", type=str, default="L")
parser.add_argument("--device-batch-size", type=int, default=32)
parser.add_argument("--grad-accum", type=int, default=8)
parser.add_argument("--warmup", type=int, default=4)
parser.add_argument("--active", type=int, default=2)
parser.add_argument("--data-dir", type=str, default=None)
parser.add_argument("--fp8", action="store_true")
parser.add_argument("--l3-after-layers", type=str, default="", help="as in base_train, e.g. 5")
parser.add_argument("--l3-k-max", type=int, default=512)
parser.add_argument("--l3-n-emb", type=int, default=0)
parser.add_argument("--trace", type=str, default="", help="write a Chrome trace here")
args = parser.parse_args()

layout, device = compute_init("cuda")
dtype = get_compute_dtype("cuda")
tokenizer = get_tokenizer()
l3_layers = tuple(int(i) for i in args.l3_after_layers.split(",") if i)
config = config_for_depth(args.depth, vocab_size=tokenizer.get_vocab_size(), window_pattern=args.window_pattern,
                          l3_after_layers=l3_layers, l3_k_max=args.l3_k_max, l3_n_emb=args.l3_n_emb)
model = build_model(config, device, dtype)
if l3_layers:
    from nanochat.l3 import allocate_for_model
    allocate_for_model(model, tokenizer, args.data_dir, layout)
if args.fp8:
    from nanochat.fp8 import convert_to_fp8
    convert_to_fp8(model, "tensorwise", device)
names = {p: n for n, p in model.named_parameters()}
optimizer = MuonAdamW(model.param_groups(0.3, 0.008, 0.02, 0.5, 0.28), names, compute_dtype=dtype, compile=True)
prepare_attention(config, device)
cmodel = torch.compile(model, dynamic=False)
loader = DataLoader(tokenizer, args.device_batch_size, config.sequence_len, "train", device, data_dir=args.data_dir)


def step():
    for _ in range(args.grad_accum):
        x, y, _ = next(loader)
        (cmodel(x, y) / args.grad_accum).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(args.warmup):
    step()
torch.cuda.synchronize()
t0 = time.time()
for _ in range(args.active):  # unprofiled wall time (the profiler itself slows the host)
    step()
torch.cuda.synchronize()
wall_ms = (time.time() - t0) * 1000 / args.active
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(args.active):
        step()
    torch.cuda.synchronize()
if args.trace:
    prof.export_chrome_trace(args.trace)

events = [e for e in prof.key_averages() if e.device_time_total > 0]
total = sum(e.device_time_total for e in events)
groups = defaultdict(float)


def group_of(name):
    n = name.lower()
    if "gemm" in n or "matmul" in n or "mm_" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "matmul"
    if "attn" in n or "attention" in n or "fmha" in n or "flex" in n or "cudnn" in n:
        return "attention"
    if "nccl" in n:
        return "communication"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "elementwise/reduction (triton, aten)"


for e in events:
    groups[group_of(e.key)] += e.device_time_total
print(f"wall time per step: {wall_ms:.1f} ms; GPU kernel time per step: {total / args.active / 1000:.1f} ms over "
      f"{len(events)} kernels; idle {wall_ms - total / args.active / 1000:.1f} ms")
for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
    print(f"  {g:<40} {t / args.active / 1000:9.1f} ms  {100 * t / total:5.1f}%")
print(f"\n{'kernel':<100} {'ms/step':>9} {'%':>6} {'calls':>7}")
for e in sorted(events, key=lambda e: -e.device_time_total)[:40]:
    print(f"{e.key[:100]:<100} {e.device_time_total / args.active / 1000:9.2f} {100 * e.device_time_total / total:6.1f} {e.count // args.active:7d}")
loader.close()
