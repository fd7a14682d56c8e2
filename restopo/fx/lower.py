"""Lower the topology IR to a torch.fx GraphModule: the fx emitter is a visitor of the one
walk over the IR (restopo.ir.walk), which fixes the order and the rules below.

The graph calls `embed` -> `context` -> for each sublayer l: its aggregation h_l, then
`sublayers.{l-1}` -> the head's aggregation -> `head`. Submodules, hence state_dict names:
  embed, context, sublayers.{i}, aggregations.{i}, phases.{k}, expand_streams,
  write_streams, head
where aggregations.{i} computes the input of sublayers.{i} (aggregations.{L} feeds the head),
phases.{k} runs phase 1 of the k-th two-phase group, and a multi-stream model's
expand_streams and write_streams make and update its n streams (these own no parameters).

How values become code (each is one line of `gm.code`):
- a standard-residual stream keeps one live value: `h3 = h2 + sublayer2`;
- stream updates (rezero, layerscale, highway) call their module on (h_{l-1}, v_{l-1});
- block sums and partials are running sums: `partial2_3 = sublayer3 + sublayer4`,
  `block2 = partial2_3 + sublayer5`, built on first use;
- a two-phase group (restopo.ir.two_phase_plan) runs phase 1 once, before its first member,
  and each member merges its pre-update partial: `h5 = aggregations_4(partial2_2,
  phase1=block2_phase1, slot=1)`; unless the backend is eager, a member whose sublayer
  takes `normed=` (restopo's own) also computes that sublayer's PreNorm in the same op,
  `h5_normed = aggregations_4(..., norm_weight=sublayers_4_norm_weight, norm_eps=1e-24)`,
  and the sublayer is called with `normed=True` (one fused kernel on the triton backend;
  phase 2 then the same norm on the eager one);
- every other aggregation calls its module on its sources in IR order;
- n streams: `streams1 = self.expand_streams(embedding)`; before sublayer l
  `mix1 = aggregations_0(streams1)` gives (h_l, post, R) and `h1 = mix1[0]`; after it
  `streams2 = self.write_streams(streams1, sublayer1, mix1)`; the head's module sums them.
"""
from __future__ import annotations

import copy
import inspect
import operator

import torch
from torch import fx, nn

from .. import ops
from ..ir import IR, Aggregation, PhaseGroup, Sublayer, stream_fed, two_phase_plan
from ..ir.walk import Visitor, walk
from ..nn.aggregate import EPS, Attend, TwoPhase, make_aggregation
from ..nn.parts import Parts
from ..nn.shared_sources import Reader, SharedSources
from ..nn.streams import StreamExpand, StreamWrite

STEP = "restopo_step"  # node.meta key: the walk's step that made the node (_Emitter._step)
SUBMODULES = ("embed", "context", "sublayers", "aggregations", "phases", "expand_streams",
              "write_streams", "head")


