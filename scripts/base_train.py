"""
Pretrain a base model. One dial, --depth; the scaling-law formulas pick the rest.

    python -m scripts.base_train --depth=12
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=4 -m scripts.base_train --depth=32 --tp=2 --pp=2
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 \
        --rdzv-id=d26 -m scripts.base_train --depth=26                        (the same on every node)

The recipe (printed at start):
  horizon  D = --num-iterations * B, else --target-flops / FLOPs-per-token, else ratio * scaling params
  batch    B = 2^19 * (D / D_ref)^0.383 rounded to a power of 2 (Power Lines), D_ref = ratio * N(d12)
  LRs      every LR * sqrt(B / 2^19)
  decay    wd = wd_ref * sqrt(B / 2^19) * D_ref / D
  schedule LR: 40-step warmup, flat, linear warmdown over the last 65% to 5%; Muon momentum
           0.85 -> 0.97 over 400 steps, then -> 0.90 during warmdown; Muon wd cosine-decayed to 0

The script reads top to bottom: flags; processes; config and recipe; every argument check; setup; the
loop, with its periodic work (val bpb, checkpoint, CORE, samples) inline before each step. The setup,
the step and the checkpoint save are nanochat/training.py's, shared with the tests.
"""

import os
import gc
import sys
import math
import time
import json
import atexit
import argparse

import torch

from nanochat.common import (compute_init, compute_cleanup, print0, print_rank, get_compute_dtype, get_peak_flops,
                             device_name, all_reduce_max, fail, barrier, hang_report_dir, install_stop_handlers, stop_agreed,
                             Interrupted, cpu_memory_error)
from nanochat.watchdog import Watchdog
from nanochat.gpt import GPTConfig, config_for_depth, window_sizes, GPT, RECOMPUTE_MODES
from nanochat import kernels
from nanochat.dataloader import reshard_states
from nanochat.dataset import DataError, check_data
from nanochat.tokenizer import get_tokenizer, get_token_bytes, TokenizerError
from nanochat.loss_eval import evaluate_bpb, default_eval_tokens
from nanochat import checkpoint_manager as ckpt
from nanochat import report
from nanochat import training

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
parser.add_argument("--recompute", type=str, default="none", choices=RECOMPUTE_MODES,
                    help="activation recompute in training: none; selective: each block but its attention and MLP "
                         "first product; mlp: each block's norm + MLP; block: each whole block (less activation "
                         "memory for a second forward of the region)")
# parallelism
parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
parser.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard norms/residual along the sequence")
parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
parser.add_argument("--pp-schedule", type=str, default="1f1b", choices=["gpipe", "1f1b"], help="pipeline schedule")
parser.add_argument("--pp-print-schedule", action="store_true", help="print the pipeline schedule table at start")
parser.add_argument("--overlap-grad-reduce", type=int, default=-1, choices=(-1, 0, 1),
                    help="1: start each DP gradient reduction during the last micro-batch's backward (blocks are then "
                         "compiled one by one); 0: after the backward; -1: 1 when the run spans several nodes")
parser.add_argument("--dist-timeout", type=float, default=1800, help="seconds a collective or barrier may wait "
                    "before the run fails with a hang report (the first step compiles; CORE and saves are uneven)")
# fp8, L3
parser.add_argument("--kernels", type=str, default=None, choices=kernels.MODES, help="auto: fast kernels where they apply; reference: the plain PyTorch math everywhere (default: NANOCHAT_KERNELS, else auto)")
parser.add_argument("--fp8", action="store_true", help="fp8 training linears, torchao's tensorwise recipe (CUDA, SM89+, torchao); any --tp/--pp")
parser.add_argument("--l3-after-layers", type=str, default="", help="blocks followed by an L3 layer (one table as keys and values), e.g. 4,8")
parser.add_argument("--l3-n-emb", type=int, default=0, help="rows of the L3 tables (0 = 16 per vocabulary entry)")
parser.add_argument("--l3-d-up", type=int, default=0, help="L3 up-projection width (0 = 4 * model_dim)")
parser.add_argument("--l3-k-max", type=int, default=512, help="most table rows one token may own")
args = parser.parse_args()
user_config = vars(args).copy()
kernels.set_mode(args.kernels)

