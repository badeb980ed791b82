"""The training schedules (nanochat.training.Schedule) against the recipe base_train prints: LR warmup,
flat, linear warmdown to final_lr_frac; Muon momentum 0.85 -> 0.97 over 400 steps, then -> 0.90 over the
warmdown; Muon weight decay cosine to 0; the step putting them into each group. MuonAdamW's update rules and the
recipe's formulas against the same written out here. The layouts are checked against one process by
tests/test_parallel.py (whose harness runs setup and the step) and base_train end to end by tests/test_train.py."""

import math

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


def test_a_decay_that_would_flip_weights_is_warned_about():
    """The recipe's decay grows as D_ref / D: at a tiny horizon LR x decay passes 1 (a decay step overshoots zero)."""
    assert Schedule(num_iterations=5000, weight_decay=0.28).notes(0.02) == []
    tiny = Schedule(num_iterations=10, weight_decay=70.0, warmup_steps=0)
    assert tiny.notes(0.02) == ["WARNING: Muon's LR x weight decay reaches 1.40 at step 0 (the recipe's decay grows as "
                                "the horizon shrinks): a decay step can flip weights' signs; lower --weight-decay"]
    assert Schedule(num_iterations=10, weight_decay=70.0, warmup_steps=40).notes(0.02)[1:] == []  # under warmup: 0.2


def test_muon_momentum_and_weight_decay():
    s = Schedule(num_iterations=1000, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert s.muon_momentum(0) == pytest.approx(0.85) and s.muon_momentum(200) == pytest.approx(0.91)
    assert s.muon_momentum(499) == pytest.approx(0.97) and s.muon_momentum(500) == pytest.approx(0.97)
    assert s.muon_momentum(1000) == pytest.approx(0.90)
    assert s.muon_weight_decay(0) == pytest.approx(0.2) and s.muon_weight_decay(500) == pytest.approx(0.1)
    assert s.muon_weight_decay(1000) == pytest.approx(0.0, abs=1e-12)
    assert s.muon_weight_decay(250) == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)))  # a cosine, not a line
    early = Schedule(num_iterations=600, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5)  # warmdown from 300
    assert early.muon_momentum(300) == pytest.approx(0.94)  # the rise stops where the warmdown starts
    assert early.muon_momentum(450) == pytest.approx(0.92)  # and falls from there to 0.90


def test_a_step_sets_each_groups_lr_momentum_and_decay():
    """Trainer.step puts the schedule's step into the optimizer: every group's LR times the multiplier, Muon's
    momentum and weight decay; the AdamW groups keep no decay."""
    from nanochat import training
    from nanochat.gpt import GPTConfig
    from nanochat.distributed import build_layout
    from nanochat.recipe import Setting, LearningRates
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    trainer = training.setup(config, Setting(device_batch=1, total_batch=16), build_layout(0, 1, 0),
                             torch.device("cpu"), torch.float32, LearningRates())
    schedule, it = Schedule(num_iterations=100, weight_decay=0.3, warmup_steps=2, warmdown_ratio=0.5), 80
    x = torch.randint(0, 64, (1, 17))
    trainer.step([(x[:, :-1], x[:, 1:])], schedule, it)
    kinds = set()
    for g in trainer.optimizer.param_groups:
        kinds.add(g["kind"])
        assert g["lr"] == pytest.approx(g["initial_lr"] * schedule.lr_multiplier(it)) and schedule.lr_multiplier(it) < 1
        if g["kind"] == "muon":
            assert g["momentum"] == pytest.approx(schedule.muon_momentum(it))
            assert g["weight_decay"] == pytest.approx(schedule.muon_weight_decay(it))
        else:
            assert g["weight_decay"] == 0.0
    assert kinds == {"muon", "adamw"}


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


