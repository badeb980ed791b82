"""
L3's lookup h = E_t^T softmax(E_t x) (l3.py gives the math) as three Triton kernels that read the table's rows in
place: no gathered copies of rows, no score or mask tensors, no fp32 gradient of each gathered row to index_put.

Positions come sorted by token id, so a token's positions are a run and its rows [start, end) a stretch of the
table; both grow with the position. A block of sorted positions (l3._Plan: at most `block`, rows within a window)
reads the rows [lo, lo + width) that its tokens own, each position masked to its own.

    forward   (block, channel chunk): scores over the block's rows in tiles, online softmax, h = sum a E
              (each chunk's program recomputes the scores over all channels); logsumexp kept per position
    dx        (block, channel chunk): a = exp(s - lse), ds = a (g . E - delta), dx = sum ds E; delta = g . h
    dtable    (tile of BR table rows, channel chunk): over the run of positions whose tokens own a row of the tile,
              dE += ds^T x + a^T g, summed into the fp32 gradient in place: a tile is one program's, no atomics

fp32 scores, softmax and accumulators from compute-dtype operands, as the blocked bmm path.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: l3.py's PyTorch paths are used
    triton = None

BR, BK, BC = 64, 64, 256  # rows a tile, channels a step of the scores, channels a program (positions: the plan's block)
WARPS = 8

if triton is not None:
    @triton.jit
    def _scores(x_ptr, e_ptr, pos, p_ok, rows, r_ok, D: tl.constexpr, BK: tl.constexpr):
        """x[pos] . e[rows] over all D channels: (len(pos), len(rows)) fp32 (rows int64: tables past 2^31 elements)."""
        s = tl.zeros([pos.shape[0], rows.shape[0]], dtype=tl.float32)
        for k in range(0, D, BK):
            ch = k + tl.arange(0, BK)
            xk = tl.load(x_ptr + pos[:, None] * D + ch[None, :], mask=p_ok[:, None] & (ch[None, :] < D), other=0.0)
            ek = tl.load(e_ptr + rows[:, None] * D + ch[None, :], mask=r_ok[:, None] & (ch[None, :] < D), other=0.0)
            s += tl.dot(xk, tl.trans(ek))
        return s

    @triton.jit
    def _block_setup(first_ptr, count_ptr, lo_ptr, start_ptr, end_ptr, b, BP: tl.constexpr):
        first, count, lo = tl.load(first_ptr + b), tl.load(count_ptr + b), tl.load(lo_ptr + b).to(tl.int64)
        pos = first + tl.arange(0, BP)
        p_ok = tl.arange(0, BP) < count
        return pos, p_ok, lo, tl.load(start_ptr + pos, mask=p_ok, other=0), tl.load(end_ptr + pos, mask=p_ok, other=0)

    @triton.jit
    def _forward(x_ptr, e_ptr, h_ptr, lse_ptr, first_ptr, count_ptr, lo_ptr, width_ptr, start_ptr, end_ptr, n_rows,
                 D: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
        b, c = tl.program_id(0), tl.program_id(1)
        pos, p_ok, lo, start, end = _block_setup(first_ptr, count_ptr, lo_ptr, start_ptr, end_ptr, b, BP)
        ch = c * BC + tl.arange(0, BC)
        m = tl.full([BP], float("-inf"), tl.float32)
        l = tl.zeros([BP], tl.float32)
        acc = tl.zeros([BP, BC], tl.float32)
        for r in range(0, tl.load(width_ptr + b), BR):
            rows = lo + r + tl.arange(0, BR)
            r_ok = rows < n_rows
            s = _scores(x_ptr, e_ptr, pos, p_ok, rows, r_ok, D, BK)
            own = (rows[None, :] >= start[:, None]) & (rows[None, :] < end[:, None])
            s = tl.where(own, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no row of its own yet: nothing to rescale
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)
            ev = tl.load(e_ptr + rows[:, None] * D + ch[None, :], mask=r_ok[:, None] & (ch[None, :] < D), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(ev.dtype), ev)
            m = m_new
        l = tl.where(p_ok, l, 1.0)
        tl.store(h_ptr + pos[:, None] * D + ch[None, :], (acc / l[:, None]).to(h_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & (ch[None, :] < D))
        if c == 0:
            tl.store(lse_ptr + pos, m + tl.log(l), mask=p_ok)

    @triton.jit
    def _weights(x_ptr, g_ptr, e_ptr, pos, p_ok, rows, r_ok, start, end, lse, delta, D: tl.constexpr, BK: tl.constexpr):
        """The softmax's weights a and the scores' gradient ds = a (g . E - delta) of positions pos at rows."""
        s = _scores(x_ptr, e_ptr, pos, p_ok, rows, r_ok, D, BK)
        da = _scores(g_ptr, e_ptr, pos, p_ok, rows, r_ok, D, BK)
        own = (rows[None, :] >= start[:, None]) & (rows[None, :] < end[:, None]) & p_ok[:, None]
        a = tl.where(own, tl.exp(s - lse[:, None]), 0.0)
        return a, a * (da - delta[:, None])

    @triton.jit
    def _grad_x(x_ptr, g_ptr, e_ptr, lse_ptr, delta_ptr, dx_ptr, first_ptr, count_ptr, lo_ptr, width_ptr, start_ptr,
                end_ptr, n_rows, D: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                BC: tl.constexpr):
        b, c = tl.program_id(0), tl.program_id(1)
        pos, p_ok, lo, start, end = _block_setup(first_ptr, count_ptr, lo_ptr, start_ptr, end_ptr, b, BP)
        lse, delta = tl.load(lse_ptr + pos, mask=p_ok, other=0.0), tl.load(delta_ptr + pos, mask=p_ok, other=0.0)
        ch = c * BC + tl.arange(0, BC)
        acc = tl.zeros([BP, BC], tl.float32)
        for r in range(0, tl.load(width_ptr + b), BR):
            rows = lo + r + tl.arange(0, BR)
            r_ok = rows < n_rows
            a, ds = _weights(x_ptr, g_ptr, e_ptr, pos, p_ok, rows, r_ok, start, end, lse, delta, D, BK)
            ev = tl.load(e_ptr + rows[:, None] * D + ch[None, :], mask=r_ok[:, None] & (ch[None, :] < D), other=0.0)
            acc += tl.dot(ds.to(ev.dtype), ev)
        tl.store(dx_ptr + pos[:, None] * D + ch[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=p_ok[:, None] & (ch[None, :] < D))

    @triton.jit
    def _grad_table(x_ptr, g_ptr, e_ptr, lse_ptr, delta_ptr, de_ptr, p_lo_ptr, p_hi_ptr, start_ptr, end_ptr, n_rows,
                    D: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
        t, c = tl.program_id(0), tl.program_id(1)
        p_lo, p_hi = tl.load(p_lo_ptr + t), tl.load(p_hi_ptr + t)
        if p_lo < p_hi:  # no position owns a row of this tile: its gradient stays as it is
            rows = t.to(tl.int64) * BR + tl.arange(0, BR)
            r_ok = rows < n_rows
            ch = c * BC + tl.arange(0, BC)
            acc = tl.zeros([BR, BC], tl.float32)
            for p in range(p_lo, p_hi, BP):
                pos = p + tl.arange(0, BP)
                p_ok = pos < p_hi
                start, end = tl.load(start_ptr + pos, mask=p_ok, other=0), tl.load(end_ptr + pos, mask=p_ok, other=0)
                lse = tl.load(lse_ptr + pos, mask=p_ok, other=0.0)
                delta = tl.load(delta_ptr + pos, mask=p_ok, other=0.0)
                a, ds = _weights(x_ptr, g_ptr, e_ptr, pos, p_ok, rows, r_ok, start, end, lse, delta, D, BK)
                ch_ok = p_ok[:, None] & (ch[None, :] < D)
                xc = tl.load(x_ptr + pos[:, None] * D + ch[None, :], mask=ch_ok, other=0.0)
                gc = tl.load(g_ptr + pos[:, None] * D + ch[None, :], mask=ch_ok, other=0.0)
                acc += tl.dot(tl.trans(ds.to(xc.dtype)), xc) + tl.dot(tl.trans(a.to(gc.dtype)), gc)
            where = de_ptr + rows[:, None] * D + ch[None, :]
            ok = r_ok[:, None] & (ch[None, :] < D)
            tl.store(where, tl.load(where, mask=ok, other=0.0) + acc, mask=ok)


def supported(x):  # CUDA, 16-bit activations (fp32 would take TF32 scores), tl.dot's 16 channels at least
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.size(1) >= 16


def _launch_shape(d, block):
    return dict(D=d, BP=block, BR=BR, BK=min(BK, triton.next_power_of_2(d)), BC=min(BC, triton.next_power_of_2(d)),
                num_warps=WARPS)


def _chunks(d):
    return triton.cdiv(d, min(BC, triton.next_power_of_2(d)))


def forward(xs, tc, blocks, start, end, block):
    """xs (n, d) sorted positions, tc (n_rows, d) the table in xs' dtype, blocks (first, count, lo, width) of at most
    `block` positions, start/end (n,) each position's rows -> hs (n, d), lse (n,) fp32."""
    hs, lse = torch.empty_like(xs), torch.empty(xs.size(0), dtype=torch.float32, device=xs.device)
    first, count, lo, width = blocks
    _forward[(first.numel(), _chunks(xs.size(1)))](xs, tc, hs, lse, first, count, lo, width, start, end, tc.size(0),
                                                   **_launch_shape(xs.size(1), block))
    return hs, lse


def backward(xs, gs, hs, lse, tc, blocks, start, end, de, block):
    """dxs (n, d) in xs' dtype; the table's gradient summed into de (n_rows, d) fp32 in place."""
    delta = (gs.float() * hs.float()).sum(1)
    dxs = torch.empty_like(xs)
    first, count, lo, width = blocks
    shape, chunks = _launch_shape(xs.size(1), block), _chunks(xs.size(1))
    _grad_x[(first.numel(), chunks)](xs, gs, tc, lse, delta, dxs, first, count, lo, width, start, end, tc.size(0),
                                     **shape)
    # tile t's rows [t BR, (t + 1) BR) are owned by the positions p with end_p > t BR and start_p < (t + 1) BR: a run
    tiles = torch.arange(0, tc.size(0), BR, device=xs.device, dtype=start.dtype)
    p_lo = torch.searchsorted(end, tiles, right=True).to(torch.int32)
    p_hi = torch.searchsorted(start, tiles + BR).to(torch.int32)
    _grad_table[(tiles.numel(), chunks)](xs, gs, tc, lse, delta, de, p_lo, p_hi, start, end, tc.size(0), **shape)
    return dxs
