"""Analyses computed from the IR alone (never from a second description of the model)."""
from __future__ import annotations

from dataclasses import dataclass

import math

from ..topology import STREAM_METHODS
from .graph import IR
from .nodes import Aggregation, Partial, Streams


def aggregations(g: IR) -> list[str]:
    """Aggregation node ids in execution order (the head's last)."""
    return [a.id for a in g.aggregations()]


def sublayers(g: IR) -> list[str]:
    return [f"sublayer{i}" for i in range(1, g.n_sublayers + 1)]


def display_name(g: IR, node: str) -> str:
    """The name shown to people: partial sums are all called 'partial', a multi-stream
    state 'streams'."""
    value = g.node(node)
    if isinstance(value, Partial):
        return "partial"
    return "streams" if isinstance(value, Streams) else node


def sources(g: IR, agg: str) -> tuple[str, ...]:
    return g.node(agg).sources


def _agg(g: IR, agg: str | Aggregation) -> Aggregation:
    return agg if isinstance(agg, Aggregation) else g.node(agg)


def is_stream(g: IR, agg: str | Aggregation) -> bool:
    """True when the aggregation is computed as one running value: the plain sum over the
    embedding and every earlier sublayer (the standard residual), or a stream update."""
    a = _agg(g, agg)
    if a.method in STREAM_METHODS:
        return True
    if a.method != "sum" or len(a.sources) != a.index or a.sources[0] != "embedding":
        return False
    return all(s == f"sublayer{i}" for i, s in enumerate(a.sources[1:], start=1))


def stream_fed(g: IR, agg: str | Aggregation) -> bool:
    """True when the aggregation is computed from the running value: h_1 = v_0, or a stream
    update h_l = h_{l-1} (+) v_{l-1}. A plain sum continues a stream only when the previous
    aggregation kept one; otherwise it is summed from its sources."""
    a = _agg(g, agg)
    if not is_stream(g, a):
        return False
    return a.index == 1 or a.method != "sum" or is_stream(g, g.aggregation(a.index - 1))


def is_multi_stream(g: IR) -> bool:
    """True for a multi-stream topology (Hyper-Connections, mHC, mHC-lite)."""
    return g.aggregation(1).multi_stream


def value_size(node) -> int:
    """d-vectors per token of an IR value: n for the streams X_l, else 1."""
    return node.n if isinstance(node, Streams) else 1


def live_values_per_token(g: IR) -> int:
    """The most d-vectors a token must keep at once between sublayers for the depth mixing.

    A value is live at point l when it was produced before aggregation l and is read by an
    aggregation at l or later; the values a point fed by the running value reads
    (`stream_fed`, as the lowering computes it) are that one value. Standard: 1; Block
    AttnRes with N blocks: N + 1; Full: L + 1; n streams (Hyper-Connections, mHC): n. A
    plain sum of every output that no running value feeds (a custom head after attending
    points) is summed from its sources, so they are all live until it.
    """
    return max(_live_per_point(g))


def two_phase_live_values(g: IR) -> int | None:
    """`live_values_per_token` as the two-phase plan runs (None without one): a group's
    phase 1 makes one result per member before the first and keeps them all (one tensor)
    until the last member has merged its own. Block AttnRes with S sublayers per block:
    N + 1 + S (its N + 1 sources, and the S results of the last block's phase 1)."""
    plan = two_phase_plan(g)
    if not plan:
        return None
    live = _live_per_point(g)
    for grp in plan:
        first, last = (g.node(m).index for m in (grp.members[0], grp.members[-1]))
        for l in range(first, last + 1):
            live[l - 1] += len(grp.members)
    return max(live)


def _live_per_point(g: IR) -> list[int]:
    """The d-vectors live at each aggregation point l = 1..L+1 (see live_values_per_token)."""
    aggs = g.aggregations()
    last_read: dict[str, int] = {}
    fed = set()
    for a in aggs:
        if stream_fed(g, a):
            fed.add(a.index)
            continue
        for s in a.sources:
            last_read[s] = max(last_read.get(s, 0), a.index)
    # Sweep: +1 at the first point after a value is produced, -1 after its last read.
    delta = [0] * (len(aggs) + 2)
    for s, r in last_read.items():
        born = g.node(s).produced + 1
        if born <= r:
            delta[born] += value_size(g.node(s))
            delta[r + 1] -= value_size(g.node(s))
    out, live = [], 0
    for l in range(1, len(aggs) + 1):
        live += delta[l]
        out.append(live + (1 if l in fed else 0))
    return out


