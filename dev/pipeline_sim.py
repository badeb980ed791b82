"""
Pipeline schedules in time: replays the action lists that nanochat.pipeline_schedules.stage_actions gives every
rank (what train_step runs) with nanochat.pipeline_schedules.simulate, and prints the step time, each rank's idle
fraction and the most micro-batch chunks each rank holds alive (peak_in_flight, what train_step measures).

    python -m dev.pipeline_sim --schedule 1f1b --stages 4 --microbatches 8           # unit times: the timeline
    python -m dev.pipeline_sim --measure 26 --out d26.json                            # one GPU: every block's times
    python -m dev.pipeline_sim --times d26.json --table                               # p x m x schedule, priced
    python -m dev.pipeline_sim --times d26.json --schedule 1f1b --stages 4 --microbatches 16

--measure times, on one GPU in bf16, the forward (F) and the backward (B) of every block, the embedding and the head
with its loss, on micro-batches of --batch x --seq tokens (window L; --compile inductor: each block and the loss
compiled, as training compiles them with overlapped reduction), the bytes each forward saves, and the optimizer's step
(MuonAdamW, compiled alike) over the whole model, over the embedding's part and over the head's: a rank's step ends
with the step over its own parameters, after the loss's broadcast that ends train_step has waited for every rank (a
block's share is the blocks' part over the depth: one GPU's stacking of Muon's matrices, the value embeddings' AdamW
spread over all blocks). --times sums them into each chunk of the layout (pipeline_parallel.split_stages, as training
splits). A message between ranks takes its bytes as train_step sends them over --p2p-gbps (a forward's x, x0, x_mid
past the backout layer and the ids; a backward's gradients of those activations); with unit times, --p2p-ms each.
The ideal step is every chunk's work over p ranks, m x sum(F + B) / p, then the slowest rank's optimizer step; idle
fractions are of the step before the optimizer's. Each priced layout also gets the step of replay_queued: the programs
training runs (messages ordered by the chunks' FLOP costs, as Pipeline orders them) with each message waiting its turn
on its pair of ranks' stream, as NCCL runs them, instead of a fixed delay; there compute also runs as it does in
training: --sustained x its time alone, and --contention slower again while an NCCL kernel is resident on its rank
(defaults measured on four H200s at d26; 1 and 0 price the blocks as timed), and each chunk call costs --call-ms more
(fitted on two H200s at d26; 0: none).
"""

import argparse
import json
import statistics

from nanochat.pipeline_parallel import split_stages
from nanochat.pipeline_schedules import (SCHEDULES, idle_formula, peak_in_flight, simulate, stage_actions, action_name,
                                         input_of, message_order, output_chunk)


# Measured on four H200s at d26 (PP 4, m = 16; every rank profiled under 1F1B and interleaving, dev/LOG.md,
# 2026-11-28): a rank's compute kernels in training take ~1.09x the blocks' times alone (sustained load against
# short bursts), and ~1.21x that while an NCCL kernel is resident beside them (one posted before its peer's spins on
# SMs until the peer posts)
SUSTAINED, CONTENTION = 1.09, 0.21
# What a chunk call costs in training beyond its blocks' work, fitted to d26 PP 2 (m = 16) on two H200s with the
# block times measured in the same call (2026-11-29): 1F1B and interleaved both within 0.3% of their steps, from 3.1%
# and 5.2% under. Where from is not settled: a message cannot start while the persistent matmul kernel beside it
# holds every SM (NCCL on high-priority streams no different), and each call's graph launch and autograd set-up
CALL_MS = 1.4
# NCCL point to point between two H200s (batch_isend_irecv, 55-82 MB, as a d26 chunk's messages; dev/LOG.md,
# 2026-11-28): 273-295 GB/s one way, 239-241 GB/s both ways at once (activations and gradients crossing)
P2P_GBPS = 240.0
CONTENTION_ROUNDS, SETTLED = 100, 1e-5  # replays until the step moves less than SETTLED of itself (d26: 10-30)