def test_an_optimizer_state_lacking_a_parameter_is_refused_by_name_before_any_state_changes():
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.optim import param_groups, MuonAdamW, muon_stacks
    from nanochat.data_parallel import DataParallel
    from nanochat.common import UserError
    model = build_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
    groups = param_groups(model, embedding_lr=0.01, unembedding_lr=0.004, matrix_lr=0.02, scalar_lr=0.02, weight_decay=0.0)
    dp = DataParallel([params for _, _, params in muon_stacks(groups)],
                      [p for g in groups if g["kind"] == "adamw" for p in g["params"]])
    optimizer = MuonAdamW(groups, {p: n for n, p in model.named_parameters()}, dp)
    state = optimizer.full_state_dict()
    for name in ("blocks.1.mlp.c_fc.weight", "wte.weight"):  # a Muon matrix, an AdamW table
        damaged = {"adamw_step": 7, "params": {k: v for k, v in state["params"].items() if k != name}}
        with pytest.raises(UserError, match=rf"no entry for 1 of the model's parameters \({name}\)"):
            optimizer.load_full_state_dict(damaged)
        assert optimizer.adamw_step == 0


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


def test_a_prune_that_fails_after_a_save_is_a_warning(tmp_path, monkeypatch, capsys):
    """The new step is saved when the older ones are pruned: a prune that fails leaves a warning, not a stopped run."""
    from nanochat import checkpoint_manager as ckpt
    from nanochat.distributed import compute_init
    from nanochat.gpt import GPTConfig
    from nanochat.recipe import LearningRates, Setting
    from nanochat import training
    layout, device = compute_init("cpu")
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    trainer = training.setup(config, Setting(device_batch=2, total_batch=64), layout, device, torch.float32,
                             LearningRates())
    trainer.save_checkpoint(str(tmp_path), 1, None, {})

    def refuse(*_):
        raise PermissionError("read-only")
    monkeypatch.setattr(ckpt, "prune_checkpoints", refuse)
    trainer.save_checkpoint(str(tmp_path), 2, None, {}, keep_last=1)
    assert ckpt.saved_steps(str(tmp_path)) == [1, 2] and "could not delete an older checkpoint" in capsys.readouterr().out


def reference_muon(w, g, momentum_buf, second_buf, lr, mu, wd):
    """optim.py's docstring, steps 1-6, on one matrix, written out here (fp32): returns the new weight."""
    from nanochat.optim import POLAR_EXPRESS_COEFFS, NORMUON_BETA2, NORMUON_EPS
    momentum_buf.mul_(mu).add_((1 - mu) * g)  # 1. Nesterov
    u = (1 - mu) * g + mu * momentum_buf
    rows = u.norm(dim=1, keepdim=True)  # 2. every row to the mean row norm
    u = u * rows.mean() / (rows + 1e-7)
    x = u.T if u.shape[0] > u.shape[1] else u  # 3. Polar Express, on the wide orientation
    x = x / (x.norm() * 1.01 + 1e-7)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    u = x.T if u.shape[0] > u.shape[1] else x
    norm = min(u.shape) ** 0.5  # 4. Frobenius norm sqrt(min(rows, cols))
    u = u * norm / (u.norm() + 1e-7)
    second_buf.mul_(NORMUON_BETA2).add_((1 - NORMUON_BETA2) * u.square().mean(dim=1, keepdim=True))  # 5. NorMuon
    u = u / (second_buf.sqrt() + NORMUON_EPS)
    u = u * norm / (u.norm() + 1e-7)
    scale = max(1.0, w.shape[0] / w.shape[1]) ** 0.5  # 6. apply, with cautious weight decay
    return w - lr * scale * u - lr * wd * ((u * w) > 0) * w


