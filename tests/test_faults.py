"""Faults named, not traced: damaged checkpoints and tokenizers, weights that are not finite, a checkpoint
used with another tokenizer, interrupted saves, pruning, and what the CPU can hold. Unit level (no script
runs); the scripts' side is in test_train.py and test_base_eval.py."""

import os
import json
import types
import pickle
import re

import pytest
import torch

from nanochat import checkpoint_manager as ckpt, run_lock
from nanochat.tokenizer import Tokenizer, TokenizerError


def save_step(d, step, weights):
    ckpt.save_stage_files(str(d), step, weights, {"adamw_step": 1, "params": {}})
    ckpt.save_meta(str(d), step, {"model_config": {}, "tokenizer_hash": "0123456789abcdef"})


def test_damaged_checkpoint_files_are_named(tmp_path):
    save_step(tmp_path, 1, {"w": torch.ones(4)})
    model = tmp_path / "model_000001.pt"
    model.write_bytes(model.read_bytes()[:100])  # truncated
    with pytest.raises(ckpt.CheckpointError, match=r"model_000001.pt is damaged .*; no earlier step there is intact"):
        ckpt.load_checkpoint(str(tmp_path), 1)
    save_step(tmp_path, 2, {"w": torch.ones(4)})
    meta = tmp_path / "meta_000002.json"
    meta.write_text(meta.read_text()[:20])
    with pytest.raises(ckpt.CheckpointError, match=r"meta_000002.json is damaged \(not a checkpoint's JSON"):
        ckpt.load_checkpoint(str(tmp_path), 2)
    meta.write_text("{}")  # JSON, but not a checkpoint's: a resume names what it lacks
    with pytest.raises(ckpt.CheckpointError, match=r"meta_000002.json is damaged \(no model_config, loop_state in it\)"):
        ckpt.load_meta(str(tmp_path), 2, needs=("model_config", "loop_state"))
    meta.write_text('{"model_config": [], "loop_state": {}, "checksums": null}')  # edited: readers would trace
    with pytest.raises(ckpt.CheckpointError, match=r"damaged \(model_config, checksums of the wrong type\)"):
        ckpt.load_checkpoint(str(tmp_path), 2)


def test_a_damaged_optimizer_file_is_named_and_a_temporary_meta_is_no_step(tmp_path):
    sums = ckpt.save_stage_files(str(tmp_path), 1, {"w": torch.ones(4)}, {"adamw_step": 1, "params": {}})
    ckpt.save_meta(str(tmp_path), 1, {"model_config": {}, "checksums": sums})  # as base_train saves: with checksums
    optim = tmp_path / "optim_000001.pt"
    data = bytearray(optim.read_bytes())
    data[-10] ^= 0xFF  # a flipped byte: it still unpickles
    optim.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"optim_000001.pt is damaged"):
        ckpt.load_checkpoint(str(tmp_path), 1)
    assert ckpt.load_checkpoint(str(tmp_path), 1, load_optimizer=False)[0]["w"].sum() == 4  # weights only: fine
    (tmp_path / "meta_000003.json.tmp.5").write_text("{}")  # a save killed before its meta's rename
    assert ckpt.saved_steps(str(tmp_path)) == [1] and ckpt.find_last_step(str(tmp_path)) == 1
    sums = ckpt.save_stage_files(str(tmp_path), 0, {"w": torch.ones(4)}, {"adamw_step": 0, "params": {}})
    ckpt.save_meta(str(tmp_path), 0, {"model_config": {}, "checksums": sums})
    assert ckpt.intact_hint(str(tmp_path)).startswith("step 0 is intact")  # step 1's optimizer file is damaged
    assert ckpt.intact_hint(str(tmp_path), quick=True).startswith("step 1 is the newest saved")  # no file read


