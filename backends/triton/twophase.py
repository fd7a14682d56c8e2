"""The two-phase pair for Block AttnRes: phase 1 (all S queries of a block over the completed
blocks) and phase 2 (merge the partial sum by online softmax, optionally fused with the next
sublayer's RMSNorm). Forward and backward kernels and their launchers.

Math: backends/eager/depth.py:phase1 / phase2 with heads=1. u_s = gain_s * query_s.

The completed blocks reach phase 1 through a table of addresses (sources.py), never stacked;
phase 1 writes each query's o1 into its own buffer (so each phase 2 gets, and sends back,
a gradient of its own instead of a zero-filled [S, ...] one) and phase 1's backward writes
each block's gradient into its own buffer.

Reads of the completed blocks in phase 1 (n blocks, S queries, per token row):
- forward (`_phase1_fwd`): pass A streams each block once in channel chunks and computes its
  RMS and the logits of all S queries at once; pass B, in the same program, streams the blocks
  again and accumulates the S outputs, normalised (pass A ends with each query's lse). So 2
  reads of the completed blocks for all S queries, against S reads for S separate
  aggregations; with few rows per program the second read should mostly hit L2 (n x rows x
  d values per program), but that is not measured here. (A single read would need S
  accumulators of d channels per row at once, more than a program's registers hold at d in
  the thousands.) Pass A reloads the S query chunks for every block; more rows per program
  (autotuned) spread that over more rows.
- backward: `_phase1_dlogits` reads each block once, with the S output gradients of each
  chunk re-read per block (from L2 with few rows per program); `_phase1_dsources` reads each
  block once more (the output gradients of its tile come from DRAM for the first block and
  from L1/L2 after) and writes the block gradients.
- measured on an H200 (n 8, S 4, d 2048, 64k rows, bf16): fwd 6.9 ms, dlogits 3.5 ms,
  dsources 5.4 ms (36.1 ms in its first form). Summing fwd's and dlogits' channel products
  elementwise over the chunks, to reduce once per block instead of once per chunk, made
  them slower (7.9 and 4.2 ms), so they reduce per chunk.
Logits z [n, S, rows] go through a small fp32 scratch (S / d of the block traffic); autograd
keeps z and m1 = lse (per-token scalars) and the blocks themselves (alive anyway).

Offsets are int64 wherever a row index multiplies a width. Scratch for a parameter's
gradient (per-program partial sums) is allocated only when that gradient is wanted.
"""
from __future__ import annotations

import torch

from . import runtime as rt
from .runtime import tl, triton
from .single import exp_shift, folded_query, key_logit
from .sources import Sources, buffer_rows, load_source, tl_dtype


