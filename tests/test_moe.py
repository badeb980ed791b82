"""Mixture of experts (nanochat/moe.py): the grouped matmuls against the expert-by-expert reference, every token routed
to K experts, the bias moving a skewed router toward balance, the counts the recipe uses, one-line errors for bad
flags, and MoE under data and pipeline parallelism and across layouts on resume (gloo, against one process)."""

import pytest
import torch

from nanochat.gpt import GPTConfig, build_model
import functools

import torch.nn.functional as F

from nanochat.moe import (MOE_BIAS_RATE, MoE, after_step, expert_dim, grouped_experts, looped_experts, mixture,
                          pairs_per_expert)
from nanochat.recipe import parse_args, model_config, check_loop_flags, Setting
from nanochat.common import ConfigError
import parallel_harness
from parallel_harness import CONFIG, run_layout
from test_parallel import _resume_matches, assert_same_run

MOE = {"moe_experts": 4, "moe_topk": 2}
HARNESS_WORKER = parallel_harness._worker  # a rank as the harness runs it (before any test patches it)


def per_token(x, chosen, weights, w_fc, w_proj):
    """The definition, token by token: sum_k weights[t, k] * relu(x_t W_fc[e]^T)^2 W_proj[e]^T, e = chosen[t, k]."""
    return torch.stack([sum(weights[t, k] * F.relu(x[t] @ w_fc[e]).square() @ w_proj[e]
                            for k, e in enumerate(chosen[t].tolist())) for t in range(x.size(0))])


@pytest.mark.parametrize("experts", [grouped_experts, looped_experts])
def test_the_mixture_matches_the_per_token_definition_forward_and_backward(experts):
    torch.manual_seed(0)
    n, d, h, E, K = 60, 16, 32, 5, 2
    x = torch.randn(n, d, requires_grad=True)
    w_fc, w_proj = torch.randn(E, d, h, requires_grad=True), torch.randn(E, h, d, requires_grad=True)
    chosen = torch.stack([torch.randperm(E - 1)[:K] for _ in range(n)])  # expert E-1 gets no token
    weights = torch.rand(n, K, requires_grad=True)
    mine = mixture(x, chosen, weights, pairs_per_expert(chosen, E), functools.partial(experts, w_fc, w_proj))
    ref = per_token(x, chosen, weights, w_fc, w_proj)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(mine, [x, w_fc, w_proj, weights], g),
                    torch.autograd.grad(ref, [x, w_fc, w_proj, weights], g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_every_token_goes_to_k_distinct_experts_with_weights_summing_to_one():
    layer = build_model(GPTConfig(**{**CONFIG, **MOE}), "cpu").blocks[1].mlp
    assert isinstance(layer, MoE) and layer.hidden == expert_dim(GPTConfig(**{**CONFIG, **MOE})) == 64
    x = torch.randn(300, CONFIG["n_embd"])
    chosen, weights, _ = layer.route(x)
    assert chosen.shape == (300, 2) and (chosen[:, 0] != chosen[:, 1]).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(300))
    assert layer.load.sum() == 600  # pairs counted: none dropped
    # the bias chooses the experts but never weighs them; forwards without gradients (evaluation) count no load
    scores = torch.sigmoid(layer.router(x).float()).detach()
    with torch.no_grad():
        layer.bias.copy_(torch.linspace(-10, 10, layer.num_experts))
        chosen, weights, _ = layer.route(x)
    chosen_scores = scores.gather(1, chosen)
    torch.testing.assert_close(weights, chosen_scores / chosen_scores.sum(-1, keepdim=True))
    assert (chosen >= layer.num_experts - 2).all() and layer.load.sum() == 600  # the two most favoured
    with pytest.raises(ConfigError, match=r"--ep 2 spreads each MoE layer's experts over DP ranks: it needs "
                                          r"--moe-experts \(off: a dense model\)"):
        Setting(dp=2, ep=2, device_batch=1, total_batch=2 * CONFIG["sequence_len"]).check(GPTConfig(**CONFIG))