# -----------------------------------------------------------------------------
# Processes, device, dtype

try:
    layout, device = compute_init(args.device_type, tp=args.tp, pp=args.pp, timeout_s=args.dist_timeout)
except (ValueError, RuntimeError) as e:
    fail(str(e))
master = layout.rank == 0
# what this rank is doing, reported if one phase outlasts --dist-timeout (multi-process runs only)
watch = Watchdog(layout.rank, args.dist_timeout if layout.world_size > 1 else None, hang_report_dir())
dtype = get_compute_dtype(device.type)
use_compile = (device.type == "cuda") if args.compile < 0 else bool(args.compile)
print0(f"world {layout.world_size} = dp {layout.dp_size} x tp {layout.tp_size} x pp {layout.pp_size}; "
       f"device {device_name(device.type)}; compute dtype {dtype}; compile {use_compile}")
if layout.world_size > 1:
    print_rank(layout, f"global rank {layout.rank}")

# -----------------------------------------------------------------------------
# Tokenizer, data, model config (from the checkpoint when resuming)

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
if layout.world_size > 1:  # several nodes: the same shards on every rank, one checkpoint folder for all
    try:
        warning = training.check_ranks_agree(layout, data_dir, ckpt_dir, saves=args.save_every != 0)
    except ValueError as e:
        fail(str(e))
    if warning:
        print0(warning)

resume_meta = None
if args.resume_from_step >= 0:
    try:
        resume_meta = ckpt.load_meta(ckpt_dir, args.resume_from_step)
        ckpt.check_tokenizer(resume_meta, tokenizer, ckpt_dir)
    except ckpt.CheckpointError as e:
        fail(str(e))
    config = GPTConfig.from_dict(resume_meta["model_config"])
else:
    try:
        l3_layers = tuple(sorted({int(s) for s in args.l3_after_layers.split(",") if s.strip()}))
    except ValueError:
        fail(f"--l3-after-layers {args.l3_after_layers!r} must be comma-separated block indices, e.g. 4,8")
    try:
        config = config_for_depth(args.depth, args.aspect_ratio, args.head_dim, vocab_size, args.max_seq_len,
                                  args.window_pattern, n_kv_head=args.n_kv_head, l3_after_layers=l3_layers,
                                  l3_n_emb=args.l3_n_emb, l3_d_up=args.l3_d_up, l3_k_max=args.l3_k_max,
                                  l3_tied=bool(l3_layers))
    except ValueError as e:
        fail(str(e))

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
schedule = training.Schedule(num_iterations, weight_decay, args.warmup_steps, args.warmdown_ratio, args.final_lr_frac)

# -----------------------------------------------------------------------------
# Argument checks: every flag (and combination) that cannot run fails here, before any work

if args.device_batch_size < 1:
    fail(f"--device-batch-size must be at least 1 (got {args.device_batch_size})")
if args.core_metric_max_per_task == 0 or args.core_metric_max_per_task < -1:
    fail("--core-metric-max-per-task must be a positive number of items, or -1 for all")
if args.keep_last == 0 or args.keep_last < -1:
    fail("--keep-last must be a positive number of checkpoints, or -1 to keep all")
if any(not 0 <= i < config.n_layer for i in config.l3_after_layers):
    fail(f"--l3-after-layers {args.l3_after_layers!r}: block indices must be in 0..{config.n_layer - 1}")
try:
    window_sizes(config)
except ValueError as e:
    fail(str(e))
if resume_meta is not None:
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
tokens_per_micro = args.device_batch_size * args.max_seq_len * layout.dp_size
if total_batch_size % tokens_per_micro != 0:
    fail(f"--total-batch-size {total_batch_size:,} is not a multiple of device_batch_size x seq_len x dp "
         f"= {args.device_batch_size} x {args.max_seq_len} x {layout.dp_size} = {tokens_per_micro:,}; "
         f"change --device-batch-size or --total-batch-size (a power of 2 works with powers of 2)")
