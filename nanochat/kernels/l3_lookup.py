"""
L3's lookup h = E_t^T softmax(E_t x) (l3.py) as Triton kernels that never synchronize with the host.

The positions are sorted by token id and cut into blocks of at most BLOCK_M positions of one token (plan, device ops
only), so a block is a small dense attention: its positions' hidden states against its token's rows [start, end) of
the table, at most k_max of them, no mask but the row count. The block count depends on the batch; instead of reading
it (a host sync that empties the GPU's queue, twice a micro-batch in the blocked path), every array and grid is
sized by its upper bound, n / BLOCK_M + min(n, vocab), and the blocks past the last hold no positions. A position's
scores (and their gradients) go to a scratch row of k_max fp32 (n x k_max: 128 MiB at 65,536 positions and k_max
512), so each product over all channels runs once:

    scores      per block: S = X E_t^T, and each position's log-sum-exp
    h           per block: exp(S - lse) E_t, one channel chunk after another
    dS          per block: P (G E_t^T - g.h), P = exp(S - lse)
    dx          per block: dS E_t
    dE          per (token, tile of its rows), on the token's first block: dS^T X + P^T G (the rows as keys and as
                values), summed over the token's blocks in registers: each row is written by one program, no
                atomics, the same sum every run

The table is read in fp32 and cast in the kernel (no cast copy of the table); scores, softmax and the table gradient
are fp32, the products' operands in the activations' dtype.
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
    def _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b, BLOCK_M: tl.constexpr):
        """Block b's positions (masked past its count) and its token's rows [start, end)."""
        first, count = tl.load(first_ptr + b), tl.load(count_ptr + b)
        m_ok = tl.arange(0, BLOCK_M) < count
        pos = tl.load(order_ptr + first + tl.arange(0, BLOCK_M), mask=m_ok, other=0)
        token = tl.load(ids_ptr + tl.load(order_ptr + first))
        return pos, m_ok, tl.load(bounds_ptr + token), tl.load(bounds_ptr + token + 1)

    @triton.jit
    def _rows_product(a_ptr, table_ptr, pos, m_ok, rows, n_ok, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """A E^T (BLOCK_M x BLOCK_N, fp32) over all D channels: positions `pos` of a (n, D), table rows `rows`."""
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        cols = tl.arange(0, BLOCK_D)
        for c in range(0, D, BLOCK_D):
            ac = tl.load(a_ptr + pos[:, None] * D + c + cols[None, :], mask=m_ok[:, None], other=0.0)
            ec = tl.load(table_ptr + rows[:, None] * D + c + cols[None, :], mask=n_ok[:, None], other=0.0)
            s += tl.dot(ac, tl.trans(ec.to(ac.dtype)))
        return s

    @triton.jit
    def _scores_kernel(x_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, s_ptr, lse_ptr,
                       K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """Per block: S = X E_t^T into the scratch (a position's scores in its row, K = k_max columns) and the
        log-sum-exp of each position's scores."""
        b = tl.program_id(0)
        if tl.load(count_ptr + b) > 0:
            pos, m_ok, start, end = _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b, BLOCK_M)
            m_run = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_run = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for r0 in range(start, end, BLOCK_N):
                rows = r0 + tl.arange(0, BLOCK_N)
                n_ok = rows < end
                s = _rows_product(x_ptr, table_ptr, pos, m_ok, rows, n_ok, D, BLOCK_M, BLOCK_N, BLOCK_D)
                tl.store(s_ptr + pos[:, None] * K + (rows - start)[None, :], s, mask=m_ok[:, None] & n_ok[None, :])
                s = tl.where(n_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_run, tl.max(s, 1))
                l_run = l_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
                m_run = m_new
            tl.store(lse_ptr + pos, m_run + tl.log(l_run), mask=m_ok)

    @triton.jit
    def _weighted_rows_kernel(w_ptr, lse_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr,
                              out_ptr, K: tl.constexpr, D: tl.constexpr, SOFTMAX: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per block, one channel chunk after another: out = W E_t, W the scratch's rows: the softmax of the scores
        (SOFTMAX, exp(S - lse): the forward's h) or the score gradients (dx)."""
        b = tl.program_id(0)
        if tl.load(count_ptr + b) > 0:
            pos, m_ok, start, end = _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b, BLOCK_M)
            lse = tl.load(lse_ptr + pos, mask=m_ok, other=0.0)
            for c in range(0, D, BLOCK_D):
                cols = c + tl.arange(0, BLOCK_D)
                acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
                for r0 in range(start, end, BLOCK_N):
                    rows = r0 + tl.arange(0, BLOCK_N)
                    n_ok = rows < end
                    ok = m_ok[:, None] & n_ok[None, :]
                    w = tl.load(w_ptr + pos[:, None] * K + (rows - start)[None, :], mask=ok, other=0.0)
                    if SOFTMAX:
                        w = tl.where(ok, tl.exp(w - lse[:, None]), 0.0)
                    e = tl.load(table_ptr + rows[:, None] * D + cols[None, :], mask=n_ok[:, None], other=0.0)
                    acc += tl.dot(w.to(out_ptr.dtype.element_ty), e.to(out_ptr.dtype.element_ty))
                tl.store(out_ptr + pos[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=m_ok[:, None])

    @triton.jit
    def _score_grad_kernel(g_ptr, table_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, s_ptr, lse_ptr,
                           delta_ptr, ds_ptr, K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per block: dS = P (G E_t^T - delta), P = exp(S - lse), into its scratch."""
        b = tl.program_id(0)
        if tl.load(count_ptr + b) > 0:
            pos, m_ok, start, end = _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b, BLOCK_M)
            lse = tl.load(lse_ptr + pos, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + pos, mask=m_ok, other=0.0)
            for r0 in range(start, end, BLOCK_N):
                rows = r0 + tl.arange(0, BLOCK_N)
                n_ok = rows < end
                ok = m_ok[:, None] & n_ok[None, :]
                at = pos[:, None] * K + (rows - start)[None, :]
                p = tl.where(ok, tl.exp(tl.load(s_ptr + at, mask=ok, other=0.0) - lse[:, None]), 0.0)
                dp = _rows_product(g_ptr, table_ptr, pos, m_ok, rows, n_ok, D, BLOCK_M, BLOCK_N, BLOCK_D)
                tl.store(ds_ptr + at, p * (dp - delta[:, None]), mask=ok)

    @triton.jit
    def _table_grad_kernel(x_ptr, g_ptr, bounds_ptr, ids_ptr, order_ptr, first_ptr, count_ptr, lead_ptr, s_ptr,
                           lse_ptr, ds_ptr, dtable_ptr, K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per (token, tile of the token's rows), on the token's first block, one channel chunk after another: the
        rows' gradient as keys and values, dS^T X + P^T G, summed over the token's blocks in registers."""
        b, r = tl.program_id(0), tl.program_id(1)
        lead = tl.load(lead_ptr + b)
        if lead > 0:  # the token's blocks are b .. b + lead - 1
            pos, m_ok, start, end = _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b, BLOCK_M)
            if start + r * BLOCK_N < end:
                rows = start + r * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = rows < end
                for c in range(0, D, BLOCK_D):
                    cols = c + tl.arange(0, BLOCK_D)
                    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
                    for k in range(0, lead):
                        pos, m_ok, start, end = _block(order_ptr, first_ptr, count_ptr, ids_ptr, bounds_ptr, b + k,
                                                       BLOCK_M)
                        ok = m_ok[:, None] & n_ok[None, :]
                        at = pos[:, None] * K + (rows - start)[None, :]
                        lse = tl.load(lse_ptr + pos, mask=m_ok, other=0.0)
                        p = tl.where(ok, tl.exp(tl.load(s_ptr + at, mask=ok, other=0.0) - lse[:, None]), 0.0)
                        ds = tl.load(ds_ptr + at, mask=ok, other=0.0)
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
        n, D = x.shape
        scores = torch.empty(n, k_max, dtype=torch.float32, device=x.device)  # a position's row: its token's rows
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        h = torch.empty_like(x)
        index = (bounds, ids, order, first, count)
        _scores_kernel[(blocks,)](x, table, *index, scores, lse, k_max, D, BLOCK_M, BLOCK_N, BLOCK_D)
        _weighted_rows_kernel[(blocks,)](scores, lse, table, *index, h, k_max, D, True, BLOCK_M, BLOCK_N, BLOCK_D)
        ctx.save_for_backward(x, table, ids, bounds, order, first, count, lead, h, scores, lse)
        ctx.k_max = k_max
        return h

    @staticmethod
    def backward(ctx, grad_h):
        x, table, ids, bounds, order, first, count, lead, h, scores, lse = ctx.saved_tensors
        k_max, (n, D), blocks = ctx.k_max, x.shape, first.numel()
        g = grad_h.to(x.dtype).contiguous()
        delta = (g.float() * h.float()).sum(1)  # g . h = sum_r P_r (g . e_r): the softmax backward's row term
        index = (bounds, ids, order, first, count)
        dscores = torch.empty_like(scores)
        _score_grad_kernel[(blocks,)](g, table, *index, scores, lse, delta, dscores, k_max, D, BLOCK_M, BLOCK_N,
                                      BLOCK_D)
        dx = torch.empty_like(x)
        _weighted_rows_kernel[(blocks,)](dscores, lse, table, *index, dx, k_max, D, False, BLOCK_M, BLOCK_N, BLOCK_D)
        dtable = torch.zeros_like(table, dtype=torch.float32)  # rows no token of the batch owns stay zero
        tiles = -(-k_max // BLOCK_N)  # row tiles of the token with the most rows
        _table_grad_kernel[(blocks, tiles)](x, g, *index, lead, scores, lse, dscores, dtable, k_max, D, BLOCK_M,
                                            BLOCK_N, BLOCK_D)
        return dx, dtable.to(table.dtype), None, None, None


def lookup(x, ids, table, bounds, k_max):
    """k_max: at least every token's row count (the row-tile grid of the table gradient)."""
    return FusedLookup.apply(x, table, ids, bounds, k_max)
