"""
Pipeline parallelism: the blocks are cut into contiguous chunks, the chunks dealt out to the PP ranks; the
micro-batches of a step flow through them, activations forward and gradients backward, in explicit p2p messages.

Collectives, over this pipeline's ranks (the PP group, or the ranks before and after this one in the ring):
  isend / irecv        per micro-batch and chunk boundary: activations to the next chunk's rank, their gradients
                       back, each message as one batch_isend_irecv, posted in the order of message_order
  broadcast            the step's loss, from the last chunk's rank to the others
  all_gather_object,   a whole copy of the model for CORE and sampling (whole_model_copy): what tensors each
  broadcast            rank holds, then each of them from its rank

Chunks. Block i costs its matmul and attention FLOPs per token; chunk 0 also holds the embeddings, the last chunk
the head and loss (as much as several blocks at small depth). The split into p x V chunks minimizes the most
expensive one; chunk c runs on rank c mod p (V = --pp-virtual chunks per rank, round-robin as in Megatron-LM, so
rank 0 holds the embeddings and rank p-1 the head). Modules a rank does not own are removed, so its state_dict
holds only its own parameters, under their global names (checkpoints stay layout-free). Across a chunk boundary
go gpt.Residual (x, x0, and x_mid once past the middle) and the token ids (value embeddings and L3 look them up);
back go the gradients of the Residual.

Schedules are lists of actions per rank, (kind, micro-batch, chunk): F a forward, B a backward, W a deferred
weight gradient (stage_actions: what train_step runs, --pp-print-schedule prints and dev/pipeline_sim.py prices).
With p ranks and m >= p micro-batches, the idle fraction of each rank at equal F, B (and W) times:
  gpipe        all m forwards, then all m backwards; m micro-batches of activations alive.     (p-1)/(m+p-1)
  1f1b         warm-up (p-s-1 forwards on rank s), one forward one backward, cool-down; at
               most p-s micro-batches alive.                                                     (p-1)/(m+p-1)
  interleaved  1F1B over V chunks per rank, the micro-batches in groups of p, each group through
               chunk 0, then chunk 1, ...; a V-th of the bubble, V times the messages, m % p == 0. (p-1)/(Vm+p-1)
  zb           ZB-H1: each backward split in two: B, the input gradient, sent on at once, and W, the weight
               gradients, run later where 1F1B idles (rank s defers s of them); at most p micro-batches alive
               on every rank (1F1B's peak, on rank 0).                                          (p-1)/(3m+p-1)
How zb splits a backward: during the forward, each linear's output y is kept (record_linears; under torch.compile
the linears run outside the graphs, as graph breaks, so that y is a tensor autograd can stop at). B is one
backward to the chunk's inputs, the kept y's and the parameters that are no linear's weight (autograd computes
only what leads there: the matmuls give dx, not dW). W is one backward from each kept y, with its gradient, to
that linear's weight: the dW half of the matmul. Both are autograd's own formulas, so zb's gradients are bitwise
those of one backward. Where one autograd node computes both halves, W runs it again: the fp8 linears (their
backward is one function; the fused fp8 MLP is not split at all, its weights' gradients come in B). The MLP takes
its module path, not the fused ReLU^2 kernel, and split-K weight gradients are off. Under --recompute block, W
recomputes each block once more (B did once); --recompute selective is refused (B's recomputation uses up the
outputs it keeps, which W's would need again).

Messages. Every rank runs its actions in order, each as soon as its input has come; the sends are posted after
the action that produces them, and the receives in one global order (message_order, from a replay of all ranks'
lists in time), so that the messages between two ranks are posted in the same order on both (NCCL runs them in
order on one stream per pair of ranks: two ranks each first waiting on the other would hang).

Evaluation: val bpb runs through the chunks (forward_loss); CORE and sampling take sequences of any length,
which neither fixed-shape messages nor sequence parallelism's equal split can take, so they run on a whole copy
of the model (whole_model_copy).
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.utils.checkpoint

from nanochat.gpt import Residual, build_model
from nanochat.common import ConfigError
from nanochat.kernels import Linear

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


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
        raise ConfigError(f"--pp x --pp-virtual = {num_stages} chunks is more than the {n} blocks; each chunk needs one")
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


# --- schedules: per rank, the ordered actions (kind, micro-batch, chunk) -----------------------------------

def stage_actions(schedule, p, m, rank, virtual=1):
    """What `rank` of p runs in one step of m micro-batches (module docstring): train_step runs exactly this list,
    --pp-print-schedule prints it, dev/pipeline_sim.py prices it."""
    if schedule == "gpipe":
        return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved(p, m, virtual, rank)
    warmup = min(p - rank - 1, m)
    acts = [("F", i, rank) for i in range(warmup)]  # warm-up: fill the pipeline
    deferred = 0
    for b in range(m):  # steady state: one forward, one backward (zb: and the oldest W, once `rank` are waiting)
        if warmup + b < m:
            acts.append(("F", warmup + b, rank))
        acts.append(("B", b, rank))
        if schedule == "zb" and b >= rank:
            acts.append(("W", deferred, rank))
            deferred += 1
    return acts + ([("W", i, rank) for i in range(deferred, m)] if schedule == "zb" else [])


def _interleaved(p, m, V, rank):
    """Megatron-LM's interleaved 1F1B: the k-th forward of a rank is micro-batch group*p + k mod p of its chunk
    (k // p) mod V; backwards walk the chunks in reverse. A deeper warm-up (2 per rank after this one, and a
    round of p for every chunk past the first) keeps every later chunk fed."""
    total = m * V

    def nth(k, backward):
        group, within = divmod(k, p * V)
        v = within // p
        return group * p + within % p, ((V - 1 - v) if backward else v) * p + rank

    warmup = min((p - rank - 1) * 2 + (V - 1) * p, total)
    acts = [("F", *nth(k, False)) for k in range(warmup)]
    for k in range(warmup, total):
        acts += [("F", *nth(k, False)), ("B", *nth(k - warmup, True))]
    return acts + [("B", *nth(k, True)) for k in range(total - warmup, total)]


def idle_formula(schedule, p, m, virtual=1):
    """Each rank's idle fraction of the step at equal F, B and W times (module docstring)."""
    work = {"gpipe": m, "1f1b": m, "interleaved": virtual * m, "zb": 3 * m}[schedule]
    return (p - 1) / (work + p - 1)


