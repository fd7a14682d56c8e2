"""The one walk: the IR visited in execution order, each step handed to a visitor.

Every consumer that turns the IR into computation is a `Visitor` of this walk: the fx
emitter (restopo.fx.lower) writes graph nodes, the eager runner (restopo.nn.run) calls
modules, a pipeline chunk (restopo.backends.pipeline.stage) runs its span of sublayers, and
diagnose records depth weights. So the rules below exist once:

- sublayer i runs on h_i; h_i is computed just before it, except that a stream-fed h_{i+1}
  (restopo.ir.stream_fed: h_1 = v_0, or a running update h_{i+1} = h_i (+) v_i) is
  computed right after sublayer i, by whoever ran sublayer i;
- a standard stream continues as `add(h_i, v_i)`; stream updates (rezero, layerscale,
  highway) are `stream_update(agg, h_i, v_i)`;
- block sums and partials are running sums in member order, built on first use:
  p_n^2 is the block's first output, p_n^{j+1} = p_n^j + v, b_n = p_n^{|n|} + v_last;
- a plain sum of one source is that source, of two an `add`, of more an `aggregate`;
- a two-phase group (restopo.ir.two_phase_plan) runs `phase1` once, before its first
  member, then `phase2` per member with its pre-update partial (None for a block's first);
- every other aggregation is `aggregate(agg, sources)` over its sources in IR order;
- a multi-stream topology (restopo.ir.Streams) starts its n streams as `expand(agg_1,
  v_0)`, reads sublayer l's input as `read(agg_l, X_l)` -> (h_l, coefficients) just
  before it, writes `write(agg_l, X_l, v_l, coefficients)` -> X_{l+1} right after it, and
  the head's point is `aggregate(agg_{L+1}, [X_{L+1}])` (the sum of the streams).

A walk may cover a span of sublayers (a pipeline chunk): values produced before the span
come from `Visitor.provide`, and the walk returns every value it saw, so the caller can
read what crosses the span's end.
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar

from .analyses import PhaseGroup, stream_fed
from .graph import IR
from .nodes import Aggregation, BlockSum, Embedding, Node, Partial, Streams, Sublayer

V = TypeVar("V")


class Visitor(Generic[V]):
    """What a walk asks of its visitor. Each call returns the visitor's value (an fx node,
    a tensor, ...); `name` is the IR's name for it, for visitors that name things."""

    def embedding(self) -> V:
        raise NotImplementedError

    def sublayer(self, node: Sublayer, h: V) -> V:
        raise NotImplementedError

    def add(self, a: V, b: V, name: str) -> V:
        raise NotImplementedError

    def stream_update(self, agg: Aggregation, h_prev: V, v_prev: V) -> V:
        raise NotImplementedError

    def aggregate(self, agg: Aggregation, sources: list[V]) -> V:
        raise NotImplementedError

    def phase1(self, k: int, group: PhaseGroup, completed: list[V]) -> Any:
        raise NotImplementedError

    def phase2(self, agg: Aggregation, phase1: Any, slot: int, partial: V | None) -> V:
        raise NotImplementedError

    def expand(self, agg: Aggregation, v0: V) -> V:
        """X_1: n = agg.streams copies of the embedding."""
        raise NotImplementedError

    def read(self, agg: Aggregation, x: V) -> tuple[V, Any]:
        """h_l = sum_i pre_i X_i, and the coefficients (post, R) that `write` needs."""
        raise NotImplementedError

    def write(self, agg: Aggregation, x: V, v: V, coefficients: Any) -> V:
        """X_{l+1} = R X_l + post (x) v_l."""
        raise NotImplementedError

    def head(self, h: V) -> V:
        raise NotImplementedError

    def aggregated(self, agg: Aggregation, inputs: list[V], h: V, stream: bool) -> None:
        """Told once per aggregation point, after h_l is known, what it was computed from:
        its sources in IR order, or for a stream-fed point (stream=True) the running value
        and the newest output (h_{l-1}, v_{l-1}), just (v_0,) at l = 1; a multi-stream
        point's input is its streams (X_l,). Diagnostics read the depth weights here;
        visitors that only compute ignore it."""

    def provide(self, node: Node) -> V | None:
        """A value made outside the walked span (received, cached), or None to compute it.
        A walk of the whole model asks only for what it is about to compute, so the
        default None is right there."""
        return None


def walk(g: IR, visitor: Visitor[V], groups: list[PhaseGroup] | tuple = (),
         span: tuple[int, int] | None = None) -> "Walk[V]":
    """Visit `g` in execution order (see the module docstring); returns the finished Walk.

    groups: the two-phase groups to run as phase 1 / phase 2 (restopo.ir.two_phase_plan;
    empty: every aggregation direct). span: sublayers (first, last) to run, default all;
    the embedding runs when first == 1, the head when last == L.
    """
    w = Walk(g, visitor, groups)
    w.run(*(span or (1, g.n_sublayers)))
    return w


