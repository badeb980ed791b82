"""
Between nanochat checkpoints and Hugging Face folders (scripts/export_hf.py, import_hf.py). An export holds
config.json with configuration_nanochat.py and modeling_nanochat.py (trust_remote_code), model.safetensors (sharded
above MAX_SHARD_SIZE, nanochat's tensor names), generation_config.json, tokenizer.json, tokenizer_config.json,
README.md (model card), nanochat_meta.json (the checkpoint's meta: an import resumes there) and checksums.json (written
last: an import refuses a file damaged since). The tokenizer's merges, every split of every token into two tokens by
the token's rank, merge as tiktoken's ranks do; ignore_merges keeps a pre-token that is a token whole, as tiktoken does.
"""

import os
import json
import errno
import math
import shutil
from pathlib import Path

import torch

from nanochat.common import UserError, file_checksum, read_json
from nanochat.gpt import GPTConfig, GPT, window_sizes, ROTARY_BASE, SOFTCAP
from nanochat.tokenizer import Tokenizer, SPECIAL_TOKENS

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_FILES = ["configuration_nanochat.py", "modeling_nanochat.py"]
MAX_SHARD_SIZE = "4GB"
SHAPE_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")  # GPTConfig's = config.json's


class ConvertError(UserError):
    """An export folder or checkpoint that cannot be converted; the message says why."""


