"""Parameter sharding (--shard-params, ZeRO-3) against one process: the same losses, gradient norms and parameters
at DP 2 and 4, with the gathered weights freed after each module (gathered again for the backward) or kept; bitwise
the unsharded DP 2 run where the sums run in the same order; the bytes of weights, gradients and optimizer state
each rank holds, measured off its tensors, about 1/DP of one process's; composed with TP (+SP), PP, CP, recompute,
compile, fp8 and L3; checkpoints that move between sharded and unsharded layouts; and base_train over two ranks."""

import pytest
import torch

from parallel_harness import run_layout
from test_parallel import assert_same_run, _resume_matches
from test_parallel_l3 import L3, assert_same_l3_run
from test_plan import assert_planned


@pytest.fixture(scope="module")
def reference():
    return run_layout()


def test_sharded_dp2_and_dp4_match_one_process_and_hold_a_dp_th(reference):
    """DP 2 (the gathered weights freed after each module, or kept) and DP 4 train as one process does. Each rank
    holds 1/DP of one process's weights, gradients and optimizer state, measured off its tensors, but for the small
    AdamW tensors every rank keeps whole and the uneven share of a stack of matrices that does not divide by DP;
    exactly what the planner counts. The most whole-weight bytes alive at once (measured off the gathered tensors'
    storage): freed, a few modules' worth; kept, every module's from the forward to its backward. (One test, so that
    the three runs are made once under pytest-xdist.)"""
    runs = {(dp, keep): run_layout(dp=dp, shard_params=True, keep_gathered=keep) for dp, keep in [(2, False), (2, True), (4, False)]}
    whole = reference["held"][0]
    for (dp, keep), run in runs.items():
        assert_same_run(run, reference)
        assert_planned(run, dp=dp, shard_params=True, keep_gathered=keep)
        for rank, held in enumerate(run["held"]):
            for kind in ("weights", "gradients", "state"):
                assert abs(held[kind] / whole[kind] - 1 / dp) < 0.04, (dp, rank, kind, held[kind], whole[kind])
    whole_bytes = sum(t.numel() * 4 for name, t in reference["params"].items()
                      if not ("lambda" in name or "smear_gate" in name))
    assert runs[2, False]["gathered_peak"] <= 0.6 * whole_bytes, (runs[2, False]["gathered_peak"], whole_bytes)
    assert runs[2, True]["gathered_peak"] >= 0.9 * whole_bytes, (runs[2, True]["gathered_peak"], whole_bytes)


def test_one_process_holds_what_the_planner_counts(reference):
    assert_planned(reference)


def test_sharded_dp2_is_bitwise_the_unsharded_dp2():
    """One micro-batch per rank: each gradient is summed over the two ranks once, as the unsharded run sums it
    (a + b either way), and every update is the same arithmetic on the same numbers."""
    sharded = run_layout(dp=2, micro_batch=4, shard_params=True)
    plain = run_layout(dp=2, micro_batch=4)
    assert sharded["losses"] == plain["losses"]
    for name, p in plain["params"].items():
        assert torch.equal(sharded["params"][name], p), name
    assert_planned(plain, dp=2, micro_batch=4)


def test_sharded_sums_in_bf16_follow_the_unsharded_fp32_sums():
    """In bf16 a sharded rank sums each micro-batch's gradients over DP in bf16, as they were made (plain DP sums
    its fp32 accumulations, bitwise one process's): the losses and Muon's matrices stay within bf16's rounding of
    the unsharded run's (Adam's tables, which turn rounding in near-zero gradients into whole steps, are not
    compared)."""
    sharded = run_layout(dp=2, shard_params=True, dtype="bfloat16")
    plain = run_layout(dp=2, dtype="bfloat16")
    assert max(abs(a - b) for a, b in zip(sharded["losses"], plain["losses"])) < 1e-3, (sharded["losses"], plain["losses"])
    for name, p in plain["params"].items():
        assert sharded["params"][name].dtype == torch.float32, name
        if p.ndim == 2 and name.startswith("blocks.") and "value_embed" not in name:
            assert (sharded["params"][name] - p).abs().max() < 5e-3, name


