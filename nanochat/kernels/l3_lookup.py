"""
L3's lookup h = E_t^T softmax(E_t x) (l3.py gives the math) as Triton kernels that read the table's rows in place:
no gathered copies of rows, no mask tensors, no fp32 gradient of each gathered row to index_put.

Positions come sorted by token id, so a token's positions are a run and its rows [start, end) a stretch of the
table; both grow with the position. A block of at most P sorted positions (l3._Plan) reads the rows
[lo, lo + width) that its tokens own, each position masked to its own. Its scores live in a scratch buffer, a
(P, wpad) tile a block at `off` (wpad: width rounded up to the row tile), so nothing is computed twice:

    scores    (block): s = x E^T over the block's rows, tile by tile, stored; then a = exp(s - lse) in the compute
              dtype over the stored scores, lse = logsumexp of each position's own rows
    mix       (block, channel chunk): out = w E for w = a (forward: h) or w = ds (backward: dx)
    score_grads (block): ds = a (g E^T - delta), delta = g . h
    grad_table (tile of table rows, channel chunk): over the run of positions whose tokens own a row of the tile,
              dE += ds^T x + a^T g (a and ds read where each position's block wrote them), summed into the fp32
              gradient in place: a tile is one program's, no atomics

fp32 scores, softmax and accumulators from compute-dtype operands, as the blocked bmm path.
"""

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: l3.py's PyTorch paths are used
    triton = None

ROWS = 64  # table rows a tile (the scratch's widths are multiples of it)
BK, BC, WARPS = 64, 128, 4  # channels a step of the scores, channels a mix program, warps a program
GRAD_TABLE = (64, 128, 4)  # _grad_table's tiling: positions a step, channels a program, warps (dev.bench_kernels l3)

