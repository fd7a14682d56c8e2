"""Depth attention in plain torch: the reference every other backend is held against.

Shapes: `sources` is [n, *batch, d] (n sources, in order), a query is [d], outputs are
[*batch, d]. Logits are `w . RMSNorm(v_i)` with the RMSNorm gain applied to the keys only;
values are summed raw. No 1/sqrt(d) scale. With `heads = k` the d channels are cut into k
equal slices, each with its own softmax over sources (the key RMS is taken over all d).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import rmsnorm, stacked, unstacked, weighted  # noqa: F401  (for the standalone writer)


def keys(sources: torch.Tensor, eps: float, key_norm: bool = True) -> torch.Tensor:
    """RMSNorm of each source over its channels, without the gain (the keys); the values
    stay raw. The gain is folded into the query instead: w . (g * k) == (g * w) . k, which
    lets one matmul serve every source (and, in phase 1, every query of a block)."""
    if not key_norm:
        return sources
    return F.rms_norm(sources, (sources.shape[-1],), None, eps)


def gained(query: torch.Tensor, key_norm_weight: torch.Tensor | None,
           key_norm: bool = True) -> torch.Tensor:
    """The query with the key-norm gain folded in (the gain applies only with key norm)."""
    if key_norm_weight is None or not key_norm:
        return query
    # in at least fp32: a bf16 product would round the query the logits are taken with
    return weighted._wide(query) * key_norm_weight


def logits(sources: torch.Tensor, query: torch.Tensor, key_norm_weight: torch.Tensor | None,
           eps: float, key_norm: bool = True, heads: int = 1) -> torch.Tensor:
    """[n, *batch, heads]: the depth-attention logit of every source (per head).

    `query` is [d] (a static pseudo-query) or [*batch, d] (one per token)."""
    # in at least fp32, as the fused kernels (weighted._wide): bf16 logits and products
    # lost most of a saturated softmax's query gradient
    k = keys(weighted._wide(sources), eps, key_norm).unflatten(-1, (heads, -1))
    q = gained(query, key_norm_weight, key_norm).unflatten(-1, (heads, -1))
    if q.dim() == 2:  # one static query: a single matmul over every source and token
        return torch.einsum("n...hc,hc->n...h", k, q)
    return torch.einsum("n...hc,...hc->n...h", k, q.expand(k.shape[1:]))


def depth_weights(sources: torch.Tensor | Sequence[torch.Tensor], query: torch.Tensor,
                  key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                  key_norm: bool = True, gate: str = "softmax",
                  heads: int = 1) -> torch.Tensor:
    """alpha [n, *batch, heads]: the weight of each source, per head (`depth_attention`'s
    output is sum_i alpha_i v_i, each head's weight over its channel slice)."""
    stacked = sources if isinstance(sources, torch.Tensor) else torch.stack(tuple(sources))
    _check_heads(stacked.shape[-1], heads)
    z = logits(stacked, query, key_norm_weight, eps, key_norm, heads)
    return torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)


