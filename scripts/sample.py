"""
Complete prompts with a base-model checkpoint (KV-cache sampling, nanochat/engine.py); a completion stops at
<|bos|> (the start of another document) or after --max-tokens tokens.

    python -m scripts.sample --prompt "The capital of France is" --num-samples 3 [--temperature 0] [--report]
    python -m scripts.sample                       # prompts from stdin, one per line (interactive)
"""

import sys
import argparse

from nanochat.common import HelpWithDefaults, UserError, get_compute_dtype
from nanochat.distributed import compute_init, compute_cleanup
from nanochat.checkpoint_manager import load_model
from nanochat.tokenizer import get_tokenizer
from nanochat.engine import generate, SAMPLE_PROMPTS
from nanochat import report, kernels

parser = argparse.ArgumentParser(description="Sample completions from a base model", formatter_class=HelpWithDefaults)
parser.add_argument("--model-tag", type=str, default=None, help="checkpoint folder (default: the most recent one)")
parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
parser.add_argument("--prompt", type=str, action="append", default=[], help="a prompt (repeatable); none = read stdin")
parser.add_argument("--fixed-prompts", action="store_true", help="complete the fixed prompts base_train samples (engine.SAMPLE_PROMPTS)")
parser.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
parser.add_argument("--max-tokens", type=int, default=64, help="most new tokens per completion")
parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = all)")
parser.add_argument("--seed", type=int, default=42, help="sampling seed (same seed, same completions)")
parser.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
parser.add_argument("--report", action="store_true", help="write the samples to the report")
parser.add_argument("--kernels", type=str, default=None, choices=kernels.MODES, help="auto: fast kernels where they apply; reference: the plain PyTorch math everywhere (default: NANOCHAT_KERNELS, else auto)")
args = parser.parse_args()
kernels.set_mode(args.kernels)

checks = [(args.num_samples < 1, f"--num-samples {args.num_samples}: 1 or more"),
          (args.max_tokens < 1, f"--max-tokens {args.max_tokens}: 1 or more"),
          (not 0 <= args.temperature < float("inf"), f"--temperature {args.temperature}: finite, 0 or more"),
          (args.top_k < 0, f"--top-k {args.top_k}: 0 or more"), (not -2 ** 63 <= args.seed < 2 ** 64, "--seed: 64 bits")]
if bad := [message for wrong, message in checks if wrong]:
    sys.exit("ERROR: " + "; ".join(bad))
try:
    _, device = compute_init(args.device_type)
    tokenizer = get_tokenizer()
    model, meta = load_model(args.model_tag, args.step, device, get_compute_dtype(device.type), tokenizer=tokenizer)
except UserError as e:
    sys.exit(f"ERROR: {e}")
bos = tokenizer.get_bos_token_id()
print(f"sampling from {meta['model_tag']} step {meta['step']} (temperature {args.temperature}, top-k {args.top_k}, "
      f"seed {args.seed})")


def stdin_prompts():
    while True:
        if sys.stdin.isatty():
            print("prompt> ", end="", flush=True)
        if not (line := sys.stdin.readline()):
            return
        if line.strip():
            yield line.rstrip("\n")


done = []  # prompt + completion, for the report
try:
    for prompt in args.prompt + (SAMPLE_PROMPTS if args.fixed_prompts else []) or stdin_prompts():
        ids = tokenizer.encode(prompt, prepend=bos)
        if len(ids) + args.max_tokens > model.rotary_len:
            print(f"skipped: the prompt ({len(ids)} tokens) plus --max-tokens {args.max_tokens} exceeds the model's "
                  f"{model.rotary_len} positions", flush=True)
            continue
        samples = generate(model, ids, args.max_tokens, num_samples=args.num_samples, temperature=args.temperature,
                           top_k=args.top_k or None, seed=args.seed, stop_tokens=(bos,))
        for i, s in enumerate(samples):
            done.append(prompt + tokenizer.decode([t for t in s if t != bos]))
            print(f"--- [{i + 1}/{args.num_samples}] {done[-1]}", flush=True)
except KeyboardInterrupt:  # Ctrl-C at the prompt or mid-completion: the samples so far stand
    print("\ninterrupted", flush=True)

if args.report:
    report.log_section("Base model samples", [{"model tag": meta["model_tag"], "step": meta["step"],
                                               "temperature": args.temperature, "top-k": args.top_k, "seed": args.seed},
                                              "\n".join(f"{i}. `{t!r}`" for i, t in enumerate(done, 1))])
compute_cleanup()
