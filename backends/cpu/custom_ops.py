"""The C kernels as torch custom ops (`torch.ops.restopo_cpu.*`), for torch.compile.

Dynamo cannot trace a foreign call, so under torch.compile the autograd Functions of
functions.py are out of reach; registered as custom ops, with fake implementations (shapes
only) and autograd formulas whose backward is itself a custom op, the kernels stay opaque
calls inside the compiled graph, and inductor compiles what lies between them. Eager calls
keep the autograd Functions: a custom op's dispatch costs tens of microseconds a call,
which the compiled graph's wrapper pays once at most.

Why: inductor's own code for phase 2 and its PreNorm passes over the partial three times
and over h1 twice (a reduction, a pointwise, a reduction again), where the kernel reads each
row once; at width 512 the aggregations' extra memory traffic is what sets Block AttnRes's
overhead (bench/overhead.py).

Ops (each returns, beside its outputs, what its backward needs):
- restopo_cpu::phase1(sources[], queries, eps, key_norm, heads) -> (h1[], lse[], z, r)
- restopo_cpu::phase2(h1, lse, partial, query, gain?, eps, key_norm, norm_eps, with_norm,
  keep_h) -> (h, y, w, rstd2), an absent output being an empty tensor
and their `*_backward` ops. Gradients are first order. Queries come with their key-norm
gains folded in (the fold is torch ops around the call, differentiated by autograd).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import functions as F

custom_op = torch.library.custom_op


def _zeros_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


# ---- phase 1 (depth attention: one query) ------------------------------------------------
@custom_op("restopo_cpu::phase1", mutates_args=())
def phase1_op(sources: list[Tensor], queries: Tensor, eps: float, key_norm: bool,
              heads: int) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    src = [F._rows(v) for v in sources]
    q = F._rows(queries)
    S, M = q.shape[0], src[0].numel() // q.shape[1]
    h1 = [torch.empty_like(src[0]) for _ in range(S)]
    lse = [src[0].new_empty((*src[0].shape[:-1], heads)) for _ in range(S)]
    z = src[0].new_empty((M, len(src), S * heads))
    r = src[0].new_empty((M, len(src)))
    F._phase1_forward(q, eps, key_norm, heads, src, F._ptrs(h1), F._ptrs(lse), z, r)
    return h1, lse, z, r


@phase1_op.register_fake
def _(sources, queries, eps, key_norm, heads):
    v, S = sources[0], queries.shape[0]
    M = v.numel() // v.shape[-1]
    return ([v.new_empty(v.shape) for _ in range(S)],
            [v.new_empty((*v.shape[:-1], heads)) for _ in range(S)],
            v.new_empty((M, len(sources), S * heads)), v.new_empty((M, len(sources))))


@custom_op("restopo_cpu::phase1_backward", mutates_args=())
def phase1_backward_op(sources: list[Tensor], queries: Tensor, z: Tensor, r: Tensor,
                       lse: list[Tensor], g_h1: list[Tensor], g_lse: list[Tensor],
                       key_norm: bool, heads: int) -> tuple[list[Tensor], Tensor]:
    # contiguous copies held here: the kernel reads them through raw addresses
    src, lse, g_h1, g_lse = ([F._rows(t) for t in ts] for ts in (sources, lse, g_h1, g_lse))
    q, z, r = F._rows(queries), F._rows(z), F._rows(r)
    d_src = [torch.empty_like(v) for v in src]
    dq = torch.empty_like(q)
    add = (F.ctypes.c_int * len(src))()
    d = q.shape[1]
    F._kernel("phase1_bwd", q.dtype)(
        len(src), F._ptrs(src), q.shape[0], src[0].numel() // d, d, heads, q.data_ptr(),
        int(key_norm), z.data_ptr(), r.data_ptr(), F._ptrs(lse), F._ptrs(g_h1),
        F._ptrs(g_lse), F._ptrs(d_src), add, dq.data_ptr(), torch.get_num_threads())
    return d_src, dq


@phase1_backward_op.register_fake
def _(sources, queries, z, r, lse, g_h1, g_lse, key_norm, heads):
    return [v.new_empty(v.shape) for v in sources], queries.new_empty(queries.shape)


def _phase1_setup(ctx, inputs, output):
    sources, queries, eps, key_norm, heads = inputs
    _, lse, z, r = output
    ctx.save_for_backward(queries, z, r, *sources, *lse)
    ctx.key_norm, ctx.heads, ctx.S = key_norm, heads, queries.shape[0]


def _phase1_backward(ctx, g_h1, g_lse, _z, _r):
    S = ctx.S
    queries, z, r, *rest = ctx.saved_tensors
    sources, lse = rest[:-S], rest[-S:]
    g_h1 = [_zeros_if_none(g, sources[0]) for g in g_h1]
    g_lse = [_zeros_if_none(g, x) for g, x in zip(g_lse, lse)]
    d_src, dq = phase1_backward_op(sources, queries, z, r, lse, g_h1, g_lse, ctx.key_norm,
                                   ctx.heads)
    return d_src, dq, None, None, None


phase1_op.register_autograd(_phase1_backward, setup_context=_phase1_setup)


# ---- phase 2 and the next sublayer's PreNorm ---------------------------------------------
@custom_op("restopo_cpu::phase2", mutates_args=())
def phase2_op(h1: Tensor, lse: Tensor, partial: Tensor, query: Tensor, gain: Optional[Tensor],
              eps: float, key_norm: bool, norm_eps: float, with_norm: bool,
              keep_h: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = None if gain is None else F._rows(gain)
    h, y, w, rstd2 = F._phase2_forward(F._rows(h1), F._rows(lse), F._rows(partial),
                                       F._rows(query), g, eps, key_norm,
                                       norm_eps if with_norm else None, keep_h, keep=True)
    def out(t):  # an absent output: an empty tensor of its own (outputs may not alias)
        return partial.new_empty(0) if t is None else t

    return out(h), out(y), w, out(rstd2)


@phase2_op.register_fake
def _(h1, lse, partial, query, gain, eps, key_norm, norm_eps, with_norm, keep_h):
    p = partial
    M = p.numel() // p.shape[-1]
    return (p.new_empty(p.shape if keep_h or not with_norm else 0),
            p.new_empty(p.shape if with_norm else 0), lse.new_empty(lse.shape),
            p.new_empty(M if with_norm else 0))


@custom_op("restopo_cpu::phase2_backward", mutates_args=())
def phase2_backward_op(h1: Tensor, lse: Tensor, partial: Tensor, query: Tensor,
                       gain: Optional[Tensor], w: Tensor, rstd2: Optional[Tensor],
                       g_h: Optional[Tensor], g_y: Optional[Tensor], eps: float,
                       key_norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    h1, lse, p, q, w = F._rows(h1), F._rows(lse), F._rows(partial), F._rows(query), F._rows(w)
    g, rstd2, g_h, g_y = (None if t is None else F._rows(t) for t in (gain, rstd2, g_h, g_y))
    d, H = p.shape[-1], lse.shape[-1]
    dh1, dp, dlse, dq = (torch.empty_like(h1), torch.empty_like(p), torch.empty_like(lse),
                         torch.empty_like(q))
    dg = torch.empty_like(g) if g is not None and g_y is not None else p.new_empty(0)
    F._kernel("phase2_bwd", p.dtype)(
        p.numel() // d, d, H, h1.data_ptr(), lse.data_ptr(), p.data_ptr(), q.data_ptr(), eps,
        int(key_norm), F._ptr(g), w.data_ptr(), F._ptr(rstd2),
        F._ptr(g_y), F._ptr(g_h), dh1.data_ptr(), dp.data_ptr(),
        dlse.data_ptr(), dq.data_ptr(), dg.data_ptr() if dg.numel() else None,
        torch.get_num_threads())
    return dh1, dlse, dp, dq, dg


@phase2_backward_op.register_fake
def _(h1, lse, partial, query, gain, w, rstd2, g_h, g_y, eps, key_norm):
    dg = gain.new_empty(gain.shape) if gain is not None and g_y is not None else \
        partial.new_empty(0)
    return (h1.new_empty(h1.shape), lse.new_empty(lse.shape), partial.new_empty(partial.shape),
            query.new_empty(query.shape), dg)


def _phase2_setup(ctx, inputs, output):
    h1, lse, partial, query, gain, eps, key_norm, norm_eps, with_norm, keep_h = inputs
    _, _, w, rstd2 = output
    ctx.save_for_backward(h1, lse, partial, query, gain, w, rstd2 if with_norm else None)
    ctx.eps, ctx.key_norm, ctx.with_norm, ctx.keep_h = eps, key_norm, with_norm, keep_h


def _phase2_backward(ctx, g_h, g_y, _w, _rstd2):
    h1, lse, partial, query, gain, w, rstd2 = ctx.saved_tensors
    g_h = g_h if ctx.keep_h or not ctx.with_norm else None
    g_y = g_y if ctx.with_norm else None
    dh1, dlse, dp, dq, dg = phase2_backward_op(h1, lse, partial, query, gain, w, rstd2, g_h,
                                               g_y, ctx.eps, ctx.key_norm)
    return (dh1, dlse, dp, dq, dg if g_y is not None and gain is not None else None,
            None, None, None, None, None)


phase2_op.register_autograd(_phase2_backward, setup_context=_phase2_setup)


def phase1(queries: Tensor, eps: float, key_norm: bool, heads: int, sources) -> tuple:
    """(h1 tuple, lse tuple) of phase 1, as functions.Phase1 gives them."""
    h1, lse, _, _ = phase1_op(list(sources), queries, eps, key_norm, heads)
    return tuple(h1), tuple(lse)


def phase2(h1, lse, p, q, g, eps, key_norm, norm_eps, keep_h) -> tuple:
    """(h or None, y or None), as functions.Phase2 gives them."""
    with_norm = norm_eps is not None
    h, y, _, _ = phase2_op(h1, lse, p, q, g, eps, key_norm,
                           norm_eps if with_norm else 0.0, with_norm, keep_h)
    return (h if keep_h or not with_norm else None), (y if with_norm else None)
