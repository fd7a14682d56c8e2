"""What the readers of one source share: its logits, and (eager) one gradient buffer.

In Full AttnRes every source v_i is read by every later aggregation point. Made inside each
reader, its logit w_l . RMSNorm_l(v_i) costs a pass over v_i per reader, forward and backward,
and recomputes v_i's RMS every time. With static queries they are one matmul:
z_i = (v_i @ [g_l * w_l]_l) * rstd_i (ops.logits_against), made at the first read of v_i; each
later reader takes its column, and autograd sums the readers' gradients once, in one unbind.
The readers' weighted sums likewise add their parts of v_i's gradient into one buffer in
place (ops.gathered) rather than each handing autograd a new d-sized tensor to add up, and
so do the logits, made from the same gathered view.

`SharedSources` is built by the lowering from the IR: which readers (static-query Attend
modules lowered directly, and two-phase groups, whose phase 1 reads the completed blocks) read
each source. It shares only within one forward of the lowered model (hooks open and close
that scope), and nothing outlives it. A forward pre-hook hands each reader its sources'
shared form and a `logits=` keyword; outside the model's forward, without autograd, under
torch.compile or on a backend other than eager and cpu (SHARING), readers make their own.

On the cpu backend, runs of about sqrt(R) consecutive Full AttnRes readers (R of them) are
also computed in two phases (`Group`): the first of a run to be called makes phase 1 for
the whole run over the sources all of them read, given their shared logits (one pass over
each source for the run, which the cpu kernel's weighted sums make with each output row
summed in registers), and each reader then merges phase 1's (h1, lse) with the sources it
reads besides, by the same softmax over [lse, its other logits]. The eager backend's
weighted sums read a source once per output either way, so it computes each reader alone.
Each reader's h1 lives from its run's start to its call, and autograd keeps it: one more
d-sized tensor per reader, for a pass per source per run instead of per reader.
A reader that shares no source's logits with another (`_alone`: Block AttnRes's output
aggregation) makes its own there, in its fused kernel. There a source's logits are split
rather than unbound (`_pieces`): a run takes its members' rows, consecutive, as one piece.

A region that torch.utils.checkpoint recomputes (restopo.fx.recompute) must make the same
ops in its forward and in its recomputation, in backward, where the model's scope is closed.
So the logits of the sources it takes from outside are made outside it (`outside`: in the
model's scope, once per forward against all their readers, as without recompute), and the
region runs inside `region(modules, outside)`, a scope of its own that starts from just
those records, in its forward and again in its recomputation; the sources it makes itself
are shared among its own readers only.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops


@dataclass(frozen=True)
class Reader:
    """One reader: its module (an Attend or a TwoPhase), the IR ids of the sources whose
    logits it takes, in the order it is called with them, and its number of queries."""

    module: nn.Module
    sources: tuple[str, ...]
    queries: int


@dataclass(frozen=True)
class Group:
    """Consecutive static softmax Attend readers that read `common` sources all: the first
    to run makes their phase 1 over those once (ops.phase1 given the shared logits: one
    pass over the sources for all of them, where each reader alone would pass over every
    source again), and each then merges what it reads besides (Full AttnRes computed in two
    phases, as the paper schedules it)."""

    index: int
    members: tuple[Reader, ...]
    common: tuple[str, ...]

    @functools.cached_property
    def slot(self) -> dict:
        """Each member module's place in the group."""
        return {m.module: k for k, m in enumerate(self.members)}

    @functools.cached_property
    def besides(self) -> dict:
        """The sources each member module reads besides the common ones, in its order."""
        return {m.module: tuple(s for s in m.sources if s not in self.common)
                for m in self.members}


def _members(module: nn.Module) -> tuple:
    return getattr(module, "members", (module,))


def gained_queries(*modules: nn.Module) -> torch.Tensor:
    """[R, d]: the queries of readers `modules`, in order, with their key-norm gains folded
    in (one multiply for all: readers of one kind all have a gain or none)."""
    members = [m for module in modules for m in _members(module)]
    queries = torch.stack([m.pseudo_query for m in members])
    if members[0].gain is None:
        return queries
    # as every aggregation folds its gain: in at least fp32 (a bf16 product would round
    # the query its logits are taken with)
    return ops.fold_gain(queries, torch.stack([m.gain for m in members]), True)


def _kind(module: nn.Module) -> tuple[bool, int]:
    """What a reader's logits depend on besides its queries: key norm or not, and heads."""
    first = _members(module)[0]
    return first.key_norm is not None, first.heads


