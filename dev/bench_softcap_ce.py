"""
The training loss on one GPU at a training shape (32 x 2048 tokens, d 768, vocab 32768, bf16):
kernels/softcap_ce.kernel_head_loss (the lm_head matmul + the Triton kernel as one autograd function) against what
torch.compile makes of the same math (F.linear, soft-cap, cross-entropy). Checks the Triton path against
float64 on a slice of rows, then times with CUDA events (median of repeats):
- the whole head, forward + backward, both ways, and its three matmuls alone;
- the kernel alone, loss only (one read of the logits) and with the gradient (a read and a write).

    python -m dev.bench_softcap_ce [--tokens 65536] [--dim 768] [--vocab 32768]
"""

import argparse

import torch
import torch.nn.functional as F

from nanochat.common import cuda_time_ms
from nanochat.kernels.softcap_ce import kernel_head_loss as head_loss, reference_loss, _row_losses

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=65536)
parser.add_argument("--dim", type=int, default=768)
parser.add_argument("--vocab", type=int, default=32768)
parser.add_argument("--repeats", type=int, default=20)
args = parser.parse_args()

torch.manual_seed(0)
N, D, V = args.tokens, args.dim, args.vocab
x = torch.randn(N, D, device="cuda").bfloat16()
w = (torch.randn(V, D, device="cuda") * 4 / D ** 0.5).bfloat16()  # logits with a spread of ~4
targets = torch.randint(0, V, (N,), device="cuda")
targets[::97] = -1

# --- correctness on the first rows, against float64 of the same (bf16-rounded) logits ---
rows = 512
xs, ws = x[:rows].clone().requires_grad_(), w.clone().requires_grad_()
head_loss(xs, ws, targets[:rows]).backward()
raw = (x[:rows] @ w.t()).double().requires_grad_()
ref = F.cross_entropy(15 * torch.tanh(raw / 15), targets[:rows], ignore_index=-1)
ref.backward()
ref_gx = raw.grad @ w.double()
mine = head_loss(x[:rows], w, targets[:rows])
print(f"vs float64 on {rows} rows: loss error {abs(mine.item() - ref.item()):.2e}, "
      f"x gradient relative error {((xs.grad.double() - ref_gx).norm() / ref_gx.norm()).item():.2e}")


def head_step(loss_fn):
    def run():
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        loss_fn(xr, wr, targets).backward()
    return run


def matmuls_only():
    logits = x @ w.t()
    logits @ w, logits.t() @ x


compiled_ref = torch.compile(lambda a, b, t: reference_loss(F.linear(a, b), t), dynamic=False)
logits = x @ w.t()
results = {
    "head: torch.compile of the PyTorch math": cuda_time_ms(head_step(compiled_ref), args.repeats),
    "head: head_loss (matmul + Triton kernel)": cuda_time_ms(head_step(head_loss), args.repeats),
    "head: its three matmuls alone": cuda_time_ms(matmuls_only, args.repeats),
    "kernel: loss only": cuda_time_ms(lambda: _row_losses(logits, targets, write_grad=False), args.repeats),
    "kernel: loss and gradient": cuda_time_ms(lambda: _row_losses(logits, targets, write_grad=True), args.repeats),
}
gb = N * V * logits.element_size() / 1e9
for name, ms in results.items():
    passes = {"kernel: loss only": 1, "kernel: loss and gradient": 2}.get(name)
    bw = f"  ({passes * gb / ms:.2f} TB/s over {passes} pass{'es' if passes > 1 else ''} of {gb:.1f} GB)" if passes else ""
    print(f"{name:<44} {ms:7.2f} ms{bw}")
