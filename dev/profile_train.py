"""
Where does a training step's GPU time go? Builds the model, optimizer and data as base_train does,
runs a few warm-up steps (compilation), then profiles a few steps with torch.profiler and prints
dev/trace_report.py's tables: kernels by GPU time, the idle time beside them, and where it sits (by part
of the step: data, train step (the forward and the step's glue), backward, optimizer, step end).
To profile another training script the same way (upstream nanochat's), see dev/profile_script.py.

    python -m dev.profile_train --depth 12 --window-pattern L --data-dir DIR [--fp8] [--l3-after-layers 5]
"""

import os
import time
import argparse
import tempfile

import torch

from dev import trace_report

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
trace_report.report(trace_path, args.active, wall_ms, args.top, labels={"data", "train step", "step end"})
