"""Recover the residual structure of one traced call pattern: cut its graph at the stream.

`recover` reads the graph `SublayerTracer` gives:
  - a residual add is an add whose one operand (the stream x) is an ancestor of the other
    (the branch y = f(norm(x)));
  - the adds must chain into one stream: each one's x is the previous one's sum; the first
    one's x is the embedding v_0, the last one's sum feeds the head;
  - the sublayer l is every node between x_l and y_l; it must read the stream only through
    norms (PreNorm) and hold an attention or an MLP, which gives its kind;
  - the rest is the front (before the stream, and the values sublayers read besides it:
    positions, masks) or the back (the final norm, the LM head, the loss).
Anything else is a RewireError saying what the model does instead. restopo.fx.extract
copies the pieces of a `StreamCut` into GraphModules.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .structure import SUPPORTED, RewireError
from .tracer import NORM_FUNCTIONS, classify, norm_calls, trace

ADDS = (operator.add, operator.iadd, torch.add)

class _Graph:
    """An fx graph with the ancestor sets and module kinds the recovery asks about."""

    def __init__(self, model: nn.Module, graph: fx.Graph):
        self.model, self.graph = model, graph
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.anc: dict[fx.Node, set[fx.Node]] = {}
        for n in self.nodes:
            s: set[fx.Node] = set()
            for a in n.all_input_nodes:
                s.add(a)
                s |= self.anc[a]
            self.anc[n] = s
        # the same, stopping at reads of a tensor's shape, dtype or device: what a value
        # needs of another's contents
        self.value_anc: dict[fx.Node, set[fx.Node]] = {}
        for n in self.nodes:
            s, meta = set(), _metadata_reads(n)
            for a in n.all_input_nodes:
                if a not in meta:
                    s |= {a} | self.value_anc[a]
            self.value_anc[n] = s
        self.output = next(n for n in self.nodes if n.op == "output")

    def kind(self, n: fx.Node) -> str | None:
        if n.op == "call_module":
            return classify(self.model.get_submodule(n.target), n.target)
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            return "attn"
        if n.op == "call_function" and n.target in NORM_FUNCTIONS:  # modded-nanogpt's norm(x)
            return "norm"
        return None

    def residual_adds(self) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
        """(add, stream x, branch y) for every add whose one operand is an ancestor of the
        other's value, in graph order."""
        out = []
        for n in self.nodes:
            if not _adds_two(n) or n.kwargs:
                continue
            a, b = n.args
            # by value: `start + x.size(1)` reads x's shape, not x, and adds no sublayer
            if a in self.value_anc[b]:
                out.append((n, a, b))
            elif b in self.value_anc[a]:
                out.append((n, b, a))
        return out

    def region(self, x: fx.Node, y: fx.Node) -> set[fx.Node]:
        """The nodes between x and y: what y computes from x."""
        return {n for n in self.anc[y] if x in self.anc[n]} | {y}

    def adds_sublayer(self, x: fx.Node, y: fx.Node) -> bool:
        """Does y compute from x's value through an attention or an MLP?"""
        return x in self.value_anc[y] and any(self.kind(n) in ("attn", "mlp")
                                              for n in self.region(x, y))

    def ordered(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        return sorted(nodes, key=self.order.__getitem__)

    def where(self, n: fx.Node) -> str:
        """A node as messages name it: a module call (or an item of its output) by the
        module's path, anything else by its node name."""
        if n.op == "call_module":
            return n.target
        src = n.args[0] if n.target is operator.getitem else None
        if isinstance(src, fx.Node) and src.op == "call_module":
            return f"{src.target}(...)[{n.args[1]!r}]"
        return n.name


def _adds_two(n: fx.Node) -> bool:
    """Is `n` an add of two graph values (x + y, torch.add(x, y, ...), x.add(y, ...))?"""
    return ((n.op == "call_function" and n.target in ADDS
             or n.op == "call_method" and n.target in ("add", "add_"))
            and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args))


