"""
Tensor parallelism (Megatron-style), as small explicit pieces.

A sharded parameter carries three attributes: `tp_dim` (the dim it is split along), `tp_group` and
`tp_size`. Parameters without them are whole on every rank. The optimizer and the checkpoint code use
the helpers at the top of this file to go between shards and full tensors; with TP=1 they are identities.
"""

import torch
import torch.distributed as dist


# -----------------------------------------------------------------------------
# Shards <-> full tensors (used by the optimizer and checkpoints)


def is_sharded(p):
    return getattr(p, "tp_dim", None) is not None


def full_shape(p):
    """The shape of the whole parameter (the shard's shape scaled back up along tp_dim)."""
    shape = list(p.shape)
    if is_sharded(p):
        shape[p.tp_dim] *= p.tp_size
    return tuple(shape)


def gather_full(t, p):
    """All-gather `t`, shaped like p's shard, into the full tensor (along p.tp_dim)."""
    if not is_sharded(p):
        return t
    parts = [torch.empty_like(t) for _ in range(p.tp_size)]
    dist.all_gather(parts, t.contiguous(), group=p.tp_group)
    return torch.cat(parts, dim=p.tp_dim)


def gather_full_grad(p):
    return gather_full(p.grad, p)


def local_shard(t, p):
    """This rank's slice of a full tensor `t` shaped like the whole of p."""
    if not is_sharded(p):
        return t
    rank = dist.get_rank(p.tp_group)
    return t.chunk(p.tp_size, dim=p.tp_dim)[rank]


def reduce_partial_grad(p):
    """Under sequence parallelism a replicated parameter used on this rank's slice of the sequence
    gets only part of its gradient: sum the parts over the TP group."""
    if getattr(p, "tp_partial_grad", False):
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=p.tp_group)
