"""
Pipeline parallelism: the blocks are cut into contiguous stages, one per PP rank; the micro-batches of
a step flow through them, activations forward and gradients backward, with explicit p2p messages.

Stages. Block i costs its matmul FLOPs plus its attention FLOPs (per token); stage 0 also holds the
embeddings, the last stage the final norm, lm_head and loss (which cost as much as several blocks at
small depth). The split minimizes the most expensive stage, at least one block per stage. Modules a
stage does not own are removed, so its state_dict holds only its own parameters, under their global
names (checkpoints stay layout-free).

What crosses a stage boundary, for each micro-batch: the residual stream x, the normed embedding x0
(every block mixes it back in), the mid-depth residual x_mid once the stream has passed the middle
(the backout subtracts it before the final norm), and the token ids (value embeddings and L3 layers
look them up). Backward sends the gradients of x, x0 and x_mid. The first stage reads the batches,
the last stage reads the same batches for their targets.

Schedules, over the m micro-batches of a step (m >= p, the number of stages):
  GPipe: all m forwards, then all m backwards; keeps m micro-batches of activations alive.
  1F1B:  warm-up (p - s - 1 forwards on stage s), steady state (one forward, one backward), cool-down
         (the remaining backwards); keeps at most p - s micro-batches alive, same bubble.
Bubble fraction for both: (p - 1) / (m + p - 1).

Evaluation: val bpb runs through the stages (forward_loss). CORE and sampling take sequences of any
length, which fixed-shape messages cannot carry: base_train gathers a whole copy of the model onto every
rank for them (checkpoint_manager.gathered_model). Under torch.compile each stage's blocks and the loss
are compiled one by one; the messages and the schedule stay eager.

Every message is a batch of isend/irecv posted together (torch.distributed.batch_isend_irecv): with
NCCL a stage that sends to and receives from the same neighbour in one phase must post both at once,
or the two kernels can wait on each other.
"""

import torch
import torch.nn as nn
import torch.distributed as dist

from nanochat.common import grid_rank
from nanochat.gpt import Residual


def block_costs(model):
    """Training FLOPs per token of each block (matmuls x6 + attention + a following L3 layer), and of
    the head (the lm_head matmul; the embedding lookup is negligible)."""
    costs = []
    for i, block in enumerate(model.blocks):
        matmul = sum(p.numel() for n, p in block.named_parameters() if p.ndim == 2 and "value_embed" not in n)
        l3 = model.l3[str(i)].estimate_flops() if str(i) in model.l3 else 0
        costs.append(6 * matmul + model.attention_flops(i) + l3)
    head = 6 * model.lm_head.weight.numel()
    return costs, head


def split_stages(costs, head_cost, num_stages):
    """Contiguous [start, end) block ranges minimizing the most expensive stage (the last stage
    also pays for the head). Dynamic programming over cut points; n_layer is small."""
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"--pp {num_stages} is more stages than blocks ({n}); each stage needs at least one block")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    # best[k][i]: minimal max-cost splitting blocks[:i] into k stages (the head not yet counted)
    best = [[INF] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                stage = prefix[i] - prefix[j] + (head_cost if (k == num_stages and i == n) else 0)
                value = max(best[k - 1][j], stage)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def _p2p(ops):
    """Post a list of (op, tensor, peer) together and wait for all of them."""
    if not ops:
        return
    reqs = dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops])
    for r in reqs:
        r.wait()


