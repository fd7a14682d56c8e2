"""out_s = sum_i alpha_{i,s} v_i over a list of sources, with a hand-written backward.

Every depth aggregation ends in such a sum: depth attention (one output), phase 1 (one per
query of the block) and phase 2 (o1 and the partial). Written with autograd's own ops each
term is a multiply and an add forward and, backward, a multiply that writes a d-sized
product per (source, output) only to reduce it to alpha's gradient. Here the forward is one
fused multiply-add per term (addcmul_), and the backward per term one dot product (alpha's
gradient) and one multiply-add into the source's gradient. Autograd saves the sources
(other nodes' outputs, alive anyway) and alpha (per-token scalars): nothing d-sized of its
own, as the list path promises (tests/test_ops_eager.py measures it).

Under torch.compile the plain form is traced instead: inductor fuses it into one loop.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


_HALF = (torch.float16, torch.bfloat16)


def _acc(v: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for v: at least fp32. A Python test, not promote_types: that
    is a dispatched op, paid at every aggregation point of a decoding step."""
    return torch.float32 if v.dtype in _HALF else v.dtype


def _wide(v: torch.Tensor) -> torch.Tensor:
    """v in its accumulation dtype (a copy for fp16/bf16, v itself otherwise): for products
    that feed a sum whose result is kept wide. A half-precision product rounds each term to
    8 bits of mantissa, and a softmax's backward then cancels the rounded terms against
    each other (a saturated softmax lost most of alpha's gradient); the fused kernels
    multiply in fp32, and so does this."""
    return v.float() if v.dtype in _HALF else v


