"""The kernels as torch custom ops (`torch.ops.restopo.*`), with fake (meta) implementations
for torch.compile and autograd formulas whose backward is itself a custom op.

`torch.library.custom_op` rather than `triton_op`: the op is opaque to dynamo, so
torch.compile and opcheck work with the interpreter on CPU as well as on CUDA.

Sources are lists of tensors (`Tensor[]`), never a stacked copy; their gradients come back as
one tensor per source. What autograd keeps: the sources (alive anyway), the queries and
gains, and per-token scalars (lse; phase 1's logits and log-sum-exp; phase 2's m1 and s1)
plus phase 2's o1 and partial (its inputs, alive anyway). No output is kept: each backward
recomputes what it needs from the inputs.

Ops (private extra outputs are what the backward needs and are dropped by the public API):
- restopo::depth_attention(sources[], query, gain?, eps, key_norm) -> (h, lse)
- restopo::phase1(completed[], queries, gains?, eps, key_norm) -> (o1[], m1, s1, z)
- restopo::phase2(o1, m1, s1, partial?, query, gain?, norm_weight?, eps, norm_eps, key_norm,
  with_norm, with_h) -> (h, y)
and their `*_backward` ops, told which gradients are wanted (`ctx.needs_input_grad`), so
that no scratch is allocated for one nobody asked for. Gradients are first order.
"""
from __future__ import annotations

from functools import reduce
from typing import Optional

import torch
from torch import Tensor

from . import single, twophase
from .runtime import acc_dtype

custom_op = torch.library.custom_op


def _zeros_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _query_grads(du: Tensor, query: Tensor, gain: Tensor | None, key_norm: bool,
                 needs: tuple[bool, bool]):
    """Split the gradient of u = gain * query into the query's and the gain's."""
    if key_norm and gain is not None:
        return ((du * gain.to(du.dtype)).to(query.dtype) if needs[0] else None,
                (du * query.to(du.dtype)).to(gain.dtype) if needs[1] else None)
    return (du.to(query.dtype) if needs[0] else None), None


def _wants_du(needs: tuple[bool, bool], gain: Tensor | None, key_norm: bool) -> bool:
    """Whether du (the gradient of u = gain * query) is needed: for the query, or for the
    gain when the gain is part of u."""
    return needs[0] or (needs[1] and key_norm and gain is not None)


def _acc(tensors) -> torch.dtype:
    return acc_dtype(reduce(torch.promote_types, [t.dtype for t in tensors]))


# ---- single-read depth attention ----------------------------------------------------------
@custom_op("restopo::depth_attention", mutates_args=())
def depth_attention_op(sources: list[Tensor], query: Tensor, key_norm_weight: Optional[Tensor],
                       eps: float, key_norm: bool) -> tuple[Tensor, Tensor]:
    return single.forward(sources, query, key_norm_weight, eps, key_norm)


@depth_attention_op.register_fake
def _(sources, query, key_norm_weight, eps, key_norm):
    out = reduce(torch.promote_types, [s.dtype for s in sources])
    return (sources[0].new_empty(sources[0].shape, dtype=out),
            sources[0].new_empty(sources[0].shape[:-1], dtype=_acc(sources)))


@custom_op("restopo::depth_attention_backward", mutates_args=())
def depth_attention_backward_op(dout: Tensor, dlse: Tensor, lse: Tensor, sources: list[Tensor],
                                query: Tensor, key_norm_weight: Optional[Tensor], eps: float,
                                key_norm: bool, need_du: bool) -> tuple[list[Tensor], Tensor]:
    return single.backward(dout, dlse, lse, sources, query, key_norm_weight, eps, key_norm,
                           need_du)


@depth_attention_backward_op.register_fake
def _(dout, dlse, lse, sources, query, key_norm_weight, eps, key_norm, need_du):
    return ([s.new_empty(s.shape) for s in sources],
            sources[0].new_empty(sources[0].shape[-1:], dtype=_acc(sources)))


def depth_setup(ctx, inputs, output):
    sources, query, gain, eps, key_norm = inputs
    _, lse = output
    ctx.save_for_backward(query, gain, lse, *sources)
    ctx.eps, ctx.key_norm = eps, key_norm


