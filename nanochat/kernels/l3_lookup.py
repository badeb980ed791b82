"""
L3's lookup h = E_t^T softmax(E_t x) (l3.py) as three Triton kernels that never synchronize with the host.

The positions are sorted by token id and cut into blocks of at most BLOCK_M positions of one token (plan, device ops
only), so a block is a small dense attention: its positions' hidden states against its token's rows [start, end) of
the table, at most k_max of them, no mask but the row count. The block count depends on the batch; instead of reading
it (a host sync that empties the GPU's queue, twice a micro-batch in the blocked path), every array and grid is
sized by its upper bound, n / BLOCK_M + min(n, vocab), and the blocks past the last hold no positions.

    forward     per (block, channel chunk): scores over all channels, online softmax over the token's rows,
                h's chunk; the log-sum-exp per position is kept for the backward
    dx          per (block, channel chunk): P = exp(S - lse), dP = g E_t^T, dS = P (dP - g.h), dx's chunk = dS E_t
    dE          per (token, channel chunk, tile of the token's rows), on the token's first block: the rows'
                gradient as keys and values, dS^T x + P^T g, summed over the token's blocks in registers: each row
                is written by one program, no atomics, the same sum every run

A program computes the scores over all channels but writes one chunk of them: the scores are recomputed per chunk
(the lookup's FLOPs are ~0.1% of the model's; its bytes and launches were what cost). The table is read in fp32 and
cast in the kernel (no cast copy of the table); scores, softmax and the table gradient are fp32.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: l3.py's padded and blocked lookups
    triton = None

BLOCK_M, BLOCK_N, BLOCK_D = 32, 64, 64  # positions per block, table rows per tile, channels per chunk


def supported(x):
    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.size(1) % BLOCK_D == 0)


def plan(ids, vocab_size, block_m=BLOCK_M):
    """(order, first, count, lead, blocks) for ids (n,): positions sorted by token (order), block b holding sorted
    positions first[b] .. first[b] + count[b] - 1 (count 0 past the last block), lead[b] the number of blocks of
    b's token if b is its first block, else 0. Device ops only; arrays of the upper bound `blocks`."""
    n, device = ids.numel(), ids.device
    order = torch.argsort(ids, stable=True)
    sid = ids[order]
    at = torch.arange(n, device=device)
    new_token = torch.ones(n, dtype=torch.bool, device=device)
    new_token[1:] = sid[1:] != sid[:-1]
    run_start = torch.cummax(torch.where(new_token, at, 0), 0).values  # where each position's token run begins
    new_block = (at - run_start) % block_m == 0
    blocks = n // block_m + min(n, vocab_size)
    first = torch.full((blocks + 1,), n, dtype=torch.int64, device=device)
    first.scatter_(0, torch.where(new_block, torch.cumsum(new_block, 0) - 1, blocks), at)  # the rest to a spare slot
    first[blocks] = n
    count = first[1:] - first[:-1]
    first = first[:-1]
    safe = first.clamp(max=n - 1)
    run_end = torch.full((n,), n, dtype=torch.int64, device=device)  # one past each position's token run
    run_end[:-1] = torch.where(new_token[1:], at[1:], n)
    run_end = torch.flip(torch.cummin(torch.flip(run_end, (0,)), 0).values, (0,))
    lead = torch.where((count > 0) & (run_start[safe] == first), (run_end[safe] - first + block_m - 1) // block_m, 0)
    return order, first, count, lead, blocks


if triton is not None:
    @triton.jit
    def _scores(x_ptr, table_ptr, pos, m_ok, rows, n_ok, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """S = X E^T (BLOCK_M x BLOCK_N, fp32) over all D channels, for positions `pos` and table rows `rows`."""
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        cols = tl.arange(0, BLOCK_D)
        for c in range(0, D, BLOCK_D):
            xc = tl.load(x_ptr + pos[:, None] * D + c + cols[None, :], mask=m_ok[:, None], other=0.0)
            ec = tl.load(table_ptr + rows[:, None] * D + c + cols[None, :], mask=n_ok[:, None], other=0.0)
            s += tl.dot(xc, tl.trans(ec.to(xc.dtype)))
        return s

    @triton.jit
    def _forward_kernel(x_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, h_ptr, lse_ptr,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b, j = tl.program_id(0), tl.program_id(1)
        count = tl.load(count_ptr + b)
        if count > 0:
            first = tl.load(first_ptr + b)
            i = tl.arange(0, BLOCK_M)
            m_ok = i < count
            pos = tl.load(order_ptr + first + i, mask=m_ok, other=0)
            token = tl.load(ids_ptr + tl.load(order_ptr + first))
            start, end = tl.load(bounds_ptr + token), tl.load(bounds_ptr + token + 1)
            cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
            m_run = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_run = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for r0 in range(start, end, BLOCK_N):
                rows = r0 + tl.arange(0, BLOCK_N)
                n_ok = rows < end
                s = _scores(x_ptr, table_ptr, pos, m_ok, rows, n_ok, D, BLOCK_M, BLOCK_N, BLOCK_D)
                s = tl.where(n_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_run, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_run - m_new)
                l_run = l_run * alpha + tl.sum(p, 1)
                ev = tl.load(table_ptr + rows[:, None] * D + cols[None, :], mask=n_ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(h_ptr.dtype.element_ty), ev.to(h_ptr.dtype.element_ty))
                m_run = m_new
            acc = acc / l_run[:, None]
            tl.store(h_ptr + pos[:, None] * D + cols[None, :], acc.to(h_ptr.dtype.element_ty), mask=m_ok[:, None])
            if j == 0:
                tl.store(lse_ptr + pos, m_run + tl.log(l_run), mask=m_ok)

    @triton.jit
    def _probabilities(x_ptr, g_ptr, table_ptr, pos, m_ok, rows, n_ok, lse, delta, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """P = softmax weights and dS = P (dP - delta) for one (block, row tile); dP = G E^T over all channels."""
        s = _scores(x_ptr, table_ptr, pos, m_ok, rows, n_ok, D, BLOCK_M, BLOCK_N, BLOCK_D)
        p = tl.where(n_ok[None, :] & m_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
        dp = _scores(g_ptr, table_ptr, pos, m_ok, rows, n_ok, D, BLOCK_M, BLOCK_N, BLOCK_D)
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _dx_kernel(x_ptr, g_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, lse_ptr,
                   delta_ptr, dx_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
        b, j = tl.program_id(0), tl.program_id(1)
        count = tl.load(count_ptr + b)
        if count > 0:
            first = tl.load(first_ptr + b)
            i = tl.arange(0, BLOCK_M)
            m_ok = i < count
            pos = tl.load(order_ptr + first + i, mask=m_ok, other=0)
            token = tl.load(ids_ptr + tl.load(order_ptr + first))
            start, end = tl.load(bounds_ptr + token), tl.load(bounds_ptr + token + 1)
            lse = tl.load(lse_ptr + pos, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + pos, mask=m_ok, other=0.0)
            cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for r0 in range(start, end, BLOCK_N):
                rows = r0 + tl.arange(0, BLOCK_N)
                n_ok = rows < end
                p, ds = _probabilities(x_ptr, g_ptr, table_ptr, pos, m_ok, rows, n_ok, lse, delta, D, BLOCK_M,
                                       BLOCK_N, BLOCK_D)
                ek = tl.load(table_ptr + rows[:, None] * D + cols[None, :], mask=n_ok[:, None], other=0.0)
                acc += tl.dot(ds.to(dx_ptr.dtype.element_ty), ek.to(dx_ptr.dtype.element_ty))
            tl.store(dx_ptr + pos[:, None] * D + cols[None, :], acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None])

    @triton.jit
    def _dtable_kernel(x_ptr, g_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, lead_ptr,
                       lse_ptr, delta_ptr, dtable_ptr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b, j, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lead = tl.load(lead_ptr + b)
        if lead > 0:  # b is its token's first block; the token's blocks are b .. b + lead - 1
            token = tl.load(ids_ptr + tl.load(order_ptr + tl.load(first_ptr + b)))
            start, end = tl.load(bounds_ptr + token), tl.load(bounds_ptr + token + 1)
            rows = start + r * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's tile of the token's rows
            if start + r * BLOCK_N < end:
                n_ok = rows < end
                cols = j * BLOCK_D + tl.arange(0, BLOCK_D)
                i = tl.arange(0, BLOCK_M)
                acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
                for k in range(0, lead):
                    first, count = tl.load(first_ptr + b + k), tl.load(count_ptr + b + k)
                    m_ok = i < count
                    pos = tl.load(order_ptr + first + i, mask=m_ok, other=0)
                    lse = tl.load(lse_ptr + pos, mask=m_ok, other=0.0)
                    delta = tl.load(delta_ptr + pos, mask=m_ok, other=0.0)
                    p, ds = _probabilities(x_ptr, g_ptr, table_ptr, pos, m_ok, rows, n_ok, lse, delta, D, BLOCK_M,
                                           BLOCK_N, BLOCK_D)
                    xc = tl.load(x_ptr + pos[:, None] * D + cols[None, :], mask=m_ok[:, None], other=0.0)
                    gc = tl.load(g_ptr + pos[:, None] * D + cols[None, :], mask=m_ok[:, None], other=0.0)
                    acc += tl.dot(tl.trans(ds.to(xc.dtype)), xc) + tl.dot(tl.trans(p.to(gc.dtype)), gc)
                tl.store(dtable_ptr + rows[:, None] * D + cols[None, :], acc, mask=n_ok[:, None])


class FusedLookup(torch.autograd.Function):
    """h = E_t^T softmax(E_t x) for x (n, D), ids (n,); table (rows, D) fp32, bounds (vocab + 1,), every token's
    row count at most k_max."""

    @staticmethod
    def forward(ctx, x, table, ids, bounds, k_max):
        x, ids = x.contiguous(), ids.contiguous()
        order, first, count, lead, blocks = plan(ids, bounds.numel() - 1)
        h = torch.empty_like(x)
        lse = torch.empty(x.size(0), dtype=torch.float32, device=x.device)
        D = x.size(1)
        _forward_kernel[(blocks, D // BLOCK_D)](x, table, bounds, ids, order, first, count, h, lse, D, BLOCK_M,
                                                BLOCK_N, BLOCK_D)
        ctx.save_for_backward(x, table, ids, bounds, order, first, count, lead, h, lse)
        ctx.k_max = k_max
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, table, ids, bounds, order, first, count, lead, h, lse = ctx.saved_tensors
        g = grad_h.to(x.dtype).contiguous()
        delta = (g.float() * h.float()).sum(1)  # g . h = sum_r P_r (g . e_r): the softmax backward's row term
        D, blocks = x.size(1), first.numel()
        dx = torch.empty_like(x)
        _dx_kernel[(blocks, D // BLOCK_D)](x, g, table, bounds, ids, order, first, count, lse, delta, dx, D, BLOCK_M,
                                           BLOCK_N, BLOCK_D)
        dtable = torch.zeros_like(table, dtype=torch.float32)  # rows no token of the batch owns stay zero
        tiles = -(-ctx.k_max // BLOCK_N)  # row tiles of the token with the most rows
        _dtable_kernel[(blocks, D // BLOCK_D, tiles)](x, g, table, bounds, ids, order, first, count, lead, lse, delta,
                                                      dtable, D, BLOCK_M, BLOCK_N, BLOCK_D)
        return dx, dtable.to(table.dtype), None, None, None


def lookup(x, ids, table, bounds, k_max):
    """k_max: at least every token's row count (the row-tile grid of the table gradient)."""
    return FusedLookup.apply(x, table, ids, bounds, k_max)
