"""Bits per byte (nanochat/loss_eval.py) against a hand computation."""

import math

import torch

from nanochat.loss_eval import evaluate_bpb


def test_bpb_equals_hand_computation():
    # token id -> bytes: 0 is a special token (no bytes), the others 1..4 bytes
    token_bytes = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    y1 = torch.tensor([[1, 2, 0], [4, -1, 3]])  # -1: ignored target
    y2 = torch.tensor([[2, 2, 2], [0, 0, 1]])
    losses = {id(y1): torch.tensor([[0.5, 1.0, 9.0], [2.0, 7.0, 1.5]]),
              id(y2): torch.tensor([[1.0, 1.0, 1.0], [8.0, 8.0, 0.25]])}
    batches = iter([(None, y1), (None, y2)])
    bpb = evaluate_bpb(lambda x, y: losses[id(y)], batches, 2, token_bytes)
    # counted: (1: 0.5 nats, 1 B) (2: 1.0, 2 B) (4: 2.0, 4 B) (3: 1.5, 3 B) (2,2,2: 3.0, 6 B) (1: 0.25, 1 B)
    nats = 0.5 + 1.0 + 2.0 + 1.5 + 3.0 + 0.25
    nbytes = 1 + 2 + 4 + 3 + 6 + 1
    assert math.isclose(bpb, nats / (math.log(2) * nbytes), rel_tol=1e-12)


def test_ignored_targets_count_no_bytes():
    """An ignored target (-1) adds no bytes, whatever token 0's length (the real tokenizer's id 0 is a byte)."""
    token_bytes = torch.tensor([3, 1, 0], dtype=torch.int32)  # 2: a special token
    y = torch.tensor([[0, -1, 1, 2]])
    bpb = evaluate_bpb(lambda x, y: torch.tensor([[1.0, 0.0, 2.0, 5.0]]), iter([(None, y)]), 1, token_bytes)
    assert math.isclose(bpb, 3.0 / (math.log(2) * 4), rel_tol=1e-12)


def test_bpb_reads_only_the_steps_asked_for_and_skips_stages_without_the_head():
    token_bytes = torch.tensor([0, 2], dtype=torch.int32)
    y = torch.tensor([[1, 1]])
    batches = iter([(None, y)] * 3)
    calls = []

    def loss_fn(x, y):
        calls.append(1)
        return None if len(calls) == 2 else torch.tensor([[1.0, 3.0]])  # the 2nd: a stage without the head

    bpb = evaluate_bpb(loss_fn, batches, 2, token_bytes)
    assert len(calls) == 2 and next(batches) is not None  # the third batch was left unread
    assert math.isclose(bpb, 4.0 / (math.log(2) * 4))


def test_bpb_without_bytes_is_infinite():
    token_bytes = torch.tensor([0, 1], dtype=torch.int32)
    bpb = evaluate_bpb(lambda x, y: torch.ones(2), iter([(None, torch.tensor([0, -1]))]), 1, token_bytes)
    assert bpb == float("inf")


def test_a_split_read_past_its_end_is_said(tokenizer, capsys, monkeypatch):
    """More batches than the split holds: the loader goes round again, and the evaluation says so (once)."""
    from nanochat import loss_eval
    from nanochat.dataloader import DataLoader
    monkeypatch.setattr(loss_eval, "_WRAPPED", set())  # said once a process: maybe already, by another test
    from nanochat.tokenizer import get_token_bytes
    token_bytes = get_token_bytes(directory=tokenizer.directory)
    zeros = lambda x, y: torch.zeros(y.shape)  # noqa: E731
    for steps, said in ((2, False), (400, True), (400, False)):  # the sample's val split: ~70 rows of 256 tokens
        loader = DataLoader(tokenizer, 4, 256, "val", "cpu")
        evaluate_bpb(zeros, loader, steps, token_bytes, label="val bpb")
        loader.close()
        assert ("NOTICE: val bpb: the split holds fewer than the 400 batches" in capsys.readouterr().out) == said