def test_a_save_that_fails_part_way_leaves_no_part_of_its_step(tmp_path, monkeypatch):
    """The optimizer's file or the meta refused (a folder made read-only, say): the step's files written before it go,
    the error names the file, and the step before stays the newest; a prune that fails part way has already made its
    step not count (the meta goes first)."""
    import errno
    sums = ckpt.save_stage_files(str(tmp_path), 2, {"w": torch.ones(4)}, {"adamw_step": 1, "params": {}})
    ckpt.save_meta(str(tmp_path), 2, {"model_config": {}, "checksums": sums})
    replace = os.replace

    def refuse(name):
        def fake(src, dst):
            if os.path.basename(dst) == name:
                raise PermissionError(errno.EACCES, "Permission denied", dst)
            return replace(src, dst)
        monkeypatch.setattr(os, "replace", fake)
    refuse("optim_000004.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*optim_000004.pt \(Permission denied\)"):
        ckpt.save_stage_files(str(tmp_path), 4, {"w": torch.ones(4)}, {"adamw_step": 2, "params": {}})
    refuse("meta_000004.json")
    sums = ckpt.save_stage_files(str(tmp_path), 4, {"w": torch.ones(4)}, {"adamw_step": 2, "params": {}})
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*meta_000004.json \(Permission denied\)"):
        ckpt.save_meta(str(tmp_path), 4, {"model_config": {}, "checksums": sums})
    assert sorted(os.listdir(tmp_path)) == ["meta_000002.json", "model_000002.pt", "optim_000002.pt"]
    monkeypatch.setattr(os, "replace", replace)
    ckpt.save_meta(str(tmp_path), 4, {"model_config": {}, "checksums": ckpt.save_stage_files(
        str(tmp_path), 4, {"w": torch.ones(4)}, {"adamw_step": 2, "params": {}})})
    remove = os.remove

    def remove_json_only(path):
        if not path.endswith(".json"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        remove(path)
    monkeypatch.setattr(os, "remove", remove_json_only)
    with pytest.raises(PermissionError):
        ckpt.prune_checkpoints(str(tmp_path), keep_last=1)
    assert ckpt.saved_steps(str(tmp_path)) == [4]


def test_a_write_is_synced_file_and_folder(tmp_path, monkeypatch):
    """atomic_write syncs the file before the rename and the folder after it (without either, a power loss can leave
    an empty file under the final name, or the old one)."""
    from nanochat.common import atomic_write
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.exists(tmp_path / "f")) or fsync(fd))
    atomic_write(str(tmp_path / "f"), b"x")
    assert synced == [False, True] and (tmp_path / "f").read_bytes() == b"x"


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(tmp_path):
    """Missing tensors, or tensors of another shape, are named (not a KeyError, not a copy that broadcasts)."""
    from nanochat.gpt import GPTConfig, build_model
    model = build_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint lacks 1 tensors the model needs, e.g. \['wte.weight'\]"):
        ckpt.load_model_state(model, {k: v for k, v in state.items() if k != "wte.weight"})
    name = next(k for k, v in state.items() if v.ndim == 2 and v.shape[0] == 32)
    with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(name)}: checkpoint shape \(1, 32\) does not fit"):
        ckpt.load_model_state(model, dict(state, **{name: state[name][:1]}))  # (1, 32) would broadcast into (32, 32)


def test_the_latest_tag_is_the_newest(tmp_path):
    for i, tag in enumerate(("old", "new", "older")):
        (tmp_path / "base_checkpoints" / tag).mkdir(parents=True)
        (tmp_path / "base_checkpoints" / tag / "meta_000001.json").write_text("{}")  # a saved step
        os.utime(tmp_path / "base_checkpoints" / tag, (1000 + 10 * i * (tag != "older"),) * 2)
    assert ckpt.latest_model_tag(str(tmp_path)) == "new"


def test_a_damaged_model_config_is_one_line():
    """A meta's model config without a shape key, or with keys of another version, is named (it built a default-sized
    model, or traced from the dataclass); an old checkpoint's l3_tied still loads."""
    from nanochat.gpt import GPTConfig
    from nanochat.common import ConfigError
    saved = GPTConfig().to_dict()
    assert GPTConfig.from_dict({**saved, "l3_tied": True}) == GPTConfig()
    with pytest.raises(ConfigError, match="lacks sequence_len, vocab_size: the checkpoint's meta is damaged"):
        GPTConfig.from_dict({k: v for k, v in saved.items() if k not in ("sequence_len", "vocab_size")})
    with pytest.raises(ConfigError, match=r"does not know \(n_experts\)"):
        GPTConfig.from_dict({**saved, "n_experts": 4})


