"""Session 10 experiment (speed36.sh): does the fused backward gain from loading its y tile before the K loop?
relu_square_mm's kernel loads y through TMA after the loop, which stalls the program; here y comes through plain
pointer loads issued before the loop (the registers are only waited on at first use, at the end). Same tiles,
same order; timed against relu_square_mm's kernel at d20 b64 and d12 b128 shapes."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanochat import relu_square_mm as rsm
from nanochat.common import cuda_time_ms


@triton.jit
def _grad_kernel(a_desc, b_desc, c_desc, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
        first_m = tile // tiles_per_group * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        in_group = tile % tiles_per_group
        off_m = (first_m + in_group % group_rows) * BLOCK_M
        off_n = in_group // group_rows * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        y = tl.load(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :])  # issued now, used after the loop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([off_n, k]).T, acc)
        acc = acc * (2.0 * tl.sqrt(y.to(tl.float32)))
        left, right = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))
        c_desc.store([off_m, off_n], left.to(c_desc.dtype))
        c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))


def launch(dy, w_proj_t, y, config):
    bm, bn, bk, gm, stages, warps = config
    M, K = dy.shape
    N = w_proj_t.size(0)
    c = torch.empty((M, N), dtype=dy.dtype, device=dy.device)
    programs = min(triton.cdiv(M, bm) * triton.cdiv(N, bn), torch.cuda.get_device_properties(0).multi_processor_count)
    _grad_kernel[(programs,)](TensorDescriptor.from_tensor(dy, [bm, bk]), TensorDescriptor.from_tensor(w_proj_t, [bn, bk]),
                              TensorDescriptor.from_tensor(c, [bm, bn // 2]), y, M, N, K, BLOCK_M=bm, BLOCK_N=bn,
                              BLOCK_K=bk, GROUP_M=gm, NUM_PROGRAMS=programs, num_stages=stages, num_warps=warps)
    return c


for M, C in ((131072, 1280), (262144, 768)):
    torch.manual_seed(0)
    dy = torch.randn(M, C, device="cuda").bfloat16()
    w_proj = (torch.randn(C, 4 * C, device="cuda") / (4 * C) ** 0.5).bfloat16()
    y = torch.rand(M, 4 * C, device="cuda").bfloat16()
    w_t = w_proj.t().contiguous()
    ref = rsm.relu_square_input_grad(dy, w_proj, y)
    base = cuda_time_ms(lambda: rsm.relu_square_input_grad(dy, w_proj, y), 20)
    print(f"M={M} C={C}: relu_square_mm backward {base:.3f} ms")
    for config in ((128, 256, 64, 4, 3, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (128, 128, 64, 4, 3, 4)):
        try:
            out = launch(dy, w_t, y, config)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t = cuda_time_ms(lambda: launch(dy, w_t, y, config), 20)
            print(f"  prefetch {config}: {t:.3f} ms ({base / t:.3f}x), differs from relu_square_mm's by {err:.1e}")
        except Exception as e:
            print(f"  prefetch {config}: failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
