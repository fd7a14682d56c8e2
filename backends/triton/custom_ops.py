"""The kernels as torch custom ops (`torch.ops.restopo.*`), with fake (meta) implementations
for torch.compile and autograd formulas whose backward is itself a custom op.

`torch.library.custom_op` rather than `triton_op`: the op is opaque to dynamo, so
torch.compile and opcheck work with the interpreter on CPU as well as on CUDA.

Ops (private extra outputs are what the backward needs and are dropped by the public API):
- restopo::depth_attention(sources, query, gain?, eps, key_norm) -> (h, lse)
- restopo::phase1(completed, queries, gains?, eps, key_norm) -> (o1, m1, s1, z)
- restopo::phase2(o1, m1, s1, partial?, query, gain?, norm_weight?, eps, norm_eps, key_norm,
  with_norm) -> (h, y)
and their `*_backward` ops. Gradients are first order (no double backward).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import single, twophase
from .runtime import acc_dtype

custom_op = torch.library.custom_op


def _zeros_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _query_grads(du: Tensor, query: Tensor, gain: Tensor | None, key_norm: bool):
    """Split the gradient of u = gain * query into the query's and the gain's."""
    if key_norm and gain is not None:
        return ((du * gain.to(du.dtype)).to(query.dtype),
                (du * query.to(du.dtype)).to(gain.dtype))
    return du.to(query.dtype), None


# ---- single-read depth attention ----------------------------------------------------------
@custom_op("restopo::depth_attention", mutates_args=())
def depth_attention_op(sources: Tensor, query: Tensor, key_norm_weight: Optional[Tensor],
                       eps: float, key_norm: bool) -> tuple[Tensor, Tensor]:
    return single.forward(sources, query, key_norm_weight, eps, key_norm)


@depth_attention_op.register_fake
def _(sources, query, key_norm_weight, eps, key_norm):
    return (sources.new_empty(sources.shape[1:]),
            sources.new_empty(sources.shape[1:-1], dtype=acc_dtype(sources.dtype)))


@custom_op("restopo::depth_attention_backward", mutates_args=())
def depth_attention_backward_op(dout: Tensor, dlse: Tensor, out: Tensor, lse: Tensor,
                                sources: Tensor, query: Tensor,
                                key_norm_weight: Optional[Tensor], eps: float,
                                key_norm: bool) -> tuple[Tensor, Tensor]:
    return single.backward(dout, dlse, out, lse, sources, query, key_norm_weight, eps, key_norm)


@depth_attention_backward_op.register_fake
def _(dout, dlse, out, lse, sources, query, key_norm_weight, eps, key_norm):
    return (sources.new_empty(sources.shape),
            sources.new_empty(sources.shape[-1:], dtype=acc_dtype(sources.dtype)))


def _depth_setup(ctx, inputs, output):
    sources, query, gain, eps, key_norm = inputs
    out, lse = output
    ctx.save_for_backward(sources, query, gain, out, lse)
    ctx.eps, ctx.key_norm = eps, key_norm


def _depth_backward(ctx, dout, dlse):
    sources, query, gain, out, lse = ctx.saved_tensors
    dsources, du = depth_attention_backward_op(
        _zeros_if_none(dout, out), _zeros_if_none(dlse, lse), out, lse, sources, query, gain,
        ctx.eps, ctx.key_norm)
    dquery, dgain = _query_grads(du, query, gain, ctx.key_norm)
    return dsources, dquery, dgain, None, None


depth_attention_op.register_autograd(_depth_backward, setup_context=_depth_setup)


# ---- phase 1 ------------------------------------------------------------------------------
@custom_op("restopo::phase1", mutates_args=())
def phase1_op(completed: Tensor, queries: Tensor, key_norm_weights: Optional[Tensor],
              eps: float, key_norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return twophase.phase1_forward(completed, queries, key_norm_weights, eps, key_norm)


@phase1_op.register_fake
def _(completed, queries, key_norm_weights, eps, key_norm):
    S, n, d = queries.shape[0], completed.shape[0], completed.shape[-1]
    batch = completed.shape[1:-1]
    acc = acc_dtype(completed.dtype)
    rows = batch.numel()
    return (completed.new_empty((S, *batch, d)), completed.new_empty((S, *batch, 1), dtype=acc),
            completed.new_empty((S, *batch, 1), dtype=acc),
            completed.new_empty((n, S, rows), dtype=acc))


@custom_op("restopo::phase1_backward", mutates_args=())
def phase1_backward_op(do1: Tensor, dm1: Tensor, ds1: Tensor, completed: Tensor,
                       queries: Tensor, key_norm_weights: Optional[Tensor], z: Tensor,
                       m1: Tensor, eps: float, key_norm: bool) -> tuple[Tensor, Tensor]:
    return twophase.phase1_backward(do1, dm1, ds1, completed, queries, key_norm_weights, z, m1,
                                    eps, key_norm)


@phase1_backward_op.register_fake
def _(do1, dm1, ds1, completed, queries, key_norm_weights, z, m1, eps, key_norm):
    return (completed.new_empty(completed.shape),
            completed.new_empty(queries.shape, dtype=acc_dtype(completed.dtype)))


def _phase1_setup(ctx, inputs, output):
    completed, queries, gains, eps, key_norm = inputs
    o1, m1, s1, z = output
    ctx.save_for_backward(completed, queries, gains, z, m1, o1, s1)
    ctx.eps, ctx.key_norm = eps, key_norm


def _phase1_backward(ctx, do1, dm1, ds1, dz):
    completed, queries, gains, z, m1, o1, s1 = ctx.saved_tensors
    dcompleted, du = phase1_backward_op(
        _zeros_if_none(do1, o1), _zeros_if_none(dm1, m1), _zeros_if_none(ds1, s1), completed,
        queries, gains, z, m1, ctx.eps, ctx.key_norm)
    dqueries, dgains = _query_grads(du, queries, gains, ctx.key_norm)
    return dcompleted, dqueries, dgains, None, None


phase1_op.register_autograd(_phase1_backward, setup_context=_phase1_setup)


# ---- phase 2 ------------------------------------------------------------------------------
@custom_op("restopo::phase2", mutates_args=())
def phase2_op(o1: Tensor, m1: Tensor, s1: Tensor, partial: Optional[Tensor], query: Tensor,
              key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
              norm_eps: float, key_norm: bool, with_norm: bool) -> tuple[Tensor, Tensor]:
    return twophase.phase2_forward(o1, m1, s1, partial, query, key_norm_weight, norm_weight,
                                   eps, norm_eps, key_norm, with_norm)


@phase2_op.register_fake
def _(o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps, norm_eps, key_norm,
      with_norm):
    return o1.new_empty(o1.shape), o1.new_empty(o1.shape if with_norm else (0,))


@custom_op("restopo::phase2_backward", mutates_args=())
def phase2_backward_op(dh: Tensor, dy: Tensor, o1: Tensor, m1: Tensor, s1: Tensor,
                       partial: Optional[Tensor], query: Tensor,
                       key_norm_weight: Optional[Tensor], norm_weight: Optional[Tensor],
                       eps: float, norm_eps: float, key_norm: bool, with_norm: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return twophase.phase2_backward(dh, dy, o1, m1, s1, partial, query, key_norm_weight,
                                    norm_weight, eps, norm_eps, key_norm, with_norm)


@phase2_backward_op.register_fake
def _(dh, dy, o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps, norm_eps,
      key_norm, with_norm):
    acc = acc_dtype(o1.dtype)
    d = o1.shape[-1]
    dp = partial.new_empty(partial.shape) if partial is not None else o1.new_empty((0,))
    return (o1.new_empty(o1.shape), m1.new_empty(m1.shape), s1.new_empty(s1.shape), dp,
            o1.new_empty((d,), dtype=acc), o1.new_empty((d,), dtype=acc))


def _phase2_setup(ctx, inputs, output):
    (o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
     with_norm) = inputs
    ctx.save_for_backward(o1, m1, s1, partial, query, gain, norm_weight)
    ctx.args = (eps, norm_eps, key_norm, with_norm)


def _phase2_backward(ctx, dh, dy):
    o1, m1, s1, partial, query, gain, norm_weight = ctx.saved_tensors
    eps, norm_eps, key_norm, with_norm = ctx.args
    dh = _zeros_if_none(dh, o1)
    dy = _zeros_if_none(dy, o1) if with_norm else dh.new_empty((0,))
    do1, dm1, ds1, dp, du, dnw = phase2_backward_op(
        dh, dy, o1, m1, s1, partial, query, gain, norm_weight, eps, norm_eps, key_norm,
        with_norm)
    if partial is None:  # h = o1 / s1: the query, its gain and m1 play no part
        dp, dquery, dgain, dm1 = None, None, None, None
    else:
        dquery, dgain = _query_grads(du, query, gain, key_norm)
    dnw = dnw.to(norm_weight.dtype) if (with_norm and norm_weight is not None) else None
    return do1, dm1, ds1, dp, dquery, dgain, dnw, None, None, None, None


phase2_op.register_autograd(_phase2_backward, setup_context=_phase2_setup)
