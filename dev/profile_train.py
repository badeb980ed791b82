"""
Where does a training step's GPU time go? Builds the model, optimizer and data as base_train does,
runs a few warm-up steps (compilation), then profiles a few steps with torch.profiler and prints the
kernels by total GPU time, grouped into matmuls, attention, optimizer and the rest; the wall time
of the same steps, so the gap (GPU idle: host syncs, launch overhead, eager code) shows; and where that
idle time sits: each stretch with no kernel running is charged to the part of the step (data, forward,
backward, optimizer, step end) and the host operation that the CPU was in when the GPU ran dry.

    python -m dev.profile_train --depth 12 --window-pattern L --data-dir DIR [--fp8] [--l3-after-layers 5]
"""

import os
import json
import time
import argparse
import tempfile
from collections import defaultdict

import torch

from nanochat.common import compute_init, get_compute_dtype
from nanochat.gpt import config_for_depth, window_sizes
from nanochat import kernels
from nanochat.tokenizer import get_tokenizer
from nanochat import training

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
parser.add_argument("--top", type=int, default=40, help="kernels to list")
args = parser.parse_args()

# base_train's setup (nanochat.training) at its default LRs, one process
layout, device = compute_init("cuda")
dtype = get_compute_dtype("cuda")
tokenizer = get_tokenizer()
l3_layers = tuple(int(i) for i in args.l3_after_layers.split(",") if i)
config = config_for_depth(args.depth, vocab_size=tokenizer.get_vocab_size(), window_pattern=args.window_pattern,
                          l3_after_layers=l3_layers, l3_k_max=args.l3_k_max, l3_n_emb=args.l3_n_emb,
                          l3_tied=bool(l3_layers))
model, fp8_active = training.build_model_for_training(config, device, dtype, layout, fp8=args.fp8,
                                                      l3_data=(tokenizer, args.data_dir))
training.tune_weight_gradients(model, layout, args.device_batch_size * config.sequence_len, dtype)
optimizer = training.make_optimizer(model, layout, dtype, 0.3, 0.008, 0.02, 0.5, 0.28, compile=True)
print(f"attention: {kernels.prepare_attention(config, window_sizes(config), device, dtype)}")
trainer = training.Trainer(model, training.compile_for_training(model, None), None, optimizer, layout, fp8=fp8_active)
schedule = training.Schedule(num_iterations=1000, weight_decay=0.28)
loader = training.make_loader(tokenizer, "train", args.device_batch_size, config.sequence_len, device, layout,
                              args.data_dir, args.grad_accum)


def step():
    """One training step as base_train runs it, in labelled parts (the labels show in the trace; torch
    labels the optimizer's step and the backward's autograd ops itself)."""
    record = torch.profiler.record_function
    with record("data"):
        batches, _ = training.next_batches(loader, args.grad_accum)
    with record("train step"):
        loss, _ = trainer.step(batches, schedule, 100)
    with record("step end"):
        loss.item()


for _ in range(args.warmup):
    step()
torch.cuda.synchronize()
t0 = time.time()
for _ in range(args.active):  # unprofiled wall time (the profiler itself slows the host)
    step()
torch.cuda.synchronize()
wall_ms = (time.time() - t0) * 1000 / args.active
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(args.active):
        step()
    torch.cuda.synchronize()
trace_path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(trace_path)
loader.close()
trace = json.load(open(trace_path))["traceEvents"]
kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
n = args.active


def group_of(name):
    low = name.lower()
    if any(s in low for s in ("attn", "attention", "fmha", "flex", "cudnn")):  # first: FA4's names hold "cutlass"
        return "attention"
    if any(s in low for s in ("gemm", "matmul", "mm_", "cutlass", "sm90_xmma", "nvjet")):
        return "matmul"
    if "nccl" in low:
        return "communication"
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return "elementwise/reduction (triton, aten)"


# --- kernel time: by group and by kernel ---
by_kernel, calls, groups = defaultdict(float), defaultdict(int), defaultdict(float)
for k in kernels:
    by_kernel[k["name"]] += k["dur"]
    calls[k["name"]] += 1
    groups[group_of(k["name"])] += k["dur"]
total = sum(by_kernel.values())
print(f"wall time per step: {wall_ms:.1f} ms; GPU kernel time per step: {total / n / 1000:.1f} ms over "
      f"{len(kernels) // n} kernel launches; idle {wall_ms - total / n / 1000:.1f} ms")
for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
    print(f"  {g:<40} {t / n / 1000:9.1f} ms  {100 * t / total:5.1f}%")
print(f"\n{'kernel':<100} {'ms/step':>9} {'%':>6} {'calls':>7}")
for name, t in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"{name[:100]:<100} {t / n / 1000:9.2f} {100 * t / total:6.1f} {calls[name] // n:7d}")

# --- idle time: the part of the step, and the host op, that the CPU was in when the GPU ran dry ---
# host events of every thread (the backward runs on autograd's own thread)
cpu = sorted((e for e in trace if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"), key=lambda e: e["ts"])
LABELS = {"data", "train step", "step end"}


def part_of(names):
    """The part of the step that open host events with these names belong to: torch's own labels tell
    the optimizer and the backward (on autograd's thread); the rest of the train step is the forward."""
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n.startswith("autograd::engine::evaluate_function") for n in names):
        return "backward"
    if "train step" in names:
        return "forward"
    return next((n for n in names if n in LABELS), "(outside)")


class HostContext:
    """For increasing times ts: the part of the step and the innermost host op running at ts (a sweep
    over the host events, sorted by start)."""

    def __init__(self, events):
        self.events, self.next, self.open = events, 0, []

    def at(self, ts):
        while self.next < len(self.events) and self.events[self.next]["ts"] <= ts:
            self.open.append(self.events[self.next])
            self.next += 1
        self.open = [e for e in self.open if e["ts"] + e["dur"] >= ts]
        part = part_of([e["name"] for e in self.open])
        ops = [e for e in self.open if e["name"] not in LABELS]
        op = min(ops, key=lambda e: e["dur"])["name"] if ops else "(no op)"
        return part, op


host_context = HostContext(cpu).at
by_part, by_op, gaps = defaultdict(float), defaultdict(float), []
busy_until = kernels[0]["ts"] + kernels[0]["dur"]
for k in kernels[1:]:
    gap = k["ts"] - busy_until
    if gap > 5:  # microseconds; shorter gaps are the launch queue's own spacing
        part, op = host_context(busy_until)
        by_part[part] += gap
        by_op[(part, op)] += gap
        gaps.append((gap, part, op))
    busy_until = max(busy_until, k["ts"] + k["dur"])
print(f"\nGPU idle per step, by part of the step ({len(gaps) / n:.0f} gaps over 5 us per step, "
      f"{sum(g for g, _, _ in gaps) / n / 1000:.1f} ms in all):")
for part, t in sorted(by_part.items(), key=lambda kv: -kv[1]):
    print(f"  {part:<12} {t / n / 1000:8.2f} ms")
print("by the host op the CPU was in when the GPU ran dry (top 15):")
for (part, op), t in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]:
    print(f"  {t / n / 1000:8.2f} ms  {part:<10} {op[:90]}")
print("largest single gaps:")
for gap, part, op in sorted(gaps, reverse=True)[:8]:
    print(f"  {gap / 1000:8.2f} ms  {part:<10} {op[:90]}")