# ---- phase 1 ------------------------------------------------------------------------------
def _phase1_fwd(SRC, U, Z, M, SUM, OUTS, R, D, n0, n, S, eps,
                DT0: tl.constexpr, DT1: tl.constexpr, NGROUPS: tl.constexpr,
                ALIGNED: tl.constexpr, ODT: tl.constexpr, KEY_NORM: tl.constexpr,
                ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    qs = tl.arange(0, BLOCK_S)
    rmask = rows < R
    smask = qs < S
    uq = qs.to(tl.int64) * D                                  # each query's row of U
    # pass A: each block's RMS and its logits against all S queries, with the running max
    # and sum of exponentials (online softmax)
    m = tl.full([BLOCK_R, BLOCK_S], float("-inf"), ACC)
    ssum = tl.zeros([BLOCK_R, BLOCK_S], ACC)
    rs = qs[None, :].to(tl.int64) * R + rows[:, None]         # [R, S] offsets into [S, R]
    zmask = rmask[:, None] & smask[None, :]
    for g in tl.static_range(NGROUPS):
        for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
            dot = tl.zeros([BLOCK_R, BLOCK_S], ACC)
            sq = tl.zeros([BLOCK_R], ACC)
            for c0 in range(0, D, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                cmask = cols < D
                v = load_source(SRC, n, i, rows, cols, rmask[:, None] & cmask[None, :],
                                DT0 if g == 0 else DT1, ALIGNED, ACC)
                u = tl.load(U + uq[:, None] + cols[None, :],
                            mask=smask[:, None] & cmask[None, :], other=0.0).to(ACC)
                dot += tl.sum(v[:, None, :] * u[None, :, :], axis=2)
                sq += tl.sum(v * v, axis=1)
            if KEY_NORM:
                z = dot / tl.sqrt(sq / D + eps)[:, None]
            else:
                z = dot
            tl.store(Z + tl.cast(i, tl.int64) * S * R + rs, z, mask=zmask)
            m_new = tl.maximum(m, z)
            shift = exp_shift(m_new)
            ssum = ssum * tl.exp(m - shift) + tl.exp(z - shift)
            m = m_new
    # the normalised state (h1, lse, 1): pass B then sums alpha_i v_i, a convex mix of the
    # blocks. The un-normalised sum_i e^(z_i - m) v_i is up to n times the largest block
    # and overflowed fp16's range where every input and the result fit in it.
    tl.store(M + rs, m + tl.log(ssum), mask=zmask)
    tl.store(SUM + rs, tl.full([BLOCK_R, BLOCK_S], 1.0, ACC), mask=zmask)
    # Z and M are read back below, possibly by other threads of this program
    tl.debug_barrier()
    # pass B: the S outputs h1 = sum_i e^(z_i - lse) v_i, chunk by chunk, each into its
    # query's buffer; this program's blocks were just read in pass A, so with small row
    # tiles they come back from L2
    sr = qs[:, None].to(tl.int64) * R + rows[None, :]         # [S, R] offsets
    srmask = smask[:, None] & rmask[None, :]
    mt = tl.load(M + sr, mask=srmask, other=0.0)
    outs = tl.load(OUTS + qs, mask=smask, other=0).to(tl.pointer_type(ODT))
    orow = tl.multiple_of(outs, 16)[:, None] + rows[None, :] * D   # [S, R] row pointers
    for c0 in range(0, D, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < D
        acc = tl.zeros([BLOCK_S, BLOCK_R, BLOCK_C], ACC)
        for g in tl.static_range(NGROUPS):
            for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
                e = tl.exp(tl.load(Z + tl.cast(i, tl.int64) * S * R + sr, mask=srmask, other=0.0) - mt)
                v = load_source(SRC, n, i, rows, cols, rmask[:, None] & cmask[None, :],
                                DT0 if g == 0 else DT1, ALIGNED, ACC)
                acc += e[:, :, None] * v[None, :, :]
        tl.store(orow[:, :, None] + cols[None, None, :], acc,
                 mask=srmask[:, :, None] & cmask[None, None, :])


def _phase1_dlogits(SRC, DO1S, DM, DS, Z, M, DZ, RINV, COEF, R, D, n0, n, S, eps,
                    DT0: tl.constexpr, DT1: tl.constexpr, NGROUPS: tl.constexpr,
                    ALIGNED: tl.constexpr, GDT: tl.constexpr, KEY_NORM: tl.constexpr,
                    ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    # The forward's normalised state: m_s = lse_s, e_si = e^(z_si - m_s) = alpha_si,
    # o1_s = sum_i e_si v_i, s1_s = sum_i e_si (= 1). de_si = do1_s . v_i + ds1_s;
    # dz_si = e_si de_si + alpha_si dm_s = e_si (de_si + dm_s), with
    # dm_s = dm1_s - sum_i e_si de_si (d lse_s / d z_si = alpha_si; ds1 cancels out).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    qs = tl.arange(0, BLOCK_S)
    rmask = rows < R
    smask = qs < S
    sr = qs[:, None].to(tl.int64) * R + rows[None, :]
    srmask = smask[:, None] & rmask[None, :]
    m = tl.load(M + sr, mask=srmask, other=0.0)
    ds = tl.load(DS + sr, mask=srmask, other=0.0).to(ACC)
    grads = tl.load(DO1S + qs, mask=smask, other=0).to(tl.pointer_type(GDT))
    grow = tl.multiple_of(grads, 16)[:, None] + rows[None, :] * D   # [S, R] row pointers
    tsum = tl.zeros([BLOCK_S, BLOCK_R], ACC)
    for g in tl.static_range(NGROUPS):
        for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
            pdot = tl.zeros([BLOCK_S, BLOCK_R], ACC)
            sq = tl.zeros([BLOCK_R], ACC)
            for c0 in range(0, D, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                cmask = cols < D
                v = load_source(SRC, n, i, rows, cols, rmask[:, None] & cmask[None, :],
                                DT0 if g == 0 else DT1, ALIGNED, ACC)
                gg = tl.load(grow[:, :, None] + cols[None, None, :],
                             mask=srmask[:, :, None] & cmask[None, None, :], other=0.0).to(ACC)
                pdot += tl.sum(gg * v[None, :, :], axis=2)
                sq += tl.sum(v * v, axis=1)
            zi = Z + tl.cast(i, tl.int64) * S * R + sr
            z = tl.load(zi, mask=srmask, other=0.0)
            de = pdot + ds
            tsum += tl.exp(z - m) * de
            tl.store(DZ + tl.cast(i, tl.int64) * S * R + sr, de, mask=srmask)
            if KEY_NORM:
                tl.store(RINV + tl.cast(i, tl.int64) * R + rows, 1.0 / tl.sqrt(sq / D + eps),
                         mask=rmask)
    # DZ is read back below, possibly by other threads of this program
    tl.debug_barrier()
    dm1 = tl.load(DM + sr, mask=srmask, other=0.0).to(ACC)
    for i in range(n):
        z = tl.load(Z + tl.cast(i, tl.int64) * S * R + sr, mask=srmask, other=0.0)
        de = tl.load(DZ + tl.cast(i, tl.int64) * S * R + sr, mask=srmask, other=0.0)
        # (de - tsum) + dm1, not de + (dm1 - tsum): next to large sources (de ~ |v|) the
        # latter dropped lse's gradient dm1, where this cancels first (exactly, at weight 1)
        dz = tl.exp(z - m) * ((de - tsum) + dm1)
        tl.store(DZ + tl.cast(i, tl.int64) * S * R + sr, dz, mask=srmask)
        # the coefficient of v_i in its own gradient through its RMS: -sum_s dz_si z_si r_i^2/D
        tl.store(COEF + tl.cast(i, tl.int64) * R + rows, tl.sum(dz * z, axis=0), mask=rmask)


def _phase1_dsources(SRC, DSRC, U, DO1S, Z, M, DZ, RINV, COEF, DU_PART, R, D, n0, n, S,
                     DT0: tl.constexpr, DT1: tl.constexpr, NGROUPS: tl.constexpr,
                     ALIGNED: tl.constexpr, GDT: tl.constexpr, KEY_NORM: tl.constexpr,
                     HAS_DU: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_S: tl.constexpr, DOT_S: tl.constexpr, BLOCK_C: tl.constexpr):
    # dv_i = sum_s e_si do1_s + r_i sum_s dz_si u_s - COEF_i r_i^2 v_i / D;
    # du_s = sum_rows dz_si r_i v_i. A persistent program per channel chunk: it takes every
    # num_programs-th row tile and sums du over them.
    # Every tile is a 2-D [rows, chunk] one and the S queries are unrolled: a [S, rows, chunk]
    # tile summed over S (the kernel's first form) put S across warps, so each block cost
    # cross-warp reductions and barriers, and its tiles were too small to keep enough loads
    # in flight (an H200 ran it at 0.15 TB/s; this form 1.0 TB/s). The output gradient tiles
    # are re-read for every block from L1/L2 rather than held. du is one [DOT_S, rows] x
    # [rows, chunk] product per block (tl.dot in exact fp32; tf32x3 was no faster).
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < D
    qd = tl.arange(0, DOT_S)
    qdmask = qd < S
    du = tl.zeros([DOT_S, BLOCK_C], ACC)
    for t in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = tl.cast(t, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        vmask = rmask[:, None] & cmask[None, :]
        for g in tl.static_range(NGROUPS):
            for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
                zi = tl.cast(i, tl.int64) * S * R
                if KEY_NORM:
                    r = tl.load(RINV + tl.cast(i, tl.int64) * R + rows, mask=rmask, other=0.0)
                else:
                    r = tl.full([BLOCK_R], 1.0, ACC)
                dv = tl.zeros([BLOCK_R, BLOCK_C], ACC)
                for s in tl.static_range(BLOCK_S):
                    smask = rmask & (tl.full([BLOCK_R], s, tl.int32) < S)   # query s exists
                    sr = tl.cast(R, tl.int64) * s + rows
                    e = tl.exp(tl.load(Z + zi + sr, mask=smask, other=0.0)
                               - tl.load(M + sr, mask=smask, other=0.0))
                    dzr = tl.load(DZ + zi + sr, mask=smask, other=0.0) * r
                    gp = tl.load(DO1S + tl.minimum(s, S - 1)).to(tl.pointer_type(GDT))
                    gg = tl.load(tl.multiple_of(gp, 16) + rows[:, None] * D + cols[None, :],
                                 mask=smask[:, None] & cmask[None, :], other=0.0).to(ACC)
                    u = tl.load(U + tl.cast(D, tl.int64) * s + cols,
                                mask=cmask & (tl.full([BLOCK_C], s, tl.int32) < S),
                                other=0.0).to(ACC)
                    dv += e[:, None] * gg + dzr[:, None] * u[None, :]
                if KEY_NORM or HAS_DU:
                    v = load_source(SRC, n, i, rows, cols, vmask, DT0 if g == 0 else DT1,
                                    ALIGNED, ACC)
                if KEY_NORM:
                    coef = tl.load(COEF + tl.cast(i, tl.int64) * R + rows, mask=rmask, other=0.0)
                    dv -= (coef * r * r / D)[:, None] * v
                dp = buffer_rows(DSRC, i, rows, D, DT0 if g == 0 else DT1)
                tl.store(dp[:, None] + cols[None, :], dv, mask=vmask)
                if HAS_DU:
                    dzr2 = tl.load(DZ + zi + qd[:, None].to(tl.int64) * R + rows[None, :],
                                   mask=qdmask[:, None] & rmask[None, :], other=0.0) * r[None, :]
                    if BLOCK_R >= 16:
                        du += tl.dot(dzr2, v, input_precision="ieee")
                    else:  # below tl.dot's smallest inner size (interpreter tests' tiles)
                        du += tl.sum(dzr2[:, :, None] * v[None, :, :], axis=1)
    if HAS_DU:
        dp = DU_PART + (tl.program_id(0).to(tl.int64) * S + qd[:, None]) * D + cols[None, :]
        tl.store(dp, du, mask=qdmask[:, None] & cmask[None, :])


def _phase1_fixed(rows: int, d: int, S: int, device: torch.device) -> dict:
    """The interpreter's config (or the one runtime.tiles() forces): big row tiles, one
    channel chunk per 1024 channels."""
    block_c = rt.chunk_size(d, device)
    block_r = rt.row_tile(rows, rt.next_pow2(S) * block_c, device, budget=1 << 16)
    return dict(BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=rt.num_warps(block_r * rt.next_pow2(S) * block_c))


def _phase1_configs(d: int, S: int, kernel: str) -> list[dict]:
    """GPU candidates (rows per program, channel chunk, warps) for "fwd", "dlogits" or
    "dsources": fwd and dlogits read things twice (their blocks, their S output gradients)
    and want few rows, so the second read hits L2; more rows spread pass A's reloads of the
    query chunks; their [rows, S, chunk] tiles hold 8192 values. dsources works on 2-D
    [rows, chunk] tiles (the queries unrolled), 8 to 16 values a thread, with at least 16
    rows so that du is a tl.dot. On an H200 at d 2048 (S 4, bf16) [16, 128] on 4 warps was
    the fastest (5.5 ms); the other three took 6.5 to 7.2 ms, and [32, 128] or [64, 64] on 8
    warps and a two-stage variant 8.6 to 9.3 ms, so those are not offered."""
    block_s = rt.next_pow2(S)
    out = []
    if kernel == "dsources":
        for r, c in ((16, 128), (16, 64), (32, 64), (16, 256)):
            c = max(16, min(rt.next_pow2(d), c))
            cfg = dict(BLOCK_R=r, BLOCK_C=c, num_warps=max(4, min(8, r * c // 512)),
                       num_stages=1)
            if cfg not in out:
                out.append(cfg)
        return out
    for r in (2, 4, 8):
        c = max(32, min(rt.next_pow2(d), 8192 // (block_s * r)))
        out.append(dict(BLOCK_R=r, BLOCK_C=c, num_warps=rt.num_warps(r * block_s * c),
                        num_stages=1))
    return out


def phase1_forward(completed: list[torch.Tensor], queries: torch.Tensor,
                   gains: torch.Tensor | None, eps: float, key_norm: bool):
    """(o1: S tensors [*batch, d] in the blocks' promoted dtype, m1 and s1 [S, *batch, 1]
    and the logits z [n, S, rows] in the accumulation dtype)."""
    src = Sources(completed, "completed")
    rt.require(src.device)
    dev, n, d, S, rows = src.device, src.n, src.d, queries.shape[0], src.rows
    batch = src.shape[:-1]
    o1 = [torch.empty((rows, d), dtype=src.out_dtype, device=dev) for _ in range(S)]
    m1 = torch.empty((S, rows), dtype=src.acc, device=dev)
    s1 = torch.empty((S, rows), dtype=src.acc, device=dev)
    z = torch.empty((n, S, rows), dtype=src.acc, device=dev)
    if rows:
        u = folded_query(queries, gains, key_norm, src.acc)
        table, (outs,) = src.table(o1)
        rt.launch(_phase1_fwd, dev, lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]),),
                  (table, u, z, m1, s1, outs, rows, d, src.n0, n, S, eps),
                  fixed=_phase1_fixed(rows, d, S, dev), configs=_phase1_configs(d, S, "fwd"),
                  key=["n", "D", "S", "KEY_NORM"], **src.constexprs(),
                  ODT=tl_dtype(src.out_dtype), KEY_NORM=key_norm, ACC=rt.tl_acc(src.acc),
                  BLOCK_S=rt.next_pow2(S))
    return ([o.view(src.shape) for o in o1], m1.view((S, *batch, 1)), s1.view((S, *batch, 1)),
            z)


def phase1_backward(do1, dm1, ds1, completed, queries, gains, z, m1, eps, key_norm,
                    need_du: bool):
    """(the block gradients, each like its block, and du [S, d] in the accumulation dtype;
    zeros when not need_du)."""
    src = Sources(completed, "completed")
    rt.require(src.device)
    dev, n, d, S, rows = src.device, src.n, src.d, queries.shape[0], src.rows
    acc = src.acc
    dsrc = src.empty_like()
    du = torch.zeros((S, d), dtype=acc, device=dev)
    if not rows:
        return src.in_caller_order(dsrc), du
    u = folded_query(queries, gains, key_norm, acc)
    # the kernels tell the compiler each output gradient starts 16-byte aligned
    # (tl.multiple_of, for vector loads), as a fresh buffer does; a view at another
    # offset (of a torch.cat's gradient, say) is copied
    do1 = [g.reshape(rows, d).to(src.out_dtype).contiguous() for g in do1]
    do1 = [g if g.data_ptr() % 16 == 0 else g.clone() for g in do1]
    dm1 = dm1.reshape(S, rows).to(acc).contiguous()
    ds1 = ds1.reshape(S, rows).to(acc).contiguous()
    m1 = m1.reshape(S, rows).contiguous()
    dz = torch.empty((n, S, rows), dtype=acc, device=dev)
    rinv = torch.empty((n, rows), dtype=acc, device=dev)
    coef = torch.empty((n, rows), dtype=acc, device=dev)
    table, (grads, douts) = src.table(dsrc, do1)
    common = dict(**src.constexprs(), GDT=tl_dtype(src.out_dtype), KEY_NORM=key_norm,
                  ACC=rt.tl_acc(acc), BLOCK_S=rt.next_pow2(S))
    fixed = _phase1_fixed(rows, d, S, dev)
    # the two kernels index the scratch by row, not by tile, so their tiles may differ
    rt.launch(_phase1_dlogits, dev, lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]),),
              (table, douts, dm1, ds1, z, m1, dz, rinv, coef, rows, d, src.n0, n, S, eps),
              fixed=fixed, configs=_phase1_configs(d, S, "dlogits"),
              key=["n", "D", "S", "KEY_NORM"], **common)
    programs = rt.persistent_programs(triton.cdiv(rows, fixed["BLOCK_R"])
                                      if dev.type != "cuda" else rows, dev)
    du_part = torch.empty((programs, S, d) if need_du else (1,), dtype=acc, device=dev)
    rt.launch(_phase1_dsources, dev,
              lambda meta: (programs, triton.cdiv(d, meta["BLOCK_C"])),
              (table, grads, u, douts, z, m1, dz, rinv, coef, du_part, rows, d, src.n0, n, S),
              fixed=fixed, configs=_phase1_configs(d, S, "dsources"),
              key=["n", "D", "S", "KEY_NORM", "HAS_DU"], HAS_DU=need_du,
              DOT_S=max(16, rt.next_pow2(S)), **common)
    if need_du:
        du = du_part.sum(0)
    return src.in_caller_order(dsrc), du


# ---- phase 2 ------------------------------------------------------------------------------
def _phase2_fwd(O1, M1, S1, P, U, NW, H, Y, R, D, stride_or, stride_pr, eps, norm_eps,
                HAS_PARTIAL: tl.constexpr, KEY_NORM: tl.constexpr, HAS_NORM: tl.constexpr,
                HAS_NW: tl.constexpr, WRITE_H: tl.constexpr, ACC: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
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
        z2, _ = key_logit(p, u, D, eps, KEY_NORM)
        m = tl.maximum(m1, z2)
        a = tl.exp(m1 - m)
        b = tl.exp(z2 - m)
        h = (a[:, None] * o1 + b[:, None] * p) / (a * s1 + b)[:, None]
    else:
        h = o1 / s1[:, None]
    io = rows[:, None] * D + cols[None, :]
    if WRITE_H:
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
                HAS_NW: tl.constexpr, HAS_DH: tl.constexpr, HAS_DP: tl.constexpr,
                HAS_DU: tl.constexpr, HAS_DNW: tl.constexpr, ACC: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # A persistent program: it takes every num_programs-th row tile and sums the gradients
    # of the [d] parameters (query, norm gain) over them.
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if HAS_PARTIAL:
        u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_NW:
        nw = tl.load(NW + cols, mask=cmask, other=0.0).to(ACC)
    du = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    dnw = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    for t in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = tl.cast(t, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        mask = rmask[:, None] & cmask[None, :]
        io = rows[:, None] * D + cols[None, :]
        o1 = tl.load(O1 + rows[:, None] * stride_or + cols[None, :], mask=mask,
                     other=0.0).to(ACC)
        m1 = tl.load(M1 + rows, mask=rmask, other=0.0).to(ACC)
        s1 = tl.load(S1 + rows, mask=rmask, other=1.0).to(ACC)
        if HAS_DH:
            g = tl.load(DH + io, mask=mask, other=0.0).to(ACC)
        else:
            g = tl.zeros([BLOCK_R, BLOCK_D], ACC)
        # recompute h in the accumulation dtype (cheaper than saving it, and exact)
        if HAS_PARTIAL:
            p = tl.load(P + rows[:, None] * stride_pr + cols[None, :], mask=mask,
                        other=0.0).to(ACC)
            z2, r = key_logit(p, u, D, eps, KEY_NORM)
            m = tl.maximum(m1, z2)
            a = tl.exp(m1 - m)
            b = tl.exp(z2 - m)
            den = a * s1 + b
            h = (a[:, None] * o1 + b[:, None] * p) / den[:, None]
        else:
            h = o1 / s1[:, None]
        if HAS_NORM:
            # y = hn nw with hn = h rn: dh += rn (gy - hn (gy . hn) / D), gy = dy nw. Written
            # with hn (bounded) rather than rn^3: an all-zero row (a padded one too) has
            # rn = 1/sqrt(norm_eps), whose cube overflows fp32 and would give 0 * inf = NaN
            dy = tl.load(DY + io, mask=mask, other=0.0).to(ACC)
            rn = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + norm_eps)
            hn = h * rn[:, None]
            if HAS_NW:
                gy = dy * nw[None, :]
                if HAS_DNW:
                    dnw += dy * hn
            else:
                gy = dy
            g += rn[:, None] * (gy - hn * (tl.sum(gy * hn, axis=1) / D)[:, None])
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
            if HAS_DP:
                dp = (b / den)[:, None] * g + (dz2 * r)[:, None] * u[None, :]
                if KEY_NORM:
                    dp -= (dz2 * z2 * r * r / D)[:, None] * p
                tl.store(DP + io, dp, mask=mask)
            if HAS_DU:
                du += (dz2 * r)[:, None] * p
        else:
            do1 = g / s1[:, None]
            ds1 = -gh / s1
            dm1 = tl.zeros([BLOCK_R], ACC)
        tl.store(DO1 + io, do1, mask=mask)
        tl.store(DM1 + rows, dm1, mask=rmask)
        tl.store(DS1 + rows, ds1, mask=rmask)
    part = tl.program_id(0).to(tl.int64) * D + cols
    if HAS_DU:
        tl.store(DU_PART + part, tl.sum(du, axis=0), mask=cmask)
    if HAS_DNW:
        tl.store(DNW_PART + part, tl.sum(dnw, axis=0), mask=cmask)


def _rows2(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [*batch, d] as [rows, d] with unit channel stride (a copy only when needed)."""
    x2 = x.reshape(-1, d)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _phase2_setup(o1, m1, s1, partial, query, gain, norm_weight, key_norm):
    """The kernels' view of phase 2's inputs; the [d] and per-row ones row-major, as the
    kernels index them (a strided norm gain was read at the wrong channels)."""
    d = o1.shape[-1]
    acc = rt.acc_dtype(torch.float64 if torch.float64 in (o1.dtype, getattr(partial, "dtype", None))
                       else o1.dtype)
    o = _rows2(o1, d)
    p = _rows2(partial, d) if partial is not None else o
    # unused pointer arguments get a real tensor (o), never an empty one
    u = folded_query(query, gain, key_norm, acc) if partial is not None else o
    rows = o.shape[0]
    block_d = rt.next_pow2(d)
    out_dtype = o1.dtype if partial is None else torch.promote_types(o1.dtype, partial.dtype)
    nw = norm_weight.contiguous() if norm_weight is not None else u
    return (d, acc, o, p, u, nw, m1.reshape(rows).contiguous(), s1.reshape(rows).contiguous(),
            rows, block_d, out_dtype)


def _phase2_fixed(rows: int, block_d: int, device: torch.device) -> dict:
    block_r = rt.row_tile(rows, block_d, device)
    return dict(BLOCK_R=block_r, num_warps=rt.num_warps(block_r * block_d))


def phase2_forward(o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
                   with_norm, with_h=True):
    """(h, y = rmsnorm(h) * norm_weight), in the promoted dtype of o1 and the partial; y is
    an empty tensor without the norm, h one when not with_h (only y is written then)."""
    rt.require(o1.device)
    d, acc, o, p, u, nw, m, s, rows, block_d, out_dtype = _phase2_setup(
        o1, m1, s1, partial, query, gain, norm_weight, key_norm)
    shape = tuple(o1.shape)
    h = torch.empty(shape if with_h else (0,), dtype=out_dtype, device=o1.device)
    y = torch.empty(shape if with_norm else (0,), dtype=out_dtype, device=o1.device)
    if rows:
        rt.launch(_phase2_fwd, o1.device, rt.row_grid(rows),
                  (o, m, s, p, u, nw, h if with_h else y, y if with_norm else h, rows, d,
                   o.stride(0), p.stride(0), eps, norm_eps),
                  fixed=_phase2_fixed(rows, block_d, o1.device), configs=rt.row_configs(block_d),
                  key=["D", "HAS_PARTIAL", "KEY_NORM", "HAS_NORM", "HAS_NW", "WRITE_H"],
                  HAS_PARTIAL=partial is not None, KEY_NORM=key_norm, HAS_NORM=with_norm,
                  HAS_NW=norm_weight is not None, WRITE_H=with_h, ACC=rt.tl_acc(acc),
                  BLOCK_D=block_d)
    return h, y



def phase2_backward(dh, dy, o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps,
                    key_norm, with_norm, need: tuple[bool, bool, bool]):
    """(do1, dm1, ds1, dpartial, du [d], dnorm_weight [d]); `need` says which of dpartial,
    du and dnorm_weight are wanted (the others come back empty or zero). dh may be empty
    (h was not an output)."""
    rt.require(o1.device)
    need_dp, need_du, need_dnw = need
    d, acc, o, p, u, nw, m, s, rows, block_d, _ = _phase2_setup(
        o1, m1, s1, partial, query, gain, norm_weight, key_norm)
    dev = o1.device
    has_partial = partial is not None
    need_dp = need_dp and has_partial
    # no rows, no kernel: the [d] gradients are sums over nothing, zeros (not the unwritten
    # per-program partials)
    need_du = need_du and has_partial and rows > 0
    need_dnw = need_dnw and with_norm and norm_weight is not None and rows > 0
    fixed = _phase2_fixed(rows, block_d, dev)
    programs = rt.persistent_programs(triton.cdiv(max(rows, 1), fixed["BLOCK_R"])
                                      if dev.type != "cuda" else max(rows, 1), dev)
    do1 = torch.empty(o1.shape, dtype=o1.dtype, device=dev)
    dm1 = torch.empty((rows,), dtype=acc, device=dev)
    ds1 = torch.empty((rows,), dtype=acc, device=dev)
    dp = (torch.empty(partial.shape, dtype=partial.dtype, device=dev) if need_dp
          else torch.empty((0,), dtype=o1.dtype, device=dev))
    du_part = torch.empty((programs, d) if need_du else (1,), dtype=acc, device=dev)
    dnw_part = torch.empty((programs, d) if need_dnw else (1,), dtype=acc, device=dev)
    has_dh = dh.numel() > 0
    if rows:
        rt.launch(_phase2_bwd, dev, lambda meta: (programs,),
                  (_rows2(dh, d).contiguous() if has_dh else o,
                   _rows2(dy, d).contiguous() if with_norm else o, o, m, s, p, u, nw, do1, dm1,
                   ds1, dp if need_dp else do1, du_part, dnw_part, rows, d, o.stride(0),
                   p.stride(0), eps, norm_eps),
                  fixed=fixed, configs=rt.row_configs(block_d, at_16_warps=8),
                  key=["D", "HAS_PARTIAL", "KEY_NORM", "HAS_NORM", "HAS_NW", "HAS_DH",
                       "HAS_DP", "HAS_DU", "HAS_DNW"],
                  HAS_PARTIAL=has_partial, KEY_NORM=key_norm, HAS_NORM=with_norm,
                  HAS_NW=norm_weight is not None, HAS_DH=has_dh, HAS_DP=need_dp,
                  HAS_DU=need_du, HAS_DNW=need_dnw, ACC=rt.tl_acc(acc), BLOCK_D=block_d)
    du = du_part.sum(0) if need_du else torch.zeros(d, dtype=acc, device=dev)
    dnw = dnw_part.sum(0) if need_dnw else torch.zeros(d, dtype=acc, device=dev)
    return (do1, dm1.view(m1.shape).to(m1.dtype), ds1.view(s1.shape).to(s1.dtype), dp, du, dnw)
