"""DP, TP and PP against one process: same losses (rel 1e-4, fp32), gradient norms and parameters (atol 1e-4) after
5 steps on the same batches (CPU, gloo), and the same whole-sequence evaluation loss afterwards. Also:
checkpoints move between layouts."""

import os
import types

import pytest
import torch

from parallel_harness import run_layout


@pytest.fixture(scope="module")
def reference():
    return run_layout()


def assert_same_run(run, ref, steps=5, embedding_atol=1e-4):
    """embedding_atol: the embedding tables' tolerance (AdamW's g / sqrt(v) turns the summation order's relative error
    in a gradient near its eps into an update's: an entry seen by one token can differ by more than the rest)."""
    assert len(run["losses"]) == len(ref["losses"]) == steps
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) / abs(b) <= 1e-4, (run["losses"], ref["losses"])
    # the gradient norm, global and per parameter group, from each rank's share of the reduced gradients
    for norms, ref_norms in zip(run["grad_norms"], ref["grad_norms"]):
        assert torch.allclose(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6), (norms, ref_norms)
    assert run["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        atol = embedding_atol if name.startswith("wte.") or ".value_embed." in name else 1e-4
        assert torch.allclose(run["params"][name], p, atol=atol), (name, (run["params"][name] - p).abs().max())
    # val bpb's loss (every rank's rows, summed over DP, from the last stage under PP), and evaluation of whole
    # sequences (gathered model under PP / sequence parallelism) on every stage
    assert abs(run["val_loss"] - ref["val_loss"]) <= 1e-4 * ref["val_loss"], (run["val_loss"], ref["val_loss"])
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


def test_dp2_tp2_with_rounds_that_do_not_divide():
    """Five layers: Muon's stacks of five matrices divide by neither DP nor TP (padding rounds, shared over the TP
    ranks). Also what each rank held: Muon's state of a cut matrix on one TP rank only (the planner's count, exact)."""
    from test_plan import assert_planned
    five = {"n_layer": 5}
    run = run_layout(dp=2, tp=2, config_overrides=five)
    assert_same_run(run, run_layout(config_overrides=five))
    assert_planned(run, dp=2, tp=2, config_overrides=five)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, pp=2), dict(dp=2, pp=2, schedule="interleaved", virtual=2)],
                         ids=["dp2", "dp2_pp2", "dp2_pp2_interleaved"])
def test_overlapped_grad_reduce_gives_the_same_run(layout):
    """The reductions launched from the last micro-batch's backward give the same numbers as those
    launched in step(); and from the second step on (the first agrees on the order) the backward
    launches all of them on every stage (interleaved: each chunk's once its last backward has run); each bucket's
    reduction starts once a step (a second one gives the same numbers, at twice the communication)."""
    on = run_layout(steps=3, **layout)
    off = run_layout(steps=3, overlap=False, **layout)
    assert on["losses"] == off["losses"]
    for name, p in off["params"].items():
        assert torch.equal(on["params"][name], p), name
    for stage in on["overlapped"]:  # the share of the buckets the backward launched, per step
        assert stage[0] == 0 and all(n == 1 for n in stage[1:]), on["overlapped"]
    assert all(n == 0 for stage in off["overlapped"] for n in stage)
    for stage in on["reductions"] + off["reductions"]:  # every bucket reduced once a step, either way
        assert stage and all(counts and set(counts) == {1} for counts in stage), (on["reductions"], off["reductions"])


@pytest.fixture(scope="module")
def pp2_1f1b():
    return run_layout(pp=2)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_pp2(reference, pp2_1f1b, schedule, virtual):
    """Every schedule against one process; and against PP=2 1F1B bitwise: the same chunks' gradients, summed in
    the same micro-batch order."""
    run = pp2_1f1b if schedule == "1f1b" else run_layout(pp=2, schedule=schedule, virtual=virtual)
    assert_same_run(run, reference)
    assert abs(run["val_loss"] - reference["val_loss"]) <= 1e-5 * reference["val_loss"]  # val bpb's, through the stages
    if schedule == "1f1b":
        return
    assert run["losses"] == pp2_1f1b["losses"]
    for name, p in pp2_1f1b["params"].items():
        assert torch.equal(run["params"][name], p), (schedule, name)


def test_dp2_pp2_interleaved(reference):  # each chunk's overlapped reduction armed before its last backward
    assert_same_run(run_layout(dp=2, pp=2, schedule="interleaved", virtual=2), reference)


def test_tp2_pp2_interleaved(reference):
    assert_same_run(run_layout(tp=2, pp=2, schedule="interleaved", virtual=2), reference)


