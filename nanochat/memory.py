"""
The memory a run needs, estimated before it starts.

- A CPU run (cpu_memory_error): a CPU out of memory kills the process without a word, so the scripts refuse a
  micro-batch that cannot fit, naming a size that does.
- A GPU layout (rank_memory, scripts/plan.py): what each rank of a DP x CP x TP x PP layout holds at its peak, for
  any depth, without a GPU. Parameters, gradients and optimizer state are counted off the model on the meta device,
  cut as the run cuts it (parallelize, split_stages, the optimizer's Muon stacks and DP ownership). Activations: a
  per-token, per-layer, per-width byte count for each --recompute mode, fitted to measured peaks, with Megatron-LM's
  split into the part TP shards and the rest; pipeline stages hold what their schedule keeps alive (peak_in_flight).
"""

import os
import math
import itertools
from dataclasses import replace
from types import SimpleNamespace

import torch

from nanochat.common import ConfigError
from nanochat.recipe import Setting


def available_memory():
    """Bytes of memory this process can still use (Linux: MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def estimate_memory(num_params, n_layer, n_embd, vocab_size, tokens, training=True):
    """Bytes a CPU process needs, roughly (measured on CPU, depth 4-8, fp32), plus 1 GiB for the rest. Training:
    16 per parameter (weights, gradients, two optimizer states) and per token 18 x vocab (logits and their gradient)
    + 96 x layers x width (activations); evaluation: 4 per parameter, per token 14 x vocab + 16 x layers x width."""
    if training:
        return 16 * num_params + tokens * (18 * vocab_size + 96 * n_layer * n_embd) + 2**30
    return 4 * num_params + tokens * (14 * vocab_size + 16 * n_layer * n_embd) + 2**30


def cpu_memory_error(num_params, config, batch_size, seq_len, training=True):
    """None if batch_size x seq_len tokens fit the memory this machine's processes have (or it is unknown), else why."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    have = available_memory()
    # + the attention's (T, T) band mask and its int64 distances, built whole on the CPU (kernels/sdpa.py)
    need = lambda b: processes * (estimate_memory(num_params, config.n_layer, config.n_embd, config.vocab_size,
                                                  b * seq_len, training) + 9 * seq_len ** 2)
    if have is None or need(batch_size) <= have:
        return None
    fits = [b for b in (2 ** i for i in range(12)) if b < batch_size and need(b) <= have]
    return (f"{'training' if training else 'evaluating'} on the CPU with micro-batches of {batch_size} x "
            f"{seq_len} tokens needs about {need(batch_size) / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB is "
            f"available: lower --device-batch-size" + (f" (about {fits[-1]} fits)" if fits else "") +
            (" or --max-seq-len, or train a smaller --depth" if training else ""))


# --- The GPU planner ------------------------------------------------------------------------------------------

GIB = 2 ** 30
# bytes kept for the backward per token, per layer, per unit of width (bf16, compiled, CUDA kernels), fitted to
# peaks measured at d12-d26 (dev/BENCHMARKS.md, "Memory planner"); fp8 keeps FP8_SAVING less, but under block
# recompute FP8_BLOCK_EXTRA more (at d12 and d26 alike: the size of the MLP's bf16 ReLU^2 output; cause unknown)
ACTIVATION_BYTES = {"none": 33.0, "selective": 13.2, "block": 11.2}
FP8_SAVING = 3.0
FP8_BLOCK_EXTRA = 8.0
HEAD_BYTES = 1.6  # per token, times the vocabulary: the lm_head and the fused loss's kept tensors (one GPU)
# under TP the vocab-parallel loss keeps two fp32 tensors a token and vocabulary entry of its shard (the soft cap's tanh,
# the softmax): 8 bytes; with it, the share of a layer's activations TP leaves whole without SP fitted to the peaks
# of d32 TP 2, d32 and d20 TP 2 x DP 2 (H200, 2026-11-27; planned 0.997, 0.997, 1.006 of them, and d32 TP 2 + SP
# 0.987; near Megatron-LM's 10 of 34 bytes x width, this block also keeping its residual and x0 mixes whole)
HEAD_BYTES_TP = 8.0
TP_WHOLE = 0.32
TP_WHOLE_SP = 4 / 34  # under SP, the share still whole: two all-gathered matmul inputs, kept for the weight gradients
# relative tok/s per GPU, measured on H200s (dev/BENCHMARKS.md): recompute at d20/d26, TP=2 at d32 (2026-11-28, device
# batch 8), CP=2 at d12 and 32K, sharding at d32 DP 4 (against plain DP 4); each further TP or CP doubling is charged
# again; PP: the bubble's formula
SPEED = {"selective": 0.91, "block": 0.88, "tp2": 0.771, "cp2": 0.755, "sharded": 0.934}
GPUS = {"h100": 79.6, "h200": 140.4, "a100": 79.2, "a100-40gb": 39.4}  # GiB, as nvidia-smi gives the memory


