"""How a kernel reads n sources without stacking them: a table of their addresses.

`torch.stack(sources)` before a fused call copies every source, and autograd then keeps the
copy for backward: O(L^2 d) per token over a Full AttnRes network, where the sources are only
O(L d). Here each call builds a small int64 table instead (FLA and fast-attnres do the same):

    row 0: the address of each source's first element
    row 1: each source's row stride, in elements (its channels must have unit stride)
    then:  one more row of addresses per extra list (the gradient buffers, written in place
           of a stacked gradient), in the same order

Sources of two dtypes are allowed (under bf16 autocast the embedding is fp32, the sublayer
outputs bf16): the table lists the dtype of the first source first (`n0` of them), then the
other, and a kernel loops over the two groups with each group's pointer type
(`NGROUPS`, `DT0`, `DT1`). More than two dtypes are cast to their promoted type (a copy);
their gradients come back in each source's own dtype.

`ALIGNED` says every address is 16-byte aligned and every row stride a multiple of 16
elements; the kernels then tell the compiler so (`tl.multiple_of`), which lets it use
vector loads (checked offline in tests/triton/test_triton_sm90_compile.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch

from . import runtime as rt
from .runtime import tl

_TL = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
       torch.float64: "float64"}


def tl_dtype(dtype: torch.dtype):
    if dtype not in _TL:
        raise TypeError(f"the triton kernels take float32, float16, bfloat16 or float64 "
                        f"sources, not {dtype}")
    return getattr(tl, _TL[dtype])


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [*batch, d] as [rows, d] with unit channel stride; a copy only when the batch dims
    do not collapse or the channels are strided."""
    try:
        v = x.view(-1, d)
    except RuntimeError:
        v = x.reshape(-1, d)
    return v if v.stride(-1) == 1 or v.shape[0] == 0 else v.contiguous()


class Sources:
    """n tensors of one shape [*batch, d] as a kernel reads them (see the module docstring).

    `order[k]` is the source at table position k; `views` are the [rows, d] views in table
    order (they keep any copy alive while a kernel runs)."""

    def __init__(self, tensors: Sequence[torch.Tensor], what: str = "sources"):
        if len(tensors) < 1:
            raise ValueError(f"{what} must hold n >= 1 tensors")
        shape, device = tuple(tensors[0].shape), tensors[0].device
        for t in tensors:
            if tuple(t.shape) != shape or t.device != device:
                raise ValueError(f"{what} must share one shape and device; got "
                                 f"{tuple(t.shape)} on {t.device} and {shape} on {device}")
        if len(shape) < 1:
            raise ValueError(f"{what} must be [*batch, d] tensors; got shape {shape}")
        self.shape, self.device, self.d = shape, device, shape[-1]
        dtypes = self.given_dtypes = [t.dtype for t in tensors]
        self.out_dtype = reduce(torch.promote_types, dtypes)
        if len(set(dtypes)) > 2:
            tensors = [t.to(self.out_dtype) for t in tensors]
            dtypes = [self.out_dtype] * len(dtypes)
        first = dtypes[0]
        self.order = ([k for k, t in enumerate(dtypes) if t == first]
                      + [k for k, t in enumerate(dtypes) if t != first])
        self.n, self.n0 = len(tensors), dtypes.count(first)
        self.dtypes = (first, dtypes[self.order[-1]])
        self.views = [_rows(tensors[k], self.d) for k in self.order]
        self.rows = self.views[0].shape[0]
        self.acc = rt.acc_dtype(torch.float64 if torch.float64 in dtypes else first)
        self.aligned = all(v.data_ptr() % 16 == 0 and v.stride(0) % 16 == 0 for v in self.views)

    def constexprs(self) -> dict:
        """The kernel's compile-time view of the sources."""
        return dict(DT0=tl_dtype(self.dtypes[0]), DT1=tl_dtype(self.dtypes[1]),
                    NGROUPS=1 if self.n0 == self.n else 2, ALIGNED=self.aligned)

    def empty_like(self) -> list[torch.Tensor]:
        """One fresh [rows, d] buffer per source, in table order (for its gradient)."""
        return [torch.empty((self.rows, self.d), dtype=v.dtype, device=self.device)
                for v in self.views]

    def table(self, *extra: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the int64 table on the device, one view of it per extra list): the sources'
        addresses and row strides, then each extra list's addresses (in the order given)."""
        rows = [[v.data_ptr() for v in self.views], [v.stride(0) for v in self.views]]
        rows += [[t.data_ptr() for t in lst] for lst in extra]
        flat = torch.tensor([x for r in rows for x in r], dtype=torch.int64)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        offsets, views = 2 * self.n, []
        for lst in extra:
            views.append(flat[offsets:offsets + len(lst)])
            offsets += len(lst)
        return flat, views

    def in_caller_order(self, per_position: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors given in table order (the sources' gradients), back in the caller's order,
        each shaped and typed as its source: with more than two dtypes the table's are
        all promoted, and torch.compile takes each gradient for its source's dtype (the
        fake backward ops say so)."""
        out: list[torch.Tensor | None] = [None] * self.n
        for k, t in zip(self.order, per_position):
            out[k] = t.view(self.shape).to(self.given_dtypes[k])
        return out


def as_list(sources) -> list[torch.Tensor]:
    """A stacked [n, *batch, d] tensor as its n views (no copy), or the sequence as a list."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2 or sources.shape[0] < 1:
            raise ValueError(f"sources must be [n >= 1, *batch, d], got shape "
                             f"{tuple(sources.shape)}")
        return list(sources.unbind(0))
    if len(sources) < 1:
        raise ValueError("sources must hold n >= 1 tensors")
    return list(sources)


@rt.device_fn
def buffer_rows(ADDR, i, rows, D, DT: tl.constexpr):
    """Pointers to channel 0 of rows `rows` of the contiguous [R, D] buffer at ADDR[i]
    (a buffer this backend allocated: 16-byte aligned)."""
    base = tl.multiple_of(tl.load(ADDR + i).to(tl.pointer_type(DT)), 16)
    return base + rows * D


@rt.device_fn
def load_source(TABLE, n, i, rows, cols, mask, DT: tl.constexpr, ALIGNED: tl.constexpr,
                ACC: tl.constexpr):
    """The [rows, cols] tile (rows int64) of table source i, of dtype DT, in the accumulation
    dtype (0 where masked)."""
    base = tl.load(TABLE + i).to(tl.pointer_type(DT))
    stride = tl.load(TABLE + n + i)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
        stride = tl.multiple_of(stride, 16)
    vp = base + rows * stride
    return tl.load(vp[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
