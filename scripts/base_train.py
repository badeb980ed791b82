"""
Pretrain a base model. One dial, --depth; the scaling-law formulas pick the rest.

    python -m scripts.base_train --depth=12
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=4 -m scripts.base_train --depth=32 --tp=2 --pp=2

The recipe (printed at start):
  horizon  D = --num-iterations * B, else --target-flops / FLOPs-per-token, else ratio * scaling params
  batch    B = 2^19 * (D / D_ref)^0.383 rounded to a power of 2 (Power Lines), D_ref = ratio * N(d12)
  LRs      every LR * sqrt(B / 2^19)
  decay    wd = wd_ref * sqrt(B / 2^19) * D_ref / D
  schedule LR: 40-step warmup, flat, linear warmdown over the last 65% to 5%; Muon momentum
           0.85 -> 0.97 over 400 steps, then -> 0.90 during warmdown; Muon wd cosine-decayed to 0
"""

import os
import gc
import atexit
import contextlib
import math
import time
import json
import argparse

import torch
import torch.distributed as dist

from nanochat.common import (compute_init, compute_cleanup, print0, print_rank, get_compute_dtype, get_peak_flops,
                             device_name, all_reduce_max, fail, install_stop_handlers, stop_agreed, Interrupted,
                             cpu_memory_error)
from nanochat.gpt import (GPTConfig, config_for_depth, build_model, window_sizes, prepare_attention, GPT,
                         tune_wgrad_splits, set_wgrad_splits)
from nanochat.optim import MuonAdamW
from nanochat.dataloader import DataLoader, reshard_states
from nanochat.dataset import DataError, check_data
from nanochat.tokenizer import get_tokenizer, get_token_bytes, TokenizerError
from nanochat.loss_eval import evaluate_bpb, default_eval_tokens
from nanochat import checkpoint_manager as ckpt
from nanochat import report

B_REF = 2 ** 19  # the reference batch (tokens) at which LRs and weight decay were tuned (d12)

# -----------------------------------------------------------------------------
# Flags

parser = argparse.ArgumentParser(description="Pretrain a base model")
# runtime
parser.add_argument("--wandb-run", type=str, default="dummy", help="wandb run name ('dummy' = no wandb)")
parser.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
parser.add_argument("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR or base_data)")
# model
parser.add_argument("--depth", type=int, default=20, help="number of blocks: the one dial")
parser.add_argument("--aspect-ratio", type=int, default=64, help="model_dim = depth * aspect_ratio (rounded up to head_dim)")
parser.add_argument("--head-dim", type=int, default=128, help="attention head dimension")
parser.add_argument("--n-kv-head", type=int, default=0, help="key/value heads for GQA (0 = as many as query heads)")
parser.add_argument("--max-seq-len", type=int, default=2048, help="context length")
parser.add_argument("--window-pattern", type=str, default="SSSL", help="sliding windows tiled over layers: S=quarter context, L=full")
# horizon
parser.add_argument("--num-iterations", type=int, default=-1, help="optimizer steps (-1 = from flops or ratio)")
parser.add_argument("--target-flops", type=float, default=-1.0, help="training FLOPs budget (-1 = use the ratio)")
parser.add_argument("--target-param-data-ratio", type=float, default=12.0, help="tokens per scaling parameter")
# batch
parser.add_argument("--device-batch-size", type=int, default=32, help="sequences per micro-batch per process")
parser.add_argument("--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1 = Power Lines formula)")
parser.add_argument("--keep-remainder", action="store_true", help="data: put cropped document tails back as new BOS pieces instead of dropping them")
# optimizer
parser.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW LR of the embeddings")
parser.add_argument("--unembedding-lr", type=float, default=0.008, help="AdamW LR of the lm_head")
parser.add_argument("--matrix-lr", type=float, default=0.02, help="Muon LR of the block matrices")
parser.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW LR of the scalars")
parser.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay at the reference batch and horizon")
parser.add_argument("--warmup-steps", type=int, default=40, help="LR warmup steps")
parser.add_argument("--warmdown-ratio", type=float, default=0.65, help="fraction of steps in the final linear LR decay")
parser.add_argument("--final-lr-frac", type=float, default=0.05, help="LR multiplier at the end of warmdown")
# evaluation, sampling, checkpoints
parser.add_argument("--eval-every", type=int, default=250, help="val bpb every N steps (-1 = only at the end)")
parser.add_argument("--eval-tokens", type=int, default=-1, help="tokens of validation data per evaluation (0 = no evaluation; "
                                                                  "-1 = 20 x 2^19 on a GPU, 2^18 elsewhere)")
