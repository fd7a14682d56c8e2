"""Residual memory I/O per token per sublayer: what the residual machinery reads and writes
in the forward pass, unfused, in units of d (plus coefficient scalars), read off the IR.

The accounting is the one of the Attention Residuals paper's Table 1 (and, for the
multi-stream rows, mHC's Table 2 as restated in ../shared/hyper.md section 6); it excludes
every sublayer's own internals. Sublayer l is charged what is done around it: computing its
input h_l and bringing the residual state up to date with its output v_l. The head's
aggregation runs once per model and is reported apart. Per step (reads, writes):

  standard stream     h_{l+1} = h_l + v_l                                     2d, d
  ReZero, LayerScale  h_{l+1} = h_l + a v_l                                   2d, d
  Highway             g = gate(h_l) is written, then h_{l+1} = h_l + g (v_l - h_l)
                                                                              4d, 2d
  direct aggregation  h_l from its k sources in one pass (Full AttnRes as restopo runs it,
                      DenseFormer, windows)                                   kd, d
  running sum         a partial or block sum a direct aggregation reads, p + v   2d, d
  two-phase member    phase 1 reads the group's K completed sources once and writes one
                      result per member: amortised over its S members        K/S d, d
                      phase 2 reads the previous partial, v_{l-1} and that result and
                      writes the new partial (h_l goes straight into the sublayer's
                      norm, the paper's fusion)                               3d, d
  n streams           coefficients nd, n^2+2n; pre nd+n, d; post d+n, nd; res nd+n^2, nd;
                      merge 2nd, nd (static HC has no coefficient step)

so the paper's rows come out as: standard 3d; Block AttnRes (N/S + 5)d at its last block
(N completed sources read by phase 1, S sublayers per block); mHC, DHC, mHC-lite
(8n+2)d + 2n^2 + 4n = 34d + 48 at n = 4; SHC (7n+2)d + n^2 + 2n.

Full AttnRes with the paper's two-phase schedule (its N groups of S sublayers are a
scheduling choice, not part of the topology: the IR lowers Full directly, and only the cpu
backend's training runs groups of readers in two phases, restopo.nn.shared_sources) is
`two_phase_full(g, S)`: phase 1 reads what was produced before the group, amortised, and
writes one result per member; phase 2 reads the member's in-group sources and writes h_l.
Its peak is (S + N)d plus the embedding's d/S, which the paper's (S + N)d leaves out.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .analyses import is_multi_stream, stream_fed, two_phase_plan
from .graph import IR
from .nodes import Aggregation, BlockSum, Partial


@dataclass(frozen=True)
class Cost:
    """Elements one token moves: reads and writes in units of d, and coefficient scalars."""

    reads: float = 0.0
    writes: float = 0.0
    scalars: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.reads + other.reads, self.writes + other.writes,
                    self.scalars + other.scalars)

    @property
    def d(self) -> float:
        """reads + writes, in units of d."""
        return self.reads + self.writes

    def __str__(self) -> str:
        text = f"{_num(self.d)}d"
        return f"{text} + {self.scalars}" if self.scalars else text


def stream_step(n: int, static: bool = False) -> Cost:
    """One multi-stream sublayer, unfused [mHC Tab.2; hyper.md section 6]."""
    coeff = Cost(0 if static else n, 0, 0 if static else n * n + 2 * n)
    pre = Cost(n, 1, n)
    post = Cost(1, n, n)
    res = Cost(n, n, n * n)
    merge = Cost(2 * n, n)
    return coeff + pre + post + res + merge


STANDARD = Cost(2, 1)
RUNNING_SUM = Cost(2, 1)
PHASE2 = Cost(3, 1)
_UPDATES = {"sum": STANDARD, "rezero": STANDARD, "layerscale": STANDARD,
            "highway": Cost(4, 2)}


@dataclass(frozen=True)
class ResidualIO:
    """The residual I/O of one topology: per sublayer (l = 1..L), at the head, and the
    paper's formula for the schedule when it has one."""

    per_sublayer: tuple[Cost, ...]
    head: Cost
    formula: str | None

    @property
    def peak(self) -> Cost:
        return max(self.per_sublayer, key=lambda c: (c.d, c.scalars))

    @property
    def mean(self) -> float:
        return sum(c.d for c in self.per_sublayer) / len(self.per_sublayer)

    def to_json(self) -> dict:
        p = self.peak
        return {"peak_d": _round(p.d), "reads_d": _round(p.reads), "writes_d": _round(p.writes),
                "scalars": p.scalars, "mean_d": _round(self.mean), "head_d": _round(self.head.d),
                "formula": self.formula}