def input_of(action, num_chunks):
    """The action whose output `action` waits for (None: the first chunk's forward): a forward takes the previous
    chunk's forward, a backward the next chunk's backward (the last chunk: its own forward), W its own B."""
    kind, i, c = action
    if kind == "F":
        return None if c == 0 else ("F", i, c - 1)
    if kind == "W":
        return ("B", i, c)
    return ("F", i, c) if c == num_chunks - 1 else ("B", i, c + 1)


def simulate(actions, duration, p2p=0.0):
    """Replay the ranks' action lists in time: each rank runs its actions in order, each once the rank is free and
    its input has come (a message between ranks takes p2p). duration(action) -> time. Returns per rank the list of
    (action, start, end) in the order run; raises ValueError if the lists wait on each other."""
    p = len(actions)
    num_chunks = 1 + max(c for acts in actions for _, _, c in acts)
    done, timeline, position, free = {}, [[] for _ in range(p)], [0] * p, [0.0] * p
    while any(position[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(actions[r]):
                action = actions[r][position[r]]
                dep = input_of(action, num_chunks)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p if dep[2] % p != r else 0.0)
                start = max(free[r], ready)
                free[r] = done[action] = start + duration(action)
                timeline[r].append((action, start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists wait on each other: no rank can run its next action")
    return timeline


def peak_in_flight(actions, kept=None):
    """Per rank, the most micro-batch chunks whose activations are alive at once: from a forward until its
    backward (zb: until its W, which still needs them). What train_step measures as Pipeline.peak_in_flight.
    kept: per chunk, the bytes its forward keeps (then the peak is in bytes); None counts each chunk as 1."""
    peaks = []
    for acts in actions:
        freeing = "W" if any(kind == "W" for kind, _, _ in acts) else "B"
        alive = peak = 0
        for kind, _, c in acts:
            weight = 1 if kept is None else kept[c]
            alive += weight if kind == "F" else -weight if kind == freeing else 0
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


ORDER_TIMES = {"F": 1, "B": 2, "W": 1}  # for message_order only: any times give a valid order; these keep it close


def message_order(actions, rank):
    """This rank's program: ("run", action) for its actions, ("send", action) for an action's output right after
    it, ("recv", action) to post the receive of another rank's output, in one order for all ranks (the replay's
    time, then the sending rank), so that two ranks post the messages between them in the same order."""
    p = len(actions)
    num_chunks = 1 + max(c for acts in actions for _, _, c in acts)
    timeline = simulate(actions, lambda a: ORDER_TIMES[a[0]])
    keyed = []
    for r, events in enumerate(timeline):
        for n, (action, start, end) in enumerate(events):
            kind, i, c = action
            if r == rank:  # after every receive that arrives by its start
                keyed.append(((start, p, n), ("run", action)))
            to = {"F": c + 1, "B": c - 1}.get(kind)
            if to is None or not 0 <= to < num_chunks or to % p == r:
                continue
            if r == rank:
                keyed.append(((end, r, n), ("send", action)))
            if to % p == rank:
                keyed.append(((end, r, n), ("recv", action)))
    return [step for _, step in sorted(keyed)]


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
    """This rank's chunks of the model and the schedule that drives them. sequence_parallel: the model was
    parallelized with it, so the residual stream between blocks, and in the messages, holds this rank's share of
    the sequence. virtual: chunks per rank (interleaved)."""

    def __init__(self, model, layout, num_microbatches, micro_batch_size, schedule="1f1b", sequence_parallel=False,
                 virtual=1, cp=None):
        self.model, self.layout, self.micro_batch_size = model, layout, micro_batch_size
        p, m = layout.pp_size, num_microbatches
        self.num_stages, self.stage, self.num_microbatches, self.virtual = p, layout.pp_rank, m, virtual
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown --pp-schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        if m < p:
            raise ConfigError(f"pipeline parallelism needs at least pp={p} micro-batches per step, got {m}")
        if (schedule == "interleaved") != (virtual > 1):
            raise ConfigError(f"--pp-virtual {virtual} with --pp-schedule {schedule}: interleaved needs "
                              "--pp-virtual >= 2 chunks per rank, the other schedules one")
        if schedule == "interleaved" and m % p:
            raise ConfigError(f"--pp-schedule interleaved runs the micro-batches in groups of pp={p}: "
                              f"{m} micro-batches per step is no multiple (set --total-batch-size)")
        if schedule == "zb" and not hasattr(torch.utils.checkpoint, "GraphExecGroup"):
            raise ConfigError(f"--pp-schedule zb needs torch.utils.checkpoint.GraphExecGroup, which torch "
                              f"{torch.__version__} lacks: upgrade torch, or use 1f1b or interleaved")
        self.schedule = schedule
        costs, head_cost = block_costs(model)
        self.num_chunks = p * virtual
        self.chunk_bounds = split_stages(costs, head_cost, self.num_chunks)
        self.chunk_costs = [sum(costs[a:b]) + (head_cost if c == self.num_chunks - 1 else 0)
                            for c, (a, b) in enumerate(self.chunk_bounds)]
        self.chunks = {}
        for c in range(self.stage, self.num_chunks, p):
            a, b = self.chunk_bounds[c]
            self.chunks[c] = Chunk(a, b, c == 0, c == self.num_chunks - 1,
                                   model.backout_layer < a, model.backout_layer < b)
        self.blocks = [i for ch in self.chunks.values() for i in range(ch.start, ch.end)]
        # drop the modules this rank does not run (blocks become empty Identities: names keep the global indices)
        for i in range(len(model.blocks)):
            if i not in self.blocks:
                model.blocks[i] = nn.Identity()
                if str(i) in model.l3:
                    del model.l3[str(i)]
        if self.stage != 0:
            model.wte = model.smear_gate = model.smear_lambda = None
        if self.stage != p - 1:
            model.lm_head = model.backout_lambda = None
        self.dtype, self.n_embd = model.compute_dtype, model.config.n_embd
        self.cp = cp  # context parallelism: the residual stream holds this rank's chunks, 1/cp of each sequence
        self.seq_shards = (layout.tp_size if sequence_parallel else 1) * layout.cp_size
        self.device = next(model.parameters()).device
        self.prev_rank = layout.peer(pp=(self.stage - 1) % p)
        self.next_rank = layout.peer(pp=(self.stage + 1) % p)
        all_actions = [self.actions(r) for r in range(p)]
        self.program = message_order(all_actions, self.stage)
        self._sent = {action for step, action in self.program if step == "send"}
        # the optimizer's overlapped reduction is armed before the last action that adds to a gradient
        mine = all_actions[self.stage]
        self.last_gradient_action = [a for a in mine if a[0] == ("W" if schedule == "zb" else "B")][-1]
        self._recording = None  # zb: where the running forward keeps its linears' outputs
        if schedule == "zb":
            record_linears(model, self)

    # --- the schedule: what train_step runs and schedule_text prints ----------------------

    def describe(self):
        p, m = self.num_stages, self.num_microbatches
        per_rank = {r: [self.chunk_bounds[c] for c in range(r, self.num_chunks, p)] for r in range(p)}
        return (f"blocks [start, end) per rank: {per_rank}; estimated cost per chunk (GFLOP/token): "
                f"{[round(c / 1e9, 3) for c in self.chunk_costs]}; idle at equal F/B/W times "
                f"{idle_formula(self.schedule, p, m, self.virtual):.3f}")

    def actions(self, rank):
        """What this pipeline's `rank` runs in one step, in order (stage_actions)."""
        return stage_actions(self.schedule, self.num_stages, self.num_microbatches, rank, self.virtual)

    def schedule_text(self):
        """--pp-print-schedule: every rank's action list (F3 = forward of micro-batch 3, B3 its backward or, under
        zb, its input gradient, W3 its weight gradients; F3c5: of chunk 5 under interleaved), in the order
        train_step runs it. dev/pipeline_sim.py replays these lists in time."""
        p, m, V = self.num_stages, self.num_microbatches, self.virtual
        lines = [f"pipeline schedule ({self.schedule}, p={p}, m={m}" + (f", V={V}" if V > 1 else "") +
                 f"): {self.describe()}"]
        return "\n".join(lines + [f"stage {r}: " + " ".join(action_name(a, V) for a in self.actions(r))
                                   for r in range(p)])

    # --- messages ---------------------------------------------------------------
    # A forward message is [x, x0, (x_mid), idx]; a backward message is [dx, dx0, (dx_mid)].

    def _boundary_shape(self):
        B, T = self.micro_batch_size, self.model.config.sequence_len
        return (B, T // self.seq_shards, self.n_embd)

    def _recv(self, action):
        """Post the receive of another rank's output `action` (the input of one of this rank's actions)."""
        kind, i, c = action
        if kind == "F":  # into chunk c + 1, which this rank holds
            mid = self.chunks[c + 1].receives_mid
            x = torch.empty(self._boundary_shape(), dtype=self.dtype, device=self.device)
            h = Residual(x, torch.empty_like(x), torch.empty_like(x) if mid else None)
            idx = torch.empty(self._boundary_shape()[:1] + (self.model.config.sequence_len,), dtype=torch.long,
                              device=self.device)
            tensors, filled, peer = carried(h, mid) + [idx], (h, idx), self.prev_rank
        else:  # the gradients of chunk c - 1's outputs
            tensors = [torch.empty(self._boundary_shape(), dtype=self.dtype, device=self.device)
                       for _ in range(3 if self.chunks[c - 1].sends_mid else 2)]
            filled, peer = tensors, self.next_rank
        requests = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in tensors])
        return requests, filled

    def _send(self, action, output):
        """Post the send of an action's output: a forward's (Residual, idx), a backward's input gradients."""
        kind, i, c = action
        if kind == "F":
            h, idx = output
            tensors, peer = carried(h, self.chunks[c].sends_mid) + [idx], self.next_rank
            tensors = [t.detach().contiguous() for t in tensors]
        else:
            tensors, peer = [g.contiguous() for g in output], self.prev_rank
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer) for t in tensors])

    # --- compute on one micro-batch of one chunk ------------------------------------------

    def forward(self, i, c, inputs):
        """Forward of micro-batch i through chunk c. Chunk 0 embeds the ids; the others take (Residual, idx) from
        the previous chunk. Returns (Residual, idx), or the loss of the last chunk."""
        model, chunk = self.model, self.chunks[c]
        if chunk.first:
            h, idx = model.embed(self.xs[i], cp=self.cp), self.xs[i]
        else:
            h, idx = inputs
            for t in carried(h, chunk.receives_mid):
                t.requires_grad_(True)
        self._saved_inputs[i, c] = h
        if self.schedule == "zb":
            self._recording = self._linear_outputs[i, c] = []
        h = model.run_blocks(h, idx, chunk.start, chunk.end, cp=self.cp)
        self._recording = None
        if chunk.last:
            loss = model.head(h, self.ys[i], cp=self.cp)
            self.total_loss += loss.detach()
            out = loss / self.num_microbatches
        else:
            out = (h, idx)
        self._saved_outputs[i, c] = out
        return out

    def backward(self, i, c, grads):
        """Backward of micro-batch i through chunk c from the gradients of its outputs (the last chunk: its loss).
        Returns the gradients of its inputs, for the previous chunk. Under zb, only B (module docstring): the
        linears' weight gradients wait for weight_gradients(i, c)."""
        chunk, out, inputs = self.chunks[c], self._saved_outputs.pop((i, c)), self._saved_inputs.pop((i, c))
        outputs, grads = ([out], None) if chunk.last else (carried(out[0], chunk.sends_mid), grads)
        received = [] if chunk.first else carried(inputs, chunk.receives_mid)
        if self.schedule != "zb":
            torch.autograd.backward(outputs, grads)
        else:
            backward_input(outputs, grads, received, self._linear_outputs[i, c], self.model.parameters())
        return None if chunk.first else [t.grad for t in received]

    def weight_gradients(self, i, c):
        """W of micro-batch i in chunk c (zb): backward_weight on what its forward recorded."""
        backward_weight(self._linear_outputs.pop((i, c)))

    # --- one training step ----------------------------------------------------------

    def train_step(self, batches, before_last_backward=None):
        """Forward and backward of the micro-batches [(x, y), ...] (x on rank 0, y on the last rank, None
        elsewhere) in the order actions(rank) lists, the messages posted in message_order; gradients accumulate
        into .grad. Returns the mean loss on every rank. before_last_backward (the optimizer's
        prepare_last_backward) runs right before the last action that adds to a gradient."""
        self.device = next(self.model.parameters()).device
        self.xs, self.ys = [b[0] for b in batches], [b[1] for b in batches]
        self._saved_inputs, self._saved_outputs, self._linear_outputs = {}, {}, {}
        self.total_loss = torch.zeros((), device=self.device)
        received, outputs, sends = {}, {}, []  # outputs: of the actions whose output goes to another rank
        self.peak_in_flight = 0  # micro-batch chunks whose activations are alive at once (peak_in_flight())
        alive = self._linear_outputs if self.schedule == "zb" else self._saved_outputs  # zb: until W, else until B
        for step, action in self.program:
            if step == "recv":
                received[action] = self._recv(action)
            elif step == "send":
                sends += self._send(action, outputs.pop(action))
            else:
                kind, i, c = action
                inputs = None
                dep = input_of(action, self.num_chunks)
                if dep in received:
                    requests, inputs = received.pop(dep)
                    for request in requests:
                        request.wait()
                if action == self.last_gradient_action and before_last_backward is not None:
                    before_last_backward()
                if kind == "W":
                    self.weight_gradients(i, c)
                    continue
                output = self.forward(i, c, inputs) if kind == "F" else self.backward(i, c, inputs)
                if action in self._sent:  # (the last chunk's loss stays out: it would keep zb's graph alive)
                    outputs[action] = output
                if kind == "F":
                    self.peak_in_flight = max(self.peak_in_flight, len(alive))
        for request in sends:
            request.wait()
        assert not self._saved_outputs and not self._linear_outputs, "the schedule left micro-batches unfinished"
        L, loss = self.layout, (self.total_loss / self.num_microbatches).detach()
        # the loss lives on the last rank: send it to every rank of this pipeline
        dist.broadcast(loss, src=L.peer(pp=self.num_stages - 1), group=L.pp_group)
        return loss

    # --- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def forward_loss(self, x, y):
        """Per-token losses of one batch through all chunks (forward only); None except on the last rank."""
        self.device = next(self.model.parameters()).device
        model, sends, losses = self.model, [], None
        for c, chunk in self.chunks.items():
            if chunk.first:
                h, idx = model.embed(x, cp=self.cp), x
            else:
                requests, (h, idx) = self._recv(("F", None, c - 1))
                for request in requests:
                    request.wait()
            h = model.run_blocks(h, idx, chunk.start, chunk.end, cp=self.cp)
            if chunk.last:
                losses = model.head(h, y, loss_reduction="none", cp=self.cp)
            else:
                sends += self._send(("F", None, c), (h, idx))
        for request in sends:
            request.wait()
        return losses


