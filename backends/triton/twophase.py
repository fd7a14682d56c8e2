"""The two-phase pair for Block AttnRes: phase 1 (all S queries of a block over the completed
blocks) and phase 2 (merge the partial sum by online softmax, optionally fused with the next
sublayer's RMSNorm). Forward and backward kernels and their launchers.

Math: backends/eager/depth.py:phase1 / phase2 with heads=1. u_s = gain_s * query_s.

Reads of the completed blocks in phase 1 (n blocks, S queries, per token row):
- forward (`_phase1_fwd`): pass A streams each block once in channel chunks and computes its
  RMS and the logits of all S queries at once; pass B, in the same program, streams the blocks
  again and accumulates the S un-normalised outputs. So 2 reads of the completed blocks for
  all S queries, against S reads for S separate aggregations; with 2 rows per program the
  second read should mostly hit L2 (n x 2 x d values per program), but that is not measured
  here. (A single read would need S accumulators of d channels per row at once, more than a
  program's registers hold at d in the thousands.)
- backward: `_phase1_dlogits` reads each block once, with the S output gradients of each
  chunk re-read per block (2 rows per program on a GPU, so the re-reads should come from L2);
  `_phase1_dsources` reads each block and the output gradients once more and writes the block
  gradients.
Logits z [n, S, rows] go through a small fp32 scratch (S / d of the block traffic).
"""
from __future__ import annotations

import torch

from . import runtime as rt
from .runtime import tl, triton
from .single import folded_query, rows_view


