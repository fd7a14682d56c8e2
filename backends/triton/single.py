"""Depth attention in one pass over the sources: forward and backward kernels, and launchers.

Per token row: z_i = r_i (v_i . u) with r_i = rsqrt(mean(v_i^2) + eps) and u = gain * query
(the key-norm gain folded into the pseudo-query, since the keys are only used in this dot
product), alpha = softmax_i(z), h = sum_i alpha_i v_i. Same math as
backends/eager/depth.py:depth_attention with heads=1 and gate="softmax".

Reads: a program holds whole rows (the width padded to a power of two) in registers, so each
source row is loaded from memory exactly once in the forward (its RMS, its logit and its
share of the online-softmax sum all come from that one load), and once in the backward.
Rows wider than triton's largest tile (2^20 channels) are left to the eager code.
"""
from __future__ import annotations

import torch

from . import runtime as rt
from .runtime import tl, triton


def _depth_fwd(V, U, OUT, LSE, R, D, n, stride_vn, stride_vr, stride_vd, eps,
               KEY_NORM: tl.constexpr, ACC: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
    m = tl.full([BLOCK_R], float("-inf"), ACC)   # running max of the logits
    s = tl.zeros([BLOCK_R], ACC)                  # running sum of e^(z - m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], ACC)       # running sum of e^(z - m) v
    vp = V + rows[:, None] * stride_vr + cols[None, :] * stride_vd
    for _ in range(n):
        v = tl.load(vp, mask=mask, other=0.0).to(ACC)
        z = tl.sum(v * u[None, :], axis=1)
        if KEY_NORM:
            z = z / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        p = tl.exp(z - m_new)
        acc = acc * scale[:, None] + p[:, None] * v
        s = s * scale + p
        m = m_new
        vp += stride_vn
    tl.store(OUT + rows[:, None] * D + cols[None, :], acc / s[:, None], mask=mask)
    tl.store(LSE + rows, m + tl.log(s), mask=rmask)


def _depth_bwd(V, U, DOUT, OUT, LSE, DLSE, DV, DU_PART, R, D, n, stride_dvn,
               stride_vn, stride_vr, stride_vd, eps,
               KEY_NORM: tl.constexpr, ACC: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # alpha_i = e^(z_i - lse); dz_i = alpha_i (dh . v_i - dh . h + dlse);
    # dv_i = alpha_i dh + dz_i r_i u - dz_i z_i r_i^2 v_i / D;  du = sum_rows dz_i r_i v_i.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    u = tl.load(U + cols, mask=cmask, other=0.0).to(ACC)
    io = rows[:, None] * D + cols[None, :]
    dh = tl.load(DOUT + io, mask=mask, other=0.0).to(ACC)
    h = tl.load(OUT + io, mask=mask, other=0.0).to(ACC)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0).to(ACC)
    delta = tl.sum(dh * h, axis=1) - tl.load(DLSE + rows, mask=rmask, other=0.0).to(ACC)
    du = tl.zeros([BLOCK_R, BLOCK_D], ACC)
    vp = V + rows[:, None] * stride_vr + cols[None, :] * stride_vd
    dvp = DV + io
    for _ in range(n):
        v = tl.load(vp, mask=mask, other=0.0).to(ACC)
        z = tl.sum(v * u[None, :], axis=1)
        if KEY_NORM:
            r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
            z = z * r
        else:
            r = tl.full([BLOCK_R], 1.0, ACC)
        alpha = tl.exp(z - lse)
        dz = alpha * (tl.sum(dh * v, axis=1) - delta)
        dv = alpha[:, None] * dh + (dz * r)[:, None] * u[None, :]
        if KEY_NORM:
            dv -= (dz * z * r * r / D)[:, None] * v
        tl.store(dvp, dv, mask=mask)
        du += (dz * r)[:, None] * v
        vp += stride_vn
        dvp += stride_dvn
    tl.store(DU_PART + pid * D + cols, tl.sum(du, axis=0), mask=cmask)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [n, *batch, d] as [n, rows, d] without copying when the strides allow it."""
    n, d = x.shape[0], x.shape[-1]
    try:
        return x.view(n, -1, d)
    except RuntimeError:  # batch dims that do not collapse: one copy
        return x.reshape(n, -1, d)


def folded_query(query: torch.Tensor, gain: torch.Tensor | None, key_norm: bool,
                 acc: torch.dtype) -> torch.Tensor:
    """u = gain * query in the accumulation dtype (the gain only ever meets the query); one
    query [d] or a block's queries [S, d] with their gains [S, d]."""
    u = query.to(acc)
    if key_norm and gain is not None:
        u = u * gain.to(acc)
    return u.contiguous()


def _tile(rows: int, d: int, device: torch.device):
    block_d = rt.next_pow2(d)
    block_r = rt.row_tile(rows, block_d, device)
    return block_r, block_d, triton.cdiv(max(rows, 1), block_r)


def forward(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor | None,
            eps: float, key_norm: bool):
    """(h [*batch, d] in the sources' dtype, lse [*batch] in the accumulation dtype)."""
    rt.require(sources.device)
    n, d = sources.shape[0], sources.shape[-1]
    acc = rt.acc_dtype(sources.dtype)
    v = rows_view(sources)
    rows = v.shape[1]
    out = torch.empty((rows, d), dtype=sources.dtype, device=sources.device)
    lse = torch.empty((rows,), dtype=acc, device=sources.device)
    if rows:
        u = folded_query(query, gain, key_norm, acc)
        block_r, block_d, programs = _tile(rows, d, sources.device)
        rt.kernel(_depth_fwd, sources.device)[(programs,)](
            v, u, out, lse, rows, d, n, v.stride(0), v.stride(1), v.stride(2), eps,
            KEY_NORM=key_norm, ACC=rt.tl_acc(sources.dtype), BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=rt.num_warps(block_r * block_d))
    return out.view(sources.shape[1:]), lse.view(sources.shape[1:-1])


def backward(dout, dlse, out, lse, sources, query, gain, eps, key_norm):
    """(dsources like sources (contiguous), du [d] in the accumulation dtype)."""
    rt.require(sources.device)
    n, d = sources.shape[0], sources.shape[-1]
    acc = rt.acc_dtype(sources.dtype)
    v = rows_view(sources)
    rows = v.shape[1]
    dv = torch.empty(sources.shape, dtype=sources.dtype, device=sources.device)
    if not rows:
        return dv, torch.zeros(d, dtype=acc, device=sources.device)
    u = folded_query(query, gain, key_norm, acc)
    block_r, block_d, programs = _tile(rows, d, sources.device)
    du_part = torch.empty((programs, d), dtype=acc, device=sources.device)
    rt.kernel(_depth_bwd, sources.device)[(programs,)](
        v, u, dout.reshape(rows, d).contiguous(), out.reshape(rows, d).contiguous(),
        lse.reshape(rows).contiguous(), dlse.reshape(rows).to(acc).contiguous(), dv, du_part,
        rows, d, n, rows * d, v.stride(0), v.stride(1), v.stride(2), eps,
        KEY_NORM=key_norm, ACC=rt.tl_acc(sources.dtype), BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=rt.num_warps(block_r * block_d))
    # per-program partials summed in a fixed order: deterministic, no atomics
    return dv, du_part.sum(0)
