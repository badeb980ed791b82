"""
Pretrain a base model. One dial, --depth; the scaling-law formulas pick the rest.

    python -m scripts.base_train --depth=12
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=4 -m scripts.base_train --depth=32 --tp=2 --pp=2
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20 --max-seq-len=32768 --cp=8

The recipe (derive_recipe; printed at start):
  horizon  D = --num-iterations * B, else --target-flops / FLOPs-per-token, else ratio * scaling params
  batch    B = 2^19 * (D / D_ref)^0.383 rounded to a power of 2 (Power Lines, arXiv 2505.13738), D_ref = ratio * N(d12)
  LRs      every LR * sqrt(B / 2^19)
  decay    wd = wd_ref * sqrt(B / 2^19) * D_ref / D (constant T_epoch, arXiv 2405.13698)
  schedule LR: 40-step warmup, flat, linear warmdown over the last 65% to 5%; Muon momentum 0.85 -> 0.97 over 400
           steps, then -> 0.90 during warmdown; Muon wd cosine-decayed to 0

Context extension: train at a short --max-seq-len with --stop-at-step N, then resume from step N with a longer
one (and a device batch that keeps the step's tokens): the schedule, batch, optimizer state and data position go
on; the windows follow the new context (S = a quarter of it).

main() reads top to bottom: flags, processes, config, recipe, flag checks, setup (training.py, shared with the
tests and dev tools), the loop (a row of "once in a while" blocks before each step), the summary. Errors the user
can fix stop the run with one line, in main(); a stop request or a data error mid-run saves the step first.
"""

import os
import gc
import math
import time
import json
import atexit
import difflib
import argparse
import traceback
from dataclasses import dataclass, replace

import torch

from nanochat.common import (HelpWithDefaults, UserError, ConfigError, print0, print_rank, get_compute_dtype, get_peak_flops,
                             device_name, fail)
from nanochat.distributed import compute_init, compute_cleanup, barrier, hang_report_dir, agree_on_error, gather_objects
from nanochat.signals import install_stop_handlers, stop_agreed, Interrupted
from nanochat.memory import cpu_memory_error
from nanochat.watchdog import Watchdog
from nanochat.gpt import GPTConfig, config_for_depth, window_sizes, GPT, RECOMPUTE_MODES, PARAM_GROUPS
from nanochat import kernels
from nanochat.dataloader import reshard_states
from nanochat.dataset import DataError, check_data, shard_listing, listing_changes
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.loss_eval import evaluate_bpb, default_eval_tokens
from nanochat.run_log import RunLog, SpikeWatch, metrics_path
from nanochat import checkpoint_manager as ckpt
from nanochat import report
from nanochat import training

UNTIMED_STEPS = 10  # each launch's first steps include compilation: left out of the training time
DEFAULT_SEQ_LEN = 2048
B_REF = 2 ** 19  # the reference batch (tokens) at which LRs and weight decay were tuned (d12)
# flags that shape the schedule, the batch and the data: a resumed run must give the ones of the saved run
# (a longer --max-seq-len is a context extension: context_lengths)
RECIPE_FLAGS = ["num_iterations", "target_flops", "target_param_data_ratio", "total_batch_size",
                "embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "weight_decay", "warmup_steps",
                "warmdown_ratio", "final_lr_frac", "keep_remainder"]
