"""Lower the topology IR to a torch.fx GraphModule.

The graph calls `embed` -> `context` -> for each sublayer l: its aggregation h_l, then
`sublayers.{l-1}` -> the head's aggregation -> `head`. Submodules, hence state_dict names:
  embed, context, sublayers.{i}, aggregations.{i}, phases.{k}, head
where aggregations.{i} computes the input of sublayers.{i} (aggregations.{L} feeds the head)
and phases.{k} runs phase 1 of the k-th two-phase group (it owns no parameters).

How values become code (each is one line of `gm.code`):
- a standard-residual stream keeps one live value: `h3 = h2 + sublayer2`;
- stream updates (rezero, layerscale, highway) call their module on (h_{l-1}, v_{l-1});
- block sums and partials are running sums: `partial2_3 = sublayer3 + sublayer4`,
  `block2 = partial2_3 + sublayer5`, built on first use;
- a two-phase group (restopo.ir.two_phase_plan) runs phase 1 once, before its first member,
  and each member merges its pre-update partial: `h5 = aggregations_4(partial2_2,
  phase1=block2_phase1, slot=1)`;
- every other aggregation calls its module on its sources in IR order.
"""
from __future__ import annotations

import operator

import networkx as nx
import torch
from torch import fx, nn

from .. import ops
from ..ir import aggregations as agg_nodes
from ..ir import is_stream, two_phase_plan
from ..nn.aggregate import Attend, TwoPhase, make_aggregation
from .parts import Parts

SUBMODULES = ("embed", "context", "sublayers", "aggregations", "phases", "head")


def lower(g: nx.DiGraph, parts: Parts, backend: str = "auto", two_phase: bool = True,
          aggregations: nn.ModuleList | None = None) -> fx.GraphModule:
    """The GraphModule computing `parts` wired as the IR `g` says: forward(idx) -> logits.

    backend: auto | eager | triton, for the aggregation ops. two_phase=False lowers every
    aggregation directly (the same function; used to test the two-phase plan against it).
    aggregations: reuse these aggregation modules (one per aggregation node, in order)
    instead of making fresh ones, e.g. to view a trained model without the two-phase plan.
    """
    ops.check_backend(backend)
    if backend == "triton":
        ops.require_backend("triton")
    kinds = tuple(g.graph["kinds"])
    if kinds != parts.kinds:
        raise ValueError(f"the topology was built for sublayers {kinds} but the model has "
                         f"{parts.kinds}; build the IR from the model's sublayer kinds")
    d = g.graph.get("width") or _width_of(parts.embed)
    aggs = agg_nodes(g)
    root = nn.Module()
    root.embed, root.sublayers, root.head = parts.embed, parts.sublayers, parts.head
    if parts.context is not None:
        root.context = parts.context
    if aggregations is None:
        aggregations = nn.ModuleList(make_aggregation(g.nodes[a], d, backend) for a in aggs)
        # new parameters live where the model's do (a rewired model may be bf16 on CUDA)
        p = next((p for p in parts.embed.parameters() if p.is_floating_point()), None)
        if p is not None:
            aggregations.to(device=p.device, dtype=p.dtype)
    elif len(aggregations) != len(aggs):
        raise ValueError(f"got {len(aggregations)} aggregation modules for the IR's {len(aggs)}")
    root.aggregations = aggregations
    plan = two_phase_plan(g) if two_phase else []
    root.phases = nn.ModuleList(
        TwoPhase([root.aggregations[g.nodes[m]["index"] - 1] for m in grp.members], backend)
        for grp in plan)
    emitter = _Emitter(g, parts, plan)
    graph = emitter.emit()
    gm = fx.GraphModule(root, graph, class_name="RestopoModel")
    # GraphModule copies only what the graph calls; keep whole containers so every
    # aggregation (also ones lowered as plain adds) is in the module and its state_dict.
    for name in SUBMODULES:
        if hasattr(root, name):
            setattr(gm, name, getattr(root, name))
    gm.restopo_ir = g
    gm.restopo_context_names = emitter.context_names
    gm.backend = backend
    return gm


def _width_of(embed: nn.Module) -> int:
    w = getattr(embed, "weight", None)
    if w is None or w.dim() != 2:
        raise ValueError("the IR has no width and the embedding has no [vocab, d] weight; "
                         "build the IR with width=")
    return w.shape[1]