def depth_grads(ctx, dout, dlse, needs: tuple[bool, bool], backward_op):
    """(the sources' gradients, dquery, dgain): the backward of depth_attention, whose
    query and gain gradients `needs` says are wanted, through `backward_op` (the custom op
    here, the plain function in eager calls: functions.py)."""
    query, gain, lse, *sources = ctx.saved_tensors
    dout = _zeros_if_none(dout, sources[0])
    dsources, du = backward_op(
        dout, _zeros_if_none(dlse, lse), lse, sources, query, gain, ctx.eps, ctx.key_norm,
        _wants_du(needs, gain, ctx.key_norm))
    dquery, dgain = _query_grads(du, query, gain, ctx.key_norm, needs)
    return dsources, dquery, dgain


def _depth_backward(ctx, dout, dlse):
    return (*depth_grads(ctx, dout, dlse, tuple(ctx.needs_input_grad[1:3]),
                         depth_attention_backward_op), None, None)


depth_attention_op.register_autograd(_depth_backward, setup_context=depth_setup)


# ---- phase 1 ------------------------------------------------------------------------------
@custom_op("restopo::phase1", mutates_args=())
def phase1_op(completed: list[Tensor], queries: Tensor, key_norm_weights: Optional[Tensor],
              eps: float, key_norm: bool) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    return twophase.phase1_forward(completed, queries, key_norm_weights, eps, key_norm)


@phase1_op.register_fake
def _(completed, queries, key_norm_weights, eps, key_norm):
    S, n = queries.shape[0], len(completed)
    first = completed[0]
    batch = first.shape[:-1]
    acc = _acc(completed)
    out = reduce(torch.promote_types, [c.dtype for c in completed])
    rows = batch.numel()
    return ([first.new_empty(first.shape, dtype=out) for _ in range(S)],
            first.new_empty((S, *batch, 1), dtype=acc), first.new_empty((S, *batch, 1), dtype=acc),
            first.new_empty((n, S, rows), dtype=acc))


@custom_op("restopo::phase1_backward", mutates_args=())
def phase1_backward_op(do1: list[Tensor], dm1: Tensor, ds1: Tensor, completed: list[Tensor],
                       queries: Tensor, key_norm_weights: Optional[Tensor], z: Tensor,
                       m1: Tensor, eps: float, key_norm: bool, need_du: bool
                       ) -> tuple[list[Tensor], Tensor]:
    return twophase.phase1_backward(do1, dm1, ds1, completed, queries, key_norm_weights, z, m1,
                                    eps, key_norm, need_du)


@phase1_backward_op.register_fake
def _(do1, dm1, ds1, completed, queries, key_norm_weights, z, m1, eps, key_norm, need_du):
    return ([c.new_empty(c.shape) for c in completed],
            completed[0].new_empty(queries.shape, dtype=_acc(completed)))


def phase1_setup(ctx, inputs, output):
    completed, queries, gains, eps, key_norm = inputs
    o1, m1, _, z = output
    ctx.save_for_backward(queries, gains, z, m1, *completed)
    ctx.eps, ctx.key_norm = eps, key_norm
    ctx.o1_like = (o1[0].shape, o1[0].dtype)


def phase1_grads(ctx, do1, dm1, ds1, needs: tuple[bool, bool], backward_op):
    """(the completed blocks' gradients, dqueries, dgains), as depth_grads."""
    queries, gains, z, m1, *completed = ctx.saved_tensors
    shape, dtype = ctx.o1_like
    do1 = [g if g is not None else m1.new_zeros(shape, dtype=dtype) for g in do1]
    dcompleted, du = backward_op(
        do1, _zeros_if_none(dm1, m1), _zeros_if_none(ds1, m1), completed, queries, gains, z,
        m1, ctx.eps, ctx.key_norm, _wants_du(needs, gains, ctx.key_norm))
    dqueries, dgains = _query_grads(du, queries, gains, ctx.key_norm, needs)
    return dcompleted, dqueries, dgains


def _phase1_backward(ctx, do1, dm1, ds1, dz):
    return (*phase1_grads(ctx, do1, dm1, ds1, tuple(ctx.needs_input_grad[1:3]),
                          phase1_backward_op), None, None)