LRS = training.LearningRates()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Pretrain a base model", formatter_class=HelpWithDefaults)
    add = parser.add_argument
    # runtime
    add("--wandb-run", type=str, default="dummy", help="wandb run name ('dummy' = no wandb)")
    add("--tensorboard", type=str, default=None, help="also write the step numbers as TensorBoard events into this "
                                                      "folder (pip install 'nanochat[tensorboard]')")
    add("--device-type", type=str, default="", help="cuda|cpu|mps (empty: autodetect)")
    add("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR or base_data)")
    # model
    add("--depth", type=int, default=20, help="number of blocks: the one dial")
    add("--aspect-ratio", type=int, default=64, help="model_dim = depth * aspect_ratio (rounded up to head_dim)")
    add("--head-dim", type=int, default=128, help="attention head dimension")
    add("--n-kv-head", type=int, default=0, help="key/value heads for GQA (0 = as many as query heads)")
    add("--max-seq-len", type=int, default=None, help=f"context length (default {DEFAULT_SEQ_LEN}; a resume: the "
                                                      f"checkpoint's, and a longer one extends it)")
    add("--window-pattern", type=str, default="SSSL", help="sliding windows tiled over layers: S=quarter context, L=full")
    # horizon
    add("--num-iterations", type=int, default=-1, help="optimizer steps (-1 = from flops or ratio)")
    add("--target-flops", type=float, default=-1.0, help="training FLOPs budget (-1 = use the ratio)")
    add("--target-param-data-ratio", type=float, default=12.0, help="tokens per scaling parameter")
    # batch
    add("--device-batch-size", type=int, default=32, help="sequences per micro-batch per process")
    add("--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1 = Power Lines formula)")
    add("--keep-remainder", action="store_true", help="data: put cropped document tails back as new BOS pieces instead of dropping them")
    # optimizer
    add("--embedding-lr", type=float, default=LRS.embedding_lr, help="AdamW LR of the embeddings")
    add("--unembedding-lr", type=float, default=LRS.unembedding_lr, help="AdamW LR of the lm_head")
    add("--matrix-lr", type=float, default=LRS.matrix_lr, help="Muon LR of the block matrices")
    add("--scalar-lr", type=float, default=LRS.scalar_lr, help="AdamW LR of the scalars")
    add("--weight-decay", type=float, default=LRS.weight_decay, help="Muon weight decay at the reference batch and horizon")
    add("--warmup-steps", type=int, default=40, help="LR warmup steps")
    add("--warmdown-ratio", type=float, default=0.65, help="fraction of steps in the final linear LR decay")
    add("--final-lr-frac", type=float, default=0.05, help="LR multiplier at the end of warmdown")
    # evaluation, sampling, checkpoints
    add("--eval-every", type=int, default=250, help="val bpb every N steps (-1 = only at the end)")
    add("--eval-tokens", type=int, default=-1, help="tokens of validation data per evaluation (0 = no evaluation; "
                                                     "-1 = 20 x 2^19 on a GPU, 2^18 elsewhere)")
    add("--core-metric-every", type=int, default=2000, help="CORE every N steps (-1 = never)")
    add("--core-metric-max-per-task", type=int, default=500, help="items per CORE task during training")
    add("--eval-bundle", type=str, default=None, help="CORE bundle folder (default: download)")
    add("--sample-every", type=int, default=2000, help="print completions every N steps (-1 = never)")
    add("--save-every", type=int, default=-1, help="checkpoint every N steps (-1 = only at the end, 0 = never)")
    add("--keep-last", type=int, default=-1, help="keep only the newest N checkpoints of the model tag (-1 = all)")
    add("--resume-from-step", type=int, default=-1, help="resume from this checkpoint step (-1 = start fresh)")
    add("--stop-at-step", type=int, default=-1, help="save at this step and stop, the schedule unchanged (-1 = run to "
                                                     "the end); e.g. to resume from it with a longer --max-seq-len")
    add("--resume-on-new-data", action="store_true", help="resume although the data folder's shards differ from "
                                                          "those the checkpoint was trained on, reading them from the start")
    add("--model-tag", type=str, default=None, help="checkpoint folder name (default: d<depth>)")
    add("--compile", type=int, default=-1, help="torch.compile the model and optimizer (-1 = on CUDA only)")
    add("--recompute", type=str, default="none", choices=RECOMPUTE_MODES,
        help="activation recompute in training: none; selective: each block but its attention and MLP first product; "
             "block: each whole block (less activation memory for a second forward of the region)")
    # parallelism
    add("--tp", type=int, default=1, help="tensor-parallel degree")
    add("--sequence-parallel", action="store_true", help="with --tp: shard norms/residual along the sequence")
    add("--pp", type=int, default=1, help="pipeline-parallel degree")
    add("--cp", type=int, default=1, help="context-parallel degree: each sequence split over this many ranks "
                                          "(head-tail chunks, ring attention; nanochat/context_parallel.py)")
    add("--pp-schedule", type=str, default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"],
        help="pipeline schedule (nanochat/pipeline_parallel.py: zb = ZB-H1, backward split into B and W)")
    add("--pp-virtual", type=int, default=1, help="chunks of blocks per pipeline rank (interleaved: 2 or more)")
    add("--pp-print-schedule", action="store_true", help="print every stage's action list at start")
    add("--shard-params", action="store_true", help="ZeRO-3: each data-parallel rank keeps the weights, gradients and "
                                                    "optimizer state of what it updates only, and gathers each block's "
                                                    "weights around its call (nanochat/data_parallel.py)")
    add("--keep-gathered", action="store_true", help="with --shard-params: keep each module's gathered weights from its "
                                                     "forward to its backward (one gather fewer, a whole copy more)")
    add("--overlap-grad-reduce", type=int, default=-1, choices=(-1, 0, 1),
        help="1: start each DP gradient reduction during the last micro-batch's backward (blocks are then compiled "
             "one by one); 0: after the backward; -1: 1 when the run spans several nodes")
    add("--dist-timeout", type=float, default=1800, help="seconds a collective or barrier may wait before the run "
                                                         "fails with a hang report (the first step compiles; CORE and saves are uneven)")
    # kernels, fp8, L3
    add("--kernels", type=str, default=None, choices=kernels.MODES, help="auto: fast kernels where they apply; reference: "
                                                                         "the plain PyTorch math everywhere (default: NANOCHAT_KERNELS, else auto)")
    add("--fp8", action="store_true", help="fp8 training linears, torchao's tensorwise recipe (CUDA, SM89+, torchao); any --tp/--pp")
    add("--l3-after-layers", type=str, default="", help="blocks followed by an L3 layer, e.g. 4,8")
    add("--l3-n-emb", type=int, default=0, help="rows of the L3 table (0 = 16 per vocabulary entry)")
    add("--l3-d-up", type=int, default=0, help="L3 up-projection width (0 = 4 * model_dim)")
    add("--l3-k-max", type=int, default=512, help="most table rows one token may own")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line, with the nearest flag (argparse prints its whole usage and no suggestion)
        flags = [f for action in parser._actions for f in action.option_strings]
        hints = [f"{u} (did you mean {' or '.join(near)}?)" if (near := difflib.get_close_matches(u.split("=")[0], flags, 2))
                 else u for u in unknown]
        parser.exit(2, f"base_train: error: unrecognized arguments: {', '.join(hints)}; see --help\n")
    if args.max_seq_len is None and args.resume_from_step < 0:
        args.max_seq_len = DEFAULT_SEQ_LEN  # a resume takes the checkpoint's (start)
    return args


# -----------------------------------------------------------------------------
# The model config and the recipe


def model_config(args, vocab_size, resume_meta):
    """The GPTConfig of the run: the checkpoint's when resuming (with --max-seq-len's context: the weights hold
    no length, the windows and rotary tables follow it), else from --depth and the model flags."""
    if resume_meta is not None:
        return replace(GPTConfig.from_dict(resume_meta["model_config"]), sequence_len=args.max_seq_len)
    try:
        l3_layers = tuple(sorted({int(s) for s in args.l3_after_layers.split(",") if s.strip()}))
    except ValueError:
        raise ConfigError(f"--l3-after-layers {args.l3_after_layers!r} must be comma-separated block indices, e.g. 4,8") from None
    return config_for_depth(args.depth, args.aspect_ratio, args.head_dim, vocab_size, args.max_seq_len, args.window_pattern,
                            n_kv_head=args.n_kv_head, l3_after_layers=l3_layers, l3_n_emb=args.l3_n_emb,
                            l3_d_up=args.l3_d_up, l3_k_max=args.l3_k_max)


