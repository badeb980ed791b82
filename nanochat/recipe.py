"""
A run's settings: base_train's flags, the model and scaling-law recipe they give, and the one check of which settings
can run together (Setting.check: base_train, training.setup, the memory planner). The recipe (derive_recipe, printed):
  horizon  D = --num-iterations * B, else D_opt = --target-flops / FLOPs-per-token, else ratio * scaling params
  batch    B = 2^19 * (D_opt / D_ref)^0.383 to a power of 2 (Power Lines, arXiv 2505.13738), D_ref = ratio * N(d12)
  LRs      every LR * sqrt(B / 2^19)
  decay    wd = wd_ref * sqrt(B / 2^19) * D_ref / D (constant T_epoch, arXiv 2405.13698)
  schedule LR: 40-step warmup, flat, linear warmdown over the last 65% to 5%; Muon momentum 0.85 -> 0.97 over 400
           steps, then -> 0.90 during warmdown; Muon wd cosine-decayed to 0 (training.Schedule)
A context extension (a resume with a longer --max-seq-len) keeps the horizon and batch of the first context.
"""

import json
import math
import difflib
import argparse
from dataclasses import dataclass, replace

import torch

from nanochat.common import HelpWithDefaults, ConfigError, print0
from nanochat.gpt import GPT, GPTConfig, window_sizes, RECOMPUTE_MODES
from nanochat.pipeline_schedules import SCHEDULES
from nanochat import kernels

DEFAULT_SEQ_LEN = 2048
B_REF = 2 ** 19  # the reference batch (tokens) at which LRs and weight decay were tuned (d12)
# flags that shape the schedule, the batch and the data: a resume must give the saved run's (not --max-seq-len: a
# longer one is a context extension, context_lengths)
RECIPE_FLAGS = ["num_iterations", "target_flops", "target_param_data_ratio", "total_batch_size",
                "embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "weight_decay", "l3_table_lr",
                "warmup_steps", "warmdown_ratio", "final_lr_frac", "keep_remainder"]
# flags that shape the model: a resume refuses other values, and takes the checkpoint's where they are left out
MODEL_FLAGS = ["depth", "aspect_ratio", "head_dim", "n_kv_head", "window_pattern", "l3_after_layers", "l3_n_emb",
               "l3_d_up", "l3_k_max", "moe_experts", "moe_topk", "moe_shared", "moe_expert_dim", "moe_layers"]


@dataclass
class LearningRates:
    """Base learning rates and Muon's weight decay, tuned at d12 and B_REF (base_train scales them by the recipe)."""
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.008
    matrix_lr: float = 0.02
    scalar_lr: float = 0.5
    weight_decay: float = 0.28
    l3_table_lr: float = None  # AdamW; None: the embeddings'