class _Emitter:
    """Writes the fx Graph: one node per value, named after the IR."""

    def __init__(self, g: nx.DiGraph, parts: Parts, plan):
        self.g, self.parts = g, parts
        self.graph = fx.Graph()
        self.values: dict[str, fx.Node] = {}
        self.group_of = {m: (k, s) for k, grp in enumerate(plan)
                         for s, m in enumerate(grp.members)}
        self.plan = plan
        self.phase1: dict[int, fx.Node] = {}
        self.context_names: tuple[str, ...] | None = None

    def node(self, op: str, target, args=(), kwargs=None, name: str | None = None) -> fx.Node:
        return self.graph.create_node(op, target, tuple(args), kwargs or {}, name=name)

    def add(self, a: fx.Node, b: fx.Node, name: str) -> fx.Node:
        return self.node("call_function", operator.add, (a, b), name=name)

    def emit(self) -> fx.Graph:
        g, L = self.g, self.g.graph["sublayers"]
        idx = self.node("placeholder", "idx", name="idx")
        self.values["embedding"] = self.node("call_module", "embed", (idx,), name="embedding")
        context = self._context(idx)
        h_prev = None
        for a in agg_nodes(g):
            l = g.nodes[a]["index"]
            h = self._aggregate(a, h_prev)
            self.values[a] = h
            if l <= L:
                self.values[f"sublayer{l}"] = self.node(
                    "call_module", f"sublayers.{l - 1}", (h, *context), name=f"sublayer{l}")
            h_prev = h
        logits = self.node("call_module", "head", (h_prev,), name="logits")
        self.node("output", "output", (logits,))
        self.graph.lint()
        return self.graph

    def _context(self, idx: fx.Node) -> list[fx.Node]:
        parts = self.parts
        if parts.context is None:
            return []
        names = self.context_names = parts.context_names or _probe_context(parts)
        ctx = self.node("call_module", "context", (idx, self.values["embedding"]),
                        name="context")
        return [self.node("call_function", operator.getitem, (ctx, i), name=n)
                for i, n in enumerate(names)]

    def value(self, v: str) -> fx.Node:
        """The fx node of IR value `v`, building block sums and partials as running sums."""
        if v in self.values:
            return self.values[v]
        at = self.g.nodes[v]
        members = at["members"]
        if at["kind"] == "partial" and at["j"] == 2:
            return self.value(f"sublayer{members[0]}")  # p_n^2 is the block's first output
        if at["kind"] == "partial":
            prev = self.value(f"partial{at['block']}.{at['j'] - 1}")
            name = f"partial{at['block']}_{at['j']}"
        else:  # a block of >= 2 sublayers: its last partial plus its last output
            prev = self.value(f"partial{at['index']}.{len(members)}")
            name = f"block{at['index']}"
        out = self.add(prev, self.value(f"sublayer{members[-1]}"), name)
        self.values[v] = out
        return out

    def _aggregate(self, a: str, h_prev: fx.Node | None) -> fx.Node:
        g, at = self.g, self.g.nodes[a]
        l, method, target = at["index"], at["method"], f"aggregations.{at['index'] - 1}"
        srcs = list(at["sources"])
        if is_stream(g, a):
            if l == 1:
                return self.value("embedding")
            prev_stream = is_stream(g, f"agg{l - 1}")
            if method == "sum" and prev_stream:
                return self.add(h_prev, self.value(f"sublayer{l - 1}"), f"h{l}")
            if method != "sum":
                return self.node("call_module", target,
                                 (h_prev, self.value(f"sublayer{l - 1}")), name=f"h{l}")
        if method == "sum" and len(srcs) == 1:
            return self.value(srcs[0])
        if method == "sum" and len(srcs) == 2:  # more sources: one call to the Sum module
            return self.add(self.value(srcs[0]), self.value(srcs[1]), f"h{l}")
        if a in self.group_of:
            k, slot = self.group_of[a]
            grp = self.plan[k]
            if k not in self.phase1:
                self.phase1[k] = self.node(
                    "call_module", f"phases.{k}", [self.value(s) for s in grp.completed],
                    name=f"block{at['block']}_phase1")
            partial = grp.partials[slot]
            args = [self.value(partial)] if partial is not None else []
            return self.node("call_module", target, args,
                             {"phase1": self.phase1[k], "slot": slot}, name=f"h{l}")
        return self.node("call_module", target, [self.value(s) for s in srcs], name=f"h{l}")


def _probe_context(parts: Parts) -> tuple[str, ...]:
    """Count the context tensors by calling embed and context on one token."""
    p = next(parts.embed.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    idx = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        out = parts.context(idx, parts.embed(idx))
    if not isinstance(out, (tuple, list)):
        raise TypeError("Parts.context must return a tuple of tensors; "
                        f"got {type(out).__name__}")
    return tuple(f"context_{i}" for i in range(len(out)))


def lowered(model: nn.Module) -> fx.GraphModule:
    """The lowered GraphModule of a compiled model, or of a wrapper that holds one."""
    if hasattr(model, "restopo_ir"):
        return model
    for m in model.modules():
        if hasattr(m, "restopo_ir"):
            return m
    raise ValueError("this module was not built by restopo (no lowered residual topology "
                     "inside); build it with restopo.compile or restopo.rewire")


def parts_of(model: nn.Module) -> Parts:
    """The Parts a lowered model was built from (the same module objects)."""
    gm = lowered(model)
    return Parts(embed=gm.embed, sublayers=gm.sublayers, kinds=gm.restopo_ir.graph["kinds"],
                 head=gm.head, context=getattr(gm, "context", None),
                 context_names=gm.restopo_context_names)


def aggregation_modules(model: nn.Module) -> list[nn.Module]:
    """The aggregation modules of a lowered model in execution order (the head's last)."""
    return list(lowered(model).aggregations)


def attend_modules(model: nn.Module) -> list[Attend]:
    return [m for m in aggregation_modules(model) if isinstance(m, Attend)]