grad_accum = total_batch_size // tokens_per_micro
if args.sequence_parallel and args.tp == 1:
    fail("--sequence-parallel needs --tp > 1")
if args.tp > 1:
    from nanochat.tensor_parallel import check_tp_size
    try:
        check_tp_size(config, args.tp, args.sequence_parallel)
    except ValueError as e:
        fail(str(e))
if args.pp > config.n_layer:
    fail(f"--pp {args.pp} is more stages than blocks ({config.n_layer}); each stage needs at least one block")
if args.pp > 1 and grad_accum < args.pp:
    fail(f"pipeline parallelism needs at least pp={args.pp} micro-batches per step, got {grad_accum} "
         f"(= {total_batch_size:,} / {tokens_per_micro:,}); lower --device-batch-size or raise --total-batch-size")
if device.type == "cpu" and (error := cpu_memory_error(param_counts["total"], config, args.device_batch_size, args.max_seq_len)):
    fail(error)

if resume_meta is not None:
    print0(f"resuming from step {args.resume_from_step} of {ckpt_dir}")
print0(f"model config: {json.dumps(config.to_dict())}")
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
# Model, parallelism, optimizer, data

model, fp8_active = training.build_model_for_training(config, device, dtype, layout, fp8=args.fp8,
                                                      l3_data=(tokenizer, data_dir) if resume_meta is None else None)
if resume_meta is not None:  # the weights go into the whole model, before it is sharded or cut into stages
    try:
        weights_only = resume_meta.get("weights_only", False)  # e.g. imported by scripts.import_hf
        model_state, optim_state, _ = ckpt.load_checkpoint(ckpt_dir, args.resume_from_step, device="cpu",
                                                           load_optimizer=not weights_only)
    except ckpt.CheckpointError as e:
        fail(str(e))
    ckpt.load_model_state(model, model_state)
    del model_state
if config.l3_after_layers:  # the real allocation, fresh or saved, sets L3's FLOPs (MFU) and the pipeline's
    flops_per_token = model.estimate_flops()  # stage costs (the meta model assumed k_max rows)
pipeline = training.apply_parallelism(model, layout, args.sequence_parallel, grad_accum, args.device_batch_size,
                                      args.pp_schedule)
if pipeline is not None:
    print0(f"pipeline: {pipeline.describe()}")
    if args.pp_print_schedule:
        print0(pipeline.schedule_table())
if device.type == "cuda":
    wgrad_splits = training.tune_weight_gradients(model, layout, args.device_batch_size * args.max_seq_len, dtype)
    print0("weight gradients, split-K by shape (out x in: split, ms plain -> ms split): " + ", ".join(
        f"{o}x{i}: {s} ({t1:.3f} -> {ts:.3f})" for (o, i), (s, t1, ts) in wgrad_splits.items()))
local_params = sum(p.numel() for p in model.parameters())
if layout.world_size > 1:
    print_rank(layout, f"local parameters: {local_params:,}")
else:
    print0(f"local parameters: {local_params:,}")
multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size)) < layout.world_size
overlap = args.overlap_grad_reduce == 1 or (args.overlap_grad_reduce == -1 and multi_node)
optimizer = training.make_optimizer(model, layout, dtype, args.embedding_lr * lr_scale, args.unembedding_lr * lr_scale,
                                    args.matrix_lr * lr_scale, args.scalar_lr * lr_scale, weight_decay, compile=use_compile,
                                    overlap_grad_reduce=overlap)

# the loop state and data position, fresh or from the checkpoint
step, smooth_loss, total_time, min_val_bpb, val_bpb = 0, 0.0, 0.0, float("inf"), None
loader_state = None
if resume_meta is not None:
    if weights_only:
        print0("the checkpoint holds weights only (no optimizer state): the optimizer starts fresh")
    else:
        optimizer.load_full_state_dict(optim_state)
    del optim_state
    loop = resume_meta["loop_state"]
    step, smooth_loss, total_time, min_val_bpb = loop["step"], loop["smooth_loss"], loop["total_time"], loop["min_val_bpb"]
    states = reshard_states(resume_meta["dataloader_states"], layout.dp_size)
    if len(resume_meta["dataloader_states"]) != layout.dp_size:
        print0(f"data: resharded the data position from dp {len(resume_meta['dataloader_states'])} to dp {layout.dp_size}")
    loader_state = states[layout.dp_rank]