parser.add_argument("--core-metric-every", type=int, default=2000, help="CORE every N steps (-1 = never)")
parser.add_argument("--core-metric-max-per-task", type=int, default=500, help="items per CORE task during training")
parser.add_argument("--eval-bundle", type=str, default=None, help="CORE bundle folder (default: download)")
parser.add_argument("--sample-every", type=int, default=2000, help="print completions every N steps (-1 = never)")
parser.add_argument("--save-every", type=int, default=-1, help="checkpoint every N steps (-1 = only at the end, 0 = never)")
parser.add_argument("--keep-last", type=int, default=-1, help="keep only the newest N checkpoints of the model tag (-1 = all)")
parser.add_argument("--resume-from-step", type=int, default=-1, help="resume from this checkpoint step (-1 = start fresh)")
parser.add_argument("--model-tag", type=str, default=None, help="checkpoint folder name (default: d<depth>)")
parser.add_argument("--compile", type=int, default=-1, help="torch.compile the model and optimizer (-1 = on CUDA only)")
# parallelism
parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
parser.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard norms/residual along the sequence")
parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
parser.add_argument("--pp-schedule", type=str, default="1f1b", choices=["gpipe", "1f1b"], help="pipeline schedule")
parser.add_argument("--pp-print-schedule", action="store_true", help="print the pipeline schedule table at start")
# fp8, L3
parser.add_argument("--fp8", action="store_true", help="fp8 training linears through torchao (CUDA, SM89+)")
parser.add_argument("--fp8-recipe", type=str, default="tensorwise", choices=["tensorwise", "rowwise"], help="torchao float8 scaling recipe")
parser.add_argument("--l3-after-layers", type=str, default="", help="comma-separated block indices followed by an L3 layer, e.g. 4,8")
parser.add_argument("--l3-n-emb", type=int, default=0, help="rows of the L3 tables (0 = 16 per vocabulary entry)")
parser.add_argument("--l3-d-up", type=int, default=0, help="L3 up-projection width (0 = 4 * model_dim)")
parser.add_argument("--l3-k-max", type=int, default=512, help="most table rows one token may own")
parser.add_argument("--l3-tied", type=int, nargs="?", const=1, default=1, choices=(0, 1),
                    help="1: one L3 table serves as keys and values (K = V); 0: two tables. Tied measured as good and "
                         "faster at d12 (dev/LOG.md)")
args = parser.parse_args()
user_config = vars(args).copy()

# -----------------------------------------------------------------------------
# Processes, device, dtype

try:
    layout, device = compute_init(args.device_type, tp=args.tp, pp=args.pp)
except (ValueError, RuntimeError) as e:
    fail(str(e))
master = layout.rank == 0
dtype = get_compute_dtype(device.type)
use_compile = (device.type == "cuda") if args.compile < 0 else bool(args.compile)
print0(f"world {layout.world_size} = dp {layout.dp_size} x tp {layout.tp_size} x pp {layout.pp_size}; "
       f"device {device_name(device.type)}; compute dtype {dtype}; compile {use_compile}")
if layout.world_size > 1:
    print_rank(layout, f"global rank {layout.rank}")


if args.device_batch_size < 1:
    fail(f"--device-batch-size must be at least 1 (got {args.device_batch_size})")
if args.core_metric_max_per_task == 0 or args.core_metric_max_per_task < -1:
    fail("--core-metric-max-per-task must be a positive number of items, or -1 for all")
if args.keep_last == 0 or args.keep_last < -1:
    fail("--keep-last must be a positive number of checkpoints, or -1 to keep all")
eval_tokens = default_eval_tokens(device.type) if args.eval_tokens < 0 else args.eval_tokens

# -----------------------------------------------------------------------------
# Tokenizer, model config (from the checkpoint when resuming)

try:
    tokenizer = get_tokenizer()
    token_bytes = get_token_bytes(device)
except TokenizerError as e:
    fail(str(e))
vocab_size = tokenizer.get_vocab_size()
try:
    data_dir = check_data(args.data_dir)
except DataError as e:
    fail(str(e))
model_tag = args.model_tag or f"d{args.depth}"
ckpt_dir = ckpt.checkpoint_dir(model_tag)

