"""
The pipeline runs the schedule it prints: in a 2-stage CPU run (gloo), for each schedule, the forwards and
backwards each stage executes in train_step are exactly Pipeline.actions(stage), and the same list is the
stage's line of schedule_text (what --pp-print-schedule prints).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel_harness import _free_port

STAGES, MICROBATCHES = 2, 3


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    from nanochat.distributed import build_layout
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.pipeline_parallel import Pipeline
    layout = build_layout(rank, STAGES, rank, pp=STAGES)
    results = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = build_model(GPTConfig(sequence_len=16, vocab_size=32, n_layer=2, n_head=2, n_kv_head=2, n_embd=32), "cpu")
        pipe = Pipeline(model, layout, MICROBATCHES, micro_batch_size=1, schedule=schedule)
        executed = []
        for kind, method in (("F", pipe.forward), ("B", pipe.backward)):
            setattr(pipe, method.__name__, lambda i, inputs, kind=kind, method=method: executed.append((kind, i)) or method(i, inputs))
        ids = torch.randint(0, 32, (MICROBATCHES, 1, 17), generator=torch.Generator().manual_seed(1))
        pipe.train_step([(x[:, :-1], x[:, 1:]) for x in ids])
        row = pipe.schedule_text().splitlines()[1 + pipe.stage].split()[2:]
        printed = [(cell[0], int(cell[1:])) for cell in row]
        results[schedule] = (executed, pipe.actions(pipe.stage), printed)
    torch.save(results, os.path.join(out_dir, f"stage{rank}.pt"))
    dist.destroy_process_group()


def test_train_step_runs_the_printed_schedule():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=STAGES, join=True)
        for stage in range(STAGES):
            for schedule, (executed, actions, printed) in torch.load(os.path.join(out_dir, f"stage{stage}.pt")).items():
                assert executed == actions == printed, (schedule, stage)
                assert len(executed) == 2 * MICROBATCHES