def parse_args(argv=None):
    """base_train's flags (scripts.plan and the dev tools read them too)."""
    parser = argparse.ArgumentParser(description="Pretrain a base model", formatter_class=HelpWithDefaults)
    add, lrs = parser.add_argument, LearningRates()
    # runtime
    add("--wandb-run", type=str, default="dummy", help="wandb run name ('dummy' = no wandb)")
    add("--tensorboard", type=str, default=None, help="also write TensorBoard events into this folder (pip install 'nanochat[tensorboard]')")
    add("--device-type", type=str, default="", choices=("", "cuda", "cpu", "mps"), help="empty: autodetect")
    add("--data-dir", type=str, default=None, help="folder of parquet shards (default: NANOCHAT_DATA_DIR or base_data)")
    # model
    add("--depth", type=int, default=20, help="number of blocks: the one dial")
    add("--aspect-ratio", type=int, default=64, help="model_dim = depth * aspect_ratio (rounded up to head_dim)")
    add("--head-dim", type=int, default=128, help="attention head dimension")
    add("--n-kv-head", type=int, default=0, help="key/value heads for GQA (0 = as many as query heads)")
    add("--max-seq-len", type=int, default=None, help=f"context length (default {DEFAULT_SEQ_LEN}; a resume: the checkpoint's, and a longer one extends it)")
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
    add("--embedding-lr", type=float, default=lrs.embedding_lr, help="AdamW LR of the embeddings")
    add("--unembedding-lr", type=float, default=lrs.unembedding_lr, help="AdamW LR of the lm_head")
    add("--matrix-lr", type=float, default=lrs.matrix_lr, help="Muon LR of the block matrices")
    add("--scalar-lr", type=float, default=lrs.scalar_lr, help="AdamW LR of the scalars")
    add("--weight-decay", type=float, default=lrs.weight_decay, help="Muon weight decay at the reference batch and horizon")
    add("--l3-table-lr", type=float, default=None, help="AdamW LR of L3's tables (default: --embedding-lr; their rows' scale is the lookup's softmax temperature)")
    add("--warmup-steps", type=int, default=40, help="LR warmup steps")
    add("--warmdown-ratio", type=float, default=0.65, help="fraction of steps in the final linear LR decay")
    add("--final-lr-frac", type=float, default=0.05, help="LR multiplier at the end of warmdown")
    # evaluation, sampling, checkpoints
    add("--eval-every", type=int, default=250, help="val bpb every N steps (-1 = only at the end)")
    add("--eval-tokens", type=int, default=-1, help="validation tokens per evaluation (0 = none; -1 = 20 x 2^19 on a GPU, 2^18 elsewhere)")
    add("--core-metric-every", type=int, default=2000, help="CORE every N steps (-1 = never)")
    add("--core-metric-max-per-task", type=int, default=500, help="items per CORE task during training")
    add("--eval-bundle", type=str, default=None, help="CORE bundle folder (default: download)")
    add("--sample-every", type=int, default=2000, help="print completions every N steps (-1 = never)")
    add("--save-every", type=int, default=-1, help="checkpoint every N steps (-1 = only at the end, 0 = never)")
    add("--keep-last", type=int, default=-1, help="keep only the newest N checkpoints of the model tag (-1 = all)")
    add("--resume-from-step", type=lambda v: v if v == "latest" else int(v), default=-1, help="step, or `latest` (-1 = fresh)")
    add("--start-over", action="store_true", help="start fresh although the model tag's folder holds a run: its files are moved into replaced_<date>-<time>/ there")
    add("--stop-at-step", type=int, default=-1, help="save at this step and stop, the schedule unchanged (-1 = run to "
                                                     "the end); e.g. to resume from it with a longer --max-seq-len")
    add("--resume-on-new-data", action="store_true", help="resume although the shards differ from the checkpoint's: on into shards added after them, else from the start")
    add("--model-tag", type=str, default=None, help="checkpoint folder name (default: d<depth>)")
    add("--seed", type=int, default=42, help="random seed: the initial weights differ with it, the data order does not")
    add("--compile", type=int, default=-1, help="torch.compile the model and optimizer (-1 = on CUDA only)")
    add("--recompute", type=str, default="none", choices=RECOMPUTE_MODES,
        help="activation recompute in training: none; selective: each block but its attention and MLP first product; "
             "block: each whole block (less activation memory for a second forward of the region)")
    # parallelism
    add("--tp", type=int, default=1, help="tensor-parallel degree")
    add("--sequence-parallel", action="store_true", help="with --tp: shard norms/residual along the sequence")
    add("--pp", type=int, default=1, help="pipeline-parallel degree")
    add("--cp", type=int, default=1, help="context-parallel degree: each sequence split over this many ranks (head-tail chunks; nanochat/context_parallel.py)")
    add("--cp-exchange", type=str, default=None, choices=("all-gather", "ring"),
        help="how --cp ranks share K/V: one all-gather per layer, or a ring of point-to-point steps that skips ranks "
             "a sliding window never reaches (less memory); default: the faster measured, ring at CP 2, else all-gather")
    add("--ep", type=int, default=1, help="expert-parallel degree: each MoE layer's experts spread over this many DP "
                                          "ranks (nanochat/expert_parallel.py)")
    add("--pp-schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (nanochat/pipeline_schedules.py)")
    add("--pp-virtual", type=int, default=1, help="chunks of blocks per pipeline rank (interleaved: 2 or more)")
    add("--pp-print-schedule", action="store_true", help="print every stage's action list at start")
    add("--shard-params", action="store_true", help="ZeRO-3: each data-parallel rank keeps the weights, gradients and "
                                                    "optimizer state of what it updates only, and gathers each block's "
                                                    "weights around its call (nanochat/sharding.py)")
    add("--keep-gathered", action="store_true", help="with --shard-params: keep each module's gathered weights from its "
                                                     "forward to its backward (one gather fewer, a whole copy of all but the embedding tables more)")
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
    add("--l3-d-up", type=int, default=0, help="L3 up-projection width (0 = model_dim)")
    add("--l3-k-max", type=int, default=512, help="most table rows one token may own")
    add("--moe-experts", type=int, default=0, help="mixture of experts: routed experts per MoE layer (0 = dense MLPs)")
    add("--moe-topk", type=int, default=2, help="experts each token is routed to")
    add("--moe-shared", type=int, default=1, help="always-on experts per MoE layer")
    add("--moe-expert-dim", type=int, default=0, help="expert width (0 = iso-FLOP: 4 x model_dim / (topk + shared))")
    add("--moe-layers", default="", help="blocks with a mixture-of-experts MLP, e.g. 1,3 (empty: all but the first)")
    parser.error = lambda message: parser.exit(2, f"base_train: error: {message}; see --help\n")  # one line, no usage
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # one line, with the nearest flag (argparse prints its whole usage and no suggestion)
        flags = [f for action in parser._actions for f in action.option_strings]
        hints = [f"{u} (did you mean {' or '.join(near)}?)" if (near := difflib.get_close_matches(u.split("=")[0], flags, 2))
                 else u for u in unknown]
        parser.error(f"unrecognized arguments: {', '.join(hints)}")
    step = args.resume_from_step
    ranges = [(step != "latest" and step < -1, "--resume-from-step: a step >= 0, latest, or -1 to start fresh"),
              *[(getattr(args, k) == 0 or getattr(args, k) < -1, f"--{k.replace('_', '-')}: positive, or -1")
                for k in ("num_iterations", "total_batch_size", "stop_at_step", "keep_last", "core_metric_max_per_task")],
              (not 0 < args.target_param_data_ratio < math.inf, "--target-param-data-ratio: positive, finite"),
              (not (args.target_flops == -1 or 0 < args.target_flops < math.inf), "--target-flops: positive, finite, or -1"),
              *[(not 0 <= (getattr(args, k) or 0) < math.inf, f"--{k.replace('_', '-')}: 0 or more, finite")
                for k in ("embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr", "weight_decay", "l3_table_lr")],
              (args.warmup_steps < 0, "--warmup-steps: 0 or more"),
              (not -2 ** 63 <= args.seed < 2 ** 64, "--seed: a 64-bit integer"),
              (not 0 < args.dist_timeout < 1e9, "--dist-timeout: seconds, positive (below 1e9)"),
              (not 0 <= args.warmdown_ratio <= 1 or not 0 <= args.final_lr_frac <= 1,
               "--warmdown-ratio and --final-lr-frac: in [0, 1]")]
    if bad := [need for wrong, need in ranges if wrong]:
        parser.error('; '.join(bad))
    if args.max_seq_len is None and args.resume_from_step == -1:  # a resume takes the checkpoint's (base_train)
        args.max_seq_len = DEFAULT_SEQ_LEN
    for action in parser._actions:  # which flags the command line gave: a resume compares those with the checkpoint
        action.default = argparse.SUPPRESS
    args.given = sorted(vars(parser.parse_known_args(argv)[0]))
    return args


