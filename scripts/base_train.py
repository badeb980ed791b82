"""
Pretrain a base model. One dial, --depth; the scaling-law formulas pick the rest (nanochat/recipe.py).

    python -m scripts.base_train --depth=12
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=4 -m scripts.base_train --depth=32 --tp=2 --pp=2
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20 --max-seq-len=32768 --cp=8

Context extension: --stop-at-step N at a short --max-seq-len, then resume from step N with a longer one: the
schedule, batch, optimizer state and data position go on; the windows follow the new context.

main() runs named phases: the processes, the plan (everything decided and checked before any work), the checkpoint
folder taken, the run (training.setup, shared with the tests), the loop ("once in a while" blocks before each step),
the summary. Errors the user can fix stop with one line; a stop request or a data error mid-run saves first.
"""

import os
import gc
import math
import time
import atexit
import traceback

import torch

from nanochat.common import (UserError, ConfigError, print0, print_rank, get_compute_dtype, get_peak_flops, device_name,
                             duration, fail)
from nanochat.distributed import (compute_init, compute_cleanup, barrier, hang_report_dir, agree_on_error, agreed,
                                  gather_objects)
from nanochat.signals import install_stop_handlers, stop_agreed, Interrupted
from nanochat.memory import cpu_memory_error
from nanochat.watchdog import Watchdog
from nanochat.optim import PARAM_GROUPS
from nanochat.gpt import GPTConfig
from nanochat import kernels, report, training
from nanochat.recipe import Setting, parse_args, check_loop_flags, model_config, derive_recipe, context_lengths
from nanochat.dataloader import reshard_states
from nanochat.dataset import DataError, check_data, shard_listing
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.loss_eval import default_eval_tokens
from nanochat.run_log import RunLog, SpikeWatch, metrics_path
from nanochat import checkpoint_manager as ckpt, run_lock

UNTIMED_STEPS = 10  # each launch's steps up to its first + this one (11, as upstream's) compile: left out of the time


# -----------------------------------------------------------------------------
# The plan: everything decided before anything is built


class Plan:
    """Tokenizer, data, checkpoint to resume (resume_meta or None; new_data: None, or other shards whose reading goes
    on ("continue") or starts over ("restart")), config, contexts, recipe,
    setting, micro-batches per step, compile; flags that cannot run are refused here, before any work; printed."""

    def __init__(self, args, layout, device):
        self.compile = (device.type == "cuda") if args.compile < 0 else bool(args.compile)
        print0(f"world {layout.world_size} = {layout.describe()}; device {device_name(device.type)}; compute dtype "
               f"{get_compute_dtype(device.type)}; compile {self.compile}")
        if layout.world_size > 1:
            print_rank(layout, f"global rank {layout.rank}")
        self.ckpt_dir = ckpt_dir = ckpt.checkpoint_dir(args.model_tag or f"d{args.depth}")

        def read_here():  # what each rank reads for itself: an error on any rank stops all, its message printed
            step = ckpt.find_last_step(ckpt_dir) if args.resume_from_step == "latest" else args.resume_from_step
            meta = ckpt.load_meta(ckpt_dir, step, needs=("model_config", "loop_state", "dataloader_states")) \
                if step >= 0 else None
            return get_tokenizer(), check_data(args.data_dir, layout.dp_size), step, meta
        self.tokenizer, self.data_dir, args.resume_from_step, self.resume_meta = \
            agreed(read_here, UserError, device if layout.world_size > 1 else None)
        data_dir, resume_meta, self.new_data = self.data_dir, self.resume_meta, None
        self.data_listing = shard_listing(data_dir)
        if layout.world_size > 1:  # several nodes: the same shards, checkpoint folder and resume point everywhere
            training.check_ranks_agree(layout, data_dir, self.data_listing, ckpt_dir, args.save_every != 0,
                                       (args.resume_from_step, resume_meta))
        if resume_meta is not None:
            if args.max_seq_len is None:  # not given: the checkpoint's context
                args.max_seq_len = GPTConfig.from_dict(resume_meta["model_config"]).sequence_len
            ckpt.check_tokenizer(resume_meta, self.tokenizer, ckpt_dir)
            self.new_data = ckpt.check_data_unchanged(resume_meta, data_dir, self.data_listing, args.resume_on_new_data)
        check_loop_flags(args, resume_meta)
        self.config = config = model_config(args, self.tokenizer.get_vocab_size(), resume_meta)
        self.contexts = context_lengths(config, resume_meta)
        self.recipe = recipe = derive_recipe(args, config, self.contexts[0][1])
        multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size)) < layout.world_size
        overlap = args.overlap_grad_reduce == 1 or (args.overlap_grad_reduce == -1 and multi_node)
        self.setting = Setting.from_args(args, layout.dp_size, recipe.total_batch_size, overlap_grad_reduce=overlap)
        self.micro_batches = self.setting.check(config)
        if device.type == "cpu" and (error := cpu_memory_error(recipe.param_counts["total"], config,
                                                               args.device_batch_size, args.max_seq_len)):
            raise ConfigError(error)
        if resume_meta is not None:
            print0(f"resuming from step {args.resume_from_step} of {ckpt_dir}")
        print0(*recipe.describe(args, config, self.setting, self.micro_batches), sep="\n")
        if args.stop_at_step > recipe.num_iterations:
            raise ConfigError(f"--stop-at-step {args.stop_at_step} is past the run's last step ({recipe.num_iterations})")
        self.schedule = training.Schedule(recipe.num_iterations, recipe.weight_decay, args.warmup_steps,
                                          args.warmdown_ratio, args.final_lr_frac)
        for note in self.schedule.notes(args.matrix_lr * recipe.lr_scale):
            print0(note)


