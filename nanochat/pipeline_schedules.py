"""
Pipeline schedules as data: per rank, the list of actions (kind, micro-batch, chunk) one step runs, F a forward, B a
backward (stage_actions: what train_step runs, --pp-print-schedule prints and dev/pipeline_sim.py prices); their
replay in time (simulate) and from it one message order for every rank (message_order). No tensors, no collectives.

With p ranks and m >= p micro-batches, the idle fraction of each rank at equal F and B times:
  gpipe        all m forwards, then all m backwards; m micro-batches of activations alive.     (p-1)/(m+p-1)
  1f1b         warm-up (p-s-1 forwards on rank s), one F one B, cool-down; at most p-s alive.  (p-1)/(m+p-1)
  interleaved  1F1B over V chunks per rank, the micro-batches in groups of p, each group through
               chunk 0, then chunk 1, ...; a V-th of the bubble, V times the messages, m % p == 0. (p-1)/(Vm+p-1)
No zero-bubble schedule (backwards split into input and weight gradients): under torch.compile the split costs
more than the bubble it fills (README, pipeline parallelism).

Messages: every rank posts them in one order (message_order): NCCL runs a pair of ranks' messages in order on one
stream, so two ranks each first waiting on the other would hang.
"""

import itertools

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stage_actions(schedule, p, m, rank, virtual=1):
    """What `rank` of p runs in one step of m micro-batches (module docstring)."""
    if schedule == "gpipe":
        return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved(p, m, virtual, rank)
    warmup = min(p - rank - 1, m)
    acts = [("F", i, rank) for i in range(warmup)]  # warm-up: fill the pipeline
    for b in range(m - warmup):  # steady state: one forward, one backward
        acts += [("F", warmup + b, rank), ("B", b, rank)]
    return acts + [("B", b, rank) for b in range(m - warmup, m)]  # cool-down: drain it


def _interleaved(p, m, V, rank):
    """Megatron-LM's interleaved 1F1B: a rank's k-th forward is micro-batch group*p + k mod p of chunk (k // p) mod V;
    backwards walk the chunks in reverse; a deeper warm-up (2 per later rank, p per extra chunk) feeds later chunks."""
    if m % p:
        raise ValueError(f"interleaved runs the micro-batches in groups of p={p}: m={m} is no multiple of it")
    total = m * V

    def nth(k, backward):
        group, within = divmod(k, p * V)
        v = within // p
        return group * p + within % p, ((V - 1 - v) if backward else v) * p + rank

    warmup = min((p - rank - 1) * 2 + (V - 1) * p, total)
    acts = [("F", *nth(k, False)) for k in range(warmup)]
    for k in range(warmup, total):
        acts += [("F", *nth(k, False)), ("B", *nth(k - warmup, True))]
    return acts + [("B", *nth(k, True)) for k in range(total - warmup, total)]


def idle_formula(schedule, p, m, virtual=1):
    """Each rank's idle fraction of the step at equal F and B times (module docstring)."""
    return (p - 1) / ((virtual if schedule == "interleaved" else 1) * m + p - 1)


def output_chunk(action):
    kind, _, c = action
    return c + 1 if kind == "F" else c - 1


def input_of(action, num_chunks):
    """The action whose output `action` waits for (None: the first chunk's forward)."""
    kind, i, c = action
    if kind == "F":
        return None if c == 0 else ("F", i, c - 1)
    return ("F", i, c) if c == num_chunks - 1 else ("B", i, c + 1)


def simulate(actions, duration, message=lambda action: 0.0):
    """Replay the ranks' action lists in time (duration(action) -> time; message(action) -> the time its output takes
    to reach another rank): per rank, [(action, start, end)] in the order run; ValueError if the lists wait on each
    other."""
    p = len(actions)
    num_chunks = 1 + max(c for acts in actions for _, _, c in acts)
    done, timeline, free = {}, [[] for _ in range(p)], [0.0] * p  # done: action -> its end
    while any(len(timeline[r]) < len(actions[r]) for r in range(p)):
        before = len(done)
        for r in range(p):
            while len(timeline[r]) < len(actions[r]):
                action = actions[r][len(timeline[r])]
                dep = input_of(action, num_chunks)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (message(dep) if dep[2] % p != r else 0.0)
                start = max(free[r], ready)
                free[r] = done[action] = start + duration(action)
                timeline[r].append((action, start, free[r]))
        if len(done) == before:
            raise ValueError("the action lists wait on each other: no rank can run its next action")
    return timeline


def peak_in_flight(actions, kept=None):
    """Per rank, the most micro-batch chunks alive at once, from a forward until its backward, as train_step
    measures (Pipeline.peak_in_flight). kept: per chunk, the bytes its forward keeps (None: 1 each)."""
    weight = lambda c: 1 if kept is None else kept[c]
    return [max(itertools.accumulate((weight(c) if kind == "F" else -weight(c) for kind, _, c in acts), initial=0))
            for acts in actions]


def message_order(actions, rank, chunk_costs=None):
    """This rank's program: ("run", action), ("send", action) right after it, ("recv", action) for another rank's
    output, alike on all ranks by replayed time, then sending rank. Any times give a valid order; nearer the real ones,
    fewer messages wait behind one posted early (a forward takes chunk_costs[c], 1 if None; a backward twice that)."""
    p = len(actions)
    num_chunks = 1 + max(c for acts in actions for _, _, c in acts)
    costs = chunk_costs or [1] * num_chunks
    timeline = simulate(actions, lambda a: costs[a[2]] * (1 if a[0] == "F" else 2))
    keyed = []
    for r, events in enumerate(timeline):
        for n, (action, start, end) in enumerate(events):
            if r == rank:  # after every receive that arrives by its start
                keyed.append(((start, p, n), ("run", action)))
            to = output_chunk(action)
            if not 0 <= to < num_chunks or to % p == r:
                continue
            if r == rank:
                keyed.append(((end, r, n), ("send", action)))
            if to % p == rank:
                keyed.append(((end, r, n), ("recv", action)))
    return [step for _, step in sorted(keyed)]


def action_name(action, virtual=1):
    kind, i, c = action
    return f"{kind}{i}" + (f"c{c}" if virtual > 1 else "")