def step_and_idle(timeline):
    """The step time and each rank's idle fraction of it."""
    step = max(events[-1][2] for events in timeline)
    return step, [1 - sum(end - start for _, start, end in events) / step for events in timeline]


def draw(timeline):
    """With unit times: one slot per unit, F3 = forward of micro-batch 3, . = idle."""
    step = round(max(events[-1][2] for events in timeline))
    lines = []
    for r, events in enumerate(timeline):
        slots = ["."] * step
        for action, start, _ in events:
            slots[round(start)] = action_name(action)
        lines.append(f"rank {r}: " + " ".join(c.rjust(3) for c in slots))
    return "\n".join(lines)


# --- measured times ------------------------------------------------------------------------------------

def measure(depth, batch, seq, reps, compile_backend=None):
    """Per block (and the embedding, the head): median ms of F and the whole backward, the bytes of the tensors its
    forward saves, on this machine's GPU (bf16; the CPU in fp32 without one). compile_backend: each block and the
    loss compiled as training compiles them with overlapped reduction."""
    import time
    import torch
    from nanochat import kernels
    from nanochat.gpt import Residual, build_model
    from nanochat.recipe import config_for_depth
    from nanochat.pipeline_parallel import carried
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = config_for_depth(depth, sequence_len=seq, window_pattern="L")
    model = build_model(config, device, dtype)
    kernels.prepare_attention(config, model.window_sizes, device, dtype)
    if compile_backend:
        torch._dynamo.config.cache_size_limit = 64
        for block in model.blocks:
            block.compile(dynamic=False, backend=compile_backend)
        model.criterion.compile(dynamic=False, backend=compile_backend)
    idx = torch.randint(0, config.vocab_size, (batch, seq), device=device)

    def timed(fn, prepare=lambda: None):
        """Median ms of fn() over reps (after 2 warm-ups), prepare() untimed before each. On a GPU, the GPU's time
        alone: a sleep kernel holds the queue while the host launches fn, as in training, where the host runs ahead
        of the GPU (timed from the host, each call also counted its launch latency, ~0.1-0.3 ms a compiled block)."""
        times = []
        for _ in range(reps + 2):
            prepare()
            sync()
            if device.type == "cuda":
                torch.cuda._sleep(50_000_000)  # ~25 ms: longer than the host takes to launch a block's kernels
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[2:])

    def leaf():
        return torch.randn(model.embed(idx).x.shape, device=device, dtype=dtype, requires_grad=True)

    parts = []  # (where the result goes, forward() -> output tensors)
    results = {"depth": depth, "batch": batch, "seq": seq, "n_embd": config.n_embd, "compile": compile_backend,
               "blocks": [{} for _ in range(depth)], "embed": {}, "head": {}}
    for i in range(depth):
        x, x0 = leaf(), leaf()
        parts.append((results["blocks"][i], lambda i=i, x=x, x0=x0: carried(
            model.run_blocks(Residual(x, x0, None), idx, i, i + 1), False)))
    parts.append((results["embed"], lambda: carried(model.embed(idx), False)))
    x = leaf()
    parts.append((results["head"], lambda: [model.head(Residual(x, x, None), idx)]))
    state = {}
    for result, forward in parts:  # as 1F1B runs them
        saved = {}  # storage -> bytes, of the tensors autograd saves in one forward

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        result["bytes"] = sum(saved.values())
        grads = None if out[0].ndim == 0 else [torch.randn_like(o) for o in out]  # made once, outside the timing
        del out
        run_forward = lambda: state.update(outputs=forward())
        result["F"] = timed(run_forward)
        result["backward"] = timed(lambda: torch.autograd.backward(state["outputs"], grads), run_forward)
    results["optimizer"] = {part: timed(step) for part, step in optimizer_steps(model, compile_backend).items()}
    for i, r in enumerate(results["blocks"]):
        print(f"block {i}: " + ", ".join(f"{k} {v:.3f}" if k != "bytes" else f"{v / 2**20:.0f} MiB"
                                         for k, v in r.items()), flush=True)
    print("embed:", results["embed"], "\nhead:", results["head"], "\noptimizer step (ms):", results["optimizer"])
    return results


