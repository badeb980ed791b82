"""CORE (nanochat/core_eval.py): each task type scored as the protocol says, on hand-made tasks and a
toy model whose answers are known; centering and the CORE mean; missing tasks; few-shot sampling;
left truncation; padding; finding and downloading the bundle."""

import os
import math
import json
import shutil
import zipfile
import threading
import http.server
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn as nn

from nanochat.core_eval import (Task, EvalBundleError, evaluate_task, evaluate_core, evaluate_core_for_training,
                                fewshot_indices, render_item, continuation_starts, prepare_items, score_rows,
                                centered_accuracy, core_score, find_eval_bundle, load_bundle, is_bundle)
from test_engine import random_gpt

V = 128  # character ids: ord(c), all of the test text is ASCII
BOS = 0


class CharTokenizer:
    """One token per character (its code point), <|bos|> = 0."""

    def get_bos_token_id(self):
        return BOS

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        return ([prepend] if prepend is not None else []) + [ord(c) for c in text]


class NextCharModel(nn.Module):
    """Predicts, with near certainty, that character c is followed by chr(ord(c) + 1): 'a' -> 'b'.
    A continuation token costs ~0 nats where it follows that rule and ~20 where it does not.
    Remembers the shape of every batch it sees."""

    def __init__(self, sequence_len=256):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=sequence_len)
        self.shapes = []

    def forward(self, idx, positions=None):
        self.shapes.append(tuple(idx.shape))
        logits = 20.0 * nn.functional.one_hot((idx + 1) % V, V).float()
        return logits if positions is None else logits[positions]


class SpaceAfterX(NextCharModel):
    """NextCharModel, but 'x' is followed by ' ' (the delimiter of language-modeling tasks)."""

    def forward(self, idx, positions=None):
        logits = 20.0 * nn.functional.one_hot(torch.where(idx == ord("x"), ord(" "), (idx + 1) % V), V).float()
        return logits if positions is None else logits[positions]


def task(task_type, num_fewshot=0, delimiter="", baseline=0.25, label="t"):
    return Task(label, task_type, num_fewshot, delimiter, baseline, f"/nonexistent/{label}.jsonl")


def accuracy(task_, records, model=None, **kw):
    acc, _ = evaluate_task(model or NextCharModel(), CharTokenizer(), task_, records, "cpu", **kw)
    return acc


# -----------------------------------------------------------------------------
# Scoring, per task type


def test_multiple_choice_lowest_mean_loss_wins():
    mc = task("multiple_choice")
    right = {"query": "a", "choices": ["bc", "bd", "xy"], "gold": 0}  # "bc" continues a -> b -> c
    wrong = {"query": "a", "choices": ["xy", "bcd"], "gold": 0}  # the model prefers "bcd"
    assert accuracy(mc, [right]) == 1.0
    assert accuracy(mc, [wrong]) == 0.0
    assert accuracy(mc, [right, wrong, right]) == pytest.approx(2 / 3)


def test_multiple_choice_scores_the_mean_not_the_sum():
    # after the shared "b": "cdeX" has 1 bad token of 4 (mean ~5 nats), "X" 1 of 1 (mean ~20); equal sums
    mc = task("multiple_choice")
    assert accuracy(mc, [{"query": "a", "choices": ["bX", "bcdeX"], "gold": 1}]) == 1.0


def test_schema_lowest_loss_on_the_shared_continuation_wins():
    schema = task("schema")
    right = {"context_options": ["a", "x"], "continuation": "bc", "gold": 0}  # a -> b fits, x -> b does not
    wrong = {"context_options": ["a", "x"], "continuation": "bc", "gold": 1}
    assert accuracy(schema, [right]) == 1.0
    assert accuracy(schema, [wrong]) == 0.0