print0(f"attention: {kernels.prepare_attention(config, window_sizes(config), device, dtype)}")
training.apply_recompute(model, args.recompute)
train_model = training.compile_for_training(model, pipeline, per_block=optimizer.overlap) if use_compile else model
print0(f"DP gradient reduction: {'overlapped with the last micro-batch backward' if optimizer.overlap else 'after the backward'}")
trainer = training.Trainer(model, train_model, pipeline, optimizer, layout, fp8=fp8_active,
                           sequence_parallel=args.sequence_parallel)

# middle pipeline stages read no data: their inputs come from the previous stage
reads_data = pipeline is None or layout.is_first_stage or layout.is_last_stage
try:
    train_loader = training.make_loader(tokenizer, "train", args.device_batch_size, args.max_seq_len, device, layout,
                                        data_dir, grad_accum, loader_state, args.keep_remainder) if reads_data else None
except DataError as e:
    fail(str(e))
eval_tokens = default_eval_tokens(device.type) if args.eval_tokens < 0 else args.eval_tokens
eval_steps = max(1, eval_tokens // tokens_per_micro)

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
# The loop: at each step boundary the periodic work (before the step: step 0 is the untrained model;
# the checkpoint comes before CORE and sampling, so a failure there cannot lose the weights), then one
# optimizer step

print0(f"training from step {step} to {num_iterations}")
last_state = loader_state
mfu, tok_per_sec, epoch = None, 0.0, 1
if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
core_status = "off (--core-metric-every -1)" if args.core_metric_every <= 0 else "not run"  # for the report
run_meta = {"model_config": config.to_dict(), "user_config": user_config, "tokenizer_hash": tokenizer.hash}
start_step, saved_step, data_error = step, None, None
while True:
    last_step = step == num_iterations
    # a stop requested during an evaluation ends it within seconds (Interrupted); a shard that cannot be read
    # (data_error, agreed over the ranks) stops the run: either way the checkpoint of this step is saved first
    interrupted = False

    # --- validation bits per byte ---
    val_bpb = None
    if eval_tokens > 0 and not data_error and (last_step or (args.eval_every > 0 and step % args.eval_every == 0 and step > 0)):
        watch.phase("val bpb (loss all-reduces; PP: stage p2p)", step)
        if reads_data:
            val_loader = training.make_loader(tokenizer, "val", args.device_batch_size, args.max_seq_len, device,
                                              layout, data_dir)
        else:  # a middle pipeline stage: its inputs come from the previous stage
            val_loader = iter(lambda: (None, None), 0)
        try:
            with trainer.evaluating():
                val_bpb = evaluate_bpb(trainer.eval_loss, val_loader, eval_steps, token_bytes, layout, label="val bpb")
        except Interrupted:
            interrupted = True
        except DataError as e:
            data_error = str(e)
        finally:
            if reads_data:
                val_loader.close()
    if val_bpb is not None:
        min_val_bpb = min(min_val_bpb, val_bpb)
        print0(f"step {step:05d} | val bpb: {val_bpb:.6f}")
        if wandb_run:
            wandb_run.log({"step": step, "val/bpb": val_bpb})

    # --- checkpoint: at the end, every --save-every steps, or when asked to stop ---
    watch.collective("stop-flag all-reduce (all ranks)")
    stop_now = stop_agreed(device) or interrupted
    loop_state = {"step": step, "smooth_loss": smooth_loss, "total_time": total_time, "min_val_bpb": min_val_bpb}
    if args.save_every != 0 and (last_step or stop_now or data_error or
                                 (args.save_every > 0 and step > 0 and step % args.save_every == 0 and step != args.resume_from_step)):
        watch.phase("checkpoint save (state gathers, barriers)", step)
        try:
            trainer.save_checkpoint(ckpt_dir, step, last_state, dict(run_meta, loop_state=loop_state,
                                                                     tokens_seen=step * total_batch_size), args.keep_last)
        except ckpt.CheckpointError as e:  # weights that are not finite are never saved
            fail(str(e))
        saved_step = step
    if data_error:
        fail(f"{data_error} (at step {step}; " + (f"saved: resume with --resume-from-step {step} once the file is replaced)"
                                                  if args.save_every != 0 else "not saved)"))
    if stop_now:
        break

    # --- CORE and sample completions: every rank evaluates (DP splits CORE's items; under TP the forward
    # is collective), rank 0 prints ---
    do_core = args.core_metric_every > 0 and (last_step or (step > 0 and step % args.core_metric_every == 0))
    do_sample = args.sample_every > 0 and (last_step or (step > 0 and step % args.sample_every == 0))
    if do_core or do_sample:
        watch.phase("CORE / samples (eval bundle download on local rank 0, count all-reduces)", step)
        eval_model = trainer.whole_model()
        try:
            with trainer.evaluating():
                if do_core:
                    from nanochat.core_eval import evaluate_core_for_training, EvalBundleError
                    core_status = "skipped: no CORE bundle (--eval-bundle DIR, or a network to download it)"
                    try:
                        core = evaluate_core_for_training(eval_model, tokenizer, device, layout, args.eval_bundle,
                                                          args.core_metric_max_per_task)
                    except EvalBundleError as e:  # a broken bundle must not end a training run
                        print0(f"step {step:05d} | CORE failed: {e}")
                        core_status, core = f"failed: {e}", None
                    if core is not None:
                        core_status = f"{core['core']:.4f} at step {step} ({core['tasks_run']}/{core['tasks_total']} tasks)"
                        print0(f"step {step:05d} | CORE ({core['tasks_run']}/{core['tasks_total']} tasks): {core['core']:.4f}")
                        if wandb_run:
                            wandb_run.log({"step": step, "core": core["core"]})
                if do_sample:
                    from nanochat.engine import sample_completions
                    for text in sample_completions(eval_model, tokenizer):
                        print0(f"  sample: {text!r}")
        except Interrupted:  # asked to stop during CORE: save this step (unless just saved), then stop
            if args.save_every != 0 and saved_step != step:
                trainer.save_checkpoint(ckpt_dir, step, last_state, dict(run_meta, loop_state=loop_state,
                                                                         tokens_seen=step * total_batch_size), args.keep_last)
            break
        del eval_model
    if last_step:
        if val_bpb is not None:
            training.write_history_row(history_path, step, smooth_loss / (1 - 0.9 ** max(1, step)), val_bpb)
        break

    # --- one optimizer step ---
    t0 = time.time()
    watch.phase("data: next batches", step)
    try:
        batches, state = training.next_batches(train_loader, grad_accum)
    except DataError as e:
        data_error = str(e)
    if all_reduce_max(float(data_error is not None), device) > 0:  # on any rank: back to the top to save, then stop
        messages = [data_error] * layout.world_size
        if layout.world_size > 1:
            dist.all_gather_object(messages, data_error)
        data_error = next(m for m in messages if m)
        continue
    if state is not None:
        last_state = state
    watch.phase("training step (TP collectives, PP p2p, DP reductions, optimizer all-gathers)", step)
    loss, lrm = trainer.step(batches, schedule, step)
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
    if step % 10 == 0 or val_bpb is not None:  # one row per step: every 10th, and every step with a val bpb
        training.write_history_row(history_path, step, debiased, val_bpb)
    if step == start_step:  # the first step compiled (at its own pace on each rank): start timing together
        watch.phase("barrier after the compile warm-up (first step)", step)
        watch.collective("barrier: compile warm-up")
        try:
            barrier(layout, "the first step (compile warm-up)")
        except RuntimeError as e:
            print_rank(layout, f"ERROR: {e}")
            sys.exit(1)
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
watch.stop()
if wandb_run:
    wandb_run.finish()
if train_loader is not None:
    train_loader.close()
compute_cleanup()