def lower(g: IR, parts: Parts, backend: str = "auto", two_phase: bool = True,
          aggregations: nn.ModuleList | None = None, share: bool = True) -> fx.GraphModule:
    """The GraphModule computing `parts` wired as the IR `g` says: forward(idx) -> logits.

    backend: auto | eager | triton, for the aggregation ops. two_phase=False lowers every
    aggregation directly (the same function; used to test the two-phase plan against it).
    aggregations: reuse these aggregation modules (one per aggregation node, in order)
    instead of making fresh ones, e.g. to view a trained model without the two-phase plan.
    share: let readers share each source's logits when training (restopo.nn.shared_sources).
    Its hooks go on the reader modules, so a lowering that reuses another model's modules
    and never trains (a decoder, a view, a writer of source) passes False: else every such
    lowering would leave one more hook on that model's modules.
    """
    ops.check_backend(backend)
    if backend in ("triton", "cpu"):
        ops.require_backend(backend)
    ops.load_backends(backend)
    kinds = g.kinds
    if kinds != parts.kinds:
        raise ValueError(f"the topology was built for sublayers {kinds} but the model has "
                         f"{parts.kinds}; build the IR from the model's sublayer kinds")
    d = g.width or _width_of(parts.embed)
    aggs = g.aggregations()
    root = nn.Module()
    root.embed, root.sublayers, root.head = parts.embed, parts.sublayers, parts.head
    if parts.context is not None:
        root.context = parts.context
    if aggregations is None:
        aggregations = nn.ModuleList(make_aggregation(a, d, backend) for a in aggs)
        # new parameters live where the model's do (a rewired model may be bf16 on CUDA)
        p = next((p for p in parts.embed.parameters() if p.is_floating_point()), None)
        if p is not None:
            aggregations.to(device=p.device, dtype=p.dtype)
    elif len(aggregations) != len(aggs):
        raise ValueError(f"got {len(aggregations)} aggregation modules for the IR's {len(aggs)}")
    root.aggregations = aggregations
    plan = two_phase_plan(g) if two_phase else []
    root.phases = nn.ModuleList(
        TwoPhase([root.aggregations[g.node(m).index - 1] for m in grp.members], backend)
        for grp in plan)
    if aggs[0].multi_stream:
        root.expand_streams, root.write_streams = StreamExpand(aggs[0].streams), StreamWrite()
    emitter = _Emitter(parts, fuse_norms=backend != "eager")
    graph = emitter.emit(g, plan)
    for name, norm in emitter.first_norms.items():
        root.get_submodule(name).fuse_first_norm(norm)
    gm = Lowered(root, graph, class_name="RestopoModel")
    _order_as_called(gm, graph)
    # GraphModule copies only what the graph calls; keep whole containers so every
    # aggregation (also ones lowered as plain adds) is in the module and its state_dict.
    for name in SUBMODULES:
        if hasattr(root, name):
            setattr(gm, name, getattr(root, name))
    gm.restopo_ir = g
    gm.restopo_context_names = emitter.context_names
    gm.backend = backend
    if share:
        _share_logits(gm, g, plan)
    return gm


# The attributes restopo keeps on a lowered model beside its modules: the IR, the spec and
# its overrides, the backend, the shared-logits state, the recompute mode, ...
KEPT_PREFIX, KEPT = "restopo_", ("backend", "spec_text")


class Lowered(fx.GraphModule):
    """The lowered model: an fx.GraphModule whose copies keep restopo's attributes.

    GraphModule's deepcopy rebuilds the module from what its graph calls and drops every
    other attribute, and its unpickling rebuilds a plain GraphModule: a copy of a compiled
    model (copy.deepcopy for an EMA or an evaluation twin, torch.save of the module) then
    lost its IR and spec, and decoding, export or recompute refused it. Here a deep copy
    takes the deep copies GraphModule made of them (in the same memo, so a copied
    shared-logits state refers to the copied modules), and an unpickled model is a Lowered
    again."""

    def __deepcopy__(self, memo):
        res = super().__deepcopy__(memo)
        copied = memo.get(id(self.__dict__), {})  # GraphModule deep-copied our __dict__
        for k, v in self.__dict__.items():
            if (k.startswith(KEPT_PREFIX) or k in KEPT) and k not in res.__dict__:
                setattr(res, k, copied[k] if k in copied else copy.deepcopy(v, memo))
        _attach_methods(res)
        return res

    def __reduce__(self):
        rebuild, args = super().__reduce__()
        return _lowered_again, (rebuild, args)


def _lowered_again(rebuild, args) -> Lowered:
    """Unpickling: GraphModule's rebuild (a plain GraphModule with all our attributes) made
    a Lowered again, its forward regenerated on its own class as GraphModule does."""
    gm = rebuild(*args)
    # named as GraphModule names the class it makes per instance, which its __new__ looks
    # past (a copy's class must derive from Lowered, not from this instance's class)
    impl = type("GraphModuleImpl", (Lowered,), {})
    impl.__name__ = type(gm).__name__
    gm.__class__ = impl
    gm.recompile()
    _attach_methods(gm)
    return gm


def give_method(gm: fx.GraphModule, name: str, fn) -> None:
    """Make `fn` (a module-level function, so pickle can name it) a method of this model:
    fx gives each GraphModule a class of its own, and a copy (deepcopy, pickle) a fresh one,
    so the method is kept in `restopo_methods` and put on each copy's class again."""
    gm.restopo_methods = {**getattr(gm, "restopo_methods", {}), name: fn}
    setattr(type(gm), name, fn)