@dataclass
class Recipe:
    num_iterations: int
    total_batch_size: int
    tokens: int                 # D, the horizon trained
    d_ref: float                # D_ref = ratio x scaling params of d12
    horizon_source: str
    lr_scale: float
    weight_decay: float         # Muon's, after scaling
    flops_per_token: float      # of the config on the meta device (L3 assumed at k_max rows per token)
    num_scaling_params: int
    param_counts: dict


def derive_recipe(args, config, start_len=None):
    """The scaling-law formulas of the module docstring. The horizon and batch are those of the context the run
    started with (start_len, if not config's), so that a context extension leaves the schedule as it was."""
    with torch.device("meta"):
        model = GPT(config)
        started = model if start_len in (None, config.sequence_len) else GPT(replace(config, sequence_len=start_len))
        reference = GPT(config_for_depth(12, args.aspect_ratio, args.head_dim, config.vocab_size, args.max_seq_len,
                                         args.window_pattern))
    num_scaling_params, flops_per_token = model.num_scaling_params(), model.estimate_flops()
    d_ref = args.target_param_data_ratio * reference.num_scaling_params()
    if args.target_flops > 0:
        d_opt, source = args.target_flops / started.estimate_flops(), f"--target-flops {args.target_flops:.3g}"
    else:
        d_opt = args.target_param_data_ratio * num_scaling_params
        source = f"ratio {args.target_param_data_ratio} x {num_scaling_params:,} scaling params"
    batch = args.total_batch_size if args.total_batch_size > 0 else 2 ** round(math.log2(B_REF * (d_opt / d_ref) ** 0.383))
    if args.num_iterations > 0:
        num_iterations, source = args.num_iterations, "--num-iterations"
    else:
        num_iterations = max(1, round(d_opt / batch))
    tokens = num_iterations * batch
    lr_scale = math.sqrt(batch / B_REF)
    return Recipe(num_iterations, batch, tokens, d_ref, source, lr_scale, args.weight_decay * lr_scale * (d_ref / tokens),
                  flops_per_token, num_scaling_params, model.parameter_counts())


def check_flags(args, config, recipe, layout, device, resume_meta):
    """Every flag (and combination) that cannot run, refused before any work. Returns the gradient
    accumulation steps."""
    if args.device_batch_size < 1:
        raise ConfigError(f"--device-batch-size must be at least 1 (got {args.device_batch_size})")
    if args.core_metric_max_per_task == 0 or args.core_metric_max_per_task < -1:
        raise ConfigError("--core-metric-max-per-task must be a positive number of items, or -1 for all")
    start_step = max(args.resume_from_step, 0)
    if args.stop_at_step != -1 and args.stop_at_step <= start_step:
        raise ConfigError(f"--stop-at-step {args.stop_at_step} is not after the step this run starts at ({start_step}): "
                          f"give a later step, or -1 to run to the end")
    if args.stop_at_step != -1 and args.save_every == 0:
        raise ConfigError("--stop-at-step saves the step it stops at: it cannot go with --save-every 0")
    if args.keep_last == 0 or args.keep_last < -1:
        raise ConfigError("--keep-last must be a positive number of checkpoints, or -1 to keep all")
    if any(not 0 <= i < config.n_layer for i in config.l3_after_layers):
        raise ConfigError(f"--l3-after-layers {args.l3_after_layers!r}: block indices must be in 0..{config.n_layer - 1}")
    window_sizes(config)
    if resume_meta is not None:  # the schedule, batch and data shape come from the flags: the saved run's
        saved, now = resume_meta.get("user_config", {}), vars(args)
        changed = {k: (saved[k], now[k]) for k in RECIPE_FLAGS if k in saved and saved[k] != now[k]}
        if changed:
            raise ConfigError("resuming with other settings than the saved run: " +
                              ", ".join(f"--{k.replace('_', '-')} was {a}, now {b}" for k, (a, b) in changed.items()) +
                              ". Pass the same flags as the original run (its command is in meta_*.json, user_config).")
    tokens_per_micro = args.device_batch_size * args.max_seq_len * layout.dp_size
    if recipe.total_batch_size % tokens_per_micro != 0:
        raise ConfigError(f"--total-batch-size {recipe.total_batch_size:,} is not a multiple of device_batch_size x "
                          f"seq_len x dp = {args.device_batch_size} x {args.max_seq_len} x {layout.dp_size} = "
                          f"{tokens_per_micro:,}; change --device-batch-size or --total-batch-size (a power of 2 works "
                          f"with powers of 2)")
    grad_accum = recipe.total_batch_size // tokens_per_micro
    if args.sequence_parallel and args.tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1")
    if args.keep_gathered and not args.shard_params:
        raise ConfigError("--keep-gathered keeps sharded weights gathered: it needs --shard-params")
    if args.tp > 1:
        from nanochat.tensor_parallel import check_tp_size
        check_tp_size(config, args.tp, args.sequence_parallel)
    if args.cp > 1:
        from nanochat.context_parallel import check_context_parallel
        check_context_parallel(args.cp, args.max_seq_len, args.tp, args.sequence_parallel)
    if args.pp > config.n_layer:
        raise ConfigError(f"--pp {args.pp} is more stages than blocks ({config.n_layer}); each stage needs at least one block")
    if args.pp > 1 and grad_accum < args.pp:
        raise ConfigError(f"pipeline parallelism needs at least pp={args.pp} micro-batches per step, got {grad_accum} "
                          f"(= {recipe.total_batch_size:,} / {tokens_per_micro:,}); lower --device-batch-size or raise "
                          f"--total-batch-size")
    if device.type == "cpu":
        error = cpu_memory_error(recipe.param_counts["total"], config, args.device_batch_size, args.max_seq_len)
        if error:
            raise ConfigError(error)
    return grad_accum


