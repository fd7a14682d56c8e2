"""Depth attention in plain torch: the reference every other backend is held against.

Shapes: `sources` is [n, *batch, d] (n sources, in order), a query is [d], outputs are
[*batch, d]. Logits are `w . RMSNorm(v_i)` with the RMSNorm gain applied to the keys only;
values are summed raw. No 1/sqrt(d) scale. With `heads = k` the d channels are cut into k
equal slices, each with its own softmax over sources (the key RMS is taken over all d).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def keys(sources: torch.Tensor, key_norm_weight: torch.Tensor | None, eps: float,
         key_norm: bool = True) -> torch.Tensor:
    """RMSNorm of each source over its channels (the keys); the values stay raw."""
    if not key_norm:
        return sources
    return F.rms_norm(sources, (sources.shape[-1],), key_norm_weight, eps)


def logits(sources: torch.Tensor, query: torch.Tensor, key_norm_weight: torch.Tensor | None,
           eps: float, key_norm: bool = True, heads: int = 1) -> torch.Tensor:
    """[n, *batch, heads]: the depth-attention logit of every source (per head)."""
    k = keys(sources, key_norm_weight, eps, key_norm)
    d = sources.shape[-1]
    prod = (k * query).unflatten(-1, (heads, d // heads))
    return prod.sum(-1)


def _expand(weights: torch.Tensor, d: int) -> torch.Tensor:
    """[..., heads] -> [..., d], each head's weight repeated over its channel slice."""
    heads = weights.shape[-1]
    return weights.repeat_interleave(d // heads, dim=-1)


def depth_attention(sources: torch.Tensor, query: torch.Tensor,
                    key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                    key_norm: bool = True, gate: str = "softmax", heads: int = 1) -> torch.Tensor:
    """h = sum_i alpha_i v_i with alpha = softmax_i(w . RMSNorm(v_i)) (or sigmoid)."""
    _check_heads(sources.shape[-1], heads)
    z = logits(sources, query, key_norm_weight, eps, key_norm, heads)
    alpha = torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)
    return (_expand(alpha, sources.shape[-1]) * sources).sum(0)


def phase1(completed: torch.Tensor, queries: torch.Tensor,
           key_norm_weights: torch.Tensor | None = None, eps: float = 1e-6, *,
           key_norm: bool = True, heads: int = 1):
    """Phase 1 of the two-phase computation for one block.

    completed: [n, *batch, d], the completed blocks [b_0 .. b_{n-1}]; queries: [S, d], the
    block's pseudo-queries; key_norm_weights: [S, d] (one gain per aggregation) or None.
    Returns (o1 [S, *batch, d], m1 [S, *batch, heads], s1 [S, *batch, heads]): per query the
    un-normalised output sum_i e^(z_i - m1) v_i, the max logit m1 and the sum s1 of e^(z_i - m1).
    """
    _check_heads(completed.shape[-1], heads)
    outs, maxes, sums = [], [], []
    for s in range(queries.shape[0]):
        gain = None if key_norm_weights is None else key_norm_weights[s]
        z = logits(completed, queries[s], gain, eps, key_norm, heads)  # [n, *batch, heads]
        m = z.amax(0)
        e = torch.exp(z - m)
        outs.append((_expand(e, completed.shape[-1]) * completed).sum(0))
        maxes.append(m)
        sums.append(e.sum(0))
    return torch.stack(outs), torch.stack(maxes), torch.stack(sums)


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor, partial: torch.Tensor | None,
           query: torch.Tensor, key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           *, key_norm: bool = True) -> torch.Tensor:
    """Phase 2: merge the block's partial sum (taken *before* this sublayer's output is added)
    into phase 1's result by online softmax. With no partial (the block's first sublayer),
    h = o1 / s1."""
    d = o1.shape[-1]
    heads = m1.shape[-1]
    if partial is None:
        return o1 / _expand(s1, d)
    z2 = logits(partial.unsqueeze(0), query, key_norm_weight, eps, key_norm, heads)[0]
    m = torch.maximum(m1, z2)
    a, b = torch.exp(m1 - m), torch.exp(z2 - m)
    return (_expand(a, d) * o1 + _expand(b, d) * partial) / _expand(a * s1 + b, d)


def _check_heads(d: int, heads: int) -> None:
    if heads < 1 or d % heads:
        raise ValueError(f"depth heads must divide the width: width {d}, heads {heads}")
