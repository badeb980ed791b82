"""
Bits per byte, a tokenizer-independent loss: the cross-entropy (nats) summed over the tokens that stand for
bytes, over ln 2 * their total bytes (special tokens and ignored targets count neither). The sums are reduced
over the DP group and, with pipeline parallelism, sent from the last stage (which holds the losses) to the others.
"""

import math

import torch
import torch.distributed as dist

from nanochat.common import Progress, print0
from nanochat.dataset import DataError
from nanochat.distributed import agreed
from nanochat.signals import stop_point

_WRAPPED = set()  # the labels whose split ran out (said once a process)


def default_eval_tokens(device_type):
    """20 batches of 2^19 tokens on a GPU (seconds); on a CPU that would take hours, so 2^18 tokens."""
    return 20 * 524288 if device_type == "cuda" else 2 ** 18


@torch.no_grad()
def evaluate_bpb(loss_fn, batches, steps, token_bytes, layout=None, label="bpb"):
    """loss_fn(x, y) -> per-token losses (shaped like y), or None on a pipeline stage without the head;
    batches yields (x, y, ...); token_bytes[id] = bytes of the token (0 = special). Raises signals.Interrupted
    on a stop request, and DataError on every rank when one cannot read its batch (none hangs in a collective)."""
    device = token_bytes.device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # nats, bytes
    agree_on = device if layout is not None and layout.world_size > 1 else None  # None: this process alone
    progress = Progress(label, steps)
    for i in range(steps):
        stop_point(agree_on)
        progress.update(i)
        x, y = agreed(lambda: next(batches)[:2], DataError, agree_on)
        losses = loss_fn(x, y)
        if losses is None:
            continue
        y = y.reshape(-1)
        nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
        sums += torch.stack([(losses.reshape(-1).double() * (nbytes > 0)).sum(), nbytes.sum().double()])
    if layout is not None and layout.dp_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=layout.dp_group)
    if layout is not None and layout.pp_size > 1:
        dist.broadcast(sums, src=layout.peer(pp=layout.pp_size - 1), group=layout.pp_group)
    if getattr(batches, "stats", {}).get("epoch", 1) > 1 and label not in _WRAPPED:  # a DataLoader past its split's end
        _WRAPPED.add(label)
        print0(f"NOTICE: {label}: the split holds fewer than the {steps} batches asked for: some of its documents "
               f"were scored more than once (ask for fewer tokens, or give the split more data)")
    nats, nbytes = sums.tolist()
    return nats / (math.log(2) * nbytes) if nbytes else float("inf")
