"""
Expert parallelism (--ep N): each MoE layer's experts spread over N data-parallel ranks (an EP group: N consecutive
DP ranks), E / N on each, the rest of the model replicated as under plain DP. A rank routes its own tokens, sends each
(token, expert) row to the rank holding that expert, runs the rows it receives through its experts, and sends the
outputs back, where they are weighted and summed as without EP (moe.mixture).

Collectives, over the EP group:
  all_to_all_single   per MoE layer and micro-batch: the rows per expert (E counts each way); the rows to their
                      experts' ranks; the outputs back. The backward sends the gradients the opposite ways.
The experts' gradients are reduced by a data_parallel.DataParallel of their own (training.setup), over the expert-DP
group: the ranks that hold the same experts, one per EP group. A rank's expert gradient holds the rows of its whole
EP group, so the sum over that group holds every rank's; the optimizer divides it by the DP size, as it divides the
replicated weights' sum over all DP ranks.

The exchange needs the row counts on the host (its split sizes): one host sync per MoE layer and micro-batch, and it
runs outside torch.compile's graphs. Checkpoints: the first EP group writes one file per EP rank (checkpoint_manager
merges them by name), so they stay layout-free.
"""

import torch
import torch.distributed as dist

from nanochat.moe import moe_modules


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group` (send[r] of them to rank r, recv[r] from it); the backward sends them back."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.size(1))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), grad.size(1))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertParallel:
    def __init__(self, layout, num_experts):
        self.group, self.size = layout.ep_group, layout.ep_size
        self.local = num_experts // self.size  # experts per rank: rank r holds r * local .. (r + 1) * local - 1

    @torch.compiler.disable  # host-side split sizes
    def run(self, experts, rows, counts):
        """experts(rows, counts) on this rank's experts, for rows sorted by (global) expert with counts (E,) per
        expert: the rows out to their experts' ranks, back in the same order."""
        N, local = self.size, self.local
        counts = counts.view(N, local)
        received = torch.empty_like(counts)  # received[s, e]: rows from rank s for my expert e
        dist.all_to_all_single(received, counts, group=self.group)
        send, recv = torch.stack([counts.sum(1), received.sum(1)]).tolist()  # one host sync
        inbound = _AllToAll.apply(rows, send, recv, self.group)  # by source rank, then expert
        # reorder by expert, then source: where each (expert, source) run of rows sits in `inbound`
        runs = received.t().reshape(-1)
        starts = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).view(N, local).t().reshape(-1)
        run_of = torch.repeat_interleave(torch.arange(N * local, device=rows.device), runs, output_size=sum(recv))
        within = torch.arange(sum(recv), device=rows.device) - (torch.cumsum(runs, 0) - runs)[run_of]
        by_expert = starts[run_of] + within
        # a rank no row comes to runs no expert (a grouped matmul of no rows is not taken everywhere), but its empty
        # rows stay in the graph: its backward's exchanges must meet its peers'
        out = experts(inbound[by_expert], received.sum(0)) if sum(recv) else inbound[by_expert]
        outbound = torch.empty_like(out).index_copy(0, by_expert, out)  # back by source rank
        return _AllToAll.apply(outbound, recv, send, self.group)


def is_expert(name):
    """Whether a tensor of a checkpoint (by name: weights or optimizer state) is a routed expert's, which EP ranks
    hold apart (moe.MoE's fc / proj ParameterDicts)."""
    return ".mlp.fc." in name or ".mlp.proj." in name


def place_experts(model, layout):
    """Keep this rank's experts in each MoE layer (its EP rank's share, by global index) and hand it the exchange."""
    for m in moe_modules(model):
        m.ep = ExpertParallel(layout, m.num_experts)
        mine = range(layout.ep_rank * m.ep.local, (layout.ep_rank + 1) * m.ep.local)
        for d in (m.fc, m.proj):
            for key in [k for k in d.keys() if int(k) not in mine]:
                del d[key]
