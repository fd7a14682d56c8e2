"""What a forward pass leaves alive for backward, in bytes: the figure activation recompute
(restopo.fx.recompute) is meant to lower.

`held_bytes` counts the storages of the tensors the forward made that are still alive when
it returns: what autograd saved, what checkpointed regions hold as their inputs, and the
output. Parameters are not made by the forward and are not counted. Counting what
torch.autograd.graph.saved_tensors_hooks sees instead would miss what a checkpointed region
holds (inside it, torch's own saved-tensor hooks take over, and its inputs are kept by the
region, not saved by an op) and would count the weights that matmuls save.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Made(TorchDispatchMode):
    """Weak references to every tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def held_bytes(forward) -> tuple[int, object]:
    """(bytes of the unique storages made by `forward()` and alive after it, its result).
    Keep the result until backward: dropping it frees what it holds."""
    with _Made() as mode:
        out = forward()
    gc.collect()
    storages = {}
    for ref in mode.made:
        t = ref()
        if t is not None:
            s = t.untyped_storage()
            storages[(s.data_ptr(), t.device)] = s.nbytes()
    return sum(storages.values()), out