def test_language_modeling_needs_every_greedy_token():
    lm = task("language_modeling", delimiter=" ", baseline=0.0)
    # the delimiter ' ' (32), a token of its own here, is scored with the continuation: after 'x' the model must
    # continue ' ', '!' (33), '"' (34), '#' (35)
    assert accuracy(lm, [{"context": "x", "continuation": "!\"#"}], model=SpaceAfterX()) == 1.0
    assert accuracy(lm, [{"context": "x", "continuation": "!\"#"}]) == 0.0  # 'x' -> 'y': the space is wrong
    assert accuracy(lm, [{"context": "x", "continuation": "!\"$"}], model=SpaceAfterX()) == 0.0  # the last token
    assert accuracy(lm, [{"context": "x", "continuation": "?\"#"}], model=SpaceAfterX()) == 0.0  # the first one


def test_continuation_tokens_by_task_type():
    rows = [np.array(r) for r in ([0, 5, 6, 7], [0, 5, 6, 8, 9])]
    assert continuation_starts("multiple_choice", rows) == [3, 3]  # after the shared prefix
    rows = [np.array(r) for r in ([0, 2, 3, 9, 9], [0, 4, 9, 9])]
    assert continuation_starts("schema", rows) == [3, 2]  # the shared suffix
    # the context's last token merged into the continuation's first (" " + "Paris" -> " Paris")
    assert continuation_starts("language_modeling", [np.array([0, 1, 2, 7])], np.array([0, 1, 2, 3])) == [3]
    assert continuation_starts("language_modeling", [np.array([0, 1, 7])], np.array([0, 1, 3])) == [2]
    # identical options still score one token
    assert continuation_starts("multiple_choice", [np.array([0, 1, 2])] * 2) == [2, 2]


def test_delimiter_goes_between_context_and_continuation():
    t = task("multiple_choice", delimiter="\nAnswer: ")
    texts, _, gold = render_item(t, [{"query": "Q?", "choices": ["yes", "no"], "gold": 1}], 0)
    assert texts == ["Q?\nAnswer: yes", "Q?\nAnswer: no"] and gold == 1
    t = task("schema", delimiter=" ")
    texts, _, _ = render_item(t, [{"context_options": ["A", "B"], "continuation": "ran.", "gold": 0}], 0)
    assert texts == ["A ran.", "B ran."]
    t = task("language_modeling", delimiter=" ")
    texts, context, _ = render_item(t, [{"context": "The sky is", "continuation": "blue"}], 0)
    assert texts == ["The sky is blue"] and context == "The sky is"  # the space is scored with "blue"


# -----------------------------------------------------------------------------
# Few-shot


def test_fewshot_excludes_the_item_and_is_reproducible():
    for idx in (0, 7, 99):
        shots = fewshot_indices(idx, 100, 10)
        assert len(shots) == len(set(shots)) == 10
        assert idx not in shots and all(0 <= j < 100 for j in shots)
        assert fewshot_indices(idx, 100, 10) == shots
    assert fewshot_indices(3, 100, 10) != fewshot_indices(4, 100, 10)
    assert sorted(fewshot_indices(4, 11, 10)) == [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]  # all the others
    assert sorted(fewshot_indices(1, 3, 10)) == [0, 2]  # fewer items than shots: all the others
    assert fewshot_indices(5, 100, 0) == []


def test_fewshot_prompt_is_correct_examples_then_the_item():
    records = [{"query": f"q{i}", "choices": [f"w{i}", f"r{i}"], "gold": 1} for i in range(20)]
    t = task("multiple_choice", num_fewshot=3, delimiter=" ")
    texts, _, _ = render_item(t, records, 5)
    demos = [f"q{j} r{j}" for j in fewshot_indices(5, 20, 3)]
    assert texts == ["\n\n".join(demos + [f"q5 {c}"]) for c in ("w5", "r5")]


def test_fewshot_prompts_do_not_change_what_is_scored():
    # the toy model looks one token back, so with or without demonstrations the same answers win
    records = [{"query": "a", "choices": ["bc", "xy"], "gold": i % 2} for i in range(10)]
    assert accuracy(task("multiple_choice", num_fewshot=3), records) == accuracy(task("multiple_choice"), records) == 0.5


# -----------------------------------------------------------------------------
# Truncation and batching


