"""
Evaluate a base-model checkpoint: CORE (nanochat/core_eval.py) and bits per byte on train and val data, to
$NANOCHAT_BASE_DIR/base_eval/<tag>_<step:06d>.csv and the report. Eager (CORE's batch shapes vary).

    python -m scripts.base_eval                                  # latest checkpoint of the latest tag
    python -m scripts.base_eval --model-tag d20 --max-per-task 500
    python -m scripts.base_eval --eval-bundle ~/eval_bundle      # a local copy of the bundle (offline)
    torchrun --nproc_per_node=8 -m scripts.base_eval             # items and batches split over ranks
"""

import os
import csv
import argparse

from nanochat.common import HelpWithDefaults, UserError, ConfigError, print0, get_base_dir, get_compute_dtype, fail
from nanochat.distributed import compute_init, compute_cleanup
from nanochat.signals import install_stop_handlers, Interrupted
from nanochat.memory import cpu_memory_error
from nanochat.checkpoint_manager import load_model
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import DataLoader
from nanochat.dataset import check_data
from nanochat.loss_eval import evaluate_bpb, default_eval_tokens
from nanochat.core_eval import find_eval_bundle, evaluate_core
from nanochat import report, kernels


def main():
    parser = argparse.ArgumentParser(description="Evaluate a base model: CORE and bits per byte",
                                     formatter_class=HelpWithDefaults)
    parser.add_argument("--model-tag", type=str, default=None, help="checkpoint folder (default: the most recent one)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    parser.add_argument("--eval-bundle", type=str, default=None,
                        help="CORE bundle folder (default: $NANOCHAT_BASE_DIR/eval_bundle, downloaded when absent)")
    parser.add_argument("--max-per-task", type=int, default=-1, help="CORE: N items of each task, a fixed shuffle's first (-1 = all)")
    parser.add_argument("--eval-tokens", type=int, default=-1, help="bpb: tokens of each split (-1 = 20 x 2^19 on a GPU, 2^18 elsewhere)")
    parser.add_argument("--device-batch-size", type=int, default=32, help="bpb: sequences per forward pass per process")
    parser.add_argument("--data-dir", type=str, default=None, help="bpb: folder of parquet shards (default as in base_train)")
    parser.add_argument("--skip-core", action="store_true", help="do not evaluate CORE")
    parser.add_argument("--skip-bpb", action="store_true", help="do not evaluate bits per byte")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (under torchrun); any checkpoint loads at any TP")
    parser.add_argument("--kernels", type=str, default=None, choices=kernels.MODES, help="auto: fast kernels where they apply; reference: the plain PyTorch math everywhere (default: NANOCHAT_KERNELS, else auto)")
    args = parser.parse_args()
    try:
        kernels.set_mode(args.kernels)
        layout, device = compute_init(args.device_type, tp=args.tp)
        install_stop_handlers()
        evaluate(args, layout, device)
    except Interrupted:
        fail("stopped by a signal during the evaluation; nothing was written")
    except UserError as e:
        fail(str(e))
    compute_cleanup()


def evaluate(args, layout, device):
    if args.max_per_task == 0:
        raise ConfigError("--max-per-task 0 evaluates nothing; give a positive count, or -1 for all items")
    if args.device_batch_size < 1 or args.eval_tokens == 0 or args.eval_tokens < -1:
        raise ConfigError(f"--device-batch-size {args.device_batch_size} must be positive, --eval-tokens "
                          f"{args.eval_tokens} positive or -1 (the default; --skip-bpb skips bpb)")
    # all that can be missing is looked for before the long parts: the bundle first (offline, fails fast), the data
    bundle = find_eval_bundle(args.eval_bundle, layout) if not args.skip_core else None
    data_dir = check_data(args.data_dir) if not args.skip_bpb else None
    tokenizer = get_tokenizer()
    token_bytes = get_token_bytes(device)
    model, meta = load_model(args.model_tag, args.step, device, get_compute_dtype(device.type), layout=layout,
                             tokenizer=tokenizer)
    model_tag, step = meta["model_tag"], meta["step"]
    print0(f"evaluating {model_tag} step {step} (sequence length {model.config.sequence_len}, "
           f"compute dtype {model.compute_dtype}) on dp {layout.dp_size} x tp {layout.tp_size}")
    items = {"model tag": model_tag, "step": step, "CORE": "skipped (--skip-core)"}
    sections = []
    if not args.skip_core:
        core = evaluate_core(model, tokenizer, device, bundle, args.max_per_task, layout)
        table = "\n".join(["| task | items | accuracy | centered |", "| --- | --- | --- | --- |"]
                          + [f"| {label} | {r['items']} | {r['accuracy']:.4f} | {r['centered']:.4f} |"
                             for label, r in core["results"].items()])
        print0(table)
        if core["missing"]:
            print0(f"missing (no data file in the bundle, left out of CORE): {', '.join(core['missing'])}")
        print0(f"CORE ({core['tasks_run']}/{core['tasks_total']} tasks): {core['core']:.4f}")
        csv_path = os.path.join(get_base_dir(), "base_eval", f"{model_tag}_{step:06d}.csv")
        if layout.rank == 0:  # the table, and the CORE row that scripts/export_hf.py reads
            os.makedirs(os.path.dirname(csv_path), exist_ok=True)
            rows = [[label, f"{r['accuracy']:.6f}", f"{r['centered']:.6f}", ""] for label, r in core["results"].items()]
            note = (f"{core['tasks_run']} of {core['tasks_total']} tasks, "  # what the score stands on (export_hf's card)
                    + ("all items" if args.max_per_task < 0 else f"{args.max_per_task} items a task"))
            with open(csv_path, "w", newline="") as f:
                csv.writer(f).writerows([["task", "accuracy", "centered", "note"], *rows,
                                         ["CORE", "", f"{core['core']:.6f}", note]])
        print0(f"wrote {csv_path}")
        items.update({"CORE": round(core["core"], 6), "CORE tasks": f"{core['tasks_run']}/{core['tasks_total']}",
                      "missing tasks": ", ".join(core["missing"]) or "none",
                      "items per task": "all" if args.max_per_task < 0 else f"{args.max_per_task} (a fixed shuffle's first)"})
        sections.append(table)
    if not args.skip_bpb:
        T = model.config.sequence_len
        if device.type == "cpu" and (error := cpu_memory_error(sum(p.numel() for p in model.parameters()), model.config,
                                                               args.device_batch_size, T, training=False)):
            raise ConfigError(error)
        eval_tokens = default_eval_tokens(device.type) if args.eval_tokens < 0 else args.eval_tokens
        steps = max(1, eval_tokens // (args.device_batch_size * T * layout.dp_size))
        for split in ("train", "val"):
            loader = DataLoader(tokenizer, args.device_batch_size, T, split, device, data_dir=data_dir,
                                dp_rank=layout.dp_rank, dp_size=layout.dp_size)
            bpb = evaluate_bpb(lambda x, y: model(x, y, loss_reduction="none"), loader, steps, token_bytes, layout,
                               label=f"{split} bpb")
            loader.close()
            print0(f"{split} bpb: {bpb:.6f}")
            items[f"{split} bpb"] = bpb
        items["bpb tokens per split"] = steps * args.device_batch_size * T * layout.dp_size
    else:
        items["val bpb"] = "skipped (--skip-bpb)"
    report.log_section("Base model evaluation", [items] + sections)


if __name__ == "__main__":
    main()
