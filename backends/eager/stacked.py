"""Depth attention when no gradient is wanted: one stacked pass over the sources.

The unstacked forms (unstacked.py) loop over the sources so that autograd saves nothing
new. Without autograd (generation, evaluation) that loop is pure cost: several ops per
source at every aggregation point, which is most of what Block and Full AttnRes add to a
one-token decoding step. Here the sources are stacked once and each step is one op over all
of them. Same mathematics as the unstacked forms (logits in at least fp32, values summed in
the sources' dtype), held against them in tests/test_ops_stacked.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .weighted import _acc


def _rstd(v: torch.Tensor, eps: float) -> torch.Tensor:
    """[*batch, 1]: 1 / RMS(v) over channels, in at least fp32 (a mean of squares: for the
    tiny tensors of a decoding step, several times cheaper than vector_norm)."""
    v = v.to(_acc(v))
    return torch.rsqrt((v * v).mean(-1, keepdim=True) + eps)


def without_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd will not record: grad mode off, or no input requires grad."""
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors)


def _stack(sources: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return sources if isinstance(sources, torch.Tensor) else torch.stack(tuple(sources))


def _by_head(v: torch.Tensor, heads: int) -> torch.Tensor:
    """[n, *batch, d] -> [*batch, heads, n, c]: each head's sources as a matrix."""
    return v.unflatten(-1, (heads, -1)).movedim(0, -2)


def _key_scale(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS of each source, [n, *batch, d] -> [*batch, 1, n, 1] (broadcasts over heads)."""
    return _rstd(v, eps).movedim(0, -2).unsqueeze(-3)


def depth_attention(sources, query: torch.Tensor, gained_query: torch.Tensor, eps: float, *,
                    key_norm: bool, gate: str, heads: int) -> torch.Tensor:
    """h = sum_i alpha_i v_i over the stacked sources; `gained_query` is [d] or [*batch, d]
    with the key-norm gain folded in."""
    v = _stack(sources)                                     # [n, *batch, d]
    acc = _acc(v)
    vh = _by_head(v, heads)                                 # [*batch, H, n, c]
    q = gained_query.unflatten(-1, (heads, -1)).unsqueeze(-1).to(acc)  # [(*batch,) H, c, 1]
    z = vh.to(acc) @ q                                      # [*batch, H, n, 1]
    if key_norm:
        z = z * _key_scale(v, eps)
    alpha = torch.softmax(z, dim=-2) if gate == "softmax" else torch.sigmoid(z)
    return (alpha.transpose(-1, -2).to(v.dtype) @ vh).squeeze(-2).flatten(-2)


def phase1(completed, gained_queries: torch.Tensor, eps: float, *, key_norm: bool,
           heads: int):
    """Phase 1 over the stacked completed blocks: (o1 [S,*b,d], m1 [S,*b,H], s1 [S,*b,H])."""
    v = _stack(completed)                                   # [n, *batch, d]
    acc = _acc(v)
    vh = _by_head(v, heads)                                 # [*batch, H, n, c]
    q = gained_queries.unflatten(-1, (heads, -1)).permute(1, 2, 0).to(acc)  # [H, c, S]
    z = vh.to(acc) @ q                                      # [*batch, H, n, S]
    if key_norm:
        z = z * _key_scale(v, eps)
    m1 = z.amax(-2, keepdim=True)                           # [*batch, H, 1, S]
    e = torch.exp(z - m1)
    o1 = e.transpose(-1, -2).to(v.dtype) @ vh               # [*batch, H, S, c]
    return (o1.movedim(-2, 0).flatten(-2), m1.squeeze(-2).movedim(-1, 0),
            e.sum(-2).movedim(-1, 0))


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor, partial: torch.Tensor | None,
           gained_query: torch.Tensor, eps: float, *, key_norm: bool) -> torch.Tensor:
    """Phase 2 (the partial merged into phase 1's result by online softmax) in as few ops
    as the maths allows: the per-token weights of o1 and the partial, then one sum."""
    heads = m1.shape[-1]
    if heads == 1:  # [*batch, 1] weights broadcast over d as they are
        if partial is None:
            return o1 / s1.to(o1.dtype)
        z2 = (partial @ gained_query.to(partial.dtype)).unsqueeze(-1).to(_acc(partial))
    else:
        if partial is None:
            return (o1.unflatten(-1, (heads, -1)) / s1.unsqueeze(-1).to(o1.dtype)).flatten(-2)
        q = gained_query.unflatten(-1, (heads, -1))
        z2 = (partial.unflatten(-1, (heads, -1)) * q).sum(-1, dtype=_acc(partial))
    if key_norm:
        z2 = z2 * _rstd(partial, eps)
    m = torch.maximum(m1, z2)
    a, b = torch.exp(m1 - m), torch.exp(z2 - m)
    den = a * s1 + b
    a, b = (a / den).to(o1.dtype), (b / den).to(partial.dtype)
    if heads == 1:
        return o1 * a + partial * b
    return (o1.unflatten(-1, (heads, -1)) * a.unsqueeze(-1)
            + partial.unflatten(-1, (heads, -1)) * b.unsqueeze(-1)).flatten(-2)
