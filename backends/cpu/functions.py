"""Autograd around the C kernels (kernels.c): phase 1 (and depth attention, its one-query
case), phase 2 fused with the next sublayer's PreNorm, and the softmax over given logits
with the weighted sum by it (AttendGiven: Full AttnRes's readers, given shared logits).

Each call hands the kernels raw addresses of contiguous float32 or float64 tensors and the
thread count torch uses (torch.get_num_threads()). Autograd keeps the sources, phase 2's
h1 and partial (all alive anyway) and per-token scalars: phase 1's logits, the sources'
rstd and lse, phase 2's weight w and its norm's rstd, the weighted sum's weights. Phase
1's backward makes the weights from its logits and lse in the same pass that reads the
sources for their gradient. Without autograd (`phase1_nograd`, `phase2_nograd`,
`weighted_sum_nograd`) the same forward call keeps nothing.
"""
from __future__ import annotations

import ctypes

import torch

from .build import library

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptrs(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[_ptr(t) for t in tensors])


def _kernel(name: str, dtype: torch.dtype):
    return getattr(library(), f"{name}_{_SUFFIX[dtype]}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rows_of(t: torch.Tensor, count: int) -> ctypes.Array:
    """The addresses of the `count` equal slices of contiguous `t` along its first dim."""
    step = t.stride(0) * t.element_size()
    return (ctypes.c_void_p * count)(*range(t.data_ptr(), t.data_ptr() + count * step, step))


def _phase1_forward(q, eps, key_norm, heads, src, h1_rows, lse_rows, z=None, r=None):
    """Phase 1's forward kernel into the S rows of h1 and of lse (their addresses); the
    logits z [M, n, S*H] and rstds r [M, n] are written where given (for the backward)."""
    S, d = q.shape
    _kernel("phase1_fwd", q.dtype)(len(src), _ptrs(src), S, src[0].numel() // d, d, heads,
                                   q.data_ptr(), eps, int(key_norm), h1_rows, lse_rows,
                                   _ptr(z), _ptr(r), None, 0.0, None, torch.get_num_threads())


def phase1_nograd(queries, eps, key_norm, heads, sources):
    """(h1 [S, *b, d], lse [S, *b, H]) without autograd: one call, nothing kept."""
    src = [_rows(v) for v in sources]
    q = _rows(queries)
    S = q.shape[0]
    h1 = src[0].new_empty((S, *src[0].shape))
    lse = src[0].new_empty((S, *src[0].shape[:-1], heads))
    _phase1_forward(q, eps, key_norm, heads, src, _rows_of(h1, S), _rows_of(lse, S))
    return h1, lse


def _phase2_forward(h1, lse, p, q, g, eps, key_norm, norm_eps, keep_h, keep: bool):
    """Phase 2's forward kernel: (h or None, y or None, w, rstd2), contiguous inputs as
    given; w [*b, H] and the norm's rstd2 [M] only where `keep` (for the backward)."""
    d = p.shape[-1]
    M = p.numel() // d
    with_norm = norm_eps is not None
    h = torch.empty_like(p) if keep_h or not with_norm else None
    y = torch.empty_like(p) if with_norm else None
    w = lse.new_empty(lse.shape) if keep else None
    rstd2 = p.new_empty(M) if keep and with_norm else None
    _kernel("phase2_fwd", p.dtype)(M, d, lse.shape[-1], h1.data_ptr(), lse.data_ptr(),
                                   p.data_ptr(), q.data_ptr(), eps, int(key_norm), _ptr(g),
                                   norm_eps if with_norm else 0.0, _ptr(h), _ptr(y), _ptr(w),
                                   _ptr(rstd2), torch.get_num_threads())
    return h, y, w, rstd2


def phase2_nograd(h1, lse, p, q, g, eps, key_norm, norm_eps, keep_h):
    """(h or None, y or None) without autograd (see Phase2)."""
    g = None if g is None else _rows(g)
    return _phase2_forward(_rows(h1), _rows(lse), _rows(p), _rows(q), g, eps, key_norm,
                           norm_eps, keep_h, keep=False)[:2]


def _gradient_buffers(src, wanted, sinks):
    """(where the kernel writes each source's gradient, whether it adds there, whether that
    buffer is the source's shared one (restopo.nn.shared_sources), so autograd gets None).
    A shared sum that is not row-major is not written: that part goes back to autograd."""
    bufs, add, sunk = [], (ctypes.c_int * len(src))(), []
    for i, (v, w, sink) in enumerate(zip(src, wanted, sinks)):
        buf = None
        if sink is not None and w:
            buf, add[i] = sink.buffer(v)
        sunk.append(buf is not None)
        if buf is None and w:
            buf = torch.empty_like(v, memory_format=torch.contiguous_format)
        bufs.append(buf)
    return bufs, add, sunk


class Phase1(torch.autograd.Function):
    """(h1_1..h1_S, lse_1..lse_S): S queries [S, d] (key-norm gains folded in) over n
    sources [*batch, d]; h1_s [*batch, d], lse_s [*batch, H]."""

    @staticmethod
    def forward(ctx, queries, eps, key_norm, heads, *sources):
        ctx.set_materialize_grads(False)
        src = [_rows(v) for v in sources]
        q = _rows(queries.detach())
        S, M = q.shape[0], src[0].numel() // q.shape[1]
        h1 = [torch.empty_like(src[0]) for _ in range(S)]
        lse = [src[0].new_empty((*src[0].shape[:-1], heads)) for _ in range(S)]
        z = src[0].new_empty((M, len(src), S * heads))  # the logits, for the backward
        r = src[0].new_empty((M, len(src)))             # and the sources' rstd
        _phase1_forward(q, eps, key_norm, heads, src, _ptrs(h1), _ptrs(lse), z, r)
        ctx.save_for_backward(q, z, r, *src, *lse)
        ctx.key_norm, ctx.heads, ctx.S = key_norm, heads, S
        # a source its readers share (restopo.nn.shared_sources): the backward adds its part
        # into the source's one gradient buffer rather than returning a tensor of its own
        ctx.sinks = [getattr(v, "restopo_sink", None) for v in sources]
        return (*h1, *lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        S = ctx.S
        q, z, r, *rest = ctx.saved_tensors
        src, lse = rest[:-S], rest[-S:]
        g_h1 = [None if g is None else _rows(g) for g in grads[:S]]
        g_lse = [None if g is None else _rows(g) for g in grads[S:]]
        d_src, add, sunk = _gradient_buffers(src, ctx.needs_input_grad[4:], ctx.sinks)
        dq = torch.empty_like(q)
        d = q.shape[1]
        _kernel("phase1_bwd", q.dtype)(len(src), _ptrs(src), S, src[0].numel() // d, d,
                                       ctx.heads, q.data_ptr(), int(ctx.key_norm),
                                       z.data_ptr(), r.data_ptr(), _ptrs(lse), _ptrs(g_h1),
                                       _ptrs(g_lse), _ptrs(d_src), add, dq.data_ptr(),
                                       torch.get_num_threads())
        d_src = [None if s else g for g, s in zip(d_src, sunk)]
        return (dq if ctx.needs_input_grad[0] else None, None, None, None, *d_src)


class Phase2(torch.autograd.Function):
    """(h, y): h = lerp(h1, p, sigmoid(rstd(p) (q . p) - lse)) per head, and y = RMSNorm(h)
    times gain g (None: no gain) where norm_eps is not None; h is returned where keep_h
    (else None, and recomputed in backward)."""

    @staticmethod
    def forward(ctx, h1, lse, p, q, g, eps, key_norm, norm_eps, keep_h):
        ctx.set_materialize_grads(False)
        h1, lse, p, q = _rows(h1), _rows(lse), _rows(p), _rows(q.detach())
        g = None if g is None else _rows(g.detach())
        h, y, w, rstd2 = _phase2_forward(h1, lse, p, q, g, eps, key_norm, norm_eps, keep_h,
                                         keep=True)
        ctx.save_for_backward(h1, lse, p, q, g, w, rstd2)
        ctx.eps, ctx.key_norm = eps, key_norm
        return h, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_h, g_y):
        h1, lse, p, q, g, w, rstd2 = ctx.saved_tensors
        # held here while the kernel reads them: a temporary copy passed as _ptr(_rows(x))
        # is freed once its address is read, and the next copy may take its memory
        g_y, g_h = (None if x is None else _rows(x) for x in (g_y, g_h))
        d, H = p.shape[-1], lse.shape[-1]
        dh1, dp, dlse = torch.empty_like(h1), torch.empty_like(p), torch.empty_like(lse)  # rows
        dq = torch.empty_like(q)
        dg = None if g is None or g_y is None else torch.empty_like(g)
        _kernel("phase2_bwd", p.dtype)(p.numel() // d, d, H, h1.data_ptr(), lse.data_ptr(),
                                       p.data_ptr(), q.data_ptr(), ctx.eps, int(ctx.key_norm),
                                       _ptr(g), w.data_ptr(), _ptr(rstd2),
                                       _ptr(g_y), _ptr(g_h),
                                       dh1.data_ptr(), dp.data_ptr(), dlse.data_ptr(),
                                       dq.data_ptr(), _ptr(dg), torch.get_num_threads())
        need = ctx.needs_input_grad
        return (dh1 if need[0] else None, dlse if need[1] else None, dp if need[2] else None,
                dq if need[3] else None, dg if need[4] else None, None, None, None, None)


def weighted_sum_nograd(alpha, sources, outputs=None):
    """sum_i alpha_i v_i per head (alpha [n, *b, H], sources [*b, d]), keeping nothing;
    with `outputs=S`, alpha [n, S, *b, H] and a tuple of the S sums."""
    out = _weighted_sum(_rows(alpha), [_rows(v) for v in sources], outputs or 1)
    return out[0] if outputs is None else out


def _weighted_sum(alpha, src, S):
    """The S weighted sums (a tuple) for alpha [n, (S,) *b, H]."""
    d = src[0].shape[-1]
    out = tuple(torch.empty_like(src[0]) for _ in range(S))
    _kernel("wsum_fwd", src[0].dtype)(len(src), _ptrs(src), S, alpha.data_ptr(),
                                      src[0].numel() // d, d, alpha.shape[-1], _ptrs(out),
                                      torch.get_num_threads())
    return out


def softmax_given(logits, src, heads: int, outputs: int | None, lse: bool):
    """The softmax over the n sources `src` ([*batch, d] each) of their given logits, in
    one kernel pass. `logits` are n tensors of H = `heads` logits a token: each source's S
    rows [S, *batch, H] (outputs S), or its one row (outputs None: [*batch, H], or
    [1, *batch, H] as a split hands it), read in place as n * S columns through a table of
    their addresses, so their shapes are checked here (ValueError). Returns (alpha
    [n, *batch, H] for outputs None, else [n, S, *batch, H]; with `lse` the S log-sum-exps
    [*batch, H], else None)."""
    n, S = len(src), outputs or 1
    batch = torch.Size((*src[0].shape[:-1], heads))
    rows = ((batch, (1, *batch)) if outputs is None else ((S, *batch),))
    if len(logits) != n or any(z.shape not in rows for z in logits):
        raise ValueError(f"depth attention over {n} sources of shape {tuple(src[0].shape)} "
                         f"needs one logit tensor of shape {tuple(rows[-1])} a source (its "
                         f"logits' rows); got {[tuple(z.shape) for z in logits]}")
    z = [_rows(x) for x in logits]
    cols, H = batch.numel(), batch[-1]
    step = cols * z[0].element_size()
    table = (ctypes.c_void_p * (n * S))(*[x.data_ptr() + s * step for x in z
                                          for s in range(S)])
    alpha = z[0].new_empty((n, *batch) if outputs is None else (n, S, *batch))
    m = z[0].new_empty((S, *batch)) if lse else None
    _kernel("given_softmax", alpha.dtype)(n, S, table, cols // H, H, alpha.data_ptr(),
                                          _rows_of(m, S) if lse else None,
                                          torch.get_num_threads())
    return alpha, (m.unbind(0) if lse else None)


def _weighted_sum_backward(alpha, src, S, grads, wanted, sinks):
    """(d_alpha, each source's gradient for autograd: None where it was added into the
    source's shared buffer or is not `wanted`) from the S sums' gradients `grads`."""
    d_src, add, sunk = _gradient_buffers(src, wanted, sinks)
    d_alpha = torch.empty_like(alpha)
    d = src[0].shape[-1]
    g = [None if x is None else _rows(x) for x in grads]
    _kernel("wsum_bwd", alpha.dtype)(len(src), _ptrs(src), S, alpha.data_ptr(),
                                     src[0].numel() // d, d, alpha.shape[-1], _ptrs(g),
                                     d_alpha.data_ptr(), _ptrs(d_src), add,
                                     torch.get_num_threads())
    return d_alpha, [None if s else x for x, s in zip(d_src, sunk)]


class AttendGiven(torch.autograd.Function):
    """The softmax over given logits and the weighted sum(s) by it, in one autograd node:
    out_s = sum_i alpha_{i,s} v_i per head (H = `heads`), alpha_s = softmax_i(z_{i,s}),
    and with `lse` also lse_s = logsumexp_i z_{i,s} (phase 1's state). The logits come as
    n tensors, each source's S rows [S, *batch, H] (for one output, [*batch, H] or
    [1, *batch, H]), each a piece of its source's shared logits
    (restopo.nn.shared_sources); the n sources [*batch, d] follow. The kernels read the
    logits where they are (a table of addresses) for the softmax (given_softmax) and write
    their gradients in one piece, its backward: autograd records one node, where a stack,
    a softmax (and a logsumexp) and a weighted sum were four, torch's softmax passed five
    times over the logits each way, and the stack's backward split the gradient again
    piece by piece. Returns the S sums (outputs None: the one sum) and, with `lse`, the S
    lse [*batch, H]."""

    @staticmethod
    def forward(ctx, heads, outputs, lse, *inputs):
        if lse and outputs is None:
            raise ValueError("AttendGiven: lse is phase 1's, with outputs S")
        ctx.set_materialize_grads(False)
        S, n = outputs or 1, len(inputs) // 2
        logits, sources = inputs[:n], inputs[n:]
        alpha, m = softmax_given(logits, sources, heads, outputs, lse)
        src = [_rows(v) for v in sources]
        ctx.save_for_backward(alpha, *src)
        ctx.sinks = [getattr(v, "restopo_sink", None) for v in sources]
        ctx.n, ctx.S, ctx.given = n, S, [z.shape for z in logits]
        out = _weighted_sum(alpha, src, S)
        out = out[:1] if outputs is None else out
        return (*out, *m) if lse else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        alpha, *src = ctx.saved_tensors
        n, S = ctx.n, ctx.S
        d_alpha, d_src = _weighted_sum_backward(alpha, src, S, grads[:S],
                                                ctx.needs_input_grad[3 + n:], ctx.sinks)
        # the softmax's backward, and the lse's (d lse_s / d z_{i,s} = alpha_{i,s}):
        # dz = alpha * (d_alpha - sum_j alpha_j d_alpha_j + d_lse), in place on d_alpha
        glse = [None if g is None else _rows(g) for g in grads[S:]]
        H = alpha.shape[-1]
        _kernel("given_softmax_bwd", alpha.dtype)(
            n, S, alpha.data_ptr(), d_alpha.data_ptr(), _ptrs(glse) if glse else None,
            alpha[0].numel() // (S * H), H, d_alpha.data_ptr(), torch.get_num_threads())
        # each source's logits' gradient in the shape they were given
        dz = [g if g.shape == shape else g.view(shape)
              for g, shape in zip(d_alpha.unbind(0), ctx.given)]
        return (None, None, None, *dz, *d_src)
