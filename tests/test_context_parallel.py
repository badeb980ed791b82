"""Context parallelism against one process: the same losses, gradient norms and parameters (as tests/test_parallel.py
checks the other layouts) at CP 2 and 4, with full-context and sliding-window layers on rows packed from documents
shorter and longer than a chunk, composed with DP, TP (+SP), PP, recompute, compile and L3; checkpoints that move
from CP 2 to CP 1; the ring's pieces (the block math, the merge, the head-tail balance, the steps a window skips);
bad layouts refused; and base_train under torchrun."""

import itertools

import pytest
import torch

from parallel_harness import run_layout
from test_parallel import assert_same_run, _resume_matches

from nanochat.common import ConfigError
from nanochat import context_parallel as cpm

# 256 tokens: S windows of 128 (a quarter rounded up to 128), so that a window spans 2 chunks at CP 2 and 4 at CP 4
WINDOWS = dict(sequence_len=256, window_pattern="SSSL")


@pytest.fixture(scope="module")
def reference():
    return run_layout()


@pytest.fixture(scope="module")
def windowed():
    return run_layout(config_overrides=WINDOWS, documents=True)


def test_windowed_reference_has_short_windows_and_documents(windowed):
    from nanochat.gpt import GPTConfig, window_sizes
    from parallel_harness import CONFIG, fixed_batches
    assert window_sizes(GPTConfig(**{**CONFIG, **WINDOWS}))[:3] == [128, 128, 128]
    rows = fixed_batches(1, sequence_len=256, documents=True)[0]
    starts = [(row == 0).nonzero().flatten().tolist() for row in rows]
    gaps = [b - a for s in starts for a, b in zip(s, s[1:])]
    assert min(gaps) < 32 and max(gaps) > 64  # documents shorter and longer than a CP 4 chunk (32 tokens)
    assert windowed["losses"][-1] < windowed["losses"][0]


@pytest.mark.parametrize("exchange", ["all-gather", "ring"])
def test_cp4_full_context(reference, exchange):  # CP 2 with full context: test_dp2_cp2
    run = run_layout(cp=4, cp_exchange=exchange)
    assert run["exchange"] == exchange
    assert_same_run(run, reference)


@pytest.mark.parametrize("cp,exchange", [(2, "all-gather"), (4, "all-gather"), (2, "ring"), (4, "ring")])
def test_cp_sliding_windows_and_documents(windowed, cp, exchange):
    run = run_layout(cp=cp, cp_exchange=exchange, config_overrides=WINDOWS, documents=True)
    assert run["exchange"] == exchange
    assert_same_run(run, windowed)


def test_dp2_cp2(reference):  # gradients summed over DP x CP; each DP rank's CP pair reads the same batches
    assert_same_run(run_layout(dp=2, cp=2), reference)


def test_cp2_tp2_sequence_parallel(windowed):  # the ring between ranks of one TP index; SP splits each rank's chunks
    assert_same_run(run_layout(cp=2, tp=2, sequence_parallel=True, config_overrides=WINDOWS, documents=True), windowed)


def test_cp2_pp2(windowed):  # the stages pass this rank's chunks and the whole ids
    assert_same_run(run_layout(cp=2, pp=2, config_overrides=WINDOWS, documents=True), windowed)


@pytest.mark.parametrize("recompute", ["selective", "block"])
def test_cp2_compiled_with_recompute(windowed, recompute):
    """The ring as one op in the compiled graph; selective recompute keeps its output, block recompute runs it
    (and its messages) again in the backward."""
    run = run_layout(cp=2, config_overrides=WINDOWS, documents=True, compile_backend="aot_eager", recompute=recompute)
    assert_same_run(run, windowed)


def test_cp2_l3():
    l3 = dict(WINDOWS, l3_after_layers=(1,), l3_n_emb=256, l3_k_max=8)
    assert_same_run(run_layout(cp=2, config_overrides=l3, documents=True),
                    run_layout(config_overrides=l3, documents=True))