phase1_op.register_autograd(_phase1_backward, setup_context=phase1_setup)


# ---- phase 2 ------------------------------------------------------------------------------
@custom_op("restopo::phase2", mutates_args=())
def phase2_op(o1: Tensor, m1: Tensor, s1: Tensor, partial: Optional[Tensor], query: Tensor,
              key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
              norm_eps: float, key_norm: bool, with_norm: bool,
              with_h: bool) -> tuple[Tensor, Tensor]:
    return twophase.phase2_forward(o1, m1, s1, partial, query, key_norm_weight, norm_weight,
                                   eps, norm_eps, key_norm, with_norm, with_h)


def _phase2_out_dtype(o1, partial):
    return o1.dtype if partial is None else torch.promote_types(o1.dtype, partial.dtype)


@phase2_op.register_fake
def _(o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps, norm_eps, key_norm,
      with_norm, with_h):
    out = _phase2_out_dtype(o1, partial)
    return (o1.new_empty(o1.shape if with_h else (0,), dtype=out),
            o1.new_empty(o1.shape if with_norm else (0,), dtype=out))


@custom_op("restopo::phase2_backward", mutates_args=())
def phase2_backward_op(dh: Tensor, dy: Tensor, o1: Tensor, m1: Tensor, s1: Tensor,
                       partial: Optional[Tensor], query: Tensor,
                       key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor],
                       eps: float, norm_eps: float, key_norm: bool, with_norm: bool,
                       need_dp: bool, need_du: bool, need_dnw: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return twophase.phase2_backward(dh, dy, o1, m1, s1, partial, query, key_norm_weight,
                                    norm_weight, eps, norm_eps, key_norm, with_norm,
                                    (need_dp, need_du, need_dnw))


@phase2_backward_op.register_fake
def _(dh, dy, o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps, norm_eps,
      key_norm, with_norm, need_dp, need_du, need_dnw):
    acc = acc_dtype(torch.float64 if torch.float64 in (o1.dtype, getattr(partial, "dtype", None))
                    else o1.dtype)
    d = o1.shape[-1]
    dp = (partial.new_empty(partial.shape) if partial is not None and need_dp
          else o1.new_empty((0,)))
    return (o1.new_empty(o1.shape), m1.new_empty(m1.shape), s1.new_empty(s1.shape), dp,
            o1.new_empty((d,), dtype=acc), o1.new_empty((d,), dtype=acc))


def phase2_setup(ctx, inputs, output):
    (o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
     with_norm, with_h) = inputs
    ctx.save_for_backward(o1, m1, s1, partial, query, gain, norm_weight)
    ctx.args = (eps, norm_eps, key_norm, with_norm, with_h)


def phase2_grads(ctx, dh, dy, backward_op=phase2_backward_op):
    """The gradients of phase2's 12 inputs (its custom op's and its autograd.Function's
    (functions.py) alike), through `backward_op`."""
    o1, m1, s1, partial, query, gain, norm_weight = ctx.saved_tensors
    eps, norm_eps, key_norm, with_norm, with_h = ctx.args
    need = ctx.needs_input_grad
    dh = _zeros_if_none(dh, o1) if with_h else o1.new_empty((0,))
    dy = _zeros_if_none(dy, o1) if with_norm else o1.new_empty((0,))
    q_needs = (need[4], need[5])
    do1, dm1, ds1, dp, du, dnw = backward_op(
        dh, dy, o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
        with_norm, need[3], _wants_du(q_needs, gain, key_norm), need[6])
    if partial is None:  # h = o1 / s1: the query, its gain and m1 play no part
        dp, dquery, dgain, dm1 = None, None, None, None
    else:
        dquery, dgain = _query_grads(du, query, gain, key_norm, q_needs)
        dp = dp if need[3] else None
    dnw = dnw.to(norm_weight.dtype) if (need[6] and with_norm and norm_weight is not None) \
        else None
    return do1, dm1, ds1, dp, dquery, dgain, dnw, None, None, None, None, None


phase2_op.register_autograd(phase2_grads, setup_context=phase2_setup)
