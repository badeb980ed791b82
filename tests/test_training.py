"""The training schedules (nanochat.training.Schedule) against the recipe base_train prints: LR warmup,
flat, linear warmdown to final_lr_frac; Muon momentum 0.85 -> 0.97 over 400 steps, then -> 0.90 over the
warmdown; Muon weight decay cosine to 0. The step, setup and save are checked by tests/test_parallel.py
(whose harness runs them) and tests/test_train.py (base_train end to end)."""

import pytest
import torch

from nanochat.training import Schedule


def test_lr_multiplier_warms_up_holds_and_warms_down():
    s = Schedule(num_iterations=1000, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert s.lr_multiplier(0) == pytest.approx(0.1) and s.lr_multiplier(9) == 1.0
    assert s.lr_multiplier(10) == s.lr_multiplier(500) == 1.0  # the warmdown starts at step 500
    assert s.lr_multiplier(750) == pytest.approx(0.55)
    assert s.lr_multiplier(1000) == pytest.approx(0.1)


def test_a_warmup_that_runs_into_the_warmdown_takes_the_lower_multiplier():
    s = Schedule(num_iterations=50, weight_decay=0.2, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)
    lrm = [s.lr_multiplier(it) for it in range(50)]
    assert lrm[17] == pytest.approx(18 / 40)  # still warming up, under the warmdown's 0.93
    assert all(b <= a + 1e-12 for a, b in zip(lrm[30:], lrm[31:]))  # no jump back up after the two lines meet
    assert max(lrm) < 1.0


def test_muon_momentum_and_weight_decay():
    s = Schedule(num_iterations=1000, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert s.muon_momentum(0) == pytest.approx(0.85) and s.muon_momentum(200) == pytest.approx(0.91)
    assert s.muon_momentum(499) == pytest.approx(0.97) and s.muon_momentum(500) == pytest.approx(0.97)
    assert s.muon_momentum(1000) == pytest.approx(0.90)
    assert s.muon_weight_decay(0) == pytest.approx(0.2) and s.muon_weight_decay(500) == pytest.approx(0.1)
    assert s.muon_weight_decay(1000) == pytest.approx(0.0, abs=1e-12)


def test_grad_norms_are_the_norms_of_the_gradients_global_and_per_group():
    """MuonAdamW.grad_norms after a step: the global norm of every gradient, then each PARAM_GROUPS' (0 when absent),
    as read from the parameters before the step. The layouts' norms equal these (tests/test_parallel.py)."""
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.optim import PARAM_GROUPS, param_groups
    from nanochat.optim import MuonAdamW, muon_stacks
    from nanochat.data_parallel import DataParallel
    torch.manual_seed(0)
    model = build_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
    groups = param_groups(model, embedding_lr=0.01, unembedding_lr=0.004, matrix_lr=0.02, scalar_lr=0.02, weight_decay=0.0)
    dp = DataParallel([params for _, _, params in muon_stacks(groups)],  # one rank, as training.setup builds it
                      [p for g in groups if g["kind"] == "adamw" for p in g["params"]])
    optimizer = MuonAdamW(groups, {p: n for n, p in model.named_parameters()}, dp)
    x = torch.randint(0, 64, (2, 17))
    model(x[:, :-1], x[:, 1:]).backward()
    expected = torch.zeros(len(PARAM_GROUPS))
    for g in groups:
        expected[PARAM_GROUPS.index(g["name"])] = sum(p.grad.double().square().sum() for p in g["params"]).sqrt()
    optimizer.step()
    assert optimizer.grad_norms.shape == (1 + len(PARAM_GROUPS),)
    assert torch.allclose(optimizer.grad_norms[1:], expected, rtol=1e-5)
    assert torch.allclose(optimizer.grad_norms[0], expected.square().sum().sqrt(), rtol=1e-5)
    assert optimizer.grad_norms[PARAM_GROUPS.index("l3_tables") + 1] == 0 and optimizer.grad_norms[0] > 0


def test_tensors_whose_rows_data_parallelism_cannot_share_are_named():
    """An L3 table of 2^19 rows at DP 3 (or the token table at DP 6) stays whole on every rank: setup says so."""
    from nanochat.data_parallel import held_whole, owned_by_rows
    table, wte, gain = torch.empty(2 ** 19, 8), torch.empty(32768, 8), torch.empty(8)
    named = [("l3.5.key_table", table), ("wte.weight", wte), ("gain", gain)]
    assert held_whole(named, 1) == [] and held_whole(named, 4) == []
    assert held_whole(named, 3) == [("l3.5.key_table", 2 ** 19), ("wte.weight", 32768)]
    assert held_whole(named, 6) == [("l3.5.key_table", 2 ** 19), ("wte.weight", 32768)]
    assert all(owned_by_rows(t, 4) for t in (table, wte)) and not owned_by_rows(table, 3)


def test_core_and_sampling_run_blocks_compiled_in_place_eagerly():
    """Blocks compiled in place (overlapped reduction, sharded weights) would compile again at every new sequence length
    CORE and sampling bring (8 lengths, then dynamo's warning); Trainer.whole_model runs them eagerly."""
    from types import SimpleNamespace
    from torch._dynamo.utils import counters
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.training import Trainer, compile_for_training
    model = build_model(GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
    compile_for_training(model, None, True, "eager")
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    model(idx, idx).backward()  # training compiles the blocks
    trainer = SimpleNamespace(model=model, pipeline=None, setting=SimpleNamespace(sequence_parallel=False),
                              dp=SimpleNamespace(shard_params=False), layout=SimpleNamespace(ep_size=1))
    trainer.evaluating = lambda: Trainer.evaluating(trainer)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad(), Trainer.whole_model(trainer) as whole:
        losses = [whole(idx[:1, :T], idx[:1, 1:T + 1]) for T in range(5, 31, 5)]
    assert counters["stats"]["unique_graphs"] == graphs and all(torch.isfinite(loss) for loss in losses)
    assert model.training  # evaluating() restored training mode


def test_a_checkpoint_with_muons_state_not_finite_is_refused(tmp_path):
    """A diverged state is never saved: Muon's momentum lives in the optimizer's stacks, not in its .state, and was
    not looked at (a checkpoint with an infinite momentum was written and loaded)."""
    from nanochat import checkpoint_manager as ckpt
    from nanochat.distributed import compute_init
    from nanochat.gpt import GPTConfig
    from nanochat.recipe import LearningRates, Setting
    from nanochat import training
    layout, device = compute_init("cpu")
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    trainer = training.setup(config, Setting(device_batch=2, total_batch=64), layout, device, torch.float32,
                             LearningRates())
    _, _, stack = trainer.optimizer.muon_stacks[0]
    stack.momentum[0].view(-1)[0] = float("inf")
    with pytest.raises(ckpt.CheckpointError, match="the weights or the optimizer's state are not finite at step 3"):
        trainer.save_checkpoint(str(tmp_path), 3, None, {})
    assert not list(tmp_path.iterdir())