def action_name(action, virtual=1):
    kind, i, c = action
    return f"{kind}{i}" + (f"c{c}" if virtual > 1 else "")


def carried(h, with_mid):
    """What of a Residual crosses a chunk boundary: x, x0, and x_mid once past the middle."""
    return [h.x, h.x0] + ([h.x_mid] if with_mid else [])


def record_linears(model, holder):
    """zb: each linear of the model's blocks (and their L3 layers) keeps its output, while a forward records, in
    holder._recording (a list, or None: not recording) as (output, weight). A tensor-parallel row linear keeps its
    product before the reduction, so that W needs no collective. The recording call runs eagerly
    (compiler.disable): inside a compiled graph the output would be no tensor of autograd's graph."""
    from nanochat.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, ColumnParallelLinear, RowParallelLinear)) or name in ("lm_head", "smear_gate"):
            continue
        method = "product" if isinstance(module, RowParallelLinear) else "forward"
        setattr(module, method, _recording(getattr(module, method), module.weight, holder))
        module.records_output = True


def _recording(call, weight, holder):
    @torch.compiler.disable
    def record(x):
        y = call(x)
        if holder._recording is not None and torch.is_grad_enabled():
            holder._recording.append((y, weight))
        return y
    return record


def backward_input(outputs, grads, received, recorded, params):
    """B: one backward from a chunk's outputs to its received inputs (none on chunk 0), the recorded linear outputs and the parameters
    that are no recorded linear's weight; the graph is kept for backward_weight."""
    deferred = {id(w) for _, w in recorded}
    others = [p for p in params if p.requires_grad and id(p) not in deferred]
    torch.autograd.backward(outputs, grads, inputs=received + [y for y, _ in recorded] + others, retain_graph=True)


def backward_weight(recorded):
    """W: from each recorded linear output, with the gradient B left there, one backward to that linear's weight
    alone (a backward to all of them at once would also run down each output's input to the earlier weights).
    Under --recompute block, one GraphExecGroup makes these backwards recompute each block once, not once each."""
    with torch.utils.checkpoint.GraphExecGroup():
        for y, weight in recorded:
            torch.autograd.backward(y, y.grad, inputs=[weight])
            y.grad = None


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
            src = layout.peer(pp=stage)
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
