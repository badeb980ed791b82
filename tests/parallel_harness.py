"""Train a tiny GPT for a few steps at a given (DP, CP, TP, PP) layout on fixed batches, in processes
started with torch.multiprocessing (gloo, CPU, fp32), and return the losses and the full parameters.
The setup, the step (with base_train's schedules) and the checkpoint save are base_train's own
(nanochat.training.setup and its Trainer). The equivalence tests compare each layout against one process.

The ranks are a pool of processes kept for the whole test session (spawn): each imported torch and nanochat once,
and runs one layout after another, each in a process group of its own (gloo, a new port per run). Starting a
world per run cost seconds of imports per rank, most of the suite's time."""

import os
import math
import sys
import atexit
import shutil
import socket
import datetime
import tempfile
import traceback
import multiprocessing

import torch
import torch.distributed as dist

CONFIG = dict(sequence_len=32, vocab_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")
GLOBAL_BATCH = 8   # sequences per step
MICRO_BATCH = 2    # sequences per micro-batch per process
# Modest LRs and decay (not base_train's): Adam (eps 1e-10) and the cautious-decay mask turn float-order noise in
# near-zero gradients into steps of up to lr (and lr*wd*|w|), so the tolerance is only meaningful when those are small.
LRS = dict(embedding_lr=0.01, unembedding_lr=0.004, matrix_lr=0.02, scalar_lr=0.02, weight_decay=0.01)


def fixed_batches(steps, seed=1234, sequence_len=None, documents=False):
    """Learnable sequences: arithmetic progressions mod the vocabulary, random start and stride. documents: rows
    packed from documents (each a progression after a BOS, id 0) of 3 to sequence_len/2 tokens, so that some are
    shorter and some longer than a context-parallel chunk."""
    g = torch.Generator().manual_seed(seed)
    T = (sequence_len or CONFIG["sequence_len"]) + 1
    t = torch.arange(T)
    out = []
    for _ in range(steps):
        start = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
        rows = (start + stride * t) % CONFIG["vocab_size"]
        if documents:
            for row in rows:
                pos = 0
                while pos < T:
                    row[pos] = 0  # BOS
                    pos += int(torch.randint(3, T // 2, (1,), generator=g))
        out.append(rows)
    return out


def leave_identity_init(model):
    """At init the blocks are identities (zero output projections), so some gradients are exactly zero
    in exact arithmetic (e.g. block 0's lambdas only rescale x before a scale-invariant norm) and float
    noise of order 1e-9 there gets a full Adam step in one layout and not in another. Start from a
    generic point instead: the same small random output projections and lambda offsets everywhere."""
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for block in model.blocks:
            mlp = block.mlp  # an MoE's output projections: its experts' and its shared expert's
            outs = [mlp.c_proj.weight] if hasattr(mlp, "c_proj") else \
                list(mlp.proj.values()) + ([mlp.shared.c_proj.weight] if mlp.shared is not None else [])
            for w in [block.attn.c_proj.weight] + outs:
                w.copy_(torch.randn(w.shape, generator=g) * 0.02)
            block.x0_lambda.add_(torch.rand((), generator=g) * 0.1)
        model.backout_lambda.fill_(0.1)
        model.smear_lambda.fill_(0.1)
        for layer in model.l3.values():  # W_mix starts at zero (a no-op layer): its tables would get no gradient
            layer.w_mix.weight.copy_(torch.randn(layer.w_mix.weight.shape, generator=g) * 0.02)


def allocate_l3(model):
    """A fresh run's L3 allocation, as base_train makes it from the training data (l3.allocate_for_model):
    LZW credits of the first fixed batches. Skewed, unlike the uniform split init_weights leaves, so a
    resumed run that did not load the saved bounds would look up other rows."""
    from nanochat.l3 import lzw_credits, allocate_rows
    tokens = torch.cat([b.flatten() for b in fixed_batches(4)])
    for layer in model.l3.values():
        rows = allocate_rows(lzw_credits(tokens, layer.vocab_size), layer.n_emb, layer.k_max)
        layer.set_allocation(rows, float(rows.mean()))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class count_l3_lookups:
    """Inside it, L3's lookups in training, by whether a plan made ahead (on the planner thread) waited for them."""

    def __init__(self):
        self.counts = {"planned ahead": 0, "planned at the lookup": 0}

    def __enter__(self):
        from nanochat.l3 import L3Layer
        self.lookup = lookup = L3Layer.lookup

        @torch.compiler.disable
        def counted(layer, x, ids):
            self.counts["planned ahead" if layer.plans_ahead else "planned at the lookup"] += 1
            return lookup(layer, x, ids)
        L3Layer.lookup = counted

    def __exit__(self, *exc):
        from nanochat.l3 import L3Layer
        L3Layer.lookup = self.lookup


def _worker(rank, world, tp, pp, sequence_parallel, schedule, steps, port, out_dir, config_overrides, resume_from,
            overlap, recompute="none", compile_backend=None, fp8=False, virtual=1, cp=1, documents=False,
            shard_params=False, keep_gathered=False, micro_batch=MICRO_BATCH, ep=1, cp_exchange=None, dtype="float32"):
    """One process of the run: base_train's setup and step (nanochat.training), on the fixed batches."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:  # a run that fails on one rank makes the others fail within the timeout, not hang
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from nanochat.distributed import build_layout
    from nanochat.gpt import GPTConfig
    from nanochat.recipe import Setting, LearningRates
    from nanochat import checkpoint_manager as ckpt
    from nanochat import training
    layout = build_layout(rank, world, rank, tp, pp, cp, ep)
    torch.manual_seed(0)

    def after_init(model):
        if fp8:  # forced on CPU: the products run on emulated fp8 operands (torch._scaled_mm's CPU path)
            from nanochat.fp8 import convert_to_fp8
            convert_to_fp8(model, force=True)
        leave_identity_init(model)
        if resume_from is None:
            allocate_l3(model)
        for layer in model.l3.values():  # the path GPUs take (CPU would mostly pick padded): its gradient summed in place
            layer.path = "blocked"

    resume, first_step = None, 0
    if resume_from is not None:
        model_state, optim_state, meta = ckpt.load_checkpoint(resume_from, device="cpu")
        resume, first_step = (model_state, optim_state), meta["step"]
    per_rank = GLOBAL_BATCH // layout.dp_size
    config = GPTConfig(**{**CONFIG, **config_overrides})
    setting = Setting(dp=layout.dp_size, tp=tp, pp=pp, cp=cp, cp_exchange=cp_exchange, ep=ep, pp_schedule=schedule,
                      pp_virtual=virtual, sequence_parallel=sequence_parallel, shard_params=shard_params,
                      keep_gathered=keep_gathered, overlap_grad_reduce=overlap, device_batch=micro_batch,
                      total_batch=GLOBAL_BATCH * config.sequence_len, recompute=recompute)
    trainer = training.setup(config, setting, layout, torch.device("cpu"), getattr(torch, dtype), LearningRates(**LRS),
                             after_init=after_init, resume=resume, compile=compile_backend)
    # a warmup and a warmdown, so that every layout applies a learning rate that changes from step to step
    schedule_of_steps = training.Schedule(steps, LRS["weight_decay"], warmup_steps=2, warmdown_ratio=0.5)
    batches = fixed_batches(steps, sequence_len=config.sequence_len, documents=documents)
    losses, overlapped, graphs, grad_norms, reductions, started = [], [], [], [], [], []
    for i, b in enumerate(trainer.dp.buckets):  # which buckets' reductions a step starts (each once: twice only costs)
        b.launch = (lambda launch, i: lambda bucket: started.append(i) or launch(bucket))(b.launch, i)
    l3_lookups = count_l3_lookups()
    for step in range(first_step, steps):
        rows = batches[step][layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]
        micro = [(rows[i:i + micro_batch, :-1], rows[i:i + micro_batch, 1:]) for i in range(0, per_rank, micro_batch)]
        if not training.reads_data(layout):  # as base_train: a middle pipeline stage reads no data
            micro = [(None, None)] * len(micro)
        with l3_lookups:
            loss, _ = trainer.step(micro, schedule_of_steps, step)
        losses.append(loss.item())
        grad_norms.append(trainer.optimizer.grad_norms.tolist())
        overlapped.append(trainer.dp.launched_in_backward / len(trainer.dp.buckets))
        reductions.append([started.count(i) for i in range(len(trainer.dp.buckets))])
        started.clear()
        if compile_backend is not None:  # graphs compiled so far in this run: a recompile adds one
            from torch._dynamo.utils import counters
            graphs.append(counters["stats"]["unique_graphs"])
        if step + 1 == steps // 2 and out_dir is not None:  # a mid-run checkpoint, saved as base_train saves
            trainer.save_checkpoint(os.path.join(out_dir, "ckpt"), step + 1, None, {})
    # val bpb as base_train computes it (loss_eval.evaluate_bpb: Trainer.eval_loss through the pipeline under PP, the
    # sums over DP and from the last stage), every token one byte, over all of the first batch's rows: this rank's
    # share in micro-batches; times ln 2, the mean loss per token, the same for every layout
    from nanochat.loss_eval import evaluate_bpb
    rows = batches[0][layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]
    micro = [(rows[i:i + micro_batch, :-1], rows[i:i + micro_batch, 1:]) if training.reads_data(layout) else (None, None)
             for i in range(0, per_rank, micro_batch)]
    with torch.no_grad(), trainer.evaluating():
        val_loss = evaluate_bpb(trainer.eval_loss, iter(micro), len(micro), torch.ones(config.vocab_size), layout) * \
            math.log(2)
    # the loss of whole sequences, as CORE and sampling see the model: pipeline and sequence-parallel
    # layouts evaluate the gathered whole copy base_train builds for them; with fp8, in bf16 as base_train does
    with torch.no_grad(), trainer.whole_model() as eval_model:
        eval_loss = eval_model(batches[0][:, :-1], batches[0][:, 1:]).item()
        model_state = ckpt.full_model_state(eval_model if ep > 1 else trainer.model)  # EP: the copy holds every expert
    gathered_peak = trainer.dp.weights.gathered_peak if trainer.dp.weights is not None else 0
    torch.save({**trainer.optimizer.held_bytes(), "gathered_peak": gathered_peak}, os.path.join(out_dir, f"held{rank}.pt"))
    if layout.dp_rank == 0 and layout.cp_rank == 0 and layout.tp_rank == 0:
        torch.save({"losses": losses, "params": model_state, "eval_loss": eval_loss, "val_loss": val_loss,
                    "overlapped": overlapped,
                    "graphs": graphs, "grad_norms": grad_norms, "l3_lookups": l3_lookups.counts, "reductions": reductions,
                    "exchange": getattr(trainer.model.sequence, "exchange", None)},  # CP's, as the attention calls it
                   os.path.join(out_dir, f"stage{layout.pp_rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The pool of ranks


def _serve(conn):
    """A pool process: run fn(rank, *args) for each request, answer None or the traceback; stop when asked or when
    the test process is gone. Between runs, what a run leaves behind in the process is reset: torch.compile's
    caches and counters (the tests count graphs), the process group of a run that failed."""
    import torch
    torch.set_num_threads(1)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        fn, rank, args = request
        if "torch._dynamo" in sys.modules:
            import torch._dynamo
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        try:
            fn(rank, *args)
            answer = None
        except BaseException:
            answer = traceback.format_exc()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.send(answer)


class RankPool:
    """Processes that run functions as the ranks of a world: spawn(fn, args, nprocs) is torch.multiprocessing.spawn's
    call, on processes that are already up. A failing run takes the pool down (its other ranks may wait in a
    collective); the next run starts a new one."""

    def __init__(self):
        self.procs, self.conns = [], []

    def grow(self, n):
        ctx = multiprocessing.get_context("spawn")
        while len(self.procs) < n:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,))
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)

    def spawn(self, fn, args=(), nprocs=1, timeout=600):
        self.grow(nprocs)
        for rank in range(nprocs):
            self.conns[rank].send((fn, rank, args))
        failures = []
        for rank in range(nprocs):
            wait = 30 if failures else timeout  # after a failure, the other ranks' answers too: one may hold its cause
            if not self.conns[rank].poll(wait):
                failures.append(f"rank {rank}: no answer within {wait} s")
                continue
            try:
                answer = self.conns[rank].recv()
            except EOFError:
                answer = f"rank {rank}: its process died (exit code {self.procs[rank].exitcode})"
            if answer is not None:
                failures.append(f"rank {rank}:\n{answer}")
        if failures:
            self.close(kill=True)
            raise RuntimeError("a pooled run failed:\n" + "\n".join(failures))

    def close(self, kill=False):
        for proc, conn in zip(self.procs, self.conns):
            if kill:
                proc.kill()
            else:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []


POOL = RankPool()
atexit.register(POOL.close)


def spawn(fn, args=(), nprocs=1):
    """fn(rank, *args) on nprocs ranks of the pool (torch.multiprocessing.spawn's call)."""
    POOL.spawn(fn, args, nprocs)


_runs_root = None


def _new_run_dir():
    """A folder for one run's checkpoints and results; they all go when the test session ends."""
    global _runs_root
    if _runs_root is None:  # made here, not at import: spawned workers import this module too
        _runs_root = tempfile.mkdtemp(prefix="nanochat_layouts_")
        atexit.register(shutil.rmtree, _runs_root, True)
    return tempfile.mkdtemp(dir=_runs_root)


def run_layout(dp=1, tp=1, pp=1, sequence_parallel=False, schedule="1f1b", steps=5, config_overrides=None,
               resume_from=None, out_dir=None, overlap=True, recompute="none", compile_backend=None, fp8=False, virtual=1,
               cp=1, documents=False, shard_params=False, keep_gathered=False, micro_batch=MICRO_BATCH, ep=1,
               cp_exchange=None, dtype="float32"):
    """Returns {"losses": [...], "params": {name: full tensor}, "eval_losses": [the whole-sequence loss
    after training, from each stage's first rank], "overlapped": [per stage, per step: the share of the buckets whose
    reduction the backward launched], "reductions": [per stage, per step: how many times each bucket's reduction
    started], "graphs": [per stage, per step: graphs torch.compile made so far],
    "dir": out_dir}. overlap: the optimizer's overlapped gradient reduction (a no-op at DP = 1).
    recompute: --recompute's mode. compile_backend: train through compile_for_training with this
    torch.compile backend (None: eager). fp8: the eligible linears in fp8 (emulated on CPU; the model
    needs n_embd >= 128 for any to be eligible). virtual: --pp-virtual (chunks per pipeline rank). cp: --cp (each
    sequence over cp ranks). documents: batches packed from BOS-led documents (fixed_batches). shard_params,
    keep_gathered: --shard-params and --keep-gathered. micro_batch: sequences per micro-batch per process. ep: --ep
    (experts over ep of the dp ranks). cp_exchange: --cp-exchange (None: its default). dtype: the compute dtype.
    The result's "held" lists, per rank, the bytes of weights, gradients and optimizer state it held (and the most
    bytes of gathered whole weights it had alive at once, "gathered_peak", their largest over the ranks)."""
    world = dp * tp * pp * cp
    out_dir = out_dir or _new_run_dir()
    args = (world, tp, pp, sequence_parallel, schedule, steps, _free_port(), out_dir, config_overrides or {}, resume_from, overlap,
            recompute, compile_backend, fp8, virtual, cp, documents, shard_params, keep_gathered, micro_batch, ep,
            cp_exchange, dtype)
    if world == 1:
        _worker(0, *args)
    else:
        spawn(_worker, args, world)
    params, losses, eval_losses, overlapped, graphs, grad_norms, exchange, l3_lookups, reductions, stage_losses = \
        {}, None, [], [], [], None, None, [], [], []
    for s in range(pp):
        part = torch.load(os.path.join(out_dir, f"stage{s}.pt"), weights_only=True)
        params.update(part["params"])
        eval_losses.append(part["eval_loss"])
        overlapped.append(part["overlapped"])
        graphs.append(part["graphs"])
        l3_lookups.append(part["l3_lookups"])
        reductions.append(part["reductions"])
        if s == pp - 1:
            losses, grad_norms, exchange, val_loss = part["losses"], part["grad_norms"], part["exchange"], part["val_loss"]
        stage_losses.append((part["losses"], part["val_loss"]))
    # the last stage's training and validation losses, broadcast to every stage
    assert all(s == (losses, val_loss) for s in stage_losses), stage_losses
    held = [torch.load(os.path.join(out_dir, f"held{r}.pt"), weights_only=True) for r in range(world)]
    return {"losses": losses, "params": params, "eval_losses": eval_losses, "val_loss": val_loss, "overlapped": overlapped, "graphs": graphs,
            "grad_norms": grad_norms, "exchange": exchange, "l3_lookups": l3_lookups, "reductions": reductions, "held": held, "gathered_peak": max(h["gathered_peak"] for h in held), "dir": out_dir}
