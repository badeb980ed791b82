"""The memory planner (nanochat/memory.py, scripts/plan.py): assert_planned, which the parallel tests run on their
CPU runs (the bytes of weights, gradients and optimizer state each rank held, measured off its tensors, against the
plan; tests/test_shard_params.py); the planner's own rules (activations grow with the tokens, fall with recompute,
split with TP and CP; a stage holds its schedule's micro-batches; sharding fits larger batches) and the script."""


import pytest

from parallel_harness import CONFIG, GLOBAL_BATCH, run_layout
from nanochat.gpt import GPTConfig
from nanochat.memory import rank_memory, largest_batch, usable_bytes, GIB, HEAD_BYTES, HEAD_BYTES_TP
from nanochat.recipe import Setting, config_for_depth

CPU = dict(compute_bytes=4, total_batch=GLOBAL_BATCH * CONFIG["sequence_len"])  # the harness: fp32, 8 sequences a step


def assert_planned(run, dp=1, tp=1, pp=1, cp=1, micro_batch=2, config_overrides=None, **flags):
    """The planner's count of every rank's weights and optimizer state is what the run's ranks held, measured off
    their tensors (DP rank 0, which owns the most; the others no more), and their gradients at the step are fp32 as
    the weights held; sharded, the gathered whole weights peaked within 10% under the plan. The parallel tests call
    this on their runs."""
    setting = Setting(dp=dp, tp=tp, pp=pp, cp=cp, device_batch=micro_batch, sequence_parallel=flags.get("sequence_parallel", False),
                      shard_params=flags.get("shard_params", False), keep_gathered=flags.get("keep_gathered", False),
                      pp_schedule=flags.get("schedule", "1f1b"), pp_virtual=flags.get("virtual", 1),
                      recompute=flags.get("recompute", "none"), **CPU)
    plan = rank_memory(GPTConfig(**{**CONFIG, **(config_overrides or {})}), setting)
    group = dp * cp * tp  # ranks: TP fastest, then CP, then DP, then PP
    for rank, held in enumerate(run["held"]):
        stage = plan[rank // group]
        first = rank % group < tp
        for measured, planned in (("weights", "weights"), ("gradients", "weights"), ("state", "optimizer state")):
            ok = held[measured] == stage[planned] if first else held[measured] <= stage[planned]
            assert ok, (rank, measured, held[measured], stage[planned])
    if setting.shard_params:
        assert 0.9 * plan[0]["gathered"] <= run["gathered_peak"] <= 1.1 * plan[0]["gathered"], (run["gathered_peak"], plan)


def test_tp_and_pp_split_the_layers_as_the_run_does():
    """Under TP the run splits the layers by the whole model's costs: the planner too (it priced the TP-cut model, so
    with a large vocabulary it gave stage 0 a layer fewer than the run does)."""
    wide = dict(n_layer=8, vocab_size=4096)
    assert_planned(run_layout(tp=2, pp=2, steps=1, config_overrides=wide), tp=2, pp=2, config_overrides=wide)


def test_an_l3_layer_keeps_one_cast_table_a_step():
    """A training step casts an L3 table to bf16 once for all its micro-batches: one copy on the layer's stage however
    many micro-batches are in flight there (two on stage 0 of PP 2 under 1F1B), none beside the gathered table when
    sharded."""
    dense, l3 = config_for_depth(12), config_for_depth(12, l3_after_layers=(2,), l3_n_emb=2 ** 16)
    act = lambda config, **kw: [r["activations"] for r in rank_memory(config, Setting(**{"device_batch": 8, **kw}))]
    table = 2 ** 16 * dense.n_embd * 2
    assert act(l3)[0] - act(dense)[0] == table
    assert act(l3, dp=2, shard_params=True) == act(dense, dp=2, shard_params=True)
    # PP 2 (the split follows the layer's FLOPs, so against the same model sharded, where the copy is not counted)
    plain, sharded = act(l3, dp=2, pp=2), act(l3, dp=2, pp=2, shard_params=True)
    assert [a - b for a, b in zip(plain, sharded)] == [table, 0]


def test_activations_follow_tokens_recompute_tp_and_cp():
    config = config_for_depth(20)
    act = lambda **kw: rank_memory(config, Setting(**{"device_batch": 16, **kw}))[0]["activations"]
    assert act(device_batch=32) == pytest.approx(2 * act())
    assert act() > act(recompute="selective") > act(recompute="block")
    assert act(fp8=True) < act()
    # TP cuts what its regions keep; SP most of the rest, but the all-gathered matmul inputs stay whole
    assert act(dp=8) / 2 < act(dp=4, tp=2, sequence_parallel=True) < act(dp=4, tp=2) < act(dp=8)
    # block recompute keeps the blocks' inputs alone, selective those and the attention's output: whole under TP
    # (but the head's share and the attention's), cut by SP; the head's tensors a vocabulary entry: fused on one GPU,
    # two fp32 ones under TP (the vocab-parallel loss), on a TP rank's shard of the vocabulary
    head = lambda bytes_per_entry, tp=1: 16 * config.sequence_len * config.vocab_size * bytes_per_entry / tp
    for mode in ("block", "selective"):
        kept = lambda **kw: act(recompute=mode, **kw)
        blocks_one = kept(dp=8) - head(HEAD_BYTES)
        assert kept(dp=4, tp=2, sequence_parallel=True) - head(HEAD_BYTES_TP, tp=2) == pytest.approx(blocks_one / 2)
        assert blocks_one / 2 < kept(dp=4, tp=2) - head(HEAD_BYTES_TP, tp=2) <= blocks_one * (1 + 1e-9)
    assert act(dp=4, tp=2, recompute="selective") / act(dp=8, recompute="selective") < \
        act(dp=4, tp=2, recompute="block") / act(dp=8, recompute="block")
    long = config_for_depth(20, sequence_len=8192)
    cp2 = lambda exchange: rank_memory(long, Setting(dp=4, cp=2, cp_exchange=exchange, device_batch=4))[0]["activations"]
    assert cp2("ring") == pytest.approx(rank_memory(long, Setting(dp=8, device_batch=2))[0]["activations"])
    # the all-gather: a layer's backward holds the whole sequence's K/V and their gradients, both in bf16
    kv_elements = 4 * 8192 * 2 * 1280
    assert cp2("all-gather") - cp2("ring") == pytest.approx(kv_elements * (2 + 2))


def test_pipeline_stages_hold_their_schedules_micro_batches():
    """1F1B: stage s keeps p - s micro-batches alive, GPipe all of them; sharding cuts every stage's weights."""
    config = config_for_depth(26)
    one_f = rank_memory(config, Setting(dp=2, pp=4, device_batch=8))  # 16 micro-batches a step
    gpipe = rank_memory(config, Setting(dp=2, pp=4, device_batch=8, pp_schedule="gpipe"))
    assert one_f[0]["activations"] > 2 * one_f[3]["activations"]  # 4 micro-batches of a chunk against 1 (+ the head)
    assert all(g["activations"] > 3 * o["activations"] for g, o in zip(gpipe[:3], one_f[:3]))
    sharded = rank_memory(config, Setting(dp=2, pp=4, device_batch=8, shard_params=True))
    assert all(s["weights"] < 0.6 * o["weights"] for s, o in zip(sharded, one_f))


def test_one_micro_batch_peaks_with_its_whole_gradients():
    """Without accumulation the fp32 gradients are whole at the backward's end: where they outweigh the activations,
    that is the peak (d32, one sequence a GPU: 22.9 GiB, not 16.6)."""
    one = rank_memory(config_for_depth(32), Setting(dp=8, device_batch=1, total_batch=8 * 2048))[0]
    assert one["activations"] < one["weights"] and one["total"] >= 2 * one["weights"] + one["optimizer state"]


def test_sharding_fits_larger_batches():
    config = config_for_depth(32)
    capacity = usable_bytes(79.6)
    assert largest_batch(config, Setting(dp=8, shard_params=True, total_batch=2 ** 21), capacity)[0] > \
        largest_batch(config, Setting(dp=8, total_batch=2 ** 21), capacity)[0]
    assert usable_bytes(79.6) / GIB == pytest.approx(0.95 * 78.1)


def test_plan_script(env):
    from conftest import run_script
    run = lambda *a: run_script("scripts.plan", a, env, check=False)
    p = run("--depth", "12", "--gpus", "2", "--gpu", "h100", "--top", "3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| pipeline rank | weights | working copies | gradients | optimizer state | activations | total | fits |" in p.stdout
    assert "layouts of 2 GPUs that fit, fastest first" in p.stdout
    p = run("--compare", "--depths", "26", "--gpus", "8", "--gpu", "h100")
    assert p.returncode == 0 and "- (--tp 2 does not divide the query heads (n_head) = 13) |" in p.stdout, p.stdout + p.stderr
    p = run("--compare", "--depths", "12", "--gpus", "1", "--gpu", "h100")  # one GPU: the TP columns say why not
    assert p.returncode == 0 and "- (--gpus 1 is not divisible by tp x pp x cp = 2) |" in p.stdout, p.stdout + p.stderr
    p = run("--compare", "--depths", "20,x")
    assert p.returncode != 0 and "depths as whole numbers" in p.stdout
    p = run("--depth", "12", "--gpus", "0")
    assert p.returncode != 0 and "--gpus 0" in p.stdout and "positive vocabulary and GPU count" in p.stdout
    p = run("--depth", "12", "--gpus", "3", "--tp", "2")
    assert p.returncode != 0 and "ERROR: --gpus 3 is not divisible by tp x pp x cp = 2" in p.stdout
    p = run("--depth", "12", "--gpus", "16")  # a layout base_train refuses: the layouts that run, then its line
    assert p.returncode != 0 and p.stdout.splitlines()[-1].startswith("ERROR: the batch") and "| pipeline rank" not in \
        p.stdout and "| dp 16; batch 16; recompute none | 16 |" in p.stdout, p.stdout
    for flags, error in ((["--gpu", ","], "ERROR: --gpu ','"), (["--kernels", "reference"], "the plan is of compiled runs"),
                         (["--fp8", "--gpu", "a100"], "--fp8 needs an H100-class GPU")):
        p = run("--depth", "12", *flags)
        assert p.returncode != 0 and error in p.stdout and "Traceback" not in p.stderr, p.stdout + p.stderr
    p = run("--depth", "12", "--gpus", "2", "--gpu", "h100,h200")
    assert p.returncode != 0 and "several go with --compare" in p.stdout
    p = run("--depth", "32", "--gpus", "4", "--gpu", "h200", "--top", "30")  # sharding is charged its measured cost
    speeds = {row.split(" | ")[0]: float(row.split(" | ")[-1].rstrip(" |")) for row in p.stdout.splitlines()
              if row.startswith("| dp 4") and "recompute none" in row and "batch 16" in row}
    assert speeds["| dp 4, sharded; batch 16; recompute none"] < speeds["| dp 4; batch 16; recompute none"], speeds