resume_meta = None
if args.resume_from_step >= 0:
    try:
        resume_meta = ckpt.load_meta(ckpt_dir, args.resume_from_step)
    except ckpt.CheckpointError as e:
        fail(str(e))
    try:
        ckpt.check_tokenizer(resume_meta, tokenizer, ckpt_dir)
    except ckpt.CheckpointError as e:
        fail(str(e))
    config = GPTConfig.from_dict(resume_meta["model_config"])
    # the schedule, batch and data shape come from the flags: they must be the ones of the saved run
    saved = resume_meta.get("user_config", {})
    recipe = ["max_seq_len", "num_iterations", "target_flops", "target_param_data_ratio", "total_batch_size",
              "embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "weight_decay", "warmup_steps",
              "warmdown_ratio", "final_lr_frac", "keep_remainder"]
    changed = {k: (saved[k], user_config[k]) for k in recipe if k in saved and saved[k] != user_config[k]}
    if changed:
        fail("resuming with other settings than the saved run: " +
             ", ".join(f"--{k.replace('_', '-')} was {a}, now {b}" for k, (a, b) in changed.items()) +
             ". Pass the same flags as the original run (its command is in meta_*.json, user_config).")
    print0(f"resuming from step {args.resume_from_step} of {ckpt_dir}")
else:
    try:
        l3_layers = tuple(sorted({int(s) for s in args.l3_after_layers.split(",") if s.strip()}))
    except ValueError:
        fail(f"--l3-after-layers {args.l3_after_layers!r} must be comma-separated block indices, e.g. 4,8")
    if any(not 0 <= i < args.depth for i in l3_layers):
        fail(f"--l3-after-layers {args.l3_after_layers!r}: block indices must be in 0..{args.depth - 1}")
    try:
        config = config_for_depth(args.depth, args.aspect_ratio, args.head_dim, vocab_size, args.max_seq_len,
                                  args.window_pattern, n_kv_head=args.n_kv_head, l3_after_layers=l3_layers,
                                  l3_n_emb=args.l3_n_emb, l3_d_up=args.l3_d_up, l3_k_max=args.l3_k_max,
                                  l3_tied=bool(args.l3_tied and l3_layers))
    except ValueError as e:
        fail(str(e))
try:
    window_sizes(config)
except ValueError as e:
    fail(str(e))
print0(f"model config: {json.dumps(config.to_dict())}")

# -----------------------------------------------------------------------------
# Scaling-law recipe

with torch.device("meta"):
    meta_model = GPT(config)
    ref_model = GPT(config_for_depth(12, args.aspect_ratio, args.head_dim, vocab_size, args.max_seq_len, args.window_pattern))
num_scaling_params = meta_model.num_scaling_params()
flops_per_token = meta_model.estimate_flops()
param_counts = meta_model.parameter_counts()
D_REF = args.target_param_data_ratio * ref_model.num_scaling_params()
del meta_model, ref_model

if args.target_flops > 0:
    D_opt, horizon_source = args.target_flops / flops_per_token, f"--target-flops {args.target_flops:.3g}"
else:
    D_opt, horizon_source = args.target_param_data_ratio * num_scaling_params, f"ratio {args.target_param_data_ratio} x {num_scaling_params:,} scaling params"
if args.total_batch_size > 0:
    total_batch_size = args.total_batch_size
else:
    total_batch_size = 2 ** round(math.log2(B_REF * (D_opt / D_REF) ** 0.383))
if args.num_iterations > 0:
    num_iterations, horizon_source = args.num_iterations, "--num-iterations"
else:
    num_iterations = max(1, round(D_opt / total_batch_size))
D = num_iterations * total_batch_size
lr_scale = math.sqrt(total_batch_size / B_REF)
weight_decay = args.weight_decay * lr_scale * (D_REF / D)

tokens_per_micro = args.device_batch_size * args.max_seq_len * layout.dp_size
if total_batch_size % tokens_per_micro != 0:
    fail(f"--total-batch-size {total_batch_size:,} is not a multiple of device_batch_size x seq_len x dp "
         f"= {args.device_batch_size} x {args.max_seq_len} x {layout.dp_size} = {tokens_per_micro:,}; "
         f"change --device-batch-size or --total-batch-size (a power of 2 works with powers of 2)")
grad_accum = total_batch_size // tokens_per_micro
if args.pp > 1 and grad_accum < args.pp:
    fail(f"pipeline parallelism needs at least pp={args.pp} micro-batches per step, got {grad_accum} "
         f"(= {total_batch_size:,} / {tokens_per_micro:,}); lower --device-batch-size or raise --total-batch-size")