def test_checkpoint_cp2_resumes_at_cp1():
    saved = run_layout(cp=2, steps=6, config_overrides=WINDOWS, documents=True)
    _resume_matches(saved, cp=1, config_overrides=WINDOWS, documents=True)


# --- the pieces ---------------------------------------------------------------------------------------------------


def spans_in_one_process(q, k, v, dout, N, window):
    """What the all-gather computes, every query chunk in one process: (out, dq, dk, dv) of whole sequences from each
    chunk's key_spans blocks merged, the backward from the merged output (ring_in_one_process for the ring's blocks)."""
    from nanochat import kernels
    cp, bands = cpm.ContextParallel(_Layout(0, N), q.size(2), q.device, "all-gather"), kernels.block_bands(q)
    chunk = lambda t, g: t[:, :, g * cp.chunk:(g + 1) * cp.chunk]
    merged = {g: cpm.merge([cpm.block_attention(chunk(q, g), k[:, :, lo:hi], v[:, :, lo:hi], offset, window)
                            for lo, hi, offset in cp.key_spans(g, window, bands)]) for g in range(2 * N)}
    out, lse = (torch.cat([merged[g][i] for g in range(2 * N)], dim=2) for i in (0, 1))
    out = out.to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for g in range(2 * N):
        for lo, hi, offset in cp.key_spans(g, window, bands):
            grads = cpm.block_attention_backward(chunk(dout, g), chunk(q, g), k[:, :, lo:hi], v[:, :, lo:hi],
                                                 chunk(out, g), chunk(lse, g), offset, window)
            chunk(dq, g).add_(grads[0])
            dk[:, :, lo:hi] += grads[1]
            dv[:, :, lo:hi] += grads[2]
    return out, dq, dk, dv


