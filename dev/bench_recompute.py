"""
Activation recompute (--recompute) on one GPU: for each depth and mode, base_train's model, split-K
choice, optimizer and compiled step (nanochat.training) on random tokens, one micro-batch per step (no
gradient accumulation), at base_train's default LRs, and a table of:
  tok/s        median over the timed steps (after warm-up: the first step compiles), and the ratio to none
  peak GiB     torch.cuda.max_memory_allocated over the timed steps
  act GiB      the activations: memory allocated right after the forward minus right before it (what the
               forward keeps for the backward, as the compiled graph keeps it), and the ratio to none
  peak-static  peak minus params + optimizer state (allocated between steps, gradients freed) + gradients
               (one fp32 tensor per parameter): the activations plus whatever is transient at the peak
  max batch    the largest of --batches whose full step (forward, backward, optimizer) runs without running
               out of memory, tried in increasing order until one fails, memory freed between tries; on the
               uncompiled model (a compile per batch size would cost minutes), whose intermediates are
               at least the compiled graph's, so the compiled step fits at least this batch
The ratios answer: which mode cuts activation memory by how much, for how much time.

    python -m dev.bench_recompute                                  # d20 and d26, every mode (H200: ~9 min)
    python -m dev.bench_recompute --depths 26 --modes none,block --device-batch-size 8
    python -m dev.bench_recompute --depths 2 --seq-len 64 --device-batch-size 2 --batches 1,2 --steps 2   # CPU smoke

On a CPU the model runs uncompiled and memory columns are n/a (no batch search).
"""

import gc
import time
import argparse
import statistics

import torch
import torch._dynamo

from nanochat.common import compute_init, get_compute_dtype, device_name
from nanochat.gpt import config_for_depth, window_sizes, RECOMPUTE_MODES
from nanochat import kernels
from nanochat import training

parser = argparse.ArgumentParser(description="Activation recompute: memory and throughput per mode")
parser.add_argument("--depths", type=str, default="20,26", help="comma-separated depths")
parser.add_argument("--modes", type=str, default=",".join(RECOMPUTE_MODES), help="comma-separated --recompute modes")
parser.add_argument("--device-batch-size", type=int, default=16, help="sequences per step for the timings")
parser.add_argument("--batches", type=str, default="8,16,32,48,64", help="device batch sizes the search tries")
parser.add_argument("--seq-len", type=int, default=2048)
parser.add_argument("--window-pattern", type=str, default="SSSL")
parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (the first compiles)")
args = parser.parse_args()

layout, device = compute_init()
cuda = device.type == "cuda"
dtype = get_compute_dtype(device.type)
GiB = 2 ** 30
print(f"device {device_name(device.type)}, dtype {dtype}, compiled {cuda}; seq len {args.seq_len}, "
      f"window pattern {args.window_pattern}, timed at device batch {args.device_batch_size}", flush=True)


def random_batch(config, batch_size):
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.sequence_len + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def step(train_model, optimizer, x, y):
    """One training step, as Trainer.step runs it with one micro-batch (the LR schedule aside)."""
    train_model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def free_memory():
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def fits(model, optimizer, config, batch_size):
    """Whether a full step at this batch size runs without running out of memory."""
    try:
        step(model, optimizer, *random_batch(config, batch_size))
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False  # leaving the except clause drops the traceback, and with it the step's tensors


def measure(model, optimizer, config, mode):
    training.apply_recompute(model, mode)  # the compiled graph guards on it: a new mode compiles anew
    train_model = training.compile_for_training(model, None) if cuda else model
    x, y = random_batch(config, args.device_batch_size)
    for _ in range(args.warmup):
        step(train_model, optimizer, x, y)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(train_model, optimizer, x, y)
        sync()
        times.append(time.perf_counter() - t0)
    row = {"tok/s": args.device_batch_size * config.sequence_len / statistics.median(times)}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        static = torch.cuda.memory_allocated() + sum(p.numel() * p.element_size() for p in model.parameters())
        before = torch.cuda.memory_allocated()
        loss = train_model(x, y)
        sync()
        row["act"] = torch.cuda.memory_allocated() - before
        loss.backward()
        optimizer.zero_grad(set_to_none=True)
        del loss
        row["peak"], row["peak-static"] = peak, peak - static
        free_memory()
        largest = None
        for b in sorted(int(s) for s in args.batches.split(",")):
            ok = fits(model, optimizer, config, b)
            optimizer.zero_grad(set_to_none=True)  # gradients of a step that ran out of memory midway
            free_memory()
            if not ok:
                break
            largest = b
        row["max batch"] = largest
    return row


def fmt(row, ref):
    gib = lambda k: f"{row[k] / GiB:.1f}" if k in row else "n/a"
    ratio = lambda k, inverse: (f" ({(ref[k] / row[k] if inverse else row[k] / ref[k]):.2f}x)" if ref and k in row else "")
    largest = row.get("max batch", "n/a")
    cols = [f"{row['tok/s']:,.0f}{ratio('tok/s', False)}", gib("peak"), gib("act") + ratio("act", True),
            gib("peak-static"), "none fit" if largest is None else str(largest)]
    return cols


header = ["depth", "mode", "tok/s (vs none)", "peak GiB", "act GiB (cut vs none)", "peak-static GiB", "max batch"]
table = []
for depth in (int(d) for d in args.depths.split(",")):
    config = config_for_depth(depth, sequence_len=args.seq_len, window_pattern=args.window_pattern)
    model, _ = training.build_model_for_training(config, device, dtype, layout)
    training.tune_weight_gradients(model, layout, args.device_batch_size * args.seq_len, dtype)
    optimizer = training.make_optimizer(model, layout, dtype, 0.3, 0.008, 0.02, 0.5, 0.28, compile=cuda)
    print(f"d{depth}: {sum(p.numel() for p in model.parameters()):,} parameters; attention: "
          f"{kernels.prepare_attention(config, window_sizes(config), device, dtype)}", flush=True)
    ref = None
    for mode in args.modes.split(","):
        row = measure(model, optimizer, config, mode)
        ref = ref or (row if mode == "none" else None)
        table.append([f"d{depth}", mode] + fmt(row, ref if mode != "none" else None))
        print("  " + " | ".join(table[-1]), flush=True)
    del model, optimizer
    torch._dynamo.reset()
    free_memory()

widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
print("-|-".join("-" * w for w in widths))
for r in table:
    print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