class Pipeline:
    """This rank's stage of the model and the schedule that drives it."""

    def __init__(self, model, layout, num_microbatches, micro_batch_size, schedule="1f1b"):
        self.model, self.layout = model, layout
        self.micro_batch_size = micro_batch_size
        self.p, self.s = layout.pp_size, layout.pp_rank
        self.m = num_microbatches
        if self.m < self.p:
            raise ValueError(f"pipeline parallelism needs at least pp={self.p} micro-batches per step, got {self.m}")
        if schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"unknown --pp-schedule {schedule!r}; use gpipe or 1f1b")
        self.schedule = schedule
        costs, head_cost = block_costs(model)
        self.stage_bounds = split_stages(costs, head_cost, self.p)
        self.start, self.end = self.stage_bounds[self.s]
        self.stage_costs = [sum(costs[a:b]) + (head_cost if k == self.p - 1 else 0) for k, (a, b) in enumerate(self.stage_bounds)]
        self._remove_other_stages()
        cfg = model.config
        # x_mid exists on the way into this stage if the backout block lies in an earlier stage
        self.receives_mid = model.backout_layer < self.start
        self.sends_mid = model.backout_layer < self.end
        self.dtype = model.compute_dtype
        self.d = cfg.n_embd
        # with sequence parallelism the residual stream between blocks is split along the sequence
        self.seq_shards = layout.tp_size if getattr(model.embed_exit, "group", None) is not None else 1
        self.device = next(model.parameters()).device

    def _remove_other_stages(self):
        """Drop the modules and parameters this stage does not run (blocks become empty Identities,
        keeping the global block indices in parameter names)."""
        m = self.model
        for i in range(len(m.blocks)):
            if not (self.start <= i < self.end):
                m.blocks[i] = nn.Identity()
                if str(i) in m.l3:
                    del m.l3[str(i)]
        if self.s != 0:
            m.wte = m.smear_gate = m.smear_lambda = None
        if self.s != self.p - 1:
            m.lm_head = m.backout_lambda = None

    # --- description ------------------------------------------------------------

    def describe(self):
        return (f"stages (blocks [start, end)): {self.stage_bounds}; estimated cost per stage (GFLOP/token): "
                f"{[round(c / 1e9, 3) for c in self.stage_costs]}; bubble (p-1)/(m+p-1) = "
                f"{(self.p - 1) / (self.m + self.p - 1):.3f}")

    def actions(self, stage):
        """The ordered list of ('F', i) / ('B', i) a stage performs in one step."""
        if self.schedule == "gpipe":
            return [("F", i) for i in range(self.m)] + [("B", i) for i in range(self.m)]
        warmup = min(self.p - stage - 1, self.m)
        acts = [("F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < self.m:  # steady state: one forward, one backward
            acts += [("F", f), ("B", b)]
            f, b = f + 1, b + 1
        acts += [("B", i) for i in range(b, self.m)]
        return acts

    def schedule_table(self):
        """Simulated time slots for every stage, as text: F3 = forward of micro-batch 3, B3 its
        backward, . = idle. A forward waits for the previous stage's forward, a backward for the next
        stage's backward (or, on the last stage, for its own forward); each takes one slot."""
        queues = [self.actions(s) for s in range(self.p)]
        done, pos = set(), [0] * self.p
        rows = [[] for _ in range(self.p)]
        while any(pos[s] < len(queues[s]) for s in range(self.p)):
            finished_now = []
            for s in range(self.p):
                if pos[s] == len(queues[s]):
                    rows[s].append(".")
                    continue
                kind, i = queues[s][pos[s]]
                if kind == "F":
                    ready = s == 0 or ("F", i, s - 1) in done
                else:
                    ready = ("F", i, s) in done if s == self.p - 1 else ("B", i, s + 1) in done
                rows[s].append(f"{kind}{i}" if ready else ".")
                if ready:
                    finished_now.append((kind, i, s))
                    pos[s] += 1
            done.update(finished_now)
        width = max(len(c) for r in rows for c in r)
        slots, busy = len(rows[0]), 2 * self.m
        lines = [f"pipeline schedule ({self.schedule}, p={self.p}, m={self.m}); time runs left to right"]
        lines += [f"stage {s}: " + " ".join(c.rjust(width) for c in r) for s, r in enumerate(rows)]
        lines.append(f"slots {slots}, busy {busy} per stage: simulated bubble {1 - busy / slots:.3f} "
                     f"(formula (p-1)/(m+p-1) = {(self.p - 1) / (self.m + self.p - 1):.3f})")
        return "\n".join(lines)

    # --- messages ---------------------------------------------------------------
    # A forward message is [x, x0, (x_mid), idx]; a backward message is [dx, dx0, (dx_mid)].

    def _recv_activation_ops(self):
        B, T = self.micro_batch_size, self.model.config.sequence_len
        x = torch.empty((B, T // self.seq_shards, self.d), dtype=self.dtype, device=self.device)
        x0 = torch.empty_like(x)
        mid = torch.empty_like(x) if self.receives_mid else None
        idx = torch.empty((B, T), dtype=torch.long, device=self.device)
        tensors = [x, x0] + ([mid] if mid is not None else []) + [idx]
        return [(dist.irecv, t, self.layout.pp_prev) for t in tensors], (Residual(x, x0, mid), idx)

    def _send_activation_ops(self, out):
        h, idx = out
        tensors = [h.x, h.x0] + ([h.x_mid] if self.sends_mid else []) + [idx]
        return [(dist.isend, t.detach().contiguous(), self.layout.pp_next) for t in tensors]

    def _recv_grad_ops(self, out):
        h = out[0]
        grads = [torch.empty_like(h.x), torch.empty_like(h.x0)] + ([torch.empty_like(h.x_mid)] if self.sends_mid else [])
        return [(dist.irecv, g, self.layout.pp_next) for g in grads], grads

    def _send_grad_ops(self, grads):
        return [(dist.isend, g.contiguous(), self.layout.pp_prev) for g in grads]

    # the four exchanges of the schedules; each is a no-op at the end of the pipeline it would cross

    def recv_forward(self):
        if self.s == 0:
            return None
        ops, inputs = self._recv_activation_ops()
        _p2p(ops)
        return inputs

    def send_forward(self, out):
        if self.s < self.p - 1:
            _p2p(self._send_activation_ops(out))

    def recv_backward(self, out):
        if self.s == self.p - 1:
            return None
        ops, grads = self._recv_grad_ops(out)
        _p2p(ops)
        return grads

    def send_backward(self, grads):
        if self.s > 0:
            _p2p(self._send_grad_ops(grads))

    def send_forward_recv_backward(self, out):
        """Send micro-batch i's output and receive micro-batch j's gradient from the next stage, posted
        together (1F1B's steady state)."""
        if self.s == self.p - 1:
            return None
        recv, grads = self._recv_grad_ops(self._saved_outputs[self._oldest_unfinished()])
        _p2p(self._send_activation_ops(out) + recv)
        return grads

    def send_backward_recv_forward(self, grads):
        """Send a gradient to the previous stage and receive the next micro-batch from it, together."""
        if self.s == 0:
            return None
        recv, inputs = self._recv_activation_ops()
        _p2p(self._send_grad_ops(grads) + recv)
        return inputs

    # --- compute on one micro-batch -------------------------------------------------

    def forward(self, i, inputs):
        """Stage forward of micro-batch i. Stage 0 embeds the ids; the others take (Residual, idx)
        received from the previous stage. Returns (Residual, idx), or the loss on the last stage."""
        m = self.model
        if self.s == 0:
            idx = self.xs[i]
            h = m.embed(idx)
        else:
            h, idx = inputs
            for t in (h.x, h.x0, h.x_mid):
                if t is not None:
                    t.requires_grad_(True)
        self._saved_inputs[i] = h
        h = m.run_blocks(h, idx, self.start, self.end)
        if self.s == self.p - 1:
            loss = m.head(h, self.ys[i])
            self.total_loss += loss.detach()
            out = loss / self.m
        else:
            out = (h, idx)
        self._saved_outputs[i] = out
        return out

    def backward(self, i, grads):
        """Stage backward of micro-batch i from the gradients of its outputs (the loss on the last
        stage). Returns the gradients of its inputs, to send to the previous stage."""
        out = self._saved_outputs.pop(i)
        inputs = self._saved_inputs.pop(i)
        if i == self.m - 1 and self.before_last_backward is not None:
            self.before_last_backward()
        if self.s == self.p - 1:
            torch.autograd.backward(out)
        else:
            h = out[0]
            outs = [h.x, h.x0] + ([h.x_mid] if self.sends_mid else [])
            torch.autograd.backward(outs, grads)
        if self.s == 0:
            return None
        return [inputs.x.grad, inputs.x0.grad] + ([inputs.x_mid.grad] if self.receives_mid else [])

    def _oldest_unfinished(self):
        return min(self._saved_outputs)

    # --- the schedules ------------------------------------------------------------

    def train_step(self, batches, before_last_backward=None):
        """Forward and backward of the m micro-batches [(x, y), ...] (x on stage 0, y on the last
        stage, None elsewhere); gradients accumulate into .grad. before_last_backward (e.g. the
        optimizer's prepare_last_backward) is called right before this stage's backward of the last
        micro-batch. Returns the mean loss on every stage."""
        self.before_last_backward = before_last_backward
        self.device = next(self.model.parameters()).device
        self.xs = [b[0] for b in batches]
        self.ys = [b[1] for b in batches]
        self._saved_inputs, self._saved_outputs = {}, {}
        self.total_loss = torch.zeros((), device=self.device)
        if self.schedule == "gpipe":
            self._gpipe()
        else:
            self._one_f_one_b()
        assert not self._saved_outputs, "schedule left micro-batches without a backward"
        return self._broadcast_loss(self.total_loss / self.m)

    def _gpipe(self):
        outs = []
        for i in range(self.m):
            out = self.forward(i, self.recv_forward())
            self.send_forward(out)
            outs.append(out)
        for i in range(self.m):
            self.send_backward(self.backward(i, self.recv_backward(outs[i])))

    def _one_f_one_b(self):
        warmup = min(self.p - self.s - 1, self.m)
        steady = self.m - warmup
        for i in range(warmup):  # fill the pipeline
            out = self.forward(i, self.recv_forward())
            self.send_forward(out)
        inputs = self.recv_forward() if steady > 0 else None
        for k in range(steady):  # one forward (micro-batch warmup+k), one backward (micro-batch k)
            out = self.forward(warmup + k, inputs)
            grads = self.send_forward_recv_backward(out)
            input_grads = self.backward(k, grads)
            if k == steady - 1:
                self.send_backward(input_grads)
            else:
                inputs = self.send_backward_recv_forward(input_grads)
        for i in range(steady, self.m):  # drain: the backwards of the warm-up micro-batches
            out = self._saved_outputs[i]
            self.send_backward(self.backward(i, self.recv_backward(out)))

    def _broadcast_loss(self, loss):
        """The loss lives on the last stage: send it to every stage of this pipeline."""
        L = self.layout
        loss = loss.detach().clone()
        dist.broadcast(loss, src=grid_rank(L, L.dp_rank, L.tp_rank, self.p - 1), group=L.pp_group)
        return loss

    # --- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def forward_loss(self, x, y):
        """Per-token losses of one batch through all stages (forward only); None except on the last stage."""
        self.device = next(self.model.parameters()).device
        m = self.model
        if self.s == 0:
            h, idx = m.embed(x), x
        else:
            h, idx = self.recv_forward()
        h = m.run_blocks(h, idx, self.start, self.end)
        if self.s == self.p - 1:
            return m.head(h, y, loss_reduction="none")
        self.send_forward((h, idx))
        return None