def optimizer_steps(model, compile_backend):
    """{part: a function running one optimizer step}: over the whole model ("all"), over the embedding's parameters
    (wte and the smear gate: the first stage's; value embeddings sit in their blocks) and over the head's (lm_head),
    each with gradients in place and its state made by a first step."""
    import torch
    from nanochat.data_parallel import DataParallel
    from nanochat.optim import MuonAdamW, muon_stacks, param_groups
    names = {p: n for n, p in model.named_parameters()}
    part_of = lambda n: "head" if n.startswith("lm_head") else "blocks" if n.startswith("blocks.") else "embed"
    steps = {}
    for part in ("all", "embed", "head"):
        groups = [dict(g, params=[p for p in g["params"] if part in ("all", part_of(names[p]))])
                  for g in param_groups(model, 0.1, 0.001, 0.01, 0.1, 0.0)]
        groups = [g for g in groups if g["params"]]
        adamw = [p for g in groups if g["kind"] == "adamw" for p in g["params"]]
        dp = DataParallel([params for _, _, params in muon_stacks(groups)], adamw)
        optimizer = MuonAdamW(groups, names, dp, compute_dtype=model.compute_dtype,
                              compile=compile_backend == "inductor")
        for g in groups:
            for p in g["params"]:
                p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()  # its state, and its compilation
        steps[part] = optimizer.step
    return steps


def typical(blocks):
    """Each block's times as the median of the blocks that run the same kernels (those that keep the same bytes: with
    or without value embeddings): one slow sample (a busy host, a clock dip) would otherwise price a whole chunk."""
    kinds = {}
    for b in blocks:
        kinds.setdefault(b["bytes"], []).append(b)
    median = {k: {key: statistics.median(b[key] for b in group) for key in ("F", "backward")}
              for k, group in kinds.items()}
    return [dict(b, **median[b["bytes"]]) for b in blocks]


def chunk_layout(measured, p, virtual):
    """The p x virtual chunks training would cut (split_stages on the FLOP costs), priced: {(kind, chunk): ms}, the
    bytes each chunk's forward keeps, the FLOP costs train_step orders its messages by (Pipeline.chunk_costs), and
    {(kind, chunk): bytes of the message that action sends}: a forward's x, x0 (and x_mid past the backout layer) in
    bf16 and the ids, a backward's gradients of the chunk's inputs; {("step", chunk): ms of its optimizer step}."""
    import torch
    from nanochat.gpt import GPT
    from nanochat.recipe import config_for_depth
    from nanochat.pipeline_parallel import block_costs, chunk_costs
    with torch.device("meta"):
        model = GPT(config_for_depth(measured["depth"], sequence_len=measured["seq"], window_pattern="L"))
    costs, head_cost = block_costs(model)
    bounds = split_stages(costs, head_cost, p * virtual)
    last, back = len(bounds) - 1, model.backout_layer
    tokens = measured["batch"] * measured["seq"]
    activation = tokens * measured["n_embd"] * 2
    blocks = typical(measured["blocks"])
    opt = measured.get("optimizer", {})  # measured before the optimizer was: none
    per_block = (opt.get("all", 0.0) - opt.get("embed", 0.0) - opt.get("head", 0.0)) / measured["depth"]
    times, kept, sizes = {}, [], {}
    for c, (a, b) in enumerate(bounds):
        parts = blocks[a:b] + ([measured["embed"]] if c == 0 else []) + \
            ([measured["head"]] if c == last else [])
        times["F", c] = sum(t["F"] for t in parts)
        times["B", c] = sum(t["backward"] for t in parts)
        times["step", c] = (b - a) * per_block + (opt.get("embed", 0.0) if c == 0 else 0.0) + \
            (opt.get("head", 0.0) if c == last else 0.0)
        kept.append(sum(t["bytes"] for t in parts))
        sizes["F", c] = (3 if back < b else 2) * activation + tokens * 8
        sizes["B", c] = (3 if back < a else 2) * activation
    return times, kept, chunk_costs(costs, head_cost, bounds), sizes