def _expand(weights: torch.Tensor, d: int) -> torch.Tensor:
    """[..., heads] -> [..., d], each head's weight repeated over its channel slice."""
    heads = weights.shape[-1]
    return weights.repeat_interleave(d // heads, dim=-1)


def depth_attention(sources: torch.Tensor | Sequence[torch.Tensor], query: torch.Tensor,
                    key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                    key_norm: bool = True, gate: str = "softmax", heads: int = 1,
                    logits: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """h = sum_i alpha_i v_i with alpha = softmax_i(w . RMSNorm(v_i)) (or sigmoid).

    `sources` may also be a sequence of [*batch, d] tensors: then no stacked copy is kept
    for backward (see unstacked.py); the result is the same. `logits`: with a sequence,
    each source's logit [*batch, heads] against this query, if already made (see
    restopo.nn.shared_sources); they must be what this call would compute."""
    if not isinstance(sources, torch.Tensor):
        _check_heads(sources[0].shape[-1], heads)
        gq = gained(query, key_norm_weight, key_norm)
        if stacked.without_grad(query, key_norm_weight, *sources):
            return stacked.depth_attention(sources, query, gq, eps, key_norm=key_norm,
                                           gate=gate, heads=heads)
        return unstacked.depth_attention(sources, query, gq, eps, key_norm=key_norm, gate=gate,
                                         heads=heads, logits=logits)
    alpha = depth_weights(sources, query, key_norm_weight, eps, key_norm=key_norm, gate=gate,
                          heads=heads)
    # the weights stay fp32 for a half-precision sum: its result is rounded once
    return (_expand(alpha, sources.shape[-1]) * sources).sum(0).to(sources.dtype)


def phase1(completed: torch.Tensor | Sequence[torch.Tensor], queries: torch.Tensor,
           key_norm_weights: torch.Tensor | None = None, eps: float = 1e-6, *,
           key_norm: bool = True, heads: int = 1,
           logits: Sequence[torch.Tensor] | None = None):
    """Phase 1 of the two-phase computation for one block.

    completed: [n, *batch, d], the completed blocks [b_0 .. b_{n-1}]; queries: [S, d], the
    block's pseudo-queries; key_norm_weights: [S, d] (one gain per aggregation) or None.
    Returns per query the online-softmax state (o1 [S, *batch, d], m1 [S, *batch, heads],
    s1 [S, *batch, heads]): the un-normalised output sum_i e^(z_i - m1) v_i, the max logit m1
    and the sum s1 of e^(z_i - m1). This backend returns it normalised, as (h1, lse,
    S Nones): h1 = o1 / s1 and lse = m1 + log s1 (the same state with s1 = 1, and fewer ops
    for phase 2); phase2 takes either form (s1[s] None: the normalised one).
    `logits`: each block's logits [S, *batch, heads] against the queries (or their S
    columns [*batch, heads]), if already made.
    """
    # One implementation for both forms: a stacked tensor is read as its n views. (A fused
    # einsum over the stack was tried: its bf16 backward under torch.compile trips a
    # view-of-a-permute on CPU, and the per-block loop costs nothing that matters here.)
    # Without autograd, one stacked pass (stacked.py): far fewer ops, e.g. when decoding.
    sources = completed.unbind(0) if isinstance(completed, torch.Tensor) else completed
    _check_heads(sources[0].shape[-1], heads)
    gq = gained(queries, key_norm_weights, key_norm)
    if stacked.without_grad(queries, key_norm_weights, *sources):
        return stacked.phase1(sources, gq, eps, key_norm=key_norm, heads=heads)
    return unstacked.phase1(sources, gq, eps, key_norm=key_norm, heads=heads, logits=logits)


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor | None,
           partial: torch.Tensor | None, query: torch.Tensor,
           key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
           key_norm: bool = True) -> torch.Tensor:
    """Phase 2: merge the block's partial sum (taken *before* this sublayer's output is added)
    into phase 1's result by online softmax. With no partial (the block's first sublayer),
    h = o1 / s1. `s1` None: phase 1's normalised form (h1, lse), see phase1; either form is
    normalised here, once, and both forms of phase 2 take that."""
    h1, lse = unstacked.normalised(o1, m1, s1)
    if stacked.without_grad(o1, partial, query, key_norm_weight):
        return stacked.phase2(h1, lse, partial, gained(query, key_norm_weight, key_norm),
                              eps, key_norm=key_norm)
    return unstacked.phase2(h1, lse, partial, gained(query, key_norm_weight, key_norm), eps,
                            key_norm=key_norm)


def phase2_norm(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor | None,
                partial: torch.Tensor | None, query: torch.Tensor,
                key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
                key_norm: bool = True, keep_h: bool = True):
    """Phase 2, then the next sublayer's PreNorm: (h or None with keep_h=False,
    rms_norm(h) * norm_weight), exactly what the unfused sublayer computes (norm_eps
    defaults to eps). The fused backends' phase2_norm falls back to this."""
    h = phase2(o1, m1, s1, partial, query, key_norm_weight, eps, key_norm=key_norm)
    y = rmsnorm.rms_norm(h, norm_weight, eps if norm_eps is None else norm_eps)
    return (h if keep_h else None), y


def _check_heads(d: int, heads: int) -> None:
    if heads < 1 or d % heads:
        raise ValueError(f"depth heads must divide the width: width {d}, heads {heads}")


def logits_against(source: torch.Tensor, gained_queries: torch.Tensor, eps: float = 1e-6, *,
                   key_norm: bool = True, heads: int = 1) -> torch.Tensor:
    """[R, *batch, heads]: one source's logits against R static queries [R, d] (gains folded
    in), in at least fp32; one pass over the source for all of them."""
    _check_heads(source.shape[-1], heads)
    return unstacked.logits_against(source, gained_queries, eps, key_norm, heads)