if triton is not None:
    @triton.jit
    def _block(first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr, end_ptr, b, P: tl.constexpr,
               R: tl.constexpr):
        """Block b's sorted positions (and which are real), its first row, padded width, scratch offset, and each
        position's rows [start, end)."""
        first, count = tl.load(first_ptr + b), tl.load(count_ptr + b)
        pos = first + tl.arange(0, P)
        ok = tl.arange(0, P) < count
        start, end = tl.load(start_ptr + pos, mask=ok, other=0), tl.load(end_ptr + pos, mask=ok, other=0)
        # lo, wpad and off are multiples of the row tile (the plan's): aligned, vector loads and stores
        return (pos, ok, tl.multiple_of(tl.load(lo_ptr + b), R), tl.multiple_of(tl.load(wpad_ptr + b), R),
                tl.multiple_of(tl.load(off_ptr + b), R), start, end)

    @triton.jit
    def _dots(x_ptr, e_ptr, pos, ok, rows, D: tl.constexpr, BK: tl.constexpr):
        """x[pos] . e[rows] over all D channels, fp32 (rows past the table: the callers clamp them, `own` masks them)."""
        s = tl.zeros([pos.shape[0], rows.shape[0]], dtype=tl.float32)
        for k in range(0, D, BK):
            ch = k + tl.arange(0, BK)
            xk = tl.load(x_ptr + pos[:, None] * D + ch[None, :], mask=ok[:, None] & (ch[None, :] < D), other=0.0)
            ek = tl.load(e_ptr + rows[:, None] * D + ch[None, :], mask=ch[None, :] < D, other=0.0)
            s += tl.dot(xk, tl.trans(ek))
        return s

    @triton.jit
    def _scores(x_ptr, e_ptr, s_ptr, a_ptr, lse_ptr, first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr,
                end_ptr, n_rows, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
        pos, ok, lo, wpad, off, start, end = _block(first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr,
                                                    end_ptr, tl.program_id(0), P, R)
        tile = off + tl.arange(0, P)[:, None] * wpad + tl.arange(0, R)[None, :]
        m = tl.full([P], float("-inf"), tl.float32)
        l = tl.zeros([P], tl.float32)
        for r in range(0, wpad, R):
            rows = tl.minimum(lo + r + tl.arange(0, R), n_rows - 1).to(tl.int64)
            own = (lo + r + tl.arange(0, R)[None, :] >= start[:, None]) & (lo + r + tl.arange(0, R)[None, :] < end[:, None])
            s = tl.where(own, _dots(x_ptr, e_ptr, pos, ok, rows, D, BK), float("-inf"))
            tl.store(s_ptr + tile + r, s)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no row of its own yet: nothing to rescale
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(ok, m + tl.log(tl.where(ok, l, 1.0)), 0.0)
        tl.store(lse_ptr + pos, lse, mask=ok)
        tl.debug_barrier()  # the scores are read back by other threads of this program than wrote them
        for r in range(0, wpad, R):
            a = tl.exp(tl.load(s_ptr + tile + r) - lse[:, None])
            tl.store(a_ptr + tile + r, a.to(a_ptr.dtype.element_ty))

    @triton.jit
    def _mix(w_ptr, e_ptr, out_ptr, first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr, end_ptr, n_rows,
             D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
        # a block's channel chunks one after the other (the chunk varies fastest): its weights read once from HBM
        b, c = tl.program_id(0) // tl.cdiv(D, BC), tl.program_id(0) % tl.cdiv(D, BC)
        pos, ok, lo, wpad, off, start, end = _block(first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr,
                                                    end_ptr, b, P, R)
        ch = c * BC + tl.arange(0, BC)
        tile = off + tl.arange(0, P)[:, None] * wpad + tl.arange(0, R)[None, :]
        acc = tl.zeros([P, BC], tl.float32)
        for r in range(0, wpad, R):
            rows = tl.minimum(lo + r + tl.arange(0, R), n_rows - 1).to(tl.int64)
            ev = tl.load(e_ptr + rows[:, None] * D + ch[None, :], mask=ch[None, :] < D, other=0.0)
            acc += tl.dot(tl.load(w_ptr + tile + r), ev)
        tl.store(out_ptr + pos[:, None] * D + ch[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None] & (ch[None, :] < D))

    @triton.jit
    def _score_grads(g_ptr, h_ptr, e_ptr, a_ptr, ds_ptr, first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr,
                     start_ptr, end_ptr, n_rows, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
        pos, ok, lo, wpad, off, start, end = _block(first_ptr, count_ptr, lo_ptr, wpad_ptr, off_ptr, start_ptr,
                                                    end_ptr, tl.program_id(0), P, R)
        tile = off + tl.arange(0, P)[:, None] * wpad + tl.arange(0, R)[None, :]
        delta = tl.zeros([P], tl.float32)  # g . h = sum over rows of a (g . E)
        for k in range(0, D, BK):
            ch = k + tl.arange(0, BK)
            on = ok[:, None] & (ch[None, :] < D)
            g = tl.load(g_ptr + pos[:, None] * D + ch[None, :], mask=on, other=0.0).to(tl.float32)
            delta += tl.sum(g * tl.load(h_ptr + pos[:, None] * D + ch[None, :], mask=on, other=0.0).to(tl.float32), 1)
        for r in range(0, wpad, R):
            rows = tl.minimum(lo + r + tl.arange(0, R), n_rows - 1).to(tl.int64)
            a = tl.load(a_ptr + tile + r).to(tl.float32)  # 0 off a position's own rows
            ds = a * (_dots(g_ptr, e_ptr, pos, ok, rows, D, BK) - delta[:, None])
            tl.store(ds_ptr + tile + r, ds.to(ds_ptr.dtype.element_ty))

    @triton.jit
    def _grad_table(x_ptr, g_ptr, a_ptr, ds_ptr, base_ptr, de_ptr, tiles_ptr, p_lo_ptr, p_hi_ptr, start_ptr, end_ptr,
                    n_rows, D: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
        # the tiles with the most positions first (a frequent token's: up to ~90x the median's loop); a tile's chunks
        # one after the other
        i, c = tl.program_id(0) // tl.cdiv(D, BC), tl.program_id(0) % tl.cdiv(D, BC)
        t = tl.load(tiles_ptr + i)
        p_lo, p_hi = tl.load(p_lo_ptr + t), tl.load(p_hi_ptr + t)
        if p_lo < p_hi:  # no position owns a row of this tile: its gradient stays as it is
            rows = t.to(tl.int64) * R + tl.arange(0, R)
            ch = c * BC + tl.arange(0, BC)
            acc = tl.zeros([R, BC], tl.float32)
            for p in range(p_lo, p_hi, P):
                pos = p + tl.arange(0, P)
                ok = pos < p_hi
                start, end = tl.load(start_ptr + pos, mask=ok, other=0), tl.load(end_ptr + pos, mask=ok, other=0)
                own = ok[:, None] & (rows[None, :] >= start[:, None]) & (rows[None, :] < end[:, None])
                at_row = tl.multiple_of(tl.load(base_ptr + pos, mask=ok, other=0), R)[:, None] + rows[None, :]
                at = tl.load(a_ptr + at_row, mask=own, other=0.0)
                dst = tl.load(ds_ptr + at_row, mask=own, other=0.0)
                on = ok[:, None] & (ch[None, :] < D)
                xc = tl.load(x_ptr + pos[:, None] * D + ch[None, :], mask=on, other=0.0)
                gc = tl.load(g_ptr + pos[:, None] * D + ch[None, :], mask=on, other=0.0)
                acc += tl.dot(tl.trans(dst), xc) + tl.dot(tl.trans(at), gc)
            where = de_ptr + rows[:, None] * D + ch[None, :]
            keep = (rows[:, None] < n_rows) & (ch[None, :] < D)
            tl.store(where, tl.load(where, mask=keep, other=0.0) + acc, mask=keep)


def scratch_layout(first, count, lo, width, block):
    """For blocks of `block` sorted positions (l3._Plan: each's first position, count, first row lo and width), the
    kernels' scratch: block b's (block, wpad) tile at off[b], its rows from klo[b] (lo aligned down to the row tile);
    a sorted position's entry for row r at base + r. -> (klo, wpad, off, base, elements in all)."""
    klo = lo - lo % ROWS
    wpad = -(-(width + lo - klo) // ROWS) * ROWS
    off = np.cumsum(block * wpad) - block * wpad
    of_block = np.repeat(np.arange(len(first)), count)
    in_block = np.arange(of_block.size) - np.repeat(np.cumsum(count) - count, count)
    base = np.empty(of_block.size, dtype=np.int64)
    base[first[of_block] + in_block] = off[of_block] + in_block * wpad[of_block] - klo[of_block]
    return klo, wpad, off, base, int(block * wpad.sum())


def table_gradient(param, tc, acc):
    """The buffer (dtype acc) a lookup sums the table's gradient into (this one's and l3's bmm path). In a training
    step the .grad of earlier micro-batches, taken and handed back (autograd keeps what comes to an empty .grad as it
    is): no dense zeros and add a micro-batch (~2 ms each at d12)."""
    if param is not None and param.grad is not None and param.grad.dtype == acc:
        de, param.grad = param.grad, None
        return de
    return torch.zeros(tc.shape, dtype=acc, device=tc.device)


class Lookup(torch.autograd.Function):
    """h = E_t^T softmax(E_t x) for x (N, d) by an l3._Plan's blocks; tc the table in x's dtype; sum_into: in a
    training step, the table parameter whose .grad the backward sums into in place (table_gradient)."""

    @staticmethod
    def forward(ctx, x, table, tc, plan, sum_into):
        order, *_, start, end, first, count, klo, wpad, off, base = plan.to(x.device)
        xs, blocks = x.index_select(0, order), (first, count, klo, wpad, off)
        hs, a = forward(xs, tc, blocks, start, end, plan.scratch, plan.block)
        ctx.save_for_backward(xs, hs, a, tc, order, start, end, base, *blocks)
        ctx.table_dtype, ctx.param, ctx.block = table.dtype, sum_into, plan.block
        return torch.empty_like(x).index_copy_(0, order, hs)

    @staticmethod
    def backward(ctx, grad_h):
        xs, hs, a, tc, order, start, end, base, *blocks = ctx.saved_tensors
        gs, de = grad_h.to(xs.dtype).index_select(0, order), table_gradient(ctx.param, tc, torch.float32)
        dxs = backward(xs, gs, hs, a, tc, blocks, start, end, base, de, ctx.block)
        return torch.empty_like(xs).index_copy_(0, order, dxs), de.to(ctx.table_dtype), None, None, None


def supported(x):  # CUDA, 16-bit activations (fp32 would take TF32 scores), tl.dot's 16 channels at least
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.size(1) >= 16


def _sizes(d, block):
    return dict(D=d, P=block, R=ROWS), dict(BK=min(BK, triton.next_power_of_2(d)), num_warps=WARPS), \
        min(BC, triton.next_power_of_2(d))


def forward(xs, tc, blocks, start, end, scratch, block):
    """xs (n, d) sorted positions, tc (n_rows, d) the table in xs' dtype, blocks (first, count, lo, wpad, off) of at
    most `block` positions, start/end (n,) each position's rows, scratch: elements of the blocks' score tiles
    -> hs (n, d), a (scratch,) in xs' dtype (lse, each position's logsumexp, is the scores kernel's own)."""
    shape, score_args, bc = _sizes(xs.size(1), block)
    s = torch.empty(scratch, dtype=torch.float32, device=xs.device)
    a = torch.empty(scratch, dtype=xs.dtype, device=xs.device)
    lse, hs = torch.empty(xs.size(0), dtype=torch.float32, device=xs.device), torch.empty_like(xs)
    nb = blocks[0].numel()
    _scores[(nb,)](xs, tc, s, a, lse, *blocks, start, end, tc.size(0), **shape, **score_args)
    _mix[(nb * triton.cdiv(xs.size(1), bc),)](a, tc, hs, *blocks, start, end, tc.size(0), **shape, BC=bc,
                                              num_warps=WARPS)
    return hs, a


def backward(xs, gs, hs, a, tc, blocks, start, end, base, de, block):
    """dxs (n, d) in xs' dtype; the table's gradient summed into de (n_rows, d) fp32 in place."""
    shape, score_args, bc = _sizes(xs.size(1), block)
    ds, dxs = torch.empty_like(a), torch.empty_like(xs)
    nb, chunks = blocks[0].numel(), triton.cdiv(xs.size(1), bc)
    _score_grads[(nb,)](gs, hs, tc, a, ds, *blocks, start, end, tc.size(0), **shape, **score_args)
    _mix[(nb * chunks,)](ds, tc, dxs, *blocks, start, end, tc.size(0), **shape, BC=bc, num_warps=WARPS)
    # tile t's rows [t R, (t + 1) R) are owned by the positions p with end_p > t R and start_p < (t + 1) R: a run
    firsts = torch.arange(0, tc.size(0), ROWS, device=xs.device, dtype=start.dtype)
    p_lo, p_hi = torch.searchsorted(end, firsts, right=True), torch.searchsorted(start, firsts + ROWS)
    tiles = torch.argsort(p_hi - p_lo, descending=True)
    positions, channels, warps = GRAD_TABLE
    channels = min(channels, triton.next_power_of_2(xs.size(1)))
    _grad_table[(tiles.numel() * triton.cdiv(xs.size(1), channels),)](
        xs, gs, a, ds, base, de, tiles, p_lo, p_hi, start, end, tc.size(0), D=xs.size(1), P=positions, R=ROWS,
        BC=channels, num_warps=warps)
    return dxs
