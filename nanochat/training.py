"""
The training core, written once: base_train, the parallel-equivalence tests and the dev tools build and step the
model through `setup` and its Trainer, so the tests check what the product runs. setup applies the whole order in
one function (as torchtitan applies its plan), for a recipe.Setting it checks first: build -> L3 rows allocated ->
fp8 -> resumed weights -> TP -> CP -> pipeline stage -> experts placed -> attention kernel settled before any trace
-> split-K tuned -> data parallelism and its optimizer -> weights sharded -> optimizer state -> recompute -> compile.
"""

import os
import copy
import json
import zlib
import math
import time
import itertools
import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanochat.common import print0, ConfigError
from nanochat.distributed import barrier, all_reduce_max, gather_objects, agreed
from nanochat.gpt import build_model, Block, WholeSequence
from nanochat import kernels, moe
from nanochat.l3 import plans_made_ahead
from nanochat.optim import MuonAdamW, muon_stacks, param_groups, split_experts
from nanochat.data_parallel import DataParallel, held_whole
from nanochat.dataloader import DataLoader
from nanochat.loss_eval import evaluate_bpb
from nanochat import checkpoint_manager as ckpt

# -----------------------------------------------------------------------------
# Setup


def setup(config, setting, layout, device, dtype, lrs, l3_data=None, after_init=None, resume=None, compile=None):
    """Build what one training process steps, in the order above; returns its Trainer. lrs: already scaled; l3_data:
    (tokenizer, data_dir) to allocate L3's rows from (a fresh run); after_init(model): a hook on the initialized model
    (tests move the weights off the init point); resume: a checkpoint's (model_state, optim_state or None); compile:
    a torch.compile backend ("inductor", which also compiles the optimizer's updates; the tests' aot_eager) or None."""
    micro_batches = setting.check(config)
    model = build_model(config, device, dtype)
    if config.l3_after_layers and l3_data is not None:
        from nanochat.l3 import allocate_for_model
        allocate_for_model(model, *l3_data, layout)
    if setting.fp8:
        from nanochat.fp8 import convert_to_fp8
        convert_to_fp8(model, device)
    if after_init is not None:
        after_init(model)
    if resume is not None:
        ckpt.load_model_state(model, resume[0])
    flops_per_token = model.estimate_flops()  # of the whole model, with L3's real allocation
    if layout.pp_size > 1:  # the layer split's costs, of the whole model as the planner prices them (TP cuts some)
        from nanochat.pipeline_parallel import Pipeline, block_costs
        costs = block_costs(model)
    if layout.tp_size > 1:
        from nanochat.tensor_parallel import parallelize
        parallelize(model, layout, setting.sequence_parallel)
    if layout.cp_size > 1:
        from nanochat.context_parallel import ContextParallel
        model.sequence = ContextParallel(layout, config.sequence_len, device, setting.exchange)
    pipeline = None
    if layout.pp_size > 1:
        pipeline = Pipeline(model, layout, setting, micro_batches, costs)
    if layout.ep_size > 1:
        from nanochat.expert_parallel import place_experts
        place_experts(model, layout)
    if layout.cp_size == 1:
        attention = kernels.prepare_attention(config, model.window_sizes, device, dtype)
    else:
        chunk = model.sequence.chunk
        attention = (f"attention over cp {layout.cp_size}, K/V by {setting.exchange} "
                     f"({kernels.attention_block_name(device, dtype, config.head_dim)})")
        odd = sorted({w for w in model.window_sizes if w < config.sequence_len and w % chunk})
        if odd and device.type == "cuda" and not kernels.fa4_takes_blocks(device, dtype, config.head_dim):
            print0(f"WARNING: windows {odd} are not whole chunks of {chunk} tokens (--max-seq-len / 2 x --cp): some of "
                   f"their blocks run the reference math (slow, an fp32 score matrix per head; with the all-gather "
                   f"near the sequence's start, and every diagonal where a window is shorter than a chunk; with the "
                   f"ring everywhere); choose --max-seq-len and --cp so that the S window (a quarter of the context) "
                   f"is a multiple of the chunk")
    wgrad_splits = {}
    if device.type == "cuda":  # rank 0's choice, so that every rank computes alike; a rank's tokens (1/cp under CP)
        splits = [kernels.tune_wgrad_splits(model, setting.device_batch * config.sequence_len // layout.cp_size, dtype)]
        if layout.world_size > 1:
            dist.broadcast_object_list(splits, src=0)
        wgrad_splits = splits[0]
        kernels.set_wgrad_splits(model, wgrad_splits)
    groups = param_groups(model, **vars(lrs))
    # data parallelism over DP x CP (same weights, each rank its share of the tokens) says what the optimizer updates;
    # sharded weights at one rank are no sharding. Under --ep the experts have their own, over the ranks holding them
    rest, experts = split_experts(groups, layout.ep_size > 1)
    sharded = setting.shard_params and layout.dp_cp_group is not None
    adamw = [p for g in rest if g["kind"] == "adamw" for p in g["params"]]
    dp = DataParallel([params for _, _, params in muon_stacks(rest)], adamw, layout.dp_cp_group,
                      overlap=setting.overlap_grad_reduce, shard_params=sharded)
    names = {p: n for n, p in model.named_parameters()}
    mine = held_whole([(names[p], p) for p in adamw], dp.size)
    if whole := list(dict.fromkeys(w for stage in gather_objects(mine, layout.cpu_group) for w in stage)):  # all stages
        print0(f"note: {', '.join(f'{n} ({rows:,} rows)' for n, rows in whole)}: rows not divisible by the "
               f"{dp.size} ranks sharing the optimizer (DP x CP), so each holds these whole (more memory); a DP x CP "
               f"dividing them shares them")
    expert_dp = DataParallel([params for _, _, params in muon_stacks(experts)], [], layout.expert_dp_group) \
        if experts else None
    optimizer = MuonAdamW(groups, names, dp, compute_dtype=dtype,
                          compile=compile == "inductor", counts_replicated=layout.tp_rank == 0, expert_dp=expert_dp)
    if sharded:
        from nanochat.sharding import ShardedWeights
        model.weights = dp.weights = ShardedWeights(model, dp, setting.keep_gathered)
    if resume is not None and resume[1] is not None:
        optimizer.load_full_state_dict(resume[1])
    for block in model.blocks:
        if isinstance(block, Block):  # a pipeline stage holds Identities in place of the others' blocks
            block.recompute = setting.recompute
    train_model = model if compile is None else compile_for_training(model, pipeline, dp.overlap or sharded, compile)
    return Trainer(model, train_model, pipeline, optimizer, dp, layout, setting,
                   fp8=any(getattr(m, "fp8", False) for m in model.modules()), flops_per_token=flops_per_token,
                   attention=attention, wgrad_splits=wgrad_splits)


def compile_for_training(model, pipeline, per_block, backend):
    """torch.compile for the training step: the whole model as one graph (returned; the uncompiled module serves
    checkpoints, sampling, CORE); under a pipeline, a graph for each of this stage's chunks of blocks and one for the
    loss, the schedule eager; per_block (gradients wanted as each block's backward ends; gathers between blocks): each
    block compiled in place."""
    # each chunk (its blocks' range) and each L3 layer's eager lookup (it resumes the graph in a frame of its own,
    # gpt.GPT._blocks) get copies of one frame, in training and again in evaluation: past torch's limit of copies the
    # rest would run uncompiled
    chunks = pipeline.virtual if pipeline is not None else 1
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * chunks * (len(model.l3) + 1))
    if pipeline is None and not per_block:
        return torch.compile(model, dynamic=False, backend=backend)
    if per_block:
        for i in pipeline.blocks if pipeline is not None else range(len(model.blocks)):
            model.blocks[i].compile(dynamic=False, backend=backend)
        print0("note: each block and the loss are compiled separately (overlapped gradient reduction or sharded weights)")
    else:
        model.run_blocks = torch.compile(model.run_blocks, dynamic=False, backend=backend)
        print0("note: each of this stage's chunks of blocks and the loss are compiled as graphs of their own (the "
               "schedule stays eager)")
    model.criterion.compile(dynamic=False, backend=backend)
    return model


def check_ranks_agree(layout, data_dir, data_listing, ckpt_dir, saves, resume):
    """Several nodes: every rank must see the same shards, else DP ranks would stride over different lists, and
    resume the same checkpoint (resume: its step and meta; node-local folders may hold other steps) (ConfigError
    naming the ranks). Checkpoints are written by one rank per stage and read by all on resume, so ckpt_dir must be
    one file system: prints a warning naming the hosts that cannot see it."""
    step, meta = resume
    digest = zlib.crc32(json.dumps(meta, sort_keys=True, default=str).encode()) if meta is not None else None
    listings = gather_objects((os.uname().nodename, data_dir, data_listing, (step, digest)), layout.cpu_group)
    differ = [f"rank {r} ({host}: {d})" for r, (host, d, lst, _) in enumerate(listings) if lst != listings[0][2]]
    if differ:
        raise ConfigError(f"the data differs between ranks: {', '.join(differ)} do not see the shards of rank 0 "
                          f"({listings[0][0]}: {listings[0][1]}); give every node the same shards (a copy or a shared folder)")
    theirs = listings[0][3]
    if differ := [f"rank {r} ({host}: step {res[0]})" for r, (host, _, _, res) in enumerate(listings) if res != theirs]:
        raise ConfigError(f"the ranks would resume different checkpoints: {', '.join(differ)} against rank 0's step "
                          f"{theirs[0]} ({listings[0][0]}: {ckpt_dir}); give every node the same checkpoint folder (a "
                          f"shared file system, or a copy of the newest step)")
    if not saves:
        return
    probe = os.path.join(ckpt_dir, f".shared_probe_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    if layout.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        open(probe, "w").close()
    barrier(layout, "creating the checkpoint folder")
    seen = gather_objects((os.uname().nodename, os.path.exists(probe)), layout.cpu_group)
    if layout.rank == 0:  # every rank has looked: the gather above completed
        os.remove(probe)
    if blind := sorted({host for host, ok in seen if not ok}):
        print0(f"WARNING: the checkpoint folder {ckpt_dir} (on {os.uname().nodename}) is not visible from "
               f"{', '.join(blind)}: checkpoints will be split over the nodes' disks and a resume cannot read them. "
               f"Point NANOCHAT_BASE_DIR at a shared file system, or copy the checkpoint to every node before "
               f"resuming.")


def reads_data(layout):
    """Whether this rank reads batches: middle pipeline stages take their inputs from the stage before."""
    return layout.pp_size == 1 or layout.is_first_stage or layout.is_last_stage


def make_loader(tokenizer, split, batch_size, seq_len, device, layout, data_dir, grad_accum=1, state=None,
                keep_remainder=False):
    """This DP rank's (x, y, state) batches, prefetching a whole step (a step starts once all its micro-batches are in:
    with less, the GPU would wait each step for the loader); evaluation (grad_accum 1): one batch at a time."""
    return DataLoader(tokenizer, batch_size, seq_len, split, device, data_dir=data_dir, dp_rank=layout.dp_rank,
                      dp_size=layout.dp_size, state=state, prefetch=grad_accum + 1,
                      keep_remainder=keep_remainder and split == "train")


# -----------------------------------------------------------------------------
# The loop


@dataclass
class Schedule:
    """By step: the LR multiplier, Muon's momentum and Muon's weight decay (the recipe's schedule, recipe.py)."""
    num_iterations: int
    weight_decay: float
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05

    def warmdown_start(self):
        return round(self.num_iterations * (1 - self.warmdown_ratio))

    def warmdown_progress(self, it):  # 0 until the warmdown starts, then linearly to 1 at the end
        start = self.warmdown_start()
        return max(0.0, (it - start) / max(1, self.num_iterations - start))

    def lr_multiplier(self, it):  # linear warmup, flat, linear warmdown to final_lr_frac (the lower, where they meet)
        warmup = (it + 1) / self.warmup_steps if it < self.warmup_steps else 1.0
        return min(warmup, 1.0 - self.warmdown_progress(it) * (1.0 - self.final_lr_frac))

    def muon_momentum(self, it):  # 0.85 -> 0.97 over the first 400 steps, then -> 0.90 over the warmdown
        top = 0.85 + 0.12 * min(1.0, min(it, self.warmdown_start()) / 400)
        return top + (0.90 - top) * self.warmdown_progress(it)

    def muon_weight_decay(self, it):  # cosine to 0
        return self.weight_decay * 0.5 * (1 + math.cos(math.pi * it / self.num_iterations))

    def notes(self, matrix_lr):
        """What base_train says of this schedule at start (matrix_lr: Muon's peak LR): a warmup that meets the
        warmdown, and a decay that would flip weights' signs (LR x decay >= 1: a horizon far under the recipe's)."""
        notes = [f"note: --warmup-steps {self.warmup_steps} runs into the warmdown (from step {self.warmdown_start()}): "
                 f"the LR never reaches its peak (lower --warmup-steps)"] if self.warmup_steps > self.warmdown_start() else []
        step = max(range(self.num_iterations), key=lambda i: self.lr_multiplier(i) * self.muon_weight_decay(i))
        if (shrink := matrix_lr * self.lr_multiplier(step) * self.muon_weight_decay(step)) >= 1:
            notes.append(f"WARNING: Muon's LR x weight decay reaches {shrink:.2f} at step {step} (the recipe's decay "
                         f"grows as the horizon shrinks): a decay step can flip weights' signs; lower --weight-decay")
        return notes


def next_batches(loader, n):
    """n micro-batches [(x, y), ...] and the data state after the last; placeholders on stages that read no data."""
    if loader is None:
        return [(None, None)] * n, None
    items = [next(loader) for _ in range(n)]
    return [(x, y) for x, y, _ in items], items[-1][2]


@dataclass
class Trainer:
    """What one training process steps, evaluates and saves. model: the uncompiled module (checkpoints, evaluation
    with fp8, CORE, sampling); train_model: what the step calls (compiled or the same); pipeline: PP driver or None."""
    model: torch.nn.Module
    train_model: torch.nn.Module
    pipeline: object
    optimizer: MuonAdamW
    dp: DataParallel
    layout: object
    setting: object                 # the recipe.Setting it was built for
    fp8: bool = False               # fp8 linears in training (evaluation runs them in bf16)
    flops_per_token: float = 0.0    # of the whole model, before it was cut up
    attention: str = ""             # the kernel that trains, and split-K per weight shape (for the log)
    wgrad_splits: dict = field(default_factory=dict)
    moe_imbalance: object = None    # after a step with MoE layers: the worst layer's max / mean load (device tensor)

    def step(self, batches, schedule, it):
        """One optimizer step on the whole (B, T) micro-batches [(x, y), ...] (CP: the model takes its chunks): forward
        and backward (the pipeline's schedule under PP), step `it`'s LR, momentum and decay, the update. Returns (the
        loss averaged over micro-batches and DP ranks, a device tensor: nothing waits for the GPU; the LR factor)."""
        with plans_made_ahead(self.model, [x for x, _ in batches]):  # L3's lookups planned on the planner thread
            if self.pipeline is not None:
                loss = self.pipeline.train_step(batches, self.dp.prepare_last_backward)
            else:
                loss = torch.zeros((), device=batches[0][0].device)
                for i, (x, y) in enumerate(batches):  # gradients accumulate in .grad
                    if i == len(batches) - 1:  # this backward completes them: DP reductions may start during it
                        self.dp.prepare_last_backward()
                    micro_loss = self.train_model(x, y)
                    (micro_loss / len(batches)).backward()
                    loss += micro_loss.detach()
                loss = loss / len(batches)
        lrm = schedule.lr_multiplier(it)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = schedule.muon_momentum(it)
                group["weight_decay"] = schedule.muon_weight_decay(it)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        token_groups = [self.layout.dp_cp_group] + ([self.layout.tp_group] if self.setting.sequence_parallel else [])
        self.moe_imbalance = moe.after_step(self.model, token_groups, self.layout.pp_group)
        if os.environ.get("NANOCHAT_TEST_NAN_AT") == f"{it}:{self.layout.rank}":  # the tests' fault: one rank's NaN
            loss = loss * float("nan")
        return self.dp.mean_loss(loss), lrm

    def signals(self):
        """For the step line and metrics.jsonl: the MoE load imbalance, if any (a host sync, after the loss's)."""
        return {} if self.moe_imbalance is None else {"moe_imbalance": self.moe_imbalance.item()}

    def describe(self, print_schedule=False):
        """What setup built, for the log: pipeline (and schedules), split-K, attention, how gradients reach owners."""
        lines = []
        if self.pipeline is not None:
            lines.append(f"pipeline: {self.pipeline.describe()}")
            lines += [self.pipeline.schedule_text()] if print_schedule else []
        if self.wgrad_splits:
            lines.append("weight gradients, split-K by shape (out x in: split, ms plain -> ms split): " + ", ".join(
                f"{o}x{i}: {s} ({t1:.3f} -> {ts:.3f})" for (o, i), (s, t1, ts) in self.wgrad_splits.items()))
        lines.append(f"attention: {self.attention}")
        if self.dp.shard_params:
            lines.append(f"weights sharded over {self.dp.size} data-parallel ranks: each module's gathered around its "
                         f"call" + (", kept until its backward" if self.setting.keep_gathered else " and again for "
                                    "its backward") + "; gradients sent to their owners as each module's backward ends")
        elif self.setting.shard_params:
            lines.append("--shard-params: one data-parallel rank holds everything already (nothing to shard)")
        else:
            lines.append(f"DP gradient reduction: {'overlapped with the last micro-batch backward' if self.dp.overlap else 'after the backward'}")
        return lines

    @contextlib.contextmanager
    def evaluating(self):
        """Evaluation and sampling: eval mode and bf16 linears where training runs fp8 (the same weights)."""
        from nanochat.fp8 import bf16_linears
        self.model.eval()
        try:
            with bf16_linears(self.model):
                yield
        finally:
            self.model.train()

    def val_bpb(self, tokenizer, data_dir, steps, token_bytes):
        """Bits per byte over `steps` batches of the validation shard, in evaluation mode."""
        L, batch, T = self.layout, self.setting.device_batch, self.model.config.sequence_len
        device = next(self.model.parameters()).device
        # a middle pipeline stage reads no data: placeholders (a generator, which closing() closes too)
        loader = make_loader(tokenizer, "val", batch, T, device, L, data_dir) if reads_data(L) else \
            ((None, None) for _ in itertools.count())
        with contextlib.closing(loader), self.evaluating():
            return evaluate_bpb(self.eval_loss, loader, steps, token_bytes, L, label="val bpb")

    def eval_loss(self, x, y):
        """Per-token losses (inside evaluating()): through the pipeline under PP (None on stages without the head);
        with fp8 on the uncompiled model, as the compiled graph was traced with the fp8 flags on."""
        if self.pipeline is not None:
            return self.pipeline.forward_loss(x, y)
        return (self.model if self.fp8 else self.train_model)(x, y, loss_reduction="none")

    @contextlib.contextmanager
    def whole_model(self):
        """The model CORE and sampling run (sequences of any length), in evaluating(): under CP a shallow copy seeing
        whole sequences; under PP, SP, sharded weights or EP a gathered whole copy on every rank (whole_model_copy says
        why), freed after. No new graphs: blocks compiled in place (compile_for_training's per_block) would compile
        again for every new length, up to dynamo's limit of 8, then warn; new lengths run eagerly, compiled code where
        it exists (FlexAttention at the training length)."""
        model = self.model
        if self.pipeline is not None or self.setting.sequence_parallel or self.dp.shard_params or self.layout.ep_size > 1:
            model = ckpt.whole_model_copy(self.model, self.layout)
        elif type(self.model.sequence) is not WholeSequence:
            model = copy.copy(self.model)
            model.sequence = WholeSequence()
        with self.evaluating(), torch.compiler.set_stance("eager_on_recompile"):
            yield model

    def save_checkpoint(self, ckpt_dir, step, data_state, meta, keep_last=-1):
        """Write step's checkpoint (a collective): whole tensors, files per stage, then meta_<step>.json (`meta`, every
        DP rank's data state, the layout); the newest keep_last stay (-1: all). Non-finite weights: CheckpointError."""
        t0 = time.time()
        L = self.layout
        # the optimizer's state too: a huge finite gradient can make AdamW's second moment infinite before the weights
        states = list(self.optimizer.state.values()) + [  # AdamW's, and Muon's held in its stacks
            {"momentum": stack.momentum, "second": stack.second} for _, _, stack in self.optimizer.muon_stacks]
        bad = ckpt.nonfinite_tensors(self.model.state_dict()) + [
            "the optimizer's state" for state in states if ckpt.nonfinite_tensors(state)][:1]
        device = next(self.model.parameters()).device
        if all_reduce_max(float(len(bad) > 0), device) > 0:
            raise ckpt.CheckpointError(f"the weights or the optimizer's state are not finite at step {step} (the run "
                                       f"diverged" +
                                       (f"; e.g. {', '.join(bad[:3])}" if bad else " on another rank") +
                                       "): not saving; try a lower LR, or resume from an earlier checkpoint")
        mine = data_state if L.tp_rank == 0 and L.cp_rank == 0 and L.is_first_stage else None
        everything = gather_objects(mine)
        data_states = sorted((s for s in everything if s is not None), key=lambda s: s["dp_rank"]) if L.world_size > 1 \
            else everything
        # a set of files per pipeline stage and EP rank of the first EP group (rank 0: the replicated weights too)
        from nanochat.expert_parallel import is_expert
        writer = L.dp_rank < L.ep_size and L.cp_rank == 0 and L.tp_rank == 0
        part, parts = L.pp_rank * L.ep_size + L.ep_rank, L.pp_size * L.ep_size
        keep = lambda name: writer and (L.ep_rank == 0 or is_expert(name))  # EP ranks past the first: their experts
        model_state = ckpt.full_model_state(self.model, keep)
        optim_state = self.optimizer.full_state_dict(keep)
        # the stage files, then the meta file (with every file's checksum) that marks the step complete; a
        # CheckpointError on a writer (a full disk) stops every rank with its line
        meta = dict(meta, dataloader_states=data_states,
                    layout={"dp": L.dp_size, "cp": L.cp_size, "tp": L.tp_size, "pp": L.pp_size, "ep": L.ep_size})
        written = agreed(lambda: ckpt.save_stage_files(ckpt_dir, step, model_state, optim_state, part, parts),
                         ckpt.CheckpointError, device, mine=writer)
        meta["checksums"] = {name: crc for part in gather_objects(written or {}) for name, crc in part.items()}
        agreed(lambda: ckpt.save_meta(ckpt_dir, step, meta, parts), ckpt.CheckpointError, device, mine=L.rank == 0)
        if L.rank == 0 and keep_last > 0:
            try:  # this step is saved: an older one left behind costs disk, not the run
                ckpt.prune_checkpoints(ckpt_dir, keep_last)
            except OSError as e:
                print0(f"WARNING: could not delete an older checkpoint in {ckpt_dir} ({e}); delete it by hand")
        print0(f"saved checkpoint for step {step} to {ckpt_dir} ({time.time() - t0:.1f}s)")
