"""
Checkpoints under $NANOCHAT_BASE_DIR/base_checkpoints/<model_tag>/, one set of files per step:

  model_<step>.pt   full (unsharded) fp32 tensors, by parameter name
  optim_<step>.pt   the optimizer's layout-free state (full tensors by parameter name)
  meta_<step>.json  model config, step, loop state, the dataloader state of every DP rank, user flags

With pipeline parallelism each stage writes its own parameters to model_<step>_stage<k>.pt (and
optim_..._stage<k>.pt); the loader merges them. The tensors are always whole, so a checkpoint saved
at one (DP, TP, PP) layout loads at any other.

Every file is written to a temporary name and renamed, and meta_<step>.json is written last: a step
counts as saved only when its meta exists, so a kill during a save never damages an earlier one. The
temporary files an interrupted save leaves (<name>.tmp.<pid>) are removed at the next save.
Loading uses torch.load(weights_only=True) and JSON: nothing arbitrary is unpickled.

What can go wrong is caught where it happens, with one line naming the file: weights that are not finite
are never saved (a diverged run must not become the latest checkpoint) and never loaded; a damaged or
refused file says which step to delete; a checkpoint records its tokenizer's hash, and a checkpoint used
with another tokenizer is an error that names both.
"""

import os
import re
import glob
import json
import pickle

import torch

from nanochat.common import UserError, get_base_dir, atomic_write_bytes, atomic_torch_save, base_dir_hint


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, diverged or made with another tokenizer."""


def checkpoint_dir(model_tag, base_dir=None):
    return os.path.join(base_dir or get_base_dir(), "base_checkpoints", model_tag)


def _suffix(stage, num_stages):
    return "" if num_stages == 1 else f"_stage{stage}"


def nonfinite_tensors(state):
    """Names of the floating-point tensors of a state dict that hold a NaN or an infinity."""
    return [name for name, t in state.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]


def remove_stale_tmp(ckpt_dir):
    """Delete the <file>.tmp.<pid> files of saves that were interrupted (their process is gone)."""
    for path in glob.glob(os.path.join(ckpt_dir, "*.tmp.*")):
        m = re.search(r"\.tmp\.(\d+)$", path)
        if m and not _process_alive(int(m.group(1))):
            os.remove(path)


def _process_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def save_stage_files(ckpt_dir, step, model_state, optim_state, stage=0, num_stages=1):
    """Write one pipeline stage's model and optimizer files (tensors must be full and on CPU)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    remove_stale_tmp(ckpt_dir)
    sfx = _suffix(stage, num_stages)
    atomic_torch_save(model_state, os.path.join(ckpt_dir, f"model_{step:06d}{sfx}.pt"))
    if optim_state is not None:
        atomic_torch_save(optim_state, os.path.join(ckpt_dir, f"optim_{step:06d}{sfx}.pt"))


def save_meta(ckpt_dir, step, meta, num_stages=1):
    """Write meta_<step>.json last: it marks the checkpoint as complete."""
    meta = dict(meta, step=step, num_stages=num_stages)
    atomic_write_bytes(os.path.join(ckpt_dir, f"meta_{step:06d}.json"), json.dumps(meta, indent=2).encode())


def saved_steps(ckpt_dir):
    """The steps with a meta_<step>.json (the complete checkpoints), ascending."""
    return sorted(int(m.group(1)) for f in glob.glob(os.path.join(ckpt_dir, "meta_*.json"))
                  if (m := re.search(r"meta_(\d+)\.json$", f)))


def find_last_step(ckpt_dir):
    steps = saved_steps(ckpt_dir)
    if not steps:
        raise CheckpointError(f"no checkpoint in {ckpt_dir} (looked for meta_*.json)")
    return steps[-1]


def delete_checkpoint(ckpt_dir, step):
    """The meta first (so the step stops counting as saved before its tensors go), then the tensor files."""
    os.remove(os.path.join(ckpt_dir, f"meta_{step:06d}.json"))
    for path in glob.glob(os.path.join(ckpt_dir, f"model_{step:06d}*.pt")) + glob.glob(os.path.join(ckpt_dir, f"optim_{step:06d}*.pt")):
        os.remove(path)


def prune_checkpoints(ckpt_dir, keep_last):
    """Delete all but the newest keep_last checkpoints."""
    for step in saved_steps(ckpt_dir)[:-keep_last]:
        delete_checkpoint(ckpt_dir, step)


def _damaged(path, step, why):
    return CheckpointError(f"{path} is damaged ({why}): delete step {step}'s files (model_{step:06d}*, optim_{step:06d}*, "
                           f"meta_{step:06d}.json) and use an earlier step")


def load_meta(ckpt_dir, step):
    path = os.path.join(ckpt_dir, f"meta_{step:06d}.json")
    if not os.path.exists(path):
        available = sorted(int(re.search(r"(\d+)", os.path.basename(f)).group(1)) for f in glob.glob(os.path.join(ckpt_dir, "meta_*.json")))
        raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}; saved steps: {available or 'none'}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError as e:  # truncated or edited by hand
        raise _damaged(path, step, f"not a checkpoint's JSON: {type(e).__name__}: {e}") from None
    return meta