# The backends whose readers share: the eager one (logits and gradient buffer) and the cpu
# one, whose depth attention takes the shared logits (its phase-1 kernel, making them again
# from every source, measured slower in Full AttnRes: 1.61 against 1.36x standard) and
# whose fused phase 1 makes its own; both of its kernels add their part of a source's
# gradient into the shared buffer.
SHARING = ("eager", "cpu")


class SharedSources:
    """The readers of each source, and (inside a scope) what they share so far."""

    def __init__(self, readers: list[Reader], eps: float):
        self.eps = eps
        self.readers = {r.module: r for r in readers}
        # per kind: its readers in order, and each one's first row in their stacked queries
        self.order: dict[tuple, list[Reader]] = {}
        for r in readers:
            self.order.setdefault(_kind(r.module), []).append(r)
        self.row = {}
        for group in self.order.values():
            at = 0
            for r in group:
                self.row[r.module], at = at, at + r.queries
        self.by_source: dict[tuple, list[Reader]] = {}
        for r in readers:
            for s in dict.fromkeys(r.sources):
                self.by_source.setdefault((s, _kind(r.module)), []).append(r)
        self.alone = _alone(readers)
        self.groups = _groups(readers)
        self.group_of = {r.module: g for g in self.groups for r in g.members}
        # What a forward would otherwise re-derive at every read, fixed by the IR: each
        # reader's kind, and (`_plan`) each source's readers and their rows of the queries.
        self.kind = {r.module: _kind(r.module) for r in readers}
        self.phase1s = frozenset(r.module for r in readers if hasattr(r.module, "members"))
        self._plans: dict[tuple, tuple] = {}
        self._records: dict | None = None  # what this forward shares so far (None: none open)
        self._within: frozenset | None = None  # a region's readers, inside region()
        self._given: frozenset = frozenset()  # the keys of the records it was given

    def __getstate__(self):  # an open scope is one forward's, never a copy's
        return {**self.__dict__, "_records": None, "_within": None, "_given": frozenset()}

    def outside(self, uses) -> dict:
        """The records of the sources a region's readers take from outside it, made now in
        the model's scope if not yet: `uses` [(reader module, position among its sources,
        value)]. Empty where nothing is shared (no scope, no autograd, compiling)."""
        records = self._records
        if records is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return {}
        got = {}
        for module, i, v in uses:
            if ops.picked(module.backend, v) not in SHARING:
                continue
            key = (self.readers[module].sources[i], _kind(module))
            got[key] = self._record(records, key, v, split=False)  # rows for the region's
        got.update((k, q) for k, q in records.items() if k[0] == "queries")
        return got

    @contextlib.contextmanager
    def region(self, modules, outside: dict):
        """A scope for the readers among `modules` (a recomputed region's) that starts from
        the records `outside` made for it."""
        outer = self._records, self._within, self._given
        self._records, self._within = dict(outside), frozenset(modules)
        # the region's inputs are these records' sources, though not always the same
        # tensor objects in its recomputation (checkpoint saves and unpacks them)
        self._given = frozenset(outside)
        try:
            yield
        finally:
            self._records, self._within, self._given = outer

    def install(self, model: nn.Module) -> None:
        """Open a scope around every forward of `model` and hand each reader its share."""
        self._scope_hooks(model)
        # fx.GraphModule's deepcopy drops forward hooks (its readers keep theirs) but copies
        # `_deepcopy_hooks` along and calls each with the copy: this object's slot in the
        # copy's list is this object's copy, which then hooks the copied model.
        hooks = model.__dict__.setdefault("_deepcopy_hooks", [])
        self._slot = len(hooks)
        hooks.append(self._copied)
        for module in self.readers:
            module.register_forward_pre_hook(self._inject, with_kwargs=True)

    def _scope_hooks(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._open)
        model.register_forward_hook(self._close, always_call=True)  # also when it raises

    def _copied(self, copy: nn.Module) -> None:
        copy.__dict__["_deepcopy_hooks"][self._slot].__self__._scope_hooks(copy)

    def _open(self, model, args) -> None:
        if not torch.compiler.is_compiling():
            self._records = {}

    def _close(self, model, args, output) -> None:
        if not torch.compiler.is_compiling():
            self._records = None

    def _inject(self, module, args, kwargs):
        # First: a compiled region (restopo.train.compile) traces this hook, and any lookup
        # below would make dynamo guard on this reader's identity, one recompile per reader.
        if torch.compiler.is_compiling():
            return None
        if kwargs.get("phase1") is not None or kwargs.get("logits") is not None:
            return None  # an Attend's phase 2, or logits already given
        shared = self.shared(module, args)
        if shared is None:
            return None
        sources, logits = shared
        return sources, {**kwargs, "logits": logits}

    def shared(self, module: nn.Module, sources):
        """(the sources' shared forms, their logits: [*batch, H] each for an Attend,
        [S, *batch, H] for a two-phase group, or None for a fused phase 1) for reader
        `module`, or None where it makes its own."""
        reader, records = self.readers.get(module), self._records
        if (reader is None or records is None or torch.compiler.is_compiling()
                or not torch.is_grad_enabled() or len(sources) != len(reader.sources)
                or (self._within is not None and module not in self._within)):
            return None
        picked = ops.picked(module.backend, sources[0])
        if picked not in SHARING:
            return None
        group = self.group_of.get(module)
        if group is not None and picked == "cpu" and self._within is None:
            return self._grouped(records, group, reader, sources)
        kind = self.kind[module]
        shared, logits = [], []
        for sid, v in zip(reader.sources, sources):
            _, view, columns, starts = self._record(records, (sid, kind), v)
            shared.append(view)
            if module not in starts:  # a fused phase 1 (cpu backend) makes its own logits
                logits = None
                continue
            start = starts[module]
            logits.append(columns[start] if reader.queries == 1 and module not in self.phase1s
                          else torch.stack(columns[start:start + reader.queries]))
        return tuple(shared), logits

    def _grouped(self, records: dict, group: Group, reader: Reader, sources):
        """(h1 of `reader`'s slot and the views of the sources it reads besides the group's
        common ones, their logits: lse and the shared columns). The group's phase 1 is made
        at its first member's call, from the common sources' shared logits."""
        module = reader.module
        kind = self.kind[module]
        given = dict(zip(reader.sources, sources))
        state = records.get(("group", group.index))
        if state is None:
            views, logits = [], []
            for sid in group.common:
                _, view, columns, starts = self._record(records, (sid, kind), given[sid])
                views.append(view)
                piece = starts.get(("group", group.index))  # the members' rows, one piece
                logits.append(columns[piece] if piece is not None else
                              tuple(columns[starts[m.module]] for m in group.members))
            queries = self._queries(records, kind, group.members)  # (their shapes)
            h1, lse, _ = ops.phase1(views, queries, None, self.eps, key_norm=kind[0],
                                    heads=kind[1], backend=module.backend, logits=logits)
            state = records[("group", group.index)] = (h1, lse)
        slot = group.slot[module]
        views, logits = [state[0][slot]], [state[1][slot]]
        for sid in group.besides[module]:
            _, view, columns, starts = self._record(records, (sid, kind), given[sid])
            views.append(view)
            logits.append(columns[starts[module]])
        return tuple(views), logits

    def _record(self, records: dict, key: tuple, v: torch.Tensor, split: bool = True):
        """The record of source `key` = (id, kind) holding value `v`, made if this scope has
        none for `v` yet (a region's given records stand for their sources, see region).
        `split` False: its logits a row a reader (for a recomputed region's readers, which
        read each source alone), never a group's piece."""
        record = records.get(key)
        if record is None or (record[0] is not v and key not in self._given):
            record = records[key] = self._make(records, key[0], key[1], v, split)
        return record

    def _make(self, records: dict, sid: str, kind: tuple[bool, int], v: torch.Tensor,
              split: bool = True):
        """(v, its gathered view, its logits' columns or pieces, each consumer's first
        column or its piece)."""
        readers = self.by_source[(sid, kind)]
        fused = ops.picked(readers[0].module.backend, v) == "cpu"  # its phase 1 is fused
        readers, rows, starts, sizes = self._plan(sid, kind, fused, split)
        if not readers:
            return v, ops.gathered(v), None, {}
        queries = self._queries(records, kind, readers, rows)
        key_norm, heads = kind
        view = ops.gathered(v)  # the logits' gradient, too, is added into its buffer
        z = ops.logits_against(view, queries, self.eps, key_norm=key_norm, heads=heads)
        return v, view, (z.unbind(0) if sizes is None else z.split(sizes)), starts

    def _plan(self, sid: str, kind: tuple, fused: bool, split: bool = True):
        """(the readers that take source `sid`'s logits, their rows in the kind's stacked
        queries (a slice where consecutive), each consumer's first row or (`_pieces`) its
        piece, the pieces' sizes or None): fixed by the IR, derived once; inside a
        recomputed region, for its readers only."""
        key = (sid, kind, fused, self._within, split)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        readers = [r for r in self.by_source[(sid, kind)]
                   if self._within is None or r.module in self._within]
        if fused:  # phase 1s make their own logits, and so does a reader alone
            readers = [r for r in readers
                       if r.module not in self.phase1s and r.module not in self.alone]
        rows = self._rows(readers)
        starts, at = {}, 0
        for r in readers:
            starts[r.module], at = at, at + r.queries
        pieces = (self._pieces(sid, readers) if fused and split and self._within is None
                  else None)
        if pieces is not None:
            starts = pieces[1]
        plan = self._plans[key] = (readers, rows, starts, pieces and pieces[0])
        return plan

    def _pieces(self, sid: str, readers: list[Reader]):
        """(split sizes, each consumer's piece) of source `sid`'s logits on the cpu backend:
        a group that reads it in common takes its members' rows as one piece [S, *batch,
        H] (the rows of consecutive readers), every other reader its own row [1, *batch,
        H], so a group's phase 1 takes one tensor a source where it took S columns, S
        autograd edges each way. None where a group's rows are not consecutive."""
        sizes, index = [], {}
        for r in readers:
            group = self.group_of.get(r.module)
            who = (("group", group.index) if group is not None and sid in group.common
                   else r.module)
            if who in index and index[who] != len(sizes) - 1:
                return None
            if who in index:
                sizes[-1] += r.queries
            else:
                index[who] = len(sizes)
                sizes.append(r.queries)
        return sizes, index

    def _rows(self, readers) -> slice | list[int]:
        """`readers`' rows in their kind's stacked queries: a slice where consecutive."""
        rows = [self.row[r.module] + k for r in readers for k in range(r.queries)]
        if rows and rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return rows

    def _queries(self, records: dict, kind, readers, rows=None) -> torch.Tensor:
        """The stacked queries of `readers` (at `rows` of the kind's, where known): rows of
        every reader's, stacked once a scope, in one multiply by their gains."""
        every = records.get(("queries", kind))
        if every is None:
            every = records[("queries", kind)] = gained_queries(
                *(r.module for r in self.order[kind]))
        rows = self._rows(readers) if rows is None else rows
        if isinstance(rows, slice):
            return every[rows]
        return every[torch.tensor(rows, device=every.device)]


