"""
What every script needs: where files live (written crash-safe), which device and dtype to compute in (bf16 on SM80+
GPUs, fp32 elsewhere; NANOCHAT_DTYPE overrides; weights stay fp32), the peak FLOP/s behind MFU, rank-aware printing
and progress, the scripts' --help (defaults shown), and the error a script prints as one line.
"""

import os
import json
import zlib
import argparse
import functools
import contextlib
import sys
import time
import statistics

from nanochat.watchdog import keep_alive


class UserError(RuntimeError):
    """Bad input or state, printed by a script as one line (fail), not a traceback: the message names the file or flag
    and what to do. every_rank: this rank's alone (not agreed on), printed by each rank that meets it."""
    every_rank = False


class ConfigError(UserError, ValueError):
    """A flag, or a combination of flags, that cannot run."""


# ---- Files ----

def get_base_dir():
    """The root for tokenizer, checkpoints, data and reports: NANOCHAT_BASE_DIR or ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:  # a file where the folder should be, a read-only parent
        raise UserError(f"cannot create the base dir {base} ({e.strerror}): set NANOCHAT_BASE_DIR to a folder you "
                        f"can write") from None
    return base


RUNCPU_BASE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "nanochat", "runcpu")  # runs/runcpu.sh's default


def base_dir_hint():
    """For "not found" messages: where runs/runcpu.sh keeps its files, where it has run and that is not the base dir in
    use."""
    return "" if os.path.abspath(get_base_dir()) == RUNCPU_BASE_DIR or not os.path.isdir(RUNCPU_BASE_DIR) else (
        f" (runs/runcpu.sh keeps its tokenizer and checkpoints under {RUNCPU_BASE_DIR}: "
        f"run with NANOCHAT_BASE_DIR={RUNCPU_BASE_DIR} to use them)")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, unless its help says it already or there is none (None, an off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def atomic_write(path, data):
    """`data` (bytes, or a function writing to a file) to a temporary file, fsync, rename over `path`, fsync the folder
    (the rename itself survives a power loss): crash-safe."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
            else:
                data(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except BaseException:  # a full disk, a refused rename, a kill: nothing half-written stays behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_json(path, default=None):
    """The JSON in `path`, or `default` (unless None) when there is no such file."""
    if default is not None and not os.path.exists(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def file_checksum(path):
    """CRC-32 of a file, recorded by checkpoints, the tokenizer and exports: it catches a damaged or truncated file (not
    an attack: loading unpickles nothing) at about 3x SHA-256's speed (7 GB/s a core)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


# ---- Device and dtype (torch is imported where it is needed: the data, report and tokenizer tools start without it)

def autodetect_device_type():
    import torch
    return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"


# fp16 is not offered: it would need loss scaling, which the training loop does not do
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def get_compute_dtype(device_type):
    import torch
    if override := os.environ.get("NANOCHAT_DTYPE"):
        if override not in _DTYPES:
            raise UserError(f"NANOCHAT_DTYPE={override!r} is not one of {sorted(_DTYPES)}")
        return getattr(torch, _DTYPES[override])
    return torch.bfloat16 if device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 8 else torch.float32


# bf16 dense peak FLOP/s (no sparsity), for MFU, matched in order against torch.cuda.get_device_name()
PEAK_BF16_FLOPS = [("B200", 2.25e15), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("H800", 989e12), ("GH200", 989e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
                   ("A6000", 155e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12)]


def get_peak_flops(device_name):
    """Peak bf16 FLOP/s of a device, or None when unknown (then MFU is not reported)."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def device_name(device_type):
    import torch
    return torch.cuda.get_device_name() if device_type == "cuda" else device_type


def cuda_time_ms(fn, repeats=20, warmup=3):
    """Median milliseconds of one fn() call on the current CUDA stream (CUDA events), after warm-up calls."""
    import torch
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


def eager(fn):
    """torch.compiler.disable(fn), asked for only while compiling: the decorator would load torch's compiler (seconds)
    in every process, most of which never compile; outside a trace it is a no-op anyway."""
    import torch

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


# ---- Printing ----

def _process_group():
    """torch.distributed where a process group exists, else None (a process that never imported torch has none)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_initialized() else None


def get_rank():  # torchrun's RANK until the process group exists (errors before it print once)
    return dist.get_rank() if (dist := _process_group()) else int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank(layout, *args):
    """print on every rank, prefixed with its place in the grid, e.g. `[dp=0 tp=1] ...` (one process: no prefix)."""
    print(*[layout.tag()] * (layout.world_size > 1), *args, flush=True)


def fail(msg, every_rank=False):
    """Bad input or state: one clear message (from rank 0, or from every rank that met it), a clean shutdown, exit 1."""
    if every_rank:
        print(f"[rank {get_rank()}] ERROR: {msg}", flush=True)
    else:
        print0(f"ERROR: {msg}")
    if get_rank() != 0:  # torchrun stops every process when one exits: let rank 0 print the line first
        time.sleep(2)
    if dist := _process_group():
        dist.destroy_process_group()
    sys.exit(1)


def duration(seconds):  # 3m07s, or 1h02m
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """`label: i/total` with time spent and left, on rank 0 at most every `every` seconds: a long loop is never silent,
    a short one prints nothing. Each update tells the hang watchdog the loop is moving."""

    def __init__(self, label, total, unit="batches", every=10.0):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.t0 = self.last = time.time()

    def update(self, done):
        keep_alive()
        now = time.time()
        if now - self.last < self.every or done >= self.total:
            return
        self.last = now
        rate = done / (now - self.t0)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        print0(f"{self.label}: {done}/{self.total} {self.unit} ({now - self.t0:.0f}s, about {eta:.0f}s left)")
