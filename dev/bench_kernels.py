"""
The kernels of nanochat/kernels/ (and the matmuls they sit between) on one GPU, at one micro-batch of a
depth's training shape, each against what it replaces: outputs and gradients checked first, then timed with
CUDA events (the median of --repeats calls). One subcommand per kernel:

  attention       what kernels.attention runs without flash-attn-4 (cuDNN through SDPA for the full context,
                  FlexAttention with a block mask for the sliding window) against FlashAttention-4, if installed;
                  bf16 in the (B, T, H, D) layout the projections produce. FA4's output and gradients are checked
                  against the other kernel; forward and backward in TFLOP/s over the (query, key) pairs the
                  mask keeps (4 * D FLOPs a pair forward, 10 * D backward).
  matmul          the model's matmul shapes in their three roles, bf16: forward (x @ W^T), input gradient
                  (dy @ W), weight gradient (dy^T @ x); for the weight gradient also the transposed product
                  (x^T @ dy)^T and a manual split-K over s chunks of the tokens (one bmm plus a sum, for outputs
                  too small to fill the SMs in whole waves; kernels.tune_wgrad_splits chooses per shape at the start
                  of training). The roles run in order on a warm GPU: the first of each shape can come out a few %
                  faster than an equal product timed later.
  relu-square-mm  the MLP's two products with ReLU^2 in their epilogues (kernels/relu_square_mm.py) against
                  cuBLAS plus torch.compile's ReLU^2:
                    forward  relu(x @ W_fc^T)^2          (M, C) x (4C, C)^T
                    backward (dy @ W_proj) * 2 sqrt(y)    (M, C) x (C, 4C)
                  in bf16, or with --fp8 as fp8.Fp8MLP runs them (e4m3 x and weights, e5m2 dy, cuBLAS's
                  _scaled_mm with fast accumulation, each side timed up to its output cast to fp8, since the
                  fused kernels hand over their amax and the separate path needs an amax pass). Checked against
                  float32 math, then every tile config of --configs, and the plain product alone (TFLOP/s over
                  the product's FLOPs). The backward's time includes the transposed copy of W_proj it runs from.
  rotary-norm     rotary + QK-norm: the custom op's Triton kernels (kernels/rotary.py) against torch.compile of
                  gpt.rotary_norm's PyTorch math, on q of one micro-batch, bf16. Checked against float64; forward
                  and forward + backward with the bandwidth over the bytes each must move (forward: read x, write
                  y; backward: read x and dy, write dx).
  softcap-ce      the training loss (soft-capped cross-entropy over the vocabulary): kernels/softcap_ce.py's
                  lm_head matmul + Triton kernel as one autograd function against torch.compile of the same math
                  (F.linear, gpt.softcap, cross-entropy). Checked against float64 on a slice of rows; the whole
                  head forward + backward both ways and its three matmuls alone, and the kernel alone, loss only
                  (one read of the logits) and with the gradient (a read and a write).
  ring            context parallelism's ring attention (nanochat/context_parallel.py) at the chunk shapes of each
                  --cps for one sequence of --seq-len: first the ring's arithmetic on this GPU's kernels, every
                  rank's blocks in one process, against one GPU attending the whole sequence (relative errors);
                  then per ring step the time of its blocks' forward and backward (the busiest rank's; in cuDNN
                  and in FlashAttention-4, --block-kernels), the bytes
                  it exchanges (K/V in bf16 each way forward and again backward, dK/dV home in fp32), and at
                  --link-gbs GB/s each way how long the exchange takes against the step's compute: hidden where
                  shorter, the rest exposed; full-context and window layers apart. Against it, one GPU attending
                  the whole sequence (cuDNN full, FlexAttention window).
  l3              L3's lookup over one micro-batch of training tokens (the shards' first batch, the LZW allocation
                  of their first 2M tokens, 2^19 rows, k_max 512): the Triton kernels (kernels/l3_lookup.py)
                  against the blocked bmm path, bf16, forward + backward with the table's gradient summed into a
                  .grad as in a step. Checked against each other; then each timed, and the kernels' forward alone;
                  with --grad-table, the kernels again with the table gradient's kernel in other tilings.
  fp8-shards      fp8 against bf16 for the matmuls one rank of a tensor-parallel model runs: each linear of a
                  block at its shard's shape (the q, k, v column shards n_embd -> its heads, attention's c_proj
                  row shard, the MLP's shard n_embd -> 4 n_embd / tp -> n_embd), forward + backward, compiled
                  as training compiles them (the fp8 casts and amaxes fuse only under torch.compile). fp8 is
                  fp8.Fp8Linear and fp8.Fp8MLP (ReLU^2 inside the products), bf16 kernels.Linear and gpt.MLP (its
                  fused ReLU^2 kernels); weights fp32 as in training, activations bf16. Under TP each shard is
                  cast with its own amax (fp8.py), as here: one GPU times a rank's work.

    python -m dev.bench_kernels attention --depth 20 --device-batch-size 32
    python -m dev.bench_kernels matmul --depth 20 --device-batch-size 32
    python -m dev.bench_kernels relu-square-mm --depth 20 --device-batch-size 64 [--fp8]
    python -m dev.bench_kernels relu-square-mm --configs 128,256,64,8,3,8 256,128,64,4,3,8
    python -m dev.bench_kernels rotary-norm --depth 20 --device-batch-size 32
    python -m dev.bench_kernels softcap-ce                       # 32 x 2048 tokens at d12 (dim 768), vocab 32768
    python -m dev.bench_kernels ring --depth 12 --seq-len 32768 --cps 2,4,8
    python -m dev.bench_kernels l3 --depth 12                    # needs data and a tokenizer, as base_train
    python -m dev.bench_kernels l3 --grad-table 32,128,4 64,64,4 64,128,8
    python -m dev.bench_kernels fp8-shards                       # d32 at TP=2, 16 x 2048 tokens
    python -m dev.bench_kernels fp8-shards --depth 26 --tp 4 --device-batch-size 8

Needs a CUDA GPU with Triton; FlashAttention-4 (`pip install -e ".[fa4]"`) for its rows; torchao and an SM89+
GPU for --fp8 and fp8-shards.
"""