if device.type == "cpu" and (error := cpu_memory_error(param_counts["total"], config, args.device_batch_size, args.max_seq_len)):
    fail(error)

print0(f"parameters: {param_counts['total']:,} total | {param_counts['scaling']:,} scaling | "
       f"{param_counts['embeddings']:,} embeddings" + (f" | {param_counts['l3 tables (sparse)']:,} L3 sparse, "
                                                       f"{param_counts['active']:,} active" if config.l3_after_layers else ""))
print0(f"FLOPs per token: {flops_per_token:.4e}")
print0(f"horizon: {D:,} tokens = {num_iterations:,} steps x {total_batch_size:,} tokens (from {horizon_source}); "
       f"tokens/scaling param = {D / num_scaling_params:.2f}; D_ref = {D_REF:,.0f}")
print0(f"batch: {total_batch_size:,} tokens = {args.device_batch_size} x {args.max_seq_len} x dp {layout.dp_size} x "
       f"grad accum {grad_accum}" + ("" if args.total_batch_size > 0 else " (Power Lines: 2^19 * (D_opt/D_ref)^0.383)"))
if args.warmup_steps > num_iterations:
    print0(f"note: --warmup-steps {args.warmup_steps} is longer than the run ({num_iterations} steps): the LR never "
           f"reaches its peak (lower --warmup-steps)")
print0(f"LR scale sqrt(B/2^19) = {lr_scale:.4f}; Muon weight decay = {args.weight_decay} x {lr_scale:.4f} x "
       f"D_ref/D {D_REF / D:.4f} = {weight_decay:.5f}; total FLOPs {flops_per_token * D:.4e}")

# -----------------------------------------------------------------------------
# Model, parallelism, optimizer

model = build_model(config, device, dtype)
if config.l3_after_layers and resume_meta is None:
    from nanochat.l3 import allocate_for_model
    allocate_for_model(model, tokenizer, data_dir, layout)
    flops_per_token = model.estimate_flops()  # with the real allocation (the meta model assumed k_max rows)
fp8_active = False
if args.fp8:
    if args.tp > 1:
        fail("--fp8 with --tp > 1 is not supported yet (torchao's Float8Linear would replace the sharded linears)")
    from nanochat.fp8 import convert_to_fp8
    fp8_active = convert_to_fp8(model, args.fp8_recipe, device) > 0
if args.tp > 1:
    from nanochat import tensor_parallel
    try:
        tensor_parallel.parallelize(model, layout, sequence_parallel=args.sequence_parallel)
    except ValueError as e:
        fail(str(e))
elif args.sequence_parallel:
    fail("--sequence-parallel needs --tp > 1")
pipeline = None
if args.pp > 1:
    from nanochat.pipeline_parallel import Pipeline
    try:
        pipeline = Pipeline(model, layout, grad_accum, args.device_batch_size, args.pp_schedule)
    except ValueError as e:
        fail(str(e))
    print0(f"pipeline: {pipeline.describe()}")
    if args.pp_print_schedule:
        print0(pipeline.schedule_table())
if device.type == "cuda":
    # per weight shape, whether a split-K weight gradient is faster on this GPU (gpt.Linear); rank 0's
    # choice, so that every rank computes alike
    wgrad_splits = [tune_wgrad_splits(model, args.device_batch_size * args.max_seq_len, dtype)]
    if layout.world_size > 1:
        dist.broadcast_object_list(wgrad_splits, src=0)
    set_wgrad_splits(model, wgrad_splits[0])
    print0("weight gradients, split-K by shape (out x in: split, ms plain -> ms split): " + ", ".join(
        f"{o}x{i}: {s} ({t1:.3f} -> {ts:.3f})" for (o, i), (s, t1, ts) in wgrad_splits[0].items()))
local_params = sum(p.numel() for p in model.parameters())
if layout.world_size > 1:
    print_rank(layout, f"local parameters: {local_params:,}")
else:
    print0(f"local parameters: {local_params:,}")

names = {p: n for n, p in model.named_parameters()}
groups = model.param_groups(args.embedding_lr * lr_scale, args.unembedding_lr * lr_scale, args.matrix_lr * lr_scale,
                            args.scalar_lr * lr_scale, weight_decay)
optimizer = MuonAdamW(groups, names, dp_group=layout.dp_group, compute_dtype=dtype, compile=use_compile)