def print_plan(args, config, recipe, layout, grad_accum):
    r, counts = recipe, recipe.param_counts
    print0(f"model config: {json.dumps(config.to_dict())}")
    print0(f"parameters: {counts['total']:,} total | {counts['scaling']:,} scaling | {counts['embeddings']:,} embeddings" +
           (f" | {counts['l3 tables (sparse)']:,} L3 sparse, {counts['active']:,} active" if config.l3_after_layers else ""))
    print0(f"FLOPs per token: {r.flops_per_token:.4e}")
    print0(f"horizon: {r.tokens:,} tokens = {r.num_iterations:,} steps x {r.total_batch_size:,} tokens (from "
           f"{r.horizon_source}); tokens/scaling param = {r.tokens / r.num_scaling_params:.2f}; D_ref = {r.d_ref:,.0f}")
    print0(f"batch: {r.total_batch_size:,} tokens = {args.device_batch_size} x {args.max_seq_len} x dp {layout.dp_size} x "
           f"grad accum {grad_accum}" + ("" if args.total_batch_size > 0 else " (Power Lines: 2^19 * (D_opt/D_ref)^0.383)"))
    if args.warmup_steps > r.num_iterations:
        print0(f"note: --warmup-steps {args.warmup_steps} is longer than the run ({r.num_iterations} steps): the LR never "
               f"reaches its peak (lower --warmup-steps)")
    print0(f"LR scale sqrt(B/2^19) = {r.lr_scale:.4f}; Muon weight decay = {args.weight_decay} x {r.lr_scale:.4f} x "
           f"D_ref/D {r.d_ref / r.tokens:.4f} = {r.weight_decay:.5f}; total FLOPs {r.flops_per_token * r.tokens:.4e}")


# -----------------------------------------------------------------------------
# The run


def start(args, layout, device):
    """Everything before the first step: tokenizer, data, config, recipe, checks, setup. Returns the Run."""
    watch = Watchdog(layout.rank, args.dist_timeout if layout.world_size > 1 else None, hang_report_dir())
    dtype = get_compute_dtype(device.type)
    print0(f"world {layout.world_size} = {layout.describe()}; device {device_name(device.type)}; compute dtype {dtype}; "
           f"compile {(device.type == 'cuda') if args.compile < 0 else bool(args.compile)}")
    if layout.world_size > 1:
        print_rank(layout, f"global rank {layout.rank}")
    tokenizer = get_tokenizer()
    data_dir = check_data(args.data_dir)
    data_listing = shard_listing(data_dir)  # what a checkpoint records, and a resume compares
    ckpt_dir = ckpt.checkpoint_dir(args.model_tag or f"d{args.depth}")
    if layout.world_size > 1:  # several nodes: the same shards on every rank, one checkpoint folder for all
        warning = training.check_ranks_agree(layout, data_dir, data_listing, ckpt_dir, saves=args.save_every != 0)
        if warning:
            print0(warning)
    resume_meta, new_data = None, False
    if args.resume_from_step >= 0:
        resume_meta = ckpt.load_meta(ckpt_dir, args.resume_from_step)
        if args.max_seq_len is None:  # not given: the checkpoint's context
            args.max_seq_len = resume_meta["model_config"]["sequence_len"]
        ckpt.check_tokenizer(resume_meta, tokenizer, ckpt_dir)
        new_data = check_data_unchanged(args, data_dir, data_listing, resume_meta)
    config = model_config(args, tokenizer.get_vocab_size(), resume_meta)
    contexts = context_lengths(config, resume_meta)
    recipe = derive_recipe(args, config, contexts[0][1])
    grad_accum = check_flags(args, config, recipe, layout, device, resume_meta)
    if resume_meta is not None:
        print0(f"resuming from step {args.resume_from_step} of {ckpt_dir}")
    print_plan(args, config, recipe, layout, grad_accum)
    take_lock(layout, device, ckpt_dir)  # before anything is written there
    return Run(args, layout, device, dtype, tokenizer, data_dir, data_listing, ckpt_dir, config, contexts, recipe,
               grad_accum, resume_meta, new_data, watch)


def context_lengths(config, resume_meta):
    """[[step, context length from that step on], ...]: the run's context history, one entry more where this resume
    changes --max-seq-len (a context extension; the line printed says what changes with it)."""
    if resume_meta is None:
        return [[0, config.sequence_len]]
    saved, loop = resume_meta["model_config"]["sequence_len"], resume_meta.get("loop_state", {})
    step, history = loop.get("step", 0), loop.get("context_lengths", [[0, saved]])
    if config.sequence_len == saved:
        return history
    if config.sequence_len < saved:
        raise ConfigError(f"--max-seq-len {config.sequence_len} is shorter than step {step}'s context ({saved}): a "
                          f"resume may lengthen the context, not shorten it (leave --max-seq-len out to keep {saved})")
    windows = lambda c: "/".join(f"{w:,}" for w in sorted(set(window_sizes(c))))
    print0(f"context extension at step {step}: {saved:,} -> {config.sequence_len:,} tokens a sequence (windows "
           f"{windows(replace(config, sequence_len=saved))} -> {windows(config)}); the schedule, batch, optimizer "
           f"state and data position go on")
    return [h for h in history if h[0] < step] + [[step, config.sequence_len]]