def test_left_truncation_keeps_the_continuation():
    lm = task("language_modeling")
    tok = CharTokenizer()
    records = [{"context": "abcdefghijklmnop", "continuation": "qr"}]
    [item] = prepare_items(lm, [{"context": "ab", "continuation": "c"}], [0], tok, max_len=8)
    assert item.rows[0].tolist() == [tok.get_bos_token_id()] + [ord(c) for c in "abc"]  # rows start as documents do
    [item] = prepare_items(lm, records, [0], tok, max_len=8)
    assert "".join(map(chr, item.rows[0])) == "klmnopqr" and item.starts == [6]
    assert accuracy(lm, records, NextCharModel(sequence_len=8)) == 1.0
    # a continuation longer than the window keeps its end (its first tokens lose their context)
    [item] = prepare_items(lm, [{"context": "ab", "continuation": "cdefghijklmn"}], [0], tok, max_len=8)
    assert "".join(map(chr, item.rows[0])) == "ghijklmn" and item.starts == [1]
    # multiple choice: every option keeps its own end
    mc = task("multiple_choice")
    [item] = prepare_items(mc, [{"query": "0123456789", "choices": ["ab", "xyz"], "gold": 0}], [0], tok, max_len=6)
    assert ["".join(map(chr, r)) for r in item.rows] == ["6789ab", "789xyz"] and item.starts == [4, 3]


def test_options_of_an_item_share_one_forward_pass():
    mc = task("multiple_choice")
    records = [{"query": "a" * (i + 1), "choices": ["b", "c", "d"], "gold": 0} for i in range(5)]
    model = NextCharModel()
    assert accuracy(mc, records, model, batch_tokens=1) == 1.0
    assert [s[0] for s in model.shapes] == [3] * 5  # one pass per item, all three options in it
    model = NextCharModel()
    assert accuracy(mc, records, model) == 1.0
    assert [s[0] for s in model.shapes] == [15]  # short items share a pass