def replay_queued(actions, programs, duration, message, tail=0.0, contention=0.0):
    """The step time of train_step's programs (message_order's) with their messages as NCCL runs them: per rank one
    compute stream; per pair of neighbouring ranks one stream (their process group), on which messages run one at a
    time in the order both ranks posted them; a message starts once both ranks have posted it, and not before the
    compute each rank queued before posting it has run (the communicator's stream waits for the compute stream), and
    takes message(the action whose output it carries); an action waits for the message that brings its input; then
    tail ms (the slowest rank's optimizer step, once all ranks are done). simulate() instead charges every message as
    a delay and lets messages overlap freely.

    contention: how much slower compute runs while an NCCL kernel is resident on its rank (from the rank's posting
    of a send or receive, or its pair stream coming free, until the message lands: a kernel posted before its peer's
    spins on SMs until the peer posts). Compute runs at 1 / (1 + contention) of its speed beside one, so a run that
    spends share s of its time so takes its time / (1 - s x contention / (1 + contention)). Since the shares move the
    timeline they are read from, the replay is repeated, each round's shares half the last round's, until the step
    settles (the mean of the last rounds' steps where it does not)."""
    shares, steps = None, []  # shares: per rank, per run, the share of its time beside a resident NCCL kernel
    for _ in range(CONTENTION_ROUNDS if contention else 1):
        step, spans, resident = _replay(actions, programs, duration, message, tail, contention, shares)
        beside = [[_covered(resident[r], start, end) for start, end in spans[r]] for r in range(len(actions))]
        shares = beside if shares is None else [[(a + b) / 2 for a, b in zip(old, new)]
                                               for old, new in zip(shares, beside)]
        if steps and abs(step - steps[-1]) < SETTLED * step:
            return step
        steps.append(step)
    return step if not contention else statistics.mean(steps[-10:])


def _covered(intervals, start, end):
    """The share of [start, end) that the intervals cover (they may overlap each other: counted once)."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered, reach = covered + b - a, b
    return covered / (end - start) if end > start else 0.0


def _replay(actions, programs, duration, message, tail, contention, shares):
    """replay_queued's one pass, each run stretched by 1 + contention x its share (none: unstretched) -> the step,
    each rank's runs' (start, end) and each rank's intervals with an NCCL kernel resident."""
    p = len(actions)
    num_chunks = 1 + max(c for acts in actions for _, _, c in acts)
    runs = [[a for step, a in prog if step == "run"] for prog in programs]
    queues = [{} for _ in range(p)]  # rank -> peer -> [(step, action, runs before it)], in posting order
    for r, prog in enumerate(programs):
        n = 0
        for step, a in prog:
            if step == "run":
                n += 1
                continue
            peer = output_chunk(a) % p if step == "send" else a[2] % p
            queues[r].setdefault(peer, []).append((step, a, n))
    spans = [[] for _ in range(p)]  # per rank, (start, end) of each run so far
    resident = [[] for _ in range(p)]
    arrived, free, head = {}, [0.0] * p, [{peer: 0 for peer in q} for q in queues]
    stream = {}  # pair -> when its stream is free

    def posted(r, n):  # when rank r's op posted after n runs may start (None: those runs not all run yet)
        return 0.0 if n == 0 else (spans[r][n - 1][1] if len(spans[r]) >= n else None)
    while any(len(spans[r]) < len(runs[r]) for r in range(p)) or any(head[r][k] < len(q) for r in range(p)
                                                                       for k, q in queues[r].items()):
        progressed = False
        for r in range(p):
            while len(spans[r]) < len(runs[r]):
                i = len(spans[r])
                a = runs[r][i]
                dep = input_of(a, num_chunks)
                remote = dep is not None and dep[2] % p != r
                if remote and dep not in arrived:
                    break
                start = max(free[r], arrived[dep] if remote else 0.0)
                free[r] = start + duration(a) / (1 - contention / (1 + contention) * shares[r][i] if shares else 1)
                spans[r].append((start, free[r]))
                progressed = True
            for peer, q in queues[r].items():
                while head[r][peer] < len(q) and q[head[r][peer]][0] == "send":
                    _, a, n = q[head[r][peer]]
                    other = queues[peer][r][head[peer][r]] if head[peer][r] < len(queues[peer][r]) else None
                    if other is None or other[:2] != ("recv", a):
                        break  # the receiver has not reached this message in its order yet
                    ready = (posted(r, n), posted(peer, other[2]))
                    if None in ready:
                        break
                    pair = (min(r, peer), max(r, peer))
                    turn = stream.get(pair, 0.0)
                    arrived[a] = stream[pair] = max(*ready, turn) + message(a)
                    resident[r].append((max(ready[0], turn), arrived[a]))
                    resident[peer].append((max(ready[1], turn), arrived[a]))
                    head[r][peer] += 1
                    head[peer][r] += 1
                    progressed = True
        if not progressed:
            raise ValueError("the programs wait on each other")
    return max(max(free), max(stream.values(), default=0.0)) + tail, spans, resident