class FA4Math:
    """flash-attn-4's two entry points as PyTorch math, standing in for its kernels on CPU: FA's window convention
    (query i sits at key i + S - T and sees the keys from `window_size_left` before to `window_size_right` after it,
    None unbounded), GQA, and a backward from the given output and log-sum-exp (a CP block's share of the merged
    attention's gradients), as flash kernels compute it. `calls` counts both (a test that means to run through it
    checks it did)."""
    calls = 0

    @staticmethod
    def _scores(q, k, left, right):
        T, S = q.size(1), k.size(1)
        k = k.repeat_interleave(q.size(2) // k.size(2), dim=2).double()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * q.size(-1) ** -0.5
        at, key = torch.arange(T)[:, None] + S - T, torch.arange(S)[None, :]
        seen = torch.ones(T, S, dtype=torch.bool)
        if left is not None:
            seen &= key >= at - left
        if right is not None:
            seen &= key <= at + right
        return scores.masked_fill(~seen, float("-inf")), k

    @staticmethod
    def _flash_attn_fwd(q, k, v, window_size_left=None, window_size_right=None, return_lse=True):
        assert all(t.stride(-1) == 1 for t in (q, k, v)) and q.dtype == k.dtype == v.dtype  # as FA4 asserts
        FA4Math.calls += 1
        scores, _ = FA4Math._scores(q, k, window_size_left, window_size_right)
        lse = scores.logsumexp(-1)
        p = (scores - cpm.finite(lse)[..., None]).exp()
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(q.size(2) // v.size(2), dim=2).double())
        return out.to(q.dtype), lse.float()

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, window_size_left=None, window_size_right=None):
        assert all(t.stride(-1) == 1 for t in (q, k, v, out, dout)) and out.dtype == dout.dtype == q.dtype
        assert lse.dtype == torch.float32
        FA4Math.calls += 1
        scores, k_heads = FA4Math._scores(q, k, window_size_left, window_size_right)
        v_heads = v.repeat_interleave(q.size(2) // v.size(2), dim=2).double()
        p, dout = (scores - lse.double()[..., None]).exp(), dout.double()
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
        rows = (dout * out.double()).sum(-1).transpose(1, 2)[..., None]
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, v_heads) - rows) * q.size(-1) ** -0.5
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_heads)
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double())
        dk, dv = (t.unflatten(2, (k.size(2), -1)).sum(3) for t in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def use_fa4_math(monkeypatch):
    """CP blocks through the FlashAttention-4 path (any band in one call, on views), FA4Math for its kernels (the
    kernels on, whatever NANOCHAT_KERNELS says; FA4Math.calls from 0)."""
    from nanochat import kernels
    from nanochat.kernels import flash_attention
    monkeypatch.setattr(kernels.KERNELS, "mode", "auto")
    monkeypatch.setattr(kernels, "fa4_runs", lambda device, dtype, head_dim: True)
    monkeypatch.setattr(flash_attention, "_fa4", lambda: FA4Math)
    monkeypatch.setattr(FA4Math, "calls", 0)


@pytest.mark.parametrize("kernel", ["reference", "fa4 bands"])
@pytest.mark.parametrize("one_process", [cpm.ring_in_one_process, spans_in_one_process], ids=["ring", "all-gather"])
@pytest.mark.parametrize("N, window", [(2, 64), (4, 64), (4, 20), (4, 9), (2, 5), (4, 2), (2, 1), (8, 10), (8, 3)])
def test_block_math_and_merge_equal_whole_attention(N, window, one_process, kernel, monkeypatch):
    """Blocks merged by log-sum-exp, and their backward from the merged output, give whole-sequence attention and
    its gradients (SDPA with the dense window mask, GQA 4 query heads over 2 kv heads), with windows from the
    whole sequence down to one token (band blocks with queries that see none of a block's keys), in the ring's
    blocks and in the all-gather's spans; in the reference math, and through the FlashAttention-4 path (every key
    before a chunk as one band; FA's window convention, here as math)."""
    from nanochat.kernels.sdpa import reference_attention
    if kernel == "fa4 bands":
        use_fa4_math(monkeypatch)
    g = torch.Generator().manual_seed(0)
    T = 64
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64).requires_grad_()
    dout = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    whole = reference_attention(q, k, v, window)
    whole.backward(dout)
    out, dq, dk, dv = one_process(q.detach(), k.detach(), v.detach(), dout, N, window)
    for mine, ref in ((out, whole), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine.double(), ref.double(), atol=1e-5, rtol=1e-5)
    assert kernel == "reference" or FA4Math.calls > 0  # the blocks did go through the FlashAttention-4 path


def test_block_window_is_the_band_in_fas_convention():
    """flash_attention.block_window against the definition, every small block: query i (offset + i keys after the
    first) sees key j iff 0 <= offset + i - j < window; FA aligns query i with key i + S - T and sees keys from
    `left` before to `right` after it, None unbounded."""
    from nanochat.kernels.flash_attention import block_window
    for T, S in itertools.product(range(1, 7), repeat=2):
        for offset, window in itertools.product(range(-S, T + S + 2), range(1, T + S + 3)):
            left, right = block_window(offset, window, T, S)
            for i, j in itertools.product(range(T), range(S)):
                at = i + S - T
                fa = (left is None or j >= at - left) and (right is None or j <= at + right)
                assert fa == (0 <= offset + i - j < window), (T, S, offset, window, i, j, left, right)


def contiguous_work(rank, size, T, window):
    """Query-key pairs of rank `rank` were the sequence cut into N contiguous pieces (no head-tail)."""
    from nanochat.kernels.sdpa import band_mask
    c = T // size
    return int(band_mask(c, T, rank * c, window, "cpu").sum())


