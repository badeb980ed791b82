"""Compiled pipeline stages (training.compile_for_training: each stage's blocks one graph, the loss
another) against eager ones and one process, in every schedule, with
recompute too: the same losses and
parameters within rounding (compiled graphs decompose and reorder some ops, e.g. rms_norm), and no graph
compiled after the first step (the micro-batches all have one shape, so one compile serves the run).
torch.compile runs with backend aot_eager: the same capture, guards and autograd split as inductor, without
its code generation, which takes the CPU tens of seconds per stage."""

import pytest
import torch

from parallel_harness import run_layout


@pytest.fixture(scope="module")
def eager_pp2():
    return run_layout(pp=2, steps=3)


@pytest.fixture(scope="module")
def one_process():
    return run_layout(steps=3)


def assert_close_runs(run, ref, tol):
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) <= tol, (run["losses"], ref["losses"])
    assert run["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        torch.testing.assert_close(run["params"][name], p, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("schedule, virtual, recompute", [("1f1b", 1, "none"), ("gpipe", 1, "block"),
                                                          ("interleaved", 2, "block")])
def test_compiled_pp2_matches_eager_pp2_without_recompiles(eager_pp2, one_process, schedule, virtual, recompute):
    run = run_layout(pp=2, steps=3, schedule=schedule, virtual=virtual, recompute=recompute,
                     compile_backend="aot_eager")
    assert_close_runs(run, eager_pp2, 1e-5)
    assert_close_runs(run, one_process, 1e-4)  # test_parallel's tolerance for PP=2 against one process
    for stage, graphs in enumerate(run["graphs"]):
        # the stage's blocks and the loss (last stage) compile in the first step, and nothing after
        assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, (stage, graphs)