def price(measured, schedule, p, m, virtual, gbps, sustained=SUSTAINED, contention=CONTENTION, call_ms=CALL_MS):
    """Simulated step (ms), its ideal, each rank's idle fraction and peak activation GiB, and the step with the
    messages queued as NCCL runs them (replay_queued, with `contention`); each message its bytes over gbps GB/s,
    every forward and backward `sustained` x its measured time + call_ms (the optimizer's step as measured: the fit
    that gave SUSTAINED left it out)."""
    times, kept, flops, sizes = chunk_layout(measured, p, virtual)
    times = {key: t * sustained + call_ms if key[0] != "step" else t for key, t in times.items()}
    actions = [stage_actions(schedule, p, m, r, virtual) for r in range(p)]
    duration = lambda a: times[a[0], a[2]]
    message = lambda a: sizes[a[0], a[2]] / (gbps * 1e9) * 1e3
    timeline = simulate(actions, duration, message)
    # each rank's optimizer step over its chunks (r, r + p, ...), after the loss's broadcast has waited for all ranks
    tail = max(sum(times["step", c] for c in range(r, p * virtual, p)) for r in range(p))
    ideal = m * sum(t for (kind, _), t in times.items() if kind != "step") / p + tail
    step = max(events[-1][2] for events in timeline) + tail
    idle = step_and_idle(timeline)[1]
    peak = [b / 2**30 for b in peak_in_flight(actions, kept)]
    queued = replay_queued(actions, [message_order(actions, r, flops) for r in range(p)], duration, message, tail,
                           contention)
    return step, ideal, idle, peak, queued


