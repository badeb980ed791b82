"""
Plan a run's memory without a GPU: what each rank holds at its peak for a layout, whether that fits, the largest
device batch that does, and the layouts of this many GPUs that fit, fastest first (nanochat/memory.py).

    python -m scripts.plan --depth 26 --gpus 8 --gpu h100                  # base_train's layout, then those that fit
    python -m scripts.plan --depth 32 --gpus 8 --gpu h100 --tp 2 --shard-params --recompute selective
    python -m scripts.plan --compare --depths 20,26,32 --gpus 8 --gpu h100,h200   # sharded or not, TP 1 or 2

Every other flag goes to base_train's parser, as the run would take it (model, batch, layout, --recompute, --fp8); the
total batch is the recipe's. A GPU is usable up to 95% (allocator fragmentation) of what the CUDA context and NCCL
leave (1.5 GiB). Predictions are allocated-memory peaks (torch.cuda.max_memory_allocated), as base_train logs.
"""

import argparse
from dataclasses import replace

from nanochat.common import HelpWithDefaults, ConfigError, fail
from nanochat.memory import GIB, GPUS, rank_memory, largest_batch, relative_speed, candidate_settings, usable_bytes
from nanochat.recipe import Setting, parse_args, model_config, derive_recipe


def run_setting(argv, gpus, vocab_size):
    """(config, Setting) from base_train's flags, over `gpus` GPUs."""
    args = parse_args(argv)
    if args.kernels == "reference" or args.compile == 0:  # the activations were fitted to compiled runs, fast kernels
        raise ConfigError("the plan is of compiled runs with the fast kernels: leave out --kernels reference / --compile 0")
    config = model_config(args, vocab_size)
    model_parallel = args.tp * args.pp * args.cp
    if gpus % model_parallel:
        raise ConfigError(f"--gpus {gpus} is not divisible by tp x pp x cp = {model_parallel}")
    return config, Setting.from_args(args, gpus // model_parallel, derive_recipe(args, config).total_batch_size)


def gib(n):
    return f"{n / GIB:,.1f}"


def print_setting(config, s, capacity):
    kinds = ["weights", "working copies", "gradients", "optimizer state", "activations", "total"]
    print(f"d{config.n_layer} ({config.n_embd} wide, {config.sequence_len:,} tokens a sequence), {s.describe()}, "
          f"{s.total_batch:,} tokens a step; GiB per rank at its peak:")
    print("| pipeline rank | " + " | ".join(kinds) + " | fits |\n|" + " --- |" * (len(kinds) + 2))
    for r, parts in enumerate(rank_memory(config, s)):
        print(f"| {r} | " + " | ".join(gib(parts[k]) for k in kinds) +
              f" | {'yes' if parts['total'] <= capacity else 'no'} |")
    best, _ = largest_batch(config, s, capacity)
    print(f"largest power-of-two device batch that fits {gib(capacity)} GiB usable: " + (str(best) if best else "none"))


def print_candidates(config, gpus, total_batch, fp8, capacity, top):
    rows = []
    for s in candidate_settings(config, gpus, total_batch, fp8):
        b, peak = largest_batch(config, s, capacity)
        if b:
            s = replace(s, device_batch=b)
            m = s.total_batch // (b * config.sequence_len * s.dp)
            rows.append((relative_speed(s, m), -s.tp * s.pp * s.cp, not s.shard_params, b, s, peak))
    rows.sort(key=lambda r: r[:4], reverse=True)
    if not rows:
        print(f"no layout of {gpus} GPUs in powers of two both fits d{config.n_layer} in {gib(capacity)} GiB a GPU and "
              f"divides its {total_batch:,} tokens a step")
        return
    print(f"\nlayouts of {gpus} GPUs that fit, fastest first (tok/s per GPU against one GPU without savers, from "
          f"measured factors: an ordering, not a prediction; DP, TP, PP, CP, sharding and recompute varied, other "
          f"layout flags at their defaults); the first is the suggestion:")
    print("| layout | device batch | peak GiB (worst rank) | relative speed |\n| --- | --- | --- | --- |")
    for speed, _, _, b, s, peak in rows[:top]:
        print(f"| {s.describe()} | {b} | {gib(peak)} | {speed:.2f} |")


def print_comparison(depths, gpu_names, gpus, rest, vocab_size, gpu_memory):
    """The largest device batch of each depth on each GPU: unsharded and sharded, TP 1 and 2, DP over the rest."""
    columns = [("unsharded", 1, False), ("sharded", 1, True), ("TP 2", 2, False), ("TP 2 sharded", 2, True)]
    print(f"largest device batch (and the worst rank's peak in GiB) on {gpus} GPUs, recipe batch, "
          f"{' '.join(rest) or 'no further flags'}:")
    print("| model | GPU | " + " | ".join(c[0] for c in columns) + " |\n|" + " --- |" * (len(columns) + 2))
    for depth in depths:
        for name in gpu_names:
            cells = []
            for _, tp, shard in columns:
                flags = rest + ["--depth", str(depth), "--tp", str(tp)] + (["--shard-params"] if shard else [])
                try:
                    config, s = run_setting(flags, gpus, vocab_size)
                    replace(s, device_batch=1).check(config)  # the layout (largest_batch tries the batches)
                except ConfigError as e:  # a layout the run would refuse, not one that does not fit
                    cells.append(f"- ({str(e).split(';')[0]})")
                    continue
                b, peak = largest_batch(config, s, usable_bytes(gpu_memory or GPUS[name]))
                cells.append(f"{b} ({gib(peak)})" if b else "none")
            print(f"| d{depth} | {name if not gpu_memory else f'{gpu_memory:g} GiB'} | " + " | ".join(cells) + " |")


class Help(argparse.RawDescriptionHelpFormatter, HelpWithDefaults):
    """The docstring as written, each flag with its default."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help, allow_abbrev=False,
                                     usage="python -m scripts.plan [plan flags] [base_train flags]")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the run (the world size)")
    parser.add_argument("--gpu", type=str, default="h100",
                        help=f"the GPU: {', '.join(GPUS)} (several, comma-separated, with --compare)")
    parser.add_argument("--gpu-memory", type=float, default=0.0, help="GiB a GPU has, in place of --gpu's")
    parser.add_argument("--compare", action="store_true",
                        help="the table of --depths x --gpu: unsharded and sharded, TP 1 and 2")
    parser.add_argument("--depths", type=str, default="20,26,32", help="with --compare")
    parser.add_argument("--top", type=int, default=10, help="layouts listed")
    parser.add_argument("--vocab-size", type=int, default=32768, help="the tokenizer's vocabulary")
    args, rest = parser.parse_known_args(argv)
    names = [g.strip().lower() for g in args.gpu.split(",") if g.strip()]
    if not (args.gpu_memory == 0 or args.gpu_memory > 1.5) or min(args.vocab_size, args.gpus) < 1 or \
            not all(d.strip().isdigit() for d in args.depths.split(",") if d):
        fail(f"--gpu-memory {args.gpu_memory:g}, --vocab-size {args.vocab_size}, --gpus {args.gpus}, --depths "
             f"{args.depths!r}: give GiB above 1.5 (CUDA and NCCL take that), a positive vocabulary and GPU count, "
             f"and depths as whole numbers")
    if any(f.startswith("--resume-from-step") for f in rest):
        fail("scripts.plan plans a run from its flags: leave out --resume-from-step")
    if len(names) > 1 and not args.compare:
        fail(f"--gpu {args.gpu!r}: one GPU a plan (several go with --compare)")
    if (not names or any(g not in GPUS for g in names)) and not args.gpu_memory:
        fail(f"--gpu {args.gpu!r}: use {', '.join(GPUS)}, or give --gpu-memory GiB")
    try:
        if args.compare:
            print_comparison([int(d) for d in args.depths.split(",") if d], names, args.gpus, rest, args.vocab_size,
                             args.gpu_memory)
            return
        capacity = usable_bytes(args.gpu_memory or GPUS[names[0]])
        config, s = run_setting(rest, args.gpus, args.vocab_size)
        if s.fp8 and names and names[0].startswith("a100"):
            raise ConfigError(f"--fp8 needs an H100-class GPU (compute capability 8.9+); on {names[0]} it trains in bf16")
        try:
            s.check(config)
        except ConfigError:  # a layout base_train would refuse: the layouts that would run, then its one line
            print_candidates(config, args.gpus, s.total_batch, s.fp8, capacity, args.top)
            raise
        print_setting(config, s, capacity)
        print_candidates(config, args.gpus, s.total_batch, s.fp8, capacity, args.top)
    except ConfigError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
