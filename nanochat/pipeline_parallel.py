"""
Pipeline parallelism: the blocks are cut into contiguous stages, one per PP rank; the micro-batches of a step
flow through them, activations forward and gradients backward, in explicit p2p messages.

Collectives, over this pipeline's ranks (the PP group, or the previous and next stage):
  isend / irecv        per micro-batch: activations to the next stage, their gradients back, as one
                       batch_isend_irecv (with NCCL, a stage that sends to and receives from one neighbour in
                       one phase must post both at once, or the two kernels can wait on each other)
  broadcast            the step's loss, from the last stage to the others
  all_gather_object,   a whole copy of the model for CORE and sampling (whole_model_copy): what tensors each
  broadcast            stage holds, then each of them from its stage

Stages. Block i costs its matmul and attention FLOPs per token; stage 0 also holds the embeddings, the last
stage the head and loss (as much as several blocks at small depth). The split minimizes the most expensive
stage. Modules a stage does not own are removed, so its state_dict holds only its own parameters, under their
global names (checkpoints stay layout-free). Across a stage boundary go gpt.Residual (x, x0, and x_mid once past
the middle) and the token ids (value embeddings and L3 look them up); back go the gradients of the Residual.

Schedules, over the m >= p micro-batches of a step, are lists of actions per stage (Pipeline.actions: what
train_step runs and --pp-print-schedule prints):
  GPipe: all m forwards, then all m backwards; keeps m micro-batches of activations alive.
  1F1B:  warm-up (p - s - 1 forwards on stage s), steady state (one forward, one backward), cool-down
         (the remaining backwards); keeps at most p - s micro-batches alive, same bubble.
Bubble fraction for both: (p - 1) / (m + p - 1).

Evaluation: val bpb runs through the stages (forward_loss); CORE and sampling take sequences of any length,
which neither fixed-shape messages nor sequence parallelism's equal split can take, so they run on a whole copy
of the model (whole_model_copy).
"""

import itertools

import torch
import torch.nn as nn
import torch.distributed as dist

from nanochat.distributed import grid_rank
from nanochat.gpt import Residual, build_model
from nanochat.common import ConfigError


def block_costs(model):
    """Training FLOPs per token of each block (matmuls x6 + attention + a following L3 layer), and of
    the head (the lm_head matmul; the embedding lookup is negligible)."""
    costs = []
    for i, block in enumerate(model.blocks):
        matmul = sum(p.numel() for n, p in block.named_parameters() if p.ndim == 2 and "value_embed" not in n)
        l3 = model.l3[str(i)].estimate_flops() if str(i) in model.l3 else 0
        costs.append(6 * matmul + model.attention_flops(i) + l3)
    return costs, 6 * model.lm_head.weight.numel()


def split_stages(costs, head_cost, num_stages):
    """Contiguous [start, end) block ranges minimizing the most expensive stage (the last stage
    also pays for the head). Dynamic programming over cut points; n_layer is small."""
    n = len(costs)
    if num_stages > n:
        raise ConfigError(f"--pp {num_stages} is more stages than blocks ({n}); each stage needs at least one block")
    prefix = list(itertools.accumulate(costs, initial=0))
    # best[k][i]: minimal max-cost splitting blocks[:i] into k stages (the head not yet counted)
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                stage = prefix[i] - prefix[j] + (head_cost if (k == num_stages and i == n) else 0)
                value = max(best[k - 1][j], stage)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts = [n]  # the cut points, walked back from the end
    for k in range(num_stages, 0, -1):
        cuts.insert(0, cut[k][cuts[0]])
    return list(zip(cuts, cuts[1:]))


def _p2p(ops):
    """Post a list of (op, tensor, peer) together and wait for all of them."""
    if ops:
        for request in dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]):
            request.wait()


def _carried(h, with_mid):
    """What of a Residual crosses a stage boundary: x, x0, and x_mid once past the middle."""
    return [h.x, h.x0] + ([h.x_mid] if with_mid else [])