def table(measured, gbps, sustained=SUSTAINED, contention=CONTENTION, call_ms=CALL_MS):
    rows = ["| p | m | schedule | step ms | queued messages: step ms | step / ideal | idle (mean over ranks) | "
            "idle at equal times | peak activations per rank (GiB, max) |", "| --- " * 9 + "|"]
    for p in (4, 8):
        for m in (8, 16, 32):
            for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
                if p * virtual > measured["depth"] or (schedule == "interleaved" and m % p):
                    continue
                step, ideal, idle, peak, queued = price(measured, schedule, p, m, virtual, gbps, sustained,
                                                        contention, call_ms)
                name = f"interleaved V={virtual}" if schedule == "interleaved" else schedule
                rows.append(f"| {p} | {m} | {name} | {step:,.1f} | {queued:,.1f} | {step / ideal:.3f} | "
                            f"{statistics.mean(idle):.3f} | "
                            f"{idle_formula(schedule, p, m, virtual):.3f} | {max(peak):.1f} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--stages", type=int, default=4, help="p")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--virtual", type=int, default=0, help="chunks per rank (0: 2 for interleaved, else 1)")
    parser.add_argument("--p2p-ms", type=float, default=0.0, help="unit times: one message between ranks")
    parser.add_argument("--p2p-gbps", type=float, default=P2P_GBPS, help="with --times: GB/s a message moves at")
    parser.add_argument("--measure", type=int, default=0, help="depth whose blocks to time on this GPU")
    parser.add_argument("--batch", type=int, default=8, help="--measure: sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=2048, help="--measure: tokens per sequence")
    parser.add_argument("--reps", type=int, default=5, help="--measure: timed repetitions per pass")
    parser.add_argument("--compile", default="", help="--measure: torch.compile backend (inductor), empty: eager")
    parser.add_argument("--out", default="", help="--measure: JSON to write")
    parser.add_argument("--times", default="", help="JSON from --measure: price the layouts with these times")
    parser.add_argument("--table", action="store_true", help="with --times: p 4, 8 x m 8, 16, 32 x every schedule")
    parser.add_argument("--sustained", type=float, default=SUSTAINED, help="with --times: compute's time in training "
                        "over the blocks' times alone (default: %(default)s, four H200s at d26; 1: as timed)")
    parser.add_argument("--contention", type=float, default=CONTENTION, help="with --times: how much slower compute "
                        "runs beside a resident NCCL kernel (default: %(default)s, four H200s at d26; 0: none)")
    parser.add_argument("--call-ms", type=float, default=CALL_MS, help="with --times: ms a chunk call costs in "
                        "training beyond its blocks' times (default: %(default)s, two H200s at d26; 0: none)")
    args = parser.parse_args(argv)
    if args.measure:
        results = measure(args.measure, args.batch, args.seq, args.reps, args.compile or None)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    p, m = args.stages, args.microbatches
    virtual = args.virtual or (2 if args.schedule == "interleaved" else 1)
    if args.times:
        with open(args.times) as f:
            measured = json.load(f)
        print(f"d{measured['depth']}, micro-batches of {measured['batch']} x {measured['seq']} tokens, "
              f"messages at {args.p2p_gbps:g} GB/s")
        if args.table:
            print(table(measured, args.p2p_gbps, args.sustained, args.contention, args.call_ms))
            return
        step, ideal, idle, peak, queued = price(measured, args.schedule, p, m, virtual, args.p2p_gbps,
                                                args.sustained, args.contention, args.call_ms)
        print(f"{args.schedule}, p={p}, m={m}, V={virtual}: step {step:.1f} ms ({step / ideal:.3f}x the ideal "
              f"{ideal:.1f}; {queued:.1f} with the messages queued per pair of ranks); idle per rank: {', '.join(f'{x:.3f}' for x in idle)}; peak activations per rank (GiB): "
              f"{', '.join(f'{x:.1f}' for x in peak)}")
        return
    actions = [stage_actions(args.schedule, p, m, r, virtual) for r in range(p)]
    timeline = simulate(actions, lambda a: 1.0 / virtual, lambda a: args.p2p_ms)
    print(f"{args.schedule}, p={p}, m={m}, V={virtual}, F = B = {1 / virtual:g}; idle at equal times "
          f"{idle_formula(args.schedule, p, m, virtual):.3f}; micro-batch chunks alive at most: "
          f"{peak_in_flight(actions)}")
    if virtual == 1 and not args.p2p_ms:
        print(draw(timeline))
    step, idle = step_and_idle(timeline)
    print(f"step {step:.2f}; idle per rank: " + ", ".join(f"{x:.3f}" for x in idle))


if __name__ == "__main__":
    main()