# -----------------------------------------------------------------------------
# The run


class Run:
    """One training process: its Trainer and data, the loop state, and the periodic work at each step boundary."""

    def __init__(self, args, layout, device, plan, watch):
        self.args, self.layout, self.device, self.plan, self.watch = args, layout, device, plan, watch
        self.config, self.recipe, self.ckpt_dir = plan.config, plan.recipe, plan.ckpt_dir
        self.schedule = plan.schedule
        meta, resume = plan.resume_meta, None
        if meta is not None:  # the weights go into the whole model, before it is cut up
            watch.phase("start-up: loading the checkpoint (every rank reads and checksums its files)")
            weights_only = meta.get("weights_only", False)  # e.g. imported by scripts.import_hf
            # a rank's damaged copy (one folder a node) named by every rank, not lost with the rank that found it
            resume = agreed(lambda: ckpt.load_checkpoint(self.ckpt_dir, args.resume_from_step, "cpu",
                                                          load_optimizer=not weights_only)[:2],
                            UserError, device if layout.world_size > 1 else None)
            if weights_only:
                print0("the checkpoint holds weights only (no optimizer state): the optimizer starts fresh")
        watch.phase("start-up: the model (L3's allocation from the data), its layout's groups, the optimizer")
        self.trainer = training.setup(self.config, plan.setting, layout, device, get_compute_dtype(device.type),
                                      self.recipe.learning_rates(args), resume=resume,
                                      l3_data=(plan.tokenizer, plan.data_dir) if meta is None else None,
                                      compile="inductor" if plan.compile else None)
        print0(*self.trainer.describe(args.pp_print_schedule), sep="\n")
        print_rank(layout, f"local parameters: {sum(p.numel() for p in self.trainer.model.parameters()):,}")
        # the loop state and data position, fresh or from the checkpoint
        loop = meta["loop_state"] if meta is not None else {}
        self.step, self.smooth_loss = loop.get("step", 0), loop.get("smooth_loss", 0.0)
        self.total_time, self.min_val_bpb = loop.get("total_time", 0.0), loop.get("min_val_bpb", float("inf"))
        self.spikes = SpikeWatch(history=loop.get("spike_window"), spiking=loop.get("spiking", ()))
        self.spike_count = loop.get("spike_count", 0)
        self.new_data_at = loop.get("new_data_at", []) + ([self.step] if plan.new_data else [])  # --resume-on-new-data
        loader_state = None
        if meta is not None and plan.new_data != "restart":
            saved_states = meta["dataloader_states"]
            loader_state = reshard_states(saved_states, layout.dp_size)[layout.dp_rank]
            if len(saved_states) != layout.dp_size:
                print0(f"data: resharded the data position from dp {len(saved_states)} to dp {layout.dp_size}")
        # a resumed step is on disk already: never written again (a stop before the first step leaves it as it is)
        self.first_step, self.last_state = self.step, loader_state
        self.saved_step = self.step if meta is not None else None
        self.launch_time = self.launch_timed = 0.0  # this launch's steps (all; its part of total_time, for the ETA)
        used = {"l3_tables": self.config.l3_after_layers, **dict.fromkeys(("moe_routers", "moe_experts"), self.config.moe_experts)}
        self.grad_norm_slots = [(g, 1 + i) for i, g in enumerate(PARAM_GROUPS) if used.get(g, True)]  # in grad_norms
        self.val_bpb, self.evals = None, {}
        self.core_status = "not run" if args.core_metric_every > 0 else "off (--core-metric-every -1)"
        self.mfu, self.tok_per_sec, self.epoch = None, 0.0, (loader_state or {}).get("epoch", 1)  # a resume's, till a step
        self.train_loader = training.make_loader(plan.tokenizer, "train", args.device_batch_size, args.max_seq_len,
                                                 device, layout, plan.data_dir, plan.micro_batches, loader_state,
                                                 args.keep_remainder) if training.reads_data(layout) else None
        self.token_bytes = get_token_bytes(device)
        eval_tokens = default_eval_tokens(device.type) if args.eval_tokens < 0 else args.eval_tokens
        self.eval_steps = max(1, eval_tokens // (args.device_batch_size * args.max_seq_len * layout.dp_size)) \
            if eval_tokens > 0 else 0
        self.peak_flops = get_peak_flops(device_name(device.type)) if device.type == "cuda" else None
        self.log = RunLog(metrics_path(self.ckpt_dir), self.header(), self.step,
                          args.wandb_run if args.wandb_run != "dummy" else None, args.tensorboard, enabled=layout.rank == 0)
        # Ctrl-C, SIGTERM or `touch <ckpt_dir>/STOP`: stop at the next step or evaluation batch, save, exit 0
        install_stop_handlers(os.path.join(self.ckpt_dir, "STOP"))

    def header(self):
        r, L, t = self.recipe, self.layout, self.trainer
        return {"flags": vars(self.args), "model_config": self.config.to_dict(),
                "layout": {"dp": L.dp_size, "cp": L.cp_size, "tp": L.tp_size, "pp": L.pp_size},
                "device": device_name(self.device.type), "dtype": str(t.model.compute_dtype).removeprefix("torch."),
                "compile": self.plan.compile, "attention": t.attention, "fp8": t.fp8, "kernels": kernels.KERNELS.mode,
                "num_iterations": r.num_iterations, "total_batch_size": r.total_batch_size,
                "grad_accum": self.plan.micro_batches, "flops_per_token": t.flops_per_token, "lr_scale": r.lr_scale,
                "weight_decay": r.weight_decay}

    def due(self, every, final):
        return every > 0 and (final or (self.step > 0 and self.step % every == 0))

    def train(self):
        """The loop: at each step boundary the periodic work (step 0's on the untrained model; the checkpoint before
        CORE and sampling, so a failure there cannot lose the weights), then one step."""
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
            if args.save_every != 0 and (final or self.due(args.save_every, final)):
                self.save()
                if not final and stop_agreed(self.device):  # a stop that came during the save ends after it
                    raise Interrupted()
            if self.due(args.core_metric_every, final):
                self.guarded("CORE", self.evaluate_core)
            if self.due(args.sample_every, final):
                self.guarded("sampling", self.sample)
            if final:
                self.log_evals()
                return
            self.train_step()

    def log_evals(self):
        """This step's evaluations, where no training record of the step will carry them (the end, a stop)."""
        if self.evals:
            self.log.log(self.step, **self.evals)
            self.evals = {}

    # --- once in a while -------------------------------------------------------------

    def guarded(self, phase, work):
        """An evaluation or sampling that raises on every rank (a bad validation shard, a bug, memory): this step is
        saved, then the run stops with one line (the traceback to stderr). A stop request passes."""
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
        self.val_bpb = self.trainer.val_bpb(self.plan.tokenizer, self.plan.data_dir, self.eval_steps, self.token_bytes)
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
                      "spiking": sorted(self.spikes.spiking), "spike_count": self.spike_count,
                      "new_data_at": self.new_data_at, "context_lengths": self.plan.contexts}
        meta = {"model_config": self.config.to_dict(), "user_config": vars(self.args),
                "tokenizer_hash": self.plan.tokenizer.hash, "loop_state": loop_state,
                "tokens_seen": self.step * self.recipe.total_batch_size, "data_listing": self.plan.data_listing}
        self.trainer.save_checkpoint(self.ckpt_dir, self.step, self.last_state, meta, self.args.keep_last)
        self.saved_step = self.step

    def evaluate_core(self):
        """CORE on every rank (DP splits the items). A broken or missing bundle is reported and the run goes on."""
        from nanochat.core_eval import evaluate_core_for_training, EvalBundleError
        self.watch.phase("CORE (eval bundle download on local rank 0, count all-reduces)", self.step)
        self.core_status = "skipped: no CORE bundle (--eval-bundle DIR, or a network to download it)"
        try:
            with self.trainer.whole_model() as model:
                core = evaluate_core_for_training(model, self.plan.tokenizer, self.device, self.layout,
                                                  self.args.eval_bundle, self.args.core_metric_max_per_task)
        except EvalBundleError as e:
            print0(f"step {self.step:05d} | CORE failed: {e}")
            self.core_status = f"failed: {e}"
            return
        if core is not None:
            tasks = f"{core['tasks_run']}/{core['tasks_total']} tasks"
            self.core_status = f"{core['core']:.4f} at step {self.step} ({tasks})"
            self.evals["core"] = core["core"]
            print0(f"step {self.step:05d} | CORE ({tasks}): {core['core']:.4f}")

    def sample(self):
        from nanochat.engine import sample_completions
        self.watch.phase("samples", self.step)
        with self.trainer.whole_model() as model:
            for text in sample_completions(model, self.plan.tokenizer):
                print0(f"  sample: {text!r}")

    # --- one step ------------------------------------------------------------------

    def train_step(self):
        t0 = time.time()
        self.watch.phase("data: next batches", self.step)  # a shard one rank cannot read: DataError on every rank
        batches, state = agreed(lambda: training.next_batches(self.train_loader, self.plan.micro_batches), DataError,
                                self.device)
        if state is not None:
            self.last_state = state
        self.watch.phase("training step (TP collectives, PP p2p, DP reductions, optimizer all-gathers)", self.step)
        loss, lrm = self.trainer.step(batches, self.schedule, self.step)
        loss = loss.item()  # also synchronizes the device, so dt is honest
        dt = time.time() - t0
        if not math.isfinite(loss):  # the checkpoints stay: one step's NaN says nothing against weights saved finite
            saved = f"; {ckpt.intact_hint(self.ckpt_dir, quick=True)}" if self.args.save_every and not self.layout.rank \
                else ""
            raise UserError(f"loss is {loss} at step {self.step}; stopping{saved}; if it comes back there, resume from "
                            f"an earlier step or lower the learning rates")
        norms = self.trainer.optimizer.grad_norms.tolist()  # [global, then each of PARAM_GROUPS]
        watched = {"grad_norm": norms[0], **{f"grad_norm_{g}": norms[i] for g, i in self.grad_norm_slots},
                   **self.trainer.signals()}
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
               f"grad norm: {watched['grad_norm']:.4f} | lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | "
               f"tok/sec: {self.tok_per_sec:,.0f}" + (f" | mfu: {self.mfu:.2f}" if self.mfu is not None else "") +
               (f" | moe imbalance: {watched['moe_imbalance']:.2f}" if "moe_imbalance" in watched else "") +
               f" | epoch: {self.epoch} | elapsed: {duration(time.time() - self.started)} | "
               f"eta: {duration(per_step * (n - self.step - 1))}")
        spikes = self.spikes.check(loss, watched["grad_norm"], judge=self.step >= self.args.warmup_steps)
        for what, value, ratio, median, steps in spikes:
            print0(f"step {self.step:05d} | WARNING: {what} spike: {value:.4f} is {ratio:.2f}x the median of the "
                   f"previous {steps} steps ({median:.4f})")
        self.spike_count += len(spikes)
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None
        self.log.log(self.step, loss=loss, loss_smooth=smooth, **watched, lrm=lrm, dt=dt, tok_per_sec=self.tok_per_sec,
                     mfu=self.mfu, peak_mem_gib=peak, epoch=self.epoch, spikes=[s[0] for s in spikes] or None, **self.evals)
        self.evals = {}
        if self.step == self.first_step:  # the first step compiled (at its own pace on each rank): time together
            self.watch.phase("barrier after the compile warm-up (first step)", self.step)
            self.watch.collective("barrier: compile warm-up")
            barrier(self.layout, "the first step (compile warm-up)")
        self.step += 1
        if self.step == self.first_step + 1:  # the collector walks every Python object: once at the start, then rarely
            gc.collect()
            gc.freeze()
            gc.disable()
            atexit.register(gc.unfreeze)  # else at exit extensions (triton's nanobind) report frozen objects as leaked
        elif self.step % 5000 == 0:
            gc.collect()

    # --- the end -------------------------------------------------------------------

    def save_before_stopping(self):
        """A stop request or an error mid-run: this step's checkpoint (unless nothing is saved); says how to go on."""
        if self.args.save_every == 0 and self.saved_step != self.step:  # the step resumed from is saved already
            return f"step {self.step} not saved (--save-every 0)"
        self.save()
        return f"saved step {self.step}: resume with --resume-from-step {self.step}"

    def training_time(self):
        """(seconds, what they are): each launch's steps after its first UNTIMED_STEPS + 1 (compilation), else all."""
        return (self.total_time, f" (each launch's steps after its first {UNTIMED_STEPS + 1}: compilation left out)") \
            if self.total_time > 0 else (self.launch_time, f" ({self.step - self.first_step} steps, compilation included)")

    def finish(self, completed):
        """The summary lines, the report section (a completed run, not a stopped one), and the closing of loaders and
        logs."""
        layout = self.layout
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None
        peaks = gather_objects((layout.tag(), peak_mem))  # ranks differ (pipeline stages, shards): the record holds all
        if peak_mem is not None and layout.world_size > 1:
            print_rank(layout, f"peak memory: {peak_mem:.2f} GiB; allocated after the last step: "
                               f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB")
        self.log.write({"kind": "end", "step": self.step, "training_time_s": self.total_time or None,  # None: no step timed
                        "peak_mem_gib": dict(peaks), "completed": completed})
        if self.val_bpb is not None:
            print0(f"Validation bpb: {self.val_bpb:.6f}")
        t, what = self.training_time()
        summary = ([f"minimum validation bpb: {self.min_val_bpb:.6f}"] if math.isfinite(self.min_val_bpb) else []) + \
                  [(f"training time: {t / 60:.2f} min" if t >= 60 else f"training time: {t:.1f}s") + what] + \
                  ([f"spikes (loss or grad norm): {self.spike_count}"] if self.spike_count else []) + \
                  ([f"peak memory: {peak_mem:.2f} GiB"] if peak_mem else [])
        print0("; ".join(summary))
        if layout.rank == 0 and completed:
            report.log_section("Base model training", [vars(self.args), self.report_items(peak_mem)])
        self.watch.stop()
        self.log.finish()
        if self.train_loader is not None:
            self.train_loader.close()

    def report_items(self, peak_mem):
        (r, layout), (seconds, what) = (self.recipe, self.layout), self.training_time()
        crop = self.train_loader.stats["crop_fraction"] if self.train_loader is not None else None
        measured = lambda v: float(v) if v is not None and math.isfinite(v) else "not measured"
        return {"parameters": r.param_counts["total"], "scaling parameters": r.param_counts["scaling"],
                "FLOPs per token": f"{r.flops_per_token:.4e}", "total batch size": r.total_batch_size,
                "iterations": r.num_iterations, "tokens trained": r.tokens,
                "tokens per scaling param": round(r.tokens / r.param_counts["scaling"], 2),
                "training FLOPs": f"{r.flops_per_token * r.tokens:.4e}", "Muon weight decay": r.weight_decay,
                "LR scale": r.lr_scale, "layout": layout.describe(),
                "gpus used": layout.world_size if self.device.type == "cuda" else 0,
                "final validation bpb": measured(self.val_bpb), "CORE during training": self.core_status,
                "minimum validation bpb": measured(self.min_val_bpb),
                "training time (min)": f"{seconds / 60:.3f}{what}",
                "tok/sec (last step)": round(self.tok_per_sec) if self.step > self.first_step else "n/a (no step this launch)",
                "spikes (loss or grad norm)": self.spike_count,
                "context (tokens)": ", then ".join(f"{n:,}" + (f" from step {s}" if s else "") for s, n in self.plan.contexts),
                "data": "the same shards throughout" if not self.new_data_at else
                        f"new shards from step {', '.join(map(str, self.new_data_at))} on (--resume-on-new-data)",
                "mfu (%)": round(self.mfu, 2) if self.mfu is not None else "n/a",
                "peak memory (GiB)": round(peak_mem, 2) if peak_mem else "n/a", "epoch": self.epoch,
                "crop fraction": round(crop, 4) if crop is not None else "n/a", "metrics": self.log.path or "n/a"}


def main(argv=None):
    args = parse_args(argv)
    lock = watch = plan = None
    try:
        kernels.set_mode(args.kernels)
        layout, device = compute_init(args.device_type, tp=args.tp, pp=args.pp, cp=args.cp, seed=args.seed,
                                      timeout_s=args.dist_timeout, ep=args.ep)
        watch = Watchdog(layout.rank, args.dist_timeout if layout.world_size > 1 else None, hang_report_dir())
        plan = Plan(args, layout, device)
        # before anything is written there; a checkpoint: fp32 weights and at most two fp32 moments a parameter
        lock = ckpt.lock_run(layout, device, plan.ckpt_dir, fresh=plan.resume_meta is None, start_over=args.start_over,
                             checkpoint_bytes=12 * plan.recipe.param_counts["total"] if args.save_every else 0)
        run, stopped = Run(args, layout, device, plan, watch), None
        if plan.resume_meta is not None:  # its checkpoint loaded: the later steps go aside, as their records did
            agreed(lambda: ckpt.set_aside_later_steps(plan.ckpt_dir, run.step, into=run.log.aside),
                   ckpt.CheckpointError, device, mine=layout.rank == 0)
        try:
            run.train()
        except Interrupted:  # every rank at the same point (a stop request is agreed on): save, then wrap up
            run.log_evals()  # this step's evaluations so far (a stop in CORE or sampling comes after validation)
            stopped = f"stopped: {run.save_before_stopping()}"
        except DataError as e:  # every rank at the same point (agreed on): this step is saved first
            raise DataError(f"{e} ({run.save_before_stopping()}" +
                            (" once the file is replaced)" if args.save_every else ")")) from None
        run.finish(completed=stopped is None)
        if stopped:
            print0(stopped)  # last: which step to resume from
    except UserError as e:
        fail(str(e), every_rank=e.every_rank)
    except KeyboardInterrupt:  # Ctrl-C in the start-up, before the stop handlers (after them: a stop at a step)
        fail("interrupted during the start-up, before the first step: nothing was trained or saved")
    except Exception as e:  # several ranks: one short line from the first to fail, the traceback in a file
        if watch is None or watch.timeout_s is None:
            raise
        watch.fail(e, lambda: ckpt.intact_hint(plan.ckpt_dir, quick=True) if plan and args.save_every else "")
    finally:
        run_lock.release_lock(lock)
        if watch is not None:
            watch.stop()
    compute_cleanup()


if __name__ == "__main__":
    main()