@pytest.mark.parametrize("N, T, window", [(2, 256, 256), (4, 256, 256), (8, 512, 512), (4, 256, 64), (8, 512, 48)])
def test_head_tail_balances_causal_work(N, T, window):
    """Every rank attends to the same number of query-key pairs (with a window, each token to `window` keys but
    those of the sequence's first window, which attend to fewer), where contiguous pieces would give the last rank
    the most; and all ranks together to the whole causal triangle's (or band's) pairs."""
    from nanochat.kernels.sdpa import band_mask
    work = [cpm.attention_work(r, N, T, window) for r in range(N)]
    assert sum(work) == int(band_mask(T, T, 0, window, "cpu").sum())
    c = T // (2 * N)
    for r in range(N):
        positions = [t for k in cpm.rank_chunks(r, N) for t in range(k * c, (k + 1) * c)]
        if window >= T:  # full context: the same work everywhere
            assert work[r] == work[0], work
        else:  # the full window for every token, less what the sequence's first tokens cannot see
            assert work[r] + sum(window - (t + 1) for t in positions if t + 1 < window) == 2 * c * window, (r, work)
    contiguous = [contiguous_work(r, N, T, window) for r in range(N)]
    assert sum(contiguous) == sum(work) and len(set(contiguous)) > 1, contiguous


class _Layout:  # what ContextParallel reads of a Layout, for the schedule alone (no process group)
    def __init__(self, rank, size):
        self.cp_rank, self.cp_size = rank, size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's and FlashAttention-4's kernels need CUDA")
