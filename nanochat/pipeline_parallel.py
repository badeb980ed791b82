"""
Pipeline parallelism: the blocks cut into contiguous chunks, dealt out to the PP ranks; a step's micro-batches flow
through them, activations forward and gradients backward, in explicit p2p messages.

Collectives, over this pipeline's ranks (the PP group, or the ranks before and after this one in the ring):
  isend / irecv        per micro-batch and chunk boundary: activations to the next chunk's rank, their gradients
                       back, each message one batch_isend_irecv on the group of the two ranks (one NCCL stream per
                       pair of neighbours), posted in the order of message_order
  broadcast            the step's loss, from the last chunk's rank to the others

Chunks. The split into p x V chunks (V = --pp-virtual) minimizes the costliest one (block_costs; the head costs as
much as several blocks at small depth); chunk c runs on rank c mod p, round-robin as in Megatron-LM (rank 0 holds the
embeddings, rank p-1 the head). A rank drops the modules it does not run: its state_dict holds its own parameters
under their global names (checkpoints stay layout-free). A forward message is gpt.Residual (x, x0, and x_mid once
past the middle) and the token ids (value embeddings and L3 look them up); a backward one, the Residual's gradients.

Schedules: pipeline_schedules.py. Evaluation: val bpb runs through the chunks (forward_loss); CORE and sampling run
on a whole copy of the model (checkpoint_manager.whole_model_copy says why).
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.distributed as dist

from nanochat.gpt import Residual
from nanochat.distributed import wait_for
from nanochat.moe import inactive_expert_params
from nanochat.l3 import plan_lookups
from nanochat.pipeline_schedules import stage_actions, idle_formula, input_of, message_order, action_name


def block_costs(model):
    """Training FLOPs per token of each block (6 x matmuls + attention + a following L3 layer) and of the lm_head."""
    costs = []
    for i, block in enumerate(model.blocks):
        matmul = sum(p.numel() for n, p in block.named_parameters() if p.ndim == 2 and "value_embed" not in n) \
            - inactive_expert_params(block)  # MoE: the experts a token runs through
        l3 = model.l3[str(i)].estimate_flops() if str(i) in model.l3 else 0
        costs.append(6 * matmul + model.attention_flops(i) + l3)
    return costs, 6 * model.lm_head.weight.numel()


def split_stages(costs, head_cost, num_stages):
    """[start, end) block ranges minimizing the costliest stage (the last pays for the head too): DP over cut points."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0))
    # best[k][i]: minimal max-cost splitting blocks[:i] into k stages (the head not yet counted)
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            head = head_cost if (k == num_stages and i == n) else 0
            best[k][i], cut[k][i] = min((max(best[k - 1][j], prefix[i] - prefix[j] + head), j) for j in range(k - 1, i))
    cuts = [n]  # the cut points, walked back from the end
    for k in range(num_stages, 0, -1):
        cuts.insert(0, cut[k][cuts[0]])
    return list(zip(cuts, cuts[1:]))


def chunk_costs(costs, head_cost, bounds):
    """Each chunk's training FLOPs per token: its blocks', and the head's in the last (message_order orders by them)."""
    return [sum(costs[a:b]) + (head_cost if c == len(bounds) - 1 else 0) for c, (a, b) in enumerate(bounds)]


# --- the pipeline ----------------------------------------------------------------------------------------

@dataclass
class Chunk:
    start: int  # blocks [start, end)
    end: int
    first: bool  # holds the embeddings
    last: bool  # holds the head and the loss
    receives_mid: bool  # x_mid exists on the way in (the backout block lies in an earlier chunk)
    sends_mid: bool


