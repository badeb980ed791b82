"""The training schedules (nanochat.training.Schedule) against the recipe base_train prints: LR warmup,
flat, linear warmdown to final_lr_frac; Muon momentum 0.85 -> 0.97 over 400 steps, then -> 0.90 over the
warmdown; Muon weight decay cosine to 0. The step, setup and save are checked by tests/test_parallel.py
(whose harness runs them) and tests/test_train.py (base_train end to end)."""

import pytest

from nanochat.training import Schedule


def test_lr_multiplier_warms_up_holds_and_warms_down():
    s = Schedule(num_iterations=1000, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert s.lr_multiplier(0) == pytest.approx(0.1) and s.lr_multiplier(9) == 1.0
    assert s.lr_multiplier(10) == s.lr_multiplier(500) == 1.0  # the warmdown starts at step 500
    assert s.lr_multiplier(750) == pytest.approx(0.55)
    assert s.lr_multiplier(1000) == pytest.approx(0.1)


def test_muon_momentum_and_weight_decay():
    s = Schedule(num_iterations=1000, weight_decay=0.2, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert s.muon_momentum(0) == pytest.approx(0.85) and s.muon_momentum(200) == pytest.approx(0.91)
    assert s.muon_momentum(499) == pytest.approx(0.97) and s.muon_momentum(500) == pytest.approx(0.97)
    assert s.muon_momentum(1000) == pytest.approx(0.90)
    assert s.muon_weight_decay(0) == pytest.approx(0.2) and s.muon_weight_decay(500) == pytest.approx(0.1)
    assert s.muon_weight_decay(1000) == pytest.approx(0.0, abs=1e-12)
