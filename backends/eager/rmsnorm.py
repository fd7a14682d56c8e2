"""RMSNorm with a hand-written backward: y = x * rstd(x) * g, rstd = 1 / sqrt(mean(x^2) + eps).

Every sublayer's PreNorm and the final norm run one, in every topology. On the CPU torch's
own (F.rms_norm) forms its backward from autograd's ops: about a dozen nodes, some of them
multiplying expanded per-token tensors, which there take many times a plain elementwise
op (at the examples' size, width 64 and 2048 tokens: 0.4 to 0.6 ms backward, against
0.1 ms here). Here the backward is five passes over d-sized tensors:

    gx = gy * x;  g . gx (the gain's part of the row sum);  rstd^T gx (the gain's gradient);
    dx = (gy * g - x * rstd^2 (gy*g . x) / d) * rstd

Autograd keeps x (the sublayer's input, which the standard model keeps for its norm too)
and the per-token rstd. The mean square and rstd are in at least fp32 (a bf16 or fp16
input is normalised in fp32 and rounded once, as F.rms_norm does). At an all-zero row the
backward forms rstd^2 and never rstd^3, so it stays finite for restopo's tiny epsilon
(restopo.nn.norm). Under torch.compile, where autograd does not record, and on CUDA (whose
F.rms_norm has fused kernels both ways, where this would launch several), F.rms_norm runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .weighted import _acc


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, times `weight` (None: no gain)."""
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or not torch.is_grad_enabled()
            or not (x.requires_grad or (weight is not None and weight.requires_grad))):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


_EPS = {}  # each (epsilon, device) as a 0-dim tensor, made once


def rstd(v: torch.Tensor, eps: float) -> torch.Tensor:
    """[*batch, 1]: 1 / RMS(v) over channels, in at least fp32, as rsqrt(eps + |v|^2 / d):
    a norm and two ops, one pass over v (the sublayer norms', the key norm's of both forms
    of depth attention). For the tiny tensors of a decoding step each op's dispatch, not its
    arithmetic, is the cost: a mean of squares takes several ops, and a Python number
    handed to an in-place op is wrapped into a tensor and copied first (two dispatches
    more each), where addcmul takes 1/d as its scalar `value` and eps as a kept tensor (a
    0-dim tensor does not change the result's dtype or device)."""
    n = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=_acc(v))
    if torch.compiler.is_compiling():
        return torch.rsqrt(n * n / v.shape[-1] + eps)
    key = (eps, n.device)
    e = _EPS.get(key)
    if e is None:
        e = _EPS[key] = torch.tensor(eps, dtype=torch.float64, device=n.device)
    return torch.addcmul(e, n, n, value=1.0 / v.shape[-1]).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        r = rstd(x, eps)
        y = torch.mul(x, r)                       # in at least fp32: r is
        if weight is not None:
            y.mul_(weight)
        ctx.save_for_backward(x, weight, r)
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight, r = ctx.saved_tensors
        d, acc = x.shape[-1], r.dtype
        gy = gy.to(acc)
        xa = x if x.dtype == acc else x.to(acc)
        gx = gy * xa                                           # [*b, d]
        rows, cols = gx.reshape(-1, d), r.reshape(1, -1)
        d_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = (cols @ rows).view(d).to(weight.dtype)  # sum over tokens of gy x rstd
        if not ctx.needs_input_grad[0]:
            return None, d_weight, None
        if weight is None:
            dot = gx.sum(-1, keepdim=True)
        else:
            w = weight.to(acc)
            dot = (rows @ w).view(r.shape)                    # sum over channels of gy g x
        # d rstd / dx = -rstd^3 x / d: as rstd^2 here (finite at a zero row) and the last
        # rstd after the sum
        c = dot.mul_(r).mul_(r).mul_(-1.0 / d)
        dx = torch.addcmul(gy, xa, c) if weight is None else torch.mul(gy, w).addcmul_(xa, c)
        dx.mul_(r)
        return dx.to(x.dtype), d_weight, None
