"""
Checkpoints in $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/, per step: model_<step>.pt (full fp32 tensors),
optim_<step>.pt (layout-free optimizer state), meta_<step>.json (config, loop and dataloader states, flags, checksums).
Under PP or EP one file per stage and EP rank (_stage<k>, k = stage x EP + EP rank; later EP ranks hold their experts
only), merged on load: whole tensors, so any (DP, TP, PP, EP) layout loads any checkpoint. Files are written to a
temporary name and renamed, meta last: a step is saved once its meta exists; a failed or killed save leaves at
most some of its tensor files without a meta (no saved step: a resume sets them aside). Loading unpickles
nothing and refuses a file failing its checksum, non-finite weights and another tokenizer, naming the newest intact
step. A run locks its folder (run_lock.py); a new run refuses a folder holding another run's files.
"""

import os
import re
import json
import time
import contextlib
import errno
import pickle
import shutil

import torch
from torch.utils._pytree import tree_leaves

from nanochat.common import UserError, get_base_dir, atomic_write, base_dir_hint, print0, file_checksum, read_json


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, diverged or made with another tokenizer."""


def checkpoint_dir(model_tag, base_dir=None):
    if model_tag in ("", ".", "..") or "/" in model_tag or os.sep in model_tag:  # a path would leave the folder
        raise CheckpointError(f"--model-tag {model_tag!r}: give a folder name (not empty, '.' or '..'; no '/')")
    return os.path.join(base_dir or get_base_dir(), "base_checkpoints", model_tag)


def _tensor_file(ckpt_dir, kind, step, stage, num_stages):  # model_ or optim_<step>[_stage<k>].pt
    return os.path.join(ckpt_dir, f"{kind}_{step:06d}" + ("" if num_stages == 1 else f"_stage{stage}") + ".pt")


def nonfinite_tensors(state):  # names of the floating-point tensors holding a NaN or an infinity
    return [name for name, t in state.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]


def save_stage_files(ckpt_dir, step, model_state, optim_state, stage=0, num_stages=1):
    """Write one stage's model and optimizer files (full CPU tensors); returns {file name: checksum}. A disk without
    room is named before writing."""
    need = sum(t.numel() * t.element_size() for t in tree_leaves([model_state, optim_state]) if torch.is_tensor(t))
    written = {}
    with _write_failure_named(ckpt_dir, step, need, written):
        os.makedirs(ckpt_dir, exist_ok=True)
        if (free := shutil.disk_usage(ckpt_dir).free) < need * 1.05 + 2**20:
            raise _no_space(ckpt_dir, step, need, free)
        for kind, state in (("model", model_state), ("optim", optim_state)):
            if state is not None:
                path = _tensor_file(ckpt_dir, kind, step, stage, num_stages)
                atomic_write(path, lambda f: torch.save(state, f))
                written[os.path.basename(path)] = file_checksum(path)
    return written


@contextlib.contextmanager
def _write_failure_named(ckpt_dir, step, need, written=()):
    """A failed write (full disk, read-only folder) stops with one line naming the file, the error and the intact
    step; this step's files already written go (a step is whole or absent)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save's zip writer raises over the OSError
        if not isinstance(cause, OSError):
            raise
        for name in written:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(ckpt_dir, name))
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(ckpt_dir, step, need, shutil.disk_usage(ckpt_dir).free) from None
        raise CheckpointError(f"cannot write {cause.filename or ckpt_dir} ({cause.strerror}) saving step {step}; " +
                              intact_hint(ckpt_dir) + ". Make the folder writable, or set NANOCHAT_BASE_DIR to one "
                              "that is") from None