def check_loop_flags(args, resume_meta):
    """base_train's loop flags (the layout's: Setting.check); a resume must give the saved run's recipe flags, and
    its model flags where given (those left out take the checkpoint's values)."""
    start_step = max(args.resume_from_step, 0)
    if args.stop_at_step != -1 and args.stop_at_step <= start_step:
        raise ConfigError(f"--stop-at-step {args.stop_at_step} is not after the step this run starts at ({start_step}): "
                          f"give a later step, or -1 to run to the end")
    if args.stop_at_step != -1 and args.save_every == 0:
        raise ConfigError("--stop-at-step saves the step it stops at: it cannot go with --save-every 0")
    if args.start_over and resume_meta is not None:
        raise ConfigError("--start-over starts a fresh run: it cannot go with --resume-from-step (drop one of them)")
    if resume_meta is not None:
        saved, now = resume_meta.get("user_config", {}), vars(args)
        if changed := {k: (saved[k], now[k]) for k in RECIPE_FLAGS if k in saved and saved[k] != now[k]}:
            raise ConfigError("resuming with other settings than the saved run: " +
                              ", ".join(f"--{k.replace('_', '-')} was {a}, now {b}" for k, (a, b) in changed.items()) +
                              ". Pass the same flags as the original run (its command is in meta_*.json, user_config).")
        default, config = vars(parse_args([])), resume_meta["model_config"]
        # a flag an older run's user_config does not name had its default then (e.g. no MoE); imported weights have none
        imported = dict(depth=config["n_layer"], window_pattern=config["window_pattern"])
        known = dict(default, **saved) if saved else imported
        differ = {k: (known[k], now[k]) for k in MODEL_FLAGS if k in known and known[k] != now[k]}
        if given := {k: ab for k, ab in differ.items() if k in args.given}:
            raise ConfigError("resuming with another model than the checkpoint's: " +
                              ", ".join(f"--{k.replace('_', '-')} {b} (the checkpoint's: {a})" for k, (a, b) in given.items()) +
                              "; leave these flags out or give the checkpoint's values")
        for k, (a, _) in differ.items():
            setattr(args, k, a)