def bytes_to_unicode():
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # stand for chr(256), chr(257), ... in byte order
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def hf_tokenizer(tok: Tokenizer):
    """A tokenizers.Tokenizer that encodes as `tok` does (see the module docstring)."""
    from tokenizers import Tokenizer as HFTokenizer, AddedToken, Regex, models, pre_tokenizers, decoders, processors
    byte_char = bytes_to_unicode()
    as_str = lambda b: "".join(byte_char[x] for x in b)
    ranks = tok.mergeable_ranks
    vocab = {as_str(b): r for b, r in ranks.items()}
    splits = ((rank, token[:i], token[i:]) for token, rank in ranks.items() for i in range(1, len(token)))
    merges = sorted((rank, ranks[l], ranks[r], as_str(l), as_str(r)) for rank, l, r in splits
                    if l in ranks and r in ranks)
    hf = HFTokenizer(models.BPE(vocab, [(l, r) for *_, l, r in merges], ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ConvertError("the special tokens' ids must follow the merged tokens' ids")
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    bos = "<|bos|>"
    hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                      special_tokens=[(bos, tok.bos_token_id)])
    return hf


def tokenizer_from_hf(directory):
    """Our Tokenizer back from an export folder's tokenizer.json."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        raise ConvertError(f"no tokenizer.json in {directory}")
    try:
        spec = read_json(path)
        char_byte = {c: b for b, c in bytes_to_unicode().items()}
        ranks = {bytes(char_byte[c] for c in s): i for s, i in spec["model"]["vocab"].items()}
        specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
        split = [p for p in spec["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"]
        if not split or set(specials) != set(SPECIAL_TOKENS):
            raise ValueError("no Split pre-tokenizer, or other special tokens")
        return Tokenizer(ranks, split[0]["pattern"]["Regex"], specials)
    except (ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{path} is not a nanochat export's tokenizer, or is damaged ({type(e).__name__}: "
                           f"{str(e)[:200]})") from None


def verify_export(directory):
    """Every file checksums.json lists matches it, but the model card (edited on the Hub as a matter of course; an
    export from before checksums: nothing to check)."""
    for name, saved in read_json(os.path.join(directory, "checksums.json"), {}).items():
        if name != "README.md" and (not os.path.exists(file := os.path.join(directory, name)) or
                                    file_checksum(file) != saved):
            raise ConvertError(f"{file} is missing or no longer matches the checksum the export saved: download it "
                               f"again, or export the checkpoint again")


def check_state(state, config, source):
    with torch.device("meta"):  # the shapes of a checkpoint of this config, without memory
        want = {k: tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = [k for k in want if k in state and tuple(state[k].shape) != want[k]]
    if missing or extra or wrong:
        raise ConvertError(f"{source} does not match its config: missing {missing[:3]}, unexpected {extra[:3]}, "
                           f"wrong shapes {wrong[:3]}")


def model_card(meta, repo_id=None, core=None):
    """README.md: how to load the model and what its checkpoint recorded."""
    na = "not recorded"
    cfg = meta.get("model_config", {})
    bpb = meta.get("loop_state", {}).get("min_val_bpb")
    bpb = f"{bpb:.4f} (best during training)" if isinstance(bpb, (int, float)) and math.isfinite(bpb) else na
    tokens = f"{meta['tokens_seen']:,}" if meta.get("tokens_seen") else na
    core = core or na
    flags = meta.get("user_config")
    flag_lines = "\n".join(f"{k}: {v}" for k, v in sorted(flags.items())) if flags else na
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- nanochat
---

# {repo_id or f"nanochat {meta.get('model_tag', '')}".strip()}

A base (not chat-tuned) model trained with [nanochat](https://github.com/karpathy/nanochat); its modeling code
ships in this folder. The tokenizer prepends `<|bos|>`, and generation stops at the next one.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{repo_id or 'DIR'}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{repo_id or 'DIR'}")
ids = tokenizer("The capital of France is", return_tensors="pt")
print(tokenizer.decode(model.generate(**ids, max_new_tokens=32, do_sample=False)[0]))
```

| | |
|---|---|
| step | {meta.get('step', na)} |
| tokens seen | {tokens} |
| val bpb | {bpb} |
| CORE | {core} |
| layers / width / heads (kv) | {cfg.get('n_layer', na)} / {cfg.get('n_embd', na)} / {cfg.get('n_head', na)} ({cfg.get('n_kv_head', na)}) |
| context / window pattern | {cfg.get('sequence_len', na)} / {cfg.get('window_pattern', na)} |
| vocabulary | {cfg.get('vocab_size', na)} |
| L3 layers after blocks | {list(cfg.get('l3_after_layers', [])) or 'none'} |

Training flags:

```
{flag_lines}
```
"""


def export(model_state, meta, tok: Tokenizer, out_dir, dtype=torch.float32, core=None, repo_id=None,
           max_shard_size=MAX_SHARD_SIZE):
    """Write an export folder from a checkpoint's full tensors and meta (core: the model card's CORE cell, as
    scripts/export_hf.py reads it from base_eval's CSV). Returns the weight files."""
    from transformers import GenerationConfig
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    from nanochat.hf.configuration_nanochat import NanochatConfig
    from nanochat.l3 import default_n_emb
    config = GPTConfig.from_dict(meta["model_config"])
    if config.moe_experts:
        raise ConvertError("this checkpoint has mixture-of-experts layers, which the Hugging Face model does not build "
                           "yet: sample and evaluate it with scripts.sample and scripts.base_eval")
    check_state(model_state, config, "the checkpoint")
    if tok.get_vocab_size() != config.vocab_size:
        raise ConvertError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {config.vocab_size}: "
                           f"export with the tokenizer it was trained with (NANOCHAT_BASE_DIR/tokenizer)")
    os.makedirs(out_dir, exist_ok=True)
    bos = tok.get_bos_token_id()
    l3 = dict(l3_after_layers=list(config.l3_after_layers), l3_d_up=config.l3_d_up or 4 * config.n_embd,
              l3_n_emb=config.l3_n_emb or default_n_emb(config.vocab_size, config.l3_k_max),
              l3_k_max=config.l3_k_max) if config.l3_after_layers else {}
    hf = NanochatConfig(**{k: getattr(config, k) for k in SHAPE_FIELDS}, **l3, window_sizes=window_sizes(config),
                        rotary_base=ROTARY_BASE, softcap=SOFTCAP, bos_token_id=bos, eos_token_id=bos)
    hf.architectures = ["NanochatForCausalLM"]
    hf.auto_map = {"AutoConfig": "configuration_nanochat.NanochatConfig",
                   "AutoModelForCausalLM": "modeling_nanochat.NanochatForCausalLM"}
    hf.dtype = str(dtype).removeprefix("torch.")
    hf.save_pretrained(out_dir)
    for name in MODEL_FILES:
        shutil.copyfile(os.path.join(HERE, name), os.path.join(out_dir, name))
    # no pad id in the model's configs: generate would take every <|bos|> (each prompt's first token) for padding
    # where it builds the attention mask itself; batches padded by the tokenizer carry their own mask
    GenerationConfig(bos_token_id=bos, eos_token_id=bos).save_pretrained(out_dir)
    hf_tokenizer(tok).save(os.path.join(out_dir, "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|bos|>",
                  "pad_token": "<|bos|>", "padding_side": "left", "add_bos_token": True, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False, "model_max_length": config.sequence_len}
    # safetensors, sharded above max_shard_size; floating tensors in `dtype`, integer ones (L3's allocation) as is
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in model_state.items()}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    texts = [("tokenizer_config.json", json.dumps(tok_config, indent=2)),
             ("nanochat_meta.json", json.dumps(meta, indent=2)), ("README.md", model_card(meta, repo_id, core))]
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                 "weight_map": split.tensor_to_filename}
        texts.append(("model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True)))
    for name, text in texts:
        Path(out_dir, name).write_text(text)
    for filename, names in split.filename_to_tensors.items():
        path = os.path.join(out_dir, filename)
        try:
            save_file({n: state[n] for n in names}, path, metadata={"format": "pt"})
        except SafetensorError as e:  # safetensors' own type over the OS's error (a full disk)
            raise OSError(errno.EIO, str(e).splitlines()[0], path) from e
        shutil.copymode(os.path.join(out_dir, "config.json"), path)  # safetensors writes 0600: readable as the rest
    checksums = {name: file_checksum(os.path.join(out_dir, name)) for name in sorted(os.listdir(out_dir))}
    Path(out_dir, "checksums.json").write_text(json.dumps(checksums, indent=2))
    return sorted(split.filename_to_tensors)


def load_export(directory):
    """(fp32 state in nanochat names, GPTConfig, meta) of an export folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        path = os.path.join(directory, "config.json")
        if not os.path.exists(path):
            raise ConvertError(f"no config.json in {directory}: pass a folder written by scripts.export_hf")
        verify_export(directory)
        cfg = read_json(path)
        if cfg.get("model_type") != "nanochat":
            raise ConvertError(f"{path} has model_type {cfg.get('model_type')!r}; only nanochat exports import")
        meta = read_json(os.path.join(directory, "nanochat_meta.json"), {})
        # the GPTConfig: the original window pattern (nanochat_meta.json) when it agrees, else spelled out per layer
        fields = {k: cfg[k] for k in SHAPE_FIELDS}
        if cfg.get("l3_after_layers"):
            fields.update(l3_after_layers=tuple(cfg["l3_after_layers"]), l3_n_emb=cfg["l3_n_emb"],
                          l3_d_up=cfg["l3_d_up"], l3_k_max=cfg["l3_k_max"])
        seq, sizes = cfg["sequence_len"], list(cfg["window_sizes"])
        spelled = "".join("S" if w < seq else "L" for w in sizes)
        config = GPTConfig(**fields, window_pattern=meta.get("model_config", {}).get("window_pattern") or spelled)
        if window_sizes(config) != sizes:
            config = GPTConfig(**fields, window_pattern=spelled)
        if window_sizes(config) != sizes:
            raise ConvertError(f"window_sizes {cfg['window_sizes']} in config.json are not a nanochat window pattern "
                               f"(S = {window_sizes(GPTConfig(**fields, window_pattern='S'))[0]} tokens, L = {seq})")
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            files = sorted(set(read_json(index)["weight_map"].values()))
        elif os.path.exists(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ConvertError(f"no model.safetensors (or model.safetensors.index.json) in {directory}")
        state = {k: (v.float() if v.is_floating_point() else v)
                 for name in files for k, v in load_file(os.path.join(directory, name)).items()}
        check_state(state, config, directory)
        return state, config, meta
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:  # damaged, no checksum
        raise ConvertError(f"{directory} holds a damaged or foreign export ({type(e).__name__}: {str(e)[:200]})") from None
