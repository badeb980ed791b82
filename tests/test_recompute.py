"""Activation recompute (--recompute selective|block) against none: the same losses and gradients, bitwise in
eager fp32 on a CPU (the backward recomputes the region with the same ops on the same inputs, so every
value is the one the first forward made), on one process and under TP=2 (sequence parallel: the regions'
all-gathers and reduce-scatters run again) and PP=2; fewer saved activations; evaluation untouched; and
the same under torch.compile (whole model and per block, one process and TP=2), within rounding (the
compiled graphs of the modes are partitioned differently)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat import kernels, training
from nanochat.gpt import GPTConfig
from nanochat.distributed import build_layout
from nanochat.recipe import Setting, LearningRates
from parallel_harness import CONFIG, leave_identity_init, fixed_batches, run_layout

MODES = ("selective", "block")


def tiny_model(mode):
    """The model as training.setup leaves it with --recompute `mode` (eager, one process)."""
    torch.manual_seed(0)
    config = GPTConfig(**CONFIG)
    setting = Setting(device_batch=1, total_batch=config.sequence_len, recompute=mode)
    return training.setup(config, setting, build_layout(0, 1, 0), torch.device("cpu"), torch.float32, LearningRates(),
                          after_init=leave_identity_init).model


def loss_and_grads(model, call=None):
    rows = fixed_batches(1)[0]
    loss = (model if call is None else call)(rows[:, :-1], rows[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model):
    """Bytes the forward keeps for the backward (every tensor autograd saves, as packed)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    rows = fixed_batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(rows[:, :-1], rows[:, 1:])
    return total


@pytest.mark.parametrize("mode", MODES)
def test_recompute_gives_the_same_loss_and_gradients(mode):
    ref_loss, ref_grads = loss_and_grads(tiny_model("none"))
    loss, grads = loss_and_grads(tiny_model(mode))
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), (mode, name, (grads[name] - g).abs().max())


def test_recompute_keeps_fewer_activations():
    """The checkpointed blocks keep only their inputs. (With checkpointing inside the hooks, a region's own
    saves go to its recompute, not to this count; selective checkpointing keeps its outputs in its own cache,
    out of the hooks' sight: the next test.)"""
    none, block = (saved_bytes(tiny_model(m)) for m in ("none", "block"))
    assert 3 * block < none, (none, block)


class CountKept(TorchDispatchMode):
    """Calls of the ops that --recompute selective keeps: attention, and the fused ReLU^2 product."""

    def __init__(self):
        super().__init__()
        self.calls, self.all_ops = {"attention": 0, "relu_square": 0}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all_ops += 1
        if func in kernels.SELECTIVE_KEEPS:
            self.calls["relu_square" if "relu_square" in str(func) else "attention"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fused_mlp_on_cpu(monkeypatch):
    """The MLP through relu_square_mm.FusedMLP, as on a GPU, with its two products in plain PyTorch."""
    from nanochat.kernels import relu_square_mm
    for name, fn in [("fc_relu_square", lambda x, w: torch.relu(x @ w.t()).square()),
                     ("relu_square_input_grad", lambda dy, w, y: (dy @ w) * 2 * y.sqrt())]:
        getattr(relu_square_mm, name).register_kernel("cpu")(fn)
    monkeypatch.setattr(relu_square_mm, "supported", lambda x: True)


@pytest.mark.parametrize("mode, recomputed", [("block", CONFIG["n_layer"]), ("selective", 0)])
def test_selective_keeps_attention_and_relu_square(fused_mlp_on_cpu, mode, recomputed):
    """The kept ops run once per layer in the forward; in the backward, "block" runs them again per layer
    and "selective" not at all (their saved outputs serve the recompute), while both run more ops than a backward
    without recompute (the rest of each block again), with the same loss and gradients."""
    rows = fixed_batches(1)[0]
    plain_loss = tiny_model("none")(rows[:, :-1], rows[:, 1:])
    with CountKept() as plain_backward:
        plain_loss.backward()
    ref_loss, ref_grads = loss_and_grads(tiny_model("none"))
    model = tiny_model(mode)
    with CountKept() as forward:
        loss = model(rows[:, :-1], rows[:, 1:])
    with CountKept() as backward:
        loss.backward()
    n = CONFIG["n_layer"]
    assert forward.calls == {"attention": n, "relu_square": n}
    assert backward.calls == {"attention": recomputed, "relu_square": recomputed}
    assert backward.all_ops > plain_backward.all_ops + n, (backward.all_ops, plain_backward.all_ops)
    assert torch.equal(loss.detach(), ref_loss)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name


def test_evaluation_does_not_recompute(monkeypatch):
    """Eval mode, or no grad (sampling, CORE, val bpb), never checkpoints, and gives the same numbers."""
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = fixed_batches(1)[0]
    ref = tiny_model("none").eval()(rows[:, :-1], rows[:, 1:], loss_reduction="none")
    model = tiny_model("block")
    with torch.no_grad():  # train mode, no grad
        assert torch.equal(model(rows[:, :-1], rows[:, 1:], loss_reduction="none"), ref)
    model.eval()  # eval mode, grad enabled
    assert torch.equal(model(rows[:, :-1], rows[:, 1:], loss_reduction="none"), ref)
    assert not calls
    model.train()
    model(rows[:, :-1], rows[:, 1:])
    assert len(calls) == CONFIG["n_layer"]  # and training does, once per block


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="--recompute 'attn'"):
        tiny_model("attn")