def _attach_methods(gm: fx.GraphModule) -> None:
    for name, fn in getattr(gm, "restopo_methods", {}).items():
        setattr(type(gm), name, fn)


def _share_logits(gm: fx.GraphModule, g: IR, plan) -> None:
    """Let the static-query readers of each source share its logits and gradient buffer
    (restopo.nn.shared_sources): the Attend modules called on their sources, and the
    two-phase groups' phase 1."""
    members = {m for grp in plan for m in grp.members}
    readers = [Reader(gm.aggregations[a.index - 1], tuple(a.sources), 1)
               for a in g.aggregations()
               if a.method == "attend" and a.query == "static" and a.id not in members]
    readers += [Reader(gm.phases[k], tuple(grp.completed), len(grp.members))
                for k, grp in enumerate(plan)]
    if readers:
        gm.restopo_shared = SharedSources(readers, EPS)  # also for recompute's regions
        gm.restopo_shared.install(gm)


def _order_as_called(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """Submodules in the order the graph first calls them. GraphModule registers them in
    the order of first use, get_attr included, so a fused PreNorm's get_attr of
    `sublayers.{i}.norm.weight` would move `sublayers` up: the parameter order (optimizer
    state, checkpoints) would then depend on the backend."""
    called = [n.target.split(".")[0] for n in graph.nodes if n.op == "call_module"]
    for name in list(dict.fromkeys(called)) + [k for k in gm._modules if k not in called]:
        gm._modules[name] = gm._modules.pop(name)


def _width_of(embed: nn.Module) -> int:
    w = getattr(embed, "weight", None)
    if w is None or w.dim() != 2:
        raise ValueError("the IR has no width and the embedding has no [vocab, d] weight; "
                         "build the IR with width=")
    return w.shape[1]


class _Emitter(Visitor):
    """The walk's visitor that writes the fx Graph: one node per value, named after the IR."""

    def __init__(self, parts: Parts, fuse_norms: bool = False):
        self.parts = parts
        self.fuse_norms = fuse_norms
        self.normed: set[int] = set()  # sublayers whose input is already RMSNorm(h)
        self.graph = fx.Graph()
        self.context: list[fx.Node] = []
        self.context_names: tuple[str, ...] | None = None
        self.pending: list[fx.Node] = []  # made since the last _step
        # a phase-1 module's name -> the PreNorm of its group's first member, fused into
        # phase 2 (phase 1 then makes it when autograd does not record)
        self.first_norms: dict[str, nn.RMSNorm] = {}

    def node(self, op: str, target, args=(), kwargs=None, name: str | None = None) -> fx.Node:
        n = self.graph.create_node(op, target, tuple(args), kwargs or {}, name=name)
        self.pending.append(n)
        return n

    def _step(self, i: int) -> None:
        """Tag the nodes made since the last tag as part of the walk's step for sublayer i
        (0: embedding, L + 1: head), in node.meta[STEP]: the regions of recompute
        (restopo.fx.recompute) are runs of steps. A step holds h_i's nodes, sublayer i and
        what the walk computes right after it (its stream write, a stream-fed h_{i+1})."""
        for n in self.pending:
            n.meta[STEP] = i
        self.pending = []

    def emit(self, g: IR, plan) -> fx.Graph:
        self.g = g
        logits = walk(g, self, plan).output
        self.node("output", "output", (logits,))
        self.graph.lint()
        return self.graph

    # -- the walk's steps
    def embedding(self) -> fx.Node:
        idx = self.node("placeholder", "idx", name="idx")
        embedding = self.node("call_module", "embed", (idx,), name="embedding")
        if self.parts.context is not None:
            names = self.context_names = self.parts.context_names or _probe_context(self.parts)
            ctx = self.node("call_module", "context", (idx, embedding), name="context")
            self.context = [self.node("call_function", operator.getitem, (ctx, i), name=n)
                            for i, n in enumerate(names)]
        self._step(0)
        return embedding

    def sublayer(self, node: Sublayer, h: fx.Node) -> fx.Node:
        kwargs = {"normed": True} if node.index in self.normed else None
        v = self.node("call_module", f"sublayers.{node.index - 1}", (h, *self.context),
                      kwargs, name=node.id)
        self._step(node.index)
        return v

    def add(self, a: fx.Node, b: fx.Node, name: str) -> fx.Node:
        return self.node("call_function", operator.add, (a, b), name=name)

    def stream_update(self, agg: Aggregation, h_prev: fx.Node, v_prev: fx.Node) -> fx.Node:
        return self.node("call_module", _target(agg), (h_prev, v_prev), name=f"h{agg.index}")

    def aggregate(self, agg: Aggregation, sources: list[fx.Node]) -> fx.Node:
        return self.node("call_module", _target(agg), sources, name=f"h{agg.index}")

    def phase1(self, k: int, group: PhaseGroup, completed: list[fx.Node]) -> fx.Node:
        block = self.g.node(group.members[0]).block
        return self.node("call_module", f"phases.{k}", completed, name=f"block{block}_phase1")

    def phase2(self, agg: Aggregation, phase1: fx.Node, slot: int,
               partial: fx.Node | None) -> fx.Node:
        kwargs, name = {"phase1": phase1, "slot": slot}, f"h{agg.index}"
        norm = self._fusable_norm(agg)
        if norm is not None:  # the value is the sublayer's normalised input, not h
            target = f"sublayers.{agg.index - 1}.norm.weight"
            kwargs["norm_weight"] = (None if norm.weight is None else
                                     self.node("get_attr", target, name=target.replace(".", "_")))
            kwargs["norm_eps"] = float(norm.eps)
            self.normed.add(agg.index)
            if slot == 0 and partial is None:
                self.first_norms[phase1.target] = norm
            name += "_normed"
        return self.node("call_module", _target(agg), [] if partial is None else [partial],
                         kwargs, name=name)

    def _fusable_norm(self, agg: Aggregation) -> nn.RMSNorm | None:
        """The PreNorm of the sublayer `agg` feeds, when phase 2 may compute it: the backend
        is not eager and the sublayer takes `normed=` and has an RMSNorm over the width
        (restopo's own sublayers and a decoder's cached attention; not a rewired model's)."""
        if not self.fuse_norms or agg.is_head:
            return None
        # the next point reads h itself (a stream update, rezero at the head after two-phase
        # sublayers): h must be kept, so the norm is the sublayer's own
        if stream_fed(self.g, self.g.aggregation(agg.index + 1)):
            return None
        sub = self.parts.sublayers[agg.index - 1]
        norm = getattr(sub, "norm", None)
        if (not isinstance(norm, nn.RMSNorm) or norm.eps is None
                or len(norm.normalized_shape) != 1
                or "normed" not in inspect.signature(sub.forward).parameters):
            return None
        return norm

    def expand(self, agg: Aggregation, v0: fx.Node) -> fx.Node:
        return self.node("call_module", "expand_streams", (v0,), name="streams1")

    def read(self, agg: Aggregation, x: fx.Node):
        mix = self.node("call_module", _target(agg), (x,), name=f"mix{agg.index}")
        h = self.node("call_function", operator.getitem, (mix, 0), name=f"h{agg.index}")
        return h, mix

    def write(self, agg: Aggregation, x: fx.Node, v: fx.Node, mix: fx.Node) -> fx.Node:
        out = self.node("call_module", "write_streams", (x, v, mix),
                        name=f"streams{agg.index + 1}")
        self._step(agg.index)
        return out

    def aggregated(self, agg: Aggregation, inputs, h, stream: bool) -> None:
        if stream and agg.index > 1:  # a stream-fed h_l is made right after sublayer l - 1
            self._step(agg.index - 1)

    def head(self, h: fx.Node) -> fx.Node:
        logits = self.node("call_module", "head", (h,), name="logits")
        self._step(self.g.n_sublayers + 1)
        return logits


def _target(agg: Aggregation) -> str:
    return f"aggregations.{agg.index - 1}"


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
    return Parts(embed=gm.embed, sublayers=gm.sublayers, kinds=gm.restopo_ir.kinds,
                 head=gm.head, context=getattr(gm, "context", None),
                 context_names=gm.restopo_context_names)


def aggregation_modules(model: nn.Module) -> list[nn.Module]:
    """The aggregation modules of a lowered model in execution order (the head's last)."""
    return list(lowered(model).aggregations)


def attend_modules(model: nn.Module) -> list[Attend]:
    return [m for m in aggregation_modules(model) if isinstance(m, Attend)]
