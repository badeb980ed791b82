"""
Where a training step's GPU time goes, read from a torch.profiler Chrome trace of a few whole steps: the
kernels by total GPU time, grouped into matmuls, attention, optimizer-free elementwise work and the rest;
the wall time of the same steps beside the kernel time, so the gap (GPU idle: host syncs, launch overhead,
eager code) shows; and where that idle time sits: each stretch with no kernel running is charged to the
part of the step (forward, backward, optimizer, or a label of the caller's) and the host operation that
the CPU was in when the GPU ran dry.

Used by dev/profile_train.py (this harness's step) and dev/profile_script.py (any training script, such as
upstream nanochat's); it imports no harness, so either can load it.
"""

import json
from collections import defaultdict


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


def part_of(names, labels):
    """The part of the step that open host events with these names belong to: torch's own labels tell
    the optimizer and the backward (on autograd's thread); a caller's label (record_function) names the
    rest; without one it is the forward and whatever else the script does between steps."""
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n.startswith("autograd::engine::evaluate_function") for n in names):
        return "backward"
    return next((n for n in names if n in labels), "forward/other")


class HostContext:
    """For increasing times ts: the part of the step and the innermost host op running at ts (a sweep
    over the host events, sorted by start)."""

    def __init__(self, events, labels):
        self.events, self.labels, self.next, self.open = events, labels, 0, []

    def at(self, ts):
        while self.next < len(self.events) and self.events[self.next]["ts"] <= ts:
            self.open.append(self.events[self.next])
            self.next += 1
        self.open = [e for e in self.open if e["ts"] + e["dur"] >= ts]
        part = part_of([e["name"] for e in self.open], self.labels)
        ops = [e for e in self.open if e["name"] not in self.labels]
        op = min(ops, key=lambda e: e["dur"])["name"] if ops else "(no op)"
        return part, op


def report(trace_path, n, wall_ms, top=40, labels=frozenset()):
    """Print the tables for a trace of n steps whose unprofiled wall time was wall_ms per step."""
    trace = json.load(open(trace_path))["traceEvents"]
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
    print(f"wall time per step: {wall_ms:.1f} ms; GPU kernel time per step: {total / n / 1000:.1f} ms over "
          f"{len(kernels) // n} kernel launches; idle {wall_ms - total / n / 1000:.1f} ms")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<40} {t / n / 1000:9.1f} ms  {100 * t / total:5.1f}%")
    print(f"\n{'kernel':<100} {'ms/step':>9} {'%':>6} {'calls':>7}")
    for name, t in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:100]:<100} {t / n / 1000:9.2f} {100 * t / total:6.1f} {calls[name] // n:7d}")

    # --- idle time: the part of the step, and the host op, that the CPU was in when the GPU ran dry ---
    # host events of every thread (the backward runs on autograd's own thread)
    cpu = sorted((e for e in trace if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"), key=lambda e: e["ts"])
    host_context = HostContext(cpu, labels).at
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