def test_the_bias_moves_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    model = build_model(GPTConfig(**{**CONFIG, **MOE}), "cpu")
    layer = model.blocks[1].mlp
    with torch.no_grad():
        layer.router.weight[0] += 0.5 * layer.router.weight.abs().mean()  # expert 0 wins most tokens
    x = torch.randn(512, CONFIG["n_embd"]).abs()
    imbalance = []
    with torch.enable_grad():
        for _ in range(600):  # a bias of ~0.4 at 1e-3 a step
            layer.route(x)
            imbalance.append(float(after_step(model, [])))  # the other layers saw no token
    assert imbalance[0] > 1.5 and imbalance[-1] < 1.05, (imbalance[0], imbalance[-1])
    assert layer.bias[0] < 0 and not layer.load.any()  # the favourite pushed down; the counts cleared each step


def test_counts_use_the_active_experts():
    dense, moe = (build_model(GPTConfig(**{**CONFIG, **o}), "cpu") for o in ({}, MOE))
    d, h, layers = CONFIG["n_embd"], 64, CONFIG["n_layer"] - 1  # all blocks but the first
    counts = moe.parameter_counts()
    routed = 2 * d * h
    assert counts["total"] - counts["active"] == layers * (4 - 2) * routed
    # per MoE layer: the dense MLP's 8 d^2 out, router + shared expert + K routed experts in
    assert moe.num_scaling_params() - dense.num_scaling_params() == layers * (d * 4 + routed + 2 * routed - 8 * d * d)


@pytest.mark.parametrize("flags, message", [
    (["--moe-experts", "4", "--moe-topk", "5"], "--moe-experts 4 --moe-topk 5: each token goes to K experts, 2 <= K <= E"),
    (["--moe-experts", "4", "--moe-topk", "1"], "with 1 the router gets no gradient"),
    (["--moe-experts", "1"], "--moe-experts 1 --moe-topk 2: each token goes to K experts, 2 <= K <= E"),
    (["--moe-experts", "4", "--moe-layers", "9"], "--moe-layers '9': block indices must be in 0..3"),
    (["--moe-experts", "4", "--moe-expert-dim", "100"], "--moe-expert-dim 100 must be >= 0, the width a multiple of 8"),
    (["--moe-layers", "1"], "--moe-layers shape what --moe-experts adds, which is off"),
    (["--l3-d-up", "64", "--l3-table-lr", "0.1"], "--l3-d-up, --l3-table-lr shape what --l3-after-layers adds, which is off"),
    (["--moe-experts", "4", "--moe-shared", "-1"], "--moe-shared -1 and --moe-expert-dim 0 must be >= 0"),
])
def test_bad_moe_flags_are_one_line_errors(flags, message):
    args = parse_args(["--depth", "4"] + flags)
    with pytest.raises(ConfigError, match=message):
        model_config(args, 256)


def test_resuming_a_dense_checkpoint_as_moe_is_refused():
    """A checkpoint from before the MoE flags names none of them: they had their defaults (dense)."""
    old = {k: v for k, v in vars(parse_args(["--depth", "4"])).items() if not k.startswith("moe_")}
    meta = {"user_config": old, "model_config": GPTConfig(n_layer=4).to_dict()}
    check_loop_flags(parse_args(["--depth", "4"]), meta)  # the same model: fine
    with pytest.raises(ConfigError, match="--moe-experts 4 \\(the checkpoint's: 0\\)"):
        check_loop_flags(parse_args(["--depth", "4", "--moe-experts", "4"]), meta)


def test_a_stage_without_moe_layers_reports_zero_imbalance():
    """Under PP every stage of an MoE model reports (0 where it holds none), so the max over stages can be taken."""
    model = build_model(GPTConfig(**{**CONFIG, **MOE, "moe_layers": (3,)}), "cpu")
    model.blocks[3] = torch.nn.Identity()  # as the pipeline cuts a stage
    assert float(after_step(model, [])) == 0.0
    assert after_step(build_model(GPTConfig(**CONFIG), "cpu"), []) is None


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match="--moe-experts with --tp needs --sequence-parallel"):
        Setting(tp=2, device_batch=1, total_batch=CONFIG["sequence_len"]).check(GPTConfig(**{**CONFIG, **MOE}))