import copy
import argparse
import contextlib

import torch
import torch.nn.functional as F

from dev import runs
from nanochat.common import cuda_time_ms, fail
from nanochat.gpt import window_sizes, rotary_tables, MLP
from nanochat.recipe import config_for_depth
from nanochat import gpt, kernels
from nanochat.kernels import Linear, flash_attention, sdpa
from nanochat.kernels import relu_square_mm as rsm
from nanochat.kernels.rotary import rotary_norm_op
from nanochat.kernels.softcap_ce import kernel_head_losses, _row_losses


def rel_err(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


@contextlib.contextmanager
def reference_math():
    """The kernels switched off (as --kernels reference): gpt.py's functions run their PyTorch math."""
    saved = kernels.KERNELS.mode
    kernels.set_mode("reference")
    try:
        yield
    finally:
        kernels.set_mode(saved)


def in_reference(fn):
    """fn, called with the kernels off (also for torch.compile of fn: its graph guards on the switch)."""
    def run(*a):
        with reference_math():
            return fn(*a)
    return run


# -----------------------------------------------------------------------------
# attention


def attention(args):
    cfg = config_for_depth(args.depth, sequence_len=args.seq_len, window_pattern="SSSL")
    B, T, H, D = args.device_batch_size, args.seq_len, cfg.n_head, cfg.head_dim
    device = torch.device("cuda", torch.cuda.current_device())
    has_fa4 = kernels.fa4_runs(device, torch.bfloat16, D)
    print(f"depth {args.depth}: B {B}, T {T}, H {H}, D {D}; {torch.cuda.get_device_name()}; "
          f"flash-attn-4 {'available' if has_fa4 else 'NOT available: timing only the PyTorch kernels'}")
    windows = sorted(set(window_sizes(cfg)), reverse=True)
    masks = {w: sdpa.block_mask(T, w, device) for w in windows if w < T}  # FlexAttention's, for the window
    sdpa.prepare_flex()
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, H, D, device=device).bfloat16() for _ in range(4))

    def pytorch_kernel(window):
        """kernels.attention's kernel without FA4 (cuDNN full, FlexAttention windowed), on (B, T, H, D) tensors."""
        run = sdpa.cudnn_attention if window >= T else (lambda q, k, v: sdpa.flex_attention(q, k, v, masks[window]))
        return lambda q, k, v: run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def fa4_kernel(window):
        return lambda q, k, v: flash_attention.flash_attention(q, k, v, window)[0]

    def forward_backward(fn):
        """A callable running fn's forward and backward; it returns the output and the three gradients."""
        def run():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)
            out.backward(dout)
            return [out.detach()] + [t.grad for t in inputs]
        return run

    for window in windows:
        pairs = sum(min(i + 1, window) for i in range(T)) * B * H
        name = "full context" if window >= T else f"window {window}"
        fns = {"cuDNN (SDPA)" if window >= T else "FlexAttention": pytorch_kernel(window)}
        if has_fa4:
            fns["FlashAttention-4"] = fa4_kernel(window)
            ref, got = (forward_backward(fn)() for fn in fns.values())
            print(f"{name}: FA4 against {next(iter(fns))}, relative error: " +
                  ", ".join(f"{n} {rel_err(g, r):.1e}" for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)))
        for kname, fn in fns.items():
            fwd = cuda_time_ms(lambda: fn(q, k, v), args.repeats)
            bwd = cuda_time_ms(forward_backward(fn), args.repeats) - fwd
            print(f"{name:<14} {kname:<18} forward {fwd:7.3f} ms ({4 * D * pairs / fwd / 1e9:5.0f} TFLOP/s)   "
                  f"backward {bwd:7.3f} ms ({10 * D * pairs / bwd / 1e9:5.0f} TFLOP/s)")


# -----------------------------------------------------------------------------
# ring (context parallelism)