def test_lines_of_a_run_log_that_are_not_records_are_skipped(tmp_path):
    from nanochat.run_log import read_records
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind": "header"}\n{"step": 0, "loss": 1.0}\n{}\n[1]\n{"step": "x", "loss": 1}\n\xff\xfe\n'
                     b'{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_records(str(path)) == [{"kind": "header"}, {"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_refused_pickle_says_why_not_weights_only_false(tmp_path):
    save_step(tmp_path, 3, {"w": torch.ones(4)})
    with open(tmp_path / "model_000003.pt", "wb") as f:
        pickle.dump({"w": Payload()}, f, protocol=2)
    with pytest.raises(ckpt.CheckpointError, match="holds objects other than tensors") as e:
        ckpt.load_checkpoint(str(tmp_path), 3)
    assert "weights_only" not in str(e.value)


def test_nonfinite_weights_are_refused_at_load(tmp_path):
    save_step(tmp_path, 4, {"w": torch.ones(4)})
    save_step(tmp_path, 5, {"w": torch.tensor([1.0, float("nan")])})
    assert ckpt.nonfinite_tensors({"w": torch.tensor([1.0, float("inf")]), "ok": torch.ones(2), "i": torch.ones(2, dtype=torch.int64)}) == ["w"]
    with pytest.raises(ckpt.CheckpointError, match=r"step 5 .* not finite \(w\): the run had diverged; step 4 is intact "
                                                   r"there \(resume with --resume-from-step 4\)"):
        ckpt.load_checkpoint(str(tmp_path))


