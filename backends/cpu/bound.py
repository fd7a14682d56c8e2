"""Kernel calls with an aggregation point's constants bound once, for calls autograd does not
record (decoding, evaluation).

A one-token decoding step runs each aggregation point's kernel on a few d-vectors: the
kernel takes a microsecond, the general path around it (backend pick, checks, gained
queries, pointer tables) ten times that, and more again inside a step whose Python no longer
sits in the processor's caches. A bound call keeps the gained queries, the PreNorm gain, the
kernel and its scalar arguments, and per call checks that its tensors fit the kernel (on the
CPU, row-major, its dtype and shapes), allocates the outputs and calls it. Anything that does
not fit goes to `general`, the unbound path with the same arguments. The kernels are the
ones the general path calls, with the same arguments, so the results are the same bits;
but for a block's first PreNorm, which phase 1's kernel makes in its own call (the general
path: phase 2's eager PreNorm with no partial), equal to rounding: a call saved shows in
an eager decoding step at batch 1 (bench/decode.py), whose matmuls leave each call's Python
and data out of the processor's caches.

Made by restopo.ops.bind_* and kept by the aggregation modules while their parameters are
unchanged (restopo.nn.aggregate.derived).
"""
from __future__ import annotations

import torch

from ..eager.rmsnorm import rms_norm
from .functions import _kernel, _ptr, _ptrs, _rows


def _fits(tensors, dtype: torch.dtype, shape: torch.Size) -> bool:
    return all(t.is_cpu and t.dtype is dtype and t.shape == shape and t.is_contiguous()
               for t in tensors)


class Phase1Call:
    """phase1(completed) for S bound queries [S, d] (key-norm gains folded in): (h1, lse,
    S Nones), each a tuple of S tensors; with `single`, depth attention: h1[0]. With
    `norm_eps`, a fourth item (y0, norm_weight, norm_eps): the first output's PreNorm."""

    def __init__(self, gained: torch.Tensor, eps: float, key_norm: bool, heads: int,
                 general, single: bool = False, norm_weight: torch.Tensor | None = None,
                 norm_eps: float | None = None):
        self.q = _rows(gained.detach())
        self.S, self.d = self.q.shape
        self.dtype, self.heads, self.single, self.general = gained.dtype, heads, single, general
        self.fn = _kernel("phase1_fwd", self.dtype)
        self.eps, self.key_norm = float(eps), int(key_norm)
        self.nones = (None,) * self.S
        self.norm_weight, self.norm_eps = norm_weight, norm_eps
        self.g = None if norm_weight is None else _rows(norm_weight.detach())

    def __call__(self, completed):
        first = completed[0]
        shape = first.shape
        if shape[-1] != self.d or not _fits(completed, self.dtype, shape):
            return self.general(completed)
        S, d, H = self.S, self.d, self.heads
        h1 = tuple(torch.empty_like(first) for _ in range(S))
        lse = tuple(first.new_empty((*shape[:-1], H)) for _ in range(S))
        norm_eps = self.norm_eps
        y0 = None if norm_eps is None else torch.empty_like(first)
        self.fn(len(completed), _ptrs(completed), S, first.numel() // d, d, H,
                self.q.data_ptr(), self.eps, self.key_norm, _ptrs(h1), _ptrs(lse), None, None,
                _ptr(self.g), norm_eps or 0.0, _ptr(y0), torch.get_num_threads())
        if self.single:
            return h1[0]
        if y0 is None:
            return h1, lse, self.nones
        return h1, lse, self.nones, (y0, self.norm_weight, norm_eps)


class Phase2Call:
    """phase2 (norm_eps None: h) or phase2_norm ((h or None, y)) of (o1, m1, s1, partial)
    for a bound query (gain folded in) and PreNorm gain."""

    def __init__(self, gained: torch.Tensor, eps: float, key_norm: bool,
                 norm_weight: torch.Tensor | None, norm_eps: float | None, keep_h: bool,
                 general):
        self.q = _rows(gained.detach())
        self.norm_weight = norm_weight
        self.g = None if norm_weight is None else _rows(norm_weight.detach())
        self.d, self.dtype, self.general = self.q.shape[-1], gained.dtype, general
        self.fn = _kernel("phase2_fwd", self.dtype)
        self.eps, self.key_norm = float(eps), int(key_norm)
        self.with_norm = norm_eps is not None
        self.norm_eps = float(norm_eps) if self.with_norm else 0.0
        self.keep_h = keep_h or not self.with_norm

    def __call__(self, o1, m1, s1, partial):
        if partial is None and s1 is None:  # a block's first sublayer: h = h1, no merge
            if not self.with_norm:
                return o1
            return (o1 if self.keep_h else None), rms_norm(o1, self.norm_weight, self.norm_eps)
        dt = self.dtype
        if (s1 is not None or partial is None or partial.shape[-1] != self.d
                or not _fits((o1, partial), dt, partial.shape) or not m1.is_cpu
                or m1.dtype is not dt or not m1.is_contiguous()
                or m1.shape[:-1] != partial.shape[:-1] or self.d % m1.shape[-1]):
            return self.general(o1, m1, s1, partial)
        h = torch.empty_like(partial) if self.keep_h else None
        y = torch.empty_like(partial) if self.with_norm else None
        self.fn(partial.numel() // self.d, self.d, m1.shape[-1], o1.data_ptr(), m1.data_ptr(),
                partial.data_ptr(), self.q.data_ptr(), self.eps, self.key_norm, _ptr(self.g),
                self.norm_eps, _ptr(h), _ptr(y), None, None, torch.get_num_threads())
        return (h, y) if self.with_norm else h