def ring(args):
    from nanochat import context_parallel as cpm
    cfg = config_for_depth(args.depth, sequence_len=args.seq_len, window_pattern="SSSL")
    B, T, H, Hkv, D = args.device_batch_size, args.seq_len, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    device = torch.device("cuda", torch.cuda.current_device())
    windows = sorted(set(window_sizes(cfg)), reverse=True)
    print(f"depth {args.depth}: B {B}, T {T}, heads {H} (kv {Hkv}), D {D}; {torch.cuda.get_device_name()}; "
          f"windows {windows}; link {args.link_gbs} GB/s each way")
    torch.manual_seed(0)
    q, dout = (torch.randn(B, H, T, D, device=device).bfloat16() for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, device=device).bfloat16() for _ in range(2))
    masks = {w: sdpa.block_mask(T, w, device) for w in windows if w < T}
    sdpa.prepare_flex()

    def whole(window):  # one GPU: cuDNN for the full context, FlexAttention for a window
        return (lambda q, k, v: sdpa.cudnn_attention(q, k, v)) if window >= T else \
            (lambda q, k, v: sdpa.flex_attention(q, k, v, masks[window]))

    def forward_backward(fn):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in inputs]

    for N in args.cps:
        c = T // (2 * N)
        kv_bytes = 2 * B * Hkv * 2 * c * D * 2  # a rank's K and V, bf16
        home_bytes = 2 * kv_bytes  # their gradients, fp32
        for window in windows:
            name = "full" if window >= T else f"window {window}"
            plans = [cpm.ContextParallel(_RingLayout(r, N), T, device, "ring") for r in range(N)]
            # the arithmetic: every rank's blocks merged, then their backward, against the whole sequence at once
            ref = forward_backward(whole(window))
            got = cpm.ring_in_one_process(q, k, v, dout, N, window)
            print(f"CP {N} {name}: against one GPU, relative error " +
                  ", ".join(f"{n} {rel_err(g, r):.1e}" for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)))
            one_f = cuda_time_ms(lambda: whole(window)(q, k, v), args.repeats)
            one_b = cuda_time_ms(lambda: forward_backward(whole(window)), args.repeats) - one_f
            print(f"  one GPU, whole sequence: {one_f:.3f} + {one_b:.3f} = {one_f + one_b:.3f} ms (ideal per rank "
                  f"{(one_f + one_b) / N:.3f} ms)")
            fwd_link = kv_bytes / (args.link_gbs * 1e9) * 1e3  # ms
            bwd_link = (kv_bytes + home_bytes) / (args.link_gbs * 1e9) * 1e3
            print(f"  exchanged per step: K/V {kv_bytes / 2**20:.1f} MiB ({fwd_link:.3f} ms at the link), backward "
                  f"+ dK/dV {home_bytes / 2**20:.1f} MiB ({bwd_link:.3f} ms)")
            for backend in args.block_kernels:
                if backend == "fa4" and not kernels.fa4_runs(q.device, q.dtype, q.size(-1)):
                    print("  fa4: flash-attn-4 does not run here (not installed, or not sm90/sm100)")
                    continue
                # per step s, the busiest rank's blocks (0: its own), forward and backward
                rows = []
                for s in range(N):
                    fwd = bwd = 0.0
                    for r, plan in enumerate(plans):
                        pairs = plan.visible_pairs(r, (r - s) % N, window)
                        if pairs:
                            f, b = time_blocks(q, k, v, dout, plan, (r - s) % N, pairs, window, backend, args.repeats)
                            fwd, bwd = max(fwd, f), max(bwd, b)
                    if fwd:
                        rows.append((s, fwd, bwd))
                # step s's compute hides step s+1's transfer: what the link takes beyond it is exposed
                exposed_f = sum(max(0.0, fwd_link - f) for _, f, _ in rows[:-1])
                exposed_b = sum(max(0.0, bwd_link - b) for _, _, b in rows[:-1])
                ring_f, ring_b = sum(r[1] for r in rows), sum(r[2] for r in rows)
                print(f"  {backend}: steps taken {len(rows)} of {N}; per step (ms, forward / backward): " +
                      "  ".join(f"s{s} {f:.3f}/{b:.3f}" for s, f, b in rows))
                print(f"  {backend}: ring compute forward {ring_f:.3f} + backward {ring_b:.3f} = {ring_f + ring_b:.3f} ms "
                      f"per rank, {(ring_f + ring_b) / ((one_f + one_b) / N):.2f}x the ideal; exposed at the link: "
                      f"forward {exposed_f:.3f} ms, backward {exposed_b:.3f} ms")


def block_kernels(text):
    names = text.split(",")
    if not set(names) <= {"cudnn", "fa4"}:
        raise argparse.ArgumentTypeError(f"{text!r}: name cudnn and/or fa4, comma-separated")
    return names


class _RingLayout:  # what ContextParallel reads of a Layout where no process group is needed
    def __init__(self, rank, size):
        self.cp_rank, self.cp_size = rank, size