def test_two_steps_follow_the_update_rules():
    """MuonAdamW's first two steps against the rules written out independently: torch.optim.AdamW (betas 0.8, 0.95,
    eps 1e-10, bias-corrected) for the AdamW groups, optim.py's docstring for Muon (with weight decay, so that its
    sign rule counts). The layouts' tests only compare the optimizer with itself."""
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.optim import param_groups, MuonAdamW, muon_stacks
    from nanochat.data_parallel import DataParallel
    torch.manual_seed(0)
    model = build_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
    groups = param_groups(model, embedding_lr=0.01, unembedding_lr=0.004, matrix_lr=0.02, scalar_lr=0.02, weight_decay=0.3)
    dp = DataParallel([params for _, _, params in muon_stacks(groups)],
                      [p for g in groups if g["kind"] == "adamw" for p in g["params"]])
    optimizer = MuonAdamW(groups, {p: n for n, p in model.named_parameters()}, dp)
    copies = {p: p.detach().clone().requires_grad_(True) for g in groups for p in g["params"]}
    adamw = torch.optim.AdamW([dict(params=[copies[p] for p in g["params"]], lr=g["lr"]) for g in groups
                               if g["kind"] == "adamw"], betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    dim_scale = (32 / 768) ** -0.5  # the embeddings' and lm_head's AdamW LRs scale with the width (param_groups)
    assert {g["name"]: (g["kind"], g["lr"], g["weight_decay"]) for g in groups} == {
        "embeddings": ("adamw", 0.01 * dim_scale, 0.0), "lm_head": ("adamw", 0.004 * dim_scale, 0.0),
        "scalars": ("adamw", 0.02, 0.0), "matrices": ("muon", 0.02, 0.3)}
    muon = [(g, p) for g in groups if g["kind"] == "muon" for p in g["params"]]
    state = {p: (torch.zeros_like(p), torch.zeros(p.shape[0], 1)) for _, p in muon}
    for _ in range(2):
        for p, c in copies.items():
            p.grad = torch.randn_like(p)
            c.grad = p.grad.clone()
        optimizer.step()
        adamw.step()
        with torch.no_grad():
            for g, p in muon:
                copies[p].copy_(reference_muon(copies[p], p.grad, *state[p], g["lr"], g["momentum"], g["weight_decay"]))
        for p, c in copies.items():
            torch.testing.assert_close(p.detach(), c.detach(), rtol=1e-5, atol=1e-6)


def test_the_recipe_follows_its_formulas():
    """derive_recipe against recipe.py's formulas computed here, at d26 (a batch above 2^19, a horizon unlike d12's):
    Power Lines' batch from D_opt / D_ref, the horizon, the LR scale sqrt(B / 2^19), Muon's decay wd * scale * D_ref / D,
    and every base LR scaled alike."""
    from nanochat.gpt import GPT
    from nanochat.recipe import parse_args, model_config, derive_recipe, config_for_depth, LearningRates
    args = parse_args(["--depth", "26", "--max-seq-len", "2048"])
    with torch.device("meta"):
        n = GPT(model_config(args, 32768)).num_scaling_params()
        n12 = GPT(config_for_depth(12, vocab_size=32768, sequence_len=2048)).num_scaling_params()
    ratio = args.target_param_data_ratio
    batch = 2 ** round(math.log2(2 ** 19 * (n / n12) ** 0.383))
    steps = round(ratio * n / batch)
    scale = math.sqrt(batch / 2 ** 19)
    recipe = derive_recipe(args, model_config(args, 32768))
    assert (recipe.total_batch_size, recipe.num_iterations) == (batch, steps) and batch > 2 ** 19
    assert recipe.lr_scale == pytest.approx(scale)
    assert recipe.weight_decay == pytest.approx(0.28 * scale * ratio * n12 / (steps * batch))
    base, lrs = LearningRates(), recipe.learning_rates(args)
    assert [lrs.embedding_lr, lrs.unembedding_lr, lrs.matrix_lr, lrs.scalar_lr, lrs.weight_decay] == pytest.approx(
        [base.embedding_lr * scale, base.unembedding_lr * scale, base.matrix_lr * scale, base.scalar_lr * scale,
         recipe.weight_decay])
    assert lrs.l3_table_lr is None  # the embeddings' LR, which optim.param_groups gives the tables (test_l3)
    assert recipe.learning_rates(parse_args(["--l3-table-lr", "0.05"])).l3_table_lr == pytest.approx(0.05 * scale)
