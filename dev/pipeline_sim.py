"""
Pipeline schedules in time: replays the action lists that nanochat.pipeline_parallel.stage_actions gives every
stage (what train_step runs) with a time per forward and per backward of one micro-batch on one stage and a
latency per message between stages, and prints the step time, each stage's idle fraction and, with unit times,
the timeline (F3 = forward of micro-batch 3, B3 its backward, . = idle).

    python -m dev.pipeline_sim --schedule 1f1b --stages 4 --microbatches 8                 # unit times
    python -m dev.pipeline_sim --stages 8 --microbatches 16 --forward-ms 31 --backward-ms 64 --p2p-ms 0.2

Each stage runs its actions in order, each as soon as the stage is free and its input is there: a forward
waits for the previous stage's forward of that micro-batch, a backward for the next stage's backward (the last
stage: its own forward); a message between stages takes --p2p-ms. The ideal step is m (F + B): no bubble.
"""

import argparse

from nanochat.pipeline_parallel import stage_actions


def simulate(actions, times, p2p=0.0):
    """actions: per stage, its list of (kind, micro-batch); times: {kind: duration}. Returns per stage the list of
    (kind, micro-batch, start, end), in the order run."""
    p = len(actions)
    done, timeline, queues, free = {}, [[] for _ in range(p)], [list(a) for a in actions], [0.0] * p
    while any(queues):
        progressed = False
        for s in range(p):
            while queues[s]:
                kind, i = queues[s][0]
                if kind == "F":
                    dep = None if s == 0 else ("F", i, s - 1)
                else:
                    dep = ("F", i, s) if s == p - 1 else ("B", i, s + 1)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p if dep[2] != s else 0.0)
                start = max(free[s], ready)
                free[s] = done[kind, i, s] = start + times[kind]
                timeline[s].append((kind, i, start, free[s]))
                queues[s].pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the action lists wait on each other: no stage can run its next action")
    return timeline


def report(timeline, times, unit):
    step = max(t[-1][3] for t in timeline)
    lines = []
    if unit:  # the timeline, one slot per unit of time
        for s, events in enumerate(timeline):
            slots = ["."] * round(step)
            for kind, i, start, end in events:
                slots[round(start)] = f"{kind}{i}"
            lines.append(f"stage {s}: " + " ".join(c.rjust(3) for c in slots))
    busy = [sum(end - start for _, _, start, end in events) for events in timeline]
    m = sum(1 for e in timeline[0] if e[0] == "F")
    ideal = m * sum(times.values())
    lines.append(f"step {step:.2f} (ideal {ideal:.2f}: {step / ideal:.3f}x); idle per stage: " +
                 ", ".join(f"{1 - b / step:.3f}" for b in busy))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--stages", type=int, default=4, help="p")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--forward-ms", type=float, default=1.0, help="one micro-batch's forward on one stage")
    parser.add_argument("--backward-ms", type=float, default=1.0, help="one micro-batch's backward on one stage")
    parser.add_argument("--p2p-ms", type=float, default=0.0, help="one message between neighbouring stages")
    args = parser.parse_args()
    p, m = args.stages, args.microbatches
    times = {"F": args.forward_ms, "B": args.backward_ms}
    timeline = simulate([stage_actions(args.schedule, p, m, s) for s in range(p)], times, args.p2p_ms)
    unit = args.forward_ms == args.backward_ms == 1.0 and args.p2p_ms == 0
    print(f"{args.schedule}, p={p}, m={m}; bubble formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}")
    print(report(timeline, times, unit))


if __name__ == "__main__":
    main()
