"""
The DCLM CORE metric: in-context learning on the 22 tasks of DCLM's "core" set (llm-foundry's ICL protocol). The bundle:
core.yaml lists the tasks, eval_meta_data.csv their random-guess accuracy (%), eval_data/<dataset_uri> JSON lines.
Each option's whole prompt (few-shot examples first) is tokenized at once, so the continuation keeps the tokens the
model would see (" Paris", not " " "Paris"); a prompt longer than the context loses its start. Multiple choice and
schema: the lowest mean cross-entropy wins; language modeling: correct iff the argmax is right at every continuation
position. CORE = the mean of (accuracy - b) / (1 - b) over the tasks with a data file.
"""

import os
import csv
import json
import time
import random
import shutil
import zipfile
import urllib.request
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F
import torch.distributed as dist

from nanochat.common import UserError, get_base_dir, print0, Progress
from nanochat.distributed import barrier, gather_objects
from nanochat.signals import stop_point

# The public DCLM eval bundle (the CORE tasks in this layout); NANOCHAT_EVAL_BUNDLE_URL overrides it.
EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
DOWNLOAD_TIMEOUT_S = 30
FEWSHOT_SEED = 1234
SUBSET_SEED = 1337  # the items a task's subset draws (--core-max-per-task, training's CORE)
# Rows x longest row per forward pass: bounds activations (logits only where scored); small passes are launch-bound
DEFAULT_BATCH_TOKENS = 32768
TASK_KEYS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
             "language_modeling": ("context", "continuation")}


class EvalBundleError(UserError):
    """No bundle, or a malformed one; the message says what to do."""


def is_bundle(path):
    return os.path.isfile(os.path.join(path, "core.yaml")) and os.path.isfile(os.path.join(path, "eval_meta_data.csv"))


def download_bundle(url, dest, timeout=DOWNLOAD_TIMEOUT_S):
    """Unpack the zip beside `dest`, then rename it into place: `dest` holds a whole bundle or does not exist."""
    tmp_zip, tmp_dir = f"{dest}.zip.tmp.{os.getpid()}", f"{dest}.tmp.{os.getpid()}"
    print(f"downloading the CORE eval bundle from {url} to {dest}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp_zip, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0)
            done, next_report = 0, 0.1
            while chunk := response.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                if total and done >= next_report * total:
                    print(f"  {done / 2**20:.1f} / {total / 2**20:.1f} MiB", flush=True)
                    next_report += 0.1
        with zipfile.ZipFile(tmp_zip) as z:  # extractall drops absolute paths and '..' in member names
            z.extractall(tmp_dir)
        # the zip holds the bundle at its top level or inside one folder
        candidates = [tmp_dir] + [os.path.join(tmp_dir, d) for d in sorted(os.listdir(tmp_dir))]
        if (root := next((c for c in candidates if is_bundle(c)), None)) is None:
            raise EvalBundleError(f"{url} does not hold a CORE eval bundle (no core.yaml and eval_meta_data.csv); "
                                  f"pass --eval-bundle DIR with a local copy")
        try:
            os.replace(root, dest)
        except OSError:
            if not is_bundle(dest):  # not a concurrent download that finished first
                raise EvalBundleError(f"{dest} exists but is not a CORE eval bundle: remove it, or pass "
                                      f"--eval-bundle DIR") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise EvalBundleError(f"could not download the CORE eval bundle from {url} ({type(e).__name__}: {e}). "
                              f"Offline? Pass --eval-bundle DIR with a local copy of the bundle (a folder holding "
                              f"core.yaml, eval_meta_data.csv and eval_data/), or put one at {dest}") from None
    finally:
        if os.path.exists(tmp_zip):
            os.remove(tmp_zip)
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"CORE eval bundle ready in {dest}", flush=True)


