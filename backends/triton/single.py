"""Depth attention in one pass over the sources: forward and backward kernels, and launchers.

Per token row: z_i = r_i (v_i . u) with r_i = rsqrt(mean(v_i^2) + eps) and u = gain * query
(the key-norm gain folded into the pseudo-query, since the keys are only used in this dot
product), alpha = softmax_i(z), h = sum_i alpha_i v_i. Same math as
backends/eager/depth.py:depth_attention with heads=1 and gate="softmax".

The sources reach the kernels through a table of addresses (sources.py): no stacked copy,
and the backward writes each source's gradient into its own buffer.

Reads: a program holds whole rows (the width padded to a power of two) in registers, so the
forward loads each source row once (its RMS, its logit and its share of the online-softmax
sum all come from that one load). Autograd keeps only the sources (alive anyway) and the
per-token log-sum-exp, not h: so the backward reads each source twice, once for
dh . h = sum_i alpha_i (dh . v_i) and once for the gradients (with few rows per program the
second read should mostly come from L2; not measured here). Rows wider than triton's
largest tile (2^20 channels) are left to the eager code.

Offsets are int64 wherever a row index multiplies a width (rows past 2^31 / d).
"""
from __future__ import annotations

import torch

from . import runtime as rt
from .runtime import tl, triton
from .sources import Sources, buffer_rows, load_source


@rt.device_fn
def key_logit(v, u, D, eps, KEY_NORM: tl.constexpr):
    """(z, r) of rows v [R, BLOCK_D] against the folded query u: z = r (v . u), with
    r = rsqrt(mean(v^2) + eps) the key norm's scale (1 without the key norm)."""
    z = tl.sum(v * u[None, :], axis=1)
    if KEY_NORM:
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        return z * r, r
    # not z * 0 + 1: an infinite logit would make r, and so z, NaN
    return z, tl.full(z.shape, 1.0, z.dtype)


@rt.device_fn
def exp_shift(m):
    """What an online softmax subtracts before taking e^: its running max m, or 0 while every
    logit so far is -inf (e^(-inf - -inf) is NaN; such a logit's weight is 0, as eager's)."""
    return tl.where(m == float("-inf"), 0.0, m)


