"""Run the IR eagerly: the walk's visitor that calls a model's modules directly.

The fx lowering writes the same steps down as a graph; this runs them at once. It serves a
pipeline chunk (a span of sublayers, values from outside the span provided by the chunk;
backends/pipeline/stage.py) and the walk's tests. Diagnostics have a visitor of their own
(restopo.train.diagnose's replay of what each step saw).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..ir import Aggregation, PhaseGroup, Sublayer
from ..ir.walk import Visitor
from .streams import expand_streams, write_streams


class EagerRun(Visitor):
    """Calls `embed`, the sublayers, the aggregation modules, the `phases` and the `head`.

    sublayers and aggregations are looked up by index (sublayer i, aggregation l, 1-based)
    in any mapping or sequence-like container; `phases[k]` runs phase 1 of the walk's k-th
    two-phase group; `context` is passed to every sublayer after h (rotary tables, ...).
    """

    def __init__(self, *, sublayers, aggregations, embed: nn.Module | None = None,
                 head: nn.Module | None = None, idx: torch.Tensor | None = None,
                 context: Sequence[torch.Tensor] = (), phases=()):
        self.embed, self.head_module, self.idx = embed, head, idx
        self.sublayers, self.aggregations = _by_index(sublayers), _by_index(aggregations)
        self.context, self.phases = tuple(context), phases

    def embedding(self) -> torch.Tensor:
        return self.embed(self.idx)

    def sublayer(self, node: Sublayer, h: torch.Tensor) -> torch.Tensor:
        return self.sublayers(node.index)(h, *self.context)

    def add(self, a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
        return a + b

    def stream_update(self, agg: Aggregation, h_prev, v_prev) -> torch.Tensor:
        return self.aggregations(agg.index)(h_prev, v_prev)

    def aggregate(self, agg: Aggregation, sources: list[torch.Tensor]) -> torch.Tensor:
        return self.aggregations(agg.index)(*sources)

    def phase1(self, k: int, group: PhaseGroup, completed: list[torch.Tensor]):
        return self.phases[k](*completed)

    def phase2(self, agg: Aggregation, phase1, slot: int, partial) -> torch.Tensor:
        args = [] if partial is None else [partial]
        return self.aggregations(agg.index)(*args, phase1=phase1, slot=slot)

    def expand(self, agg: Aggregation, v0: torch.Tensor) -> torch.Tensor:
        return expand_streams(v0, agg.streams)

    def read(self, agg: Aggregation, x: torch.Tensor):
        mix = self.aggregations(agg.index)(x)
        return mix[0], mix

    def write(self, agg: Aggregation, x, v, mix) -> torch.Tensor:
        return write_streams(x, v, mix[1], mix[2])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_module(h)


def _by_index(modules):
    """i -> module i (1-based) from a {i: module} mapping or a 0-based sequence."""
    if isinstance(modules, Mapping):
        return modules.__getitem__
    return lambda i: modules[i - 1]