def _find_or_download(path):
    if path:
        if not is_bundle(path):
            raise EvalBundleError(f"--eval-bundle {path} is not a CORE eval bundle: expected core.yaml, "
                                  f"eval_meta_data.csv and eval_data/ inside it")
        return os.path.abspath(path)
    default = os.path.join(get_base_dir(), "eval_bundle")
    if not is_bundle(default):
        download_bundle(os.environ.get("NANOCHAT_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL, default)
    return default


def find_eval_bundle(path=None, layout=None):
    """The bundle folder: `path`, else $NANOCHAT_BASE_DIR/eval_bundle, downloaded when absent (by local rank 0
    of each node while the others wait: the base dir may be per node or shared). Every rank sees a failure."""
    if layout is not None and layout.world_size > 1:
        error = None
        if layout.local_rank == 0:
            try:
                _find_or_download(path)
            except EvalBundleError as e:
                error = str(e)
        barrier(layout, "the CORE eval bundle download (local rank 0 of each node)")
        if any(errors := gather_objects(error, layout.cpu_group)):
            raise EvalBundleError(next(e for e in errors if e))
    return _find_or_download(path)


# a core.yaml task: task_type in TASK_KEYS; delimiter precedes the continuation; baseline: random accuracy (0-1)
Task = namedtuple("Task", ["label", "task_type", "num_fewshot", "delimiter", "baseline", "path"])


def load_bundle(bundle_dir):
    """(tasks whose data file exists, labels of those whose file is missing), in core.yaml's order."""
    import yaml
    try:
        with open(os.path.join(bundle_dir, "core.yaml")) as f:
            entries = yaml.safe_load(f)["icl_tasks"]
        with open(os.path.join(bundle_dir, "eval_meta_data.csv")) as f:
            baselines = {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        raise EvalBundleError(f"{bundle_dir} is not a readable CORE eval bundle ({type(e).__name__}: {e})") from None
    tasks, missing = [], []
    for entry in entries:
        try:
            label, uri, task_type = entry["label"], entry["dataset_uri"], entry["icl_task_type"]
            num_fewshot = int(entry["num_fewshot"][0])  # DCLM lists one few-shot count per task in CORE
        except (KeyError, TypeError, ValueError, IndexError):
            raise EvalBundleError(f"core.yaml: the task entry {entry!r} needs label, dataset_uri, icl_task_type "
                                  f"and num_fewshot: [k]") from None
        if task_type not in TASK_KEYS:
            raise EvalBundleError(f"core.yaml: task {label!r} has icl_task_type {task_type!r}; "
                                  f"expected one of {sorted(TASK_KEYS)}")
        if label not in baselines:
            raise EvalBundleError(f"eval_meta_data.csv has no random baseline for task {label!r}")
        path = os.path.join(bundle_dir, "eval_data", uri)
        if not os.path.isfile(path):
            missing.append(label)
            continue
        tasks.append(Task(label, task_type, num_fewshot, entry.get("continuation_delimiter", " "), baselines[label], path))
    return tasks, missing


def load_records(task):
    keys = TASK_KEYS[task.task_type]
    records = []
    with open(task.path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalBundleError(f"{task.path} line {line_no} is not JSON ({e})") from None
            if any(k not in record for k in keys):
                raise EvalBundleError(f"{task.path} line {line_no}: a {task.task_type} record needs keys {keys}, "
                                      f"found {sorted(record)}")
            options, gold = item_options(task.task_type, record, task.delimiter)  # also read as a few-shot example
            if not (type(gold) is int and 0 <= gold < len(options)):
                raise EvalBundleError(f"{task.path} line {line_no}: gold {gold!r} is not the index of one of its "
                                      f"{len(options)} options")
            records.append(record)
    if not records:
        raise EvalBundleError(f"{task.path} holds no records")
    return records


def fewshot_indices(idx, n, k):
    """k distinct indices of [0, n) other than idx, the same on every call for the same item (sampled from the n-1
    others without building their list: tasks have up to 20k items)."""
    return [j + (j >= idx) for j in random.Random(FEWSHOT_SEED + idx).sample(range(n - 1), max(0, min(k, n - 1)))]


def item_options(task_type, record, delimiter):
    """([(context, continuation) per option], index of the correct option)."""
    if task_type == "multiple_choice":
        return [(record["query"] + delimiter, choice) for choice in record["choices"]], record["gold"]
    if task_type == "schema":
        return [(option + delimiter, record["continuation"]) for option in record["context_options"]], record["gold"]
    return [(record["context"].strip() + delimiter, record["continuation"])], 0  # as the protocol trims it


def render_item(task, records, idx):
    """(full prompt per option, the first option's prompt without its continuation, gold). That prompt ends without
    whitespace: language modeling scores the delimiter's space with the continuation, as the CORE protocol does
    (where it is a token of its own, e.g. before digits, the model must predict it too)."""
    prefix = ""
    for j in fewshot_indices(idx, len(records), task.num_fewshot):
        options, gold = item_options(task.task_type, records[j], task.delimiter)
        prefix += "".join(options[gold]) + "\n\n"
    options, gold = item_options(task.task_type, records[idx], task.delimiter)
    return [prefix + context + continuation for context, continuation in options], (prefix + options[0][0]).rstrip(), gold


def common_prefix_len(seqs):  # of token arrays (commonprefix takes any sequences, not only paths)
    return len(os.path.commonprefix([s.tolist() for s in seqs]))


def continuation_starts(task_type, rows, context=None):
    """Per row, its first continuation token's index (`context`: the prompt without it, for language modeling)."""
    if task_type == "multiple_choice":
        starts = [common_prefix_len(rows)] * len(rows)
    elif task_type == "schema":
        shared = common_prefix_len([r[::-1] for r in rows])
        starts = [len(r) - shared for r in rows]
    else:
        starts = [common_prefix_len([rows[0], context])]
    # every row scores at least its last token, and never position 0 (nothing predicts it)
    return [min(max(s, 1), len(r) - 1) for s, r in zip(starts, rows)]


PreparedItem = namedtuple("PreparedItem", ["rows", "starts", "gold"])  # int32 arrays, ints, int


def prepare_items(task, records, indices, tokenizer, max_len):
    rendered = [render_item(task, records, i) for i in indices]
    lm = task.task_type == "language_modeling"  # then each row is followed by its context (no continuation)
    texts = [t for option_texts, context, _ in rendered for t in option_texts + ([context] if lm else [])]
    ids = iter([np.asarray(x, dtype=np.int32) for x in tokenizer.encode(texts, prepend=tokenizer.get_bos_token_id())])
    items = []
    for option_texts, _, gold in rendered:
        rows = [next(ids) for _ in option_texts]
        starts = continuation_starts(task.task_type, rows, next(ids) if lm else None)
        # keep the last max_len tokens: a continuation longer than the window loses its first tokens
        cut = [max(0, len(r) - max_len) for r in rows]
        items.append(PreparedItem([r[c:] for r, c in zip(rows, cut)], [max(1, s - c) for s, c in zip(starts, cut)], gold))
    return items


@torch.no_grad()
def score_rows(model, rows, starts, device):
    """One forward pass over right-padded rows; per row (lists): the mean cross-entropy over its continuation
    rows[i][starts[i]:], and whether the argmax matched every continuation token."""
    lengths = np.array([len(r) for r in rows])
    ids = np.zeros((len(rows), lengths.max()), dtype=np.int64)  # the pad id is irrelevant: never read
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    # logits at position p predict token p+1: continuation tokens start..len-1 are read at start-1..len-2
    pos = np.arange(ids.shape[1])
    mask = (pos >= np.array(starts)[:, None] - 1) & (pos < lengths[:, None] - 1)
    row_idx, col_idx = (torch.from_numpy(a).to(device) for a in np.nonzero(mask))
    ids = torch.from_numpy(ids).to(device)
    logits = model(ids, positions=(row_idx, col_idx))  # lm_head only where scored: (continuation tokens, V), fp32
    targets = ids[row_idx, col_idx + 1]
    losses = F.cross_entropy(logits, targets, reduction="none")
    wrong = (logits.argmax(dim=-1) != targets).float()
    sums = torch.zeros((2, len(rows)), device=device).index_add_(1, row_idx, torch.stack([losses, wrong]))
    counts = torch.from_numpy(lengths - np.array(starts)).to(device)
    return (sums[0] / counts).tolist(), (sums[1] == 0).tolist()


def item_batches(items, batch_tokens):
    """Runs of items with rows x longest row <= batch_tokens (or one item alone: its options share a pass)."""
    batch, n_rows, longest = [], 0, 0
    for item in items:
        item_longest = max(len(r) for r in item.rows)
        if batch and (n_rows + len(item.rows)) * max(longest, item_longest) > batch_tokens:
            yield batch
            batch, n_rows, longest = [], 0, 0
        batch.append(item)
        n_rows, longest = n_rows + len(item.rows), max(longest, item_longest)
    if batch:
        yield batch


def evaluate_task(model, tokenizer, task, records, device, max_per_task=-1, layout=None,
                  batch_tokens=DEFAULT_BATCH_TOKENS, cache=None):
    """(accuracy, items) over max_per_task items (-1: all) drawn by a fixed shuffle (the files are ordered: jeopardy's
    first 500 lines hold 2 of its 5 categories), strided over DP ranks; `cache` (a dict) keeps the tokenized items
    for the next call (training evaluates them again and again)."""
    n = len(records) if max_per_task < 0 else min(max_per_task, len(records))
    chosen = list(range(len(records)))
    if n < len(records):
        random.Random(SUBSET_SEED).shuffle(chosen)
    dp_rank, dp_size = (layout.dp_rank, layout.dp_size) if layout is not None else (0, 1)
    max_len = model.config.sequence_len
    key = (tokenizer, task, n, dp_rank, dp_size, max_len)  # the tokenizer by identity
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = prepare_items(task, records, chosen[dp_rank:n:dp_size], tokenizer, max_len)
    items = cache[key]
    correct, done = 0, 0
    # a stop request ends a long task within a batch in one process; under torchrun the ranks run different
    # numbers of batches, so they agree on stopping once per task (evaluate_core)
    alone = layout is None or layout.world_size == 1
    progress = Progress(f"  {task.label}", len(items), unit="items")
    for batch in item_batches(items, batch_tokens):
        if alone:
            stop_point()
        progress.update(done)
        done += len(batch)
        mean_losses, exact = score_rows(model, [r for it in batch for r in it.rows],
                                        [s for it in batch for s in it.starts], device)
        offset = 0
        for item in batch:  # language modeling: the exact match; else the lowest loss wins (ties: the first option)
            losses = mean_losses[offset:offset + len(item.rows)]
            correct += exact[offset] if task.task_type == "language_modeling" else losses.index(min(losses)) == item.gold
            offset += len(item.rows)
    counts = torch.tensor([correct, len(items)], dtype=torch.int64, device=device)
    if dp_size > 1:  # SUM: gloo has no AVG
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=layout.dp_group)
    correct, total = counts.tolist()
    return correct / total, total


def centered_accuracy(accuracy, baseline):  # 0 at random guessing, 1 at perfect
    return (accuracy - baseline) / (1.0 - baseline)


def core_score(results):  # the mean centered accuracy over the tasks that ran
    return sum(r["centered"] for r in results.values()) / len(results)


def evaluate_core(model, tokenizer, device, bundle_dir, max_per_task=-1, layout=None, cache=None):
    """Every task of the bundle with a data file: {"core", "tasks_run", "tasks_total", "missing": [labels],
    "results": {label: {"accuracy", "centered", "items", "seconds"}}}."""
    tasks, missing = load_bundle(bundle_dir)
    if not tasks:
        raise EvalBundleError(f"none of the tasks in {bundle_dir}/core.yaml has its data file under eval_data/")
    subset = "all items" if max_per_task < 0 else f"{max_per_task} items (a fixed shuffle's first)"
    print0(f"CORE: {len(tasks)} tasks from {bundle_dir}, {subset} of each"
           + (f"; no data file for {len(missing)}: {', '.join(missing)}" if missing else ""))
    records_by_path = cache.setdefault("records", {}) if cache is not None else {}
    results = {}
    distributed = layout is not None and layout.world_size > 1
    for task in tasks:
        stop_point(device if distributed else None)
        t0 = time.time()
        if task.path not in records_by_path:
            records_by_path[task.path] = load_records(task)
        accuracy, n = evaluate_task(model, tokenizer, task, records_by_path[task.path], device, max_per_task, layout,
                                    cache=cache)
        r = results[task.label] = {"accuracy": accuracy, "centered": centered_accuracy(accuracy, task.baseline),
                                   "items": n, "seconds": time.time() - t0}
        print0(f"  {task.label:<34} {n:>6} items | accuracy {accuracy:.4f} | centered {r['centered']:+.4f} | {r['seconds']:.1f}s")
    return {"core": core_score(results), "tasks_run": len(results), "tasks_total": len(tasks) + len(missing),
            "results": results, "missing": missing}


_TRAINING_CACHE = {}  # tokenized items and the bundle's location, kept across a run's CORE evaluations


def evaluate_core_for_training(model, tokenizer, device, layout, eval_bundle, max_per_task):
    """CORE inside base_train (`model` takes whole sequences: training.Trainer.whole_model), or None with a one-line
    note when there is no bundle (never stops the run)."""
    key = ("bundle", eval_bundle)
    if key not in _TRAINING_CACHE:  # look (and maybe download) once per run
        try:
            _TRAINING_CACHE[key] = find_eval_bundle(eval_bundle, layout)
        except EvalBundleError as e:
            _TRAINING_CACHE[key] = EvalBundleError(str(e))
    if isinstance(bundle := _TRAINING_CACHE[key], EvalBundleError):
        print0(f"CORE: skipped ({bundle})")
        return None
    return evaluate_core(model, tokenizer, device, bundle, max_per_task, layout, cache=_TRAINING_CACHE)