def out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a sum or lerp of `tensors` is returned in: their promoted dtype (as the
    fused kernels return), found without a dispatch when they agree (the usual case).
    Under autocast the embedding (b_0) stays fp32 while blocks are bf16: the result was
    the first source's dtype, or an error where an op wants one dtype."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _Sink:
    """Where the weighted sums that read one source add up its gradient, within one
    backward pass: a pass that does not need the source never runs the view's node, so
    what it added is dropped by the next pass rather than handed on."""

    grad: torch.Tensor | None = None
    task: int = -1  # the backward pass (autograd graph task) `grad` belongs to

    def add(self, g: torch.Tensor, a: torch.Tensor) -> None:
        """grad += g * a, with g [*batch, H, c] and a per head [*batch, H, 1]."""
        task = torch._C._current_graph_task_id()
        if self.grad is None or self.task != task:
            self.grad, self.task = (g * a).flatten(-2), task
        else:
            self.grad.unflatten(-1, g.shape[-2:]).addcmul_(g, a)

    def buffer(self, like: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(this pass's gradient buffer, row-major and shaped as `like`; whether it holds a
        sum already), for a kernel or matmul that writes its part there itself: it writes
        the buffer when False and adds to it when True. (None, False) where the sum so far
        is not row-major (add's product can take a gradient's strides): the caller then
        hands its part to autograd instead."""
        task = torch._C._current_graph_task_id()
        if self.grad is None or self.task != task:
            self.grad = torch.empty_like(like, memory_format=torch.contiguous_format)
            self.task = task
            return self.grad, False
        return (self.grad, True) if self.grad.is_contiguous() else (None, False)

    def take(self) -> torch.Tensor | None:
        """This pass's sum (None if nothing was added in it); the sink is emptied."""
        got, self.grad = self.grad, None
        return got if self.task == torch._C._current_graph_task_id() else None


class _Gather(torch.autograd.Function):
    """Identity forward; backward hands on what the readers added to the sink (plus any
    gradient that reached this view by other ops), then empties the sink."""

    @staticmethod
    def forward(ctx, v, sink):
        ctx.set_materialize_grads(False)
        ctx.sink = sink
        return v.view_as(v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        got = ctx.sink.take()
        if got is None or grad is None:
            return (grad if got is None else got), None
        return got.add_(grad), None


def gathered(v: torch.Tensor) -> torch.Tensor:
    """A view of source v for its readers' weighted sums: each adds its part of v's gradient
    into one buffer in place (a multiply-add), which this view's backward hands on once,
    after the last of them, instead of each reader returning a new d-sized tensor for
    autograd to add up."""
    if torch.compiler.is_compiling() or not v.requires_grad:
        return v
    sink = _Sink()
    out = _Gather.apply(v, sink)
    out.restopo_sink = sink
    return out


def weighted_sum(alpha: torch.Tensor, sources: Sequence[torch.Tensor],
                 outputs: int | None = None) -> torch.Tensor:
    """sum_i alpha_i v_i, each head's weight over its channel slice.

    alpha: [n, *batch, H] for one output ([*batch, d] returned), or [n, S, *batch, H] with
    `outputs=S` for S outputs ([S, *batch, d]); sources: n tensors [*batch, d], d = H * c."""
    if torch.compiler.is_compiling() or len({tuple(v.shape) for v in sources}) != 1:
        return _plain(alpha, sources, outputs)
    return WeightedSum.apply(alpha, outputs, *sources)


def _plain(alpha, sources, outputs):
    """The same sum in autograd's ops (for tracing, and sources that broadcast)."""
    heads, dtype = alpha.shape[-1], out_dtype(*sources)
    out = None
    for a_i, v in zip(alpha, sources):                           # a_i: [(S,) *batch, H]
        term = v.unflatten(-1, (heads, -1)) * a_i.unsqueeze(-1).to(dtype)
        out = term if out is None else out + term
    return out.flatten(-2)


class WeightedSum(torch.autograd.Function):
    """out_s = sum_i alpha_{i,s} v_i; see the module docstring."""

    @staticmethod
    def forward(ctx, alpha, outputs, *sources):
        v0, dtype = sources[0], out_dtype(*sources)
        heads = alpha.shape[-1]
        a = alpha.to(dtype).unsqueeze(-1)                         # [n, (S,) *batch, H, 1]
        if outputs is None:
            a = a.unsqueeze(1)
        vh = [v.unflatten(-1, (heads, -1)) for v in sources]      # [*batch, H, c]
        out = torch.empty((a.shape[1], *vh[0].shape), dtype=dtype, device=v0.device)
        for o, a_s in zip(out, a.unbind(1)):                      # each output in place
            torch.mul(vh[0], a_s[0], out=o)
            for v, a_i in zip(vh[1:], a_s[1:]):
                o.addcmul_(v, a_i)
        ctx.save_for_backward(alpha, *sources)
        ctx.outputs = outputs
        ctx.sinks = [getattr(v, "restopo_sink", None) for v in sources]
        out = out.flatten(-2)
        return out[0] if outputs is None else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        alpha, *sources = ctx.saved_tensors
        heads = alpha.shape[-1]
        g = grad.unflatten(-1, (heads, -1))                       # [(S,) *batch, H, c]
        a = alpha.to(grad.dtype).unsqueeze(-1)
        if ctx.outputs is None:
            g, a = g.unsqueeze(0), a.unsqueeze(1)                 # a: [n, S, *batch, H, 1]
        gs = g.unbind(0)
        d_alpha = product = None
        if ctx.needs_input_grad[0]:  # alpha's gradient: each output's gradient . v_i
            d_alpha = torch.empty(a.shape[:-1], dtype=_acc(grad), device=grad.device)
            product = torch.empty_like(gs[0], dtype=d_alpha.dtype)  # reused scratch
            wide_gs = [_wide(g_s) for g_s in gs]
        d_sources = []
        for i, (v, sink) in enumerate(zip(sources, ctx.sinks)):
            vh = v.unflatten(-1, (heads, -1))
            wide_v = _wide(vh) if product is not None else None
            dv = None
            for s, (g_s, a_is) in enumerate(zip(gs, a[i])):
                if product is not None:
                    torch.sum(torch.mul(wide_gs[s], wide_v, out=product), -1, out=d_alpha[i, s])
                if sink is not None:  # a gathered source: added in place (see gathered)
                    sink.add(g_s, a_is)
                elif ctx.needs_input_grad[2 + i]:
                    if dv is None:
                        dv = g_s * a_is
                    else:
                        dv.addcmul_(g_s, a_is)
            d_sources.append(None if dv is None else dv.flatten(-2))
        if d_alpha is not None:
            d_alpha = (d_alpha[:, 0] if ctx.outputs is None else d_alpha).to(alpha.dtype)
        return (d_alpha, None, *d_sources)
