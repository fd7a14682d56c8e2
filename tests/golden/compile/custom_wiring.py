"""model: written by `restopo compile` from custom_wiring.restopo; standalone (imports only torch).

Topology custom; 32 sublayers. Copy this file anywhere:

    import torch, model
    model = model.build()                      # PyTorch's default initialisation
    blob = torch.load("model.pt")              # restopo compile ... -o model.pt
    model.load_state_dict(blob["state_dict"])  # strict
    logits = model(idx)                        # idx [B, T] token ids -> [B, T, vocab]

A training run's weights: `restopo export RUN -o weights.safetensors`, then
model.load_state_dict(safetensors.torch.load_file("weights.safetensors")). (A checkpoint's
own model.safetensors keeps a tied head's weight once, under the embedding's name: a
strict load misses head.lm_head.weight.)

The depth-attention kernels, sublayers and aggregation modules below are restopo's own
eager backend: without autograd (under torch.no_grad) the outputs equal
restopo.load(..., backend="eager") bit for bit. With autograd on they agree up to float
rounding, not bit for bit: restopo's eager backend then computes each source's
depth-attention logits for all its readers in one matmul, which this file leaves out.
Those of restopo's default backend (fused kernels) agree up to float rounding. The forward
at the end is the lowered graph's generated code.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

SPEC = r'''# Custom wiring: blocks of 4 sublayers whose aggregations use an input-dependent query,
# and a head that reads the embedding and the completed blocks without key norm. Shows the
# rule form: which sources each aggregation reads, how they are weighted, what the head
# reads. Not a row of the paper's table; a starting point for new topologies.

model ablation {
  vocab: 256; width: 64; depth: 16; heads: 4; context: 128   # 32 sublayers, as in the paper
  mlp: swiglu(4x)
}

residual custom {
  block_size: 4                  # sublayers per block (a multiple of 2: attn + mlp)
  before sublayer: attend(embedding, blocks, partial; query: input_dependent)
  before head: attend(embedding, blocks; key_norm: none)
}

train { data: builtin:stdlib; steps: 300; batch: 16; lr: 3e-3; schedule: cosine; warmup: 30 }
'''
OVERRIDES = ()
NORM_EPS = 1e-24
EPS = NORM_EPS


# ---- depth-attention kernels (restopo's eager backend)
_HALF = (torch.float16, torch.bfloat16)


def _weighted__acc(v: torch.Tensor) -> torch.dtype:
    """The accumulation dtype for v: at least fp32. A Python test, not promote_types: that
    is a dispatched op, paid at every aggregation point of a decoding step."""
    return torch.float32 if v.dtype in _HALF else v.dtype


def _weighted__wide(v: torch.Tensor) -> torch.Tensor:
    """v in its accumulation dtype (a copy for fp16/bf16, v itself otherwise): for products
    that feed a sum whose result is kept wide. A half-precision product rounds each term to
    8 bits of mantissa, and a softmax's backward then cancels the rounded terms against
    each other (a saturated softmax lost most of alpha's gradient); the fused kernels
    multiply in fp32, and so does this."""
    return v.float() if v.dtype in _HALF else v


def _weighted_out_dtype(*tensors: torch.Tensor) -> torch.dtype:
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


def _weighted_gathered(v: torch.Tensor) -> torch.Tensor:
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


def _weighted_weighted_sum(alpha: torch.Tensor, sources: Sequence[torch.Tensor],
                 outputs: int | None = None) -> torch.Tensor:
    """sum_i alpha_i v_i, each head's weight over its channel slice.

    alpha: [n, *batch, H] for one output ([*batch, d] returned), or [n, S, *batch, H] with
    `outputs=S` for S outputs ([S, *batch, d]); sources: n tensors [*batch, d], d = H * c."""
    if torch.compiler.is_compiling() or len({tuple(v.shape) for v in sources}) != 1:
        return _weighted__plain(alpha, sources, outputs)
    return WeightedSum.apply(alpha, outputs, *sources)


def _weighted__plain(alpha, sources, outputs):
    """The same sum in autograd's ops (for tracing, and sources that broadcast)."""
    heads, dtype = alpha.shape[-1], _weighted_out_dtype(*sources)
    out = None
    for a_i, v in zip(alpha, sources):                           # a_i: [(S,) *batch, H]
        term = v.unflatten(-1, (heads, -1)) * a_i.unsqueeze(-1).to(dtype)
        out = term if out is None else out + term
    return out.flatten(-2)


class WeightedSum(torch.autograd.Function):
    """out_s = sum_i alpha_{i,s} v_i; see the module docstring."""

    @staticmethod
    def forward(ctx, alpha, outputs, *sources):
        v0, dtype = sources[0], _weighted_out_dtype(*sources)
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
            d_alpha = torch.empty(a.shape[:-1], dtype=_weighted__acc(grad), device=grad.device)
            product = torch.empty_like(gs[0], dtype=d_alpha.dtype)  # reused scratch
            wide_gs = [_weighted__wide(g_s) for g_s in gs]
        d_sources = []
        for i, (v, sink) in enumerate(zip(sources, ctx.sinks)):
            vh = v.unflatten(-1, (heads, -1))
            wide_v = _weighted__wide(vh) if product is not None else None
            dv = None
            for s, (g_s, a_is) in enumerate(zip(gs, a[i])):
                if product is not None:
                    torch.sum(torch.mul(wide_gs[s], wide_v, out=product), -1, out=d_alpha[i, s])
                if sink is not None:  # a _weighted_gathered source: added in place (see _weighted_gathered)
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


weighted = SimpleNamespace(_acc=_weighted__acc, _plain=_weighted__plain, _wide=_weighted__wide, gathered=_weighted_gathered, out_dtype=_weighted_out_dtype, weighted_sum=_weighted_weighted_sum)


def _rmsnorm_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, times `weight` (None: no gain)."""
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or not torch.is_grad_enabled()
            or not (x.requires_grad or (weight is not None and weight.requires_grad))):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


_EPS = {}  # each (epsilon, device) as a 0-dim tensor, made once


def _rmsnorm_rstd(v: torch.Tensor, eps: float) -> torch.Tensor:
    """[*batch, 1]: 1 / RMS(v) over channels, in at least fp32, as rsqrt(eps + |v|^2 / d):
    a norm and two ops, one pass over v (the sublayer norms', the key norm's of both forms
    of depth attention). For the tiny tensors of a decoding step each op's dispatch, not its
    arithmetic, is the cost: a mean of squares takes several ops, and a Python number
    handed to an in-place op is wrapped into a tensor and copied first (two dispatches
    more each), where addcmul takes 1/d as its scalar `value` and eps as a kept tensor (a
    0-dim tensor does not change the result's dtype or device)."""
    n = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=_weighted__acc(v))
    if torch.compiler.is_compiling():
        return torch.rsqrt(n * n / v.shape[-1] + eps)
    key = (eps, n.device)
    e = _EPS.get(key)
    if e is None:
        e = _EPS[key] = torch.tensor(eps, dtype=torch.float64, device=n.device)
    return torch.addcmul(e, n, n, value=1.0 / v.shape[-1]).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        r = _rmsnorm_rstd(x, eps)
        y = torch.mul(x, r)                       # in at least fp32: r is
        if weight is not None:
            y.mul_(weight)
        ctx.save_for_backward(x, weight, r)
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight, r = ctx.saved_tensors
        d, acc = x.shape[-1], r.dtype
        gy = gy.to(acc)
        xa = x if x.dtype == acc else x.to(acc)
        gx = gy * xa                                           # [*b, d]
        rows, cols = gx.reshape(-1, d), r.reshape(1, -1)
        d_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = (cols @ rows).view(d).to(weight.dtype)  # sum over tokens of gy x _rmsnorm_rstd
        if not ctx.needs_input_grad[0]:
            return None, d_weight, None
        if weight is None:
            dot = gx.sum(-1, keepdim=True)
        else:
            w = weight.to(acc)
            dot = (rows @ w).view(r.shape)                    # sum over channels of gy g x
        # d _rmsnorm_rstd / dx = -_rmsnorm_rstd^3 x / d: as _rmsnorm_rstd^2 here (finite at a zero row) and the last
        # _rmsnorm_rstd after the sum
        c = dot.mul_(r).mul_(r).mul_(-1.0 / d)
        dx = torch.addcmul(gy, xa, c) if weight is None else torch.mul(gy, w).addcmul_(xa, c)
        dx.mul_(r)
        return dx.to(x.dtype), d_weight, None


rmsnorm = SimpleNamespace(rms_norm=_rmsnorm_rms_norm, rstd=_rmsnorm_rstd)


class _KeyScaled(torch.autograd.Function):
    """z = u _rmsnorm_rstd(v): logits u = q . v [*batch, H] times the key norm's 1 / RMS(v) [*batch, 1],
    with a one-pass backward: d _rmsnorm_rstd / dv = -_rmsnorm_rstd^3 v / d, taken as (v _rmsnorm_rstd) ((dz . z) _rmsnorm_rstd),
    not (dz . u) _rmsnorm_rstd^3 v: each factor finite for tiny and all-zero rows (_rmsnorm_rstd^3, or _rmsnorm_rstd^2
    alone, overflows fp32 at eps 1e-30: 1e45) and 0 where v's mean square overflowed (_rmsnorm_rstd =
    0 and z = 0, where dz u can overflow)."""

    @staticmethod
    def forward(ctx, u, v, eps):
        r = _rmsnorm_rstd(v, eps)
        z = u * r
        ctx.save_for_backward(v, r, z)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        v, r, z = ctx.saved_tensors
        scale = (grad * z).sum(-1, keepdim=True) * r * (-1.0 / v.shape[-1])
        return grad * r, ((v.to(r.dtype) * r) * scale).to(v.dtype), None


def _unstacked__key_scaled(u: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """u _rmsnorm_rstd(v), _rmsnorm_rstd in at least fp32 (see _KeyScaled)."""
    if torch.compiler.is_compiling():  # autograd's ops: inductor fuses them with the logits
        return u * _rmsnorm_rstd(v, eps)
    return _KeyScaled.apply(u, v, eps)


def _unstacked_source_logits(v: torch.Tensor, q: torch.Tensor, eps: float, key_norm: bool) -> torch.Tensor:
    """[*batch, H]: the logits of one source v [*batch, d] against the heads-split query q,
    [H, c] (static) or [*batch, H, c] (per token)."""
    if q.dim() == 2 and not torch.compiler.is_compiling():
        return _unstacked_logits_against(v, q.flatten()[None], eps, key_norm, q.shape[0])[0]
    # A product and a sum rather than a matmul: under torch.compile it fuses with the RMS
    # into one pass over v (a matmul-vector is an extern kernel that reads v again). Logits
    # are at least float32 whatever v's dtype: 1/RMS of a (near-)zero row is huge (restopo.nn.norm's
    # epsilon is tiny) and would overflow to inf in fp16, giving 0 * inf = NaN.
    z = (v.unflatten(-1, (q.shape[-2], -1)) * q).sum(-1, dtype=_weighted__acc(v))
    return _unstacked__key_scaled(z, v, eps) if key_norm else z


def _unstacked_query_matrix(gained_queries: torch.Tensor, heads: int) -> torch.Tensor:
    """[d, R*H]: R queries [R, d] as columns, each head's slice in its own column (zeros
    elsewhere), so `v @ _unstacked_query_matrix` is every query's per-head logit of v in one matmul."""
    R, d = gained_queries.shape
    if heads == 1:
        return gained_queries.t()
    q = gained_queries.view(R, heads, d // heads)
    eye = torch.eye(heads, dtype=q.dtype, device=q.device)
    return torch.einsum("rhc,hk->hcrk", q, eye).reshape(d, R * heads)


def _unstacked_logits_against(v: torch.Tensor, gained_queries: torch.Tensor, eps: float, key_norm: bool,
                   heads: int) -> torch.Tensor:
    """[R, *batch, H]: the logits of one source v [*batch, d] against R static queries
    [R, d] (key-norm gains folded in), in at least fp32: one pass over v for all of them.
    Query-major, so each query's logits are one contiguous piece (cheap to split and to
    gather back in backward)."""
    R = gained_queries.shape[0]
    acc = _weighted__acc(v)
    if torch.compiler.is_compiling():  # see _unstacked_source_logits: a product and a sum fuse
        q = gained_queries.unflatten(-1, (heads, -1)).view(R, *[1] * (v.dim() - 1), heads, -1)
        z = (v.unflatten(-1, (heads, -1)) * q).sum(-1, dtype=acc)
    else:  # [R*H, tokens] = W^T v^T: one matmul, its output already query-major
        w = _unstacked_query_matrix(gained_queries, heads).to(acc)  # fp32 for fp16/bf16 v: _weighted__wide
        if torch.is_grad_enabled() and (v.requires_grad or w.requires_grad):
            z = _Logits.apply(v, w, eps, key_norm)
        else:
            u, r = _unstacked__logit_parts(v, w, eps, key_norm)
            z = u if r is None else u * r
        if heads == 1:  # the same layout without a permuted view (one autograd node less)
            return z.view(R, *v.shape[:-1], 1)
        return z.view(R, heads, *v.shape[:-1]).movedim(1, -1)
    return z * _rmsnorm_rstd(v, eps) if key_norm else z  # (compiling: autograd's ops)


class _Logits(torch.autograd.Function):
    """z = (W^T v^T) * _rmsnorm_rstd(v), [R*H, tokens] in at least fp32 (_rmsnorm_rstd 1 without key norm),
    in one node whose backward writes v's gradient in place: a matmul and, with the key
    norm, one multiply-add of v (d _rmsnorm_rstd / dv = -_rmsnorm_rstd^3 v / d), into the source's shared
    gradient buffer when v is a gathered view (weighted.gathered: Full AttnRes's sources).
    Autograd's own ops wrote three d-sized tensors a source (the matmul's and two for the
    _rmsnorm_rstd's backward) and then added them to the buffer's sum, two passes more."""

    @staticmethod
    def forward(ctx, v, w, eps, key_norm):
        u, r = _unstacked__logit_parts(v, w, eps, key_norm)
        z = u if r is None else u * r
        ctx.save_for_backward(v, w, z if key_norm else None, r)
        ctx.sink = getattr(v, "restopo_sink", None)
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        v, w, z, r = ctx.saved_tensors
        v2 = v.reshape(-1, v.shape[-1])
        half = v.dtype != _weighted__acc(v)  # fp16/bf16: the products in fp32 (weighted._wide)
        du = dz * r if r is not None else dz          # [R*H, M], in w's (wide) dtype
        dw = (du @ _weighted__wide(v2)).t() if ctx.needs_input_grad[1] else None  # w is wide
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


def _unstacked__logit_parts(v, w, eps, key_norm):
    """(u = W^T v^T [R*H, tokens] in at least fp32, _rmsnorm_rstd(v) [1, tokens] or None without
    key norm): the logits are u * _rmsnorm_rstd."""
    u = w.t() @ _weighted__wide(v.reshape(-1, v.shape[-1])).t()  # w is wide already
    return u, (_rmsnorm_rstd(v, eps).view(1, -1) if key_norm else None)


def _unstacked_depth_attention(sources: Sequence[torch.Tensor], query: torch.Tensor,
                    gained_query: torch.Tensor, eps: float, *, key_norm: bool, gate: str,
                    heads: int, logits: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """h = sum_i alpha_i v_i; `gained_query` is the query with the key-norm gain folded in.
    `logits`: each source's logit [*batch, H] if already made (shared by its readers)."""
    if logits is None:
        q = gained_query.unflatten(-1, (heads, -1))
        logits = [_unstacked_source_logits(v, q, eps, key_norm) for v in sources]
    z = torch.stack(tuple(logits))                                         # [n, *batch, H]
    alpha = torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)
    return _weighted_weighted_sum(alpha, sources)


def _unstacked_phase1(completed: Sequence[torch.Tensor], gained_queries: torch.Tensor, eps: float, *,
           key_norm: bool, heads: int, logits: Sequence[torch.Tensor] | None = None):
    """Phase 1 over a list of completed blocks, in _unstacked_normalised form: (h1 [S,*b,d], lse
    [S,*b,H], (None,) * S). h1 = sum_i softmax_i(z_i) v_i is phase 1's own output and lse
    its log-sum-exp: the online-softmax state (o1, m1, s1) = (h1, lse, 1), so a block's
    first sublayer reads h1 as it is and phase 2 merges by one lerp (no division by s1
    anywhere). s1 is S Nones, so s1[slot] reads as with the other forms.
    `logits`: each block's logits [S, *batch, H] against the S queries (or their S
    [*batch, H] columns), if already made."""
    if logits is None:
        logits = [_unstacked_logits_against(v, gained_queries, eps, key_norm, heads) for v in completed]
    z = torch.stack([_unstacked_block_logits(zs) for zs in logits])  # [n, S, *batch, H]
    alpha, S = torch.softmax(z, dim=0), gained_queries.shape[0]
    return _weighted_weighted_sum(alpha, completed, outputs=S), torch.logsumexp(z, dim=0), (None,) * S


def _unstacked_block_logits(zs) -> torch.Tensor:
    """One block's given logits [S, *batch, H]: as given, or its S columns stacked."""
    return zs if isinstance(zs, torch.Tensor) else torch.stack(tuple(zs))


def _unstacked_normalised(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor | None):
    """(h1, lse): phase 1's state (o1, m1, s1) in _unstacked_normalised form, h1 = o1 / s1 (per head)
    and lse = m1 + log s1; s1 None means it already is (the eager phase 1's own output).
    depth.phase2 normalises once here, before either form of phase 2."""
    if s1 is None:
        return o1, m1
    heads = m1.shape[-1]
    h1 = (o1.unflatten(-1, (heads, -1)) / s1.unsqueeze(-1).to(o1.dtype)).flatten(-2)
    return h1, m1 + torch.log(s1)


def _unstacked_phase2(h1: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,
           gained_query: torch.Tensor, eps: float, *, key_norm: bool) -> torch.Tensor:
    """Phase 2: the pre-update partial merged into phase 1's _unstacked_normalised result (h1, its
    log-sum-exp lse) by online softmax. With two terms the softmax is a sigmoid: the
    partial's weight is w = sigmoid(z2 - lse), and h = lerp(h1, partial, w). Autograd keeps
    h1 and the partial (alive anyway) and per-token scalars."""
    if partial is None:
        return h1
    if torch.compiler.is_compiling() or h1.shape != partial.shape:
        heads = lse.shape[-1]
        z2 = _unstacked_source_logits(partial, gained_query.unflatten(-1, (heads, -1)), eps, key_norm)
        w = torch.sigmoid(z2 - lse).unsqueeze(-1)
        dtype = _weighted_out_dtype(h1, partial)
        h = torch.lerp(h1.unflatten(-1, (heads, -1)).to(dtype),
                       partial.unflatten(-1, (heads, -1)).to(dtype), w.to(dtype))
        return h.flatten(-2)
    return _Lerp.apply(h1, lse, partial, gained_query, eps, key_norm)


class _Lerp(torch.autograd.Function):
    """Phase 2 with a partial, h = lerp(h1, p, w), w = sigmoid(z2 - lse), z2 = q . p *
    _rmsnorm_rstd(p), in one node with its backward written out: autograd's ops take some twenty
    small per-token ops and nodes each way per sublayer, and pass over d-sized tensors
    more often than this does (three passes forward, eight backward)."""

    @staticmethod
    def forward(ctx, h1, lse, p, q, eps, key_norm):
        heads = lse.shape[-1]
        acc = _weighted__acc(p)
        u = _weighted__wide(p.reshape(-1, p.shape[-1])) @ _unstacked_query_matrix(q[None], heads).to(acc)
        u = u.view(lse.shape)                                     # q . p per head
        r = _rmsnorm_rstd(p, eps) if key_norm else None
        z2 = u * r if key_norm else u
        w = torch.sigmoid(z2 - lse)
        dtype = _weighted_out_dtype(h1, p)  # autograd hands each input its gradient in its own dtype
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
        wide_p = _weighted__wide(ph)  # fp16/bf16: the products below in fp32 (weighted._wide)
        scratch = torch.sub(wide_p, _weighted__wide(h1.unflatten(-1, (heads, -1))))     # p - h1
        dw = scratch.mul_(_weighted__wide(g)).sum(-1, dtype=acc)             # g . (p - h1) per head
        dz2 = dw * w * (1 - w)
        wv = w.unsqueeze(-1).to(g.dtype)
        d_h1 = g * (1 - wv)
        d_p = g * wv                                               # the value's part
        du = dz2 * r if ctx.key_norm else dz2
        d_p.addcmul_(du.unsqueeze(-1).to(g.dtype), q.unflatten(-1, (heads, -1)))  # the logit's
        if ctx.key_norm:  # through _rmsnorm_rstd: d _rmsnorm_rstd / dp = -_rmsnorm_rstd^3 p / d, and u * _rmsnorm_rstd = z2:
            # (dz2 . u) _rmsnorm_rstd^3 = (dz2 . z2) _rmsnorm_rstd^2, finite where _rmsnorm_rstd^3 overflows
            dr = (dz2 * z2).sum(-1, keepdim=True) * (r * r) * (-1.0 / p.shape[-1])
            d_p.addcmul_(ph, dr.unsqueeze(-1).to(p.dtype))
        d_q = torch.einsum("...h,...hc->hc", du.to(wide_p.dtype), wide_p).flatten().to(q.dtype)
        return d_h1.flatten(-2), -dz2, d_p.flatten(-2), d_q, None, None


unstacked = SimpleNamespace(_key_scaled=_unstacked__key_scaled, _logit_parts=_unstacked__logit_parts, block_logits=_unstacked_block_logits, depth_attention=_unstacked_depth_attention, logits_against=_unstacked_logits_against, normalised=_unstacked_normalised, phase1=_unstacked_phase1, phase2=_unstacked_phase2, query_matrix=_unstacked_query_matrix, source_logits=_unstacked_source_logits)


def _stacked__as(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """v in `dtype`, without dispatching a no-op conversion when it already is."""
    return v if v.dtype == dtype else v.to(dtype)


def _stacked_without_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd will not record: grad mode off, or no input requires grad."""
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors)


def _stacked__beside(sources) -> tuple[torch.Tensor, torch.Size]:
    """(the sources stacked next to the channels, [M, n, d] with M the batch's tokens; the
    batch shape). Every token's sources are then one matrix: its logits one matmul, its
    weighted sum one batched matmul."""
    v = (sources.movedim(0, -2) if isinstance(sources, torch.Tensor)
         else torch.stack(tuple(sources), -2))              # [*b, n, d]
    return v.reshape(-1, *v.shape[-2:]), v.shape[:-2]


def _stacked__by_head(v3: torch.Tensor, heads: int) -> torch.Tensor:
    """[M, n, d] -> [M*H, n, c]: each head's sources as a matrix (a view for one head)."""
    if heads == 1:
        return v3
    return v3.unflatten(-1, (heads, -1)).transpose(1, 2).flatten(0, 1)


def _stacked__scaled(z: torch.Tensor, v3: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """Logits z [M*H, n, k] of keys RMSNorm(v) from raw v [M, n, d]: times 1 / RMS(v_i)."""
    r = _rmsnorm_rstd(v3, eps)                                      # [M, n, 1]
    return z.mul_(r if heads == 1 else r.repeat_interleave(heads, 0))


def _stacked__loops(loops: bool | None) -> bool:
    """Contractions as products and sums (see the module's docstring): under torch.compile
    unless told."""
    return torch.compiler.is_compiling() if loops is None else loops


def _stacked_depth_attention(sources, query: torch.Tensor, gained_query: torch.Tensor, eps: float, *,
                    key_norm: bool, gate: str, heads: int,
                    loops: bool | None = None) -> torch.Tensor:
    """h = sum_i alpha_i v_i over the stacked sources; `gained_query` is [d] or [*batch, d]
    with the key-norm gain folded in."""
    v3, batch = _stacked__beside(sources)                            # [M, n, d]
    if _stacked__loops(loops):
        return _stacked__depth_attention_loops(v3, batch, gained_query, eps, key_norm, gate, heads)
    d, acc = v3.shape[-1], _weighted__acc(v3)
    vh = _stacked__by_head(v3, heads)                                # [M*H, n, c]
    q = _stacked__as(gained_query, acc)
    if q.dim() > 1:  # a query per token
        z = torch.bmm(_stacked__as(vh, acc), q.reshape(vh.shape[0], -1, 1))
    elif heads == 1:  # one static query: one matrix-vector product
        z = (_stacked__as(vh, acc) @ q).unsqueeze(-1)
    else:
        z = (_stacked__as(vh, acc).unflatten(0, (-1, heads)) @ q.view(heads, -1, 1)).flatten(0, 1)
    if key_norm:                                            # z: [M*H, n, 1]
        z = _stacked__scaled(z, v3, eps, heads)
    alpha = torch.softmax(z, dim=1) if gate == "softmax" else torch.sigmoid(z)
    return torch.bmm(_stacked__as(alpha, v3.dtype).mT, vh).view(*batch, d)


def _stacked__depth_attention_loops(v3, batch, gained_query, eps, key_norm, gate, heads):
    """_stacked_depth_attention with products and sums for its two contractions."""
    M, n, d = v3.shape
    acc = _weighted__acc(v3)
    v4 = v3.unflatten(-1, (heads, -1))                      # [M, n, H, c]
    q = _stacked__as(gained_query, acc).unflatten(-1, (heads, -1))   # [H, c] or [*b, H, c]
    q = q.reshape(M, 1, heads, -1) if q.dim() > 2 else q    # a query per token
    z = (_stacked__as(v4, acc) * q).sum(-1)                          # [M, n, H]
    if key_norm:
        z = z * _rmsnorm_rstd(v3, eps)
    alpha = torch.softmax(z, dim=1) if gate == "softmax" else torch.sigmoid(z)
    h = (_stacked__as(alpha, v3.dtype).unsqueeze(-1) * v4).sum(1)    # [M, H, c]
    return h.view(*batch, d)


def _stacked_phase1(completed, gained_queries: torch.Tensor, eps: float, *, key_norm: bool,
           heads: int, loops: bool | None = None):
    """Phase 1 over the stacked completed blocks, normalised as unstacked.phase1's:
    (h1 [S,*b,d], lse [S,*b,H], (None,) * S). The division by s1 happens once here, on the
    [tokens, n, S] weights, rather than on each member's d-sized output in phase 2."""
    v3, batch = _stacked__beside(completed)                          # [M, n, d]
    if _stacked__loops(loops):
        return _stacked__phase1_loops(v3, batch, gained_queries, eps, key_norm, heads)
    S, acc = gained_queries.shape[0], _weighted__acc(v3)
    vh = _stacked__by_head(v3, heads)                                # [M*H, n, c]
    q = _stacked__as(gained_queries.view(S, heads, -1).permute(1, 2, 0), acc)  # [H, c, S]
    if heads == 1:
        z = _stacked__as(vh, acc) @ q[0]                             # [M, n, S]: one mm
    else:
        z = (_stacked__as(vh, acc).unflatten(0, (-1, heads)) @ q).flatten(0, 1)  # [M*H, n, S]
    if key_norm:
        z = _stacked__scaled(z, v3, eps, heads)
    # The softmax over the sources and its log-sum-exp, in place (torch.logsumexp is a
    # composite of some nine ops, and the softmax would be two more).
    m = z.amax(1, keepdim=True)                             # [M*H, 1, S]
    e = z.sub_(m).exp_()
    s = e.sum(1, keepdim=True)
    h1 = torch.bmm(_stacked__as(e.div_(s), v3.dtype).mT, vh)         # [M*H, S, c]: normalised
    lse = s.log_().add_(m)

    def by_query(x):  # [M*H, S, c] -> [S, *b, H * c]: a transpose and a view for one head
        if heads == 1:
            return x.transpose(0, 1).view(S, *batch, x.shape[-1])
        x = x.unflatten(0, (-1, heads)).permute(2, 0, 1, 3)  # [S, M, H, c]
        return x.reshape(S, *batch, -1)

    return by_query(h1), by_query(lse.mT), (None,) * S


def _stacked__phase1_loops(v3, batch, gained_queries, eps, key_norm, heads):
    """_stacked_phase1 with products and sums for its two contractions."""
    S, acc = gained_queries.shape[0], _weighted__acc(v3)
    v5 = v3.unflatten(-1, (heads, -1)).unsqueeze(2)         # [M, n, 1, H, c]
    q = _stacked__as(gained_queries, acc).view(S, heads, -1)         # [S, H, c]
    z = (_stacked__as(v5, acc) * q).sum(-1)                          # [M, n, S, H]
    if key_norm:
        z = z * _rmsnorm_rstd(v3, eps).unsqueeze(-1)
    lse = torch.logsumexp(z, 1)                             # [M, S, H]
    e = torch.exp(z - lse.unsqueeze(1))                     # [M, n, S, H]: normalised
    h1 = (_stacked__as(e, v3.dtype).unsqueeze(-1) * v5).sum(1)       # [M, S, H, c]

    def by_query(x):  # [M, S, ...] -> [S, *b, ...]
        return x.movedim(1, 0).unflatten(1, batch)

    return by_query(h1.flatten(-2)), by_query(lse), (None,) * S


def _stacked_phase2(h1: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor | None,
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
    p = _stacked__as(partial, _weighted__acc(partial))
    if split:
        z2 = (by_head(p) * by_head(gained_query)).sum(-1)
    else:
        z2 = (p @ _stacked__as(gained_query, p.dtype)).unsqueeze(-1)
    if key_norm:
        z2 = z2.mul_(_rmsnorm_rstd(p, eps))
    dtype = _weighted_out_dtype(h1, partial)
    w = _stacked__as(torch.sigmoid_(z2.sub_(lse)), dtype)
    h = torch.lerp(by_head(_stacked__as(h1, dtype)), by_head(_stacked__as(partial, dtype)), per_head(w))
    return h.flatten(-2) if split else h


stacked = SimpleNamespace(_as=_stacked__as, _beside=_stacked__beside, _by_head=_stacked__by_head, _depth_attention_loops=_stacked__depth_attention_loops, _loops=_stacked__loops, _phase1_loops=_stacked__phase1_loops, _scaled=_stacked__scaled, depth_attention=_stacked_depth_attention, phase1=_stacked_phase1, phase2=_stacked_phase2, without_grad=_stacked_without_grad)


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


class ops:
    """restopo.ops with its eager backend only (`backend=` is accepted and ignored)."""

    @staticmethod
    def depth_attention(*args, backend=None, **kwargs):
        return depth_attention(*args, **kwargs)

    @staticmethod
    def phase1(*args, backend=None, **kwargs):
        return phase1(*args, **kwargs)

    @staticmethod
    def phase2(*args, backend=None, **kwargs):
        return phase2(*args, **kwargs)

    @staticmethod
    def depth_weights(*args, **kwargs):
        return depth_weights(*args, **kwargs)

    @staticmethod
    def cpu_kernels(backend, device, dtype):  # no fused kernels here: compile every region
        return False

    # calls bound once per parameter version (restopo.ops.bind_*): here the plain calls
    @staticmethod
    def bind_phase1(*args, backend=None, norm_weight=None, norm_eps=None, **kwargs):
        # no first PreNorm to make here: only restopo's lowering fuses one into phase 1
        # (TwoPhase.fuse_first_norm), and this file's forward was written without it
        assert norm_eps is None, "a standalone TwoPhase has no first_norm"
        return lambda completed: phase1(completed, *args, **kwargs)

    @staticmethod
    def bind_depth_attention(*args, backend=None, **kwargs):
        return lambda sources: depth_attention(sources, *args, **kwargs)

    @staticmethod
    def bind_phase2(query, key_norm_weight, eps, *, norm_weight, norm_eps, key_norm, keep_h,
                    backend=None):
        if norm_eps is None:
            return lambda o1, m1, s1, partial: phase2(o1, m1, s1, partial, query,
                                                      key_norm_weight, eps, key_norm=key_norm)
        return lambda o1, m1, s1, partial: phase2_norm(
            o1, m1, s1, partial, query, key_norm_weight, eps, norm_weight=norm_weight,
            norm_eps=norm_eps, key_norm=key_norm, keep_h=keep_h)

    @staticmethod
    def rms_norm(*args, **kwargs):
        return rmsnorm.rms_norm(*args, **kwargs)

# ---- sublayers (restopo.nn.sublayers)

class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters, state_dict and maths) whose training step on the CPU
    runs restopo.ops.rms_norm: its backward written out, where torch's forms it from
    autograd's ops at several times the cost (the PreNorm of every sublayer, in every
    topology, and the final norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return ops.rms_norm(x, self.weight, self.eps)


def check_batched(idx: torch.Tensor) -> None:
    """Token ids come as [batch, T]: one sequence [T] is refused, not read as a batch of T
    sequences of one token (or an IndexError deep inside a model)."""
    if idx.dim() != 2:
        raise ValueError(f"the model takes token ids [batch, T]; got shape "
                         f"{tuple(idx.shape)} (one sequence: ids[None])")


def token_ids_in(idx: torch.Tensor, vocab: int) -> None:
    """Token ids outside the vocabulary are named (a ValueError), not an IndexError inside
    the embedding, or a CUDA device assert that spoils the process. Reads the ids back: on
    CUDA a wait for the GPU."""
    if idx.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(idx)).tolist()  # one read back, not two
    if low < 0 or high >= vocab:
        raise ValueError(f"token id {low if low < 0 else high}, outside the model's "
                         f"vocabulary 0..{vocab - 1}")


def check_token_ids(idx: torch.Tensor, vocab: int) -> None:
    """token_ids_in, in a model's forward, eager or compiled, where reading the ids costs
    nothing: on the CPU, or where autograd does not record (inference, evaluation). A CUDA
    training step's forward would wait for the GPU at its start; training data are checked
    once, when the corpus opens (restopo.train.data)."""
    if idx.device.type == "cpu" or not torch.is_grad_enabled():
        token_ids_in_eager(idx, vocab)


class TokenEmbedding(nn.Embedding):
    """nn.Embedding (the same parameter and state_dict) that refuses token ids outside
    its vocabulary in words (check_token_ids)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_token_ids(idx, self.num_embeddings)
        return super().forward(idx)


class Rotary(nn.Module):
    """The Parts `context`: rotary cos/sin for the sequence length of `idx`.

    Tables are precomputed for `context` positions (buffers, not saved in state_dict),
    from float64 angles, in float32; a module moved to float64 makes them again in float64
    (`_apply`), since float32's rounding (3e-8) cast up would stay in a float64 model.
    Rotation pairs channel i with channel i + head_dim/2 (the rotate-half convention).
    """

    def __init__(self, head_dim: int, context: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head size; got {head_dim} "
                             f"(choose width and heads with an even width/heads)")
        self.context, self.head_dim, self.base = context, head_dim, base
        cos, sin = self._tables(torch.float32)  # on the default device (meta: no data)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, dtype: torch.dtype, device: torch.device | None = None):
        """cos, sin [context, head_dim] in `dtype`, from angles made in float64."""
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = 1.0 / self.base ** (half / self.head_dim)
        positions = torch.arange(self.context, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype == torch.float64 and self.cos.device.type != "meta":
            self.cos, self.sin = self._tables(torch.float64, self.cos.device)
        return self

    def forward(self, idx: torch.Tensor, v0: torch.Tensor):
        check_batched(idx)
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"sequence length {T} is longer than the model's context "
                             f"{self.context}; crop the input or raise model.context")
        return self._in(self.cos[:T], self.sin[:T], v0.dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin [T, head_dim] of the given positions (decoding: the offset ones)."""
        return self._in(self.cos.index_select(0, positions),
                        self.sin.index_select(0, positions), dtype)

    @staticmethod
    def _in(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        """The tables in `dtype`, with no conversion when they already are (a no-op .to
        is still a dispatch under inference mode)."""
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """The keys and values one attention sublayer has seen, preallocated for `length`
    positions ([batch, heads, length, head_dim] each).

    `positions` ([T] long, shared by every layer's cache: the tokens of the current step)
    and `end` (how many positions are filled after this step; None: attend over all
    `length`, masked, so shapes stay fixed under torch.compile) are set by the decoder.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, length: int, *,
                 dtype: torch.dtype, device, step):
        shape = (batch, heads, length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.step = step  # the decoder's shared step state: .positions and .end

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Store this step's k, v [B, heads, T, hd]; the keys, values and the causal mask
        [T, S] (key position <= query position) to attend with."""
        positions, end = self.step.positions, self.step.end
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        keys, values = (self.k, self.v) if end is None else (self.k[:, :, :end],
                                                              self.v[:, :, :end])
        key_pos = torch.arange(keys.shape[2], device=keys.device)
        return keys, values, key_pos <= positions[:, None]


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions; PreNorm inside. With a
    `cache` (KVCache, decoding) the step's keys and values are stored there and the queries
    attend over every position seen so far."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        if d % heads:
            raise ValueError(f"heads must divide the width: width {d}, heads {heads}")
        self.heads = heads
        self.norm = RMSNorm(d, eps=NORM_EPS)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, *, normed: bool = False) -> torch.Tensor:
        B, T, d = h.shape
        x = h if normed else self.norm(h)
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v, mask = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


def swiglu_hidden(d: int, ratio: float) -> int:
    """SwiGLU has three matrices, so its hidden size is 2/3 of ratio*d (the same parameter
    count as a two-matrix MLP of ratio*d), rounded up to a multiple of 8."""
    return 8 * math.ceil(2 * ratio * d / 3 / 8)


def mlp_hidden(d: int, kind: str, ratio: float) -> int:
    """The hidden width of restopo.nn.sublayers.MLP: SwiGLU's, or GELU's ratio x d."""
    return swiglu_hidden(d, ratio) if kind == "swiglu" else int(round(ratio * d))


class MLP(nn.Module):
    """Feed-forward sublayer, `swiglu` (silu(W1 x) * W3 x) or `gelu`; PreNorm inside.
    `*context` is accepted and ignored so every sublayer has one call signature."""

    def __init__(self, d: int, kind: str = "swiglu", ratio: float = 4.0):
        super().__init__()
        if kind not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be 'swiglu' or 'gelu'; got {kind!r}")
        self.kind = kind
        self.norm = RMSNorm(d, eps=NORM_EPS)
        hidden = mlp_hidden(d, kind, ratio)
        self.up = nn.Linear(d, 2 * hidden if kind == "swiglu" else hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, h: torch.Tensor, *context: torch.Tensor, normed: bool = False
                ) -> torch.Tensor:
        x = self.up(h if normed else self.norm(h))
        if self.kind == "swiglu":
            gate, value = x.chunk(2, dim=-1)
            x = F.silu(gate) * value
        else:
            x = F.gelu(x)
        return self.down(x)


class Head(nn.Module):
    """Final RMSNorm and LM head: h_{L+1} -> logits."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = RMSNorm(d, eps=NORM_EPS)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def token_ids_in_eager(idx: torch.Tensor, vocab: int) -> None:
    """token_ids_in outside torch.compile: a compiled forward leaves the check out."""
    if not torch.compiler.is_compiling():
        token_ids_in(idx, vocab)


# ---- aggregation modules (restopo.nn.aggregate)

FIXED_FOR = [None]  # no decoding sequence here (restopo.decode)


def own(module: nn.Module, name: str):
    """The parameter (or submodule) `name` of `module`, read from its own dict: a plain
    `module.name` goes through nn.Module.__getattr__, about a microsecond a lookup, and a
    decoding step's aggregation points read a dozen each (it was most of the Python time of
    a phase 1 there). Anything not in those dicts is read as an attribute."""
    got = module._parameters.get(name)
    if got is None:
        got = module._modules.get(name)
    return getattr(module, name) if got is None else got


def derived(owner: nn.Module, params: tuple[torch.Tensor, ...], make, slot: str = "derived"):
    """make(), kept on `owner` (in its Kept, under `slot`) while `params` are unchanged,
    for calls autograd does not record (decoding, evaluation). There, remaking a
    pseudo-query's gained form at every aggregation point of every step is pure dispatch
    cost. The key is each parameter's storage, dtype, device and version (bumped by every
    in-place update: an optimizer step, load_state_dict), so a changed parameter is never
    served a stale value; within a decoding sequence (FIXED_FOR) it is checked at the
    sequence's first step only (touching every parameter's storage and version counter
    costs more than the kernel there, once the step's matmuls have pushed them out of the
    caches)."""
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return make()
    cache = owner.__dict__.get("_kept")
    if cache is None:
        cache = owner.__dict__["_kept"] = Kept()
    kept, sequence = cache.get(slot), FIXED_FOR[0]
    if kept is not None and sequence is not None and kept[2] is sequence:
        return kept[1]
    key = tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in params)
    if kept is None or kept[0] != key:
        kept = (key, make(), sequence)
    cache[slot] = (kept[0], kept[1], sequence)
    return kept[1]


def trusted(owner: nn.Module, slot: str):
    """What derived() keeps on `owner` under `slot` when it was checked in the decoding
    sequence now running (FIXED_FOR), else None: a step after the sequence's first then
    skips even gathering the parameters a check would read."""
    sequence = FIXED_FOR[0]
    cache = None if sequence is None else owner.__dict__.get("_kept")
    kept = None if cache is None else cache.get(slot)
    return kept[1] if kept is not None and kept[2] is sequence else None


class Kept(dict):
    """What derived() keeps on a module, by slot: a cache, so a copy or a pickle of the
    module (copy.deepcopy, torch.save) starts with an empty one; what it holds (bound
    kernel calls, closures) can be neither copied nor pickled."""

    def __reduce__(self):
        return Kept, ()


def unrecorded() -> bool:
    """True for calls autograd does not record and dynamo does not trace (eager decoding,
    evaluation): there the aggregation modules run kernel calls bound once per parameter
    version (ops.bind_*), where a one-token step's cost is mostly the call path."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class Attend(nn.Module):
    """AttnRes depth attention: h = sum_i alpha_i v_i, alpha from pseudo_query . RMSNorm(v_i).

    `pseudo_query` starts at zero, so a fresh model takes the plain mean of the sources
    (softmax gate). With `query="input_dependent"` the query is
    `pseudo_query + W(rmsnorm(newest source))` per token; W starts at zero, so at
    initialisation it equals the static query and only learns to depart from it.
    """

    def __init__(self, d: int, query: str = "static", gate: str = "softmax",
                 key_norm: str = "rms", heads: int = 1, backend: str = "auto"):
        super().__init__()
        if d % heads:
            raise ValueError(f"depth heads must divide the width: width {d}, heads {heads}")
        self.d, self.query, self.gate, self.heads, self.backend = d, query, gate, heads, backend
        self.pseudo_query = nn.Parameter(torch.zeros(d))
        self.key_norm = nn.RMSNorm(d, eps=EPS) if key_norm == "rms" else None
        self.query_proj = None
        if query == "input_dependent":
            self.query_proj = nn.Linear(d, d, bias=False)
            nn.init.zeros_(self.query_proj.weight)

    @property
    def gain(self) -> torch.Tensor | None:
        return None if self.key_norm is None else self.key_norm.weight

    def forward(self, *sources: torch.Tensor, phase1=None, slot: int = 0,
                norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None, logits=None) -> torch.Tensor:
        """`logits`: each source's logit, already made (restopo.nn.shared_sources)."""
        if phase1 is not None:
            return self.merge(phase1, slot, sources[0] if sources else None, norm_weight,
                              norm_eps)
        if (self.query_proj is None and self.gate == "softmax" and logits is None
                and unrecorded()):
            return self._bound("attend", (), lambda q, gain, key_norm:
                               ops.bind_depth_attention(q, gain, EPS, key_norm=key_norm,
                                                        heads=self.heads,
                                                        backend=self.backend))(sources)
        q, gain = self._static() if self.query_proj is None else (self._query(sources),
                                                                   self.gain)
        # A tuple, not a stack: the eager backend then saves no copy of the sources.
        return ops.depth_attention(sources, q, gain, EPS,
                                   key_norm=self.key_norm is not None, gate=self.gate,
                                   heads=self.heads, backend=self.backend, logits=logits)

    def runs_kernels(self, device, dtype) -> bool:
        """Whether this module's calls (uncompiled) run the cpu backend's fused C kernels:
        regional compilation then leaves it uncompiled (restopo.train.compile)."""
        return (self.query_proj is None and self.gate == "softmax"
                and ops.cpu_kernels(self.backend, device, dtype))

    def _query(self, sources) -> torch.Tensor:
        q = self.pseudo_query
        if self.query_proj is not None:
            q = q + self.query_proj(F.rms_norm(sources[-1], (self.d,), eps=EPS))
        return q

    def _bound(self, slot: str, extra: tuple, bind):
        """bind(pseudo_query, key-norm gain or None, key_norm), kept under `slot` while those
        and the `extra` tensors it binds are unchanged (see derived)."""
        got = trusted(self, slot)
        if got is not None:
            return got
        q, norm = own(self, "pseudo_query"), own(self, "key_norm")
        gain = None if norm is None else own(norm, "weight")
        params = (q,) + extra if gain is None else (q, gain) + extra
        return derived(self, params, lambda: bind(q, gain, norm is not None), slot)

    def _static(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the pseudo-query, the key-norm gain); without autograd, the gain folded into
        the query once while both are unchanged (the backends fold it per call otherwise)."""
        q, norm = own(self, "pseudo_query"), own(self, "key_norm")
        gain = None if norm is None else own(norm, "weight")
        if gain is None or torch.is_grad_enabled():
            return q, gain
        return derived(self, (q, gain), lambda: q * gain), None

    def depth_weights(self, *sources: torch.Tensor) -> torch.Tensor:
        """alpha [n, *batch, heads]: the weight of each source (for diagnostics); the
        output is sum_i alpha_i v_i with each head's weight over its channel slice."""
        return ops.depth_weights(sources, self._query(sources), self.gain, EPS,
                                 key_norm=self.key_norm is not None, gate=self.gate,
                                 heads=self.heads)

    def input_weights(self, *sources: torch.Tensor) -> list[torch.Tensor]:
        alpha = self.depth_weights(*sources)
        return list(alpha.repeat_interleave(self.d // self.heads, dim=-1))

    def merge(self, phase1, slot: int, partial: torch.Tensor | None,
              norm_weight: torch.Tensor | None = None,
              norm_eps: float | None = None) -> torch.Tensor:
        """Phase 2: this member's slice of its group's phase-1 result merged with its
        pre-update partial (None for the first sublayer of a block). With `norm_eps`, the
        next sublayer's PreNorm (gain `norm_weight`) in the same op: returns RMSNorm(h),
        the sublayer's normalised input, not h."""
        o1, m1, s1 = phase1[:3]
        if len(phase1) > 3 and partial is None and slot == 0:
            y0, gain, eps = phase1[3]  # phase 1 made this PreNorm (TwoPhase.fuse_first_norm)
            if gain is norm_weight and eps == norm_eps:
                return y0
        if unrecorded():
            extra = () if norm_weight is None else (norm_weight,)
            call = self._bound("merge", extra, lambda q, gain, key_norm: ops.bind_phase2(
                q, gain, EPS, norm_weight=norm_weight, norm_eps=norm_eps, key_norm=key_norm,
                keep_h=False, backend=self.backend))
            got = call(o1[slot], m1[slot], s1[slot], partial)
            return got if norm_eps is None else got[1]
        q, gain = self._static()
        args = (o1[slot], m1[slot], s1[slot], partial, q, gain, EPS)
        key_norm = own(self, "key_norm") is not None
        if norm_eps is None:
            return ops.phase2(*args, key_norm=key_norm, backend=self.backend)
        return ops.phase2_norm(*args, norm_weight=norm_weight, norm_eps=norm_eps,
                               key_norm=key_norm, keep_h=False, backend=self.backend)[1]

    def extra_repr(self) -> str:
        return f"d={self.d}, query={self.query}, gate={self.gate}, heads={self.heads}"


class RestopoModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = TokenEmbedding(256, 64)
        self.context = Rotary(16, 128)
        self.sublayers = nn.ModuleList([
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
            Attention(64, 4),
            MLP(64, 'swiglu', 4.0),
        ])
        self.aggregations = nn.ModuleList([
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'input_dependent', 'softmax', 'rms', 1),
            Attend(64, 'static', 'softmax', 'none', 1),
        ])
        self.phases = nn.ModuleList()
        self.head = Head(64, 256)
        self.head.lm_head.weight = self.embed.weight  # tied

    def forward(self, idx):
        embedding = self.embed(idx)
        context = self.context(idx, embedding);  idx = None
        cos = context[0]
        sin = context[1];  context = None
        h1 = getattr(self.aggregations, "0")(embedding)
        sublayer1 = getattr(self.sublayers, "0")(h1, cos, sin);  h1 = None
        h2 = getattr(self.aggregations, "1")(embedding, sublayer1)
        sublayer2 = getattr(self.sublayers, "1")(h2, cos, sin);  h2 = None
        partial1_3 = sublayer1 + sublayer2;  sublayer1 = sublayer2 = None
        h3 = getattr(self.aggregations, "2")(embedding, partial1_3)
        sublayer3 = getattr(self.sublayers, "2")(h3, cos, sin);  h3 = None
        partial1_4 = partial1_3 + sublayer3;  partial1_3 = sublayer3 = None
        h4 = getattr(self.aggregations, "3")(embedding, partial1_4)
        sublayer4 = getattr(self.sublayers, "3")(h4, cos, sin);  h4 = None
        block1 = partial1_4 + sublayer4;  partial1_4 = sublayer4 = None
        h5 = getattr(self.aggregations, "4")(embedding, block1)
        sublayer5 = getattr(self.sublayers, "4")(h5, cos, sin);  h5 = None
        h6 = getattr(self.aggregations, "5")(embedding, block1, sublayer5)
        sublayer6 = getattr(self.sublayers, "5")(h6, cos, sin);  h6 = None
        partial2_3 = sublayer5 + sublayer6;  sublayer5 = sublayer6 = None
        h7 = getattr(self.aggregations, "6")(embedding, block1, partial2_3)
        sublayer7 = getattr(self.sublayers, "6")(h7, cos, sin);  h7 = None
        partial2_4 = partial2_3 + sublayer7;  partial2_3 = sublayer7 = None
        h8 = getattr(self.aggregations, "7")(embedding, block1, partial2_4)
        sublayer8 = getattr(self.sublayers, "7")(h8, cos, sin);  h8 = None
        block2 = partial2_4 + sublayer8;  partial2_4 = sublayer8 = None
        h9 = getattr(self.aggregations, "8")(embedding, block1, block2)
        sublayer9 = getattr(self.sublayers, "8")(h9, cos, sin);  h9 = None
        h10 = getattr(self.aggregations, "9")(embedding, block1, block2, sublayer9)
        sublayer10 = getattr(self.sublayers, "9")(h10, cos, sin);  h10 = None
        partial3_3 = sublayer9 + sublayer10;  sublayer9 = sublayer10 = None
        h11 = getattr(self.aggregations, "10")(embedding, block1, block2, partial3_3)
        sublayer11 = getattr(self.sublayers, "10")(h11, cos, sin);  h11 = None
        partial3_4 = partial3_3 + sublayer11;  partial3_3 = sublayer11 = None
        h12 = getattr(self.aggregations, "11")(embedding, block1, block2, partial3_4)
        sublayer12 = getattr(self.sublayers, "11")(h12, cos, sin);  h12 = None
        block3 = partial3_4 + sublayer12;  partial3_4 = sublayer12 = None
        h13 = getattr(self.aggregations, "12")(embedding, block1, block2, block3)
        sublayer13 = getattr(self.sublayers, "12")(h13, cos, sin);  h13 = None
        h14 = getattr(self.aggregations, "13")(embedding, block1, block2, block3, sublayer13)
        sublayer14 = getattr(self.sublayers, "13")(h14, cos, sin);  h14 = None
        partial4_3 = sublayer13 + sublayer14;  sublayer13 = sublayer14 = None
        h15 = getattr(self.aggregations, "14")(embedding, block1, block2, block3, partial4_3)
        sublayer15 = getattr(self.sublayers, "14")(h15, cos, sin);  h15 = None
        partial4_4 = partial4_3 + sublayer15;  partial4_3 = sublayer15 = None
        h16 = getattr(self.aggregations, "15")(embedding, block1, block2, block3, partial4_4)
        sublayer16 = getattr(self.sublayers, "15")(h16, cos, sin);  h16 = None
        block4 = partial4_4 + sublayer16;  partial4_4 = sublayer16 = None
        h17 = getattr(self.aggregations, "16")(embedding, block1, block2, block3, block4)
        sublayer17 = getattr(self.sublayers, "16")(h17, cos, sin);  h17 = None
        h18 = getattr(self.aggregations, "17")(embedding, block1, block2, block3, block4, sublayer17)
        sublayer18 = getattr(self.sublayers, "17")(h18, cos, sin);  h18 = None
        partial5_3 = sublayer17 + sublayer18;  sublayer17 = sublayer18 = None
        h19 = getattr(self.aggregations, "18")(embedding, block1, block2, block3, block4, partial5_3)
        sublayer19 = getattr(self.sublayers, "18")(h19, cos, sin);  h19 = None
        partial5_4 = partial5_3 + sublayer19;  partial5_3 = sublayer19 = None
        h20 = getattr(self.aggregations, "19")(embedding, block1, block2, block3, block4, partial5_4)
        sublayer20 = getattr(self.sublayers, "19")(h20, cos, sin);  h20 = None
        block5 = partial5_4 + sublayer20;  partial5_4 = sublayer20 = None
        h21 = getattr(self.aggregations, "20")(embedding, block1, block2, block3, block4, block5)
        sublayer21 = getattr(self.sublayers, "20")(h21, cos, sin);  h21 = None
        h22 = getattr(self.aggregations, "21")(embedding, block1, block2, block3, block4, block5, sublayer21)
        sublayer22 = getattr(self.sublayers, "21")(h22, cos, sin);  h22 = None
        partial6_3 = sublayer21 + sublayer22;  sublayer21 = sublayer22 = None
        h23 = getattr(self.aggregations, "22")(embedding, block1, block2, block3, block4, block5, partial6_3)
        sublayer23 = getattr(self.sublayers, "22")(h23, cos, sin);  h23 = None
        partial6_4 = partial6_3 + sublayer23;  partial6_3 = sublayer23 = None
        h24 = getattr(self.aggregations, "23")(embedding, block1, block2, block3, block4, block5, partial6_4)
        sublayer24 = getattr(self.sublayers, "23")(h24, cos, sin);  h24 = None
        block6 = partial6_4 + sublayer24;  partial6_4 = sublayer24 = None
        h25 = getattr(self.aggregations, "24")(embedding, block1, block2, block3, block4, block5, block6)
        sublayer25 = getattr(self.sublayers, "24")(h25, cos, sin);  h25 = None
        h26 = getattr(self.aggregations, "25")(embedding, block1, block2, block3, block4, block5, block6, sublayer25)
        sublayer26 = getattr(self.sublayers, "25")(h26, cos, sin);  h26 = None
        partial7_3 = sublayer25 + sublayer26;  sublayer25 = sublayer26 = None
        h27 = getattr(self.aggregations, "26")(embedding, block1, block2, block3, block4, block5, block6, partial7_3)
        sublayer27 = getattr(self.sublayers, "26")(h27, cos, sin);  h27 = None
        partial7_4 = partial7_3 + sublayer27;  partial7_3 = sublayer27 = None
        h28 = getattr(self.aggregations, "27")(embedding, block1, block2, block3, block4, block5, block6, partial7_4)
        sublayer28 = getattr(self.sublayers, "27")(h28, cos, sin);  h28 = None
        block7 = partial7_4 + sublayer28;  partial7_4 = sublayer28 = None
        h29 = getattr(self.aggregations, "28")(embedding, block1, block2, block3, block4, block5, block6, block7)
        sublayer29 = getattr(self.sublayers, "28")(h29, cos, sin);  h29 = None
        h30 = getattr(self.aggregations, "29")(embedding, block1, block2, block3, block4, block5, block6, block7, sublayer29)
        sublayer30 = getattr(self.sublayers, "29")(h30, cos, sin);  h30 = None
        partial8_3 = sublayer29 + sublayer30;  sublayer29 = sublayer30 = None
        h31 = getattr(self.aggregations, "30")(embedding, block1, block2, block3, block4, block5, block6, block7, partial8_3)
        sublayer31 = getattr(self.sublayers, "30")(h31, cos, sin);  h31 = None
        partial8_4 = partial8_3 + sublayer31;  partial8_3 = sublayer31 = None
        h32 = getattr(self.aggregations, "31")(embedding, block1, block2, block3, block4, block5, block6, block7, partial8_4)
        sublayer32 = getattr(self.sublayers, "31")(h32, cos, sin);  h32 = cos = sin = None
        block8 = partial8_4 + sublayer32;  partial8_4 = sublayer32 = None
        h33 = getattr(self.aggregations, "32")(embedding, block1, block2, block3, block4, block5, block6, block7, block8);  embedding = block1 = block2 = block3 = block4 = block5 = block6 = block7 = block8 = None
        logits = self.head(h33);  h33 = None
        return logits


def build():
    """The model (PyTorch's default initialisation; load trained weights strictly)."""
    return RestopoModel()