# the loop state and data position, fresh or from the checkpoint
step, smooth_loss, total_time, min_val_bpb, val_bpb = 0, 0.0, 0.0, float("inf"), None
loader_state = None
if resume_meta is not None:
    try:
        model_state, optim_state, _ = ckpt.load_checkpoint(ckpt_dir, args.resume_from_step, device="cpu")
    except ckpt.CheckpointError as e:
        fail(str(e))
    ckpt.load_model_state(model, model_state)
    optimizer.load_full_state_dict(optim_state)
    del model_state, optim_state
    if config.l3_after_layers and pipeline is None:  # the saved allocation sets L3's FLOPs (MFU)
        flops_per_token = model.estimate_flops()
    loop = resume_meta["loop_state"]
    step, smooth_loss, total_time, min_val_bpb = loop["step"], loop["smooth_loss"], loop["total_time"], loop["min_val_bpb"]
    states = reshard_states(resume_meta["dataloader_states"], layout.dp_size)
    if len(resume_meta["dataloader_states"]) != layout.dp_size:
        print0(f"data: resharded the data position from dp {len(resume_meta['dataloader_states'])} to dp {layout.dp_size}")
    loader_state = states[layout.dp_rank]

orig_model = model  # the uncompiled module: checkpoints, sampling, CORE
print0(f"attention: {prepare_attention(config, device, dtype)}")
if use_compile and pipeline is None:
    model = torch.compile(model, dynamic=False)
elif use_compile:  # the schedule calls the pieces one micro-batch at a time: compile each block and the loss
    for i in range(pipeline.start, pipeline.end):
        model.blocks[i].compile(dynamic=False)
    model.criterion.compile(dynamic=False)
    print0("note: under --pp > 1 each block and the loss are compiled separately (the schedule's sends and receives stay eager)")

reads_data = pipeline is None or layout.is_first_stage or layout.is_last_stage


def make_loader(split, state=None):
    # training prefetches a whole step: a step starts once all its micro-batches are in, so with a
    # shallower queue the GPU would wait at every step for the loader to pack the rest (measured: ~80 ms
    # per step); evaluation takes one batch at a time
    train = split == "train"
    return DataLoader(tokenizer, args.device_batch_size, args.max_seq_len, split, device, data_dir=data_dir,
                      dp_rank=layout.dp_rank, dp_size=layout.dp_size, state=state,
                      prefetch=grad_accum + 1 if train else 2, keep_remainder=args.keep_remainder and train)


try:
    train_loader = make_loader("train", loader_state) if reads_data else None
except DataError as e:
    fail(str(e))

# -----------------------------------------------------------------------------
# Schedules


def lr_multiplier(it):
    warmdown_start = round(num_iterations * (1 - args.warmdown_ratio))
    if it < args.warmup_steps:
        return (it + 1) / args.warmup_steps
    if it < warmdown_start:
        return 1.0
    progress = (it - warmdown_start) / max(1, num_iterations - warmdown_start)
    return 1.0 - progress * (1.0 - args.final_lr_frac)


def muon_momentum(it):
    warmdown_start = round(num_iterations * (1 - args.warmdown_ratio))
    if it >= warmdown_start:  # 0.97 -> 0.90 over the warmdown
        progress = (it - warmdown_start) / max(1, num_iterations - warmdown_start)
        start = 0.85 + 0.12 * min(1.0, warmdown_start / 400)
        return start + (0.90 - start) * progress
    return 0.85 + 0.12 * min(1.0, it / 400)


def muon_weight_decay(it):
    return weight_decay * 0.5 * (1 + math.cos(math.pi * it / num_iterations))


# -----------------------------------------------------------------------------
# One step: forward/backward over the micro-batches, then the optimizer


def next_batches():
    """grad_accum micro-batches (x, y), the data state after the last one, and the message of a data
    error (a shard that cannot be read) or None."""
    if train_loader is None:
        return [(None, None)] * grad_accum, None, None
    batches = []
    try:
        for _ in range(grad_accum):
            x, y, state = next(train_loader)
            batches.append((x, y))
    except DataError as e:
        return None, None, str(e)
    return batches, state, None


def forward_backward(batches):
    """Mean loss over the micro-batches, gradients accumulated into .grad (the same on every rank)."""
    if pipeline is not None:
        return pipeline.train_step(batches)
    total = torch.zeros((), device=device)
    for x, y in batches:
        loss = model(x, y)
        (loss / grad_accum).backward()
        total += loss.detach()
    return total / grad_accum


def bf16_eval():
    """Evaluation and sampling run in bf16: with fp8, on the uncompiled model with the fp8 linears
    swapped out (same weights)."""
    if not fp8_active:
        return contextlib.nullcontext()
    from nanochat.fp8 import bf16_linears
    return bf16_linears(orig_model)


