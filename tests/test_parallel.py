"""DP, TP and PP against one process: same losses (rel 1e-4, fp32), gradient norms and parameters (atol 1e-4) after
5 steps on the same batches (CPU, gloo), and the same whole-sequence evaluation loss afterwards. Also:
checkpoints move between layouts."""

import os

import pytest
import torch

from parallel_harness import run_layout


@pytest.fixture(scope="module")
def reference():
    return run_layout()


def assert_same_run(run, ref, steps=5):
    assert len(run["losses"]) == len(ref["losses"]) == steps
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) <= 1e-4, (run["losses"], ref["losses"])
    # the gradient norm, global and per parameter group, from each rank's share of the reduced gradients
    for norms, ref_norms in zip(run["grad_norms"], ref["grad_norms"]):
        assert torch.allclose(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6), (norms, ref_norms)
    assert run["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        assert torch.allclose(run["params"][name], p, atol=1e-4), (name, (run["params"][name] - p).abs().max())
    # evaluation of whole sequences (gathered model under PP / sequence parallelism) agrees on every stage
    for loss in run["eval_losses"]:
        assert abs(loss - ref["eval_losses"][0]) / ref["eval_losses"][0] <= 1e-4, (run["eval_losses"], ref["eval_losses"])


def test_reference_learns(reference):
    assert reference["losses"][-1] < reference["losses"][0]


def test_dp2(reference):
    assert_same_run(run_layout(dp=2), reference)


def test_tp2(reference):
    assert_same_run(run_layout(tp=2), reference)


def test_tp2_sequence_parallel(reference):
    assert_same_run(run_layout(tp=2, sequence_parallel=True), reference)


def test_dp4(reference):  # one matrix of every Muon round per rank, one micro-batch per step
    assert_same_run(run_layout(dp=4), reference)


def test_dp2_tp2(reference):
    assert_same_run(run_layout(dp=2, tp=2), reference)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, pp=2)], ids=["dp2", "dp2_pp2"])
def test_overlapped_grad_reduce_gives_the_same_run(layout):
    """The reductions launched from the last micro-batch's backward give the same numbers as those
    launched in step(); and from the second step on (the first agrees on the order) the backward
    launches some of them on every stage."""
    on = run_layout(steps=3, **layout)
    off = run_layout(steps=3, overlap=False, **layout)
    assert on["losses"] == off["losses"]
    for name, p in off["params"].items():
        assert torch.equal(on["params"][name], p), name
    for stage in on["overlapped"]:
        assert stage[0] == 0 and all(n > 0 for n in stage[1:]), on["overlapped"]
    assert all(n == 0 for stage in off["overlapped"] for n in stage)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2(reference, schedule):
    assert_same_run(run_layout(pp=2, schedule=schedule), reference)


def test_dp2_pp2(reference):
    assert_same_run(run_layout(dp=2, pp=2), reference)


def test_tp2_pp2(reference):
    assert_same_run(run_layout(tp=2, pp=2), reference)


def test_tp2_pp2_sequence_parallel(reference):  # stages pass this rank's share of the tokens
    assert_same_run(run_layout(tp=2, pp=2, sequence_parallel=True), reference)


def _resume_matches(saved_run, **layout):
    """Resume the checkpoint saved half-way through `saved_run` at another layout: the second half of
    the loss curve and the final parameters must match."""
    resumed = run_layout(steps=6, resume_from=os.path.join(saved_run["dir"], "ckpt"), **layout)
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], saved_run["losses"][3:]):
        assert abs(a - b) / abs(b) <= 1e-4, (resumed["losses"], saved_run["losses"])
    for name, p in saved_run["params"].items():
        assert torch.allclose(resumed["params"][name], p, atol=1e-4), name


def test_checkpoint_tp2_resumes_at_tp1_and_tp4():
    kv4 = {"n_kv_head": 4}  # TP=4 needs 4 kv heads
    saved = run_layout(tp=2, steps=6, config_overrides=kv4)
    _resume_matches(saved, tp=1, config_overrides=kv4)
    _resume_matches(saved, tp=4, config_overrides=kv4)


def test_checkpoint_pp2_resumes_at_pp1_and_back():
    saved = run_layout(pp=2, steps=6)
    _resume_matches(saved, pp=1)
    saved1 = run_layout(pp=1, steps=6)
    _resume_matches(saved1, pp=2, schedule="gpipe")


def test_checkpoint_dp2_resumes_at_dp1():
    saved = run_layout(dp=2, steps=6)
    _resume_matches(saved, dp=1)


