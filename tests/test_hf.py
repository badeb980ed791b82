"""Hugging Face interop (nanochat/hf/, scripts/export_hf.py, scripts/import_hf.py): the exported model gives our
logits (fp32) and greedy samples, its tokenizer our ids; export -> import -> export keeps the weights' bytes; an
imported checkpoint samples, evaluates and resumes (fresh optimizer); TP=2 and PP=2 checkpoints export as TP=1."""

import os
import re
import json
import math

import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from conftest import run_script, ckpt_dir, TINY_MODEL
from parallel_harness import run_layout
from nanochat.gpt import GPTConfig, build_model
from nanochat.engine import generate
from nanochat.dataset import SAMPLE_DIR
from nanochat.hf import convert

ATOL = 1e-5
# 3 layers, GQA, windows S = 128 and L = 256 tokens; vocab = the test tokenizer's
CONFIG = dict(sequence_len=256, vocab_size=1024, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")


def random_weights(model, seed=0):
    """Every weight doing something (the real init zeroes output projections, gates and lambdas, which would
    hide a wrong smear, backout or value-embedding gate)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and not name.endswith(("wte.weight", "value_embed.weight", "_table")):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.size(1)))
            elif p.ndim == 0:
                p.copy_(0.2 + 0.6 * torch.rand((), generator=g))
    model.eval()
    return model


def export_and_load(model, tokenizer, out_dir):
    from transformers import AutoModelForCausalLM
    meta = {"model_config": model.config.to_dict(), "step": 1}
    convert.export(model.state_dict(), meta, tokenizer, str(out_dir))
    return AutoModelForCausalLM.from_pretrained(str(out_dir), trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def tiny(base_dir, tmp_path_factory):
    """(our model, the transformers model loaded from its export, our tokenizer, the export folder)."""
    from nanochat.tokenizer import get_tokenizer
    from transformers import AutoTokenizer
    tokenizer = get_tokenizer(os.path.join(base_dir, "tokenizer"))
    assert tokenizer.get_vocab_size() == CONFIG["vocab_size"]
    torch.manual_seed(0)
    model = random_weights(build_model(GPTConfig(**CONFIG), "cpu"))
    out = tmp_path_factory.mktemp("hf_tiny")
    hf = export_and_load(model, tokenizer, out)
    return model, hf, tokenizer, AutoTokenizer.from_pretrained(str(out)), out


def test_export_folder(tiny):
    *_, out = tiny
    for name in ["config.json", "generation_config.json", "model.safetensors", "modeling_nanochat.py",
                 "configuration_nanochat.py", "tokenizer.json", "tokenizer_config.json", "README.md"]:
        assert os.path.exists(os.path.join(out, name)), name
    for name in ["modeling_nanochat.py", "configuration_nanochat.py"]:  # standalone: transformers + torch only
        with open(os.path.join(out, name)) as f:
            assert "nanochat." not in f.read().replace("nanochat.py", "")
    # the weights are readable by whoever may read the rest (safetensors creates its files 0600)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert modes["model.safetensors"] == modes["config.json"], modes


@pytest.mark.parametrize("T", [1, 37, 128, 200, 256])  # inside and beyond the 128-token window
def test_logits_equal_ours(tiny, T):
    model, hf, *_ = tiny
    ids = torch.randint(0, CONFIG["vocab_size"], (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= ATOL, diff


def test_padding_left_and_right(tiny):
    """A padded batch gives each row's own logits at its real positions."""
    model, hf, *_ = tiny
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g) for n in (150, 90)]
    with torch.no_grad():
        alone = [model(r[None])[0] for r in rows]
        for side in ("left", "right"):
            ids = torch.zeros(2, 150, dtype=torch.long)
            mask = torch.zeros(2, 150, dtype=torch.long)
            for i, r in enumerate(rows):
                sl = slice(150 - len(r), 150) if side == "left" else slice(0, len(r))
                ids[i, sl], mask[i, sl] = r, 1
            logits = hf(ids, attention_mask=mask).logits
            for i, r in enumerate(rows):
                sl = slice(150 - len(r), 150) if side == "left" else slice(0, len(r))
                assert (logits[i, sl] - alone[i]).abs().max().item() <= ATOL, side


