"""
The process-group layout: torchrun's processes as a grid world = PP x DP x CP x TP, every group created explicitly;
the parallel files take their groups from the Layout. Ranks go TP fastest, then CP, DP, PP: the most frequent talkers
get the fastest links (NVLink before the network): TP several times a block, CP once an attention layer, DP once a
step, PP once a micro-batch and stage. CP ranks hold the same weights: gradients are summed over DP x CP.

Collectives here (host-side or one scalar):
  barrier            gloo, all ranks: a rank waiting in vain fails after --dist-timeout, naming what it waited for
  all_reduce MAX     of one float over all ranks (all_reduce_max: a stop request, an error flag)
  all_gather_object  objects of every rank (gather_objects): the message of a rank that failed (agree_on_error)
"""

import os
import sys
import datetime
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanochat.common import UserError, get_base_dir, autodetect_device_type


# torch 2.13 renamed two collectives (the old names warn at every use); 2.11 has only the old ones
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankFailure(UserError):
    """A collective this rank waited on in vain: its own failure, which the others may not share."""
    every_rank = True


@dataclass
class Layout:
    """Where this process sits in the world = PP x DP x CP x TP grid. Groups are None when a size is 1."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None
    cp_group: object = None
    dp_cp_group: object = None  # DP x CP: the ranks whose gradients are summed (the optimizer's group)
    # this rank and the next / previous pipeline stage (a ring): batched p2p runs on its group's one NCCL stream, so
    # each pair of neighbours gets its own, and a late message to one neighbour does not hold up the other's
    pp_next_group: object = None
    pp_prev_group: object = None
    # expert parallelism (expert_parallel.py): EP groups of ep_size consecutive DP ranks; expert-DP: the ranks holding
    # the same experts
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    expert_dp_group: object = None
    cpu_group: object = None  # gloo group of all ranks for host-side waits (None: the default group is gloo)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    def describe(self):
        return f"dp {self.dp_size} x " + (f"cp {self.cp_size} x " if self.cp_size > 1 else "") + \
            f"tp {self.tp_size} x pp {self.pp_size}" + (f", experts over ep {self.ep_size}" if self.ep_size > 1 else "")

    def peer(self, **coords):
        """Global rank of the process at this one's coordinates with those given changed (e.g. pp=0)."""
        return grid_rank(self, **(dict(dp=self.dp_rank, cp=self.cp_rank, tp=self.tp_rank, pp=self.pp_rank) | coords))

    def tag(self):
        parts = [f"{d}={getattr(self, d + '_rank')}" for d in ("dp", "cp", "tp", "pp")
                 if d == "dp" or getattr(self, d + "_size") > 1]
        return "[" + " ".join(parts) + "]"


def grid_rank(layout, dp, cp, tp, pp):
    return ((pp * layout.dp_size + dp) * layout.cp_size + cp) * layout.tp_size + tp