# ---- phase 1 ------------------------------------------------------------------------------
def _phase1_fwd(V, U, Z, M, SUM, O1, R, D, n, S, stride_vn, stride_vr, stride_vd, eps,
                KEY_NORM: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    qs = tl.arange(0, BLOCK_S)
    rmask = rows < R
    smask = qs < S
    # pass A: each block's RMS and its logits against all S queries, with the running max
    # and sum of exponentials (online softmax)
    m = tl.full([BLOCK_R, BLOCK_S], float("-inf"), ACC)
    ssum = tl.zeros([BLOCK_R, BLOCK_S], ACC)
    vrow = V + rows[:, None] * stride_vr
    vp = vrow
    zp = Z + qs[None, :] * R + rows[:, None]
    zmask = rmask[:, None] & smask[None, :]
    for _ in range(n):
        dot = tl.zeros([BLOCK_R, BLOCK_S], ACC)
        sq = tl.zeros([BLOCK_R], ACC)
        for c0 in range(0, D, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            cmask = cols < D
            v = tl.load(vp + cols[None, :] * stride_vd, mask=rmask[:, None] & cmask[None, :],
                        other=0.0).to(ACC)
            u = tl.load(U + qs[:, None] * D + cols[None, :],
                        mask=smask[:, None] & cmask[None, :], other=0.0).to(ACC)
            dot += tl.sum(v[:, None, :] * u[None, :, :], axis=2)
            sq += tl.sum(v * v, axis=1)
        if KEY_NORM:
            z = dot / tl.sqrt(sq / D + eps)[:, None]
        else:
            z = dot
        tl.store(zp, z, mask=zmask)
        m_new = tl.maximum(m, z)
        ssum = ssum * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
        vp += stride_vn
        zp += S * R
    so = qs[None, :] * R + rows[:, None]
    tl.store(M + so, m, mask=zmask)
    tl.store(SUM + so, ssum, mask=zmask)
    # Z is read back below, possibly by other threads of this program
    tl.debug_barrier()
    # pass B: the S un-normalised outputs, chunk by chunk; this program's blocks were just
    # read in pass A, so with small row tiles they come back from L2
    sr = qs[:, None] * R + rows[None, :]                      # [S, R] offsets
    srmask = smask[:, None] & rmask[None, :]
    mt = tl.load(M + sr, mask=srmask, other=0.0)
    for c0 in range(0, D, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < D
        acc = tl.zeros([BLOCK_S, BLOCK_R, BLOCK_C], ACC)
        vq = vrow + cols[None, :] * stride_vd
        zq = Z + sr
        for _ in range(n):
            e = tl.exp(tl.load(zq, mask=srmask, other=0.0) - mt)
            v = tl.load(vq, mask=rmask[:, None] & cmask[None, :], other=0.0).to(ACC)
            acc += e[:, :, None] * v[None, :, :]
            vq += stride_vn
            zq += S * R
        op = O1 + (qs[:, None, None] * R + rows[None, :, None]) * D + cols[None, None, :]
        tl.store(op, acc, mask=srmask[:, :, None] & cmask[None, None, :])


def _phase1_dlogits(V, DO1, DM, DS, Z, M, DZ, RINV, COEF, R, D, n, S,
                    stride_vn, stride_vr, stride_vd, eps,
                    KEY_NORM: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # e_si = e^(z_si - m_s); o1_s = sum_i e_si v_i; s1_s = sum_i e_si; m_s = max_i z_si.
    # de_si = do1_s . v_i + ds1_s; dz_si = e_si de_si + dm_s [i is an argmax] / #argmax, with
    # dm_s = dm1_s - sum_i e_si de_si (ties split evenly, as torch.amax's backward does).
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    qs = tl.arange(0, BLOCK_S)
    rmask = rows < R
    smask = qs < S
    sr = qs[:, None] * R + rows[None, :]
    srmask = smask[:, None] & rmask[None, :]
    m = tl.load(M + sr, mask=srmask, other=0.0)
    ds = tl.load(DS + sr, mask=srmask, other=0.0).to(ACC)
    tsum = tl.zeros([BLOCK_S, BLOCK_R], ACC)
    ties = tl.zeros([BLOCK_S, BLOCK_R], ACC)
    vp = V + rows[:, None] * stride_vr
    for i in range(n):
        pdot = tl.zeros([BLOCK_S, BLOCK_R], ACC)
        sq = tl.zeros([BLOCK_R], ACC)
        for c0 in range(0, D, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            cmask = cols < D
            v = tl.load(vp + cols[None, :] * stride_vd, mask=rmask[:, None] & cmask[None, :],
                        other=0.0).to(ACC)
            g = tl.load(DO1 + sr[:, :, None] * D + cols[None, None, :],
                        mask=srmask[:, :, None] & cmask[None, None, :], other=0.0).to(ACC)
            pdot += tl.sum(g * v[None, :, :], axis=2)
            sq += tl.sum(v * v, axis=1)
        z = tl.load(Z + i * S * R + sr, mask=srmask, other=0.0)
        de = pdot + ds
        tsum += tl.exp(z - m) * de
        ties += tl.where(z == m, 1.0, 0.0)
        tl.store(DZ + i * S * R + sr, de, mask=srmask)
        if KEY_NORM:
            tl.store(RINV + i * R + rows, 1.0 / tl.sqrt(sq / D + eps), mask=rmask)
        vp += stride_vn
    # DZ is read back below, possibly by other threads of this program
    tl.debug_barrier()
    dm = (tl.load(DM + sr, mask=srmask, other=0.0).to(ACC) - tsum) / tl.maximum(ties, 1.0)
    for i in range(n):
        z = tl.load(Z + i * S * R + sr, mask=srmask, other=0.0)
        de = tl.load(DZ + i * S * R + sr, mask=srmask, other=0.0)
        dz = tl.exp(z - m) * de + tl.where(z == m, dm, 0.0)
        tl.store(DZ + i * S * R + sr, dz, mask=srmask)
        # the coefficient of v_i in its own gradient through its RMS: -sum_s dz_si z_si r_i^2/D
        tl.store(COEF + i * R + rows, tl.sum(dz * z, axis=0), mask=rmask)


def _phase1_dsources(V, U, DO1, Z, M, DZ, RINV, COEF, DV, DU_PART, R, D, n, S, stride_dvn,
                     stride_vn, stride_vr, stride_vd,
                     KEY_NORM: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # dv_i = sum_s e_si do1_s + r_i sum_s dz_si u_s - COEF_i r_i^2 v_i / D;
    # du_s = sum_rows dz_si r_i v_i.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    qs = tl.arange(0, BLOCK_S)
    rmask = rows < R
    cmask = cols < D
    smask = qs < S
    sr = qs[:, None] * R + rows[None, :]
    srmask = smask[:, None] & rmask[None, :]
    vmask = rmask[:, None] & cmask[None, :]
    m = tl.load(M + sr, mask=srmask, other=0.0)
    g = tl.load(DO1 + sr[:, :, None] * D + cols[None, None, :],
                mask=srmask[:, :, None] & cmask[None, None, :], other=0.0).to(ACC)
    u = tl.load(U + qs[:, None] * D + cols[None, :], mask=smask[:, None] & cmask[None, :],
                other=0.0).to(ACC)
    du = tl.zeros([BLOCK_S, BLOCK_C], ACC)
    vp = V + rows[:, None] * stride_vr + cols[None, :] * stride_vd
    dvp = DV + rows[:, None] * D + cols[None, :]
    for i in range(n):
        v = tl.load(vp, mask=vmask, other=0.0).to(ACC)
        e = tl.exp(tl.load(Z + i * S * R + sr, mask=srmask, other=0.0) - m)
        dz = tl.load(DZ + i * S * R + sr, mask=srmask, other=0.0)
        if KEY_NORM:
            r = tl.load(RINV + i * R + rows, mask=rmask, other=0.0)
        else:
            r = tl.full([BLOCK_R], 1.0, ACC)
        dzr = dz * r[None, :]
        dv = tl.sum(e[:, :, None] * g, axis=0) + tl.sum(dzr[:, :, None] * u[:, None, :], axis=0)
        if KEY_NORM:
            coef = tl.load(COEF + i * R + rows, mask=rmask, other=0.0)
            dv -= (coef * r * r / D)[:, None] * v
        tl.store(dvp, dv, mask=vmask)
        du += tl.sum(dzr[:, :, None] * v[None, :, :], axis=1)
        vp += stride_vn
        dvp += stride_dvn
    dp = DU_PART + (pid * S + qs[:, None]) * D + cols[None, :]
    tl.store(dp, du, mask=smask[:, None] & cmask[None, :])


def _phase1_tiles(rows: int, d: int, S: int, device: torch.device, kernel: str):
    """(BLOCK_R, BLOCK_S, BLOCK_C) for kernel "fwd", "dlogits" or "dsources".

    On a GPU, "fwd" and "dlogits" take 2 rows per program with wide channel chunks, so what a
    program reads twice (its blocks in "fwd", its S output gradients in "dlogits", about
    n x 2 x d and S x 2 x d values) is still in L2 the second time; "dsources" reads each
    thing once and takes 16 rows, which keeps its per-program partials of du small.
    """
    block_s = rt.next_pow2(S)
    if device.type == "cuda" and "rows" not in rt._override:
        block_r = 16 if kernel == "dsources" else 2
        block_c = max(32, min(rt.next_pow2(d), 8192 // (block_s * block_r)))
        return block_r, block_s, rt._override.get("chunk", block_c)
    block_c = rt.chunk_size(d, device)
    block_r = rt.row_tile(rows, block_s * block_c, device, budget=1 << 16)
    return block_r, block_s, block_c


def phase1_forward(completed: torch.Tensor, queries: torch.Tensor, gains: torch.Tensor | None,
                   eps: float, key_norm: bool):
    """(o1 [S, *batch, d] in the input dtype, m1 and s1 [S, *batch, 1] and the logits
    z [n, S, rows] in the accumulation dtype)."""
    rt.require(completed.device)
    dev, n, d, S = completed.device, completed.shape[0], completed.shape[-1], queries.shape[0]
    batch = completed.shape[1:-1]
    acc = rt.acc_dtype(completed.dtype)
    v = rows_view(completed)
    rows = v.shape[1]
    o1 = torch.empty((S, rows, d), dtype=completed.dtype, device=dev)
    m1 = torch.empty((S, rows), dtype=acc, device=dev)
    s1 = torch.empty((S, rows), dtype=acc, device=dev)
    z = torch.empty((n, S, rows), dtype=acc, device=dev)
    if rows:
        u = folded_query(queries, gains, key_norm, acc)
        block_r, block_s, block_c = _phase1_tiles(rows, d, S, dev, "fwd")
        r_tiles = triton.cdiv(rows, block_r)
        warps = rt.num_warps(block_r * block_s * block_c)
        strides = (v.stride(0), v.stride(1), v.stride(2))
        rt.kernel(_phase1_fwd, dev)[(r_tiles,)](
            v, u, z, m1, s1, o1, rows, d, n, S, *strides, eps, KEY_NORM=key_norm,
            ACC=rt.tl_acc(completed.dtype), BLOCK_R=block_r, BLOCK_S=block_s,
            BLOCK_C=block_c, num_warps=warps)
    return (o1.view((S, *batch, d)), m1.view((S, *batch, 1)), s1.view((S, *batch, 1)), z)


def phase1_backward(do1, dm1, ds1, completed, queries, gains, z, m1, eps, key_norm):
    """(dcompleted like completed (contiguous), du [S, d] in the accumulation dtype)."""
    rt.require(completed.device)
    dev, n, d, S = completed.device, completed.shape[0], completed.shape[-1], queries.shape[0]
    acc = rt.acc_dtype(completed.dtype)
    v = rows_view(completed)
    rows = v.shape[1]
    dv = torch.empty(completed.shape, dtype=completed.dtype, device=dev)
    if not rows:
        return dv, torch.zeros((S, d), dtype=acc, device=dev)
    u = folded_query(queries, gains, key_norm, acc)
    strides = (v.stride(0), v.stride(1), v.stride(2))
    do1 = do1.reshape(S, rows, d).contiguous()
    dm1 = dm1.reshape(S, rows).to(acc).contiguous()
    ds1 = ds1.reshape(S, rows).to(acc).contiguous()
    m1 = m1.reshape(S, rows).contiguous()
    dz = torch.empty((n, S, rows), dtype=acc, device=dev)
    rinv = torch.empty((n, rows), dtype=acc, device=dev)
    coef = torch.empty((n, rows), dtype=acc, device=dev)
    tl_acc = rt.tl_acc(completed.dtype)
    # the two kernels index the scratch by row, not by tile, so their tiles may differ
    block_r, block_s, block_c = _phase1_tiles(rows, d, S, dev, "dlogits")
    rt.kernel(_phase1_dlogits, dev)[(triton.cdiv(rows, block_r),)](
        v, do1, dm1, ds1, z, m1, dz, rinv, coef, rows, d, n, S, *strides, eps,
        KEY_NORM=key_norm, ACC=tl_acc, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_C=block_c,
        num_warps=rt.num_warps(block_r * block_s * block_c))
    block_r, block_s, block_c = _phase1_tiles(rows, d, S, dev, "dsources")
    r_tiles = triton.cdiv(rows, block_r)
    du_part = torch.empty((r_tiles, S, d), dtype=acc, device=dev)
    rt.kernel(_phase1_dsources, dev)[(r_tiles, triton.cdiv(d, block_c))](
        v, u, do1, z, m1, dz, rinv, coef, dv, du_part, rows, d, n, S, rows * d, *strides,
        KEY_NORM=key_norm, ACC=tl_acc, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_C=block_c,
        num_warps=rt.num_warps(block_r * block_s * block_c))
    return dv, du_part.sum(0)


# ---- phase 2 ------------------------------------------------------------------------------
def _phase2_fwd(O1, M1, S1, P, U, NW, H, Y, R, D, stride_or, stride_pr, eps, norm_eps,
                HAS_PARTIAL: tl.constexpr, KEY_NORM: tl.constexpr, HAS_NORM: tl.constexpr,
                HAS_NW: tl.constexpr, ACC: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    o1 = tl.load(O1 + rows[:, None] * stride_or + cols[None, :], mask=mask, other=0.0).to(ACC)
    m1 = tl.load(M1 + rows, mask=rmask, other=0.0).to(ACC)
    s1 = tl.load(S1 + rows, mask=rmask, other=1.0).to(ACC)
    if HAS_PARTIAL:
        p = tl.load(P + rows[:, None] * stride_pr + cols[None, :], mask=mask, other=0.0).to(ACC)
        u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
        z2 = tl.sum(p * u[None, :], axis=1)
        if KEY_NORM:
            z2 = z2 / tl.sqrt(tl.sum(p * p, axis=1) / D + eps)
        m = tl.maximum(m1, z2)
        a = tl.exp(m1 - m)
        b = tl.exp(z2 - m)
        h = (a[:, None] * o1 + b[:, None] * p) / (a * s1 + b)[:, None]
    else:
        h = o1 / s1[:, None]
    io = rows[:, None] * D + cols[None, :]
    tl.store(H + io, h, mask=mask)
    if HAS_NORM:
        # the next sublayer's PreNorm, from the fp32 h still in registers
        y = h / tl.sqrt(tl.sum(h * h, axis=1) / D + norm_eps)[:, None]
        if HAS_NW:
            y = y * tl.load(NW + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        tl.store(Y + io, y, mask=mask)


def _phase2_bwd(DH, DY, O1, M1, S1, P, U, NW, DO1, DM1, DS1, DP, DU_PART, DNW_PART, R, D,
                stride_or, stride_pr, eps, norm_eps,
                HAS_PARTIAL: tl.constexpr, KEY_NORM: tl.constexpr, HAS_NORM: tl.constexpr,
                HAS_NW: tl.constexpr, ACC: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    io = rows[:, None] * D + cols[None, :]
    o1 = tl.load(O1 + rows[:, None] * stride_or + cols[None, :], mask=mask, other=0.0).to(ACC)
    m1 = tl.load(M1 + rows, mask=rmask, other=0.0).to(ACC)
    s1 = tl.load(S1 + rows, mask=rmask, other=1.0).to(ACC)
    g = tl.load(DH + io, mask=mask, other=0.0).to(ACC)
    # recompute h in the accumulation dtype (cheaper than saving it, and exact)
    if HAS_PARTIAL:
        p = tl.load(P + rows[:, None] * stride_pr + cols[None, :], mask=mask, other=0.0).to(ACC)
        u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
        z2 = tl.sum(p * u[None, :], axis=1)
        if KEY_NORM:
            r = 1.0 / tl.sqrt(tl.sum(p * p, axis=1) / D + eps)
            z2 = z2 * r
        else:
            r = tl.full([BLOCK_R], 1.0, ACC)
        m = tl.maximum(m1, z2)
        a = tl.exp(m1 - m)
        b = tl.exp(z2 - m)
        den = a * s1 + b
        h = (a[:, None] * o1 + b[:, None] * p) / den[:, None]
    else:
        h = o1 / s1[:, None]
    if HAS_NORM:
        # y = h rn nw: dh += rn gy - h rn^3 (gy . h) / D with gy = dy nw
        dy = tl.load(DY + io, mask=mask, other=0.0).to(ACC)
        rn = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + norm_eps)
        if HAS_NW:
            gy = dy * tl.load(NW + cols, mask=cmask, other=0.0).to(ACC)[None, :]
            tl.store(DNW_PART + pid * D + cols, tl.sum(dy * h * rn[:, None], axis=0), mask=cmask)
        else:
            gy = dy
        g += rn[:, None] * gy - (rn * rn * rn * tl.sum(gy * h, axis=1) / D)[:, None] * h
    gh = tl.sum(g * h, axis=1)
    if HAS_PARTIAL:
        # h = (a o1 + b p) / (a s1 + b), a = e^(m1 - m), b = e^(z2 - m), m = max(m1, z2)
        da = (tl.sum(g * o1, axis=1) - gh * s1) / den
        db = (tl.sum(g * p, axis=1) - gh) / den
        dm = -(a * da + b * db)
        # torch.maximum's backward: all to the larger input, half each on a tie
        w1 = tl.where(m1 > z2, 1.0, tl.where(m1 == z2, 0.5, 0.0))
        dm1 = a * da + w1 * dm
        dz2 = b * db + (1.0 - w1) * dm
        do1 = (a / den)[:, None] * g
        ds1 = -a * gh / den
        dp = (b / den)[:, None] * g + (dz2 * r)[:, None] * u[None, :]
        if KEY_NORM:
            dp -= (dz2 * z2 * r * r / D)[:, None] * p
        tl.store(DP + io, dp, mask=mask)
        tl.store(DU_PART + pid * D + cols, tl.sum((dz2 * r)[:, None] * p, axis=0), mask=cmask)
    else:
        do1 = g / s1[:, None]
        ds1 = -gh / s1
        dm1 = tl.zeros([BLOCK_R], ACC)
    tl.store(DO1 + io, do1, mask=mask)
    tl.store(DM1 + rows, dm1, mask=rmask)
    tl.store(DS1 + rows, ds1, mask=rmask)


def _rows2(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [*batch, d] as [rows, d] with unit channel stride (a copy only when needed)."""
    x2 = x.reshape(-1, d)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _phase2_setup(o1, m1, s1, partial, query, gain, key_norm):
    d = o1.shape[-1]
    acc = rt.acc_dtype(o1.dtype)
    o = _rows2(o1, d)
    p = _rows2(partial, d) if partial is not None else o
    # unused pointer arguments get a real tensor (o), never an empty one
    u = folded_query(query, gain, key_norm, acc) if partial is not None else o
    rows = o.shape[0]
    block_d = rt.next_pow2(d)
    block_r = rt.row_tile(rows, block_d, o1.device)
    return d, acc, o, p, u, m1.reshape(rows).contiguous(), s1.reshape(rows).contiguous(), \
        rows, block_r, block_d


def phase2_forward(o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
                   with_norm):
    """(h like o1, y = rmsnorm(h) * norm_weight like o1, or an empty tensor without the norm)."""
    rt.require(o1.device)
    d, acc, o, p, u, m, s, rows, block_r, block_d = _phase2_setup(
        o1, m1, s1, partial, query, gain, key_norm)
    h = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    y = torch.empty(o1.shape if with_norm else (0,), dtype=o1.dtype, device=o1.device)
    if rows:
        nw = norm_weight if norm_weight is not None else u
        rt.kernel(_phase2_fwd, o1.device)[(triton.cdiv(rows, block_r),)](
            o, m, s, p, u, nw, h, y if with_norm else h, rows, d, o.stride(0), p.stride(0),
            eps, norm_eps,
            HAS_PARTIAL=partial is not None, KEY_NORM=key_norm, HAS_NORM=with_norm,
            HAS_NW=norm_weight is not None, ACC=rt.tl_acc(o1.dtype), BLOCK_R=block_r,
            BLOCK_D=block_d, num_warps=rt.num_warps(block_r * block_d))
    return h, y


def phase2_backward(dh, dy, o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps,
                    key_norm, with_norm):
    """(do1, dm1, ds1, dpartial (empty without a partial), du [d] and dnorm_weight [d] in the
    accumulation dtype (zeros where they do not apply))."""
    rt.require(o1.device)
    d, acc, o, p, u, m, s, rows, block_r, block_d = _phase2_setup(
        o1, m1, s1, partial, query, gain, key_norm)
    dev = o1.device
    programs = triton.cdiv(max(rows, 1), block_r)
    do1 = torch.empty(o1.shape, dtype=o1.dtype, device=dev)
    dm1 = torch.empty((rows,), dtype=acc, device=dev)
    ds1 = torch.empty((rows,), dtype=acc, device=dev)
    dp = torch.empty(partial.shape if partial is not None else (0,),
                     dtype=(partial if partial is not None else o1).dtype, device=dev)
    du_part = torch.zeros((programs, d), dtype=acc, device=dev)
    dnw_part = torch.zeros((programs, d), dtype=acc, device=dev)
    if rows:
        nw = norm_weight if norm_weight is not None else u
        dy_ = _rows2(dy, d) if with_norm else o
        rt.kernel(_phase2_bwd, dev)[(programs,)](
            _rows2(dh, d).contiguous(), dy_.contiguous(), o, m, s, p, u, nw, do1, dm1, ds1,
            dp if partial is not None else do1,
            du_part, dnw_part, rows, d, o.stride(0), p.stride(0), eps, norm_eps,
            HAS_PARTIAL=partial is not None, KEY_NORM=key_norm, HAS_NORM=with_norm,
            HAS_NW=norm_weight is not None, ACC=rt.tl_acc(o1.dtype), BLOCK_R=block_r,
            BLOCK_D=block_d, num_warps=rt.num_warps(block_r * block_d))
    return (do1, dm1.view(m1.shape).to(m1.dtype), ds1.view(s1.shape).to(s1.dtype), dp,
            du_part.sum(0), dnw_part.sum(0))