def test_tp2_pp2_sequence_parallel(reference):  # chunks pass this rank's share of the tokens
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
    saved = run_layout(pp=2, steps=6, schedule="interleaved", virtual=2)  # each rank saves its two chunks
    _resume_matches(saved, pp=1)
    saved1 = run_layout(pp=1, steps=6)
    _resume_matches(saved1, pp=2)


def test_checkpoint_dp2_resumes_at_dp1():
    saved = run_layout(dp=2, steps=6)
    _resume_matches(saved, dp=1)


def test_tp_that_does_not_divide_heads_is_a_clear_error():
    from nanochat.gpt import GPTConfig
    from nanochat.recipe import Setting

    def check(tp, **config):
        Setting(tp=tp, device_batch=1, total_batch=32).check(GPTConfig(sequence_len=32, n_embd=64, **config))
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the query heads \(n_head\) = 4; valid --tp values for this model: \[1, 2\]"):
        check(3, n_head=4, n_kv_head=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"key/value heads \(n_kv_head\) = 2"):
        check(4, n_head=4, n_kv_head=2, vocab_size=64)
    with pytest.raises(ValueError, match=r"vocabulary \(vocab_size\) = 65"):
        check(2, n_head=4, n_kv_head=4, vocab_size=65)


def test_pipeline_stage_split_and_schedule():
    import torch
    from nanochat.gpt import GPT
    from nanochat.recipe import config_for_depth
    from nanochat.pipeline_parallel import split_stages, block_costs, Pipeline
    from nanochat.recipe import Setting
    assert split_stages([1, 1, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    assert split_stages([1, 1, 1, 1], 2, 2) == [(0, 3), (3, 4)]  # the head weighs on the last stage
    assert split_stages([5, 1, 1, 1, 1, 1], 0, 2) == [(0, 1), (1, 6)]
    from nanochat.distributed import Layout

    def pipeline(m=8, schedule="1f1b", virtual=1, rank=0):
        """Pipeline rank `rank` of 4 at d12 with m micro-batches of one sequence, as setup builds it."""
        config = config_for_depth(12)
        setting = Setting(pp=4, pp_schedule=schedule, pp_virtual=virtual, device_batch=1,
                          total_batch=m * config.sequence_len)
        m = setting.check(config)
        with torch.device("meta"):
            model = GPT(config)
        return Pipeline(model, Layout(pp_size=4, pp_rank=rank), setting, m)
    with torch.device("meta"):
        costs, head = block_costs(GPT(config_for_depth(12)))
    assert len(costs) == 12 and head > costs[0]  # d12's lm_head costs more than a block
    text = pipeline().schedule_text()
    assert "stage 3:" in text and "idle at equal F/B times 0.273" in text
    first_row = text.splitlines()[1].split()[2:]
    assert first_row[:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]  # stage 0 warms up with p-1 = 3 forwards, then 1F1B
    interleaved = pipeline(schedule="interleaved", virtual=2, rank=1)
    assert sorted(interleaved.chunks) == [1, 5] and interleaved.schedule_text().splitlines()[2].split()[2] == "F0c1"
    assert interleaved.blocks == [i for c in (1, 5) for i in range(*interleaved.chunk_bounds[c])]
    for kwargs, message in ((dict(m=2), "at least pp=4 micro-batches"),
                            (dict(schedule="interleaved"), "interleaved needs --pp-virtual >= 2"),
                            (dict(schedule="gpipe", virtual=2), "interleaved needs --pp-virtual >= 2"),
                            (dict(schedule="interleaved", virtual=2, m=6), "6 micro-batches per step is no multiple"),
                            (dict(schedule="interleaved", virtual=4), "16 chunks is more than the 12 blocks"),
                            (dict(schedule="zb"), "unknown --pp-schedule 'zb'")):
        with pytest.raises(ValueError, match=message):
            pipeline(**kwargs)


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_schedules_in_time_and_their_messages(schedule, virtual):
    """Replayed at equal times, each schedule idles each rank the fraction its formula gives; the messages between
    two ranks are posted in one order on both (none waits on the other), with equal chunk costs and uneven ones."""
    from nanochat.pipeline_schedules import (idle_formula, message_order, output_chunk, peak_in_flight, simulate,
                                             stage_actions)
    p, m = 4, 8
    actions = [stage_actions(schedule, p, m, r, virtual) for r in range(p)]
    timeline = simulate(actions, lambda a: 1.0 / virtual)
    step = max(events[-1][2] for events in timeline)
    assert step == pytest.approx(2 * m + 2 * (p - 1) / virtual)
    for events in timeline:
        assert 1 - sum(end - start for _, start, end in events) / step == pytest.approx(idle_formula(schedule, p, m, virtual))
    assert peak_in_flight(actions) == {"gpipe": [8] * 4, "1f1b": [4, 3, 2, 1],
                                       "interleaved": [11, 9, 7, 5] if virtual == 2 else [19, 17, 15, 13]}[schedule]
    uneven = [1.0 + 0.37 * ((3 * c) % 5) for c in range(p * virtual)]  # as chunks of 3 and 4 blocks, a head
    for costs in (None, uneven):
        programs = [message_order(actions, r, costs) for r in range(p)]
        for a in range(p):
            for b in range(p):
                sent = [act for step_, act in programs[a] if step_ == "send" and output_chunk(act) % p == b]
                received = [act for step_, act in programs[b] if step_ == "recv" and act[2] % p == a]
                assert sent == received, (a, b, costs)
    # GPipe's critical path crosses each of the p-1 rank boundaries once each way: one message latency each
    if schedule == "gpipe":
        slow = simulate(actions, lambda a: 1.0, lambda a: 0.5)
        assert max(t[-1][2] for t in slow) == 22.0 + 2 * 3 * 0.5
    with pytest.raises(ValueError, match="wait on each other"):
        simulate([list(reversed(acts)) for acts in actions], lambda a: 1.0)


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
        x = torch.randn(2, 5, 16, requires_grad=True)
        targets = torch.randint(0, 64, (2, 5))
        targets[0, :2] = -1
        for t in (targets, torch.full_like(targets, -1)):
            for reduction in ("none", "sum", "mean"):
                mine = tp_loss(x, lm_head, t, reduction)
                ref = SoftcapCrossEntropy()(x, lm_head, t, reduction)
                assert mine.shape == ref.shape
                assert torch.allclose(mine, ref, atol=1e-5, equal_nan=True), (reduction, mine, ref)
        # and the gradients: the ignored targets' positions get none (their loss is masked out of the sum)
        grads = [torch.autograd.grad(loss(x, lm_head, targets, "sum"), (x, lm_head.weight))
                 for loss in (tp_loss, SoftcapCrossEntropy())]
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads)) and not grads[0][0][0, :2].any()
        assert tp_loss(x, lm_head, torch.full_like(targets, -1)).isnan()
    finally:
        dist.destroy_process_group()