def stage_actions(schedule, p, m, stage):
    """The ordered list of ("F", i) / ("B", i) that `stage` of p runs in one step of m micro-batches: train_step
    runs exactly this list, --pp-print-schedule prints it, dev/pipeline_sim.py replays it."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - stage - 1, m)
    acts = [("F", i) for i in range(warmup)]  # warm-up: fill the pipeline
    for f in range(warmup, m):  # steady state: one forward, one backward
        acts += [("F", f), ("B", f - warmup)]
    return acts + [("B", i) for i in range(m - warmup, m)]  # cool-down: the warm-up micro-batches' backwards


class Pipeline:
    """This rank's stage of the model and the schedule that drives it. sequence_parallel: the model was parallelized
    with it, so the residual stream between blocks, and in the messages, holds this rank's share of the sequence."""

    def __init__(self, model, layout, num_microbatches, micro_batch_size, schedule="1f1b", sequence_parallel=False):
        self.model, self.layout, self.micro_batch_size = model, layout, micro_batch_size
        self.num_stages, self.stage, self.num_microbatches = layout.pp_size, layout.pp_rank, num_microbatches
        if num_microbatches < self.num_stages:
            raise ConfigError(f"pipeline parallelism needs at least pp={self.num_stages} micro-batches per step, "
                              f"got {num_microbatches}")
        if schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"unknown --pp-schedule {schedule!r}; use gpipe or 1f1b")
        self.schedule = schedule
        costs, head_cost = block_costs(model)
        self.stage_bounds = split_stages(costs, head_cost, self.num_stages)
        self.start, self.end = self.stage_bounds[self.stage]
        self.stage_costs = [sum(costs[a:b]) + (head_cost if k == self.num_stages - 1 else 0)
                            for k, (a, b) in enumerate(self.stage_bounds)]
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        # drop the modules this stage does not run (blocks become empty Identities: names keep the global indices)
        for i in range(len(model.blocks)):
            if not (self.start <= i < self.end):
                model.blocks[i] = nn.Identity()
                if str(i) in model.l3:
                    del model.l3[str(i)]
        if not self.first:
            model.wte = model.smear_gate = model.smear_lambda = None
        if not self.last:
            model.lm_head = model.backout_lambda = None
        # x_mid exists on the way into this stage if the backout block lies in an earlier stage
        self.receives_mid = model.backout_layer < self.start
        self.sends_mid = model.backout_layer < self.end
        self.dtype, self.n_embd = model.compute_dtype, model.config.n_embd
        self.seq_shards = layout.tp_size if sequence_parallel else 1
        self.device = next(model.parameters()).device

    # --- the schedule: what train_step runs and schedule_text prints ----------------------

    def describe(self):
        p, m = self.num_stages, self.num_microbatches
        return (f"stages (blocks [start, end)): {self.stage_bounds}; estimated cost per stage (GFLOP/token): "
                f"{[round(c / 1e9, 3) for c in self.stage_costs]}; bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}")

    def actions(self, stage):
        """What this pipeline's `stage` runs in one step, in order (stage_actions)."""
        return stage_actions(self.schedule, self.num_stages, self.num_microbatches, stage)

    def schedule_text(self):
        """--pp-print-schedule: every stage's action list (F3 = forward of micro-batch 3, B3 its backward), in the
        order train_step runs it. dev/pipeline_sim.py replays these lists in time."""
        lines = [f"pipeline schedule ({self.schedule}, p={self.num_stages}, m={self.num_microbatches}): {self.describe()}"]
        return "\n".join(lines + [f"stage {s}: " + " ".join(f"{k}{i}" for k, i in self.actions(s))
                                   for s in range(self.num_stages)])

    # --- messages ---------------------------------------------------------------
    # A forward message is [x, x0, (x_mid), idx]; a backward message is [dx, dx0, (dx_mid)]. Each action
    # receives its input before it runs (a forward from the previous stage, a backward from the next) and
    # sends its output after (none at the ends of the pipeline).

    def _recv_ops(self, action):
        """The receives of an action's input, and what they fill."""
        kind, i = action
        if kind == "F":
            if self.first:
                return [], None
            B, T = self.micro_batch_size, self.model.config.sequence_len
            x = torch.empty((B, T // self.seq_shards, self.n_embd), dtype=self.dtype, device=self.device)
            h = Residual(x, torch.empty_like(x), torch.empty_like(x) if self.receives_mid else None)
            idx = torch.empty((B, T), dtype=torch.long, device=self.device)
            return [(dist.irecv, t, self.layout.pp_prev) for t in _carried(h, self.receives_mid) + [idx]], (h, idx)
        if self.last:
            return [], None
        grads = [torch.empty_like(t) for t in _carried(self._saved_outputs[i][0], self.sends_mid)]
        return [(dist.irecv, g, self.layout.pp_next) for g in grads], grads

    def _send_ops(self, kind, output):
        """The sends of an action's output: a forward's (Residual, idx), a backward's input gradients."""
        if kind == "F":
            if self.last:
                return []
            h, idx = output
            tensors = _carried(h, self.sends_mid) + [idx]
            return [(dist.isend, t.detach().contiguous(), self.layout.pp_next) for t in tensors]
        if self.first:
            return []
        return [(dist.isend, g.contiguous(), self.layout.pp_prev) for g in output]

    # --- compute on one micro-batch -------------------------------------------------

    def forward(self, i, inputs):
        """Stage forward of micro-batch i. Stage 0 embeds the ids; the others take (Residual, idx)
        received from the previous stage. Returns (Residual, idx), or the loss on the last stage."""
        model = self.model
        if self.first:
            h, idx = model.embed(self.xs[i]), self.xs[i]
        else:
            h, idx = inputs
            for t in _carried(h, self.receives_mid):
                t.requires_grad_(True)
        self._saved_inputs[i] = h
        h = model.run_blocks(h, idx, self.start, self.end)
        if self.last:
            loss = model.head(h, self.ys[i])
            self.total_loss += loss.detach()
            out = loss / self.num_microbatches
        else:
            out = (h, idx)
        self._saved_outputs[i] = out
        return out

    def backward(self, i, grads):
        """Stage backward of micro-batch i from the gradients of its outputs (the loss on the last
        stage). Returns the gradients of its inputs, to send to the previous stage."""
        out = self._saved_outputs.pop(i)
        inputs = self._saved_inputs.pop(i)
        if self.last:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(_carried(out[0], self.sends_mid), grads)
        return None if self.first else [t.grad for t in _carried(inputs, self.receives_mid)]

    # --- one training step ----------------------------------------------------------

    def train_step(self, batches, before_last_backward=None):
        """Forward and backward of the micro-batches [(x, y), ...] (x on stage 0, y on the last stage, None elsewhere)
        in the order actions(stage) lists; gradients accumulate into .grad. Returns the mean loss on every stage.
        before_last_backward (the optimizer's prepare_last_backward) runs right before the last micro-batch's."""
        self.device = next(self.model.parameters()).device
        self.xs, self.ys = [b[0] for b in batches], [b[1] for b in batches]
        self._saved_inputs, self._saved_outputs = {}, {}
        self.total_loss = torch.zeros((), device=self.device)
        actions = self.actions(self.stage)
        recv, inputs = self._recv_ops(actions[0])
        _p2p(recv)
        for k, (kind, i) in enumerate(actions):
            if kind == "B" and i == self.num_microbatches - 1 and before_last_backward is not None:
                before_last_backward()
            output = self.forward(i, inputs) if kind == "F" else self.backward(i, inputs)
            send = self._send_ops(kind, output)
            following = actions[k + 1] if k + 1 < len(actions) else None
            if following is None:
                _p2p(send)
                break
            recv, inputs = self._recv_ops(following)
            if following[0] != kind:  # a forward meets a backward: one neighbour, posted at once (module docstring)
                _p2p(send + recv)
            else:
                _p2p(send)
                _p2p(recv)
        assert not self._saved_outputs, "schedule left micro-batches without a backward"
        L, loss = self.layout, (self.total_loss / self.num_microbatches).detach()
        # the loss lives on the last stage: send it to every stage of this pipeline
        dist.broadcast(loss, src=grid_rank(L, L.dp_rank, L.tp_rank, self.num_stages - 1), group=L.pp_group)
        return loss

    # --- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def forward_loss(self, x, y):
        """Per-token losses of one batch through all stages (forward only); None except on the last stage."""
        self.device = next(self.model.parameters()).device
        model = self.model
        if self.first:
            h, idx = model.embed(x), x
        else:
            recv, (h, idx) = self._recv_ops(("F", None))
            _p2p(recv)
        h = model.run_blocks(h, idx, self.start, self.end)
        if self.last:
            return model.head(h, y, loss_reduction="none")
        _p2p(self._send_ops("F", (h, idx)))
        return None


def whole_model_copy(model, layout):
    """A whole, unsharded copy of a TP and/or PP model on every rank, for CORE and sampling (module docstring): TP
    shards all-gathered (checkpoint_manager.full_model_state), then each tensor broadcast over the PP group from
    the stage holding it. Costs one full model (plus a CPU copy of the local part) per rank while it lives."""
    from nanochat.checkpoint_manager import full_model_state, load_model_state
    device = next(model.parameters()).device
    state = full_model_state(model)
    if layout.pp_size > 1:
        held = [None] * layout.pp_size  # per stage: name -> (shape, dtype) of the tensors it holds
        dist.all_gather_object(held, {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()},
                               group=layout.pp_group)
        for stage, tensors in enumerate(held):
            src = grid_rank(layout, layout.dp_rank, layout.tp_rank, stage)
            for name, (shape, dtype) in tensors.items():
                if stage == layout.pp_rank:
                    t = state[name].to(device)
                else:
                    t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.broadcast(t, src=src, group=layout.pp_group)
                state[name] = t
    full = build_model(model.config, device, model.compute_dtype)
    load_model_state(full, state)
    full.eval()
    return full
