"""
Profile any training script's steps, one optimizer step at a time, without changing the script: for a
side-by-side look at where this harness and another (upstream nanochat) spend a step.

    python dev/profile_script.py --root ../nanochat-92d63d4 --skip 6 --steps 2 -- \
        -m scripts.base_train --depth=20 --window-pattern=L --device-batch-size=32 --num-iterations=20

The script runs in this process, from --root (first on sys.path, the working directory) with the
arguments after `--`. A global optimizer hook (torch.optim.optimizer.register_optimizer_step_post_hook)
counts the steps of any torch.optim.Optimizer: after --skip steps (compilation, warm-up) it times
--steps steps unprofiled, profiles the next --steps, prints dev/trace_report.py's tables and ends the
process. The step boundary is the optimizer's step, so a step's tail (zero_grad, logging) is counted in
the next one. Run it as a file (not `-m`), so that the package imported is the one under --root.
"""

import os
import sys
import time
import runpy
import argparse
import tempfile
import importlib.util

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--root", type=str, required=True, help="the checkout to run the script from")
parser.add_argument("--skip", type=int, default=6, help="optimizer steps before any timing (compilation)")
parser.add_argument("--steps", type=int, default=2, help="steps timed, then as many profiled")
parser.add_argument("--trace", type=str, default="", help="write the Chrome trace here")
parser.add_argument("--top", type=int, default=40, help="kernels to list")
parser.add_argument("script", nargs=argparse.REMAINDER, help="-- -m MODULE ARGS... or -- FILE.py ARGS...")
args = parser.parse_args()
script = args.script[1:] if args.script[:1] == ["--"] else args.script
if not script or (script[0] == "-m" and len(script) < 2):
    sys.exit("profile_script: give the script after `--`: -m MODULE ARGS... or FILE.py ARGS...")

# the report module by its path: this checkout's `dev` package may not be importable beside --root's
spec = importlib.util.spec_from_file_location("trace_report", os.path.join(os.path.dirname(os.path.abspath(__file__)), "trace_report.py"))
trace_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_report)

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

root = os.path.abspath(args.root)
os.chdir(root)
sys.path.insert(0, root)
profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
state = dict(step=0, t0=None, wall_ms=None)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def after_step(optimizer, *_):
    state["step"] += 1
    step, skip, n = state["step"], args.skip, args.steps
    if step == skip:
        synchronize()
        state["t0"] = time.time()
    elif step == skip + n:
        synchronize()
        state["wall_ms"] = (time.time() - state["t0"]) * 1000 / n
        profiler.start()
    elif step == skip + 2 * n:
        synchronize()
        profiler.stop()
        trace_path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
        profiler.export_chrome_trace(trace_path)
        print(f"\n== profile of optimizer steps {skip + n + 1}-{skip + 2 * n} of {' '.join(script)} ({root})")
        trace_report.report(trace_path, n, state["wall_ms"], args.top)
        sys.stdout.flush()
        os._exit(0)  # the script's remaining steps, evaluation and checkpoint are not needed


register_optimizer_step_post_hook(after_step)
if script[0] == "-m":
    sys.argv = [script[1]] + script[2:]
    runpy.run_module(script[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")
sys.exit(f"profile_script: the script ended after {state['step']} optimizer steps, before {args.skip + 2 * args.steps}: "
         f"raise its step count or lower --skip/--steps")
