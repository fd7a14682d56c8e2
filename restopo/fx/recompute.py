"""Activation recompute (`train.recompute`): what backward keeps is a region's inputs, and
each region runs again in backward (torch.utils.checkpoint, non-reentrant).

  none      autograd keeps what every op saves.
  sublayer  a region is one sublayer (attention or MLP with its PreNorm): it keeps its
            input h_l and recomputes the rest. Applied to the sublayer modules themselves
            (torch's composable checkpoint, hooks, no renamed parameters), so it holds
            wherever they run: the lowered model, DDP, FSDP2 (applied before fully_shard,
            the order torch supports), a pipeline chunk.
  block     a region is one transformer layer: the walk's steps from its attention sublayer
            up to the next one (restopo.fx.lower tags each node with its step): the
            aggregations that make the layer's inputs h_l (with the running sums and the
            two-phase group's phase 1 they build), its sublayers, the stream writes, and a
            stream-fed h_{l+1} made right after its last sublayer. The embedding and the
            head's aggregation and head are outside every region. The lowered graph calls
            each region as one module (`regions.{k}`, owning no parameters, so state_dict
            and checkpoints are the same in every mode) on the values it reads from outside:
            a standard stream's region keeps h_l alone, a Full AttnRes region the sources it
            reads, which are the same tensors in every region (each kept once).
            AttnRes readers keep sharing their sources' logits
            (restopo.nn.shared_sources): those of a source from outside the region are made
            outside it, once per forward as without recompute, and handed to the region's
            forward and to its recomputation alike; those of a source made inside are made
            inside, for its own readers, and made again when it is recomputed.

Block regions live in the lowered fx graph only: a pipeline chunk runs its own walk, so
block is refused there (restopo.train.layout). Under FSDP2 a region holds several units:
its recomputation gathers each unit's weights (FSDP's forward hooks run inside it) in place
of the gather that unit's backward makes without recompute, not in addition to it: a step
gathers as often, and as many bytes, in every mode (bench/fsdp_recompute.py counts them;
exact, tests/test_layouts.py).
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from ..spec.objects import RECOMPUTE
from ..topology import layer_starts
from .lower import STEP, lowered

MODES = RECOMPUTE


def apply(model: nn.Module, mode: str) -> nn.Module:
    """Make `model` (a lowered model, or a module holding one) recompute as `mode` says, in
    place; returns it. Call it before wrapping the model in DDP or FSDP."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "none":
        return model
    gm = lowered(model)
    if getattr(gm, "restopo_recompute", "none") != "none":
        raise ValueError(f"this model already recomputes ({gm.restopo_recompute})")
    if mode == "sublayer":
        checkpoint_sublayers(gm.sublayers)
    else:
        _regions(gm)
    gm.restopo_recompute = mode
    return model


def checkpoint_sublayers(sublayers) -> None:
    """Recompute each of these modules in backward (their parameter names unchanged)."""
    from torch.distributed._composable import checkpoint as composable

    for m in sublayers:
        composable(m)


def layer_of(kinds: tuple[str, ...]) -> list[int]:
    """Region (0-based) of each sublayer in block mode: one per transformer layer, opened by
    each attention sublayer (sublayers before the first attention make region 0)."""
    starts = set(layer_starts(kinds))
    out, k = [], 0
    for i in range(1, len(kinds) + 1):
        k += i in starts and i > 1
        out.append(k)
    return out


class Region(nn.Module):
    """One block region: runs its part of the lowered graph under non-reentrant checkpoint.
    The part is a GraphModule over the model's own modules, kept out of this module's
    children so that nothing is registered twice; `shared` is the model's SharedSources
    (None: no readers), whose region scope the part runs in, forward and recomputed."""

    def __init__(self, part: fx.GraphModule, shared=None, uses=()):
        super().__init__()
        self.__dict__["part"] = part
        self.__dict__["shared"] = shared
        self.__dict__["readers"] = tuple(part.modules())
        self.uses = tuple(uses)  # (reader, position among its sources, index of the input)

    def forward(self, *inputs):
        # Compiling, nothing is shared (the readers make their own logits), and the region
        # scope's bookkeeping inside the checkpoint (a mutation of an object from outside
        # it) made dynamo break the graph at every region: no layer was compiled.
        if self.shared is None or torch.compiler.is_compiling():
            return checkpoint(self.part, *inputs, use_reentrant=False)
        outside = self.shared.outside([(m, i, inputs[k]) for m, i, k in self.uses])
        return checkpoint(self._run, outside, *inputs, use_reentrant=False)

    def _run(self, outside: dict, *inputs):
        with self.shared.region(self.readers, outside):
            return self.part(*inputs)


def _regions(gm: fx.GraphModule) -> None:
    """Rewrite `gm`'s graph so that each layer's nodes run as one Region call."""
    region = layer_of(gm.restopo_ir.kinds)
    L = len(region)
    members: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        step = n.meta.get(STEP)
        if step is not None and 1 <= step <= L:
            members.setdefault(region[step - 1], []).append(n)
    for nodes in members.values():
        # a parameter read (a PreNorm gain fused into phase 2) stays in the model's graph, an
        # input of the region: it is read live there (FSDP keeps it whole: train.fsdp.borrowed)
        for n in [n for n in nodes if n.op == "get_attr"]:
            nodes.remove(n)
            nodes[0].prepend(n)
    gm.regions = nn.ModuleList()
    for k, nodes in members.items():
        _extract(gm, nodes, k)
    gm.graph.lint()
    gm.recompile()


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], k: int) -> None:
    """Move `nodes` (contiguous in the graph) into Region k, called in their place."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env = {a: sub.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    part = fx.GraphModule(gm, sub, class_name="RecomputeRegion")
    shared = getattr(gm, "restopo_shared", None)
    readers = shared.readers if shared is not None else {}
    at = {a: k for k, a in enumerate(inputs)}
    uses = [(gm.get_submodule(n.target), i, at[a]) for n in nodes if n.op == "call_module"
            and gm.get_submodule(n.target) in readers
            for i, a in enumerate(n.args) if a in at]
    gm.regions.append(Region(part, shared, uses))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(f"regions.{k}", tuple(inputs))
        got = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    names = [n.name for n in outputs]
    for n, g in zip(outputs, got):
        n.replace_all_uses_with(g)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    call.name = f"region{k}"
    for name, g in zip(names, got):  # the values keep their names in gm.code
        g.name = name
