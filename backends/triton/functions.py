"""The kernels under torch.autograd.Function, for eager calls.

The custom ops (custom_ops.py) are what torch.compile and torch.export trace: dynamo needs
their fake implementations. Called eagerly, a custom op costs more than its kernel at
small widths: the dispatcher fills the schema's defaults, checks that no output aliases an
input, and wraps autograd in Python, once for the forward and once more for the backward
op (~45 us a call on a CPU host, with the kernel launch stubbed out). These Functions run
the same forward, keep the same tensors (the setup functions of custom_ops.py) and run the
same backward (its *_grads functions) on the plain kernel functions; backends/triton picks
them outside compilation. Sources travel as trailing positional tensors, since a Function
tracks no tensor inside a list.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import custom_ops as C
from . import single, twophase


def _phase2_backward(*args):
    """twophase.phase2_backward with the custom op's signature (three flags, not a tuple)."""
    return twophase.phase2_backward(*args[:-3], tuple(args[-3:]))


class DepthAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, gain, eps, key_norm, *sources):
        sources = list(sources)
        out = single.forward(sources, query, gain, eps, key_norm)
        C.depth_setup(ctx, (sources, query, gain, eps, key_norm), out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        dsources, dquery, dgain = C.depth_grads(ctx, dout, dlse,
                                                tuple(ctx.needs_input_grad[:2]), single.backward)
        return (dquery, dgain, None, None, *dsources)


class Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, gains, eps, key_norm, *completed):
        completed = list(completed)
        o1, m1, s1, z = twophase.phase1_forward(completed, queries, gains, eps, key_norm)
        C.phase1_setup(ctx, (completed, queries, gains, eps, key_norm), (o1, m1, s1, z))
        ctx.queries = len(o1)
        return (*o1, m1, s1, z)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        S = ctx.queries
        dcompleted, dqueries, dgains = C.phase1_grads(
            ctx, grads[:S], grads[S], grads[S + 1], tuple(ctx.needs_input_grad[:2]),
            twophase.phase1_backward)
        return (dqueries, dgains, None, None, *dcompleted)


class Phase2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        out = twophase.phase2_forward(*inputs)
        C.phase2_setup(ctx, inputs, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dh, dy):
        return C.phase2_grads(ctx, dh, dy, _phase2_backward)


# the custom ops' call signatures (backends/triton/__init__.py calls either set)
def depth_attention_op(sources, query, key_norm_weight, eps, key_norm):
    return DepthAttention.apply(query, key_norm_weight, eps, key_norm, *sources)


def phase1_op(completed, queries, key_norm_weights, eps, key_norm):
    *o1, m1, s1, z = Phase1.apply(queries, key_norm_weights, eps, key_norm, *completed)
    return o1, m1, s1, z


def phase2_op(o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps, norm_eps,
              key_norm, with_norm, with_h):
    return Phase2.apply(o1, m1, s1, partial, query, key_norm_weight, norm_weight, eps,
                        norm_eps, key_norm, with_norm, with_h)