def test_padding_does_not_change_scores():
    torch.manual_seed(0)
    model = random_gpt(sequence_len=64, vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    tok = CharTokenizer()
    texts = ["hi", "a longer row of text", "mid size", "x", "the longest row of all in this batch"]
    rows = [np.array(tok.encode(t, prepend=BOS), dtype=np.int32) for t in texts]
    starts = [1, 5, 3, 1, 20]
    batched = score_rows(model, rows, starts, "cpu")
    alone = [score_rows(model, [r], [s], "cpu") for r, s in zip(rows, starts)]
    assert np.allclose(batched[0], [a[0][0] for a in alone], rtol=1e-5, atol=1e-5)
    assert batched[1] == [a[1][0] for a in alone]
    # and whole tasks: every item alone, or many items per pass
    records = [{"query": q, "choices": ["one", "two", "three"], "gold": i % 3} for i, q in enumerate(texts * 3)]
    mc = task("multiple_choice", num_fewshot=2, delimiter=" ")
    assert accuracy(mc, records, model, batch_tokens=1) == accuracy(mc, records, model, batch_tokens=100_000)


def test_max_per_task_draws_a_fixed_shuffle_of_the_items():
    """A task file is ordered (its first lines can all be one category): a subset is a fixed shuffle's first items,
    here 1, 0, 3, 2, 5, 4 of six, so three hold two right and one wrong (the file's first three: all right)."""
    lm = task("language_modeling", baseline=0.0)
    records = [{"context": "a", "continuation": "b"}] * 3 + [{"context": "a", "continuation": "z"}] * 3
    assert evaluate_task(NextCharModel(), CharTokenizer(), lm, records, "cpu", max_per_task=3) == (2 / 3, 3)
    assert evaluate_task(NextCharModel(), CharTokenizer(), lm, records, "cpu", max_per_task=5) == (0.6, 5)
    assert evaluate_task(NextCharModel(), CharTokenizer(), lm, records, "cpu") == (0.5, 6)


# -----------------------------------------------------------------------------
# Bundles, centering, CORE


def make_bundle(root, tasks):
    """tasks: (label, type, fewshot, baseline %, records or None for a missing file, delimiter or None)."""
    os.makedirs(os.path.join(root, "eval_data"), exist_ok=True)
    yaml_lines, csv_lines = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for label, task_type, shots, baseline, records, delim in tasks:
        yaml_lines += ["-", f"  label: {label}", f"  dataset_uri: {label}.jsonl", f"  num_fewshot: [{shots}]",
                       f"  icl_task_type: {task_type}"]
        if delim is not None:
            yaml_lines.append(f"  continuation_delimiter: {json.dumps(delim)}")
        csv_lines.append(f"{label},{baseline}")
        if records is not None:
            with open(os.path.join(root, "eval_data", f"{label}.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in records) + "\n")
    with open(os.path.join(root, "core.yaml"), "w") as f:
        f.write("\n".join(yaml_lines) + "\n")
    with open(os.path.join(root, "eval_meta_data.csv"), "w") as f:
        f.write("\n".join(csv_lines) + "\n")
    return str(root)


MC_RECORDS = [{"query": "a", "choices": ["bc", "xy"], "gold": g} for g in (0, 0, 0, 1)]  # 3 of 4 right
LM_RECORDS = [{"context": "a", "continuation": "bc"}, {"context": "a", "continuation": "bd"}]  # 1 of 2 right


def mini_bundle(root):
    return make_bundle(root, [("mc", "multiple_choice", 2, 25, MC_RECORDS, ""),
                              ("gone", "language_modeling", 0, 0, None, None),
                              ("lm", "language_modeling", 1, 0, LM_RECORDS, "")])


def test_centering_and_core_mean():
    assert centered_accuracy(0.25, 0.25) == 0.0
    assert centered_accuracy(1.0, 0.25) == 1.0
    assert centered_accuracy(0.5, 0.25) == pytest.approx(1 / 3)
    assert centered_accuracy(0.1, 0.0) == pytest.approx(0.1)
    assert core_score({"a": {"centered": 0.2}, "b": {"centered": 0.5}, "c": {"centered": -0.1}}) == pytest.approx(0.2)


def test_core_over_a_bundle_with_a_missing_task(tmp_path, capsys):
    bundle = mini_bundle(tmp_path / "bundle")
    tasks, missing = load_bundle(bundle)
    assert [t.label for t in tasks] == ["mc", "lm"] and missing == ["gone"]
    assert tasks[0].delimiter == "" and tasks[0].baseline == 0.25 and tasks[0].num_fewshot == 2
    out = evaluate_core(NextCharModel(), CharTokenizer(), "cpu", bundle)
    assert out["tasks_run"] == 2 and out["tasks_total"] == 3 and out["missing"] == ["gone"]
    mc, lm = out["results"]["mc"], out["results"]["lm"]
    assert (mc["accuracy"], mc["items"]) == (0.75, 4) and mc["centered"] == pytest.approx((0.75 - 0.25) / 0.75)
    assert (lm["accuracy"], lm["items"]) == (0.5, 2) and lm["centered"] == pytest.approx(0.5)
    assert out["core"] == pytest.approx((2 / 3 + 0.5) / 2)
    printed = capsys.readouterr().out
    assert "gone" in printed and "mc" in printed and "accuracy 0.7500" in printed
    # the first 2 items of each task
    out = evaluate_core(NextCharModel(), CharTokenizer(), "cpu", bundle, max_per_task=2)
    assert out["results"]["mc"]["accuracy"] == 1.0 and out["results"]["lm"]["accuracy"] == 0.5


def test_default_delimiter_is_a_space(tmp_path):
    bundle = make_bundle(tmp_path, [("lm", "language_modeling", 0, 0, [{"context": "x", "continuation": "!"}], None)])
    [t], _ = load_bundle(bundle)
    assert t.delimiter == " "
    assert evaluate_core(SpaceAfterX(), CharTokenizer(), "cpu", bundle)["core"] == 1.0  # 'x' -> ' ' -> '!'


def test_bad_bundles_fail_clearly(tmp_path):
    with pytest.raises(EvalBundleError, match="is not a CORE eval bundle"):
        find_eval_bundle(str(tmp_path))
    bundle = make_bundle(tmp_path / "a", [("lm", "language_modeling", 0, 0, [{"context": "x"}], None)])
    with pytest.raises(EvalBundleError, match="needs keys"):
        evaluate_core(NextCharModel(), CharTokenizer(), "cpu", bundle)
    bundle = make_bundle(tmp_path / "b", [("lm", "language_modeling", 0, 0, None, None)])
    with pytest.raises(EvalBundleError, match="none of the tasks"):
        evaluate_core(NextCharModel(), CharTokenizer(), "cpu", bundle)
    # a wrong gold anywhere in a task (any record may be another's few-shot example), named with its line
    records = [{"query": "a", "choices": ["b", "c"], "gold": g} for g in (0, 5)]
    bundle = make_bundle(tmp_path / "c", [("mc", "multiple_choice", 2, 0, records, None)])
    with pytest.raises(EvalBundleError, match=r"line 2: gold 5 is not the index of one of its 2 options"):
        evaluate_core(NextCharModel(), CharTokenizer(), "cpu", bundle)


def test_core_during_training(tmp_path, capsys):
    bundle = mini_bundle(tmp_path / "bundle")
    model, tok = NextCharModel(), CharTokenizer()
    assert evaluate_core_for_training(model, tok, "cpu", None, str(tmp_path / "nowhere"), 2) is None
    assert "CORE: skipped" in capsys.readouterr().out
    for _ in range(2):  # the second call reuses the tokenized items
        out = evaluate_core_for_training(model, tok, "cpu", None, bundle, -1)
        assert out["tasks_run"] == 2 and out["tasks_total"] == 3 and out["core"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert model.training


# -----------------------------------------------------------------------------
# Finding and downloading the bundle


def test_offline_download_fails_fast_with_advice(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", "http://127.0.0.1:9/x.zip")
    with pytest.raises(EvalBundleError, match="--eval-bundle DIR"):
        find_eval_bundle()
    assert os.listdir(tmp_path) == []  # no half-written files


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_unpacks_into_the_base_dir(tmp_path, monkeypatch):
    src = mini_bundle(tmp_path / "src" / "eval_bundle")
    zip_path = tmp_path / "serve" / "eval_bundle.zip"
    os.makedirs(zip_path.parent)
    with zipfile.ZipFile(zip_path, "w") as z:  # the bundle inside a top-level folder, as published
        for dirpath, _, files in os.walk(src):
            for f in files:
                full = os.path.join(dirpath, f)
                z.write(full, os.path.relpath(full, tmp_path / "src"))
    handler = partial(QuietHandler, directory=str(zip_path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = tmp_path / "base"
        monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip")
        path = find_eval_bundle()
    finally:
        server.shutdown()
        server.server_close()
    assert path == str(base / "eval_bundle") and is_bundle(path)
    assert sorted(os.listdir(base)) == ["eval_bundle"]  # the temporary zip and folder are gone
    assert load_bundle(path)[1] == ["gone"]
    shutil.rmtree(src)
    assert find_eval_bundle() == path  # found now, no download


def test_a_rows_mean_loss_is_its_continuations_cross_entropy():
    """score_rows' mean over a row's continuation equals cross-entropy computed directly, rows of other lengths
    batched together (a toy model's 0-or-20-nat margins could not see the denominator off by one)."""
    torch.manual_seed(0)
    model = random_gpt(sequence_len=64, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    rows, starts = [np.array([0, 5, 9, 17, 3, 44], dtype=np.int32), np.array([0, 7, 7, 2], dtype=np.int32)], [3, 1]
    means, _ = score_rows(model, rows, starts, "cpu")
    for row, start, got in zip(rows, starts, means):
        ids = torch.tensor(row, dtype=torch.long)[None]
        with torch.no_grad():
            want = F.cross_entropy(model(ids)[0][start - 1:-1], ids[0, start:]).item()
        assert math.isclose(got, want, rel_tol=1e-5)


def test_language_modeling_starts_where_the_context_stops_matching():
    """The context's last token merged with the continuation's first (context [0, 1, 2, 3], the whole text
    [0, 1, 2, 7, 8, 9]): the continuation starts at the first token that differs, 3, not at the context's length."""
    assert continuation_starts("language_modeling", [np.array([0, 1, 2, 7, 8, 9])], np.array([0, 1, 2, 3])) == [3]