def _alone(readers: list[Reader]) -> frozenset:
    """The Attend readers that share no source's logits with another Attend reader (Block
    AttnRes's output aggregation, the only one to read the block sums besides their phase
    1s). On the cpu backend such a reader makes its own logits in its fused kernel, in the
    same pass as its weighted sum, rather than taking them made apart, a matmul, an rstd
    and an autograd node a source, forward and backward, for no reader to share."""
    count: dict[tuple, int] = {}
    attend = [r for r in readers if not hasattr(r.module, "members")]
    for r in attend:
        for s in dict.fromkeys(r.sources):
            count[(s, _kind(r.module))] = count.get((s, _kind(r.module)), 0) + 1
    return frozenset(r.module for r in attend
                     if all(count[(s, _kind(r.module))] == 1 for s in r.sources))


def _groups(readers: list[Reader]) -> list[Group]:
    """Runs of about sqrt(R) consecutive static softmax Attend readers (R of them), of one
    kind, as groups over the sources they all read: a source is then read about R / sqrt(R)
    times by phase 1s and sqrt(R) / 2 times by merges, not R / 2 times. A run whose readers
    share fewer than two sources stays ungrouped (phase 1 would save nothing)."""
    attend = [r for r in readers if not hasattr(r.module, "members")
              and getattr(r.module, "gate", None) == "softmax" and r.queries == 1]
    size = max(2, round(len(attend) ** 0.5))
    groups, run = [], []
    for r in attend + [None]:
        if run and (r is None or len(run) == size or _kind(r.module) != _kind(run[0].module)):
            common = tuple(s for s in dict.fromkeys(run[0].sources)
                           if all(s in m.sources for m in run[1:]))
            if len(run) > 1 and len(common) > 1:
                groups.append(Group(len(groups), tuple(run), common))
            run = []
        if r is not None:
            run.append(r)
    return groups
