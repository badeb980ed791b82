"""
A run's record, in a file tools read instead of its printout: metrics.jsonl beside the run's checkpoints
($NANOCHAT_BASE_DIR/base_checkpoints/<model-tag>/), one JSON object per line:
  {"kind": "header", ...}  at every launch: flags, model config, layout, device, attention kernel, fp8, recipe
  {"step": s, ...}         per step: loss (the step's mean), loss_smooth (the debiased EMA the log line shows),
                           lrm, dt (s), tok_per_sec, mfu (%), peak_mem_gib, epoch; val_bpb and core where evaluated
  {"kind": "end", ...}     at the end (completed or stopped): the last step, training time, every rank's peak memory
A resumed run keeps the records before its first step, so the file tells one trajectory. Rank 0 writes line by
line (a line a crash cuts off is skipped when read); wandb, when named, gets the same records.
"""

import os
import json
import time


class RunLog:
    """Appends a run's records (on rank 0; elsewhere every call is a no-op)."""

    def __init__(self, path, header, start_step=0, wandb_run=None, enabled=True):
        self.path, self.wandb = (path if enabled else None), None
        if self.path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # resumed: the earlier launches' headers and steps before this one's first (not their end records)
        kept = [r for r in read_records(path) if r.get("kind") == "header" or ("kind" not in r and r["step"] < start_step)]
        kept = kept if start_step > 0 else []
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.write({"kind": "header", "time": time.time(), "start_step": start_step, **header})
        if wandb_run:
            import wandb
            self.wandb = wandb.init(project="nanochat", name=wandb_run, config=header.get("flags", {}))

    def write(self, record):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, step, **fields):
        """One step's record (fields that are None are left out)."""
        record = {"step": step, **{k: v for k, v in fields.items() if v is not None}}
        self.write(record)
        if self.wandb is not None:
            self.wandb.log(record)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def read_records(path):
    """Every complete record of a metrics.jsonl, in order ([] when there is no file; a line cut off by a crash
    is skipped)."""
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    return records


class Run:
    """A run as its metrics.jsonl tells it: `header` (the latest launch's), `steps` ({step: record}, records of
    one step merged), `end` (the last end record, None while running or after a crash), and the series."""

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
        """{step: value} of the steps from `from_step` on that have `key`."""
        return {s: r[key] for s, r in sorted(self.steps.items()) if key in r and s >= from_step}

    def losses(self):
        return self.series("loss")

    def last(self, key):
        return next(reversed(self.series(key).values()), None)


def metrics_path(ckpt_dir):
    return os.path.join(ckpt_dir, "metrics.jsonl")