def _load_merged(ckpt_dir, step, kind, num_stages, device):
    merged = {}
    for stage in range(num_stages):
        path = os.path.join(ckpt_dir, f"{kind}_{step:06d}{_suffix(stage, num_stages)}.pt")
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint step {step} is incomplete: {path} is missing")
        try:
            part = torch.load(path, map_location=device, weights_only=True)
        except pickle.UnpicklingError:  # an object other than tensors, dicts and numbers: never unpickled
            raise CheckpointError(f"{path} holds objects other than tensors, which are not loaded (unpickling them could "
                                  f"run code); a checkpoint from base_train holds tensors only: use one saved by it") from None
        except (RuntimeError, EOFError, OSError) as e:  # a truncated or corrupt file
            raise _damaged(path, step, f"{type(e).__name__}: {str(e).split('. ')[0] or 'unreadable'}") from None
        if kind == "optim":  # {'adamw_step': n, 'params': {...}}
            merged.setdefault("params", {}).update(part["params"])
            merged["adamw_step"] = part["adamw_step"]
        else:
            merged.update(part)
    return merged


def load_checkpoint(ckpt_dir, step=None, device="cpu", load_optimizer=True):
    """(model_state, optim_state or None, meta) for a step (default: the latest). Weights that are not
    finite are refused."""
    step = find_last_step(ckpt_dir) if step is None else step
    meta = load_meta(ckpt_dir, step)
    n = meta.get("num_stages", 1)
    model_state = _load_merged(ckpt_dir, step, "model", n, device)
    bad = nonfinite_tensors(model_state)
    if bad:
        earlier = [s for s in saved_steps(ckpt_dir) if s < step]
        raise CheckpointError(f"checkpoint step {step} in {ckpt_dir} has weights that are not finite ({', '.join(bad[:3])}"
                              f"{', ...' if len(bad) > 3 else ''}): the run had diverged; use an earlier step "
                              f"(saved: {earlier or 'none'}) with --step / --resume-from-step")
    optim_state = _load_merged(ckpt_dir, step, "optim", n, device) if load_optimizer else None
    return model_state, optim_state, meta


def check_tokenizer(meta, tokenizer, ckpt_dir):
    """The checkpoint must be used with the tokenizer it was trained with: another one of the same vocab
    size would load and give wrong bpb and garbage samples. Checkpoints from before the hash was recorded
    are accepted as they are (the vocab size still has to fit the weights)."""
    saved = meta.get("tokenizer_hash")
    if saved is None:
        return
    if saved != tokenizer.hash:
        raise CheckpointError(f"the checkpoint in {ckpt_dir} (step {meta['step']}) was trained with tokenizer {saved}, "
                              f"but the tokenizer in {tokenizer.directory} is {tokenizer.hash}: use the tokenizer it was "
                              f"trained with (NANOCHAT_BASE_DIR of that run)")


def latest_model_tag(base_dir=None):
    """The most recently written tag folder under base_checkpoints/."""
    root = os.path.join(base_dir or get_base_dir(), "base_checkpoints")
    tags = [d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))] if os.path.isdir(root) else []
    if not tags:
        raise CheckpointError(f"no checkpoints in {root}: train a model with `python -m scripts.base_train` first"
                              + base_dir_hint())
    return max(tags, key=lambda d: os.path.getmtime(os.path.join(root, d)))


def load_model(model_tag=None, step=None, device="cpu", compute_dtype=torch.float32, base_dir=None, layout=None,
               tokenizer=None):
    """Build a GPT from a checkpoint for evaluation or sampling (the latest tag and step unless given).
    With a layout of TP > 1 the full weights are loaded, then sharded for this rank, so a checkpoint
    from any training layout evaluates at any TP. `tokenizer`: the one to use with it, checked against
    the checkpoint's. Returns (model, meta); meta["model_tag"] is the tag."""
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
    config = GPTConfig.from_dict(meta["model_config"])
    model = build_model(config, device, compute_dtype)
    load_model_state(model, model_state)
    if layout is not None and layout.tp_size > 1:
        from nanochat.tensor_parallel import parallelize
        parallelize(model, layout)
    model.eval()
    meta["model_tag"] = model_tag
    return model, meta


def load_model_state(model, full_state):
    """Copy full tensors into a (possibly sharded, possibly partial) model: each parameter or buffer
    takes its own shard of the tensor with its name. Keys the model does not have are skipped (other
    pipeline stages); keys it has must be present."""
    from nanochat import tensor_parallel as tp
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = [k for k in model.state_dict().keys() if k not in full_state]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    with torch.no_grad():
        for name in model.state_dict().keys():
            target = own[name]
            src = tp.local_shard(full_state[name], target)
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(full_state[name].shape)} does not fit "
                                      f"the model's {tuple(target.shape)} (different --depth/--aspect-ratio/vocab?)")
            target.copy_(src)


def full_model_state(model, keep=True):
    """Full CPU tensors by name (a collective over the TP group when the model is sharded). Ranks that
    will not write (keep=False) take part in the gathers but keep nothing."""
    from nanochat import tensor_parallel as tp
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    out = {}
    for name, t in model.state_dict().items():
        full = tp.gather_full(t.detach(), own[name])
        if keep:
            out[name] = full.cpu()
    return out