def test_pp4_interleaved_ring():
    """Four stages, two chunks each: the last stage's first chunk feeds stage 0's second (the ring), each pair of
    neighbours on its own process group."""
    eight = {"n_layer": 8}
    assert_same_run(run_layout(pp=4, schedule="interleaved", virtual=2, config_overrides=eight),
                    run_layout(config_overrides=eight))


def _count_sent_tensors(rank, *args):
    """A harness rank that records, at every wait in the pipeline, how many of the tensors its sends posted are still
    alive (weak references) while it runs the layout as usual: the most at once, and the total, into out_dir."""
    import json
    import weakref
    import parallel_harness
    import nanochat.pipeline_parallel as pipeline
    sent, most, originals = [], [0], (pipeline.dist, pipeline.wait_for)

    def batch_isend_irecv(ops):
        sent.extend(weakref.ref(op.tensor) for op in ops if op.op is originals[0].isend)
        return originals[0].batch_isend_irecv(ops)

    def wait_for(requests, result=None):
        most[0] = max(most[0], sum(ref() is not None for ref in sent))
        return originals[1](requests, result)

    pipeline.dist = types.SimpleNamespace(**{**vars(originals[0]), "batch_isend_irecv": batch_isend_irecv})
    pipeline.wait_for = wait_for
    try:  # the pool's processes serve later runs: put the module back as it was
        parallel_harness._worker(rank, *args)
    finally:
        pipeline.dist, pipeline.wait_for = originals
    with open(os.path.join(args[7], f"sent{rank}.json"), "w") as f:
        json.dump({"most_alive": most[0], "sent": len(sent)}, f)


def test_a_stage_frees_each_send_once_a_later_message_from_its_peer_is_in():
    """Rank 0 of PP 2 sends only activations, rank 1 only gradients. A send is freed once a message its peer sent
    later has arrived (the pair's messages run in one order), not at the step's end: rank 0 holds at most the
    warm-up's and the current micro-batch's activations, rank 1 two micro-batches' gradients, not all four."""
    import json
    from parallel_harness import spawn, _new_run_dir, _free_port
    out_dir, steps = _new_run_dir(), 3
    spawn(_count_sent_tensors, (2, 1, 2, False, "1f1b", steps, _free_port(), out_dir, {}, None, True), 2)
    for rank, tensors in ((0, 3), (1, 2)):  # x, x0 and the ids; the gradients of x and x0
        with open(os.path.join(out_dir, f"sent{rank}.json")) as f:
            counts = json.load(f)
        evaluation = 4 * tensors if rank == 0 else 0  # the evaluation's four forwards
        assert counts["sent"] == steps * 4 * tensors + evaluation, counts
        assert counts["most_alive"] <= 2 * tensors, (rank, counts)
