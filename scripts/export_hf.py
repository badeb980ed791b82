"""
Export a checkpoint as a Hugging Face folder (see nanochat/hf/convert.py) for AutoModelForCausalLM (trust_remote_code):
fp32 master weights (also of fp8 runs) or --dtype bfloat16; --push-to-hub checks the Hub login (`hf auth login`) first.

    python -m scripts.export_hf --model-tag d20 --out hf/d20 [--step 5000] [--dtype bfloat16]
    python -m scripts.export_hf --model-tag d20 --out hf/d20 --push-to-hub you/nanochat-d20 [--private]
"""

import os
import csv
import time
import shutil
import argparse

import torch

from nanochat.common import HelpWithDefaults, UserError, get_base_dir, fail
from nanochat import checkpoint_manager as ckpt
from nanochat.tokenizer import get_tokenizer
from nanochat.hf.convert import export

parser = argparse.ArgumentParser(description="Export a checkpoint as a Hugging Face transformers folder",
                                 formatter_class=HelpWithDefaults)
parser.add_argument("--model-tag", type=str, default=None, help="checkpoint folder (default: the most recent one)")
parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
parser.add_argument("--out", type=str, required=True, help="the folder to write (new or empty)")
parser.add_argument("--dtype", type=str, default="float32", choices=["float32", "bfloat16"], help="weights' dtype")
parser.add_argument("--push-to-hub", type=str, default=None, metavar="REPO", help="then upload to this Hub repo (user/name)")
parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
args = parser.parse_args()

if args.push_to_hub:  # before any work: an export that then cannot be uploaded wastes the time it took
    from huggingface_hub import HfApi
    api = HfApi()
    try:
        user = api.whoami()["name"]
    except Exception as e:
        fail(f"--push-to-hub {args.push_to_hub}: cannot reach the Hugging Face Hub as a logged-in user "
             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no details'}). Check the network, "
             f"log in with `hf auth login` (or set HF_TOKEN), or export without --push-to-hub")
    print(f"Hub: logged in as {user}")
if os.path.exists(args.out) and not os.path.isdir(args.out):
    fail(f"--out {args.out} is a file: give a folder (new or empty)")
if os.path.isdir(args.out) and os.listdir(args.out):
    fail(f"--out {args.out} is not empty: remove it or choose another folder")

try:
    model_tag = args.model_tag or ckpt.latest_model_tag()
    t0 = time.time()
    model_state, _, meta = ckpt.load_checkpoint(ckpt.checkpoint_dir(model_tag), args.step, load_optimizer=False)
    tokenizer = get_tokenizer()
    ckpt.check_tokenizer(meta, tokenizer, ckpt.checkpoint_dir(model_tag))  # the export carries this tokenizer
    meta["model_tag"] = model_tag
    step = meta["step"]
    core, csv_path = None, os.path.join(get_base_dir(), "base_eval", f"{model_tag}_{step:06d}.csv")
    if os.path.exists(csv_path):  # base_eval's table, ending with the CORE row (and, since it has one, its note)
        with open(csv_path, newline="") as f:
            row = next((row for row in csv.reader(f) if row and row[0] == "CORE"), None)
        core = row and f"{float(row[2]):.4f} (scripts.base_eval: {row[3] if len(row) > 3 else 'tasks and items not recorded'})"
    # written beside --out and renamed onto it when whole: a failure leaves no partial export behind
    tmp = f"{os.path.abspath(args.out).rstrip(os.sep)}.tmp.{os.getpid()}"
    try:
        files = export(model_state, meta, tokenizer, tmp, getattr(torch, args.dtype), core, args.push_to_hub)
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
except UserError as e:  # a missing or damaged checkpoint or tokenizer, or one that cannot be converted
    fail(str(e))
except OSError as e:  # a full disk, a folder that cannot be written
    fail(f"cannot write {e.filename or args.out} ({e.strerror}): nothing was exported to {args.out}")
size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
print(f"exported {model_tag} step {step} to {args.out}: {len(files)} weight file(s), {size / 2**20:,.1f} MiB, "
      f"{time.time() - t0:.1f}s")

if args.push_to_hub:
    try:
        api.create_repo(args.push_to_hub, private=args.private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=args.out, repo_id=args.push_to_hub, repo_type="model",
                          commit_message=f"nanochat {model_tag} step {step}")
    except Exception as e:  # no write access to the repo, the network gone: the export stays
        fail(f"the upload to {args.push_to_hub} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
             f"{args.out} is exported: upload it again with huggingface_hub's upload_folder, or fix access and re-run")
    print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