# -----------------------------------------------------------------------------
# The model config and the recipe


def config_for_depth(depth, aspect_ratio=64, head_dim=128, vocab_size=32768, sequence_len=2048,
                     window_pattern="SSSL", n_kv_head=0, **kwargs):
    """The one dial: model_dim = depth * aspect_ratio rounded up to a multiple of head_dim."""
    if depth < 1 or aspect_ratio < 1 or head_dim < 2 or head_dim % 2 or sequence_len < 1 or n_kv_head < 0:
        raise ConfigError(f"--depth ({depth}), --aspect-ratio ({aspect_ratio}), --max-seq-len ({sequence_len}) must be "
                         f"positive, --head-dim ({head_dim}) positive and even, --n-kv-head ({n_kv_head}) >= 0")
    model_dim = ((depth * aspect_ratio + head_dim - 1) // head_dim) * head_dim
    n_head = model_dim // head_dim
    n_kv_head = n_kv_head or n_head
    if n_head % n_kv_head != 0:
        raise ConfigError(f"--n-kv-head {n_kv_head} must divide the number of heads, {n_head}")
    if kwargs.get("l3_after_layers") and not kwargs.get("l3_d_up"):  # --l3-d-up 0: the width (as good on the ladder, faster)
        kwargs["l3_d_up"] = model_dim
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                     n_kv_head=n_kv_head, n_embd=model_dim, window_pattern=window_pattern, **kwargs)


def block_indices(flag, value, depth):
    """--l3-after-layers / --moe-layers: comma-separated block indices, as a sorted tuple."""
    try:
        blocks = tuple(sorted({int(s) for s in value.split(",") if s.strip()}))
    except ValueError:
        raise ConfigError(f"--{flag} {value!r} must be comma-separated block indices, e.g. 4,8") from None
    if any(not 0 <= i < depth for i in blocks):
        raise ConfigError(f"--{flag} {value!r}: block indices must be in 0..{depth - 1}")
    return blocks