@pytest.fixture(scope="module")
def moe_reference_run():
    return run_layout(config_overrides=MOE)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(pp=2), dict(tp=2, sequence_parallel=True),
                                    dict(dp=2, shard_params=True)], ids=["dp2", "pp2", "tp2_sp", "dp2_sharded"])
def test_moe_under_parallelism_follows_one_process(moe_reference_run, layout):
    """DP 2: each rank routes its half of the tokens, the loads summed over DP move the same bias on both ranks
    (sharded too: each expert's matrices gathered around its layer like a dense MLP's).
    TP 2 with SP: the attention and dense MLP cut, the MoE layers replicated, each rank running its own tokens (losses
    and gradient norms agree to 1e-7; one value embedding entry, whose gradient is near AdamW's eps, by 4e-4)."""
    assert_same_run(run_layout(config_overrides=MOE, **layout), moe_reference_run, embedding_atol=1e-3)


def test_moe_checkpoint_dp2_resumes_at_pp2():
    saved = run_layout(dp=2, steps=6, config_overrides=MOE)
    _resume_matches(saved, pp=2, config_overrides=MOE)


def test_moe_compiled_follows_eager(moe_reference_run):
    """torch.compile (aot_eager on CPU) over the routing, the grouped matmuls and the load counts (a buffer the
    graph updates), without recompiling after the first step."""
    from test_compiled_pipeline import assert_close_runs
    run = run_layout(config_overrides=MOE, compile_backend="aot_eager")
    assert_close_runs(run, moe_reference_run, 1e-4)  # as compiled PP 2 against one process
    assert run["graphs"][0] == [run["graphs"][0][0]] * len(run["graphs"][0])


def test_hf_export_of_an_moe_checkpoint_is_a_one_line_error(tmp_path):
    from nanochat.hf.convert import export, ConvertError
    model = build_model(GPTConfig(**{**CONFIG, **MOE}), "cpu")
    with pytest.raises(ConvertError, match="mixture-of-experts layers"):
        export(model.state_dict(), {"model_config": model.config.to_dict()}, None, str(tmp_path))


@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2), dict(dp=2, ep=2, pp=2),
                                    dict(dp=2, ep=2, recompute="block"), dict(pp=2, schedule="interleaved", virtual=2),
                                    dict(dp=2, ep=2, tp=2, sequence_parallel=True)],
                         ids=["ep2", "ep4", "dp2xep2", "ep2xpp2", "ep2_block_recompute", "pp2_interleaved", "ep2xtp2_sp"])
def test_expert_parallel_follows_one_process(moe_reference_run, layout):
    """Each rank holds E / ep experts; rows go to their experts' ranks and back by all-to-all; the experts' gradients
    summed over the ranks that hold the same ones (dp 4 x ep 2: two each)."""
    assert_same_run(run_layout(config_overrides=MOE, **layout), moe_reference_run, embedding_atol=1e-3)


def _skewed_router_worker(rank, *args):
    """A harness rank whose MoE routers start skewed (bias +10 for experts 0 and 1, -10 for 2 and 3): at EP 2 no
    token reaches rank 1's experts."""
    import parallel_harness
    from nanochat.moe import moe_modules
    identity = parallel_harness.leave_identity_init

    def skewed(model):
        identity(model)
        for m in moe_modules(model):
            m.bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))
    parallel_harness.leave_identity_init = skewed
    try:
        HARNESS_WORKER(rank, *args)
    finally:  # the pool's processes serve later runs
        parallel_harness.leave_identity_init = identity


def test_an_ep_rank_no_token_reaches_still_exchanges_and_follows_one_process(monkeypatch):
    """Its empty rows stay in the graph, so its backward's exchanges meet its peers' (they crashed gloo and would
    hang NCCL)."""
    import parallel_harness
    monkeypatch.setattr(parallel_harness, "_worker", _skewed_router_worker)
    one = run_layout(config_overrides=MOE)
    assert_same_run(run_layout(dp=2, ep=2, config_overrides=MOE), one, embedding_atol=1e-3)


