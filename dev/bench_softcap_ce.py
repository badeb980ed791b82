"""
The soft-capped cross-entropy on one GPU: the Triton kernels (softcap_ce.py) against what
torch.compile makes of the same math, at the training shape (32 x 2048 tokens, vocab 32768, bf16
logits). Checks them against float64 on a slice of rows, then times forward + backward with CUDA
events (median of repeats), and prints the HBM bandwidth the
kernels reach (one read of the logits forward; one read and one write backward).

    python -m dev.bench_softcap_ce [--tokens 65536] [--vocab 32768]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from nanochat.softcap_ce import kernel_loss, reference_loss

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=65536)
parser.add_argument("--vocab", type=int, default=32768)
parser.add_argument("--repeats", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)
N, V = args.tokens, args.vocab
raw = (torch.randn(N, V, device="cuda") * 4).bfloat16()
targets = torch.randint(0, V, (N,), device="cuda")
targets[::97] = -1

# --- correctness on the first rows, against float64 ---
rows = 512
x = raw[:rows].double().requires_grad_()
F.cross_entropy(15 * torch.tanh(x / 15), targets[:rows], ignore_index=-1).backward()
mine = raw[:rows].clone().requires_grad_()
loss = kernel_loss(mine, targets[:rows])
loss.backward()
ref_loss = F.cross_entropy(15 * torch.tanh(raw[:rows].double() / 15), targets[:rows], ignore_index=-1)
print(f"vs float64 on {rows} rows: loss error {abs(loss.item() - ref_loss.item()):.2e}, "
      f"gradient relative error {((mine.grad.double() - x.grad).norm() / x.grad.norm()).item():.2e}")


def timed(fn):
    """Median ms of fn() (forward + backward) over the repeats, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step(loss_fn):
    def run():
        r = raw.detach().requires_grad_()
        loss_fn(r, targets).backward()
    return run


compiled_ref = torch.compile(reference_loss, dynamic=False)
results = {"torch.compile of the PyTorch math": timed(step(compiled_ref)),
           "Triton kernels": timed(step(kernel_loss))}
gb = 3 * N * V * raw.element_size() / 1e9  # forward read + backward read and write
for name, ms in results.items():
    print(f"{name:<40} {ms:7.2f} ms forward+backward  ({gb / ms:.2f} TB/s over the minimal {gb:.1f} GB)")