@pytest.mark.parametrize("layout", [dict(tp=2, sequence_parallel=True), dict(pp=2, schedule="interleaved", virtual=2),
                                    dict(cp=2)], ids=["tp2_sp", "pp2_interleaved", "cp2"])
def test_sharded_dp2_composes(reference, layout):
    run = run_layout(dp=2, shard_params=True, **layout)
    assert_same_run(run, reference)
    assert_planned(run, dp=2, shard_params=True, **layout)


@pytest.mark.parametrize("recompute, compile_backend, keep", [("selective", None, True), ("block", "aot_eager", False)])
def test_sharded_with_recompute_and_compile(reference, recompute, compile_backend, keep):
    """Recompute runs a block's forward again in its backward, with its whole weights put back in place; compiled,
    each block is its own graph and the gathers run between them, with no recompile after the first step."""
    run = run_layout(dp=2, shard_params=True, keep_gathered=keep, recompute=recompute or "none",
                     compile_backend=compile_backend)
    assert_same_run(run, reference)
    if compile_backend:
        assert len(set(run["graphs"][0])) == 1, run["graphs"]


def test_kept_weights_but_the_tables_and_the_plan_counts_them():
    """--keep-gathered keeps each module's weights from its forward to its backward, but not the embedding tables (a
    recomputed lookup gathers its table again); the planner counts what is kept and the table of the block in its
    call. With value embeddings a large share of the weights (vocabulary 1,024), the peak stays within the plan's 10%."""
    wide = dict(vocab_size=1024)
    for recompute in ("none", "block"):
        run = run_layout(dp=2, steps=2, shard_params=True, keep_gathered=True, recompute=recompute, config_overrides=wide)
        assert_planned(run, dp=2, shard_params=True, keep_gathered=True, recompute=recompute, config_overrides=wide)


def test_kept_weights_under_interleaving_are_each_chunk_s_own():
    """Interleaved, a chunk's micro-batch in flight keeps that chunk's weights gathered, not the whole stage's: the
    planner counts each chunk's (it counted the stage's for every one, 1.6x the peak)."""
    layout = dict(dp=2, pp=2, micro_batch=1, shard_params=True, keep_gathered=True, schedule="interleaved", virtual=2)
    assert_planned(run_layout(steps=1, **layout), **layout)


def test_sharded_fp8():
    from test_fp8_parallel import FP8, assert_same_fp8_run
    assert_same_fp8_run(run_layout(dp=2, steps=4, config_overrides=FP8, fp8=True, shard_params=True),
                        run_layout(steps=4, config_overrides=FP8, fp8=True))


def test_sharded_l3():  # the tables by rows over DP, gathered around their layer like the blocks' weights
    assert_same_l3_run(run_layout(dp=2, shard_params=True, config_overrides=L3), run_layout(config_overrides=L3))


def test_sharded_dp4_resumes_at_dp1_and_at_sharded_dp2():
    saved = run_layout(dp=4, steps=6, shard_params=True)
    _resume_matches(saved, dp=1)
    _resume_matches(saved, dp=2, shard_params=True)  # into shards of another size


def test_base_train_shard_params_over_two_ranks(env):
    """base_train itself: --shard-params over two ranks trains, saves, and
    resumes unsharded (the same two ranks, so the same batches) with the losses it would have had."""
    from conftest import run_script, run_losses, TINY_MODEL
    args = TINY_MODEL + ["--device-batch-size", "2", "--total-batch-size", "256", "--warmup-steps", "2",
                         "--num-iterations", "4", "--save-every", "2", "--model-tag", "sharded", "--eval-every", "4"]
    full = run_script("scripts.base_train", args + ["--shard-params"], env, nproc=2)
    assert "weights sharded over 2 data-parallel ranks" in full.stdout, full.stdout[-2000:]
    losses = run_losses(env, "sharded")
    run_script("scripts.base_train", args + ["--resume-from-step", "2"], env, nproc=2)
    again = run_losses(env, "sharded")
    for s in (2, 3):
        assert abs(again[s] - losses[s]) <= 1e-4 * losses[s], (s, again[s], losses[s])
