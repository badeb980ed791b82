"""
A run's record for tools: metrics.jsonl beside the run's checkpoints, one JSON object per line:
  {"kind": "header", ...}  at every launch: flags, model config, layout, device, attention kernel, fp8, recipe
  {"step": s, ...}         per step: loss (the step's mean), loss_smooth (the log line's debiased EMA), grad_norm
                           (global) and grad_norm_<group> (optim.PARAM_GROUPS), lrm, dt (s), tok_per_sec, mfu (%),
                           peak_mem_gib, epoch; moe_imbalance (MoE); spikes (SpikeWatch); val_bpb and core if evaluated
  {"kind": "end", ...}     at the end: the last step, training time, every rank's peak memory, completed (false: stopped)
A resumed run keeps the records before its first step: one trajectory (where it trains steps again, the file as it was
goes aside first). Rank 0 writes line by line (a line a crash cuts off is skipped when read); wandb and TensorBoard,
when asked for, get the same numbers.
"""

import os
import json
import math
import time
import statistics
import contextlib

from nanochat.common import UserError, atomic_write


class RunLog:
    """Appends a run's records (on rank 0; elsewhere every call is a no-op)."""

    def __init__(self, path, header, start_step=0, wandb_run=None, tensorboard_dir=None, enabled=True):
        self.path, self.wandb, self.tensorboard = (path if enabled else None), None, None
        self.aside = None  # the replaced_<date>-<time>/ folder the earlier records went into (the later steps follow)
        if self.path is None:
            return
        # resumed: the earlier launches' headers, steps before this one's first and the evaluations a stop left at it
        # (not their end records). Steps trained again (a resume from an earlier step, step 0 too): the whole earlier
        # file goes into replaced_<date>-<time>/ first. A fresh run finds no file (checkpoint_manager.start_fresh)
        records = read_records(path)
        kept = [r for r in records if r.get("kind") == "header" or ("kind" not in r and (
            r["step"] < start_step or (r["step"] == start_step and "loss" not in r)))]
        # wandb and TensorBoard first: one that cannot start leaves the run's folder as it was
        if wandb_run:
            try:
                import wandb
                # a resumed run goes on in the wandb run its first launch started (its id in that launch's header)
                earlier = next((r["wandb_id"] for r in records if r.get("kind") == "header" and "wandb_id" in r), None)
                self.wandb = wandb.init(project="nanochat", name=wandb_run, config=header.get("flags", {}), id=earlier,
                                        resume="allow" if earlier else None)
                header = dict(header, wandb_id=self.wandb.id)
            except Exception as e:  # no package, no API key, no network: its own error types
                raise UserError(f"--wandb-run {wandb_run}: wandb did not start ({type(e).__name__}: "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}); log in "
                                f"(wandb login) or leave the flag out") from None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package: pip install 'nanochat[tensorboard]'") from None
            try:  # a resumed run's events for steps it trains again are dropped in favour of the newest
                self.tensorboard = SummaryWriter(tensorboard_dir, purge_step=start_step if records else None)
            except OSError as e:
                raise UserError(f"--tensorboard {tensorboard_dir}: cannot write there ({e.strerror}); name a folder "
                                f"you can write") from None
        with self.named_write_error():
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            if any("loss" in r and r["step"] >= start_step for r in records):  # steps trained again
                from nanochat.checkpoint_manager import move_aside
                self.aside = move_aside(folder, [os.path.basename(path)])
                print(f"resuming from step {start_step}: the records from that step on are kept in {self.aside}")
            atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.write({"kind": "header", "time": time.time(), "start_step": start_step, **header})

    def write(self, record):
        if self.path is None:
            return
        with self.named_write_error(), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    @contextlib.contextmanager
    def named_write_error(self):
        """A record that cannot be written (a read-only or full disk) stops the run with one line naming the file."""
        try:
            yield
        except OSError as e:
            from nanochat.checkpoint_manager import intact_hint
            raise UserError(f"cannot write {e.filename or self.path} ({e.strerror}); "
                            f"{intact_hint(os.path.dirname(self.path))}") from None

    def log(self, step, **fields):
        """One step's record (fields that are None are left out)."""
        record = {"step": step, **{k: v for k, v in fields.items() if v is not None}}
        self.write(record)
        if self.wandb is not None:
            self.wandb.log(record, step=step)  # the run's step, not wandb's count of this launch's calls
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


class SpikeWatch:
    """Loss and gradient-norm spikes: a loss above loss_ratio x the median of the previous `window` steps', or a
    gradient norm above grad_ratio x theirs, once `min_steps` steps are in the window. A spike is reported at its first
    step, not again while it lasts. Steps whose numbers are not finite are judged, not kept."""

    def __init__(self, window=50, min_steps=20, loss_ratio=1.2, grad_ratio=3.0, history=None, spiking=()):
        self.window, self.min_steps, self.loss_ratio, self.grad_ratio = window, min_steps, loss_ratio, grad_ratio
        self.history = [tuple(h) for h in history or []]  # (loss, grad norm) of the latest steps; saved in checkpoints
        self.spiking = set(spiking)  # what is above the rule at the latest step; saved too (a resume mid-spike)

    def check(self, loss, grad_norm, judge=True):
        """[(what, value, ratio to the median, the median, steps in the window)] of the spikes that start at this
        step; then the step joins the window. judge=False: it only joins (the LR warmup, when the norms move fast)."""
        above = []
        if judge and len(self.history) >= self.min_steps:
            for what, value, past, limit in (("loss", loss, [h[0] for h in self.history], self.loss_ratio),
                                             ("grad norm", grad_norm, [h[1] for h in self.history], self.grad_ratio)):
                median = statistics.median(past)
                if not value <= limit * median:  # NaN too
                    above.append((what, value, value / median if median > 0 else math.inf, median, len(past)))
        started = [spike for spike in above if spike[0] not in self.spiking]
        self.spiking = {spike[0] for spike in above}
        if all(map(math.isfinite, (loss, grad_norm))):
            self.history = (self.history + [(loss, grad_norm)])[-self.window:]
        return started


def read_records(path):
    """Every complete record of a metrics.jsonl, in order ([] without a file; a line a crash cut off, or one that is
    not a record, is skipped)."""
    records = []
    if os.path.exists(path):
        with open(path, errors="replace") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    r = json.loads(line)
                    if isinstance(r, dict) and ("kind" in r or isinstance(r.get("step"), int)):
                        records.append(r)
    return records


class Run:
    """A run's metrics.jsonl: `header` (the latest launch's), `steps` ({step: its records merged}), `end` (the last end
    record; None while running or after a crash), and the series."""

    def __init__(self, path):
        self.path = path
        records = read_records(path)
        kinds = {r["kind"]: r for r in records if "kind" in r}  # the last header and end record
        if "header" not in kinds:
            raise FileNotFoundError(f"{path}: no run record there (base_train writes it; was the model tag right?)")
        self.header, self.end, self.steps = kinds["header"], kinds.get("end"), {}
        for r in records:
            if "kind" not in r:
                self.steps.setdefault(r["step"], {}).update(r)

    def series(self, key, from_step=0):
        return {s: r[key] for s, r in sorted(self.steps.items()) if key in r and s >= from_step}

    def losses(self):
        return self.series("loss")

    def last(self, key):
        return next(reversed(self.series(key).values()), None)


def metrics_path(ckpt_dir):
    return os.path.join(ckpt_dir, "metrics.jsonl")
