r"""
Where a training step's GPU time goes, for any training script, without changing it: this checkout's
scripts.base_train or another checkout's (upstream nanochat's), for a side-by-side look.

    python -m dev.profile_step --skip 4 --steps 2 -- -m scripts.base_train --depth=12 --window-pattern=L \
        --device-batch-size=32 --total-batch-size=524288 --num-iterations=20
    python dev/profile_step.py --root ../nanochat-92d63d4 --skip 6 --steps 2 -- \
        -m scripts.base_train --run=dummy --depth=20 --window-pattern=L --device-batch-size=32 --num-iterations=20

The script runs in this process, from --root (first on sys.path, and the working directory) with the arguments
after `--`. A global optimizer hook (torch.optim.optimizer.register_optimizer_step_post_hook) counts the steps of
any torch.optim.Optimizer (base_train's MuonAdamW is one): after --skip steps (compilation, warm-up) it times
--steps steps unprofiled, profiles the next --steps with torch.profiler, prints the tables below and ends the
process (the script's remaining steps, evaluation and checkpoint are skipped):
- the wall time per step beside the GPU kernel time (the gap is GPU idle: host syncs, launch overhead, eager
  code), and the kernels by total GPU time, grouped into attention, matmuls, communication, copies and the
  elementwise/reduction rest; the communication with no other kernel beside it, in all and by collective;
- where the idle time sits: each stretch with no kernel running is charged to the part of the step and the
  innermost host op the CPU was in when the GPU ran dry, with the largest single gaps.
The parts come from torch's own labels: "optimizer" (Optimizer.step), "backward" (autograd's thread) and
"forward/other", which is everything else between two optimizer steps: the forward, the data loading, the
script's logging and the previous step's tail (zero_grad, the loss's .item()). Seen from outside, the script
has no labels of its own (an in-process profiler could wrap its data, step and step-end code in
record_function); the host-op table is what tells those apart here (e.g. the loader's ops, aten::item).

Needs a CUDA GPU for the kernel tables (on a CPU the trace holds no kernels, and that is all it says). Run it
with -m from this checkout or as a file; it imports nothing of this checkout, so the script's package is the
one under --root.
"""

import os
import sys
import json
import time
import runpy
import argparse
import tempfile
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -----------------------------------------------------------------------------
# The report, from a torch.profiler Chrome trace of n steps


def group_of(name):
    low = name.lower()
    if any(s in low for s in ("attn", "attention", "fmha", "flex", "cudnn")):  # first: FA4's names hold "cutlass"
        return "attention"
    if any(s in low for s in ("gemm", "matmul", "mm_", "cutlass", "sm90_xmma", "nvjet")):
        return "matmul"
    if "nccl" in low:
        return "communication"
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return "elementwise/reduction (triton, aten)"


def collective_of(name):
    """NCCL's collective of a kernel name (AllGather, ReduceScatter, SendRecv, ...), else None."""
    if "nccl" not in name.lower():
        return None
    return name.split("Kernel_", 1)[-1].split("_")[0].split("(")[0]


def part_of(names):
    """The part of the step that open host events with these names belong to: torch's own labels tell the
    optimizer and the backward (on autograd's thread); the rest is the forward and whatever else the script
    does between steps."""
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n.startswith("autograd::engine::evaluate_function") for n in names):
        return "backward"
    return "forward/other"


class HostContext:
    """For increasing times ts: the part of the step and the innermost host op running at ts (a sweep over
    the host events, sorted by start)."""

    def __init__(self, events):
        self.events, self.next, self.open = events, 0, []

    def at(self, ts):
        while self.next < len(self.events) and self.events[self.next]["ts"] <= ts:
            self.open.append(self.events[self.next])
            self.next += 1
        self.open = [e for e in self.open if e["ts"] + e["dur"] >= ts]
        op = min(self.open, key=lambda e: e["dur"])["name"] if self.open else "(no op)"
        return part_of([e["name"] for e in self.open]), op


def busy_time(kernels):
    """How long at least one of these kernels (sorted by start) runs: the union of their intervals (us)."""
    total, end = 0.0, float("-inf")
    for k in kernels:
        if k["ts"] + k["dur"] > end:
            total += k["ts"] + k["dur"] - max(k["ts"], end)
            end = k["ts"] + k["dur"]
    return total