class Pipeline:
    """This rank's chunks and the schedule that drives them, for a checked recipe.Setting (pp_schedule, pp_virtual,
    device_batch; under sequence_parallel the residual stream, and so each message, holds this rank's tokens only)."""

    def __init__(self, model, layout, setting, num_microbatches, costs=None):
        """costs: block_costs of the whole model (before TP cuts it); None: of `model`."""
        p = layout.pp_size
        self.model, self.layout, self.micro_batch_size = model, layout, setting.device_batch
        self.num_stages, self.stage, self.num_microbatches = p, layout.pp_rank, num_microbatches
        self.virtual, self.schedule, self.num_chunks = setting.pp_virtual, setting.pp_schedule, p * setting.pp_virtual
        costs, head_cost = costs or block_costs(model)
        self.chunk_bounds = split_stages(costs, head_cost, self.num_chunks)
        self.chunk_costs = chunk_costs(costs, head_cost, self.chunk_bounds)
        back = model.backout_layer
        self.chunks = {c: Chunk(a, b, c == 0, c == self.num_chunks - 1, back < a, back < b)
                       for c, (a, b) in enumerate(self.chunk_bounds) if c % p == self.stage}
        self.blocks = [i for ch in self.chunks.values() for i in range(ch.start, ch.end)]
        # drop the modules this rank does not run (blocks become empty Identities: names keep the global indices)
        for i in sorted(set(range(len(model.blocks))) - set(self.blocks)):
            model.blocks[i] = nn.Identity()
            if str(i) in model.l3:
                del model.l3[str(i)]
        self.chunk_l3 = {c: [layer for k, layer in model.l3.items() if ch.start <= int(k) < ch.end]
                         for c, ch in self.chunks.items()}  # each chunk's L3 layers
        if self.stage != 0:
            model.wte = model.smear_gate = model.smear_lambda = None
        if self.stage != p - 1:
            model.lm_head = model.backout_lambda = None
        # the residual stream holds 1/tp of the tokens under sequence parallelism, and 1/cp of each sequence under CP
        self.seq_shards = (layout.tp_size if setting.sequence_parallel else 1) * layout.cp_size
        self.device = next(model.parameters()).device
        self.prev_rank, self.next_rank = (layout.peer(pp=(self.stage + d) % p) for d in (-1, 1))
        self.pair_group = {self.prev_rank: layout.pp_prev_group, self.next_rank: layout.pp_next_group}
        all_actions = [self.actions(r) for r in range(p)]
        self.program = message_order(all_actions, self.stage, self.chunk_costs)
        self._sent = {action for step, action in self.program if step == "send"}
        # the optimizer's overlapped reduction is armed for a chunk's parameters before its last backward (under
        # interleaving the chunks' last backwards come at different times: armed at the rank's last alone, the other
        # chunks' reductions waited for the step)
        backwards = [a for a in all_actions[self.stage] if a[0] == "B"]
        self.last_backward = {[a for a in backwards if a[2] == c][-1]: c for c in self.chunks}
        self.chunk_parameters = None  # at the first step: setup places the experts (EP) after this

    def _chunk_parameters(self):
        """{chunk: the parameters its backward makes gradients for}: its blocks' and L3 layers', and those outside
        them (the embeddings on the first stage, the head on the last) with the first or last chunk."""
        owner = {f"{kind}.{i}": c for c, ch in self.chunks.items() for i in range(ch.start, ch.end)
                 for kind in ("blocks", "l3")}
        outer = next((c for c, ch in self.chunks.items() if ch.first or ch.last), None)
        params = {c: [] for c in self.chunks}
        for name, p in self.model.named_parameters():
            params[owner.get(".".join(name.split(".")[:2]), outer)].append(p)
        return params

    # --- the schedule: what train_step runs and schedule_text prints ----------------------

    def describe(self):
        p, m = self.num_stages, self.num_microbatches
        per_rank = {r: [self.chunk_bounds[c] for c in range(r, self.num_chunks, p)] for r in range(p)}
        return (f"blocks [start, end) per rank: {per_rank}; estimated cost per chunk (GFLOP/token): "
                f"{[round(c / 1e9, 3) for c in self.chunk_costs]}; idle at equal F/B times "
                f"{idle_formula(self.schedule, p, m, self.virtual):.3f}")

    def actions(self, rank):
        return stage_actions(self.schedule, self.num_stages, self.num_microbatches, rank, self.virtual)

    def schedule_text(self):
        """--pp-print-schedule: every rank's action list (F3 = forward of micro-batch 3, B3 its backward; F3c5: of
        chunk 5 under interleaved), in the order train_step runs it. dev/pipeline_sim.py replays these lists in time."""
        p, m, V = self.num_stages, self.num_microbatches, self.virtual
        lines = [f"pipeline schedule ({self.schedule}, p={p}, m={m}" + (f", V={V}" if V > 1 else "") +
                 f"): {self.describe()}"]
        return "\n".join(lines + [f"stage {r}: " + " ".join(action_name(a, V) for a in self.actions(r))
                                   for r in range(p)])

    # --- messages: forward [x, x0, (x_mid), idx], backward [dx, dx0, (dx_mid)] ---------------

    def _empty(self):
        """A buffer for x, x0, x_mid or their gradients: (B, T / seq_shards, D)."""
        B, T, D = self.micro_batch_size, self.model.config.sequence_len, self.model.config.n_embd
        return torch.empty((B, T // self.seq_shards, D), dtype=self.model.compute_dtype, device=self.device)

    def _recv(self, action):
        """Post the receive of another rank's output `action` (the input of one of this rank's actions)."""
        kind, i, c = action
        if kind == "F":  # into chunk c + 1, which this rank holds
            mid = self.chunks[c + 1].receives_mid
            h = Residual(self._empty(), self._empty(), self._empty() if mid else None)
            idx = h.x.new_empty((self.micro_batch_size, self.model.config.sequence_len), dtype=torch.long)
            tensors, filled, peer = carried(h, mid) + [idx], (h, idx), self.prev_rank
        else:  # the gradients of chunk c - 1's outputs
            tensors = [self._empty() for _ in range(3 if self.chunks[c - 1].sends_mid else 2)]
            filled, peer = tensors, self.next_rank
        return dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer, self.pair_group[peer]) for t in tensors]), filled

    def _send(self, action, output):
        """Post the send of an action's output: a forward's (Residual, idx), a backward's input gradients."""
        kind, i, c = action
        if kind == "F":
            h, idx = output
            tensors, peer = carried(h, self.chunks[c].sends_mid) + [idx], self.next_rank
            tensors = [t.detach().contiguous() for t in tensors]
        else:
            tensors, peer = [g.contiguous() for g in output], self.prev_rank
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, self.pair_group[peer]) for t in tensors])

    # --- compute on one micro-batch of one chunk ------------------------------------------

    def forward(self, i, c, inputs):
        """Micro-batch i through chunk c (chunk 0 embeds the ids): (Residual, idx), or the last chunk's loss."""
        chunk = self.chunks[c]
        received = self._saved_inputs[i, c] = [] if chunk.first else carried(inputs[0], chunk.receives_mid)
        if self.chunk_l3[c] and self.xs[i] is None:  # no ids read here: plan the lookups from those received (l3.py)
            plan_lookups(self.chunk_l3[c], self.model.sequence.local(inputs[1]))
        for t in received:
            t.requires_grad_(True)
        h, idx = self._through(chunk, self.xs[i], inputs)
        out = (h, idx)
        if chunk.last:
            loss = self.model.head(h, self.ys[i])
            self.total_loss += loss.detach()
            out = loss / self.num_microbatches
        self._saved_outputs[i, c] = out
        return out

    def _through(self, chunk, x, inputs):
        """(Residual, idx) after chunk's blocks, from the ids x (chunk 0) or the (Residual, idx) received."""
        h, idx = (self.model.embed(x), x) if chunk.first else inputs
        return self.model.run_blocks(h, idx, chunk.start, chunk.end), idx

    def backward(self, i, c, grads):
        """Micro-batch i back through chunk c from its outputs' gradients (the last chunk: its loss); returns its
        inputs' gradients."""
        chunk, out, received = self.chunks[c], self._saved_outputs.pop((i, c)), self._saved_inputs.pop((i, c))
        outputs, grads = ([out], None) if chunk.last else (carried(out[0], chunk.sends_mid), grads)
        torch.autograd.backward(outputs, grads)
        return None if chunk.first else [t.grad for t in received]

    def train_step(self, batches, before_last_backward=None):
        """Micro-batches [(x, y), ...] (x on rank 0, y on the last, else None) in actions(rank)'s order, gradients into
        .grad; the mean loss on every rank. before_last_backward(params) runs before each chunk's last backward."""
        self.device = next(self.model.parameters()).device
        self.xs, self.ys = [b[0] for b in batches], [b[1] for b in batches]
        self._saved_inputs, self._saved_outputs = {}, {}
        self.total_loss = torch.zeros((), device=self.device)
        # outputs: of the actions whose output goes to another rank; sends: {n: (peer, its works)}, the n-th send
        # posted, each work holding its tensors; received: {action: (sends posted before it, peer, works, buffers)}
        received, outputs, sends, count = {}, {}, {}, 0
        self.peak_in_flight = 0  # micro-batch chunks whose activations are alive at once (peak_in_flight())
        for step, action in self.program:
            if step == "run":
                kind, i, c = action
                dep = input_of(action, self.num_chunks)
                inputs = None
                if dep in received:
                    posted, peer, works, buffers = received.pop(dep)
                    inputs = wait_for(works, buffers)
                    # the sends to that peer posted before this receive ran before it on the pair's stream (and the
                    # peer has taken them): their tensors are freed now (those after a peer's last message: at the end)
                    for n in [n for n, (to, _) in sends.items() if n < posted and to == peer]:
                        wait_for(sends.pop(n)[1])
                if action in self.last_backward and before_last_backward is not None:
                    self.chunk_parameters = self.chunk_parameters or self._chunk_parameters()
                    before_last_backward(self.chunk_parameters[self.last_backward[action]])
                output = self.forward(i, c, inputs) if kind == "F" else self.backward(i, c, inputs)
                if action in self._sent:
                    outputs[action] = output
                if kind == "F":
                    self.peak_in_flight = max(self.peak_in_flight, len(self._saved_outputs))
                continue
            # activations go to the next rank and gradients to the previous one
            peer = self.next_rank if (action[0] == "F") == (step == "send") else self.prev_rank
            if step == "recv":
                received[action] = (count, peer, *self._recv(action))
            else:
                sends[count] = (peer, self._send(action, outputs.pop(action)))
                count += 1
        wait_for([work for _, works in sends.values() for work in works])
        assert not self._saved_outputs, "the schedule left micro-batches unfinished"
        L, loss = self.layout, (self.total_loss / self.num_microbatches).detach()
        # the loss lives on the last rank: send it to every rank of this pipeline
        dist.broadcast(loss, src=L.peer(pp=self.num_stages - 1), group=L.pp_group)
        return loss

    # --- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def forward_loss(self, x, y):
        """Per-token losses of one batch through all chunks (forward only); None except on the last rank. The batch
        has the training micro-batch's shape: the receives are sized by it."""
        if x is not None and tuple(x.shape) != (self.micro_batch_size, self.model.config.sequence_len):
            raise ValueError(f"pipeline evaluation takes batches of the training micro-batch's shape "
                             f"{(self.micro_batch_size, self.model.config.sequence_len)}, not {tuple(x.shape)}")
        self.device = next(self.model.parameters()).device
        sends, losses = [], None
        for c, chunk in self.chunks.items():
            h, idx = self._through(chunk, x, None if chunk.first else wait_for(*self._recv(("F", None, c - 1))))
            if chunk.last:
                losses = self.model.head(h, y, loss_reduction="none")
            else:
                sends += self._send(("F", None, c), (h, idx))
        wait_for(sends)
        return losses


def carried(h, with_mid):
    """What of a Residual crosses a chunk boundary: x, x0, and x_mid once past the middle."""
    return [h.x, h.x0] + ([h.x_mid] if with_mid else [])