def time_blocks(q, k, v, dout, plan, source, pairs, window, backend, repeats):
    """(forward ms, backward ms) of one ring step's blocks on plan's rank with source's K/V in `backend`'s kernel:
    each block's attention and merge, then each block's backward."""
    from nanochat import context_parallel as cpm
    c = plan.chunk
    qs = [slice(i * c, (i + 1) * c) for i in cpm.rank_chunks(plan.rank, plan.size)]
    ks = [slice(i * c, (i + 1) * c) for i in cpm.rank_chunks(source, plan.size)]
    blocks = [(q[:, :, qs[a]], k[:, :, ks[b]], v[:, :, ks[b]], dout[:, :, qs[a]], offset) for a, b, offset in pairs]

    def reference(fn, *args):  # a block `backend` does not take: the reference math (as training runs), no other kernel
        saved = kernels.set_mode("reference")
        try:
            return fn(*args)
        finally:
            kernels.set_mode(saved)

    def forward(qb, kb, vb, o):
        if kernels.takes_attention_block(qb, kb, o, window, backend):
            return kernels.attention_block(qb, kb, vb, o, window, backend)
        return reference(cpm.block_attention, qb, kb, vb, o, window)

    def backward(db, qb, kb, vb, out, lse, o):
        if kernels.takes_attention_block(qb, kb, o, window, backend):
            return kernels.attention_block_backward(db, qb, kb, vb, out, lse, o, window, backend)
        return reference(cpm.block_attention_backward, db, qb, kb, vb, out, lse, o, window)

    outs = [forward(qb, kb, vb, o) for qb, kb, vb, _, o in blocks]
    fwd = cuda_time_ms(lambda: [cpm.merge([forward(qb, kb, vb, o)]) for qb, kb, vb, _, o in blocks], repeats)
    bwd = cuda_time_ms(lambda: [backward(db, qb, kb, vb, out, lse, o)
                                for (qb, kb, vb, db, o), (out, lse) in zip(blocks, outs)], repeats)
    return fwd, bwd


# -----------------------------------------------------------------------------
# matmul