def test_greedy_generate_equals_engine(tiny):
    model, hf, tokenizer, *_ = tiny
    bos = tokenizer.get_bos_token_id()
    text = open(os.path.join(SAMPLE_DIR, "README.md")).read()
    prompts = [tokenizer.encode("The capital of France is", prepend=bos),
               tokenizer.encode(text, prepend=bos)[:120]]  # decoding crosses the 128-token window
    for prompt in prompts:
        ours = generate(model, prompt, 32, temperature=0.0, stop_tokens=(bos,))[0]
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert theirs == ours
    with pytest.raises(ValueError, match="nanochat decodes with transformers' DynamicCache, not StaticCache"):
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, cache_implementation="static")
    with pytest.raises(ValueError, match="input_ids is empty"):
        hf.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    # another stop token (or none) and no attention mask: the prompt's <|bos|> is a token, not padding
    ours = generate(model, prompts[0], 16, temperature=0.0)[0]
    for eos in (None, 10):
        theirs = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False, eos_token_id=eos)
        assert theirs[0, len(prompts[0]):].tolist()[:len(ours)] == ours[:theirs.size(1) - len(prompts[0])], eos


def test_batched_generate_with_the_shipped_tokenizer(tiny):
    """Prompts of several lengths padded by the exported tokenizer (to the left, as it says) decode as each alone."""
    model, hf, tokenizer, hf_tok, _ = tiny
    texts = ["The capital of France is", "A", "Once upon a time, in a land far away, there"]
    batch = hf_tok(texts, return_tensors="pt", padding=True)
    out = hf.generate(**batch, max_new_tokens=8, do_sample=False, eos_token_id=None)[:, batch["input_ids"].size(1):]
    for text, row in zip(texts, out.tolist()):
        assert row == generate(model, tokenizer.encode(text, prepend=tokenizer.get_bos_token_id()), 8, temperature=0.0)[0]


def test_even_depth_logits_equal_ours(tiny, tmp_path):
    """At an even depth the backout's middle block and the value embeddings' layers are told apart (at 3 they are
    the same blocks under either parity)."""
    torch.manual_seed(0)
    model = random_weights(build_model(GPTConfig(**dict(CONFIG, n_layer=4, window_pattern="SSSL")), "cpu"))
    hf = export_and_load(model, tiny[2], tmp_path)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= ATOL