def added_parameters(g: IR) -> int:
    """Parameters the topology adds to the model (needs the IR's width)."""
    d = g.width
    if d is None:
        raise ValueError("the IR was built without a width; pass width= to build_ir")
    return sum(stream_parameters(a.method, a.streams, d, a.dynamic) if a.multi_stream
               and not a.is_head else
               aggregation_parameters(a.method, len(a.sources), d, a.query, a.key_norm,
                                      a.index) for a in g.aggregations())


def stream_parameters(method: str, n: int, d: int, dynamic: bool = False) -> int:
    """Parameters one multi-stream sublayer owns (../shared/hyper.md section 6; the head's
    sum of the streams owns none):
      SHC       n(n+2)                                      A_m, A_r, B
      DHC       2d + d(n+2) + n(n+2) + 2                    + LayerNorm(d), W_m, W_r, W_b,
                                                              s_alpha, s_beta
      mHC       nd(n^2+2n) + (n^2+2n) + 3                   phi, b, (a_pre, a_post, a_res)
      mHC-lite  nd(2n+n!) + (2n+n!) + 3                     the same with n! mixture logits
    (restopo's mHC-lite has no separate RMSNorm gain over nd: like mHC, it folds into phi.)"""
    if method == "hyper_connections":
        static = n * (n + 2)
        return static + (2 * d + d * (n + 2) + 2 if dynamic else 0)
    k = n * n if method == "mhc" else math.factorial(n)
    return n * d * (2 * n + k) + (2 * n + k) + 3


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


def mixing_matrix(g: IR) -> tuple[list[str], list[str], list[list[int]]]:
    """Which source feeds which aggregation: (source ids, aggregation ids, 0/1 rows).

    Rows are aggregations in execution order; columns the values any aggregation reads,
    in the order they are produced.
    """
    aggs = g.aggregations()
    cols = sorted({s for a in aggs for s in a.sources},
                  key=lambda s: (g.node(s).produced, s))
    rows = []
    for a in aggs:
        read = set(a.sources)
        rows.append([1 if c in read else 0 for c in cols])
    return cols, [a.id for a in aggs], rows


@dataclass(frozen=True)
class PhaseGroup:
    """Aggregations whose static queries all read the same completed sources.

    Phase 1 attends all of `members`' queries over `completed` in one batched pass; phase 2
    merges, per member in order, its own partial (None for a block's first sublayer).
    """

    completed: tuple[str, ...]
    members: tuple[str, ...]
    partials: tuple[str | None, ...]


def two_phase_plan(g: IR, within=None) -> list[PhaseGroup]:
    """Groups of >= 2 static-query softmax aggregations that read the same completed sources
    and differ at most by a trailing partial. The lowering runs them as phase 1 / phase 2;
    every other aggregation is lowered directly.

    within: only these aggregation indices take part (a pipeline chunk groups the points it
    owns); default every aggregation.
    """
    groups: dict[tuple, list[Aggregation]] = {}
    partial_ids = {v.id for v in g.values() if isinstance(v, Partial)}  # one set test a read
    for a in g.aggregations():
        if within is not None and a.index not in within:
            continue
        if a.method != "attend" or a.query != "static" or a.gate != "softmax":
            continue
        srcs = a.sources
        partial = srcs[-1] if srcs and srcs[-1] in partial_ids else None
        completed = srcs[:-1] if partial else srcs
        if not partial_ids.isdisjoint(completed):
            continue
        groups.setdefault((completed, a.key_norm, a.heads, a.block), []).append(a)
    plan = []
    for (completed, *_), members in groups.items():
        if len(members) < 2:
            continue
        partials = tuple(m.sources[-1] if len(m.sources) > len(completed) else None
                         for m in members)
        plan.append(PhaseGroup(completed, tuple(m.id for m in members), partials))
    return sorted(plan, key=lambda p: g.node(p.members[0]).index)