def report(trace_path, n, wall_ms, top=40):
    """Print the tables for a trace of n steps whose unprofiled wall time was wall_ms per step."""
    with open(trace_path) as f:
        trace = json.load(f)["traceEvents"]
    kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not kernels:
        print(f"wall time per step: {wall_ms:.1f} ms; the trace holds no GPU kernels (a CPU run)")
        return

    # --- kernel time: by group and by kernel ---
    by_kernel, calls, groups = defaultdict(float), defaultdict(int), defaultdict(float)
    for k in kernels:
        by_kernel[k["name"]] += k["dur"]
        calls[k["name"]] += 1
        groups[group_of(k["name"])] += k["dur"]
    total = sum(by_kernel.values())
    busy = busy_time(kernels) / n / 1000
    print(f"wall time per step: {wall_ms:.1f} ms; GPU kernel time per step: {total / n / 1000:.1f} ms over "
          f"{len(kernels) // n} kernel launches; some kernel running {busy:.1f} ms (profiled; unprofiled wall less "
          f"that: {wall_ms - busy:.1f} ms)")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<40} {t / n / 1000:9.1f} ms  {100 * t / total:5.1f}%")
    if "communication" in groups:  # communication kernels overlap compute on their own streams: what is left bare
        alone = busy - busy_time([k for k in kernels if group_of(k["name"]) != "communication"]) / n / 1000
        print(f"  communication with no other kernel running (exposed, waits for peers included): {alone:.1f} ms")
        # by collective (NCCL's kernel names: ncclDevKernel_AllGather_RING_LL, ...): where it alone runs
        kinds = {collective_of(k["name"]) for k in kernels if group_of(k["name"]) == "communication"}
        bare = {c: busy - busy_time([k for k in kernels if collective_of(k["name"]) != c]) / n / 1000 for c in kinds}
        print("    of which with no other kernel at all: " + ", ".join(
            f"{c} {t:.1f} ms" for c, t in sorted(bare.items(), key=lambda kv: -kv[1])))
    print(f"\n{'kernel':<100} {'ms/step':>9} {'%':>6} {'calls':>7}")
    for name, t in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:100]:<100} {t / n / 1000:9.2f} {100 * t / total:6.1f} {calls[name] // n:7d}")

    # --- idle time: the part of the step, and the host op, that the CPU was in when the GPU ran dry ---
    # host events of every thread (the backward runs on autograd's own thread)
    cpu = sorted((e for e in trace if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"), key=lambda e: e["ts"])
    host_context = HostContext(cpu).at
    by_part, by_op, gaps = defaultdict(float), defaultdict(float), []
    busy_until = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - busy_until
        if gap > 5:  # microseconds; shorter gaps are the launch queue's own spacing
            part, op = host_context(busy_until)
            by_part[part] += gap
            by_op[(part, op)] += gap
            gaps.append((gap, part, op))
        busy_until = max(busy_until, k["ts"] + k["dur"])
    print(f"\nGPU idle per step, by part of the step ({len(gaps) / n:.0f} gaps over 5 us per step, "
          f"{sum(g for g, _, _ in gaps) / n / 1000:.1f} ms in all):")
    for part, t in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<14} {t / n / 1000:8.2f} ms")
    print("by the host op the CPU was in when the GPU ran dry (top 15):")
    for (part, op), t in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {t / n / 1000:8.2f} ms  {part:<14} {op[:90]}")
    print("largest single gaps:")
    for gap, part, op in sorted(gaps, reverse=True)[:8]:
        print(f"  {gap / 1000:8.2f} ms  {part:<14} {op[:90]}")


# -----------------------------------------------------------------------------
# Profiling a script's optimizer steps from outside


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=str, default=ROOT, help="the checkout to run the script from (default: this one)")
    parser.add_argument("--skip", type=int, default=6, help="optimizer steps before any timing: compilation (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="steps timed, then as many profiled (default: %(default)s)")
    parser.add_argument("--trace", type=str, default="", help="write the Chrome trace here (default: a temporary file)")
    parser.add_argument("--top", type=int, default=40, help="kernels to list (default: %(default)s)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS... or -- FILE.py ARGS...")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script or (script[0] == "-m" and len(script) < 2):
        sys.exit("profile_step: give the script after `--`: -m MODULE ARGS... or FILE.py ARGS...")
    if args.skip < 1 or args.steps < 1:
        sys.exit("profile_step: --skip and --steps must be at least 1")

    root = os.path.abspath(args.root)
    os.chdir(root)
    sys.path.insert(0, root)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = torch.profiler.profile(activities=activities)
    state = dict(step=0, t0=None, wall_ms=None)

    def after_step(optimizer, *_):
        state["step"] += 1
        step, skip, n = state["step"], args.skip, args.steps
        if step == skip:
            synchronize()
            state["t0"] = time.time()
        elif step == skip + n:  # the unprofiled wall time first: the profiler itself slows the host
            synchronize()
            state["wall_ms"] = (time.time() - state["t0"]) * 1000 / n
            profiler.start()
        elif step == skip + 2 * n:
            synchronize()
            profiler.stop()
            trace_path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
            profiler.export_chrome_trace(trace_path)
            print(f"\n== profile of optimizer steps {skip + n + 1}-{skip + 2 * n} of {' '.join(script)} ({root})")
            report(trace_path, n, state["wall_ms"], args.top)
            sys.stdout.flush()
            os._exit(0)  # the script's remaining steps, evaluation and checkpoint are not needed

    register_optimizer_step_post_hook(after_step)
    if script[0] == "-m":
        sys.argv = [script[1]] + script[2:]
        runpy.run_module(script[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = script
        runpy.run_path(script[0], run_name="__main__")
    sys.exit(f"profile_step: the script ended after {state['step']} optimizer steps, before {args.skip + 2 * args.steps}: "
             f"raise its step count or lower --skip/--steps")


if __name__ == "__main__":
    main()