def usable_bytes(gib):
    """What an allocator peak may reach on a `gib` GiB GPU: 95% (fragmentation) of what CUDA and NCCL leave."""
    return 0.95 * (gib - 1.5) * GIB


_models = {}


def _meta_model(config, s):
    """The model on the meta device (shapes, no memory), cut for TP as the run cuts it; one per config and TP."""
    key = (repr(config), s.tp, s.sequence_parallel)
    if key not in _models:
        from nanochat.gpt import GPT
        with torch.device("meta"):
            model = GPT(config)
        if s.tp > 1:  # the layout parallelize reads: rank 0 of the TP group, no process group
            from nanochat.tensor_parallel import parallelize
            parallelize(model, SimpleNamespace(tp_rank=0, tp_size=s.tp, tp_group=None), s.sequence_parallel)
        _models[key] = model
    return _models[key]


def rank_memory(config, s):
    """Per pipeline rank (DP rank 0, owning the most under sharding), its bytes at the training peak: {"weights",
    "working copies", "gradients", "optimizer state", "activations", "total", "gathered"}; not counted: the step's
    temporaries, CORE's and sampling's model copy under PP, SP or sharding (4 B/param). ConfigError where
    Setting.check fails."""
    from nanochat.optim import muon_stacks, param_groups
    from nanochat.pipeline_parallel import block_costs, split_stages
    from nanochat.pipeline_schedules import stage_actions, peak_in_flight
    from nanochat.data_parallel import RoundRobin, owned_by_rows
    from nanochat.sharding import embedding_types
    from nanochat.tensor_parallel import is_sharded
    from nanochat.moe import extra_activation_bytes, moe_layers
    m = s.check(config)  # micro-batches per step
    model = _meta_model(config, s)
    D = s.dp * s.cp  # the optimizer's group: gradients are summed, and state (and weights) shared, over DP x CP
    dt = s.compute_bytes  # of a gathered weight (fp8's casts come after the gather)
    per_layer = ACTIVATION_BYTES[s.recompute]
    if s.fp8:
        per_layer += FP8_BLOCK_EXTRA if s.recompute == "block" else -FP8_SAVING * per_layer / ACTIVATION_BYTES["none"]
    # the share of a layer's kept bytes TP leaves whole: block recompute keeps the blocks' inputs alone, selective
    # those and the attention's output (cut), none TP_WHOLE; SP cuts the inputs, but without recompute the
    # all-gathered inputs of the attention's and the MLP's first matmuls are kept whole
    left_whole = ({"none": TP_WHOLE_SP} if s.sequence_parallel else
                  {"none": TP_WHOLE, "selective": 0.5, "block": 1.0}).get(s.recompute, 0.0)
    tp_share = left_whole + (1 - left_whole) / s.tp
    tokens = s.device_batch * config.sequence_len / s.cp
    # split as the run splits: by the whole model's costs (before TP cuts it)
    chunks = split_stages(*block_costs(_meta_model(config, replace(s, tp=1, sequence_parallel=False))),
                          s.pp * s.pp_virtual)
    head = (HEAD_BYTES_TP if s.tp > 1 else HEAD_BYTES) * config.vocab_size / s.tp  # on the last chunk
    # per MoE layer, beyond a dense one (under TP, with SP: on this rank's tokens)
    moe = extra_activation_bytes(config, tokens / s.tp, s.recompute, s.ep)
    kept = [tokens * ((b - a) * config.n_embd * per_layer * tp_share + (head if c == len(chunks) - 1 else 0)) +
            moe * sum(i in moe_layers(config) for i in range(a, b)) for c, (a, b) in enumerate(chunks)]
    if s.pp > 1:
        actions = [stage_actions(s.pp_schedule, s.pp, m, r, s.pp_virtual) for r in range(s.pp)]
        act_peaks = peak_in_flight(actions, kept)
    else:
        act_peaks = [kept[0]]
    # per L3 layer, its table cast to the compute dtype, once for the step's micro-batches (sharded: the gathered
    # table is that copy, counted with the gathered weights); its other activations are not counted
    l3 = {int(i): 0 if s.shard_params and D > 1 else layer.key_table.numel() * dt for i, layer in model.l3.items()}
    act_peaks = [peak + sum(l3.get(i, 0) for c, (a, b) in enumerate(chunks) if c % s.pp == r for i in range(a, b))
                 for r, peak in enumerate(act_peaks)]
    if s.cp > 1 and s.exchange == "all-gather":  # a layer's backward holds every rank's K/V and their gradients
        # (both in the compute dtype) beside the activations
        kv = s.device_batch * config.sequence_len * 2 * config.n_kv_head * (config.n_embd // config.n_head) / s.tp
        act_peaks = [a + kv * 2 * dt for a in act_peaks]
    groups = param_groups(model, 0.0, 0.0, 0.0, 0.0, 0.0)
    out = []

    def chunk_units(c):  # the modules chunk c calls: its blocks and their L3 layers, the embedding first, the head last
        a, b = chunks[c]
        return ([model.wte] if c == 0 else []) + [model.blocks[i] for i in range(a, b)] + \
            [model.l3[str(i)] for i in range(a, b) if str(i) in model.l3] + \
            ([model.lm_head] if c == len(chunks) - 1 else [])
    for r in range(s.pp):
        units = [u for c in range(r, len(chunks), s.pp) for u in chunk_units(c)]
        stage = {id(p) for u in units for p in u.parameters()}
        stage |= {id(p) for p in ((model.smear_gate.weight, model.smear_lambda) if r == 0 else ()) +
                  ((model.backout_lambda,) if r == s.pp - 1 else ())}
        mine = [dict(g, params=[p for p in g["params"] if id(p) in stage]) for g in groups]
        weights = state = 0
        sharded = set()  # the tensors sharding cuts (Muon matrices, AdamW tensors owned by rows)
        for group, full_shape, params in muon_stacks([g for g in mine if g["params"]]):
            owned = RoundRobin(len(params), D, 0).rounds
            held = owned if (s.shard_params and D > 1) else len(params)
            if group["name"] == "moe_experts" and s.ep > 1:  # a rank holds its EP rank's experts; they are shared out
                held = len(params) // s.ep                   # over the ranks holding the same ones
                owned = RoundRobin(held, s.dp // s.ep, 0).rounds
            if is_sharded(params[0]):  # TP ranks share the rounds out (tensor_parallel.rounds_held)
                owned = math.ceil(owned / s.tp)
            weights += held * params[0].numel() * 4
            state += owned * (math.prod(full_shape) + full_shape[0]) * 4  # momentum, NorMuon's per-row moment
            sharded |= {id(p) for p in params}
        for p in (p for g in mine if g["kind"] == "adamw" for p in g["params"]):
            rows = owned_by_rows(p, D)
            weights += p.numel() * 4 // (D if rows and s.shard_params else 1)
            state += 8 * p.numel() // (D if rows else 1)  # AdamW's two moments: by rows already (ZeRO-2)
            if rows:
                sharded.add(id(p))
        gathered = working = 0
        if s.shard_params and D > 1:
            whole = [sum(p.numel() for p in u.parameters() if id(p) in sharded) for u in units]
            tables = [sum(p.numel() for m in u.modules() if isinstance(m, embedding_types())
                          for p in m.parameters(recurse=False) if id(p) in sharded) for u in units]
            kept_of = {id(u): w - t for u, w, t in zip(units, whole, tables)}  # kept gathered: all but the tables
            # freed after each call: in a backward this module's whole weights and the previous one's, in a pipeline
            # the gathering posted for its next forward; kept: each chunk's micro-batch alive holds that chunk's
            # weights but the embedding tables, and a block in its call its value embeddings' table (interleaved: and
            # the next chunk's first gathering, posted ahead). And two modules' gradients: as made and sent (both in
            # the compute dtype).
            freed = (3 if s.pp > 1 else 2) * max(whole)
            per_chunk = [sum(kept_of[id(u)] for u in chunk_units(c)) if c % s.pp == r else 0 for c in range(len(chunks))]
            kept_whole = (peak_in_flight(actions, per_chunk)[r] if s.pp > 1 else per_chunk[0]) + \
                max((t for w, t in zip(whole, tables) if w > t), default=0) + (max(whole) if s.pp_virtual > 1 else 0)
            gathered = (max(freed, kept_whole) if s.keep_gathered else freed) * dt
            working = gathered + 2 * max(whole) * 2 * dt
        # fp32 as the weights held: beside the activations after an earlier micro-batch; else whole at the backward's
        # end, when the activations are gone (counted where they outweigh them)
        alive_grads = weights if (m > 1 or s.pp > 1) else max(0, weights - act_peaks[r])
        parts = {"weights": weights, "working copies": working, "gradients": alive_grads,
                 "optimizer state": state, "activations": act_peaks[r]}
        parts["total"] = sum(parts.values())
        parts["gathered"] = gathered  # the whole weights alone, of the working copies
        out.append(parts)
    return out


def worst_rank_peak(config, s):
    return max(r["total"] for r in rank_memory(config, s))


def largest_batch(config, s, capacity):
    """(the largest power-of-two device batch that fits every rank in `capacity` bytes, the worst peak); (0, None)
    if none fits."""
    best = (0, None)
    for b in (2 ** i for i in range(12)):
        try:
            peak = worst_rank_peak(config, replace(s, device_batch=b))
        except ConfigError:
            continue
        if peak <= capacity:
            best = (b, peak)
    return best


def relative_speed(s, micro_batches):
    """Tok/s per GPU against one GPU without savers, from the measured SPEED (an ordering, not a prediction)."""
    speed = SPEED.get(s.recompute, 1.0) * SPEED["tp2"] ** math.log2(s.tp) * SPEED["cp2"] ** math.log2(s.cp) * \
        (SPEED["sharded"] if s.shard_params else 1.0)
    if s.pp > 1:
        speed *= micro_batches * s.pp_virtual / (micro_batches * s.pp_virtual + s.pp - 1)
    return speed


def candidate_settings(config, gpus, total_batch, fp8=False):
    """Every layout of `gpus` GPUs the run accepts (Setting.check at device batch 1: the most micro-batches), CP only
    for sequences of 8K+ tokens, sharded or not, each recompute mode; TP with MoE layers with sequence parallelism."""
    powers = [2 ** i for i in range(int(math.log2(gpus)) + 1) if gpus % 2 ** i == 0]
    for tp, pp, cp in itertools.product(powers, powers, powers):
        if gpus % (tp * pp * cp) or (cp > 1 and config.sequence_len < 8192):
            continue
        shards = (False, True) if gpus > tp * pp else (False,)
        for shard, recompute in itertools.product(shards, ("none", "selective", "block")):
            s = Setting(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, shard_params=shard, recompute=recompute,
                        total_batch=total_batch, fp8=fp8, sequence_parallel=tp > 1 and config.moe_experts > 0)
            try:
                replace(s, device_batch=1).check(config)
            except ConfigError:
                continue
            yield s