def model_config(args, vocab_size, resume_meta=None):
    """The run's GPTConfig: the checkpoint's when resuming (at --max-seq-len: the weights hold no length, the
    windows and rotary tables follow it), else from --depth and the model flags."""
    if resume_meta is not None:
        return replace(GPTConfig.from_dict(resume_meta["model_config"]), sequence_len=args.max_seq_len)
    l3_layers, moe_blocks = (block_indices(f, getattr(args, f.replace("-", "_")), args.depth)
                             for f in ("l3-after-layers", "moe-layers"))
    if args.moe_experts and not 2 <= args.moe_topk <= args.moe_experts:
        raise ConfigError(f"--moe-experts {args.moe_experts} --moe-topk {args.moe_topk}: each token goes to K experts, "
                          f"2 <= K <= E (with 1 the router gets no gradient)")
    if min(args.moe_shared, args.moe_expert_dim) < 0 or args.moe_expert_dim % 8:
        raise ConfigError(f"--moe-shared {args.moe_shared} and --moe-expert-dim {args.moe_expert_dim} must be >= 0, "
                          f"the width a multiple of 8 (the grouped matmuls' rows: 16 bytes)")
    for feature, on, flags in (("--l3-after-layers", l3_layers, ("l3_n_emb", "l3_d_up", "l3_k_max", "l3_table_lr")),
                               ("--moe-experts", args.moe_experts, ("moe_topk", "moe_shared", "moe_expert_dim", "moe_layers"))):
        if not on and (idle := [f"--{k.replace('_', '-')}" for k in flags if k in getattr(args, "given", ())]):
            raise ConfigError(f"{', '.join(idle)} shape what {feature} adds, which is off: give {feature} or leave them out")
    config = config_for_depth(args.depth, args.aspect_ratio, args.head_dim, vocab_size, args.max_seq_len,
                              args.window_pattern, n_kv_head=args.n_kv_head, l3_after_layers=l3_layers,
                              l3_n_emb=args.l3_n_emb, l3_d_up=args.l3_d_up, l3_k_max=args.l3_k_max,
                              moe_experts=args.moe_experts, moe_topk=args.moe_topk, moe_shared=args.moe_shared,
                              moe_expert_dim=args.moe_expert_dim, moe_layers=moe_blocks)
    window_sizes(config)  # a pattern of other letters than S and L is refused here
    return config


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
    param_counts: dict          # gpt.parameter_counts

    def learning_rates(self, args):
        s, table = self.lr_scale, args.l3_table_lr  # None: optim.param_groups gives the tables the embeddings' LR
        return LearningRates(args.embedding_lr * s, args.unembedding_lr * s, args.matrix_lr * s, args.scalar_lr * s,
                             self.weight_decay, None if table is None else table * s)

    def describe(self, args, config, setting, micro_batches):
        """The lines base_train prints at start: the model, the horizon, the batch, the LRs and decay."""
        counts = self.param_counts
        return [f"model config: {json.dumps(config.to_dict())}",
                f"parameters: {counts['total']:,} total | {counts['scaling']:,} scaling | {counts['embeddings']:,} "
                f"embeddings" + (f" | {counts['l3 tables (sparse)']:,} L3 sparse" if config.l3_after_layers else "") +
                (f" | {counts['active']:,} active" if config.l3_after_layers or config.moe_experts else ""),
                f"FLOPs per token: {self.flops_per_token:.4e}",
                f"horizon: {self.tokens:,} tokens = {self.num_iterations:,} steps x {self.total_batch_size:,} tokens "
                f"(from {self.horizon_source}); tokens/scaling param = {self.tokens / counts['scaling']:.2f}; "
                f"D_ref = {self.d_ref:,.0f}",
                f"batch: {self.total_batch_size:,} tokens = {setting.device_batch} x {config.sequence_len} x dp "
                f"{setting.dp} x grad accum {micro_batches}" +
                ("" if args.total_batch_size > 0 else " (Power Lines: 2^19 * (D_opt/D_ref)^0.383)"),
                f"LR scale sqrt(B/2^19) = {self.lr_scale:.4f}; Muon weight decay = {args.weight_decay} x "
                f"{self.lr_scale:.4f} x D_ref/D {self.d_ref / self.tokens:.4f} = {self.weight_decay:.5f}; total FLOPs "
                f"{self.flops_per_token * self.tokens:.4e}"]