def eval_loss_fn(x, y):
    if pipeline is not None:
        return pipeline.forward_loss(x, y)
    return (orig_model if fp8_active else model)(x, y, loss_reduction="none")


def evaluate_val_bpb():
    steps = max(1, eval_tokens // (args.device_batch_size * args.max_seq_len * layout.dp_size))
    loader = make_loader("val") if reads_data else None
    batches = loader if loader is not None else iter(lambda: (None, None), 0)
    model.eval()
    try:
        with bf16_eval():
            return evaluate_bpb(eval_loss_fn, batches, steps, token_bytes, layout, label="val bpb")
    finally:  # also when a stop (Interrupted) or a data error ends it
        model.train()
        if loader is not None:
            loader.close()


def gather_data_states():
    """Every DP rank's data state (the ranks that read data contribute)."""
    mine = last_state if reads_data and layout.tp_rank == 0 and layout.is_first_stage else None
    if layout.world_size == 1:
        return [mine]
    everything = [None] * layout.world_size
    dist.all_gather_object(everything, mine)
    states = sorted((s for s in everything if s is not None), key=lambda s: s["dp_rank"])
    return states


def save_checkpoint(at_step):
    """Full tensors: TP shards gathered; each pipeline stage writes its own part; meta last. Weights that
    are not finite are not saved: the run stops instead, so a diverged run never becomes the latest
    checkpoint (nor what a resume, base_eval or sample would pick up)."""
    t0 = time.time()
    bad = ckpt.nonfinite_tensors(orig_model.state_dict())
    if all_reduce_max(float(len(bad) > 0), device) > 0:
        if bad:
            print_rank(layout, f"weights that are not finite: {', '.join(bad[:3])}")
        fail(f"the weights are not finite at step {at_step} (the run diverged): not saving; try a lower LR, or resume "
             f"from an earlier checkpoint")
    states = gather_data_states()
    writer = layout.dp_rank == 0 and layout.tp_rank == 0
    model_state = ckpt.full_model_state(orig_model, keep=writer)
    optim_state = optimizer.full_state_dict(keep=writer)
    if writer:
        ckpt.save_stage_files(ckpt_dir, at_step, model_state, optim_state, layout.pp_rank, layout.pp_size)
    if layout.world_size > 1:
        dist.barrier()
    if master:
        meta = {"model_config": config.to_dict(), "user_config": user_config, "dataloader_states": states,
                "loop_state": {"step": at_step, "smooth_loss": smooth_loss, "total_time": total_time,
                               "min_val_bpb": min_val_bpb},
                "layout": {"dp": layout.dp_size, "tp": layout.tp_size, "pp": layout.pp_size},
                "tokenizer_hash": tokenizer.hash}
        ckpt.save_meta(ckpt_dir, at_step, meta, layout.pp_size)
        if args.keep_last > 0:
            ckpt.prune_checkpoints(ckpt_dir, args.keep_last)
    if layout.world_size > 1:
        dist.barrier()
    print0(f"saved checkpoint for step {at_step} to {ckpt_dir} ({time.time() - t0:.1f}s)")
    return at_step


# Ctrl-C / SIGTERM: stop at the next step boundary, or within seconds during an evaluation; save; exit 0
install_stop_handlers()

wandb_run = None
if args.wandb_run != "dummy" and master:
    import wandb
    wandb_run = wandb.init(project="nanochat", name=args.wandb_run, config=user_config)

peak_flops = get_peak_flops(device_name(device.type)) if device.type == "cuda" else None
history_path = os.path.join(report.report_dir(), "train_loss.csv") if master else None
if master:  # keep the rows before the resume point, drop the rest
    rows = []
    if step > 0 and os.path.exists(history_path):
        with open(history_path) as f:
            rows = [line for i, line in enumerate(f) if i > 0 and int(line.split(",")[0]) < step]
    with open(history_path, "w") as f:
        f.write("step,loss,val_bpb\n" + "".join(rows))

# -----------------------------------------------------------------------------
# The loop

print0(f"training from step {step} to {num_iterations}")
last_state = loader_state
mfu, tok_per_sec, epoch = None, 0.0, 1
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
core_status = "off (--core-metric-every -1)" if args.core_metric_every <= 0 else "not run"  # for the report


def core_and_samples(at_step):
    """CORE and sample completions (uncompiled model, bf16). CORE runs on every rank (DP splits the
    items); every rank samples (under TP the forward is collective) and rank 0 prints. Under pipeline or
    sequence parallelism (whose forward takes only fixed shapes) every rank evaluates a gathered whole
    copy of the model instead, freed afterwards."""
    do_core = args.core_metric_every > 0 and (last_step or (at_step > 0 and at_step % args.core_metric_every == 0))
    do_sample = args.sample_every > 0 and (last_step or (at_step > 0 and at_step % args.sample_every == 0))
    if not (do_core or do_sample):
        return
    eval_model = orig_model
    if pipeline is not None or args.sequence_parallel:
        eval_model = ckpt.gathered_model(orig_model, layout)
    eval_model.eval()
    global core_status
    with bf16_eval():
        if do_core:
            from nanochat.core_eval import evaluate_core_for_training, EvalBundleError
            core_status = "skipped: no CORE bundle (--eval-bundle DIR, or a network to download it)"
            try:
                core = evaluate_core_for_training(eval_model, tokenizer, device, layout, args.eval_bundle,
                                                  args.core_metric_max_per_task)
            except EvalBundleError as e:  # a broken bundle must not end a training run
                print0(f"step {at_step:05d} | CORE failed: {e}")
                core_status = f"failed: {e}"
                core = None
            if core is not None:
                core_status = f"{core['core']:.4f} at step {at_step} ({core['tasks_run']}/{core['tasks_total']} tasks)"
                print0(f"step {at_step:05d} | CORE ({core['tasks_run']}/{core['tasks_total']} tasks): {core['core']:.4f}")
                if wandb_run:
                    wandb_run.log({"step": at_step, "core": core["core"]})
        if do_sample:
            from nanochat.engine import sample_completions
            for text in sample_completions(eval_model, tokenizer):
                print0(f"  sample: {text!r}")
    orig_model.train()
    del eval_model


def write_history_row(at_step, loss_value, val):
    """One row per step of train_loss.csv: every 10th step, and every step with a val bpb."""
    if master:
        with open(history_path, "a") as f:
            f.write(f"{at_step},{loss_value:.6f}," + (f"{val:.6f}" if val is not None else "") + "\n")


def stop_on_data_error(message):
    """A shard that cannot be read mid-run (caught on one rank, agreed by all): save, then stop with its message."""
    messages = [message]
    if layout.world_size > 1:
        messages = [None] * layout.world_size
        dist.all_gather_object(messages, message)
    if args.save_every != 0:
        save_checkpoint(step)
    fail(f"{next(m for m in messages if m)} (at step {step}; " +
         (f"saved: resume with --resume-from-step {step} once the file is replaced)" if args.save_every != 0 else "not saved)"))


start_step, saved_step = step, None
while True:
    last_step = step == num_iterations
    # --- evaluation, checkpoint, CORE and samples (before the step: step 0 is the untrained model;
    # the checkpoint comes before CORE and sampling, so a failure there cannot lose the weights). A stop
    # requested during an evaluation ends it within seconds (Interrupted); the checkpoint is still saved ---
    val_bpb = None
    if eval_tokens > 0 and (last_step or (args.eval_every > 0 and step % args.eval_every == 0 and step > 0)):
        try:
            val_bpb = evaluate_val_bpb()
        except Interrupted:
            pass
        except DataError as e:
            stop_on_data_error(str(e))
    if val_bpb is not None:
        min_val_bpb = min(min_val_bpb, val_bpb)
        print0(f"step {step:05d} | val bpb: {val_bpb:.6f}")
        if wandb_run:
            wandb_run.log({"step": step, "val/bpb": val_bpb})
    stop_now = stop_agreed(device)
    if args.save_every != 0 and (last_step or stop_now or (args.save_every > 0 and step > 0 and step % args.save_every == 0
                                                           and step != args.resume_from_step)):
        saved_step = save_checkpoint(step)
    if stop_now:
        break
    try:
        core_and_samples(step)
    except Interrupted:
        if args.save_every != 0 and saved_step != step:
            save_checkpoint(step)
        break
    if last_step:
        if val_bpb is not None:
            write_history_row(step, smooth_loss / (1 - 0.9 ** max(1, step)), val_bpb)
        break

    # --- one optimizer step ---
    t0 = time.time()
    batches, state, data_error = next_batches()
    if all_reduce_max(float(data_error is not None), device) > 0:
        stop_on_data_error(data_error)
    if state is not None:
        last_state = state
    loss = forward_backward(batches)
    lrm = lr_multiplier(step)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = muon_momentum(step)
            group["weight_decay"] = muon_weight_decay(step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if layout.dp_size > 1:  # report the mean over DP ranks
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=layout.dp_group)
        loss = loss / layout.dp_size
    loss_value = loss.item()  # also synchronizes the device, so dt is honest
    dt = time.time() - t0
    if not math.isfinite(loss_value):
        withdrawn = saved_step == step  # saved moments ago: its weights are the ones that gave this loss
        if withdrawn and master:
            ckpt.delete_checkpoint(ckpt_dir, step)
        fail(f"loss is {loss_value} at step {step}; stopping" + (f" (deleted the checkpoint of step {step}: its weights give "
             f"this loss)" if withdrawn else "") + "; try a lower LR, or resume from an earlier checkpoint")

    smooth_loss = 0.9 * smooth_loss + 0.1 * loss_value
    debiased = smooth_loss / (1 - 0.9 ** (step + 1))
    if step - start_step > 10:  # the first steps of a process include compilation
        total_time += dt
    tok_per_sec = total_batch_size / dt
    mfu = 100 * flops_per_token * total_batch_size / dt / (peak_flops * layout.world_size) if peak_flops else None
    if train_loader is not None:
        epoch = train_loader.stats["epoch"]
    line = (f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:.2f}%) | loss: {debiased:.6f} | "
            f"lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,.0f}")
    if mfu is not None:
        line += f" | mfu: {mfu:.2f}"
    line += f" | epoch: {epoch}"
    print0(line)
    if wandb_run and step % 10 == 0:
        wandb_run.log({"step": step, "train/loss": debiased, "train/lrm": lrm, "train/dt": dt, "train/tok_per_sec": tok_per_sec,
                       **({"train/mfu": mfu} if mfu is not None else {})})
    if step % 10 == 0 or val_bpb is not None:
        write_history_row(step, debiased, val_bpb)
    step += 1
    # the collector walks every Python object: once at the start, then only rarely
    if step == 1:
        gc.collect()
        gc.freeze()
        gc.disable()
        # frozen objects are never freed; at exit (a failure's included) extensions such as triton's nanobind
        # would report them as leaked
        atexit.register(gc.unfreeze)
    elif step % 5000 == 0:
        gc.collect()

