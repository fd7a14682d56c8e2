"""Depth attention over a *list* of sources, keeping no stacked copy for backward.

`torch.stack(sources)` followed by the reference math makes autograd save an [n, *batch, d]
copy at every aggregation point: O(L^2 d) per token over a Full AttnRes network, where the
sources themselves are only O(L d). Here every d-sized tensor autograd saves is a source
that is alive anyway (or a view of one); what is new is per-token scalars (logits,
weights, reciprocal RMS). The key RMSNorm is factored the same way: the logit is
`(v . g*w) * rsqrt(mean(v^2) + eps)`, which equals `w . RMSNorm_g(v)` without
materialising the normalised keys.

Same mathematics as `depth.py` (tested against hand-written loops and the stacked form);
the eager backend uses it for depth attention when the caller hands sources as a sequence
(the lowered models do), and for phase 1 always.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _acc(v: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for v: at least fp32 (as F.rms_norm computes)."""
    return torch.promote_types(v.dtype, torch.float32)


def _rstd(v: torch.Tensor, eps: float) -> torch.Tensor:
    """[*batch, 1]: 1 / RMS(v) over channels, in at least fp32."""
    ms = torch.linalg.vector_norm(v, 2, dim=-1, keepdim=True, dtype=_acc(v)) ** 2
    return torch.rsqrt(ms / v.shape[-1] + eps)


def source_logits(v: torch.Tensor, q: torch.Tensor, eps: float, key_norm: bool) -> torch.Tensor:
    """[*batch, H]: the logits of one source v [*batch, d] against the heads-split query q,
    [H, c] (static) or [*batch, H, c] (per token)."""
    # A product and a sum rather than a matmul: under torch.compile it fuses with the RMS
    # into one pass over v (a matmul-vector is an extern kernel that reads v again). Logits
    # are at least float32 whatever v's dtype: 1/RMS of a (near-)zero row is huge (restopo.nn.norm's
    # epsilon is tiny) and would overflow to inf in fp16, giving 0 * inf = NaN.
    z = (v.unflatten(-1, (q.shape[-2], -1)) * q).sum(-1, dtype=_acc(v))
    if key_norm:
        z = z * _rstd(v, eps)
    return z


def depth_attention(sources: Sequence[torch.Tensor], query: torch.Tensor,
                    gained_query: torch.Tensor, eps: float, *, key_norm: bool, gate: str,
                    heads: int) -> torch.Tensor:
    """h = sum_i alpha_i v_i; `gained_query` is the query with the key-norm gain folded in."""
    q = gained_query.unflatten(-1, (heads, -1))
    z = torch.stack([source_logits(v, q, eps, key_norm) for v in sources])  # [n, *batch, H]
    alpha = torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)
    out = None
    for a, v in zip(alpha, sources):
        term = v.unflatten(-1, (heads, -1)) * a.unsqueeze(-1).to(v.dtype)
        out = term if out is None else out + term
    return out.flatten(-2)


def phase1(completed: Sequence[torch.Tensor], gained_queries: torch.Tensor, eps: float, *,
           key_norm: bool, heads: int):
    """Phase 1 over a list of completed blocks; (o1 [S,*b,d], m1 [S,*b,H], s1 [S,*b,H])."""
    q = gained_queries.unflatten(-1, (heads, -1))  # [S, H, c]
    zs = []
    for v in completed:
        z = (v.unflatten(-1, (heads, -1)).unsqueeze(0)
             * q.view(q.shape[0], *([1] * (v.dim() - 1)), *q.shape[1:])).sum(-1, dtype=_acc(v))
        if key_norm:
            z = z * _rstd(v, eps)  # float32, as in source_logits
        zs.append(z)
    z = torch.stack(zs, dim=1)                     # [S, n, *batch, H]
    m1 = z.amax(1)
    e = torch.exp(z - m1.unsqueeze(1))
    o1 = None
    for i, v in enumerate(completed):
        term = v.unflatten(-1, (heads, -1)) * e[:, i].unsqueeze(-1).to(v.dtype)
        o1 = term if o1 is None else o1 + term
    return o1.flatten(-2), m1, e.sum(1)