class Walk(Generic[V]):
    """One walk's state. After `run`: `values` by IR node id (h_l under agg{l}), `output`
    the head's result when the span reached the head (else None), and `value(id)` builds
    any further running sum from them (what a pipeline chunk sends on)."""

    def __init__(self, g: IR, visitor: Visitor[V], groups):
        self.g, self.visitor, self.groups = g, visitor, list(groups)
        self.values: dict[str, V] = {}
        self.output: V | None = None
        self.slot_of = {m: (k, s) for k, grp in enumerate(self.groups)
                        for s, m in enumerate(grp.members)}
        self.phase1: dict[int, Any] = {}
        self.coefficients: dict[int, Any] = {}  # multi-stream: read l's, for write l

    def run(self, first: int, last: int) -> None:
        g, values, L = self.g, self.values, self.g.n_sublayers
        if not 1 <= first <= last <= L:
            raise ValueError(f"span ({first}, {last}) is not within sublayers 1..{L}")
        if first == 1:
            values[Embedding.id] = self.visitor.embedding()
        elif stream_fed(g, g.aggregation(first)):
            values[f"agg{first}"] = self._provided(g.aggregation(first))
        for i in range(first, last + 1):
            agg = g.aggregation(i)
            if agg.id not in values:
                values[agg.id] = self._aggregate(agg)
            values[f"sublayer{i}"] = self.visitor.sublayer(g.sublayer(i), values[agg.id])
            if agg.multi_stream:
                values[f"streams{i + 1}"] = self.visitor.write(
                    agg, self.value(f"streams{i}"), values[f"sublayer{i}"],
                    self.coefficients.pop(i))
            following = g.aggregation(i + 1)
            if stream_fed(g, following):
                values[following.id] = self._aggregate(following)
        if last == L:
            head = g.aggregation(L + 1)
            if head.id not in values:
                values[head.id] = self._aggregate(head)
            self.output = self.visitor.head(values[head.id])

    def _provided(self, node: Node) -> V:
        got = self.visitor.provide(node)
        if got is None:
            raise RuntimeError(f"{node.id} is needed but was neither computed in this span "
                               f"nor provided by the {type(self.visitor).__name__}")
        return got

    def value(self, node_id: str) -> V:
        """The visitor's value of IR node `node_id`, building running sums on first use."""
        if node_id in self.values:
            return self.values[node_id]
        node = self.g.node(node_id)
        got = self.visitor.provide(node)
        if got is not None:
            out = got
        elif isinstance(node, Partial) and node.j == 2:
            return self.value(f"sublayer{node.members[0]}")  # p_n^2 is the block's first output
        elif isinstance(node, Partial):
            out = self.visitor.add(self.value(f"partial{node.block}.{node.j - 1}"),
                                   self.value(f"sublayer{node.members[-1]}"),
                                   f"partial{node.block}_{node.j}")
        elif isinstance(node, BlockSum):
            out = self.visitor.add(self.value(f"partial{node.index}.{len(node.members)}"),
                                   self.value(f"sublayer{node.members[-1]}"), node.id)
        elif isinstance(node, Streams) and node.index == 1:
            out = self.visitor.expand(self.g.aggregation(1), self.value(Embedding.id))
        else:
            out = self._provided(node)  # made in another span (a sublayer output, ...)
        self.values[node_id] = out
        return out

    def _aggregate(self, a: Aggregation) -> V:
        fed = stream_fed(self.g, a)
        if a.multi_stream and not a.is_head:
            x = self.value(a.sources[0])
            h, self.coefficients[a.index] = self.visitor.read(a, x)
            self.visitor.aggregated(a, [x], h, stream=False)
            return h
        if fed:
            inputs = ([self.value(Embedding.id)] if a.index == 1 else
                      [self.values[f"agg{a.index - 1}"], self.value(f"sublayer{a.index - 1}")])
            h = self._stream(a, inputs)
        else:
            h = self._direct(a)
            inputs = [self.value(s) for s in a.sources]  # all computed by _direct already
        self.visitor.aggregated(a, inputs, h, stream=fed)
        return h

    def _stream(self, a: Aggregation, inputs: list[V]) -> V:
        if a.index == 1:
            return inputs[0]
        if a.method == "sum":
            return self.visitor.add(*inputs, f"h{a.index}")
        return self.visitor.stream_update(a, *inputs)

    def _direct(self, a: Aggregation) -> V:
        l, visitor = a.index, self.visitor
        if a.method == "sum" and len(a.sources) == 1:
            return self.value(a.sources[0])
        if a.method == "sum" and len(a.sources) == 2:
            return visitor.add(self.value(a.sources[0]), self.value(a.sources[1]), f"h{l}")
        if a.id in self.slot_of:
            k, slot = self.slot_of[a.id]
            group = self.groups[k]
            if k not in self.phase1:
                self.phase1[k] = visitor.phase1(k, group, [self.value(s) for s in group.completed])
            partial = group.partials[slot]
            return visitor.phase2(a, self.phase1[k], slot,
                                  None if partial is None else self.value(partial))
        return visitor.aggregate(a, [self.value(s) for s in a.sources])