@pytest.mark.parametrize("kernel", ["as installed", "cudnn"])
@pytest.mark.parametrize("one_process", [cpm.ring_in_one_process, spans_in_one_process], ids=["ring", "all-gather"])
@pytest.mark.parametrize("N, window", [(2, 1024), (4, 1024), (4, 256), (4, 128), (8, 256), (4, 100)])
def test_cp_blocks_in_the_cuda_kernels_match_the_reference_math(N, window, one_process, kernel, monkeypatch):
    """The ring's blocks and the all-gather's spans in the kernels (FlashAttention-4 where installed, any band; else,
    and with `cudnn`, cuDNN: causal, unmasked and upper-triangle masks, other bands in the reference math), bf16,
    against the same all in the reference math (fp32), GQA 4 query heads over 2 kv heads."""
    from nanochat import kernels
    if kernel == "cudnn":  # where FlashAttention-4 is installed, its fallback too
        monkeypatch.setattr(kernels, "fa4_runs", lambda device, dtype, head_dim: False)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(2, 4, 1024, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    got = one_process(q, k, v, dout, N, window)
    saved = kernels.KERNELS.mode
    kernels.set_mode("reference")
    try:
        ref = one_process(q.float(), k.float(), v.float(), dout.float(), N, window)
    finally:
        kernels.set_mode(saved)
    for mine, want in zip(got, ref):
        assert ((mine.float() - want).norm() / want.norm()).item() < 2e-2


def test_window_layers_skip_the_steps_they_do_not_need():
    """At 32K tokens over CP 8 (chunks of 2K), an S layer (window 8K) needs the K/V of the ranks holding the four
    chunks before each of its own: rank 0 (chunks 0, 15) receives from ranks 1-4 only; a full layer every step."""
    T, N = 32768, 8
    plans = {r: cpm.ContextParallel(_Layout(r, N), T, "cpu", "ring") for r in range(N)}
    full = plans[0].schedule(T)
    assert [s for s, receive, send in full] == list(range(1, N)) and all(rec and snd for _, rec, snd in full)
    s_layer = plans[0].schedule(8192)
    assert sorted((0 - s) % N for s, receive, _ in s_layer if receive) == [1, 2, 3, 4]
    # what a rank receives at step s, the rank s before it sends at step s: the tables agree
    for r in range(N):
        for s, receive, _ in plans[r].schedule(8192):
            assert receive == plans[(r - s) % N].schedule(8192)[s - 1][2]
    # a window within one chunk: only the ranks holding the neighbouring chunks
    near = plans[3].schedule(1024)
    assert sorted((3 - s) % N for s, receive, _ in near if receive) == [2, 4]


def test_all_gather_key_spans_are_whole_kernel_blocks():
    """Under the all-gather a query chunk attends to at most three blocks the kernels take whole: its diagonal
    (causal), the keys all its queries see (none) and, for a window of whole chunks, the chunk one window back
    (upper, a chunk's length one window back, whole chunks or not); where the sequence's start cuts that block short,
    a band (the reference math)."""
    from nanochat.kernels.sdpa import block_kind
    cp = cpm.ContextParallel(_Layout(0, 4), 32768, "cpu", "all-gather")  # chunks of 4,096
    kinds = lambda chunk, window: [(lo, hi, block_kind(4096, hi - lo, offset, window))
                                   for lo, hi, offset in cp.key_spans(chunk, window)]
    assert kinds(5, 8192) == [(20480, 24576, "causal"), (16384, 20480, "none"), (12288, 16384, "upper")]
    assert kinds(1, 8192) == [(4096, 8192, "causal"), (0, 4096, "none")]
    assert kinds(0, 8192) == [(0, 4096, "causal")]
    assert kinds(7, 32768) == [(28672, 32768, "causal"), (0, 28672, "none")]
    assert kinds(5, 6000) == [(20480, 24576, "causal"), (18576, 20480, "none"), (14480, 18576, "upper")]
    assert kinds(1, 6000) == [(4096, 8192, "causal"), (2192, 4096, "none"), (0, 2192, "band")]
    # FlashAttention-4 takes any band: a query chunk's diagonal, then every key before it that some query sees
    assert cp.key_spans(5, 8192, bands=True) == [(20480, 24576, 0), (12289, 20480, 8191)]
    assert cp.key_spans(1, 6000, bands=True) == [(4096, 8192, 0), (0, 4096, 4096)]
    assert cp.key_spans(7, 32768, bands=True) == [(28672, 32768, 0), (0, 28672, 28672)]
    assert cp.key_spans(0, 8192, bands=True) == [(0, 4096, 0)]
    with pytest.raises(ValueError, match="'all-gather' or 'ring'"):
        cpm.ContextParallel(_Layout(0, 4), 32768, "cpu", "rings")  # never a silent fall-back to the all-gather


def test_bad_layouts_are_clear_errors():
    from nanochat.gpt import GPTConfig
    from nanochat.recipe import Setting
    with pytest.raises(ConfigError, match=r"--cp 3 cuts each sequence into 2 x 3 = 6 chunks: --max-seq-len \(64\) "
                                          r"must divide by 6"):
        Setting(cp=3, device_batch=1, total_batch=64).check(GPTConfig(sequence_len=64))
    with pytest.raises(ConfigError, match=r"--sequence-parallel with --cp 2: each rank's 6 tokens must divide by --tp 4"):
        Setting(cp=2, tp=4, sequence_parallel=True, device_batch=1, total_batch=12).check(
            GPTConfig(sequence_len=12, n_head=4, n_kv_head=4, n_embd=64, vocab_size=64))
    from nanochat.distributed import build_layout
    from nanochat.common import UserError
    with pytest.raises(UserError, match="world size 6 is not divisible by tp=1 x pp=1 x cp=4"):
        build_layout(0, 6, 0, cp=4)


def test_layout_numbers_tp_fastest_then_cp_then_dp_then_pp():
    from nanochat.distributed import Layout, grid_rank
    L = Layout(dp_size=2, cp_size=2, tp_size=2, pp_size=2, world_size=16)
    ranks = [grid_rank(L, dp=d, cp=c, tp=t, pp=p) for p in range(2) for d in range(2) for c in range(2) for t in range(2)]
    assert ranks == list(range(16))


def test_base_train_cp2_resumes_at_cp1(env):
    """base_train itself: --cp 2 over two ranks trains (the log names the exchange), saves, and resumes at CP 1 with the
    losses it would have had."""
    from conftest import run_script, run_losses, TINY_MODEL
    args = TINY_MODEL + ["--device-batch-size", "4", "--total-batch-size", "512", "--warmup-steps", "2",
                         "--num-iterations", "4", "--save-every", "2", "--model-tag", "cp2", "--eval-every", "4"]
    full = run_script("scripts.base_train", args + ["--cp", "2"], env, nproc=2)
    assert "world 2 = dp 1 x cp 2 x tp 1 x pp 1" in full.stdout
    assert "attention over cp 2, K/V by ring" in full.stdout  # the default at CP 2
    losses = run_losses(env, "cp2")
    run_script("scripts.base_train", args + ["--resume-from-step", "2"], env)
    again = run_losses(env, "cp2")
    assert sorted(again) == [0, 1, 2, 3]
    for s in (2, 3):
        assert abs(again[s] - losses[s]) <= 1e-4 * losses[s], (s, again[s], losses[s])


def test_cp2_fp8():
    """fp8 linears on this rank's tokens: their activations scaled by this rank's amax (as a DP rank's are), so the
    run follows one process's within fp8's own noise (the bounds of tests/test_fp8_parallel.py)."""
    from test_fp8_parallel import FP8, assert_same_fp8_run
    assert_same_fp8_run(run_layout(cp=2, steps=4, config_overrides=FP8, fp8=True),
                        run_layout(steps=4, config_overrides=FP8, fp8=True))


def _exchange_in_bf16(rank, port, out_dir, fa4):
    """One rank of a CP 2 group: both exchanges' forward and backward on bf16 chunks (what a GPU runs), saved; with
    `fa4`, through the FlashAttention-4 path (FA4Math for its kernels)."""
    patches = pytest.MonkeyPatch()  # undone at the end: the pool's processes run other tests after this one
    if fa4:
        use_fa4_math(patches)
    try:
        _exchanges_saved(rank, port, out_dir)
    finally:
        patches.undo()


def _exchanges_saved(rank, port, out_dir):
    import os
    import datetime
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    layout = _Layout(rank, 2)
    layout.cp_group, layout.peer = dist.group.WORLD, lambda cp: cp
    q, k, v, dout = _exchange_inputs()
    results = {}
    for exchange in ("all-gather", "ring"):
        cp = cpm.ContextParallel(layout, q.size(2), "cpu", exchange)
        mine = [cp.local(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v, dout)]
        forward, backward = (cp.ring_forward, cp.ring_backward) if exchange == "ring" else \
            (cp.gather_forward, cp.gather_backward)
        out, lse = forward(*mine[:3], WINDOW_BF16)
        results[exchange] = [out, *backward(mine[3], *mine[:3], out, lse, WINDOW_BF16)]
    results["fa4 calls"] = FA4Math.calls
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


WINDOW_BF16 = 48  # 1.5 chunks at CP 2: upper blocks, and bands where the sequence starts


def _exchange_inputs():  # q, k, v, dout: GQA, 4 query heads over 2 kv heads
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, 128, 16, generator=g).bfloat16() for heads in (4, 2, 2, 4)]