def take_lock(layout, device, ckpt_dir):
    """One run per checkpoint folder: rank 0 holds <ckpt_dir>/run.lock until the process ends; a folder in use
    stops every rank with the holder's line."""
    error = None
    if layout.rank == 0:
        try:
            atexit.register(ckpt.release_lock, ckpt.take_lock(ckpt_dir))
        except ckpt.CheckpointError as e:
            error = str(e)
    if (error := agree_on_error(error, device)) is not None:
        raise ckpt.CheckpointError(error)


def check_data_unchanged(args, data_dir, data_listing, resume_meta):
    """The data position in a checkpoint means something only for the shards it was saved with: a resume that
    finds others stops, unless --resume-on-new-data (then the new data is read from its start). Returns whether
    the run goes on with new data."""
    if "data_listing" not in resume_meta:  # saved without a listing (imported weights)
        return False
    changes = listing_changes(resume_meta["data_listing"], data_listing)
    step = resume_meta["loop_state"]["step"]
    if changes and not args.resume_on_new_data:
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise ConfigError(f"the shards in {data_dir} differ from those step {step} was trained on: {shown}. Put the "
                          f"saved shards back, or pass --resume-on-new-data to read the new data from its start")
    if changes:
        print0(f"note: the shards in {data_dir} differ from step {step}'s ({len(changes)} changes); "
               f"--resume-on-new-data: reading them from the start")
    return bool(changes)