def test_stale_tmp_files_go_when_a_run_takes_the_folder(tmp_path):
    """The temporary files of saves killed earlier, whatever their process or node, go when the next run takes the
    folder (the lock excludes any other run, and this one has written nothing yet); a move aside never collides."""
    for name in (f"model_000001.pt.tmp.{2 ** 22 + 12345}", "model_000001_stage1.pt.tmp.77", "metrics.jsonl.tmp.9"):
        (tmp_path / name).write_bytes(b"half a checkpoint")
    (tmp_path / "notes.tmp.txt").write_text("the user's")  # not ours: stays
    lock = ckpt.lock_run(types.SimpleNamespace(rank=0), None, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.tmp.txt", "run.lock"]
    os.remove(tmp_path / "notes.tmp.txt")
    run_lock.release_lock(lock)
    (tmp_path / "a").write_text("a"), (tmp_path / "b").write_text("b")
    first, second = ckpt.move_aside(str(tmp_path), ["a"]), ckpt.move_aside(str(tmp_path), ["b"])
    assert first != second and os.listdir(first) == ["a"] and os.listdir(second) == ["b"]


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save_step(tmp_path, step, {"w": torch.ones(4)})
    ckpt.prune_checkpoints(str(tmp_path), 2)
    assert ckpt.saved_steps(str(tmp_path)) == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["meta_000003.json", "meta_000004.json", "model_000003.pt", "model_000004.pt",
                                            "optim_000003.pt", "optim_000004.pt"]
    for step in (100000, 1000000, 1050000):  # step 100000's files by name are a prefix of step 1000000's
        save_step(tmp_path, step, {"w": torch.ones(4)})
    ckpt.prune_checkpoints(str(tmp_path), 2)
    assert ckpt.saved_steps(str(tmp_path)) == [1000000, 1050000]
    ckpt.load_checkpoint(str(tmp_path), 1000000)


def small_tokenizer(specials=("<|bos|>", "<|user_start|>")):
    return Tokenizer({bytes([i]): i for i in range(256)}, r"\w+|\s+", {name: 256 + i for i, name in enumerate(specials)})


def test_tokenizer_hash_identifies_it_and_a_mismatch_names_both(tmp_path):
    a, b = small_tokenizer(), small_tokenizer(("<|user_start|>", "<|bos|>"))  # same vocab size, other ids
    assert a.hash == small_tokenizer().hash and a.hash != b.hash and len(a.hash) == 16
    a.save(str(tmp_path / "tok"))
    assert Tokenizer.load(str(tmp_path / "tok")).hash == a.hash
    b.directory = "/somewhere/tokenizer"
    meta = {"step": 7, "tokenizer_hash": a.hash}
    with pytest.raises(ckpt.CheckpointError, match=rf"trained with tokenizer {a.hash}, but the tokenizer in "
                                                   rf"/somewhere/tokenizer is {b.hash}"):
        ckpt.check_tokenizer(meta, b, "/ckpt")
    ckpt.check_tokenizer(meta, a, "/ckpt")
    ckpt.check_tokenizer({"step": 7}, b, "/ckpt")  # a checkpoint from before the hash: accepted


def test_damaged_tokenizer_is_named(tmp_path):
    """A tokenizer file changed since it was saved is refused by its checksum: cut at a line end (it would load with
    part of its merges) or damaged; a tokenizer from before checksums is parsed and named where it breaks."""
    d = tmp_path / "tok"
    small_tokenizer().save(str(d))
    path = d / "tokenizer.tiktoken"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:len(lines) // 2]) + "\n")
    with pytest.raises(TokenizerError, match=r"tokenizer.tiktoken no longer matches the checksum saved with it .*tok_train"):
        Tokenizer.load(str(d))
    path.write_text("\n".join(lines[:10] + ["@@notbase64 10"] + lines[11:]) + "\n")
    meta = json.loads((d / "tokenizer.json").read_text())
    del meta["checksums"]
    (d / "tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(TokenizerError, match=r"tokenizer.tiktoken is damaged at line 11 .*tok_train"):
        Tokenizer.load(str(d))
    small_tokenizer().save(str(d))
    (d / "tokenizer.json").write_text('{"pattern": ')
    with pytest.raises(TokenizerError, match=r"is damaged \(JSONDecodeError"):
        Tokenizer.load(str(d))


def test_cpu_memory_estimate_grows_with_the_micro_batch():
    from nanochat.memory import estimate_memory
    small = estimate_memory(37_000_000, 4, 256, 32768, 4 * 512)
    assert 0.8 * 2**30 < small - 2**30 < 2.0 * 2**30  # measured: ~1.25 GiB peak for this one (d4, 2048 tokens)
    big = estimate_memory(37_000_000, 4, 256, 32768, 32 * 2048)  # the old CPU defaults: tens of GiB
    assert big > 30 * 2**30
    assert 0.6 * 2**30 < estimate_memory(37_000_000, 4, 256, 32768, 4 * 512, training=False) - 2**30 < 1.2 * 2**30  # ~0.83


def test_progress_speaks_only_for_long_loops(capsys):
    from nanochat.common import Progress
    p = Progress("val bpb", 100, every=0.0)
    p.update(50)
    assert "val bpb: 50/100 batches" in capsys.readouterr().out
    quiet = Progress("val bpb", 100)  # every 10 s: a short loop prints nothing
    quiet.update(50)
    assert capsys.readouterr().out == ""


def test_a_model_flag_given_at_its_default_is_compared_on_resume():
    """--depth 20 is the default, but given it names another model than a depth-2 checkpoint's: refused, not taken."""
    from nanochat.common import ConfigError
    from nanochat.recipe import parse_args, check_loop_flags
    saved = parse_args(["--depth", "2"])
    meta = {"user_config": vars(saved), "model_config": {"n_layer": 2, "window_pattern": "SSSL"}}
    left_out = parse_args(["--resume-from-step", "2"])
    check_loop_flags(left_out, meta)
    assert left_out.depth == 2  # left out: the checkpoint's
    with pytest.raises(ConfigError, match=r"--depth 20 \(the checkpoint's: 2\)"):
        check_loop_flags(parse_args(["--depth", "20", "--resume-from-step", "2"]), meta)


@pytest.mark.parametrize("flags, message", [
    (["--resume-from-step", "-2"], "--resume-from-step: a step >= 0"),
    (["--num-iterations", "0"], "--num-iterations: positive"),
    (["--target-param-data-ratio", "0"], "--target-param-data-ratio: positive"),
    (["--target-param-data-ratio", "nan"], "--target-param-data-ratio: positive, finite"),  # was a traceback
    (["--target-flops", "0"], "--target-flops: positive, finite, or -1"),  # was the ratio's horizon, silently
    (["--matrix-lr", "-0.02"], "--matrix-lr: 0 or more, finite"),
    (["--l3-table-lr", "nan"], "--l3-table-lr: 0 or more, finite"),
    (["--warmdown-ratio", "1.5", "--target-param-data-ratio", "0"], "ratio: positive, finite; --warmdown-ratio and --final"),
    (["--seed", "99999999999999999999"], r"^base_train: error: --seed: a 64-bit integer; see --help\n"),  # torch's, traced
    (["--dist-timeout", "0"], r"^base_train: error: --dist-timeout: seconds, positive \(below 1e9\); see --help\n"),
    (["--device-type", "foo"], r"argument --device-type: invalid choice: 'foo'"),  # torch.device's error, traced
    (["--depth", "x"], r"^base_train: error: argument --depth: invalid int value: 'x'; see --help\n"),  # not the usage
])
def test_flags_out_of_range_end_in_one_line(flags, message, capsys):
    from nanochat.recipe import parse_args
    with pytest.raises(SystemExit):
        parse_args(flags)
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err


def test_model_tags_are_folder_names_and_the_default_tag_holds_a_checkpoint(tmp_path):
    """A tag with a path in it would write outside base_checkpoints/; the scripts' default tag is the newest folder
    that holds a checkpoint (a run that saved none leaves only its metrics)."""
    import time
    from nanochat import checkpoint_manager as ckpt
    for tag in ("../escape", "a/b", ".", ".."):
        with pytest.raises(ckpt.CheckpointError, match="give a folder name"):
            ckpt.checkpoint_dir(tag, str(tmp_path))
    saved = ckpt.checkpoint_dir("saved", str(tmp_path))
    sums = ckpt.save_stage_files(saved, 1, {"w": torch.ones(2)}, {"adamw_step": 0, "params": {}})
    ckpt.save_meta(saved, 1, {"model_config": {}, "checksums": sums})
    time.sleep(0.01)
    os.makedirs(ckpt.checkpoint_dir("metrics_only", str(tmp_path)))
    assert ckpt.latest_model_tag(str(tmp_path)) == "saved"


def test_parallel_degrees_and_an_odd_context():
    """--ep below 1 is refused like the other degrees; an odd --max-seq-len is fine without context parallelism."""
    from nanochat.common import ConfigError
    from nanochat.recipe import Setting, config_for_depth
    config = config_for_depth(2, 32, 32, vocab_size=64, sequence_len=63)
    with pytest.raises(ConfigError, match="--ep 0: each >= 1"):
        Setting(device_batch=1, total_batch=63, ep=0).check(config)
    assert Setting(device_batch=1, total_batch=63).check(config) == 1


def test_start_over_and_resume_together_are_refused():
    from nanochat.common import ConfigError
    from nanochat.recipe import parse_args, check_loop_flags
    with pytest.raises(ConfigError, match=r"--start-over starts a fresh run: it cannot go with --resume-from-step"):
        check_loop_flags(parse_args(["--start-over", "--resume-from-step", "2"]), {"model_config": {}})


@pytest.mark.parametrize("flags, message", [
    (dict(tp=2, fp8=True), r"--fp8 with --tp 2: a rank's query heads' width 72, key/value heads' width 72 must be"),
    (dict(pp_virtual=2), r"--pp-schedule and --pp-virtual need --pp > 1"),
    (dict(pp_schedule="interleaved"), r"need --pp > 1"),
    (dict(cp_exchange="ring"), r"--cp-exchange ring is how --cp ranks share K/V: it needs --cp > 1"),
])
def test_layouts_that_cannot_run_are_refused_before_they_start(flags, message):
    from nanochat.common import ConfigError
    from nanochat.recipe import Setting, config_for_depth
    config = config_for_depth(2, aspect_ratio=72, head_dim=72, vocab_size=256, sequence_len=64)  # 2 heads of 72
    with pytest.raises(ConfigError, match=message):
        Setting(device_batch=1, total_batch=64, **flags).check(config)
    from nanochat.pipeline_schedules import stage_actions  # the schedule itself, for the tools that price it
    with pytest.raises(ValueError, match="m=6 is no multiple"):
        stage_actions("interleaved", 4, 6, 0, virtual=2)