def test_import_checks_the_files_but_the_model_card(tiny, tmp_path):
    import shutil
    folder = tmp_path / "export"
    shutil.copytree(tiny[4], folder)
    with open(folder / "README.md", "a") as f:
        f.write("\nEdited on the Hub.\n")
    convert.load_export(str(folder))  # a model card edited after the export still imports
    with open(folder / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(convert.ConvertError, match=r"config.json is missing or no longer matches the checksum"):
        convert.load_export(str(folder))


def tokenizer_cases():
    docs = pq.read_table(os.path.join(SAMPLE_DIR, "sample_00000.parquet"), columns=["text"]).column("text").to_pylist()
    return docs[:200] + [
        "emoji 😀👍🏽🧑‍🚀 and flags 🇫🇷", "日本語のテキストと中文文本，한국어", "tabs\t\tand   spaces    \n\n\n  end  ",
        "   ", "\n", "", "<|bos|>", "text <|bos|> typed<|user_start|> as text", "numbers 1234567 3.14159 -42",
        "don't WON'T it's I'll we've they're", "mixed  \r\n line\r\nendings", "\u00e9\u0301 combining é",
    ]


def test_tokenizer_equals_ours(tiny):
    _, _, tokenizer, hf_tok, _ = tiny
    bos = tokenizer.get_bos_token_id()
    cases = tokenizer_cases()
    agree = sum(hf_tok(s)["input_ids"] == tokenizer.encode(s, prepend=bos) for s in cases)
    assert agree == len(cases)
    plain = sum(hf_tok(s, add_special_tokens=False)["input_ids"] == tokenizer.encode(s) for s in cases)
    assert plain == len(cases)
    assert hf_tok.bos_token_id == bos and hf_tok.decode(tokenizer.encode(cases[0])) == cases[0]
    # and back: import rebuilds the same tokenizer from tokenizer.json
    back = convert.tokenizer_from_hf(tiny[4])
    assert (back.mergeable_ranks, back.special_tokens, back.pattern) == \
        (tokenizer.mergeable_ranks, tokenizer.special_tokens, tokenizer.pattern)


def test_l3_model_exports(tiny, tmp_path):
    """L3 tables and a non-uniform allocation export and give our logits."""
    tokenizer = tiny[2]
    torch.manual_seed(0)
    config = GPTConfig(**CONFIG, l3_after_layers=(1,), l3_n_emb=4096, l3_k_max=16)
    model = random_weights(build_model(config, "cpu"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        layer = model.l3["1"]
        layer.key_table.copy_(torch.randn(layer.key_table.shape, generator=g))
        rows = torch.full((CONFIG["vocab_size"],), 4, dtype=torch.int64)  # 4096 rows: 6 for even ids, 2 for odd
        rows[0::2] += 2
        rows[1::2] -= 2
        layer.set_allocation(rows, 4.0)
    hf = export_and_load(model, tokenizer, tmp_path)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 200), generator=g)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= ATOL, diff


def test_sharded_and_bf16_exports_load(tiny, tmp_path):
    """Above the shard size the weights split into shards with an index; --dtype bfloat16 halves them."""
    from transformers import AutoModelForCausalLM
    model, _, tokenizer, *_ = tiny
    meta = {"model_config": model.config.to_dict(), "step": 1}
    files = convert.export(model.state_dict(), meta, tokenizer, str(tmp_path / "sharded"), max_shard_size="200KB")
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), trust_remote_code=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
        assert (hf(ids).logits - ref).abs().max().item() <= ATOL
        state, _, _ = convert.load_export(str(tmp_path / "sharded"))
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        convert.export(model.state_dict(), meta, tokenizer, str(tmp_path / "bf16"), dtype=torch.bfloat16)
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), trust_remote_code=True)
        assert hf.dtype == torch.bfloat16
        assert (hf(ids).logits - ref).abs().max().item() < 0.5  # bf16 rounding of weights and activations


def safetensors_bytes(directory):
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        return f.read()