# -----------------------------------------------------------------------------
# Wrap up

peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
if peak_mem is not None and layout.world_size > 1:  # ranks differ (pipeline stages, shards): each reports
    print_rank(layout, f"peak memory: {peak_mem:.2f} GiB; allocated after the last step: "
                       f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB")
if val_bpb is not None:
    print0(f"Validation bpb: {val_bpb:.6f}")
summary = ([f"minimum validation bpb: {min_val_bpb:.6f}"] if math.isfinite(min_val_bpb) else []) + \
          ([f"training time: " + (f"{total_time / 60:.2f} min" if total_time >= 60 else f"{total_time:.1f}s")]
           if total_time > 0 else []) + \
          ([f"peak memory: {peak_mem:.2f} GiB"] if peak_mem else [])
if summary:
    print0("; ".join(summary))
if master and step == num_iterations:
    crop = train_loader.stats["crop_fraction"] if train_loader is not None else None
    report.log_section("Base model training", [user_config, {
        "parameters": param_counts["total"], "scaling parameters": num_scaling_params,
        "FLOPs per token": f"{flops_per_token:.4e}", "total batch size": total_batch_size,
        "iterations": num_iterations, "tokens trained": D, "tokens per scaling param": round(D / num_scaling_params, 2),
        "training FLOPs": f"{flops_per_token * D:.4e}", "Muon weight decay": weight_decay, "LR scale": lr_scale,
        "layout": f"dp {layout.dp_size} x tp {layout.tp_size} x pp {layout.pp_size}",
        "gpus used": layout.world_size if device.type == "cuda" else 0,
        "final validation bpb": val_bpb if val_bpb is not None else "not measured",
        "CORE during training": core_status,
        "minimum validation bpb": min_val_bpb if math.isfinite(min_val_bpb) else "not measured",
        "training time (min)": round(total_time / 60, 3), "tok/sec (last step)": round(tok_per_sec),
        "mfu (%)": round(mfu, 2) if mfu is not None else "n/a", "peak memory (GiB)": round(peak_mem, 2) if peak_mem else "n/a",
        "epoch": epoch, "crop fraction": round(crop, 4) if crop is not None else "n/a",
    }])
if wandb_run:
    wandb_run.finish()
if train_loader is not None:
    train_loader.close()
compute_cleanup()
