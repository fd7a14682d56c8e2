"""Analyses computed from the IR alone (never from a second description of the model)."""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..topology import STREAM_METHODS


def aggregations(g: nx.DiGraph) -> list[str]:
    """Aggregation node ids in execution order (the head's last)."""
    return sorted((n for n, a in g.nodes(data=True) if a["kind"] == "aggregation"),
                  key=lambda n: g.nodes[n]["index"])


def sublayers(g: nx.DiGraph) -> list[str]:
    return [f"sublayer{i}" for i in range(1, g.graph["sublayers"] + 1)]


def display_name(g: nx.DiGraph, node: str) -> str:
    """The name shown to people: partial sums are all called 'partial'."""
    return "partial" if g.nodes[node]["kind"] == "partial" else node


def sources(g: nx.DiGraph, agg: str) -> tuple[str, ...]:
    return g.nodes[agg]["sources"]


def is_stream(g: nx.DiGraph, agg: str) -> bool:
    """True when the aggregation is computed as one running value: the plain sum over the
    embedding and every earlier sublayer (the standard residual), or a stream update."""
    a = g.nodes[agg]
    if a["method"] in STREAM_METHODS:
        return True
    want = ("embedding",) + tuple(f"sublayer{i}" for i in range(1, a["index"]))
    return a["method"] == "sum" and a["sources"] == want


def live_values_per_token(g: nx.DiGraph) -> int:
    """The most d-vectors a token must keep at once between sublayers for the depth mixing.

    A value is live at point l when it was produced before aggregation l and is read by an
    aggregation at l or later; every value read only by stream aggregations is folded into a
    single running value. Standard: 1; Block AttnRes with N blocks: N + 1; Full: L + 1.
    """
    aggs = aggregations(g)
    last_read: dict[str, int] = {}
    stream_until = 0
    for a in aggs:
        l = g.nodes[a]["index"]
        if is_stream(g, a):
            stream_until = l
            continue
        for s in sources(g, a):
            last_read[s] = max(last_read.get(s, 0), l)
    best = 0
    for a in aggs:
        l = g.nodes[a]["index"]
        live = sum(1 for s, r in last_read.items()
                   if g.nodes[s]["produced"] < l <= r)
        best = max(best, live + (1 if l <= stream_until else 0))
    return best


def added_parameters(g: nx.DiGraph) -> int:
    """Parameters the topology adds to the model (needs the IR's width)."""
    d = g.graph["width"]
    if d is None:
        raise ValueError("the IR was built without a width; pass width= to build_ir")
    total = 0
    for a in aggregations(g):
        at = g.nodes[a]
        total += aggregation_parameters(at["method"], len(at["sources"]), d,
                                        at["query"], at["key_norm"], at["index"])
    return total


def aggregation_parameters(method: str, n_sources: int, d: int, query: str = "static",
                           key_norm: str = "rms", index: int = 2) -> int:
    """Parameters one aggregation point owns. Stream updates own the weight of the output
    they add (that of sublayer index-1), so the first aggregation owns none. Scalars own one
    per source whatever their gate."""
    if method == "attend":
        return d + (d * d if query == "input_dependent" else 0) + (d if key_norm == "rms" else 0)
    if method == "scalars":
        return n_sources
    if method in STREAM_METHODS:
        if index == 1:
            return 0
        return {"rezero": 1, "layerscale": d, "highway": d * d + d}[method]
    return 0


def mixing_matrix(g: nx.DiGraph) -> tuple[list[str], list[str], list[list[int]]]:
    """Which source feeds which aggregation: (source ids, aggregation ids, 0/1 rows).

    Rows are aggregations in execution order; columns the values any aggregation reads,
    in the order they are produced.
    """
    aggs = aggregations(g)
    cols = sorted({s for a in aggs for s in sources(g, a)},
                  key=lambda s: (g.nodes[s]["produced"], s))
    rows = [[1 if c in sources(g, a) else 0 for c in cols] for a in aggs]
    return cols, aggs, rows


@dataclass(frozen=True)
class PhaseGroup:
    """Aggregations whose static queries all read the same completed sources.

    Phase 1 attends all of `members`' queries over `completed` in one batched pass; phase 2
    merges, per member in order, its own partial (None for a block's first sublayer).
    """

    completed: tuple[str, ...]
    members: tuple[str, ...]
    partials: tuple[str | None, ...]


def two_phase_plan(g: nx.DiGraph) -> list[PhaseGroup]:
    """Groups of >= 2 static-query softmax aggregations that read the same completed sources
    and differ at most by a trailing partial. The lowering runs them as phase 1 / phase 2;
    every other aggregation is lowered directly."""
    groups: dict[tuple, list[str]] = {}
    for a in aggregations(g):
        at = g.nodes[a]
        if at["method"] != "attend" or at["query"] != "static" or at["gate"] != "softmax":
            continue
        srcs = sources(g, a)
        partial = srcs[-1] if srcs and g.nodes[srcs[-1]]["kind"] == "partial" else None
        completed = srcs[:-1] if partial else srcs
        if any(g.nodes[s]["kind"] == "partial" for s in completed):
            continue
        key = (completed, at["key_norm"], at["heads"], at["block"])
        groups.setdefault(key, []).append(a)
    plan = []
    for (completed, *_), members in groups.items():
        if len(members) < 2:
            continue
        partials = tuple(sources(g, m)[-1] if len(sources(g, m)) > len(completed) else None
                         for m in members)
        plan.append(PhaseGroup(completed, tuple(members), partials))
    return sorted(plan, key=lambda p: g.nodes[p.members[0]]["index"])


def summary(g: nx.DiGraph) -> dict:
    """The JSON form of `restopo inspect`."""
    aggs = []
    for a in aggregations(g):
        at = g.nodes[a]
        entry = {"index": at["index"], "before": at["before"], "method": at["method"],
                 "sources": [display_name(g, s) for s in at["sources"]]}
        if at["method"] == "attend":
            entry.update(query=at["query"], gate=at["gate"], key_norm=at["key_norm"],
                         heads=at["heads"])
        elif at["method"] == "scalars":  # none: DenseFormer's raw weights; else normalised
            entry.update(gate=at["gate"])
        aggs.append(entry)
    out = {
        "topology": g.graph["name"],
        "sublayers": g.graph["sublayers"],
        "blocks": len(g.graph["blocks"]),
        "block_sizes": [len(b) for b in g.graph["blocks"]],
        "live_values_per_token": live_values_per_token(g),
        "added_parameters": added_parameters(g) if g.graph["width"] else None,
        "two_phase_groups": [list(p.members) for p in two_phase_plan(g)],
        "aggregations": aggs,
    }
    return out