def _depth_fwd(SRC, U, OUT, LSE, R, D, n0, n, eps,
               DT0: tl.constexpr, DT1: tl.constexpr, NGROUPS: tl.constexpr,
               ALIGNED: tl.constexpr, KEY_NORM: tl.constexpr, ACC: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
    m = tl.full([BLOCK_R], float("-inf"), ACC)   # running max of the logits
    s = tl.zeros([BLOCK_R], ACC)                  # running sum of e^(z - m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)       # running sum of e^(z - m) v
    for g in tl.static_range(NGROUPS):            # the sources of each dtype
        for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
            v = load_source(SRC, n, i, rows, cols, mask, DT0 if g == 0 else DT1, ALIGNED, ACC)
            z, _ = key_logit(v, u, D, eps, KEY_NORM)
            m_new = tl.maximum(m, z)
            shift = exp_shift(m_new)
            scale = tl.exp(m - shift)
            p = tl.exp(z - shift)
            acc = acc * scale[:, None] + p[:, None] * v
            s = s * scale + p
            m = m_new
    tl.store(OUT + rows[:, None] * D + cols[None, :], acc / s[:, None], mask=mask)
    tl.store(LSE + rows, m + tl.log(s), mask=rmask)


def _depth_bwd(SRC, DSRC, U, DOUT, LSE, DLSE, DU_PART, R, D, n0, n, eps,
               DT0: tl.constexpr, DT1: tl.constexpr, NGROUPS: tl.constexpr,
               ALIGNED: tl.constexpr, KEY_NORM: tl.constexpr, HAS_DU: tl.constexpr,
               ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # alpha_i = e^(z_i - lse); dz_i = alpha_i (dh . v_i - dh . h + dlse);
    # dv_i = alpha_i dh + dz_i r_i u - dz_i z_i r_i^2 v_i / D;  du = sum_rows dz_i r_i v_i.
    # A persistent program: it takes every num_programs-th row tile and sums du over them.
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
    du = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    for t in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = tl.cast(t, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        mask = rmask[:, None] & cmask[None, :]
        dh = tl.load(DOUT + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(ACC)
        lse = tl.load(LSE + rows, mask=rmask, other=0.0).to(ACC)
        # pass 1: dh . h from the sources (h itself is not kept for backward)
        dhh = tl.zeros([BLOCK_R], ACC)
        for g in tl.static_range(NGROUPS):
            for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
                v = load_source(SRC, n, i, rows, cols, mask, DT0 if g == 0 else DT1, ALIGNED,
                                ACC)
                z, _ = key_logit(v, u, D, eps, KEY_NORM)
                dhh += tl.exp(z - lse) * tl.sum(dh * v, axis=1)
        dlse = tl.load(DLSE + rows, mask=rmask, other=0.0).to(ACC)
        # pass 2: each source's gradient, into its own buffer
        for g in tl.static_range(NGROUPS):
            for i in range(0 if g == 0 else n0, n0 if g == 0 else n):
                v = load_source(SRC, n, i, rows, cols, mask, DT0 if g == 0 else DT1, ALIGNED,
                                ACC)
                z, r = key_logit(v, u, D, eps, KEY_NORM)
                alpha = tl.exp(z - lse)
                # (dh . v_i - dh . h) + dlse: cancels first, keeping dlse next to large v
                dz = alpha * ((tl.sum(dh * v, axis=1) - dhh) + dlse)
                dv = alpha[:, None] * dh + (dz * r)[:, None] * u[None, :]
                if KEY_NORM:
                    dv -= (dz * z * r * r / D)[:, None] * v
                dp = buffer_rows(DSRC, i, rows, D, DT0 if g == 0 else DT1)
                tl.store(dp[:, None] + cols[None, :], dv, mask=mask)
                if HAS_DU:
                    du += (dz * r)[:, None] * v
    if HAS_DU:
        tl.store(DU_PART + tl.program_id(0).to(tl.int64) * D + cols, tl.sum(du, axis=0),
                 mask=cmask)


def folded_query(query: torch.Tensor, gain: torch.Tensor | None, key_norm: bool,
                 acc: torch.dtype) -> torch.Tensor:
    """u = gain * query in the accumulation dtype (the gain only ever meets the query); one
    query [d] or a block's queries [S, d] with their gains [S, d]."""
    u = query.to(acc)
    if key_norm and gain is not None:
        u = u * gain.to(acc)
    return u.contiguous()


def _fixed(rows: int, block_d: int, device: torch.device) -> dict:
    """The interpreter's config (big tiles: it runs one numpy op per tile op), or the one a
    test forces with runtime.tiles()."""
    block_r = rt.row_tile(rows, block_d, device)
    return dict(BLOCK_R=block_r, num_warps=rt.num_warps(block_r * block_d))



def forward(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor | None,
            eps: float, key_norm: bool):
    """(h [*batch, d] in the sources' promoted dtype, lse [*batch] in the accumulation
    dtype)."""
    src = Sources(sources)
    rt.require(src.device)
    d, rows = src.d, src.rows
    out = torch.empty((rows, d), dtype=src.out_dtype, device=src.device)
    lse = torch.empty((rows,), dtype=src.acc, device=src.device)
    if rows:
        u = folded_query(query, gain, key_norm, src.acc)
        table, _ = src.table()
        block_d = rt.next_pow2(d)
        rt.launch(_depth_fwd, src.device, rt.row_grid(rows),
                  (table, u, out, lse, rows, d, src.n0, src.n, eps),
                  fixed=_fixed(rows, block_d, src.device), configs=rt.row_configs(block_d),
                  key=["n", "D", "KEY_NORM"], **src.constexprs(), KEY_NORM=key_norm,
                  ACC=rt.tl_acc(src.acc), BLOCK_D=block_d)
    return out.view(src.shape), lse.view(src.shape[:-1])


def backward(dout, dlse, lse, sources, query, gain, eps, key_norm, need_du: bool):
    """(the source gradients, each like its source, and du [d] in the accumulation dtype;
    zeros when not need_du)."""
    src = Sources(sources)
    rt.require(src.device)
    d, rows = src.d, src.rows
    dsrc = src.empty_like()
    du = torch.zeros(d, dtype=src.acc, device=src.device)
    if not rows:
        return src.in_caller_order(dsrc), du
    u = folded_query(query, gain, key_norm, src.acc)
    table, (grads,) = src.table(dsrc)
    block_d = rt.next_pow2(d)
    fixed = _fixed(rows, block_d, src.device)
    programs = rt.persistent_programs(triton.cdiv(rows, fixed["BLOCK_R"])
                                      if src.device.type != "cuda" else rows, src.device)
    du_part = torch.empty((programs, d) if need_du else (1,), dtype=src.acc, device=src.device)
    rt.launch(_depth_bwd, src.device, lambda meta: (programs,),
              (table, grads, u, dout.reshape(rows, d).contiguous(),
               lse.reshape(rows).contiguous(), dlse.reshape(rows).to(src.acc).contiguous(),
               du_part, rows, d, src.n0, src.n, eps),
              fixed=fixed, configs=rt.row_configs(block_d),
              key=["n", "D", "KEY_NORM", "HAS_DU"], **src.constexprs(), KEY_NORM=key_norm,
              HAS_DU=need_du, ACC=rt.tl_acc(src.acc), BLOCK_D=block_d)
    if need_du:  # per-program partials summed in a fixed order: deterministic, no atomics
        du = du_part.sum(0)
    return src.in_caller_order(dsrc), du
