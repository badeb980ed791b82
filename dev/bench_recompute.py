"""
Activation recompute (--recompute) on one GPU: for each depth and mode, what base_train builds and steps
(nanochat.training.setup at base_train's default learning rates, recipe.LearningRates(): the model, split-K
choice, optimizer and compiled step) on random tokens, one micro-batch per step (no gradient accumulation),
and a table of:
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
The ratios answer: which mode cuts activation memory by how much, for how much time. Each mode is a fresh
setup (as a run with that --recompute flag), so split-K is chosen again for each.

    python -m dev.bench_recompute                                  # d20 and d26, every mode
    python -m dev.bench_recompute --depths 26 --modes none,block --device-batch-size 8
    python -m dev.bench_recompute --depths 2 --seq-len 64 --device-batch-size 2 --batches 1,2 --steps 2   # CPU smoke

Needs a CUDA GPU for the figures; on a CPU the model runs uncompiled and the memory columns are n/a (no batch
search). No data or tokenizer: the tokens are random.
"""

import gc
import time
import statistics
import dataclasses

import torch
import torch._dynamo

from dev import runs
from nanochat.common import get_compute_dtype, device_name
from nanochat.distributed import compute_init
from nanochat.gpt import RECOMPUTE_MODES
from nanochat.recipe import config_for_depth
from nanochat import training
from nanochat.recipe import Setting, LearningRates

GiB = 2 ** 30
IT = 100  # the schedule's step for every step timed: past the warm-up, where the LR is flat


def random_batch(config, batch_size, device):
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.sequence_len + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


def free_memory(cuda):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def fits(trainer, schedule, config, batch_size, device):
    """Whether a full step at this batch size runs without running out of memory."""
    try:
        trainer.step([random_batch(config, batch_size, device)], schedule, IT)
        torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False  # leaving the except clause drops the traceback, and with it the step's tensors


def measure(trainer, schedule, config, args, device):
    cuda = device.type == "cuda"
    x, y = random_batch(config, args.device_batch_size, device)
    for _ in range(args.warmup):
        trainer.step([(x, y)], schedule, IT)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.step([(x, y)], schedule, IT)
        sync()
        times.append(time.perf_counter() - t0)
    row = {"tok/s": args.device_batch_size * config.sequence_len / statistics.median(times)}
    if cuda:
        model, optimizer = trainer.model, trainer.optimizer
        peak = torch.cuda.max_memory_allocated()
        static = torch.cuda.memory_allocated() + sum(p.numel() * p.element_size() for p in model.parameters())
        before = torch.cuda.memory_allocated()
        loss = trainer.train_model(x, y)
        sync()
        row["act"] = torch.cuda.memory_allocated() - before
        loss.backward()
        optimizer.zero_grad(set_to_none=True)
        del loss
        row["peak"], row["peak-static"] = peak, peak - static
        free_memory(cuda)
        eager = dataclasses.replace(trainer, train_model=model)  # the search steps the uncompiled model
        largest = None
        for b in sorted(int(s) for s in args.batches.split(",")):
            ok = fits(eager, schedule, config, b, device)
            optimizer.zero_grad(set_to_none=True)  # gradients of a step that ran out of memory midway
            free_memory(cuda)
            if not ok:
                break
            largest = b
        row["max batch"] = largest
    return row


def fmt(row, ref):
    gib = lambda k: f"{row[k] / GiB:.1f}" if k in row else "n/a"
    ratio = lambda k, inverse: (f" ({(ref[k] / row[k] if inverse else row[k] / ref[k]):.2f}x)" if ref and k in row else "")
    largest = row.get("max batch", "n/a")
    return [f"{row['tok/s']:,.0f}{ratio('tok/s', False)}", gib("peak"), gib("act") + ratio("act", True),
            gib("peak-static"), "none fit" if largest is None else str(largest)]


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    parser.add_argument("--depths", type=str, default="20,26", help="comma-separated depths")
    parser.add_argument("--modes", type=str, default=",".join(RECOMPUTE_MODES), help="comma-separated --recompute modes")
    parser.add_argument("--device-batch-size", type=int, default=16, help="sequences per step for the timings")
    parser.add_argument("--batches", type=str, default="8,16,32,48,64", help="device batch sizes the search tries")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length")
    parser.add_argument("--window-pattern", type=str, default="SSSL", help="as base_train's")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (the first compiles)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in RECOMPUTE_MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: use some of {', '.join(RECOMPUTE_MODES)}")

    layout, device = compute_init()
    cuda = device.type == "cuda"
    dtype = get_compute_dtype(device.type)
    lrs = LearningRates()
    schedule = training.Schedule(num_iterations=1000, weight_decay=lrs.weight_decay)
    print(f"device {device_name(device.type)}, dtype {dtype}, compiled {cuda}; seq len {args.seq_len}, "
          f"window pattern {args.window_pattern}, timed at device batch {args.device_batch_size}", flush=True)

    header = ["depth", "mode", "tok/s (vs none)", "peak GiB", "act GiB (cut vs none)", "peak-static GiB", "max batch"]
    table = []
    for depth in (int(d) for d in args.depths.split(",")):
        config = config_for_depth(depth, sequence_len=args.seq_len, window_pattern=args.window_pattern)
        ref = None
        for mode in modes:
            setting = Setting(device_batch=args.device_batch_size, total_batch=args.device_batch_size * args.seq_len,
                              recompute=mode)
            trainer = training.setup(config, setting, layout, device, dtype, lrs, compile="inductor" if cuda else None)
            if mode == modes[0]:
                print(f"d{depth}: {sum(p.numel() for p in trainer.model.parameters()):,} parameters; attention: "
                      f"{trainer.attention}", flush=True)
            row = measure(trainer, schedule, config, args, device)
            ref = ref or (row if mode == "none" else None)
            table.append([f"d{depth}", mode] + fmt(row, ref if mode != "none" else None))
            print("  " + " | ".join(table[-1]), flush=True)
            del trainer
            torch._dynamo.reset()  # each mode's model is new: its graphs would count against the recompile limit
            free_memory(cuda)

    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in table:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