def test_expert_parallel_checkpoints_resume_at_other_layouts():
    """An EP 2 checkpoint (one file per EP rank) resumes at one process, and a one-process one at EP 2."""
    saved = run_layout(dp=2, ep=2, steps=6, config_overrides=MOE)
    _resume_matches(saved, config_overrides=MOE)
    _resume_matches(run_layout(steps=6, config_overrides=MOE), dp=2, ep=2, config_overrides=MOE)


def test_the_planner_divides_the_experts_under_expert_parallelism():
    from nanochat.memory import rank_memory
    config = GPTConfig(**{**CONFIG, **MOE})
    plain, spread = (rank_memory(config, Setting(dp=2, ep=ep, device_batch=1, total_batch=2 * CONFIG["sequence_len"]))[0]
                     for ep in (1, 2))
    experts = 3 * 4 * 2 * CONFIG["n_embd"] * 64 * 4  # 3 MoE layers x 4 experts x 2 matrices, fp32
    assert plain["weights"] - spread["weights"] == experts // 2
    assert spread["activations"] < plain["activations"]  # the weight stacks of half the experts


def test_the_planner_counts_moe_layers_on_the_tokens_of_a_tp_rank():
    """Under TP with SP an MoE layer runs this rank's tokens: its extra activations (beyond a dense MLP's) are half
    of one GPU's at TP 2, the experts' weight stacks whole."""
    from nanochat.memory import rank_memory, candidate_settings
    config, tokens = GPTConfig(**{**CONFIG, **MOE}), CONFIG["sequence_len"]
    one, tp2 = (rank_memory(c, Setting(tp=tp, sequence_parallel=tp > 1, device_batch=1, total_batch=tokens))[0]
                for c, tp in ((config, 1), (config, 2)))
    dense_one, dense_tp2 = (rank_memory(GPTConfig(**CONFIG), Setting(tp=tp, sequence_parallel=tp > 1, device_batch=1,
                                                                       total_batch=tokens))[0] for tp in (1, 2))
    stacks = 3 * 2 * 4 * CONFIG["n_embd"] * 64 * 2  # 3 MoE layers, two bf16 (E, d, h) stacks of 4 experts
    moe_one, moe_tp2 = one["activations"] - dense_one["activations"], tp2["activations"] - dense_tp2["activations"]
    assert moe_tp2 - stacks == pytest.approx((moe_one - stacks) / 2)
    assert any(s.tp == 2 and s.sequence_parallel for s in candidate_settings(config, 2, 2 * tokens))


def test_moe_in_fp8_under_expert_and_tensor_parallelism_follows_one_process():
    """fp8 converts the attention's and the shared expert's linears (not the router, not the routed experts); EP 2
    follows one process within fp8's own noise (test_fp8_parallel's rule)."""
    from test_fp8_parallel import FP8, assert_same_fp8_run
    config = {**FP8, **MOE}  # two blocks: block 1 a mixture of experts
    reference = run_layout(steps=4, config_overrides=config, fp8=True)
    assert_same_fp8_run(run_layout(dp=2, ep=2, steps=4, config_overrides=config, fp8=True), reference)
    # TP 2 with SP: the replicated shared expert's fp8 products are whole (its tp_partial_grad group only sums its
    # gradient). The routing bias moves by +-rate a step on a comparison of loads, which other fp8 roundings (TP's
    # shards cast with their own amax) can flip: each element within two flipped steps (4 x rate; measured one;
    # 4 steps can part it by 8 x rate)
    tp2 = run_layout(tp=2, sequence_parallel=True, steps=4, config_overrides=config, fp8=True)
    bias = "blocks.1.mlp.bias"
    assert (tp2["params"].pop(bias) - reference["params"][bias]).abs().max() <= 4 * MOE_BIAS_RATE + 1e-6
    assert_same_fp8_run(tp2, dict(reference, params={n: p for n, p in reference["params"].items() if n != bias}))