def matmul_roles(name, n_in, n_out, M, repeats):
    """Time one linear's products on M tokens (its tensors are freed on return, before the next shape's)."""
    x = torch.randn(M, n_in, device="cuda").bfloat16()
    w = torch.randn(n_out, n_in, device="cuda").bfloat16()
    dy = torch.randn(M, n_out, device="cuda").bfloat16()
    flop = 2 * M * n_in * n_out
    roles = {"forward x @ W^T": lambda: x @ w.t(),
             "input grad dy @ W": lambda: dy @ w,
             "weight grad dy^T @ x": lambda: dy.t() @ x,
             "weight grad (x^T @ dy)^T": lambda: (x.t() @ dy).t()}
    for s in (2, 3, 4):
        if M % s == 0:
            roles[f"weight grad split-K {s} (bmm)"] = (
                lambda s=s: torch.bmm(dy.view(s, M // s, n_out).transpose(1, 2), x.view(s, M // s, n_in)).sum(0))
    for role, fn in roles.items():
        ms = cuda_time_ms(fn, repeats)
        print(f"{name:<22} {str((n_in, n_out)):<14} {role:<28} {ms:7.3f} {flop / ms / 1e9:8.1f}")


def matmul(args):
    d = config_for_depth(args.depth).n_embd
    M = args.device_batch_size * args.seq_len
    shapes = {"attention q/k/v/proj": (d, d), "MLP up": (d, 4 * d), "MLP down": (4 * d, d), "lm_head": (d, args.vocab)}
    print(f"depth {args.depth}: d {d}, {M} tokens per micro-batch; {torch.cuda.get_device_name()}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    print(f"{'linear':<22} {'(in, out)':<14} {'role':<28} {'ms':>7} {'TFLOP/s':>8}")
    for name, (n_in, n_out) in shapes.items():
        matmul_roles(name, n_in, n_out, M, args.repeats)


# -----------------------------------------------------------------------------
# relu-square-mm


def relu_square_mm(args):
    configs = args.configs or sorted({",".join(map(str, c)) for (_, fp8), c in rsm.CONFIGS.items() if fp8 == args.fp8})
    cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
    M, C = args.device_batch_size * args.seq_len, cfg.n_embd
    torch.manual_seed(0)
    x = torch.randn(M, C, device="cuda").bfloat16()
    dy = torch.randn(M, C, device="cuda").bfloat16()
    w_fc = (torch.randn(4 * C, C, device="cuda") / C ** 0.5).bfloat16()
    w_proj = (torch.randn(C, 4 * C, device="cuda") / (4 * C) ** 0.5).bfloat16()
    tflop = 2 * M * C * 4 * C / 1e12
    print(f"depth {args.depth}: M={M} tokens, C={C}; each product {tflop:.2f} TFLOP; {'fp8' if args.fp8 else 'bf16'}")
    compiled = lambda fn: torch.compile(fn, dynamic=False)

    if args.fp8:
        from nanochat.fp8 import E4M3, E5M2, to_fp8, scaled_mm  # the casts and products of fp8.Fp8MLP (needs torchao)

        x_op, x_inv = to_fp8(x, E4M3)
        dy_op, dy_inv = to_fp8(dy, E5M2)
        w_fc_op, w_fc_inv = to_fp8(w_fc, E4M3)
        w_proj_op, w_proj_inv = to_fp8(w_proj, E4M3)
        w_proj_t_op = w_proj_op.t().contiguous()
        fwd_scale, bwd_scale = x_inv * w_fc_inv, dy_inv * w_proj_inv
        fwd_product = lambda: scaled_mm(x_op, w_fc_op, x_inv, w_fc_inv, torch.bfloat16)
        bwd_product = lambda: scaled_mm(dy_op, w_proj_t_op, dy_inv, w_proj_inv, torch.bfloat16)
        relu_square_cast = compiled(lambda h: to_fp8(F.relu(h).square(), E4M3))
        relu_square_grad_cast = compiled(lambda g, y: to_fp8(2 * y.float().sqrt() * g, E5M2))
        cast_known_amax = compiled(to_fp8)
        y = F.relu(fwd_product()).square()
        separate_fwd = lambda: relu_square_cast(fwd_product())
        separate_bwd = lambda: relu_square_grad_cast(bwd_product(), y)

        def fused_fwd(config):  # the output, after the cast that c_proj's product needs
            y, amax = rsm._launch(x_op, w_fc_op, rsm.RELU_SQUARE, config=config, scale=fwd_scale, out_dtype=torch.bfloat16)
            cast_known_amax(y, E4M3, amax)
            return y

        def fused_bwd(config):  # the output, after the cast that c_fc's backward products need
            grad_h, amax = rsm._launch(dy_op, w_proj_t_op, rsm.RELU_SQUARE_GRAD, y=y, config=config, scale=bwd_scale,
                                       out_dtype=torch.bfloat16)
            cast_known_amax(grad_h, E5M2, amax)
            return grad_h

        ref_x, ref_dy = x_op.float() * x_inv, dy_op.float() * dy_inv
        ref_w_fc, ref_w_proj = w_fc_op.float() * w_fc_inv, w_proj_op.float() * w_proj_inv
    else:
        fwd_product = lambda: x @ w_fc.t()
        bwd_product = lambda: dy @ w_proj
        relu_square = compiled(lambda h: F.relu(h).square())
        relu_square_grad = compiled(lambda g, y: 2 * y.sqrt() * g)
        y = relu_square(fwd_product())
        separate_fwd = lambda: relu_square(fwd_product())
        separate_bwd = lambda: relu_square_grad(bwd_product(), y)
        fused_fwd = lambda config: rsm._launch(x, w_fc, rsm.RELU_SQUARE, config=config)
        fused_bwd = lambda config: rsm._launch(dy, w_proj.t().contiguous(), rsm.RELU_SQUARE_GRAD, y=y, config=config)
        ref_x, ref_dy, ref_w_fc, ref_w_proj = x.float(), dy.float(), w_fc.float(), w_proj.float()

    rows = slice(0, 4096)  # the check on a slice of the rows, in float32
    ref_y = F.relu(ref_x[rows] @ ref_w_fc.t()).square()
    ref_dh = (ref_dy[rows] @ ref_w_proj) * 2 * y[rows].float().sqrt()

    print(f"{'':<34}{'forward':>20}{'backward':>20}")
    fwd_mm = cuda_time_ms(fwd_product, args.repeats)
    bwd_mm = cuda_time_ms(bwd_product, args.repeats)
    print(f"{'cuBLAS product alone':<34}{fwd_mm:9.3f} ms ({tflop / fwd_mm * 1e3:4.0f} TF/s){bwd_mm:9.3f} ms "
          f"({tflop / bwd_mm * 1e3:4.0f} TF/s)")
    fwd = cuda_time_ms(separate_fwd, args.repeats)
    bwd = cuda_time_ms(separate_bwd, args.repeats)
    label = "cuBLAS + compiled ReLU^2" + (" + cast" if args.fp8 else "")
    print(f"{label:<34}{fwd:9.3f} ms{'':>11}{bwd:9.3f} ms")
    for text in configs:
        config = tuple(int(v) for v in text.split(","))
        try:
            err_f = rel_err(fused_fwd(config)[rows], ref_y)
            err_b = rel_err(fused_bwd(config)[rows], ref_dh)
            f, b = cuda_time_ms(lambda: fused_fwd(config), args.repeats), cuda_time_ms(lambda: fused_bwd(config), args.repeats)
            print(f"{'fused ' + text:<34}{f:9.3f} ms ({tflop / f * 1e3:4.0f} TF/s){b:9.3f} ms ({tflop / b * 1e3:4.0f} TF/s)"
                  f"   err {err_f:.1e} / {err_b:.1e}   vs separate {fwd / f:.3f}x / {bwd / b:.3f}x")
        except Exception as e:  # a config that does not compile (shared memory, registers): say so, go on
            print(f"{'fused ' + text:<34} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


# -----------------------------------------------------------------------------
# rotary-norm


def rotary_norm(args):
    cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
    B, T, H, D = args.device_batch_size, args.seq_len, cfg.n_head, cfg.head_dim
    torch.manual_seed(0)
    x = torch.randn(B, T, H, D, device="cuda").bfloat16()
    dy = torch.randn(B, T, H, D, device="cuda").bfloat16()
    cos, sin = (t[:, :T].to("cuda", torch.bfloat16) for t in rotary_tables(T, D))
    kernel = lambda x, cos, sin: rotary_norm_op(x, cos, sin, gpt.QK_SCALE)
    math = in_reference(gpt.rotary_norm)

    # --- correctness on the first sequence, against float64 of the same bf16 inputs ---
    xs = x[:1].clone().requires_grad_()
    kernel(xs, cos, sin).backward(dy[:1])
    ref_x = x[:1].double().requires_grad_()
    ref = math(ref_x, cos.double(), sin.double())
    ref.backward(dy[:1].double())
    y = kernel(x[:1], cos, sin)
    print(f"vs float64 on one sequence: output relative error {((y.double() - ref).norm() / ref.norm()).item():.2e}, "
          f"gradient relative error {((xs.grad.double() - ref_x.grad).norm() / ref_x.grad.norm()).item():.2e}")

    def forward_backward(fn):
        def run():
            xr = x.detach().requires_grad_()
            fn(xr, cos, sin).backward(dy)
        return run

    gb = x.numel() * x.element_size() / 1e9
    compiled = in_reference(torch.compile(gpt.rotary_norm, dynamic=False))
    for name, fn in (("torch.compile of the PyTorch math", compiled), ("custom op (Triton kernels)", kernel)):
        fwd = cuda_time_ms(lambda: fn(x, cos, sin), args.repeats)
        both = cuda_time_ms(forward_backward(fn), args.repeats)
        print(f"{name:<36} forward {fwd:6.3f} ms ({2 * gb / fwd:.2f} TB/s)   "
              f"forward + backward {both:6.3f} ms ({5 * gb / both:.2f} TB/s over 5 passes of {gb:.2f} GB)")


# -----------------------------------------------------------------------------
# softcap-ce


def softcap_ce(args):
    N, D, V = args.device_batch_size * args.seq_len, config_for_depth(args.depth).n_embd, args.vocab
    print(f"depth {args.depth}: {N} tokens, dim {D}, vocab {V}")
    torch.manual_seed(0)
    x = torch.randn(N, D, device="cuda").bfloat16()
    w = (torch.randn(V, D, device="cuda") * 4 / D ** 0.5).bfloat16()  # logits with a spread of ~4
    targets = torch.randint(0, V, (N,), device="cuda")
    targets[::97] = -1
    head_loss = lambda x, w, t: gpt.reduce_losses(kernel_head_losses(x, w, t, gpt.SOFTCAP), t, "mean")
    math = lambda x, w, t: F.cross_entropy(gpt.softcap(F.linear(x, w)), t, ignore_index=-1)

    # --- correctness on the first rows, against float64 of the same (bf16-rounded) logits ---
    rows = 512
    xs, ws = x[:rows].clone().requires_grad_(), w.clone().requires_grad_()
    head_loss(xs, ws, targets[:rows]).backward()
    raw = (x[:rows] @ w.t()).double().requires_grad_()
    ref = F.cross_entropy(gpt.SOFTCAP * torch.tanh(raw / gpt.SOFTCAP), targets[:rows], ignore_index=-1)
    ref.backward()
    ref_gx = raw.grad @ w.double()
    mine = head_loss(x[:rows], w, targets[:rows])
    print(f"vs float64 on {rows} rows: loss error {abs(mine.item() - ref.item()):.2e}, "
          f"x gradient relative error {((xs.grad.double() - ref_gx).norm() / ref_gx.norm()).item():.2e}")

    def head_step(loss_fn):
        def run():
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            loss_fn(xr, wr, targets).backward()
        return run

    def matmuls_only():
        logits = x @ w.t()
        logits @ w, logits.t() @ x

    logits = x @ w.t()
    results = {
        "head: torch.compile of the PyTorch math": cuda_time_ms(head_step(torch.compile(math, dynamic=False)), args.repeats),
        "head: head_loss (matmul + Triton kernel)": cuda_time_ms(head_step(head_loss), args.repeats),
        "head: its three matmuls alone": cuda_time_ms(matmuls_only, args.repeats),
        "kernel: loss only": cuda_time_ms(lambda: _row_losses(logits, targets, False, gpt.SOFTCAP), args.repeats),
        "kernel: loss and gradient": cuda_time_ms(lambda: _row_losses(logits, targets, True, gpt.SOFTCAP), args.repeats),
    }
    gb = N * V * logits.element_size() / 1e9
    for name, ms in results.items():
        passes = {"kernel: loss only": 1, "kernel: loss and gradient": 2}.get(name)
        bw = f"  ({passes * gb / ms:.2f} TB/s over {passes} pass{'es' if passes > 1 else ''} of {gb:.1f} GB)" if passes else ""
        print(f"{name:<44} {ms:7.2f} ms{bw}")


# -----------------------------------------------------------------------------
# l3


def l3_lookup(args):
    import numpy as np
    from nanochat import l3
    from nanochat.dataloader import BestFitPacker
    from nanochat.kernels import l3_lookup as l3_lookup_module
    from nanochat.kernels.l3_lookup import Lookup
    from nanochat.tokenizer import get_tokenizer
    tokenizer, D = get_tokenizer(), config_for_depth(args.depth).n_embd
    layer = l3.L3Layer(tokenizer.get_vocab_size(), D, 1 << 19).cuda()
    layer.init_weights()
    tokens = l3.sample_training_tokens(tokenizer, None, 2_000_000)
    d = l3.allocate_rows(l3.lzw_credits(tokens, layer.vocab_size), layer.n_emb, layer.k_max)
    layer.set_allocation(d, float((np.bincount(tokens, minlength=layer.vocab_size) * d).sum() / tokens.size))
    ids = BestFitPacker(tokenizer, args.device_batch_size, args.seq_len).next_block()[:, :-1].reshape(-1)
    plan = l3._Plan(ids.astype(np.int64), layer.bounds.cpu().numpy(), l3.L3_BLOCK_POSITIONS, layer.k_max, pin=True)
    print(f"depth {args.depth}: {ids.size} tokens, dim {D}, {layer.n_emb:,} rows, {len(plan.widths)} blocks, "
          f"{float(layer.rows_per_token):.1f} rows a token on average")
    torch.manual_seed(0)
    x = torch.randn(ids.size, D, device="cuda").bfloat16().requires_grad_()
    g, table = torch.randn_like(x), layer.key_table
    tc = table.detach().bfloat16()
    paths = {"Triton kernels": lambda: Lookup.apply(x, table, tc, plan, table),
             "blocked bmm": lambda: l3._BlockedLookup.apply(x, table, tc, plan, l3.L3_CHUNK_BYTES, table)}
    results = {}
    for name, lookup in paths.items():
        x.grad = table.grad = None
        h = lookup()
        h.backward(g)
        results[name] = (h, x.grad, table.grad)
    for what, mine, ref in zip(("h", "dx", "dtable"), *results.values()):
        print(f"{what}: relative difference of the kernels from the bmm path {rel_err(mine, ref):.2e}")

    def step(lookup):
        def run():
            x.grad = table.grad = None
            lookup().backward(g)
        return run
    for name, lookup in paths.items():
        print(f"{name + ', forward + backward':<40} {cuda_time_ms(step(lookup), args.repeats):7.2f} ms")
    with torch.no_grad():
        print(f"{'Triton kernels, forward':<40} {cuda_time_ms(paths['Triton kernels'], args.repeats):7.2f} ms")
    default, kernels_grad = l3_lookup_module.GRAD_TABLE, results["Triton kernels"][2]
    for tiling in args.grad_table or []:  # the table gradient's kernel in other tilings, forward + backward
        l3_lookup_module.GRAD_TABLE = tiling
        ms = cuda_time_ms(step(paths["Triton kernels"]), args.repeats)  # leaves the last call's table.grad
        name = "Triton kernels, grad_table " + ",".join(map(str, tiling))
        print(f"{name:<40} {ms:7.2f} ms (dtable {rel_err(table.grad, kernels_grad):.1e} from the tiling {default})")
    l3_lookup_module.GRAD_TABLE = default


# -----------------------------------------------------------------------------
# fp8-shards


def fp8_shards(args):
    from nanochat.fp8 import convert_to_fp8, fp8_unavailable_reason
    from nanochat.recipe import Setting
    if reason := fp8_unavailable_reason(torch.device("cuda")):
        fail(f"fp8-shards: {reason}")
    cfg = config_for_depth(args.depth, sequence_len=args.seq_len)
    try:
        Setting(tp=args.tp, device_batch=1, total_batch=cfg.sequence_len).check(cfg)
    except ValueError as e:
        fail(str(e))
    C, hd, tp = cfg.n_embd, cfg.head_dim, args.tp
    M = args.device_batch_size * args.seq_len
    q_out, kv_out = cfg.n_head * hd // tp, cfg.n_kv_head * hd // tp
    mlp = MLP(cfg)
    mlp.c_fc, mlp.c_proj = Linear(C, 4 * C // tp), Linear(4 * C // tp, C)  # this rank's shard of the MLP
    shards = [("q (column)", Linear(C, q_out)), ("k (column)", Linear(C, kv_out)), ("v (column)", Linear(C, kv_out)),
              ("attention c_proj (row)", Linear(q_out, C)), ("MLP c_fc (column) + c_proj (row)", mlp)]
    torch.manual_seed(0)

    def fwd_bwd_ms(module, n_in, n_out):
        """Forward + backward (input and weight gradients) of the compiled module on one micro-batch."""
        step = torch.compile(module, dynamic=False)
        x = torch.randn(M, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, n_out, device="cuda", dtype=torch.bfloat16)
        params = list(module.parameters())
        return cuda_time_ms(lambda: torch.autograd.grad(step(x), [x, *params], dy), args.repeats)

    pairs = []  # (name, bf16 module, its fp8 copy), converted before the table (convert_to_fp8 prints a line)
    for name, module in shards:
        module = module.cuda()
        for p in module.parameters():
            torch.nn.init.normal_(p, std=p.size(1) ** -0.5)
        holder = torch.nn.Sequential(copy.deepcopy(module))
        assert convert_to_fp8(holder, torch.device("cuda")) > 0, name
        pairs.append((name, module, holder[0]))

    print(f"depth {args.depth} at TP={tp}, one rank's shards: n_embd {C}, {M:,} tokens per micro-batch "
          f"({args.device_batch_size} x {args.seq_len}); {torch.cuda.get_device_name()}; forward + backward, compiled")
    print(f"{'linear':<36}{'(in, out)':>16}{'bf16 ms':>10}{'fp8 ms':>10}{'bf16/fp8':>10}")
    total_bf16 = total_fp8 = 0.0
    for name, module, fp8_module in pairs:
        n_in, n_out = (C, C) if module is mlp else (module.in_features, module.out_features)
        shape = f"({C}, {4 * C // tp}, {C})" if module is mlp else f"({n_in}, {n_out})"
        bf16_ms, fp8_ms = fwd_bwd_ms(module, n_in, n_out), fwd_bwd_ms(fp8_module, n_in, n_out)
        total_bf16, total_fp8 = total_bf16 + bf16_ms, total_fp8 + fp8_ms
        print(f"{name:<36}{shape:>16}{bf16_ms:10.3f}{fp8_ms:10.3f}{bf16_ms / fp8_ms:9.3f}x")
    print(f"{'a block (sum of the above)':<36}{'':>16}{total_bf16:10.3f}{total_fp8:10.3f}{total_bf16 / total_fp8:9.3f}x")


# -----------------------------------------------------------------------------


def add_micro_batch_args(parser, depth=20, device_batch_size=32):
    """The micro-batch every subcommand times: one of a depth's training shape."""
    parser.add_argument("--depth", type=int, default=depth, help="model depth (the shapes)")
    parser.add_argument("--device-batch-size", type=int, default=device_batch_size, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    sub = parser.add_subparsers(dest="kernel", required=True, metavar="KERNEL")

    def add(name, run, help, **micro_batch):
        p = sub.add_parser(name, help=help, formatter_class=runs.HelpFormatter)
        add_micro_batch_args(p, **micro_batch)
        p.set_defaults(run=run)
        return p

    add("attention", attention, "cuDNN / FlexAttention against FlashAttention-4")
    add("matmul", matmul, "the model's matmul shapes in their three roles").add_argument(
        "--vocab", type=int, default=32768, help="the lm_head's output size")
    p = add("relu-square-mm", relu_square_mm, "the MLP's products with ReLU^2 in their epilogues")
    p.add_argument("--fp8", action="store_true", help="fp8 operands (tensorwise scales), as fp8.Fp8MLP")
    p.add_argument("--configs", nargs="*", default=None, help="tile configs BLOCK_M,BLOCK_N,BLOCK_K,GROUP_M,stages,warps "
                                                              "(default: the ones relu_square_mm.CONFIGS picks)")
    add("rotary-norm", rotary_norm, "rotary + QK-norm: Triton kernels against compiled PyTorch")
    add("softcap-ce", softcap_ce, "the soft-capped loss: lm_head + Triton kernel against compiled PyTorch",
        depth=12).add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    p = add("ring", ring, "context parallelism's ring: its blocks per step against one GPU, and the exchange",
            depth=12, device_batch_size=1)
    p.add_argument("--cps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8], help="CP degrees")
    p.add_argument("--link-gbs", type=float, default=450.0, help="GB/s each way between two ranks (NVLink: ~450)")
    p.add_argument("--block-kernels", type=block_kernels, default=["cudnn", "fa4"],
                   help="kernels of the blocks to time: cudnn (causal, unmasked and upper; bands in the reference "
                        "math), fa4 (any band)")
    add("l3", l3_lookup, "L3's lookup: Triton kernels against the blocked bmm path", depth=12).add_argument(
        "--grad-table", nargs="*", type=lambda s: tuple(int(v) for v in s.split(",")), default=None,
        help="tilings POSITIONS,CHANNELS,WARPS of the table gradient's kernel to time besides its own")
    add("fp8-shards", fp8_shards, "fp8 against bf16 for one tensor-parallel rank's linears", depth=32,
        device_batch_size=16).add_argument("--tp", type=int, default=2,
                                           help="the tensor-parallel degree whose per-rank shapes are timed")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        fail(f"dev.bench_kernels {args.kernel} times kernels on a CUDA GPU; this machine has none")
    args.run(args)


if __name__ == "__main__":
    main()
