"""
Turn a scripts.export_hf folder back into a nanochat checkpoint (fp32) for base_eval, sample and base_train
--resume-from-step: the exported meta (step, loop and data position carry over) with weights_only: true ("start the
optimizer fresh"). The tokenizer goes to NANOCHAT_BASE_DIR/tokenizer if none is there; another one there is an error.

    python -m scripts.import_hf --dir hf/d20 --model-tag d20-hf
    python -m scripts.base_train --model-tag d20-hf --resume-from-step 5000 [the original run's flags]
"""

import os
import argparse

from nanochat.common import HelpWithDefaults, UserError, fail
from nanochat import checkpoint_manager as ckpt
from nanochat.tokenizer import default_tokenizer_dir, get_tokenizer
from nanochat.hf.convert import load_export, tokenizer_from_hf, ConvertError

parser = argparse.ArgumentParser(description="Import a Hugging Face export folder as a nanochat checkpoint",
                                 formatter_class=HelpWithDefaults)
parser.add_argument("--dir", type=str, required=True, help="the folder scripts.export_hf wrote")
parser.add_argument("--model-tag", type=str, required=True, help="checkpoint folder to write")
parser.add_argument("--step", type=int, default=None, help="step to save it as (default: the exported step, else 0)")
args = parser.parse_args()

if args.step is not None and args.step < 0:
    fail(f"--step {args.step}: a checkpoint's step is 0 or more")
try:
    state, config, meta = load_export(args.dir)
    tokenizer = tokenizer_from_hf(args.dir)
except ConvertError as e:
    fail(str(e))
if meta.get("tokenizer_hash") not in (None, tokenizer.hash):  # the export's files disagree with its weights' run
    fail(f"{args.dir}'s tokenizer is {tokenizer.hash}, but its model was trained with {meta['tokenizer_hash']}: export "
         f"the checkpoint again with the tokenizer it was trained with")
step = args.step if args.step is not None else meta.get("step", 0)
try:
    ckpt_dir = ckpt.checkpoint_dir(args.model_tag)  # a tag that is no folder name, a base dir that cannot be made
except UserError as e:
    fail(str(e))
if os.path.exists(os.path.join(ckpt_dir, f"meta_{step:06d}.json")):
    fail(f"{ckpt_dir} already has a checkpoint for step {step}: choose another --model-tag or --step")

tok_dir = default_tokenizer_dir()
try:
    if os.path.exists(os.path.join(tok_dir, "tokenizer.tiktoken")):
        if get_tokenizer(tok_dir).hash != tokenizer.hash:  # merges, pattern and special tokens
            fail(f"{tok_dir} holds another tokenizer than {args.dir}'s: set NANOCHAT_BASE_DIR to another folder "
                 f"(or move that tokenizer away) so that evaluation uses the model's own")
    else:
        tokenizer.save(tok_dir)
        print(f"wrote the export's tokenizer to {tok_dir}")
except UserError as e:  # a damaged tokenizer there
    fail(str(e))
except OSError as e:
    fail(f"cannot write the export's tokenizer to {tok_dir} ({e.strerror}): set NANOCHAT_BASE_DIR to a folder you "
         f"can write")

meta = dict(meta, model_config=config.to_dict(), weights_only=True, imported_from=os.path.abspath(args.dir))
meta.pop("model_tag", None)
if step != meta.get("step", 0) or "loop_state" not in meta:  # the export's loop and data position are its step's
    meta["loop_state"] = {"step": step, "smooth_loss": 0.0, "total_time": 0.0, "min_val_bpb": float("inf")}
    meta["dataloader_states"] = []
    meta.pop("tokens_seen", None)
meta.setdefault("dataloader_states", [])  # none: a resumed run reads the data from the start
try:
    meta["checksums"] = ckpt.save_stage_files(ckpt_dir, step, state, None)
    ckpt.save_meta(ckpt_dir, step, meta)
except UserError as e:  # a full disk, a folder that cannot be written
    fail(str(e))
print(f"imported {args.dir} as {ckpt_dir} step {step} ({sum(v.numel() for v in state.values()):,} values; "
      f"weights only: --resume-from-step {step} starts a fresh optimizer)")