def residual_io(g: IR) -> ResidualIO:
    """The residual I/O of the schedule restopo runs for `g` (its two-phase plan included)."""
    L = g.n_sublayers
    per = [Cost() for _ in range(L + 1)]  # per[l], l = 1..L
    if is_multi_stream(g):
        a = g.aggregation(1)
        step = stream_step(a.streams, static=a.method == "hyper_connections" and not a.dynamic)
        per = [step] * L
        static = step.scalars < stream_step(a.streams).scalars
        # dynamic HC moves what mHC moves: Table 1's mHC row, named as what it counts
        formula = ("static HC, (7n + 2)d + n^2 + 2n" if static else
                   ("Table 1 mHC" if a.method == "mhc" else "dynamic HC, as Table 1 mHC")
                   + ", (8n + 2)d + 2n^2 + 4n") + f" with n = {a.streams}"
        return ResidualIO(tuple(per), Cost(a.streams, 1), formula)
    groups = two_phase_plan(g)
    member = {m: grp for grp in groups for m in grp.members}
    added: set[int] = set()  # sublayers whose output a running sum adds on
    head = Cost()
    for a in g.aggregations():
        if stream_fed(g, a):
            cost = Cost() if a.index == 1 else _UPDATES[a.method]
            # the update after sublayer l-1 (the head's is the one after sublayer L)
            per[a.index - 1] += cost
            continue
        if a.id in member:
            grp = member[a.id]
            cost = Cost(len(grp.completed) / len(grp.members), 1) + PHASE2
        else:
            cost = Cost(len(a.sources), 1)
            for s in a.sources:  # running sums: p^{j+1} = p^j + v, one add per later member
                if isinstance(g.node(s), (Partial, BlockSum)):
                    added.update(g.node(s).members[1:])
        if a.is_head:
            head = cost
        else:
            per[a.index] += cost
    for i in added:  # a two-phase member's phase 2 keeps its block's running sum itself
        if f"agg{i}" not in member:
            per[i] += RUNNING_SUM
    return ResidualIO(tuple(per[1:]), head, _formula(g, groups))


def _formula(g: IR, groups) -> str | None:
    aggs = g.aggregations()
    if all(stream_fed(g, a) for a in aggs):
        return "Table 1 standard residual, 3d" if all(a.method == "sum" for a in aggs) else None
    members = {m for grp in groups for m in grp.members}
    if members and all(a.id in members for a in aggs[:-1]):
        return "Table 1 Block AttnRes two-phase, (N/S + 5)d at the last block"
    if not members and not any(stream_fed(g, a) for a in aggs):
        return "direct, (k + 1)d over k sources (+ 3d per running sum added)"
    return None


def two_phase_full(g: IR, group: int) -> ResidualIO:
    """Direct static softmax attend points run as the paper's two-phase Full AttnRes over
    consecutive groups of `group` sublayers (see the module docstring); other points as
    `residual_io` counts them."""
    return _grouped(g, group, residual_io(g), _produced(g, _groupable(g)))


def best_two_phase_full(g: IR) -> ResidualIO | None:
    """`two_phase_full` at the group size with the smallest peak (None when no point can
    be grouped: the topology has no direct static softmax attention). The graph is read
    once for all the sizes tried (each divisor of L): reading it per size made `restopo
    inspect` of a deep Full AttnRes spec take minutes."""
    groupable = _groupable(g)
    if not groupable:
        return None
    L = g.n_sublayers
    base, produced = residual_io(g), _produced(g, groupable)
    sizes = [s for s in range(2, L + 1) if L % s == 0] or [L]
    return min((_grouped(g, s, base, produced) for s in sizes), key=lambda r: r.peak.d)


def _produced(g: IR, points: list[Aggregation]) -> dict[int, list[int]]:
    """Each point's sources by where they are produced (sorted), keyed by its index."""
    return {a.index: sorted(g.node(s).produced for s in a.sources) for a in points}


def _grouped(g: IR, group: int, base: ResidualIO, produced: dict[int, list[int]]
             ) -> ResidualIO:
    L = g.n_sublayers
    per = list(base.per_sublayer)
    for index, made in produced.items():
        first = (index - 1) // group * group + 1  # the group's first sublayer
        size = min(group, L - first + 1)
        before = bisect.bisect_left(made, first)  # sources produced before the group
        inside = len(made) - before
        per[index - 1] = (per[index - 1] + Cost(-len(made), -1)
                          + Cost(before / size, 1) + Cost(inside, 1))
    N = -(-L // group)
    if all(made == list(range(index)) for index, made in produced.items()):
        formula = f"Table 1 Full AttnRes two-phase, (S + N)d + d/S with S = {group}, N = {N}"
    else:  # some point reads fewer (a window): the paper's formula would overstate it
        formula = (f"groups of S = {group}, phase 1 reading each point's sources from before "
                   f"its group")
    return ResidualIO(tuple(per), base.head, formula)


def _groupable(g: IR) -> list[Aggregation]:
    """The sublayers' direct static softmax attention points over single outputs."""
    planned = {m for grp in two_phase_plan(g) for m in grp.members}
    return [a for a in g.aggregations()[:-1]
            if a.method == "attend" and a.query == "static" and a.gate == "softmax"
            and a.id not in planned
            and not any(isinstance(g.node(s), (Partial, BlockSum)) for s in a.sources)]


def _round(x: float) -> float:
    return round(float(x), 6)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"