@pytest.mark.parametrize("per_block, mode", [(False, "block"), (False, "selective"), (True, "block")],
                         ids=["whole_model_block", "whole_model_selective", "per_block_block"])
def test_recompute_under_compile(per_block, mode):
    """torch.compile traces the checkpoints (aot_eager: the capture and the autograd split that decides
    what the backward recomputes, without code generation, which the CPU would take minutes for)."""
    ref_loss, ref_grads = loss_and_grads(tiny_model("none"))
    model = tiny_model(mode)
    compiled = training.compile_for_training(model, None, per_block=per_block, backend="aot_eager")
    loss, grads = loss_and_grads(model, compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


_references = {}


def reference(schedule=None, virtual=1, **layout):
    """The run without recompute, once per layout (in 1F1B: every schedule computes the same gradients bitwise,
    test_parallel.test_pp2)."""
    key = tuple(sorted(layout.items()))
    if key not in _references:
        _references[key] = run_layout(steps=3, **layout)
    return _references[key]


# each run starts processes, so a few pairs rather than every one: the whole block (selective: but for
# the attention output) under TP, where attention's collectives run again too, eager and compiled (whole
# model, aot_eager); and under PP
@pytest.mark.parametrize("layout, mode, backend", [
    (dict(tp=2, sequence_parallel=True), "selective", None),
    (dict(tp=2, sequence_parallel=True), "block", "aot_eager"),
    (dict(pp=2), "block", None),
    (dict(pp=2, schedule="interleaved", virtual=2), "selective", None),
], ids=["tp2_sp_selective", "tp2_sp_block_compiled", "pp2_block", "pp2_interleaved_selective"])
def test_recompute_under_parallelism(layout, mode, backend):
    ref = reference(**layout)
    run = run_layout(steps=3, recompute=mode, compile_backend=backend, **layout)
    if backend is None:  # eager: bitwise
        assert run["losses"] == ref["losses"], (run["losses"], ref["losses"])
        for name, p in ref["params"].items():
            assert torch.equal(run["params"][name], p), name
    else:
        for a, b in zip(run["losses"], ref["losses"], strict=True):
            assert abs(a - b) / abs(b) <= 1e-5, (run["losses"], ref["losses"])
        for name, p in ref["params"].items():
            torch.testing.assert_close(run["params"][name], p, rtol=0, atol=1e-5, msg=name)
        assert run["graphs"][0] == [run["graphs"][0][0]] * 3  # no recompiles after the first step
        if "pp" not in layout:  # the whole model one graph: no break at TP's collectives (torch 2.11 broke at each)
            assert run["graphs"][0][0] == 1, run["graphs"]
    assert run["eval_losses"] == ref["eval_losses"]