@pytest.mark.parametrize("fa4", [False, True], ids=["blocks", "fa4 bands"])
def test_exchanges_in_bf16_agree_with_whole_attention(tmp_path, fa4):
    """In bf16, as on a GPU (the dK/dV reduce-scatter in K/V's dtype), with GQA and a window of a chunk and a half: both
    exchanges give each rank's chunks of the whole sequence's output and gradients, within bf16's rounding of the fp32
    reference; also through the FlashAttention-4 path (its blocks read the chunks in place, as views)."""
    from parallel_harness import spawn, _free_port
    spawn(_exchange_in_bf16, (_free_port(), str(tmp_path), fa4), 2)
    q, k, v, dout = (t.float() for t in _exchange_inputs())
    want = cpm.ring_in_one_process(q, k, v, dout, 2, WINDOW_BF16)
    for rank in range(2):
        positions = cpm.ContextParallel(_Layout(rank, 2), 128, "cpu", "ring").positions
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (got["fa4 calls"] > 0) == fa4  # through FlashAttention-4's path exactly when asked
        for exchange in ("all-gather", "ring"):
            for mine, whole in zip(got[exchange], want):
                assert mine.dtype == torch.bfloat16
                assert mine.is_contiguous(), (exchange, rank)  # as the custom ops' fakes say (compile checks strides)
                whole = whole.index_select(2, positions)
                error = ((mine.float() - whole).norm() / whole.norm()).item()
                assert error < 5e-3, (exchange, rank, error)
