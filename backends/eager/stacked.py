"""Depth attention when no gradient is wanted: one stacked pass over the sources.

The unstacked forms (unstacked.py) loop over the sources so that autograd saves nothing
new. Without autograd (generation, evaluation) that loop is pure cost: several ops per
source at every aggregation point, which is most of what Block and Full AttnRes add to a
one-token decoding step. Here the sources are stacked once and each step is one op over all
of them. Same mathematics as the unstacked forms (logits in at least fp32, values summed in
the sources' dtype), held against them in tests/test_ops_stacked.py.

Under torch.compile (a compiled decoding step) the contractions over channels and sources
are written as products and sums rather than matmuls: inductor fuses those into the loops
around them, where each matmul stays a library call of its own, a fixed cost per call that
a one-token step pays at every aggregation point for a few thousand flops (`loops`).
"""
from __future__ import annotations

import torch

from .rmsnorm import rstd
from .weighted import _acc, out_dtype


def _as(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """v in `dtype`, without dispatching a no-op conversion when it already is."""
    return v if v.dtype == dtype else v.to(dtype)


def without_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd will not record: grad mode off, or no input requires grad."""
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors)


def _beside(sources) -> tuple[torch.Tensor, torch.Size]:
    """(the sources stacked next to the channels, [M, n, d] with M the batch's tokens; the
    batch shape). Every token's sources are then one matrix: its logits one matmul, its
    weighted sum one batched matmul."""
    v = (sources.movedim(0, -2) if isinstance(sources, torch.Tensor)
         else torch.stack(tuple(sources), -2))              # [*b, n, d]
    return v.reshape(-1, *v.shape[-2:]), v.shape[:-2]


def _by_head(v3: torch.Tensor, heads: int) -> torch.Tensor:
    """[M, n, d] -> [M*H, n, c]: each head's sources as a matrix (a view for one head)."""
    if heads == 1:
        return v3
    return v3.unflatten(-1, (heads, -1)).transpose(1, 2).flatten(0, 1)


def _scaled(z: torch.Tensor, v3: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """Logits z [M*H, n, k] of keys RMSNorm(v) from raw v [M, n, d]: times 1 / RMS(v_i)."""
    r = rstd(v3, eps)                                      # [M, n, 1]
    return z.mul_(r if heads == 1 else r.repeat_interleave(heads, 0))


def _loops(loops: bool | None) -> bool:
    """Contractions as products and sums (see the module's docstring): under torch.compile
    unless told."""
    return torch.compiler.is_compiling() if loops is None else loops


def depth_attention(sources, query: torch.Tensor, gained_query: torch.Tensor, eps: float, *,
                    key_norm: bool, gate: str, heads: int,
                    loops: bool | None = None) -> torch.Tensor:
    """h = sum_i alpha_i v_i over the stacked sources; `gained_query` is [d] or [*batch, d]
    with the key-norm gain folded in."""
    v3, batch = _beside(sources)                            # [M, n, d]
    if _loops(loops):
        return _depth_attention_loops(v3, batch, gained_query, eps, key_norm, gate, heads)
    d, acc = v3.shape[-1], _acc(v3)
    vh = _by_head(v3, heads)                                # [M*H, n, c]
    q = _as(gained_query, acc)
    if q.dim() > 1:  # a query per token
        z = torch.bmm(_as(vh, acc), q.reshape(vh.shape[0], -1, 1))
    elif heads == 1:  # one static query: one matrix-vector product
        z = (_as(vh, acc) @ q).unsqueeze(-1)
    else:
        z = (_as(vh, acc).unflatten(0, (-1, heads)) @ q.view(heads, -1, 1)).flatten(0, 1)
    if key_norm:                                            # z: [M*H, n, 1]
        z = _scaled(z, v3, eps, heads)
    alpha = torch.softmax(z, dim=1) if gate == "softmax" else torch.sigmoid(z)
    return torch.bmm(_as(alpha, v3.dtype).mT, vh).view(*batch, d)


def _depth_attention_loops(v3, batch, gained_query, eps, key_norm, gate, heads):
    """depth_attention with products and sums for its two contractions."""
    M, n, d = v3.shape
    acc = _acc(v3)
    v4 = v3.unflatten(-1, (heads, -1))                      # [M, n, H, c]
    q = _as(gained_query, acc).unflatten(-1, (heads, -1))   # [H, c] or [*b, H, c]
    q = q.reshape(M, 1, heads, -1) if q.dim() > 2 else q    # a query per token
    z = (_as(v4, acc) * q).sum(-1)                          # [M, n, H]
    if key_norm:
        z = z * rstd(v3, eps)
    alpha = torch.softmax(z, dim=1) if gate == "softmax" else torch.sigmoid(z)
    h = (_as(alpha, v3.dtype).unsqueeze(-1) * v4).sum(1)    # [M, H, c]
    return h.view(*batch, d)


def phase1(completed, gained_queries: torch.Tensor, eps: float, *, key_norm: bool,
           heads: int, loops: bool | None = None):
    """Phase 1 over the stacked completed blocks, normalised as unstacked.phase1's:
    (h1 [S,*b,d], lse [S,*b,H], (None,) * S). The division by s1 happens once here, on the
    [tokens, n, S] weights, rather than on each member's d-sized output in phase 2."""
    v3, batch = _beside(completed)                          # [M, n, d]
    if _loops(loops):
        return _phase1_loops(v3, batch, gained_queries, eps, key_norm, heads)
    S, acc = gained_queries.shape[0], _acc(v3)
    vh = _by_head(v3, heads)                                # [M*H, n, c]
    q = _as(gained_queries.view(S, heads, -1).permute(1, 2, 0), acc)  # [H, c, S]
    if heads == 1:
        z = _as(vh, acc) @ q[0]                             # [M, n, S]: one mm
    else:
        z = (_as(vh, acc).unflatten(0, (-1, heads)) @ q).flatten(0, 1)  # [M*H, n, S]
    if key_norm:
        z = _scaled(z, v3, eps, heads)
    # The softmax over the sources and its log-sum-exp, in place (torch.logsumexp is a
    # composite of some nine ops, and the softmax would be two more).
    m = z.amax(1, keepdim=True)                             # [M*H, 1, S]
    e = z.sub_(m).exp_()
    s = e.sum(1, keepdim=True)
    h1 = torch.bmm(_as(e.div_(s), v3.dtype).mT, vh)         # [M*H, S, c]: normalised
    lse = s.log_().add_(m)

    def by_query(x):  # [M*H, S, c] -> [S, *b, H * c]: a transpose and a view for one head
        if heads == 1:
            return x.transpose(0, 1).view(S, *batch, x.shape[-1])
        x = x.unflatten(0, (-1, heads)).permute(2, 0, 1, 3)  # [S, M, H, c]
        return x.reshape(S, *batch, -1)

    return by_query(h1), by_query(lse.mT), (None,) * S


def _phase1_loops(v3, batch, gained_queries, eps, key_norm, heads):
    """phase1 with products and sums for its two contractions."""
    S, acc = gained_queries.shape[0], _acc(v3)
    v5 = v3.unflatten(-1, (heads, -1)).unsqueeze(2)         # [M, n, 1, H, c]
    q = _as(gained_queries, acc).view(S, heads, -1)         # [S, H, c]
    z = (_as(v5, acc) * q).sum(-1)                          # [M, n, S, H]
    if key_norm:
        z = z * rstd(v3, eps).unsqueeze(-1)
    lse = torch.logsumexp(z, 1)                             # [M, S, H]
    e = torch.exp(z - lse.unsqueeze(1))                     # [M, n, S, H]: normalised
    h1 = (_as(e, v3.dtype).unsqueeze(-1) * v5).sum(1)       # [M, S, H, c]

    def by_query(x):  # [M, S, ...] -> [S, *b, ...]
        return x.movedim(1, 0).unflatten(1, batch)

    return by_query(h1.flatten(-2)), by_query(lse), (None,) * S


def phase2(h1: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,
           gained_query: torch.Tensor, eps: float, *, key_norm: bool) -> torch.Tensor:
    """Phase 2 (the partial merged into phase 1's normalised result h1, of log-sum-exp lse,
    by online softmax) in as few ops as the maths allows. With two terms the softmax is a
    sigmoid: the partial's weight is w = sigmoid(z2 - lse), and h = (1 - w) * h1 +
    w * partial, one lerp."""
    if partial is None:
        return h1
    heads = lse.shape[-1]
    # Per-head weights [*b, H] act on [*b, H, c] views; one head's [*b, 1] broadcast over
    # d as they are, with no view ops (each is a dispatch in a decoding step).
    split = heads > 1

    def by_head(x):
        return x.unflatten(-1, (heads, -1)) if split else x

    def per_head(w):
        return w.unsqueeze(-1) if split else w

    # The logit w . RMSNorm(p) as (w . p) / RMS(p), in at least fp32 like every logit: on
    # the CPU F.rms_norm runs some twenty ops (two of them copies) where the norm and four
    # in-place ops on the logit are five.
    p = _as(partial, _acc(partial))
    if split:
        z2 = (by_head(p) * by_head(gained_query)).sum(-1)
    else:
        z2 = (p @ _as(gained_query, p.dtype)).unsqueeze(-1)
    if key_norm:
        z2 = z2.mul_(rstd(p, eps))
    dtype = out_dtype(h1, partial)
    w = _as(torch.sigmoid_(z2.sub_(lse)), dtype)
    h = torch.lerp(by_head(_as(h1, dtype)), by_head(_as(partial, dtype)), per_head(w))
    return h.flatten(-2) if split else h
