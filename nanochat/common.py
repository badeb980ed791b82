"""
What every script needs: where files live (written so that a crash never damages them), which device and dtype
to compute in (bf16 on GPUs with fast bf16, SM80+; fp32 elsewhere; NANOCHAT_DTYPE overrides; weights stay fp32),
the peak FLOP/s that MFU is measured against, rank-aware printing and progress, the scripts' --help (defaults
shown), and the error a script prints as one line.
"""

import os
import argparse
import sys
import time
import statistics

import torch
import torch.distributed as dist


class UserError(RuntimeError):
    """Bad input or state: the message names the file or flag and what to do. A script prints it as one line
    (fail) instead of a traceback; the data, checkpoint, tokenizer and eval-bundle errors are all of this kind.
    every_rank: the error is this rank's alone (not agreed on), so each rank that meets it prints it."""
    every_rank = False


class ConfigError(UserError, ValueError):
    """A flag, or a combination of flags, that cannot run."""


# -----------------------------------------------------------------------------
# Files


def get_base_dir():
    """The root for tokenizer, checkpoints, data and reports: NANOCHAT_BASE_DIR or ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    os.makedirs(base, exist_ok=True)
    return base


RUNCPU_BASE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanochat", "runcpu")  # runs/runcpu.sh's default


def base_dir_hint():
    """For "not found" messages: where runs/runcpu.sh keeps its files, unless that is the base dir in use."""
    if os.path.abspath(get_base_dir()) == RUNCPU_BASE_DIR:
        return ""
    return (f" (runs/runcpu.sh keeps its tokenizer and checkpoints under {RUNCPU_BASE_DIR}: "
            f"run with NANOCHAT_BASE_DIR={RUNCPU_BASE_DIR} to use them)")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """The scripts' --help: each flag with its default, unless its help says it already or there is none (None,
    an off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def atomic_write(path, write):
    """write(f) into a temporary file beside `path`, fsync, then rename over it: a crash leaves the old file intact."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill: nothing half-written stays behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_bytes(path, data: bytes):
    atomic_write(path, lambda f: f.write(data))


def atomic_torch_save(obj, path):
    atomic_write(path, lambda f: torch.save(obj, f))


# -----------------------------------------------------------------------------
# Device and dtype


def autodetect_device_type():
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


# fp16 is not offered: it would need loss scaling, which the training loop does not do
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def get_compute_dtype(device_type):
    """bf16 where the hardware does it fast (CUDA SM80+), fp32 otherwise; NANOCHAT_DTYPE overrides."""
    override = os.environ.get("NANOCHAT_DTYPE")
    if override:
        if override not in _DTYPES:
            raise UserError(f"NANOCHAT_DTYPE={override!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[override]
    if device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 8:
        return torch.bfloat16
    return torch.float32


# bf16 dense peak FLOP/s (no sparsity), for MFU, matched in order against torch.cuda.get_device_name()
PEAK_BF16_FLOPS = [("B200", 2.25e15), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("H800", 989e12), ("GH200", 989e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
                   ("A6000", 155e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12)]


def get_peak_flops(device_name):
    """Peak bf16 FLOP/s of a device, or None when unknown (then MFU is not reported)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def device_name(device_type):
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    return device_type


def cuda_time_ms(fn, repeats=20, warmup=3):
    """Median milliseconds of one fn() call on the current CUDA stream (CUDA events), after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# -----------------------------------------------------------------------------
# Printing


def get_rank():
    """This process's global rank: torchrun's RANK until the process group exists (errors before it print once)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    """print on global rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank(layout, *args):
    """print on every rank, prefixed with its place in the grid, e.g. `[dp=0 tp=1] ...`."""
    print(layout.tag(), *args, flush=True)


def fail(msg, every_rank=False):
    """Bad input or state: a clear message (once, from rank 0, or from every rank that met it), a clean
    shutdown, exit status 1."""
    if every_rank:
        print(f"[rank {get_rank()}] ERROR: {msg}", flush=True)
    else:
        print0(f"ERROR: {msg}")
    if get_rank() != 0:  # torchrun stops every process when one exits: let rank 0 print the line first
        time.sleep(2)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


class Progress:
    """Prints `label: i/total (rate, ETA)` on rank 0 at most every `every` seconds, so that a loop longer
    than a few seconds is never silent and a short one prints nothing."""

    def __init__(self, label, total, unit="batches", every=10.0):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.t0 = self.last = time.time()

    def update(self, done):
        now = time.time()
        if now - self.last < self.every or done >= self.total:
            return
        self.last = now
        rate = done / (now - self.t0)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        print0(f"{self.label}: {done}/{self.total} {self.unit} ({now - self.t0:.0f}s, about {eta:.0f}s left)")