def build_layout(rank, world_size, local_rank, tp=1, pp=1, cp=1, ep=1):
    """Split the world into DP x CP x TP x PP and create every process group, in one order on every rank."""
    if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp) != 0:
        raise UserError(f"world size {world_size} is not divisible by tp={tp} x pp={pp} x cp={cp}; "
                        f"choose degrees whose product divides the number of processes")
    dp = world_size // (tp * pp * cp)
    if ep < 1 or dp % ep:
        raise UserError(f"--ep {ep} must divide the data-parallel size, {dp}: experts are spread over DP ranks")
    L = Layout(rank=rank, world_size=world_size, local_rank=local_rank, dp_size=dp, tp_size=tp, pp_size=pp, cp_size=cp,
               tp_rank=rank % tp, cp_rank=(rank // tp) % cp, dp_rank=(rank // (tp * cp)) % dp,
               pp_rank=rank // (tp * cp * dp), ep_size=ep, ep_rank=(rank // (tp * cp)) % dp % ep)
    if world_size == 1:
        return L

    def join(name, ranks):  # every rank creates every group, and keeps those it is in
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            setattr(L, f"{name}_group", group)
    # a group: the ranks that share every coordinate outside `dims`
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    product = [("dp_cp", ("dp", "cp"))] if dp > 1 and cp > 1 else []  # else it is one of the two
    for name, dims in [("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",))] + product:
        others = [d for d in sizes if d not in dims]
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            join(name, sorted(grid_rank(L, **dict(zip(others, fixed)), **dict(zip(dims, inner)))
                              for inner in itertools.product(*(range(sizes[d]) for d in dims))))
    if not product:
        L.dp_cp_group = L.dp_group if cp == 1 else L.cp_group
    for fixed in itertools.product(range(dp), range(cp), range(tp)) if pp > 1 else ():
        for s in range(pp if pp > 2 else 1):  # at pp = 2 both neighbours are the one other stage
            pair = [grid_rank(L, *fixed, pp=s), grid_rank(L, *fixed, pp=(s + 1) % pp)]
            group = dist.new_group(sorted(pair))
            if rank == pair[0] or (pp == 2 and rank in pair):
                L.pp_next_group = group
            if rank == pair[1] or (pp == 2 and rank in pair):
                L.pp_prev_group = group
    for fixed in itertools.product(range(cp), range(tp), range(pp)) if ep > 1 else ():
        cut = [[grid_rank(L, d, *fixed) for d in range(g * ep, (g + 1) * ep)] for g in range(dp // ep)]
        for name, members in [("ep", ranks) for ranks in cut] + [("expert_dp", list(ranks)) for ranks in zip(*cut)]:
            join(name, members)
    return L


def _script_name():  # base_train, base_eval, ...: sys.argv[0] is the file's path (or, run by runpy, the module's name)
    name = os.path.basename(sys.argv[0])
    return name[:-3] if name.endswith(".py") else name.rpartition(".")[2]


def compute_init(device_type="", tp=1, pp=1, cp=1, seed=42, timeout_s=None, ep=1):
    """Set up device, seeds and (under torchrun) the process groups, whose collectives fail after timeout_s seconds
    (None: PyTorch's default); NCCL gets the flight recorder (watchdog) and a gloo group for host waits (barrier)."""
    device_type = device_type or autodetect_device_type()
    if device_type not in ("cuda", "cpu", "mps"):
        raise UserError(f"--device-type={device_type}: cuda, cpu or mps (or leave it out: the script picks)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device-type=cuda but no CUDA device is visible; use --device-type=cpu")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device-type=mps but MPS is not available; use --device-type=cpu")
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (rare here) may use tf32
        torch.backends.cudnn.allow_tf32 = True
    if not all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):  # not under torchrun
        if tp * pp * cp * ep > 1:
            raise UserError(f"--tp={tp} --pp={pp} --cp={cp} --ep={ep} need {tp * pp * cp * ep} processes at least: "
                            f"launch with torchrun --nproc_per_node={tp * pp * cp * ep} -m scripts.{_script_name()} ...")
        # an indexed device, so that device-keyed caches (attention masks) match tensors' .device
        device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else None)
        return build_layout(0, 1, 0), device
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device_type == "cuda" and per_node > torch.cuda.device_count():
        raise UserError(f"torchrun started {per_node} processes on this node, which has {torch.cuda.device_count()} "
                        f"GPU(s): one GPU per process; use --nproc_per_node={torch.cuda.device_count()} (or "
                        f"--device-type=cpu)")
    if device_type == "cuda":
        from nanochat.watchdog import enable_flight_recorder
        enable_flight_recorder(hang_report_dir())
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device(device_type)
        dist.init_process_group(backend="gloo", timeout=timeout)
    layout = build_layout(rank, world_size, local_rank, tp, pp, cp, ep)
    if device_type == "cuda":
        layout.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    dist.barrier()
    return layout, device


def compute_cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def hang_report_dir():
    """Where ranks write hang reports and NCCL flight-recorder dumps (per node when the base dir is)."""
    return os.path.join(get_base_dir(), "hang_reports")


def barrier(layout, what):
    """Every rank waits here (host, gloo); one that never arrives fails the others, naming `what`, not a hang."""
    if layout.world_size == 1:
        return
    try:
        dist.barrier(group=layout.cpu_group)
    except RuntimeError as e:
        raise RankFailure(f"rank {layout.rank} waited longer than the collective timeout (--dist-timeout) at the "
                           f"barrier after {what}: another rank did not arrive. Its log and hang report "
                           f"({hang_report_dir()}) say what it was doing; if it was only slow, raise --dist-timeout. "
                           f"({str(e).splitlines()[0]})") from None


def all_reduce_max(value: float, device) -> float:
    """Largest value over all ranks (a flag, a NaN count); identity in one process."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def wait_for(requests, result=None):
    """Wait for the requests (batch_isend_irecv's, async collectives' works); returns `result`, what they fill."""
    for request in requests:
        request.wait()
    return result


def gather_objects(obj, group=None):
    """Every rank's `obj`, in rank order (a collective over `group`, all ranks by default); [obj] in one process."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size(group)
    dist.all_gather_object(objects, obj, group=group)
    return objects


def agree_on_error(message, device):
    """A collective: every rank passes its error message or None, and gets the first failing rank's (None: none
    failed), so that all stop together rather than wait for the failed peer in their next collective until timeout.
    device None: this rank's own message, no collective."""
    if device is None or not dist.is_initialized() or all_reduce_max(float(message is not None), device) == 0:
        return message
    return next(m for m in gather_objects(message) if m is not None)


def agreed(work, error_type, device, mine=True):
    """work() where `mine` (else None); an `error_type` it raises on any rank is raised on every rank with the first
    failing rank's message (agree_on_error, also a barrier). Without a device, this rank alone."""
    result, error = None, None
    try:
        if mine:
            result = work()
    except error_type as e:
        error = str(e)
    if (error := agree_on_error(error, device)) is not None:
        raise error_type(error)
    return result