def _size(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _no_space(ckpt_dir, step, need, free):
    return CheckpointError(f"the disk is full: saving step {step} in {ckpt_dir} needs about {_size(need)} and "
                           f"{_size(free)} is free; {intact_hint(ckpt_dir)}. Free some space, or set NANOCHAT_BASE_DIR "
                           f"to a disk with room")


def intact_hint(ckpt_dir, before=None, quick=False):
    """For error lines: the newest step (before `before`) whose files are all there and match their checksums; quick:
    whose meta is there (written after its files), nothing read, where the other ranks will not wait for a checksum
    of every file (a resume checks them, and names the newest intact step if one is damaged)."""
    for step in reversed(saved_steps(ckpt_dir)):
        if before is not None and step >= before:
            continue
        if quick:
            return f"step {step} is the newest saved there (resume with --resume-from-step {step})"
        with contextlib.suppress(CheckpointError):
            verify(ckpt_dir, step)
            return f"step {step} is intact there (resume with --resume-from-step {step})"
    return "no earlier step was saved there" if before is None else "no earlier step there is intact"


def lock_run(layout, device, ckpt_dir, fresh=False, start_over=False, checkpoint_bytes=0):
    """Rank 0 takes the folder before anything is written: the lock, the temporary files of saves killed earlier (any
    node's: the lock excludes other runs, and this one has written nothing), start_fresh for a fresh run, room for one
    checkpoint of checkpoint_bytes. A refusal stops every rank with one line. Returns the lock (None off rank 0)."""
    from nanochat.distributed import agree_on_error
    from nanochat.run_lock import take_lock, release_lock
    lock, error = None, None
    if layout.rank == 0:
        try:
            lock = take_lock(ckpt_dir)
            for f in os.listdir(ckpt_dir):  # only what atomic_write leaves of a checkpoint or the records
                if re.fullmatch(r"((model|optim|meta)_\d+\S*|metrics\.jsonl)\.tmp\.\d+", f):
                    os.remove(os.path.join(ckpt_dir, f))
            if fresh:
                start_fresh(ckpt_dir, start_over)
            if checkpoint_bytes and (free := shutil.disk_usage(ckpt_dir).free) < checkpoint_bytes * 1.05:
                raise CheckpointError(f"the disk of {ckpt_dir} has {_size(free)} free and one checkpoint of this run "
                                      f"needs about {_size(checkpoint_bytes)}: free some space, set NANOCHAT_BASE_DIR to "
                                      f"a disk with room, or save nothing (--save-every 0)")
        except OSError as e:  # a read-only base dir, a file where the folder should be, a full disk
            error = (f"cannot write {e.filename or ckpt_dir} ({e.strerror}): set NANOCHAT_BASE_DIR to a folder you can "
                     f"write, or fix this one")
        except CheckpointError as e:
            error = str(e)
    if (error := agree_on_error(error, device)) is not None:
        release_lock(lock)
        raise CheckpointError(error)
    return lock


def start_fresh(ckpt_dir, start_over):
    """Another run's checkpoints or records here: refused, or with start_over moved into replaced_<date>-<time>/."""
    held = [f for f in os.listdir(ckpt_dir) if f == "metrics.jsonl" or step_of(f) is not None]
    if not held:
        return
    if not start_over:
        steps = saved_steps(ckpt_dir)
        what = (f"checkpoints up to step {steps[-1]}: resume it with --resume-from-step latest," if steps else
                "the records of a run that saved no checkpoint (metrics.jsonl):")
        raise CheckpointError(f"{ckpt_dir} holds {what} train under another --model-tag, or pass --start-over to move "
                              f"its files into replaced_<date>-<time>/ there and start again")
    print(f"--start-over: moved the earlier run's {len(held)} files into {move_aside(ckpt_dir, held)}", flush=True)


def set_aside_later_steps(ckpt_dir, step, into=None):
    """A run resumed from a step before the newest (its checkpoint loaded): the later steps' files go into
    replaced_<date>-<time>/ (`into`: the folder their records already went into), so that the run neither writes over
    them nor has --keep-last prune by number the steps it saves, and a later resume of the newest step finds the
    records of the steps before it (even when this launch saves nothing)."""
    later = [f for f in os.listdir(ckpt_dir) if (saved := step_of(f)) is not None and saved > step]
    if not later:
        return
    try:
        aside = move_aside(ckpt_dir, later, into)
    except OSError as e:
        raise CheckpointError(f"cannot move the later steps' files of {ckpt_dir} aside ({e.strerror}: {e.filename}); "
                              f"resume from step {saved_steps(ckpt_dir)[-1]} instead, or make the folder writable") from None
    print(f"resuming from step {step}: moved the {len(later)} files of later steps into {aside}", flush=True)


def step_of(name):
    """The step a checkpoint file (model_, optim_ or meta_<step>...) belongs to; None for any other file."""
    return int(m.group(2)) if (m := re.match(r"(model|optim|meta)_(\d+)", name)) else None


def move_aside(ckpt_dir, files, into=None):
    """`files` of ckpt_dir moved into `into` or a new replaced_<date>-<time>[-n]/ there; returns its path."""
    aside = base = into or os.path.join(ckpt_dir, "replaced_" + time.strftime("%Y%m%d-%H%M%S"))
    n = 0
    while into is None and os.path.exists(aside):  # another move this second
        n += 1
        aside = f"{base}-{n}"
    os.makedirs(aside, exist_ok=True)
    for f in files:
        os.replace(os.path.join(ckpt_dir, f), os.path.join(aside, f))
    return aside


def check_data_unchanged(resume_meta, data_dir, data_listing, resume_on_new_data=False):
    """A data position holds only for the shards it was saved with: others stop the run, unless --resume-on-new-data.
    Then, where the saved training shards are the first of the new ones as they were, and the run had not begun a
    second epoch, the position goes on into the added shards ("continue"); else all are read from the start
    ("restart"). None: the same shards."""
    from nanochat.dataset import listing_changes
    if "data_listing" not in resume_meta:  # saved without a listing (imported weights)
        return None
    saved = resume_meta["data_listing"]
    changes = listing_changes(saved, data_listing)
    step = resume_meta["loop_state"]["step"]
    if changes and not resume_on_new_data:
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise CheckpointError(f"the shards in {data_dir} differ from those step {step} was trained on: {shown}. "
                              f"Put the saved shards back, or pass --resume-on-new-data to read the new data")
    if not changes:
        return None
    first_epoch = all((s or {}).get("epoch", 1) == 1 for s in resume_meta.get("dataloader_states", []))  # None: step 0
    mode = "continue" if first_epoch and data_listing[:len(saved) - 1] == saved[:-1] else "restart"
    print0(f"note: the shards in {data_dir} differ from step {step}'s ({len(changes)} changes); --resume-on-new-data: " +
           ("the saved training shards lead the new ones: the data position goes on into the added shards"
            if mode == "continue" else "reading them from the start"))
    return mode


def save_meta(ckpt_dir, step, meta, num_stages=1):
    """The meta file (with its tensor files' checksums), last: it makes the step count as saved."""
    data = json.dumps(dict(meta, step=step, num_stages=num_stages), indent=2).encode()
    with _write_failure_named(ckpt_dir, step, len(data), written=meta.get("checksums", {})):
        atomic_write(os.path.join(ckpt_dir, f"meta_{step:06d}.json"), data)


def saved_steps(ckpt_dir):
    return sorted(int(m.group(1)) for f in os.listdir(ckpt_dir) if (m := re.fullmatch(r"meta_(\d+)\.json", f))) \
        if os.path.isdir(ckpt_dir) else []


def find_last_step(ckpt_dir):
    if not (steps := saved_steps(ckpt_dir)):
        raise CheckpointError(f"no checkpoint in {ckpt_dir} (looked for meta_*.json)")
    return steps[-1]


def prune_checkpoints(ckpt_dir, keep_last):
    """Delete all but the newest keep_last steps, each meta first (the step stops counting as saved), then tensors."""
    for step in saved_steps(ckpt_dir)[:-keep_last]:
        os.remove(os.path.join(ckpt_dir, f"meta_{step:06d}.json"))
        for f in os.listdir(ckpt_dir):  # the step's own files: model_100000*.pt would also match step 1000000's
            if f.endswith(".pt") and step_of(f) == step:
                os.remove(os.path.join(ckpt_dir, f))


def _damaged(path, step, why):
    return CheckpointError(f"{path} is damaged ({why}); {intact_hint(os.path.dirname(path), before=step)}")


def load_meta(ckpt_dir, step, needs=()):
    """The meta of a step, holding the keys `needs` (a resume: the model config, the loop and data states)."""
    path = os.path.join(ckpt_dir, f"meta_{step:06d}.json")
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}; "
                              f"saved steps: {saved_steps(ckpt_dir) or 'none'}")
    try:
        meta = read_json(path)
    except ValueError as e:  # truncated or edited by hand
        raise _damaged(path, step, f"not a checkpoint's JSON: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, step, "not a checkpoint's JSON object")
    if missing := [k for k in needs if k not in meta]:
        raise _damaged(path, step, f"no {', '.join(missing)} in it")
    kinds = {"step": int, "num_stages": int, "model_config": dict, "user_config": dict, "loop_state": dict,
             "dataloader_states": list, "checksums": dict}  # what the readers index into, when present
    if wrong := [k for k, kind in kinds.items() if k in meta and not isinstance(meta[k], kind)]:
        raise _damaged(path, step, f"{', '.join(wrong)} of the wrong type")
    return meta


def _check_file(path, step, checksums):
    """The file is there and matches its recorded checksum (a checkpoint from before checksums: not checked)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint step {step} is incomplete: {path} is missing")
    if (saved := checksums.get(os.path.basename(path))) and file_checksum(path) != saved:
        raise _damaged(path, step, "it no longer matches the checksum saved with it")


def verify(ckpt_dir, step):
    """CheckpointError unless every file the meta lists matches its checksum (before checksums: model files exist)."""
    meta = load_meta(ckpt_dir, step)
    n, sums = meta.get("num_stages", 1), meta.get("checksums", {})
    for name in sums or [os.path.basename(_tensor_file(ckpt_dir, "model", step, s, n)) for s in range(n)]:
        _check_file(os.path.join(ckpt_dir, name), step, sums)


def _load_merged(ckpt_dir, step, kind, num_stages, device, checksums):
    merged = {}
    for stage in range(num_stages):
        path = _tensor_file(ckpt_dir, kind, step, stage, num_stages)
        _check_file(path, step, checksums)
        try:
            part = torch.load(path, map_location=device, weights_only=True)
        except pickle.UnpicklingError:  # an object other than tensors, dicts and numbers: never unpickled
            raise CheckpointError(f"{path} holds objects other than tensors, which are not loaded (unpickling them "
                                  f"could run code); a checkpoint from base_train holds tensors only: use one saved "
                                  f"by it") from None
        except (RuntimeError, EOFError, OSError) as e:  # a truncated or corrupt file
            raise _damaged(path, step, f"{type(e).__name__}: {str(e).split('. ')[0] or 'unreadable'}") from None
        if kind == "optim":  # {'adamw_step': n, 'params': {...}}
            merged.setdefault("params", {}).update(part["params"])
            merged["adamw_step"] = part["adamw_step"]
        else:
            merged.update(part)
    return merged


def load_checkpoint(ckpt_dir, step=None, device="cpu", load_optimizer=True):
    """(model_state, optim_state or None, meta) for a step (default: the latest); non-finite weights refused."""
    step = find_last_step(ckpt_dir) if step is None else step
    meta = load_meta(ckpt_dir, step)
    n, sums = meta.get("num_stages", 1), meta.get("checksums", {})
    model_state = _load_merged(ckpt_dir, step, "model", n, device, sums)
    if bad := nonfinite_tensors(model_state):
        raise CheckpointError(f"checkpoint step {step} in {ckpt_dir} has weights that are not finite "
                              f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): the run had diverged; "
                              f"{intact_hint(ckpt_dir, before=step)} (--step for sample and base_eval)")
    optim_state = _load_merged(ckpt_dir, step, "optim", n, device, sums) if load_optimizer else None
    return model_state, optim_state, meta


def check_tokenizer(meta, tokenizer, ckpt_dir):
    saved = meta.get("tokenizer_hash")
    if saved is not None and saved != tokenizer.hash:
        raise CheckpointError(f"the checkpoint in {ckpt_dir} (step {meta['step']}) was trained with tokenizer "
                              f"{saved}, but the tokenizer in {tokenizer.directory} is {tokenizer.hash}: use the "
                              f"tokenizer it was trained with (NANOCHAT_BASE_DIR of that run)")


def latest_model_tag(base_dir=None):
    """The most recently written tag folder under base_checkpoints/ that holds a checkpoint (a run that saved none
    leaves its metrics only)."""
    root = os.path.join(base_dir or get_base_dir(), "base_checkpoints")
    tags = [d for d in os.listdir(root) if saved_steps(os.path.join(root, d))] if os.path.isdir(root) else []
    if not tags:
        raise CheckpointError(f"no checkpoints in {root}: train a model with `python -m scripts.base_train` first"
                              + base_dir_hint())
    return max(tags, key=lambda d: os.path.getmtime(os.path.join(root, d)))


def load_model(model_tag=None, step=None, device="cpu", compute_dtype=torch.float32, base_dir=None, layout=None,
               tokenizer=None):
    """(model, meta with "model_tag") for evaluation or sampling, by default of the latest tag and step; full weights,
    sharded at TP > 1 (any checkpoint, any TP); `tokenizer`, if given, checked against it."""
    from nanochat.gpt import GPTConfig, build_model
    model_tag = model_tag or latest_model_tag(base_dir)
    ckpt_dir = checkpoint_dir(model_tag, base_dir)
    if not os.path.isdir(ckpt_dir):
        root = os.path.dirname(ckpt_dir)
        tags = sorted(os.listdir(root)) if os.path.isdir(root) else []
        raise CheckpointError(f"no checkpoints for model tag {model_tag!r} in {root}; tags found: {tags or 'none'}")
    model_state, _, meta = load_checkpoint(ckpt_dir, step, device="cpu", load_optimizer=False)
    if tokenizer is not None:
        check_tokenizer(meta, tokenizer, ckpt_dir)
    model = build_model(GPTConfig.from_dict(meta["model_config"]), device, compute_dtype)
    load_model_state(model, model_state)
    if layout is not None and layout.tp_size > 1:
        from nanochat.recipe import Setting
        from nanochat.tensor_parallel import parallelize
        # MoE layers stay whole under TP: without SP every rank runs every token's experts, redundant but right for
        # evaluation (training needs SP for its expert loads and its cost), so the check is told SP's rule holds
        Setting(tp=layout.tp_size, device_batch=1, total_batch=model.config.sequence_len,
                sequence_parallel=bool(model.config.moe_experts)).check(model.config)
        parallelize(model, layout)
    meta["model_tag"] = model_tag
    return model.eval(), meta


def load_model_state(model, full_state):
    """Copy full tensors into a (possibly sharded or partial) model, each its own shard; keys it lacks are skipped."""
    from nanochat import tensor_parallel as tp
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if missing := [k for k in model.state_dict().keys() if k not in full_state]:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    with torch.no_grad():
        for name in model.state_dict().keys():
            target = own[name]
            src = tp.local_shard(full_state[name], target)
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(full_state[name].shape)} does not fit "
                                      f"the model's {tuple(target.shape)} (different --depth/--aspect-ratio/vocab?)")
            target.copy_(src)


def full_model_state(model, keep=lambda name: True):
    """Full CPU tensors by name, those passing `keep`; a collective over TP and DP (sharded weights) that every rank
    joins."""
    from nanochat import tensor_parallel as tp
    from nanochat.sharding import whole_over_dp
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out = {}
    for name, t in model.state_dict().items():
        full = tp.gather_full(whole_over_dp(t.detach(), own[name]), own[name])
        if keep(name):
            out[name] = full.cpu()
    return out


def whole_model_copy(model, layout):
    """A whole copy of a TP, PP, EP or sharded model on every rank, for CORE and sampling (any sequence length, which
    PP's fixed-shape messages and SP's equal split cannot take; calls an EP group's ranks do not make together).
    Collectives: full_model_state's; over the PP (then EP) group, gather_objects (who holds what), one broadcast a
    tensor."""
    import torch.distributed as dist
    from nanochat.distributed import gather_objects
    from nanochat.gpt import build_model
    from nanochat.expert_parallel import is_expert
    device = next(model.parameters()).device
    state = full_model_state(model)
    for group, shares in ((layout.pp_group, lambda name: True), (layout.ep_group, is_expert)):
        if group is None:  # a size of 1
            continue
        mine = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items() if shares(n)}
        for r, tensors in enumerate(gather_objects(mine, group)):  # per rank: name -> (shape, dtype) of what it holds
            for name, (shape, dtype) in tensors.items():
                t = state[name].to(device) if r == dist.get_rank(group) else \
                    torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.broadcast(t, src=dist.get_global_rank(group, r), group=group)
                state[name] = t
    full = build_model(model.config, device, model.compute_dtype)
    load_model_state(full, state)
    return full.eval()