def test_tp_that_does_not_divide_heads_is_a_clear_error():
    from nanochat.gpt import GPTConfig
    from nanochat.tensor_parallel import check_tp_size
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the query heads \(n_head\) = 4; valid --tp values for this model: \[1, 2\]"):
        check_tp_size(GPTConfig(n_head=4, n_kv_head=2, n_embd=64, vocab_size=64), 3)
    with pytest.raises(ValueError, match=r"key/value heads \(n_kv_head\) = 2"):
        check_tp_size(GPTConfig(n_head=4, n_kv_head=2, n_embd=64, vocab_size=64), 4)
    with pytest.raises(ValueError, match=r"vocabulary \(vocab_size\) = 65"):
        check_tp_size(GPTConfig(n_head=4, n_kv_head=4, n_embd=64, vocab_size=65), 2)


def test_pipeline_stage_split_and_schedule():
    import torch
    from nanochat.gpt import GPT, config_for_depth
    from nanochat.pipeline_parallel import split_stages, block_costs, Pipeline
    assert split_stages([1, 1, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    assert split_stages([1, 1, 1, 1], 2, 2) == [(0, 3), (3, 4)]  # the head weighs on the last stage
    assert split_stages([5, 1, 1, 1, 1, 1], 0, 2) == [(0, 1), (1, 6)]
    with pytest.raises(ValueError, match="more stages than blocks"):
        split_stages([1, 1], 0, 3)
    with torch.device("meta"):
        model = GPT(config_for_depth(12))
    costs, head = block_costs(model)
    assert len(costs) == 12 and head > costs[0]  # d12's lm_head costs more than a block
    from nanochat.distributed import Layout
    pipe = Pipeline(model, Layout(pp_size=4, pp_rank=0), num_microbatches=8, micro_batch_size=1, schedule="1f1b")
    text = pipe.schedule_text()
    assert "stage 3:" in text and "bubble (p-1)/(m+p-1) = 0.273" in text
    first_row = text.splitlines()[1].split()[2:]
    assert first_row[:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]  # stage 0 warms up with p-1 = 3 forwards, then 1F1B
    # replayed in time with equal forward and backward times, every stage idles the formula's fraction
    from dev.pipeline_sim import simulate, report
    from nanochat.pipeline_parallel import stage_actions
    for schedule in ("1f1b", "gpipe"):
        timeline = simulate([stage_actions(schedule, 4, 8, s) for s in range(4)], {"F": 1.0, "B": 1.0})
        assert report(timeline, {"F": 1.0, "B": 1.0}, unit=False).endswith("0.273, 0.273, 0.273, 0.273")
    # GPipe's critical path crosses each of the p-1 stage boundaries once each way: one message latency each
    slow = simulate([stage_actions("gpipe", 4, 8, s) for s in range(4)], {"F": 1.0, "B": 1.0}, p2p=0.5)
    assert max(t[-1][3] for t in slow) == 22.0 + 2 * 3 * 0.5
    with pytest.raises(ValueError, match="at least pp=4 micro-batches"):
        Pipeline(model, Layout(pp_size=4, pp_rank=0), num_microbatches=2, micro_batch_size=1)


def test_vocab_parallel_loss_reduces_like_the_single_device_loss():
    """TP's loss (over a group of one process here) reduces as the one-device loss does: 'none' in the
    targets' shape, 'sum', and 'mean' over the counted targets, NaN when none counts (F.cross_entropy's
    answer; TP used to return 0 there)."""
    from types import SimpleNamespace
    import torch.distributed as dist
    from parallel_harness import _free_port
    from nanochat.gpt import Linear, SoftcapCrossEntropy
    from nanochat.tensor_parallel import VocabParallelSoftcapCrossEntropy
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        tp_loss = VocabParallelSoftcapCrossEntropy(64, SimpleNamespace(tp_group=dist.group.WORLD, tp_rank=0, tp_size=1))
        lm_head = Linear(16, 64)
        torch.nn.init.normal_(lm_head.weight)
        x = torch.randn(2, 5, 16)
        targets = torch.randint(0, 64, (2, 5))
        targets[0, :2] = -1
        for t in (targets, torch.full_like(targets, -1)):
            for reduction in ("none", "sum", "mean"):
                mine = tp_loss(x, lm_head, t, reduction)
                ref = SoftcapCrossEntropy()(x, lm_head, t, reduction)
                assert mine.shape == ref.shape
                assert torch.allclose(mine, ref, atol=1e-5, equal_nan=True), (reduction, mine, ref)
        assert tp_loss(x, lm_head, torch.full_like(targets, -1)).isnan()
    finally:
        dist.destroy_process_group()