def _scaled(n: fx.Node) -> fx.Node | None:
    """x, where `n` is x scaled by a number or a parameter (0.9 * x, x / c, self.a * x)."""
    if not (n.op == "call_function" and n.target in (operator.mul, operator.truediv, torch.mul)
            or n.op == "call_method" and n.target in ("mul", "div")) or len(n.args) != 2:
        return None
    nodes = [a for a in n.args if isinstance(a, fx.Node) and a.op != "get_attr"]
    return nodes[0] if len(nodes) == 1 else None


def recover(model: nn.Module, fixed: Iterable[tuple[str, object]] = ()) -> "StreamCut":
    """Trace `model` (the (name, value) arguments fixed) and cut it at its residual stream."""
    graph, checkpointed = trace(model, fixed)
    _drop_unread_items(graph)
    return StreamCut(model, _Graph(model, graph), checkpointed)


def _drop_unread_items(graph: fx.Graph) -> None:
    """Tuple unpacking (`y, _ = self.moe(x)`) traces a getitem for every item: one never read
    is no value of the model, but left in the front it looked like a read of the sublayer."""
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and n.target is operator.getitem and not n.users:
            graph.erase_node(n)


class StreamCut:
    """One traced call pattern cut at its residual stream: the residual adds, the nodes of
    each sublayer, of the front and of the back, and the front values the pieces read."""

    def __init__(self, model: nn.Module, G: _Graph, checkpointed: tuple[str, ...] = ()):
        self.model, self.G, self.checkpointed = model, G, checkpointed
        self._check_other_adds()
        adds = G.residual_adds()
        name = type(model).__name__
        # adds before the first attention/MLP branch belong to the embedding
        # (x = x + pos(x)); the stream starts at the first one that adds a sublayer
        while adds and not self._has_sublayer(adds[0]):
            adds.pop(0)
        if not adds:
            self._check_whole_torch_layers()
            raise RewireError(
                f"{name} has no residual adds (no `x = x + f(...)` whose f reads x): there is "
                f"no residual stream to rewire. {SUPPORTED}")
        self._check_post_norm(adds)
        self.adds, self.streams, self.branches = zip(*adds)
        for k in range(1, len(adds)):
            if self.streams[k] is not self.adds[k - 1]:
                self._check_parallel(self.streams[k], self.adds[k - 1])
                raise RewireError(
                    f"{name}: the residual adds do not form one stream: "
                    f"`{self.adds[k].name}` adds into `{self.streams[k].name}`, not into the "
                    f"previous residual sum `{self.adds[k - 1].name}`. {SUPPORTED}")
        for user in self.adds[-1].users:  # the last block's, which no residual add follows
            self._check_parallel(user, self.adds[-1])
        self.v0 = self.streams[0]
        added = set(self.adds)
        self.regions = []
        for x, y in zip(self.streams, self.branches):
            # what the front makes from the embedding's shape, dtype or device (a rotary
            # table: rotary_emb(h, position_ids)) is the front's, for every sublayer to read
            anc = G.value_anc if x is self.streams[0] else G.anc
            region = {n for n in G.anc[y] if x in anc[n]} | {y}
            self.regions.append(region)
        inside = set().union(*self.regions) | added
        last = self.adds[-1]
        self.back_nodes = {n for n in G.nodes if last in G.anc[n]}
        self.front_nodes = [n for n in G.nodes if n not in inside and n not in self.back_nodes]
        self._check_front(inside)
        self.kinds = tuple(self._check_region(k) for k in range(len(self.adds)))
        front = set(self.front_nodes)
        for nodes, stream in [*zip(self.regions, self.streams), (self.back_nodes, last)]:
            self._check_inputs(nodes, front | {stream})

        def reads(nodes):  # the front values a piece reads
            return {a for n in nodes for a in n.all_input_nodes if a in front}
        self.context = G.ordered(set().union(*(reads(r) for r in self.regions)) - {self.v0})
        self.back_reads = G.ordered(reads(self.back_nodes))
        if any(self.v0 in G.anc[n] or n is self.v0 for n in self.back_reads):
            raise RewireError(f"{name}: its head reads the embedding output directly; the "
                              f"rewired stream replaces it. {SUPPORTED}")

    def _has_sublayer(self, add) -> bool:
        _, x, y = add
        return self.G.adds_sublayer(x, y)

    # ----------------------------------------------------------------- checks
    def _check_other_adds(self) -> None:
        """Refuse, naming it, an add of a sublayer other than x + f(norm(x)): one scaled by
        torch.add's alpha=, or one into a scaled stream (a * x + f(norm(x))); they were taken
        for no residual add, or for parallel sublayers."""
        G, name = self.G, type(self.model).__name__
        for n in G.nodes:
            if not _adds_two(n):
                continue
            for s, y in (n.args, n.args[::-1]):
                if "alpha" in n.kwargs and G.adds_sublayer(s, y):
                    raise RewireError(
                        f"{name}: `{n.name}` adds a sublayer with alpha={n.kwargs['alpha']} "
                        f"(torch.add(x, f, alpha=a)), which rewire does not take apart: write "
                        f"it x + a * f(...). {SUPPORTED}")
                x = _scaled(s)
                if x is not None and s not in G.value_anc[y] and G.adds_sublayer(x, y):
                    raise RewireError(
                        f"{name}: `{n.name}` adds a sublayer to the stream scaled by "
                        f"`{s.name}` (x = a * x + f(norm(x))), a weight on the stream that a "
                        f"rewired stream, whose topology weighs every source, cannot keep. "
                        f"{SUPPORTED}")

    def _check_whole_torch_layers(self) -> None:
        """No residual add was seen: is it inside a torch.nn module that holds attention
        (nn.TransformerEncoder, nn.TransformerEncoderLayer), which fx calls without tracing
        into, as it does every torch.nn module?"""
        for n in self.G.nodes:
            if n.op != "call_module":
                continue
            m = self.model.get_submodule(n.target)
            if (type(m).__module__.startswith("torch.nn.") and classify(m) is None
                    and any(isinstance(c, nn.MultiheadAttention) for c in m.modules())):
                raise RewireError(
                    f"{type(self.model).__name__}: its layers are inside `{n.target}`, a "
                    f"torch.nn.{type(m).__name__}, which torch.fx calls whole (as every torch.nn "
                    f"module) and which keeps its MLP in a method, not a module: rewire cannot "
                    f"take it apart; write the layers as your own module, with an attention "
                    f"and an MLP module per layer (x = x + self.attn(self.ln_1(x)); x = x + "
                    f"self.mlp(self.ln_2(x))). {SUPPORTED}")

    def _check_post_norm(self, adds) -> None:
        streams = {x for _, x, _ in adds}
        for add, _, _ in adds:
            users = list(add.users)
            if (len(users) == 1 and self.G.kind(users[0]) == "norm" and users[0] in streams):
                raise RewireError(
                    f"{type(self.model).__name__} is a post-norm transformer: the residual sum "
                    f"`{add.name}` goes through the norm `{self.G.where(users[0])}` before the "
                    f"next sublayer (x = norm(x + f(x))). {SUPPORTED}")

    def _check_parallel(self, x: fx.Node, prev: fx.Node) -> None:
        """The stream went on from the residual sum `prev` through `x`, an add that is not a
        residual add: is its other operand a sublayer of an earlier stream value, one that
        `prev` did not need (attention and MLP side by side, as in GPT-J)?"""
        G = self.G
        if x.op == "call_function" and x.target in ADDS and prev in x.args:
            other = next(a for a in x.args if a is not prev)
            if isinstance(other, fx.Node) and any(
                    G.kind(n) in ("attn", "mlp") and n not in G.anc[prev]
                    and any(s in G.anc[n] for s in self.streams) for n in G.anc[other] | {other}):
                raise RewireError(
                    f"{type(self.model).__name__} has parallel sublayers: `{x.name}` adds "
                    f"`{self.G.where(other)}`, computed from the stream before `{prev.name}`, "
                    f"so the attention and the MLP read the same input (a GPT-J / GPT-NeoX "
                    f"parallel block), not one after the other. {SUPPORTED}")

    def _check_front(self, inside: set[fx.Node]) -> None:
        for n in self.front_nodes:
            hit = self.G.anc[n] & inside
            if hit and n is not self.G.output:
                src = self.G.ordered(hit)[-1]
                self._check_read_of_sublayer(n, src)
                raise RewireError(
                    f"{type(self.model).__name__}: `{self.G.where(n)}` reads the hidden state "
                    f"`{src.name}` between sublayers, which a rewired stream no longer has. "
                    f"{SUPPORTED}")

    def _check_read_of_sublayer(self, n: fx.Node, src: fx.Node) -> None:
        """`n`, outside every sublayer, reads `src`: refused in words when `src` is inside one
        (a second output of the sublayer's module, such as an MoE's auxiliary loss)."""
        k = next((k for k, r in enumerate(self.regions) if src in r), None)
        if k is None:
            return
        name, sub = type(self.model).__name__, self.names()[k]
        read = (f"`{self.G.where(n)}`" if n.target is operator.getitem
                else f"`{self.G.where(src)}` (by `{self.G.where(n)}`)")
        raise RewireError(
            f"{name}: {read} is read outside the sublayer `{sub}`; a rewired stream keeps "
            f"only what a sublayer adds to it, so a second output such as an MoE's auxiliary "
            f"loss has nowhere to go: return only the added value and keep the other on the "
            f"module (self.aux_loss = ...) to read after the forward. {SUPPORTED}")

    def _check_inputs(self, nodes: set[fx.Node], allowed: set[fx.Node]) -> None:
        """A piece may read its own stream value and the front, nothing else in between."""
        for n in self.G.ordered(nodes):
            for a in n.all_input_nodes:
                if a not in nodes and a not in allowed:
                    raise RewireError(
                        f"{type(self.model).__name__}: `{self.G.where(n)}` reads the hidden "
                        f"state `{a.name}` between sublayers, which a rewired stream no "
                        f"longer has. {SUPPORTED}")

    def _check_region(self, k: int) -> str:
        G, region, x = self.G, self.regions[k], self.streams[k]
        where = " + ".join(G.where(n) for n in G.ordered(region) if n.op == "call_module")
        for n in G.ordered(region):
            if (x in n.all_input_nodes and G.kind(n) != "norm"
                    and x not in _metadata_reads(n)):
                raise RewireError(
                    f"{type(self.model).__name__}: the sublayer `{where}` reads the residual "
                    f"stream directly in `{G.where(n)}`, not through a norm, so it is not "
                    f"PreNorm (x = x + f(norm(x))). {SUPPORTED}")
            outside = [u for u in n.users if u not in region and u is not self.adds[k]]
            if outside:
                raise RewireError(
                    f"{type(self.model).__name__}: `{G.where(outside[0])}` reads `{G.where(n)}` "
                    f"from inside the sublayer `{where}`. {SUPPORTED}")
        kinds = {G.kind(n) for n in region} - {None, "norm"}
        if kinds == {"attn", "mlp"}:
            raise RewireError(
                f"{type(self.model).__name__}: the sublayer `{where}` holds both an attention "
                f"and an MLP (a parallel block); rewire needs one per residual add. {SUPPORTED}")
        if not kinds:
            raise RewireError(
                f"{type(self.model).__name__}: the residual branch `{where or self.branches[k]}`"
                f" holds neither an attention nor an MLP module (recognised by class name: "
                f"*Attention*/*Attn*, *MLP*/*FeedForward*; or, for any other class, held as "
                f"attn, attention, mlp, ff, ffn, feed_forward). {SUPPORTED}")
        return kinds.pop()

    # ----------------------------------------------------------------- pieces
    def names(self) -> tuple[str, ...]:
        return tuple(" + ".join(self.G.where(n) for n in self.G.ordered(r)
                                if n.op == "call_module") for r in self.regions)

    def width(self) -> int:
        for n in self.G.ordered(self.regions[0]):
            if self.G.kind(n) == "norm" and n.op == "call_module":
                m = self.model.get_submodule(n.target)
                w = getattr(m, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 1:
                    return w.shape[0]
                shape = getattr(m, "normalized_shape", None)
                if shape:
                    return tuple(shape)[-1]
        emb = self._token_embedding()  # a functional norm has no weight to read
        if emb is not None:
            return emb.embedding_dim
        raise RewireError(f"{type(self.model).__name__}: cannot read the width from the first "
                          f"sublayer's norm; give it a 1-d weight or normalized_shape")

    def function_norms(self) -> tuple[tuple[str, float | None], ...]:
        """(function, epsilon) of each norm the sublayers and the head call as a function
        (F.rms_norm); None for the dtype's machine epsilon (tracer.norm_calls)."""
        return tuple(norm_calls(self.G.ordered(set().union(*self.regions, self.back_nodes))))

    def head_normed(self) -> bool:
        """Does the back read the last residual sum only through norms (a final norm)?"""
        last = self.adds[-1]
        return all(self.G.kind(u) == "norm" for u in last.users
                   if last not in _metadata_reads(u))

    def context_names(self) -> tuple[str, ...]:
        """Readable names for the context values: the buffer, input or module each one is
        read from (`cos`, `sin`, `mask`), numbered when two share a name."""
        out: list[str] = []
        for n in self.context:
            src = n
            while src.op in ("call_function", "call_method") and src.args and isinstance(
                    src.args[0], fx.Node):
                src = src.args[0]
            base = str(src.target).split(".")[-1] if src.op != "call_function" else n.name
            base = re.sub(r"\W", "_", base).strip("_") or "context"
            name, k = base, 1
            while name in out:
                k += 1
                name = f"{base}_{k}"
            out.append(name)
        return tuple(out)

    def vocab(self) -> int | None:
        """The size of the embedding table read with the first argument (token ids)."""
        emb = self._token_embedding()
        return None if emb is None else emb.num_embeddings

    def _token_embedding(self) -> nn.Embedding | None:
        """The embedding module read with the first argument (token ids)."""
        first = next((n for n in self.G.nodes if n.op == "placeholder"), None)
        for n in self.front_nodes:
            if n.op == "call_module" and first in n.all_input_nodes:
                m = self.model.get_submodule(n.target)
                if isinstance(m, nn.Embedding):
                    return m
        return None

    def signature_of_region(self, k: int) -> tuple:
        """What must agree between call patterns for their sublayers to be the same: each
        node's op, target and constant arguments."""
        shape = lambda a: fx.map_arg(a, lambda _: "%")  # noqa: E731
        return tuple((n.op, str(n.target), str(shape(n.args)), str(shape(n.kwargs)))
                     for n in self.G.ordered(self.regions[k]))


# ops that read only a tensor's shape, dtype or device: a sublayer may apply them to the
# stream itself (to build a mask, say), since every h_l has the stream's shape. Of the
# tensor they are called on (h.size()), of their first argument (torch.zeros_like(h)), or
# of the tensor they match another to (mask.type_as(h)).
METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda")
METADATA_METHODS = ("size", "dim", "new_ones", "new_zeros", "new_full", "new_empty",
                    "new_tensor", "get_device")
LIKE = (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
        torch.rand_like, torch.randn_like)
AS_METHODS = ("type_as", "expand_as", "view_as", "reshape_as", "to")


def _metadata_reads(n: fx.Node) -> set[fx.Node]:
    """The inputs `n` reads only the shape, dtype or device of (none of their values)."""
    if (n.op == "call_method" and n.target in METADATA_METHODS
            or n.op == "call_function" and (n.target in LIKE or n.target is getattr and
                                            len(n.args) == 2 and n.args[1] in METADATA_ATTRS)):
        meta, rest = n.args[:1], (n.args[1:], n.kwargs)
    elif n.op == "call_method" and n.target in AS_METHODS:
        meta, rest = n.args[1:], (n.args[:1], n.kwargs)  # x.to(h): h's dtype and device
    else:
        return set()
    read: set[fx.Node] = set()
    fx.map_arg(rest, read.add)
    return {a for a in meta if isinstance(a, fx.Node)} - read