def derive_recipe(args, config, start_len=None):
    """The module docstring's formulas; horizon and batch of the starting context (start_len), kept on extension."""
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
                  flops_per_token, model.parameter_counts())


def context_lengths(config, resume_meta):
    """[[step, context length from then on], ...]; one entry more where this resume extends --max-seq-len (printed)."""
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


# -----------------------------------------------------------------------------
# The layout and what can run together


@dataclass
class Setting:
    """One way to train: layout, micro-batch, memory savers (base_train's flags); check() decides what runs together."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_exchange: str | None = None  # None: the faster measured, see `exchange`
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    shard_params: bool = False
    keep_gathered: bool = False
    overlap_grad_reduce: bool = False
    device_batch: int = 32
    total_batch: int = 524288
    recompute: str = "none"
    fp8: bool = False
    compute_bytes: int = 2  # of the compute dtype: bf16 on GPUs (4: fp32, as on a CPU); for the planner

    @property
    def exchange(self):
        """--cp-exchange by default: the faster measured at 32K (dev/LOG.md), the ring where they tie (CP 2)."""
        return self.cp_exchange or ("ring" if self.cp == 2 else "all-gather")

    @classmethod
    def from_args(cls, args, dp, total_batch, overlap_grad_reduce=False):
        return cls(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, cp_exchange=args.cp_exchange, ep=args.ep, pp_schedule=args.pp_schedule,
                   pp_virtual=args.pp_virtual, sequence_parallel=args.sequence_parallel, shard_params=args.shard_params,
                   keep_gathered=args.keep_gathered, overlap_grad_reduce=overlap_grad_reduce,
                   device_batch=args.device_batch_size, total_batch=total_batch, recompute=args.recompute, fp8=args.fp8)

    def describe(self):
        parts = [f"dp {self.dp}"] + [f"{d} {n}" for d in ("cp", "tp", "pp", "ep") if (n := getattr(self, d)) > 1]
        parts += [self.pp_schedule + (f" V={self.pp_virtual}" if self.pp_virtual > 1 else "")] if self.pp > 1 else []
        parts += [f for f, on in (("sp", self.sequence_parallel), ("sharded", self.shard_params),
                                  ("kept", self.keep_gathered), ("fp8", self.fp8)) if on]
        return ", ".join(parts) + f"; batch {self.device_batch}; recompute {self.recompute}"

    def check(self, config):
        """Refuses what cannot run with this model, with one line naming the flags; returns micro-batches per step."""
        T, tp, pp, cp = config.sequence_len, self.tp, self.pp, self.cp
        if min(tp, pp, cp, self.dp, self.pp_virtual, self.ep, self.device_batch) < 1:
            raise ConfigError(f"--device-batch-size {self.device_batch}, --tp {tp}, --pp {pp}, --cp {cp}, --pp-virtual "
                              f"{self.pp_virtual}, --ep {self.ep}: each >= 1")
        tokens_per_micro = self.device_batch * T * self.dp
        if self.total_batch % tokens_per_micro != 0:
            raise ConfigError(f"the batch, {self.total_batch:,} tokens (--total-batch-size, or the recipe's where it is "
                              f"left out), is not a multiple of device_batch_size x "
                              f"seq_len x dp = {self.device_batch} x {T} x {self.dp} = {tokens_per_micro:,}; change "
                              f"--device-batch-size or --total-batch-size (a power of 2 works with powers of 2)")
        m = self.total_batch // tokens_per_micro
        if self.sequence_parallel and tp == 1:
            raise ConfigError("--sequence-parallel needs --tp > 1")
        if config.moe_experts and tp > 1 and not self.sequence_parallel:
            raise ConfigError("--moe-experts with --tp needs --sequence-parallel: MoE layers are not cut, so without it "
                              "every TP rank would run every token's experts")
        if self.ep > 1 and not (config.moe_experts and config.moe_experts % self.ep == 0 and self.dp % self.ep == 0):
            raise ConfigError(f"--ep {self.ep} spreads each MoE layer's experts over DP ranks: it needs --moe-experts "
                              f"({config.moe_experts or 'off: a dense model'}) and the DP size ({self.dp}) divisible by it")
        if self.ep > 1 and (cp > 1 or self.shard_params):
            raise ConfigError(f"--ep {self.ep} with --cp or --shard-params: not built; use one of them")
        if self.keep_gathered and not self.shard_params:
            raise ConfigError("--keep-gathered keeps sharded weights gathered: it needs --shard-params")
        divides = [("query heads (n_head)", config.n_head), ("key/value heads (n_kv_head)", config.n_kv_head),
                   ("MLP width (4 x n_embd)", 4 * config.n_embd), ("vocabulary (vocab_size)", config.vocab_size)]
        for what, n in divides:
            if n % tp != 0:
                valid = [d for d in range(1, min(config.n_head, 64) + 1) if all(k % d == 0 for _, k in divides)]
                raise ConfigError(f"--tp {tp} does not divide the {what} = {n}; valid --tp values for this model: "
                                  f"{valid}. (head count = model_dim / head_dim: pick --depth/--aspect-ratio/--head-dim "
                                  f"so it divides)")
        cut = {"query heads' width": config.n_head // tp * config.head_dim, "MLP width": 4 * config.n_embd // tp,
               "key/value heads' width": config.n_kv_head // tp * config.head_dim}  # fp8 products: multiples of 16
        if self.fp8 and tp > 1 and (bad := [f"{what} {n}" for what, n in cut.items() if n % 16]):
            raise ConfigError(f"--fp8 with --tp {tp}: a rank's {', '.join(bad)} must be multiples of 16 for fp8 "
                              f"products; choose another --tp or --head-dim")
        if self.sequence_parallel and T % tp != 0:
            raise ConfigError(f"--sequence-parallel needs --max-seq-len ({T}) divisible by --tp {tp}")
        if cp > 1 and T % (2 * cp):
            raise ConfigError(f"--cp {cp} cuts each sequence into 2 x {cp} = {2 * cp} chunks: --max-seq-len ({T}) "
                              f"must divide by {2 * cp}")
        if self.sequence_parallel and (T // cp) % tp:
            raise ConfigError(f"--sequence-parallel with --cp {cp}: each rank's {T // cp} tokens must divide by --tp {tp}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
        if pp > 1:
            self.check_pipeline(config, m, tokens_per_micro)
        elif (self.pp_schedule, self.pp_virtual) != ("1f1b", 1):  # they shape a pipeline
            raise ConfigError("--pp-schedule and --pp-virtual need --pp > 1")
        if cp == 1 and self.cp_exchange:
            raise ConfigError(f"--cp-exchange {self.cp_exchange} is how --cp ranks share K/V: it needs --cp > 1")
        return m

    def check_pipeline(self, config, m, tokens_per_micro):
        p, schedule, virtual = self.pp, self.pp_schedule, self.pp_virtual
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown --pp-schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        if p * virtual > config.n_layer:
            raise ConfigError(f"--pp {p} x --pp-virtual {virtual} = {p * virtual} chunks is more than the "
                              f"{config.n_layer} blocks; each chunk needs one")
        if m < p:
            raise ConfigError(f"pipeline parallelism needs at least pp={p} micro-batches per step, got {m} "
                              f"(= {self.total_batch:,} / {tokens_per_micro:,}); lower --device-batch-size or "
                              f"raise --total-batch-size")
        if (schedule == "interleaved") != (virtual > 1):
            raise ConfigError(f"--pp-virtual {virtual} with --pp-schedule {schedule}: interleaved needs --pp-virtual "
                              f">= 2 chunks per rank, the other schedules one")
        if schedule == "interleaved" and m % p:
            raise ConfigError(f"--pp-schedule interleaved runs the micro-batches in groups of pp={p}: {m} micro-batches "
                              f"per step is no multiple (set --total-batch-size)")
