"""
fp8 training linears through torchao's float8 training (dynamic scaling, `tensorwise` or `rowwise`).

- Only Linear layers whose dims are multiples of 16 and at least 128 are converted (the fp8 matmul's
  shape rules; small layers gain nothing), and never the lm_head: the logits keep bf16 precision.
- The weights stay the same fp32 Parameters: a Float8Linear keeps the Linear's weight and only casts
  it (and the activations, and the output gradients) to fp8 around each matmul. So a checkpoint has the
  same keys with or without fp8, and one saved with fp8 loads without it and vice versa.
- Evaluation and sampling run in bf16: `bf16_linears(model)` swaps every Float8Linear back to a plain
  Linear holding the very same weight Parameter, and restores the fp8 modules afterwards.
- Without CUDA (or an SM89+ GPU), or without torchao, --fp8 says so and training continues without it.
It pays off only under torch.compile, which fuses the casts and scale computations.
"""

import importlib.util
from contextlib import contextmanager

import torch

from nanochat.gpt import Linear


def is_eligible(module, fqn):
    """The filter: a bias-free Linear with both dims multiples of 16 and >= 128, not the lm_head."""
    if not isinstance(module, torch.nn.Linear) or fqn.endswith("lm_head"):
        return False
    n_in, n_out = module.in_features, module.out_features
    return n_in % 16 == 0 and n_out % 16 == 0 and min(n_in, n_out) >= 128


def fp8_unavailable_reason(device):
    if device.type != "cuda":
        return f"fp8 needs a CUDA GPU (device is {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"fp8 matmuls need compute capability 8.9+ ({torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)})"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    return None


def convert_to_fp8(model, recipe="tensorwise", device=None, force=False):
    """Convert eligible Linears in place. Returns the number converted (0 when fp8 is unavailable;
    `force` skips the device check, for tests on CPU)."""
    reason = None if force else fp8_unavailable_reason(device)
    if reason:
        print(f"WARNING: --fp8 requested but {reason}; continuing without fp8", flush=True)
        return 0
    from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=is_eligible)
    converted = sum(1 for m in model.modules() if _is_fp8(m))
    print(f"fp8 ({recipe}): converted {converted} Linear layers", flush=True)
    return converted


def _is_fp8(module):
    return type(module).__name__ == "Float8Linear"


def _swap(model, make):
    """Replace modules by make(module) where it returns one; returns the (parent, name, old) list."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                swapped.append((parent, name, child))
    return swapped


def _as_bf16_linear(module):
    if not _is_fp8(module):
        return None
    lin = Linear.__new__(Linear)
    torch.nn.Module.__init__(lin)
    lin.in_features, lin.out_features = module.in_features, module.out_features
    lin.weight = module.weight  # the same Parameter: nothing is copied
    lin.bias = None
    return lin


@contextmanager
def bf16_linears(model):
    """Run the block in bf16: fp8 Linears are temporarily replaced by plain Linears on the same weights."""
    swapped = _swap(model, _as_bf16_linear)
    try:
        yield model
    finally:
        for parent, name, old in swapped:
            setattr(parent, name, old)
