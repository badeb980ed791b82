"""
The pipeline runs the schedule it prints: in a 2-rank CPU run (gloo), for each schedule, the actions each rank
executes in train_step are exactly Pipeline.actions(rank), the same list is the rank's line of schedule_text (what
--pp-print-schedule prints), and the most micro-batch chunks alive at once is what the simulator counts.
"""

import os
import tempfile

import torch
import torch.distributed as dist

from parallel_harness import _free_port, spawn

STAGES, MICROBATCHES = 2, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    from nanochat.distributed import build_layout
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.pipeline_parallel import Pipeline
    from nanochat.pipeline_schedules import action_name, peak_in_flight
    from nanochat.recipe import Setting
    layout = build_layout(rank, STAGES, rank, pp=STAGES)
    results = {}
    for schedule, virtual in SCHEDULES:
        torch.manual_seed(0)
        model = build_model(GPTConfig(sequence_len=16, vocab_size=32, n_layer=4, n_head=2, n_kv_head=2, n_embd=32), "cpu")
        setting = Setting(pp=STAGES, pp_schedule=schedule, pp_virtual=virtual, device_batch=1)
        pipe = Pipeline(model, layout, setting, MICROBATCHES)
        linear = next(m.c_q for m in model.modules() if hasattr(m, "c_q"))
        executed = []
        for kind, name in (("F", "forward"), ("B", "backward")):
            method = getattr(pipe, name)

            def run(i, c, *inputs, kind=kind, method=method):
                executed.append((kind, i, c))
                return method(i, c, *inputs)
            setattr(pipe, name, run)
        ids = torch.randint(0, 32, (MICROBATCHES, 1, 17), generator=torch.Generator().manual_seed(1))
        pipe.train_step([(x[:, :-1], x[:, 1:]) for x in ids])
        row = pipe.schedule_text().splitlines()[1 + pipe.stage].split()[2:]
        printed = [action_name(a, virtual) for a in executed]
        predicted = peak_in_flight([pipe.actions(r) for r in range(STAGES)])[pipe.stage]
        results[schedule] = (executed, pipe.actions(pipe.stage), row, printed, pipe.peak_in_flight, predicted,
                             linear.weight.grad is not None)
    torch.save(results, os.path.join(out_dir, f"stage{rank}.pt"))
    dist.destroy_process_group()


def test_train_step_runs_the_printed_schedule():
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, (_free_port(), out_dir), STAGES)
        for stage in range(STAGES):
            results = torch.load(os.path.join(out_dir, f"stage{stage}.pt"))
            for (schedule, virtual), (executed, actions, row, printed, peak, predicted, has_grad) in zip(
                    SCHEDULES, results.values(), strict=True):
                assert executed == actions and printed == row, (schedule, stage)
                assert sorted(executed) == sorted((k, i, c) for k in "FB" for i in range(MICROBATCHES)
                                                  for c in range(stage, STAGES * virtual, STAGES)), (schedule, stage)
                assert peak == predicted, (schedule, stage, peak, predicted)
                assert has_grad
        assert results["gpipe"][4] == MICROBATCHES  # GPipe keeps every micro-batch; 1F1B at most p - rank
        assert results["1f1b"][4] == 1