def test_round_trip_sample_eval_resume(env, tmp_path):
    """base_train -> export -> import -> export: same weight bytes; the import samples, evaluates, resumes."""
    train = ["--device-batch-size", "4", "--total-batch-size", "512", "--warmup-steps", "1", "--eval-every", "2",
             "--eval-tokens", "1024"] + TINY_MODEL
    train += ["--num-iterations", "4", "--save-every", "2"]
    run_script("scripts.base_train", train + ["--model-tag", "hf_src"], env)
    first, second = tmp_path / "first", tmp_path / "second"
    run_script("scripts.export_hf", ["--model-tag", "hf_src", "--step", "2", "--out", str(first)], env)
    p = run_script("scripts.import_hf", ["--dir", str(first), "--model-tag", "hf_back"], env)
    assert "weights only" in p.stdout
    scores = os.path.join(env["NANOCHAT_BASE_DIR"], "base_eval", "hf_back_000002.csv")  # as base_eval writes it
    os.makedirs(os.path.dirname(scores), exist_ok=True)
    with open(scores, "w") as f:
        f.write('task,accuracy,centered,note\ncapitals,0.5,0.25,\nCORE,,0.250000,"3 of 4 tasks, 8 items a task"\n')
    run_script("scripts.export_hf", ["--model-tag", "hf_back", "--out", str(second)], env)
    assert "| CORE | 0.2500 (scripts.base_eval: 3 of 4 tasks, 8 items a task) |" in (second / "README.md").read_text()
    assert safetensors_bytes(first) == safetensors_bytes(second)
    card = (first / "README.md").read_text()
    assert "| tokens seen | 1,024 |" in card and "| CORE | not recorded |" in card
    assert re.search(r"^\| val bpb \| \d+\.\d{4} \(best during training\) \|$", card, re.M)
    assert "num_iterations: 4" in card

    p = run_script("scripts.sample", ["--model-tag", "hf_back", "--prompt", "The", "--temperature", "0",
                                      "--max-tokens", "4"], env)
    assert "sampling from hf_back step 2" in p.stdout
    p = run_script("scripts.base_eval", ["--model-tag", "hf_back", "--skip-core", "--eval-tokens", "256",
                                         "--device-batch-size", "2"], env)
    assert "val bpb:" in p.stdout
    p = run_script("scripts.base_train", train + ["--model-tag", "hf_back", "--resume-from-step", "2"], env)
    assert "the optimizer starts fresh" in p.stdout and "step 00002/00004" in p.stdout

    # a checkpoint trained with another tokenizer than the base dir's is not exported with it; a negative step
    meta_path = os.path.join(ckpt_dir(env, "hf_src"), "meta_000004.json")
    meta = json.load(open(meta_path))
    json.dump(dict(meta, tokenizer_hash="0123456789abcdef"), open(meta_path, "w"))
    p = run_script("scripts.export_hf", ["--model-tag", "hf_src", "--out", str(tmp_path / "wrong")], env, check=False)
    assert p.returncode == 1 and "was trained with tokenizer 0123456789abcdef" in p.stdout, p.stdout[-500:]
    assert not (tmp_path / "wrong").exists()
    # at another step than the export's, its loop and data position stay behind (they belong to its step)
    run_script("scripts.import_hf", ["--dir", str(first), "--model-tag", "hf_three", "--step", "3"], env)
    three = json.load(open(os.path.join(ckpt_dir(env, "hf_three"), "meta_000003.json")))
    assert three["loop_state"] == {"step": 3, "smooth_loss": 0.0, "total_time": 0.0, "min_val_bpb": float("inf")}
    assert three["dataloader_states"] == [] and "tokens_seen" not in three
    p = run_script("scripts.import_hf", ["--dir", str(first), "--model-tag", "neg", "--step", "-1"], env, check=False)
    assert p.returncode != 0 and "--step -1: a checkpoint's step is 0 or more" in p.stdout + p.stderr


def test_push_to_hub_offline_fails_first(env, tmp_path):
    e = dict(env, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    e.pop("HF_TOKEN", None)
    out = tmp_path / "never"
    p = run_script("scripts.export_hf", ["--model-tag", "no_such_tag", "--out", str(out), "--push-to-hub", "me/x"], e,
                   check=False)
    assert p.returncode == 1 and "cannot reach the Hugging Face Hub" in p.stdout and "Traceback" not in p.stderr
    assert not out.exists()


def test_parallel_checkpoints_export_as_one_process(tiny, tmp_path):
    """TP=2 and PP=2 checkpoints (PP: one file per stage) export the same tensors as the TP=1 one."""
    from safetensors.torch import load_file
    tokenizer = tiny[2]
    overrides = {"vocab_size": CONFIG["vocab_size"]}
    exports = {}
    for name, layout in {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}.items():
        run = run_layout(**layout, steps=4, config_overrides=overrides, out_dir=str(tmp_path / name))
        state, _, meta = convert_checkpoint(tmp_path / name / "ckpt", overrides)
        convert.export(state, meta, tokenizer, str(tmp_path / f"hf_{name}"))
        exports[name] = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
        assert run["losses"]
    ref = exports["tp1"]
    for name in ("tp2", "pp2"):
        assert exports[name].keys() == ref.keys()
        for k, v in ref.items():
            assert torch.allclose(exports[name][k], v, atol=1e-4), (name, k)
        assert (tmp_path / f"hf_{name}" / "config.json").read_text() == (tmp_path / "hf_tp1" / "config.json").read_text()


def convert_checkpoint(ckpt_dir, overrides):
    """The harness's mid-run checkpoint, with the model config base_train would have written into its meta."""
    from nanochat import checkpoint_manager as ckpt
    from parallel_harness import CONFIG as HARNESS
    state, _, meta = ckpt.load_checkpoint(str(ckpt_dir), load_optimizer=False)
    meta["model_config"] = GPTConfig(**{**HARNESS, **overrides}).to_dict()
    return state, None, meta
