"""The cross-stage block cache: one copy per rank of every value it holds, per microbatch.

Why its own gradient path: a later chunk on the same rank must not read the producing
chunk's graph tensor directly, or its backward would run through the producer's graph and
the producer's own backward would then fail ("backward through the graph a second time").
So the cache hands later chunks a *detached leaf* of each value. Their backward passes
accumulate the value's gradient in that leaf's `.grad` (however many virtual stages read it),
and the producing chunk picks the sum up in its own backward through `Inject`, an identity on
one of its outputs whose backward also returns the leaves' gradients as the gradients of the
cached tensors. So a cached block's gradient is summed on the rank that holds it and goes back
once, with the chunk that received or produced it; it is never sent per hop.

In every pipeline schedule, chunk c's backward for a microbatch runs after the backward of
every later chunk for that microbatch (it needs their input gradients), so the leaves are
complete by the time `Inject` runs.
"""
from __future__ import annotations

import torch


class RankCache:
    """Values held by one rank, keyed by (microbatch, value); shared by its virtual stages."""

    def __init__(self):
        self._store: dict[tuple[int, object], torch.Tensor] = {}

    def put(self, mb: int, key, tensor: torch.Tensor) -> torch.Tensor:
        """Keep `tensor` for later chunks of this rank; returns the leaf they will read."""
        leaf = tensor.detach().requires_grad_(tensor.requires_grad)
        self._store[(mb, key)] = leaf
        return leaf

    def get(self, mb: int, key) -> torch.Tensor:
        try:
            return self._store[(mb, key)]
        except KeyError:
            raise RuntimeError(f"pipeline cache miss: {key} for microbatch {mb} is not held "
                               f"on this rank (the plan and the runtime disagree)") from None

    def holds(self, mb: int, key) -> bool:
        return (mb, key) in self._store

    def clear(self) -> None:
        self._store.clear()

    def __len__(self) -> int:
        return len(self._store)


class Inject(torch.autograd.Function):
    """out = carrier (identity); backward also hands `leaves[k].grad` to `tensors[k]`."""

    @staticmethod
    def forward(ctx, carrier, leaves, *tensors):
        ctx.leaves = leaves
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        return carrier.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = []
        for leaf, (shape, dtype, device) in zip(ctx.leaves, ctx.shapes):
            g = leaf.grad
            grads.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
        ctx.leaves = None
        return (grad, None, *grads)


class Boundary(torch.autograd.Function):
    """A tensor crossing a stage boundary: a contiguous copy in the wire dtype forward, a
    contiguous gradient backward. gloo refuses non-contiguous tensors, and a gradient through
    `einsum` or `cat` can arrive permuted while the runtime allocates buffers with the
    forward's strides. The copy also keeps a forwarded input from being sent as the stage's
    own leaf, and a bf16 activation under autocast from meeting an fp32 receive buffer."""

    @staticmethod
    def forward(ctx, x, dtype=torch.float32):
        ctx.dtype = x.dtype
        return x.to(dtype).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).contiguous(), None
