"""Depth attention over a *list* of sources, keeping no stacked copy for backward.

`torch.stack(sources)` followed by the reference math makes autograd save an [n, *batch, d]
copy at every aggregation point: O(L^2 d) per token over a Full AttnRes network, where the
sources themselves are only O(L d). Here every d-sized tensor autograd saves is a source
that is alive anyway (or a view of one); what is new is per-token scalars (logits,
weights, reciprocal RMS). The key RMSNorm is factored the same way: the logit is
`(v . g*w) * rsqrt(mean(v^2) + eps)`, which equals `w . RMSNorm_g(v)` without
materialising the normalised keys.

Each aggregation is its logits (one matmul per source against every static query that
reads it, `logits_against`; or given, computed once per source for all its readers by
restopo.nn.shared_sources), a softmax over sources, and a weighted sum (weighted.py, with a
hand-written backward). Same mathematics as `depth.py` (tested against hand-written loops
and the stacked form); the eager backend uses it whenever gradients are wanted.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .rmsnorm import rstd
from .weighted import _acc, _wide, out_dtype, weighted_sum


class _KeyScaled(torch.autograd.Function):
    """z = u rstd(v): logits u = q . v [*batch, H] times the key norm's 1 / RMS(v) [*batch, 1],
    with a one-pass backward: d rstd / dv = -rstd^3 v / d, taken as (v rstd) ((dz . z) rstd),
    not (dz . u) rstd^3 v: each factor finite for tiny and all-zero rows (rstd^3, or rstd^2
    alone, overflows fp32 at eps 1e-30: 1e45) and 0 where v's mean square overflowed (rstd =
    0 and z = 0, where dz u can overflow)."""

    @staticmethod
    def forward(ctx, u, v, eps):
        r = rstd(v, eps)
        z = u * r
        ctx.save_for_backward(v, r, z)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        v, r, z = ctx.saved_tensors
        scale = (grad * z).sum(-1, keepdim=True) * r * (-1.0 / v.shape[-1])
        return grad * r, ((v.to(r.dtype) * r) * scale).to(v.dtype), None


def _key_scaled(u: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """u rstd(v), rstd in at least fp32 (see _KeyScaled)."""
    if torch.compiler.is_compiling():  # autograd's ops: inductor fuses them with the logits
        return u * rstd(v, eps)
    return _KeyScaled.apply(u, v, eps)


def source_logits(v: torch.Tensor, q: torch.Tensor, eps: float, key_norm: bool) -> torch.Tensor:
    """[*batch, H]: the logits of one source v [*batch, d] against the heads-split query q,
    [H, c] (static) or [*batch, H, c] (per token)."""
    if q.dim() == 2 and not torch.compiler.is_compiling():
        return logits_against(v, q.flatten()[None], eps, key_norm, q.shape[0])[0]
    # A product and a sum rather than a matmul: under torch.compile it fuses with the RMS
    # into one pass over v (a matmul-vector is an extern kernel that reads v again). Logits
    # are at least float32 whatever v's dtype: 1/RMS of a (near-)zero row is huge (restopo.nn.norm's
    # epsilon is tiny) and would overflow to inf in fp16, giving 0 * inf = NaN.
    z = (v.unflatten(-1, (q.shape[-2], -1)) * q).sum(-1, dtype=_acc(v))
    return _key_scaled(z, v, eps) if key_norm else z


def query_matrix(gained_queries: torch.Tensor, heads: int) -> torch.Tensor:
    """[d, R*H]: R queries [R, d] as columns, each head's slice in its own column (zeros
    elsewhere), so `v @ query_matrix` is every query's per-head logit of v in one matmul."""
    R, d = gained_queries.shape
    if heads == 1:
        return gained_queries.t()
    q = gained_queries.view(R, heads, d // heads)
    eye = torch.eye(heads, dtype=q.dtype, device=q.device)
    return torch.einsum("rhc,hk->hcrk", q, eye).reshape(d, R * heads)


def logits_against(v: torch.Tensor, gained_queries: torch.Tensor, eps: float, key_norm: bool,
                   heads: int) -> torch.Tensor:
    """[R, *batch, H]: the logits of one source v [*batch, d] against R static queries
    [R, d] (key-norm gains folded in), in at least fp32: one pass over v for all of them.
    Query-major, so each query's logits are one contiguous piece (cheap to split and to
    gather back in backward)."""
    R = gained_queries.shape[0]
    acc = _acc(v)
    if torch.compiler.is_compiling():  # see source_logits: a product and a sum fuse
        q = gained_queries.unflatten(-1, (heads, -1)).view(R, *[1] * (v.dim() - 1), heads, -1)
        z = (v.unflatten(-1, (heads, -1)) * q).sum(-1, dtype=acc)
    else:  # [R*H, tokens] = W^T v^T: one matmul, its output already query-major
        w = query_matrix(gained_queries, heads).to(acc)  # fp32 for fp16/bf16 v: _wide
        if torch.is_grad_enabled() and (v.requires_grad or w.requires_grad):
            z = _Logits.apply(v, w, eps, key_norm)
        else:
            u, r = _logit_parts(v, w, eps, key_norm)
            z = u if r is None else u * r
        if heads == 1:  # the same layout without a permuted view (one autograd node less)
            return z.view(R, *v.shape[:-1], 1)
        return z.view(R, heads, *v.shape[:-1]).movedim(1, -1)
    return z * rstd(v, eps) if key_norm else z  # (compiling: autograd's ops)


class _Logits(torch.autograd.Function):
    """z = (W^T v^T) * rstd(v), [R*H, tokens] in at least fp32 (rstd 1 without key norm),
    in one node whose backward writes v's gradient in place: a matmul and, with the key
    norm, one multiply-add of v (d rstd / dv = -rstd^3 v / d), into the source's shared
    gradient buffer when v is a gathered view (weighted.gathered: Full AttnRes's sources).
    Autograd's own ops wrote three d-sized tensors a source (the matmul's and two for the
    rstd's backward) and then added them to the buffer's sum, two passes more."""

    @staticmethod
    def forward(ctx, v, w, eps, key_norm):
        u, r = _logit_parts(v, w, eps, key_norm)
        z = u if r is None else u * r
        ctx.save_for_backward(v, w, z if key_norm else None, r)
        ctx.sink = getattr(v, "restopo_sink", None)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        v, w, z, r = ctx.saved_tensors
        v2 = v.reshape(-1, v.shape[-1])
        half = v.dtype != _acc(v)  # fp16/bf16: the products in fp32 (weighted._wide)
        du = dz * r if r is not None else dz          # [R*H, M], in w's (wide) dtype
        dw = (du @ _wide(v2)).t() if ctx.needs_input_grad[1] else None  # w is wide
        if not ctx.needs_input_grad[0]:
            return None, dw, None, None
        # v's gradient: added in place to the readers' sum when v is gathered (handed on
        # by the view, see weighted._Sink), else a tensor of its own
        buf, summed = (None, False) if ctx.sink is None else ctx.sink.buffer(v)
        dv = torch.empty_like(v2) if buf is None else buf.view(v2.shape)
        if half:  # the product in fp32, then rounded once into v's dtype
            wide = du.t() @ w.t()
            if summed:
                dv.add_(wide)
            else:
                dv.copy_(wide)
        elif summed:
            dv.addmm_(du.t(), w.t())
        else:
            torch.mm(du.t(), w.t(), out=dv)
        if r is not None:  # (dz . u) r^3 as (dz . z) r^2: finite for an all-zero row (z = 0
            # there), and 0 where the mean square overflowed (r = 0, z = 0; dz u overflows)
            scale = (dz * z).sum(0) * (-1.0 / v.shape[-1])
            dv.addcmul_(v2, (r[0] * r[0] * scale).to(v.dtype).unsqueeze(-1))
        return (dv.view(v.shape) if buf is None else None), dw, None, None


def _logit_parts(v, w, eps, key_norm):
    """(u = W^T v^T [R*H, tokens] in at least fp32, rstd(v) [1, tokens] or None without
    key norm): the logits are u * rstd."""
    u = w.t() @ _wide(v.reshape(-1, v.shape[-1])).t()  # w is wide already
    return u, (rstd(v, eps).view(1, -1) if key_norm else None)


def depth_attention(sources: Sequence[torch.Tensor], query: torch.Tensor,
                    gained_query: torch.Tensor, eps: float, *, key_norm: bool, gate: str,
                    heads: int, logits: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """h = sum_i alpha_i v_i; `gained_query` is the query with the key-norm gain folded in.
    `logits`: each source's logit [*batch, H] if already made (shared by its readers)."""
    if logits is None:
        q = gained_query.unflatten(-1, (heads, -1))
        logits = [source_logits(v, q, eps, key_norm) for v in sources]
    z = torch.stack(tuple(logits))                                         # [n, *batch, H]
    alpha = torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)
    return weighted_sum(alpha, sources)


def phase1(completed: Sequence[torch.Tensor], gained_queries: torch.Tensor, eps: float, *,
           key_norm: bool, heads: int, logits: Sequence[torch.Tensor] | None = None):
    """Phase 1 over a list of completed blocks, in normalised form: (h1 [S,*b,d], lse
    [S,*b,H], (None,) * S). h1 = sum_i softmax_i(z_i) v_i is phase 1's own output and lse
    its log-sum-exp: the online-softmax state (o1, m1, s1) = (h1, lse, 1), so a block's
    first sublayer reads h1 as it is and phase 2 merges by one lerp (no division by s1
    anywhere). s1 is S Nones, so s1[slot] reads as with the other forms.
    `logits`: each block's logits [S, *batch, H] against the S queries (or their S
    [*batch, H] columns), if already made."""
    if logits is None:
        logits = [logits_against(v, gained_queries, eps, key_norm, heads) for v in completed]
    z = torch.stack([block_logits(zs) for zs in logits])  # [n, S, *batch, H]
    alpha, S = torch.softmax(z, dim=0), gained_queries.shape[0]
    return weighted_sum(alpha, completed, outputs=S), torch.logsumexp(z, dim=0), (None,) * S


def block_logits(zs) -> torch.Tensor:
    """One block's given logits [S, *batch, H]: as given, or its S columns stacked."""
    return zs if isinstance(zs, torch.Tensor) else torch.stack(tuple(zs))


def normalised(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor | None):
    """(h1, lse): phase 1's state (o1, m1, s1) in normalised form, h1 = o1 / s1 (per head)
    and lse = m1 + log s1; s1 None means it already is (the eager phase 1's own output).
    depth.phase2 normalises once here, before either form of phase 2."""
    if s1 is None:
        return o1, m1
    heads = m1.shape[-1]
    h1 = (o1.unflatten(-1, (heads, -1)) / s1.unsqueeze(-1).to(o1.dtype)).flatten(-2)
    return h1, m1 + torch.log(s1)


def phase2(h1: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,
           gained_query: torch.Tensor, eps: float, *, key_norm: bool) -> torch.Tensor:
    """Phase 2: the pre-update partial merged into phase 1's normalised result (h1, its
    log-sum-exp lse) by online softmax. With two terms the softmax is a sigmoid: the
    partial's weight is w = sigmoid(z2 - lse), and h = lerp(h1, partial, w). Autograd keeps
    h1 and the partial (alive anyway) and per-token scalars."""
    if partial is None:
        return h1
    if torch.compiler.is_compiling() or h1.shape != partial.shape:
        heads = lse.shape[-1]
        z2 = source_logits(partial, gained_query.unflatten(-1, (heads, -1)), eps, key_norm)
        w = torch.sigmoid(z2 - lse).unsqueeze(-1)
        dtype = out_dtype(h1, partial)
        h = torch.lerp(h1.unflatten(-1, (heads, -1)).to(dtype),
                       partial.unflatten(-1, (heads, -1)).to(dtype), w.to(dtype))
        return h.flatten(-2)
    return _Lerp.apply(h1, lse, partial, gained_query, eps, key_norm)


class _Lerp(torch.autograd.Function):
    """Phase 2 with a partial, h = lerp(h1, p, w), w = sigmoid(z2 - lse), z2 = q . p *
    rstd(p), in one node with its backward written out: autograd's ops take some twenty
    small per-token ops and nodes each way per sublayer, and pass over d-sized tensors
    more often than this does (three passes forward, eight backward)."""

    @staticmethod
    def forward(ctx, h1, lse, p, q, eps, key_norm):
        heads = lse.shape[-1]
        acc = _acc(p)
        u = _wide(p.reshape(-1, p.shape[-1])) @ query_matrix(q[None], heads).to(acc)
        u = u.view(lse.shape)                                     # q . p per head
        r = rstd(p, eps) if key_norm else None
        z2 = u * r if key_norm else u
        w = torch.sigmoid(z2 - lse)
        dtype = out_dtype(h1, p)  # autograd hands each input its gradient in its own dtype
        out = torch.lerp(h1.unflatten(-1, (heads, -1)).to(dtype),
                         p.unflatten(-1, (heads, -1)).to(dtype), w.unsqueeze(-1).to(dtype))
        ctx.save_for_backward(h1, p, q, w, z2, r)
        ctx.key_norm = key_norm
        return out.flatten(-2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h1, p, q, w, z2, r = ctx.saved_tensors
        heads, acc = w.shape[-1], w.dtype
        g = grad.unflatten(-1, (heads, -1))
        ph = p.unflatten(-1, (heads, -1))
        wide_p = _wide(ph)  # fp16/bf16: the products below in fp32 (weighted._wide)
        scratch = torch.sub(wide_p, _wide(h1.unflatten(-1, (heads, -1))))     # p - h1
        dw = scratch.mul_(_wide(g)).sum(-1, dtype=acc)             # g . (p - h1) per head
        dz2 = dw * w * (1 - w)
        wv = w.unsqueeze(-1).to(g.dtype)
        d_h1 = g * (1 - wv)
        d_p = g * wv                                               # the value's part
        du = dz2 * r if ctx.key_norm else dz2
        d_p.addcmul_(du.unsqueeze(-1).to(g.dtype), q.unflatten(-1, (heads, -1)))  # the logit's
        if ctx.key_norm:  # through rstd: d rstd / dp = -rstd^3 p / d, and u * rstd = z2:
            # (dz2 . u) rstd^3 = (dz2 . z2) rstd^2, finite where rstd^3 overflows
            dr = (dz2 * z2).sum(-1, keepdim=True) * (r * r) * (-1.0 / p.shape[-1])
            d_p.addcmul_(ph, dr.unsqueeze(-1).to(p.dtype))
        d_q = torch.einsum("...h,...hc->hc", du.to(wide_p.dtype), wide_p).flatten().to(q.dtype)
        return d_h1.flatten(-2), -dz2, d_p.flatten(-2), d_q, None, None