class Run:
    """One training process: its Trainer and data, the loop state, and the periodic work at each step boundary."""

    def __init__(self, args, layout, device, dtype, tokenizer, data_dir, data_listing, ckpt_dir, config, contexts, recipe,
                 grad_accum, resume_meta, new_data, watch):
        self.args, self.layout, self.device, self.tokenizer, self.data_dir = args, layout, device, tokenizer, data_dir
        self.ckpt_dir, self.config, self.recipe, self.grad_accum, self.watch = ckpt_dir, config, recipe, grad_accum, watch
        self.contexts = contexts
        self.schedule = training.Schedule(recipe.num_iterations, recipe.weight_decay, args.warmup_steps,
                                          args.warmdown_ratio, args.final_lr_frac)
        s = recipe.lr_scale
        lrs = training.LearningRates(args.embedding_lr * s, args.unembedding_lr * s, args.matrix_lr * s,
                                     args.scalar_lr * s, recipe.weight_decay)
        resume = None
        if resume_meta is not None:  # the weights go into the whole model, before it is cut up
            weights_only = resume_meta.get("weights_only", False)  # e.g. imported by scripts.import_hf
            resume = ckpt.load_checkpoint(ckpt_dir, args.resume_from_step, "cpu", load_optimizer=not weights_only)[:2]
            if weights_only:
                print0("the checkpoint holds weights only (no optimizer state): the optimizer starts fresh")
        multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size)) < layout.world_size
        use_compile = (device.type == "cuda") if args.compile < 0 else bool(args.compile)
        self.trainer = training.setup(
            config, layout, device, dtype, lrs, fp8=args.fp8,
            l3_data=(tokenizer, data_dir) if resume_meta is None else None, resume=resume,
            sequence_parallel=args.sequence_parallel, pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual,
            num_microbatches=grad_accum,
            micro_batch_size=args.device_batch_size, recompute=args.recompute, compile="inductor" if use_compile else None,
            overlap_grad_reduce=args.overlap_grad_reduce == 1 or (args.overlap_grad_reduce == -1 and multi_node),
            shard_params=args.shard_params, keep_gathered=args.keep_gathered)
        self.describe_setup()
        # the loop state and data position, fresh or from the checkpoint
        loop = resume_meta["loop_state"] if resume_meta is not None else {}
        self.step, self.smooth_loss = loop.get("step", 0), loop.get("smooth_loss", 0.0)
        self.total_time, self.min_val_bpb = loop.get("total_time", 0.0), loop.get("min_val_bpb", float("inf"))
        self.spikes, self.spike_count = SpikeWatch(history=loop.get("spike_window")), loop.get("spike_count", 0)
        self.new_data_at = loop.get("new_data_at", []) + ([self.step] if new_data else [])  # --resume-on-new-data
        loader_state = None
        if resume_meta is not None and not new_data:
            saved_states = resume_meta["dataloader_states"]
            loader_state = reshard_states(saved_states, layout.dp_size)[layout.dp_rank]
            if len(saved_states) != layout.dp_size:
                print0(f"data: resharded the data position from dp {len(saved_states)} to dp {layout.dp_size}")
        self.data_listing = data_listing
        self.first_step, self.last_state, self.saved_step = self.step, loader_state, None
        self.launch_time = 0.0  # this launch's steps, all of them (total_time leaves out each launch's first ones)
        self.launch_timed = 0.0  # this launch's part of total_time, for the ETA
        self.grad_norm_slots = [(g, 1 + i) for i, g in enumerate(PARAM_GROUPS)  # in optimizer.grad_norms
                                if g != "l3_tables" or config.l3_after_layers]
        self.val_bpb, self.evals, self.core_status = None, {}, "not run" if args.core_metric_every > 0 else "off (--core-metric-every -1)"
        self.mfu, self.tok_per_sec, self.epoch = None, 0.0, 1
        # middle pipeline stages read no data: their inputs come from the previous stage
        self.reads_data = layout.pp_size == 1 or layout.is_first_stage or layout.is_last_stage
        self.train_loader = training.make_loader(tokenizer, "train", args.device_batch_size, args.max_seq_len, device,
                                                 layout, data_dir, grad_accum, loader_state, args.keep_remainder) \
            if self.reads_data else None
        self.token_bytes = get_token_bytes(device)
        eval_tokens = default_eval_tokens(device.type) if args.eval_tokens < 0 else args.eval_tokens
        self.eval_steps = max(1, eval_tokens // (args.device_batch_size * args.max_seq_len * layout.dp_size)) if eval_tokens > 0 else 0
        self.peak_flops = get_peak_flops(device_name(device.type)) if device.type == "cuda" else None
        self.log = RunLog(metrics_path(ckpt_dir), self.header(dtype, use_compile), self.step,
                          args.wandb_run if args.wandb_run != "dummy" else None, args.tensorboard, enabled=layout.rank == 0)
        # Ctrl-C, SIGTERM or `touch <ckpt_dir>/STOP`: stop at the next step or evaluation batch, save, exit 0
        install_stop_handlers(os.path.join(ckpt_dir, "STOP"))

    def describe_setup(self):
        t, layout = self.trainer, self.layout
        if t.pipeline is not None:
            print0(f"pipeline: {t.pipeline.describe()}")
            if self.args.pp_print_schedule:
                print0(t.pipeline.schedule_text())
        if t.wgrad_splits:
            print0("weight gradients, split-K by shape (out x in: split, ms plain -> ms split): " + ", ".join(
                f"{o}x{i}: {s} ({t1:.3f} -> {ts:.3f})" for (o, i), (s, t1, ts) in t.wgrad_splits.items()))
        local = f"local parameters: {sum(p.numel() for p in t.model.parameters()):,}"
        if layout.world_size > 1:
            print_rank(layout, local)
        else:
            print0(local)
        print0(f"attention: {t.attention}")
        dp = t.optimizer.dp
        if dp.shard_params:
            print0(f"weights sharded over {dp.size} data-parallel ranks: each module's gathered around its call" +
                   (", kept until its backward" if self.args.keep_gathered else " and again for its backward") +
                   "; gradients sent to their owners as each module's backward ends")
        elif self.args.shard_params:
            print0("--shard-params: one data-parallel rank holds everything already (nothing to shard)")
        else:
            print0(f"DP gradient reduction: {'overlapped with the last micro-batch backward' if dp.overlap else 'after the backward'}")

    def header(self, dtype, use_compile):
        r = self.recipe
        return {"flags": vars(self.args), "model_config": self.config.to_dict(),
                "layout": {"dp": self.layout.dp_size, "cp": self.layout.cp_size, "tp": self.layout.tp_size,
                           "pp": self.layout.pp_size},
                "device": device_name(self.device.type), "dtype": str(dtype).removeprefix("torch."), "compile": use_compile,
                "attention": self.trainer.attention, "fp8": self.trainer.fp8, "kernels": kernels.KERNELS.mode,
                "num_iterations": r.num_iterations, "total_batch_size": r.total_batch_size, "grad_accum": self.grad_accum,
                "flops_per_token": self.trainer.flops_per_token, "lr_scale": r.lr_scale, "weight_decay": r.weight_decay}

    def due(self, every, final):
        return every > 0 and (final or (self.step > 0 and self.step % every == 0))

    def train(self):
        """The loop: at each step boundary the periodic work (before the step: step 0 is the untrained model; the
        checkpoint comes before CORE and sampling, so a failure there cannot lose the weights), then one step."""
        print0(f"training from step {self.step} to {self.recipe.num_iterations}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        args, self.started = self.args, time.time()
        while True:
            final = self.step == self.recipe.num_iterations
            self.val_bpb = None
            if self.eval_steps and (final or self.due(args.eval_every, final)):
                self.guarded("validation", self.evaluate_val)
            self.watch.collective("stop-flag all-reduce (all ranks)")
            if stop_agreed(self.device) or (self.step == args.stop_at_step and not final):
                raise Interrupted()
            if args.save_every != 0 and (final or (self.due(args.save_every, final) and self.step != args.resume_from_step)):
                self.save()
            if self.due(args.core_metric_every, final):
                self.guarded("CORE", self.evaluate_core)
            if self.due(args.sample_every, final):
                self.guarded("sampling", self.sample)
            if final:
                if self.evals:
                    self.log.log(self.step, **self.evals)
                return
            self.train_step()

    # --- once in a while -------------------------------------------------------------

    def guarded(self, phase, work):
        """An evaluation or sampling: if it raises on every rank (a bad validation shard, a bug, memory), this step
        is saved first, then the run stops with one line (the traceback goes to stderr). A stop request passes."""
        error = None
        try:
            work()
        except Interrupted:
            raise
        except UserError as e:
            error = f"{phase} at step {self.step}: {e}"
        except Exception as e:
            traceback.print_exc()
            error = f"{phase} failed at step {self.step}: {type(e).__name__}: {e}"
        if (error := agree_on_error(error, self.device)) is not None:
            raise UserError(f"{error} ({self.save_before_stopping()})")

    def evaluate_val(self):
        self.watch.phase("val bpb (loss all-reduces; PP: stage p2p)", self.step)
        args, layout = self.args, self.layout
        if self.reads_data:
            loader = training.make_loader(self.tokenizer, "val", args.device_batch_size, args.max_seq_len, self.device,
                                          layout, self.data_dir)
        else:  # a middle pipeline stage: its inputs come from the previous stage
            loader = iter(lambda: (None, None), 0)
        try:
            with self.trainer.evaluating():
                self.val_bpb = evaluate_bpb(self.trainer.eval_loss, loader, self.eval_steps, self.token_bytes, layout,
                                            label="val bpb")
        finally:
            if self.reads_data:
                loader.close()
        self.min_val_bpb = min(self.min_val_bpb, self.val_bpb)
        self.evals["val_bpb"] = self.val_bpb
        print0(f"step {self.step:05d} | val bpb: {self.val_bpb:.6f}")

    def save(self):
        """The checkpoint of this step (once). Weights that are not finite are never saved (CheckpointError)."""
        if self.saved_step == self.step:
            return
        self.watch.phase("checkpoint save (state gathers, barriers)", self.step)
        loop_state = {"step": self.step, "smooth_loss": self.smooth_loss, "total_time": self.total_time,
                      "min_val_bpb": self.min_val_bpb, "spike_window": self.spikes.history,
                      "spike_count": self.spike_count, "new_data_at": self.new_data_at, "context_lengths": self.contexts}
        meta = {"model_config": self.config.to_dict(), "user_config": vars(self.args), "tokenizer_hash": self.tokenizer.hash,
                "loop_state": loop_state, "tokens_seen": self.step * self.recipe.total_batch_size,
                "data_listing": self.data_listing}
        self.trainer.save_checkpoint(self.ckpt_dir, self.step, self.last_state, meta, self.args.keep_last)
        self.saved_step = self.step

    def evaluate_core(self):
        """CORE on every rank (DP splits the items). A broken or missing bundle is reported and the run goes on."""
        from nanochat.core_eval import evaluate_core_for_training, EvalBundleError
        self.watch.phase("CORE (eval bundle download on local rank 0, count all-reduces)", self.step)
        self.core_status = "skipped: no CORE bundle (--eval-bundle DIR, or a network to download it)"
        try:
            with self.trainer.evaluating():
                core = evaluate_core_for_training(self.trainer.whole_model(), self.tokenizer, self.device, self.layout,
                                                  self.args.eval_bundle, self.args.core_metric_max_per_task)
        except EvalBundleError as e:
            print0(f"step {self.step:05d} | CORE failed: {e}")
            self.core_status = f"failed: {e}"
            return
        if core is not None:
            self.core_status = f"{core['core']:.4f} at step {self.step} ({core['tasks_run']}/{core['tasks_total']} tasks)"
            self.evals["core"] = core["core"]
            print0(f"step {self.step:05d} | CORE ({core['tasks_run']}/{core['tasks_total']} tasks): {core['core']:.4f}")

    def sample(self):
        from nanochat.engine import sample_completions
        self.watch.phase("samples", self.step)
        with self.trainer.evaluating():
            for text in sample_completions(self.trainer.whole_model(), self.tokenizer):
                print0(f"  sample: {text!r}")

    # --- one step ------------------------------------------------------------------

    def next_batches(self):
        """The step's micro-batches; a shard one rank cannot read raises DataError on every rank."""
        self.watch.phase("data: next batches", self.step)
        error = None
        try:
            batches, state = training.next_batches(self.train_loader, self.grad_accum)
        except DataError as e:
            error = str(e)
        error = agree_on_error(error, self.device)
        if error is not None:
            raise DataError(error)
        return batches, state

    def train_step(self):
        t0 = time.time()
        batches, state = self.next_batches()
        if state is not None:
            self.last_state = state
        self.watch.phase("training step (TP collectives, PP p2p, DP reductions, optimizer all-gathers)", self.step)
        loss, lrm = self.trainer.step(batches, self.schedule, self.step)
        loss = loss.item()  # also synchronizes the device, so dt is honest
        dt = time.time() - t0
        if not math.isfinite(loss):
            self.diverged(loss)
        norms = self.trainer.optimizer.grad_norms.tolist()  # [global, then each of PARAM_GROUPS]
        grad_norms = {"grad_norm": norms[0], **{f"grad_norm_{g}": norms[i] for g, i in self.grad_norm_slots}}
        self.smooth_loss = 0.9 * self.smooth_loss + 0.1 * loss
        smooth = self.smooth_loss / (1 - 0.9 ** (self.step + 1))  # debiased
        self.launch_time += dt
        if self.step - self.first_step > UNTIMED_STEPS:
            self.total_time += dt
            self.launch_timed += dt
        self.tok_per_sec = self.recipe.total_batch_size / dt
        if self.peak_flops:
            self.mfu = 100 * self.trainer.flops_per_token * self.tok_per_sec / (self.peak_flops * self.layout.world_size)
        if self.train_loader is not None:
            self.epoch = self.train_loader.stats["epoch"]
        n, timed = self.recipe.num_iterations, self.step - self.first_step - UNTIMED_STEPS  # in launch_timed
        per_step = self.launch_timed / timed if timed > 0 else dt  # after the compile warm-up: the mean
        print0(f"step {self.step:05d}/{n:05d} ({100 * self.step / n:.2f}%) | loss: {smooth:.6f} | "
               f"grad norm: {grad_norms['grad_norm']:.4f} | lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | "
               f"tok/sec: {self.tok_per_sec:,.0f}" + (f" | mfu: {self.mfu:.2f}" if self.mfu is not None else "") +
               f" | epoch: {self.epoch} | elapsed: {duration(time.time() - self.started)} | "
               f"eta: {duration(per_step * (n - self.step - 1))}")
        spikes = self.spikes.check(loss, grad_norms["grad_norm"], judge=self.step >= self.args.warmup_steps)
        for what, value, ratio, median, steps in spikes:
            print0(f"step {self.step:05d} | WARNING: {what} spike: {value:.4f} is {ratio:.2f}x the median of the "
                   f"previous {steps} steps ({median:.4f})")
        self.spike_count += len(spikes)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None
        self.log.log(self.step, loss=loss, loss_smooth=smooth, **grad_norms, lrm=lrm, dt=dt, tok_per_sec=self.tok_per_sec,
                     mfu=self.mfu, peak_mem_gib=peak, epoch=self.epoch, spikes=[s[0] for s in spikes] or None, **self.evals)
        self.evals = {}
        if self.step == self.first_step:  # the first step compiled (at its own pace on each rank): time together
            self.watch.phase("barrier after the compile warm-up (first step)", self.step)
            self.watch.collective("barrier: compile warm-up")
            barrier(self.layout, "the first step (compile warm-up)")
        self.step += 1
        if self.step == 1:  # the collector walks every Python object: once at the start, then only rarely
            gc.collect()
            gc.freeze()
            gc.disable()
            # frozen objects are never freed; at exit (a failure's included) extensions such as triton's nanobind
            # would report them as leaked
            atexit.register(gc.unfreeze)
        elif self.step % 5000 == 0:
            gc.collect()

    def diverged(self, loss):
        """A loss that is not finite stops the run; a checkpoint saved moments ago holds the weights that gave it."""
        withdrawn = self.saved_step == self.step
        if withdrawn and self.layout.rank == 0:
            ckpt.delete_checkpoint(self.ckpt_dir, self.step)
        raise UserError(f"loss is {loss} at step {self.step}; stopping" +
                        (f" (deleted the checkpoint of step {self.step}: its weights give this loss)" if withdrawn else "") +
                        "; try a lower LR, or resume from an earlier checkpoint")

    # --- the end -------------------------------------------------------------------

    def save_before_stopping(self):
        """A stop request or an error mid-run: this step's checkpoint (unless the run saves nothing); says how to
        go on."""
        if self.args.save_every == 0:
            return f"step {self.step} not saved (--save-every 0)"
        self.save()
        return f"saved step {self.step}: resume with --resume-from-step {self.step}"

    def stop(self):
        """Saves; returns the line to print last (after the summary)."""
        return f"stopped: {self.save_before_stopping()}"

    def data_error(self, error):
        return f"{error} ({self.save_before_stopping()}" + (" once the file is replaced)" if self.args.save_every else ")")

    def training_time(self):
        """(seconds, what they are): the steps after each launch's first UNTIMED_STEPS (compilation), else all of them."""
        if self.total_time > 0:
            return self.total_time, ""
        return self.launch_time, f" ({self.step - self.first_step} steps, compilation included)"

    def finish(self):
        """The summary lines, the report section (a completed run), and the closing of loaders and logs."""
        layout = self.layout
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None
        peaks = gather_objects((layout.tag(), peak_mem))  # ranks differ (pipeline stages, shards): the record holds all
        if peak_mem is not None and layout.world_size > 1:
            print_rank(layout, f"peak memory: {peak_mem:.2f} GiB; allocated after the last step: "
                               f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB")
        self.log.write({"kind": "end", "step": self.step, "training_time_s": self.total_time, "peak_mem_gib": dict(peaks)})
        if self.val_bpb is not None:
            print0(f"Validation bpb: {self.val_bpb:.6f}")
        t, what = self.training_time()
        summary = ([f"minimum validation bpb: {self.min_val_bpb:.6f}"] if math.isfinite(self.min_val_bpb) else []) + \
                  [(f"training time: {t / 60:.2f} min" if t >= 60 else f"training time: {t:.1f}s") + what] + \
                  ([f"spikes (loss or grad norm): {self.spike_count}"] if self.spike_count else []) + \
                  ([f"peak memory: {peak_mem:.2f} GiB"] if peak_mem else [])
        print0("; ".join(summary))
        if layout.rank == 0 and self.step == self.recipe.num_iterations:
            report.log_section("Base model training", [vars(self.args), self.report_items(peak_mem)])
        self.watch.stop()
        self.log.finish()
        if self.train_loader is not None:
            self.train_loader.close()

    def report_items(self, peak_mem):
        r, layout = self.recipe, self.layout
        crop = self.train_loader.stats["crop_fraction"] if self.train_loader is not None else None
        measured = lambda v, fmt: fmt(v) if v is not None and math.isfinite(v) else "not measured"
        return {"parameters": r.param_counts["total"], "scaling parameters": r.num_scaling_params,
                "FLOPs per token": f"{r.flops_per_token:.4e}", "total batch size": r.total_batch_size,
                "iterations": r.num_iterations, "tokens trained": r.tokens,
                "tokens per scaling param": round(r.tokens / r.num_scaling_params, 2),
                "training FLOPs": f"{r.flops_per_token * r.tokens:.4e}", "Muon weight decay": r.weight_decay,
                "LR scale": r.lr_scale, "layout": layout.describe(),
                "gpus used": layout.world_size if self.device.type == "cuda" else 0,
                "final validation bpb": measured(self.val_bpb, float), "CORE during training": self.core_status,
                "minimum validation bpb": measured(self.min_val_bpb, float),
                "training time (min)": round(self.training_time()[0] / 60, 3), "tok/sec (last step)": round(self.tok_per_sec),
                "spikes (loss or grad norm)": self.spike_count,
                "context (tokens)": ", then ".join(f"{n:,}" + (f" from step {s}" if s else "") for s, n in self.contexts),
                "data": "the same shards throughout" if not self.new_data_at else
                        f"new shards from step {', '.join(map(str, self.new_data_at))} on (--resume-on-new-data)",
                "mfu (%)": round(self.mfu, 2) if self.mfu is not None else "n/a",
                "peak memory (GiB)": round(peak_mem, 2) if peak_mem else "n/a", "epoch": self.epoch,
                "crop fraction": round(crop, 4) if crop is not None else "n/a", "metrics": self.log.path or "n/a"}


def duration(seconds):
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def main(argv=None):
    args = parse_args(argv)
    try:
        kernels.set_mode(args.kernels)
        layout, device = compute_init(args.device_type, tp=args.tp, pp=args.pp, cp=args.cp, timeout_s=args.dist_timeout)
        run, stopped = start(args, layout, device), None
        try:
            run.train()
        except Interrupted:  # every rank at the same point (a stop request is agreed on): save, then wrap up
            stopped = run.stop()
        except DataError as e:  # every rank at the same point (agreed on): this step is saved first
            raise DataError(run.data_error(e)) from None
        run.finish()
        if stopped:
            print0(stopped)  # last: which step to resume from
    except UserError as e:
        fail(str(e), every_rank=e.every_rank)
    compute_cleanup()


if __name__ == "__main__":
    main()
