"""Copy the pieces of a `StreamCut` into GraphModules: each sublayer, the front, the back.

Each piece is its own GraphModule that calls the original submodules, so every original
Parameter is shared, not copied.
"""
from __future__ import annotations

import inspect

from torch import fx, nn

from .recover import StreamCut
from .structure import FrontAndBack


def sublayer_module(cut: StreamCut, k: int) -> fx.GraphModule:
    """(h, *context) -> v_k: the nodes between the stream and the branch."""
    inputs = [cut.streams[k], *cut.context]
    names = ["h", *(f"c{i}" for i in range(len(cut.context)))]
    return _extract(cut.model, cut.G.ordered(cut.regions[k]), inputs, names,
                    cut.branches[k], "Sublayer")


def front_and_back(cut: StreamCut) -> tuple[FrontAndBack, list[fx.GraphModule]]:
    """The call pattern's front and back, and the GraphModules they run."""
    G = cut.G
    placeholders = [n for n in G.nodes if n.op == "placeholder"]
    body = [n for n in cut.front_nodes if n.op != "placeholder" and n is not G.output]
    embed = _extract(cut.model, body, placeholders, None, cut.v0, "Embed", True)
    context = _extract(cut.model, body, [cut.v0, *placeholders], None,
                       tuple(cut.context), "Context", True)
    extra = _extract(cut.model, body, placeholders, None, tuple(cut.back_reads),
                     "HeadInputs", True)
    back_body = G.ordered(cut.back_nodes - {G.output})
    back = _extract(cut.model, back_body, [cut.adds[-1], *cut.back_reads],
                    ["h", *(f"e{i}" for i in range(len(cut.back_reads)))],
                    G.output.args[0], "Head")
    sig = inspect.signature(cut.model.forward)
    ends = FrontAndBack(front=_spreading(embed, sig), context=_spreading(context, sig, lead=1),
                        extra=_spreading(extra, sig), back=back)
    return ends, [embed, context, extra, back]


def _extract(root: nn.Module, nodes: list[fx.Node], inputs: list[fx.Node],
             names: list[str] | None, outputs, class_name: str,
             keep_placeholders: bool = False) -> fx.GraphModule:
    """A GraphModule running `nodes` on `inputs` (new placeholders, or copies of the original
    ones with their names) and returning `outputs` (nodes, nested in tuples)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if keep_placeholders:
        # the first input may be a value fed in from outside (v_0 for the context)
        for n in inputs:
            if n.op == "placeholder":
                env[n] = g.node_copy(n)
                # every call passes every argument (structure.bind fills in the defaults), so
                # a default is never read, and a tensor one would not compile
                env[n].args = ()
            else:
                env[n] = g.placeholder("v0")
    else:
        for n, name in zip(inputs, names):
            env[n] = g.placeholder(name)
    for n in nodes:
        if n in env:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(fx.map_arg(outputs, lambda a: env[a]))
    gm = fx.GraphModule(root, g, class_name=class_name)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.delete_all_unused_submodules()
    return gm


class _Spread:
    """fn called with values in signature order, a *args tuple and a **kwargs dict spread out
    again (the traced forward keeps them as varargs); `lead` values go first unchanged."""

    def __init__(self, fn, signature: inspect.Signature, lead: int = 0):
        self.fn, self.lead = fn, lead
        self.kinds = [p.kind for p in signature.parameters.values()]

    def __call__(self, *values):
        args, kwargs = list(values[:self.lead]), {}
        for kind, v in zip(self.kinds, values[self.lead:]):
            if kind == inspect.Parameter.VAR_POSITIONAL:
                args.extend(v)
            elif kind == inspect.Parameter.VAR_KEYWORD:
                kwargs.update(v)
            else:
                args.append(v)
        return self.fn(*args, **kwargs)


def _spreading(fn, signature: inspect.Signature, lead: int = 0):
    varargs = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if any(p.kind in varargs for p in signature.parameters.values()):
        return _Spread(fn, signature, lead)
    return fn
