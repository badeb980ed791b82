"""
Things every script needs: where files live, which device and dtype to compute in, the torchrun
process groups (DP x TP x PP), rank-aware printing, the peak FLOP/s table for MFU, a CUDA timer,
Ctrl-C / SIGTERM as a request to stop that long loops poll, progress lines for long loops, and the
memory a CPU run may use.

The compute dtype is decided once, here: bf16 on GPUs that have fast bf16 (SM80+), fp32 elsewhere,
overridable with NANOCHAT_DTYPE=float32|bfloat16. Weights stay fp32; modules cast to it.
"""

import os
import sys
import time
import signal
import datetime
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def atomic_write_bytes(path, data: bytes):
    """Write to a temporary file beside `path`, fsync, then rename: a crash leaves the old file intact."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path):
    """torch.save with the same guarantee as atomic_write_bytes."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            raise ValueError(f"NANOCHAT_DTYPE={override!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[override]
    if device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 8:
        return torch.bfloat16
    return torch.float32


# bf16 dense peak FLOP/s (no sparsity), for MFU. Matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = [
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A6000", 155e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


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


# -----------------------------------------------------------------------------
# Processes: torchrun init, the DP x TP x PP layout, printing


@dataclass
class Layout:
    """Where this process sits in the world = PP x DP x TP grid (TP varies fastest: TP peers are
    neighbouring ranks, which on one node share the fastest links). Groups are None when a size is 1."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    pp_prev: int = -1  # global rank of the previous / next pipeline stage, -1 at the ends
    pp_next: int = -1
    cpu_group: object = None  # gloo group of all ranks for host-side waits (None: the default group is gloo)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    def tag(self):
        parts = [f"dp={self.dp_rank}"]
        if self.tp_size > 1:
            parts.append(f"tp={self.tp_rank}")
        if self.pp_size > 1:
            parts.append(f"pp={self.pp_rank}")
        return "[" + " ".join(parts) + "]"


def grid_rank(layout, dp, tp, pp):
    """Global rank of the process at (dp, tp, pp)."""
    return (pp * layout.dp_size + dp) * layout.tp_size + tp


def build_layout(rank, world_size, local_rank, tp=1, pp=1):
    """Split the world into DP x TP x PP and create every process group explicitly. Every rank must
    call new_group for every group, in the same order, even for groups it is not in."""
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp={tp} x pp={pp}; "
                         f"choose tp and pp whose product divides the number of processes")
    dp = world_size // (tp * pp)
    L = Layout(rank=rank, world_size=world_size, local_rank=local_rank, dp_size=dp, tp_size=tp, pp_size=pp)
    L.tp_rank = rank % tp
    L.dp_rank = (rank // tp) % dp
    L.pp_rank = rank // (tp * dp)
    if world_size == 1:
        return L
    for p in range(pp):  # TP groups: same (pp, dp), all tp
        for d in range(dp):
            ranks = [grid_rank(L, d, t, p) for t in range(tp)]
            g = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                L.tp_group = g
    for p in range(pp):  # DP groups: same (pp, tp), all dp
        for t in range(tp):
            ranks = [grid_rank(L, d, t, p) for d in range(dp)]
            g = dist.new_group(ranks) if dp > 1 else None
            if rank in ranks:
                L.dp_group = g
    for d in range(dp):  # PP groups: same (dp, tp), all pp
        for t in range(tp):
            ranks = [grid_rank(L, d, t, p) for p in range(pp)]
            g = dist.new_group(ranks) if pp > 1 else None
            if rank in ranks:
                L.pp_group = g
    if L.pp_rank > 0:
        L.pp_prev = grid_rank(L, L.dp_rank, L.tp_rank, L.pp_rank - 1)
    if L.pp_rank < pp - 1:
        L.pp_next = grid_rank(L, L.dp_rank, L.tp_rank, L.pp_rank + 1)
    return L


def is_distributed():
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def compute_init(device_type="", tp=1, pp=1, seed=42, timeout_s=None):
    """Set up device, seeds and (under torchrun) the process groups, whose collectives fail after
    timeout_s seconds (None: PyTorch's default). Under NCCL the flight recorder is on (nanochat.watchdog)
    and a gloo group of all ranks serves host-side waits (barrier). Returns (layout, device)."""
    device_type = device_type or autodetect_device_type()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device-type=cuda but no CUDA device is visible; use --device-type=cpu")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("--device-type=mps but MPS is not available; use --device-type=cpu")
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (rare here) may use tf32
        torch.backends.cudnn.allow_tf32 = True
    if is_distributed():
        rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        if device_type == "cuda":
            from nanochat.watchdog import enable_flight_recorder
            enable_flight_recorder(hang_report_dir())
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
        else:
            device = torch.device(device_type)
            dist.init_process_group(backend="gloo", timeout=timeout)
        layout = build_layout(rank, world_size, local_rank, tp, pp)
        if device_type == "cuda":
            layout.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier()
    else:
        if tp * pp > 1:
            raise ValueError(f"--tp={tp} --pp={pp} need {tp * pp} processes at least: launch with "
                             f"torchrun --nproc_per_node={tp * pp} -m scripts.base_train ...")
        # an indexed device, so that device-keyed caches (attention masks) match tensors' .device
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
        layout = build_layout(0, 1, 0)
    return layout, device


def hang_report_dir():
    """Where ranks write hang reports and NCCL flight-recorder dumps (per node when the base dir is)."""
    return os.path.join(get_base_dir(), "hang_reports")


def barrier(layout, what):
    """Every rank waits here (on the host, gloo) for the others. A rank that does not arrive within the
    collective timeout makes the others fail with a message naming `what`, not a silent hang."""
    if layout.world_size == 1:
        return
    try:
        dist.barrier(group=layout.cpu_group)
    except RuntimeError as e:
        raise RuntimeError(f"rank {layout.rank} waited longer than the collective timeout (--dist-timeout) at the "
                           f"barrier after {what}: another rank did not arrive. Its log and hang report "
                           f"({hang_report_dir()}) say what it was doing; if it was only slow, raise --dist-timeout. "
                           f"({str(e).splitlines()[0]})") from None


def compute_cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def fail(msg):
    """Bad input or state: a clear message (once, from rank 0), a clean shutdown, exit status 1."""
    print0(f"ERROR: {msg}")
    compute_cleanup()
    sys.exit(1)


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*args, **kwargs):
    """print on global rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank(layout, *args):
    """print on every rank, prefixed with its place in the grid, e.g. `[dp=0 tp=1] ...`."""
    print(layout.tag(), *args, flush=True)


def all_reduce_max(value: float, device) -> float:
    """Largest value over all ranks (a flag, a NaN count); identity in one process."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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
# Stopping: Ctrl-C and SIGTERM become a request that the training loop and the evaluations poll, so that
# a run stops within seconds at any time (evaluation included) and saves its checkpoint on the way out


class Interrupted(Exception):
    """A stop was requested (Ctrl-C or SIGTERM) while a long operation polled stop_point()."""


_stop_signal = None


def install_stop_handlers():
    """Ctrl-C and SIGTERM set the stop request instead of killing the process."""
    def request_stop(signum, frame):
        global _stop_signal
        if _stop_signal is None:
            print(f"received signal {signum}: stopping at the next step or evaluation batch", flush=True)
        _stop_signal = signum
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def stop_requested():
    return _stop_signal is not None


def stop_agreed(device):
    """Whether any rank was asked to stop (a collective: every rank must call it at the same point)."""
    return all_reduce_max(float(stop_requested()), device) > 0


def stop_point(device=None):
    """Raise Interrupted when a stop was requested. With a device, every rank must call it equally often:
    the ranks agree (a signal reaches them at slightly different times); without one, this rank alone."""
    if (stop_agreed(device) if device is not None else stop_requested()):
        raise Interrupted()


# -----------------------------------------------------------------------------
# Progress of long loops


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


# -----------------------------------------------------------------------------
# Memory


def available_memory():
    """Bytes of memory this process can still use (Linux: MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate_memory(num_params, n_layer, n_embd, vocab_size, tokens, training=True):
    """Bytes a CPU process needs, roughly (measured on CPU, depth 4-8, fp32), plus 1 GiB for the rest.
    Training: 16 per parameter (weights, gradients, two optimizer states) and, per token of a micro-batch,
    18 x vocab (the logits and their gradient) + 96 x layers x width (activations kept for the backward).
    Evaluation: 4 per parameter and, per token, 14 x vocab + 16 x layers x width."""
    if training:
        return 16 * num_params + tokens * (18 * vocab_size + 96 * n_layer * n_embd) + 2**30
    return 4 * num_params + tokens * (14 * vocab_size + 16 * n_layer * n_embd) + 2**30


def cpu_memory_error(num_params, config, batch_size, seq_len, training=True):
    """None when `batch_size` sequences of `seq_len` tokens fit in the memory available to the processes of
    this machine (or it is unknown); else the message, with a batch size that fits. A CPU that runs out of
    memory kills the process without a word, so the scripts refuse first."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    have = available_memory()

    def need(b):
        return processes * estimate_memory(num_params, config.n_layer, config.n_embd, config.vocab_size, b * seq_len, training)
    if have is None or need(batch_size) <= have:
        return None
    fits = [b for b in (2 ** i for i in range(12)) if b < batch_size and need(b) <= have]
    return (f"{'training' if training else 'evaluating'} on the CPU with micro-batches of {batch_size} x {seq_len} tokens "
            f"needs about {need(batch_size) / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB is available: lower "
            f"--device-batch-size" + (f" (about {fits[-1]} fits)" if fits else "") +
            (" or --max-seq-len, or train a smaller --depth" if training else ""))
