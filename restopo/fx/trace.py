"""Find the residual structure of a PreNorm transformer by tracing it with torch.fx.

`SublayerTracer` keeps norms, attentions and MLPs as leaves, so a block's forward
`x = x + self.attn(self.ln_1(x))` shows up as three nodes: the norm, the sublayer and the
add. `recover` then reads the graph:
  - a residual add is an add whose one operand (the stream x) is an ancestor of the other
    (the branch y = f(norm(x)));
  - the adds must chain into one stream: each one's x is the previous one's sum; the first
    one's x is the embedding v_0, the last one's sum feeds the head;
  - the sublayer l is every node between x_l and y_l; it must read the stream only through
    norms (PreNorm) and hold an attention or an MLP, which gives its kind;
  - the rest is the front (before the stream, and the values sublayers read besides it:
    positions, masks) or the back (the final norm, the LM head, the loss).
Each piece is copied into its own GraphModule that calls the original submodules, so every
original Parameter is shared, not copied.
"""
from __future__ import annotations

import dis
import inspect
import operator
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .structure import SUPPORTED, Ends, RewireError, Structure, pattern

NORM = re.compile(r"norm(\d*d)?$", re.I)  # LayerNorm, LlamaRMSNorm, BatchNorm1d; not NormBlock
ATTN = re.compile(r"attn|attention", re.I)
MLP = re.compile(r"mlp|feed_?forward|ffn|ffw|swiglu|geglu|moe|experts?$", re.I)
ADDS = (operator.add, operator.iadd, torch.add)


def classify(module: nn.Module) -> str | None:
    """"norm" | "attn" | "mlp" by the module's class name, or None."""
    name = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or NORM.search(name):
        return "norm"
    if isinstance(module, nn.MultiheadAttention) or ATTN.search(name):
        return "attn"
    if MLP.search(name):
        return "mlp"
    return None


class SublayerTracer(fx.Tracer):
    """fx tracer whose leaves are the norm, attention and MLP modules.

    A module named like a sublayer that holds a norm and a sublayer of its own (an
    "AttentionBlock" with its PreNorm inside) is traced through instead; an MoE holding
    expert MLPs, or an attention holding q/k norms, stays one leaf. Guards on traced values
    that only raise (`assert t <= block_size`) are recorded as torch._assert.
    """

    def __init__(self):
        super().__init__()
        self._leaf: dict[int, bool] = {}
        # buffers read in a forward (rotary tables, masks) become graph values, so that
        # slicing them by a traced length works
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if classify(m) is not None and self._is_sublayer_leaf(m):
            return True
        return super().is_leaf_module(m, qualname)

    def _is_sublayer_leaf(self, m: nn.Module) -> bool:
        key = id(m)
        if key not in self._leaf:
            inner = {classify(c) for c in m.modules() if c is not m}
            block = "norm" in inner and bool(inner & {"attn", "mlp"})
            self._leaf[key] = classify(m) == "norm" or not block
        return self._leaf[key]

    def to_bool(self, obj):
        # A guard (`assert t <= block_size`, `if t > block_size: raise ...`) branches on a
        # traced value only to raise: take the branch that does not raise and record the
        # condition as a torch._assert, as fx does for asserts on older Pythons.
        # Proxy.__bool__ -> to_bool: the forward's frame is two up.
        frame = inspect.currentframe().f_back.f_back
        passes = _guard_outcome(frame)
        if passes is None:
            return super().to_bool(obj)
        cond = obj if passes else self.create_proxy("call_function", operator.not_, (obj,), {})
        self.create_proxy("call_function", torch._assert,
                          (cond, "a guard in the traced forward failed"), {})
        return passes


_ENDS_BLOCK = ("JUMP", "RETURN", "FOR_ITER", "RERAISE")


def _guard_outcome(frame) -> bool | None:
    """For a conditional jump whose fall-through path raises: the truth value that skips
    the raise. None when the branch is not such a guard."""
    insts = list(dis.get_instructions(frame.f_code))
    at = next((k for k, ins in enumerate(insts) if ins.offset == frame.f_lasti), None)
    if at is None or "JUMP" not in insts[at].opname:
        return None
    op = insts[at].opname
    if "IF_TRUE" in op:
        jumps_on = True
    elif "IF_FALSE" in op:
        jumps_on = False
    else:
        return None
    for ins in insts[at + 1:]:  # the fall-through path: taken when the jump is not
        if ins.opname == "RAISE_VARARGS":
            return jumps_on
        if any(word in ins.opname for word in _ENDS_BLOCK):
            return None
    return None


def trace(model: nn.Module, fixed: Iterable[tuple[str, object]] = ()) -> fx.Graph:
    """The fx graph of `model.forward` with the (name, value) arguments fixed (see
    `structure.pattern`)."""
    try:
        return SublayerTracer().trace(model, concrete_args=dict(fixed))
    except RewireError:
        raise
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError, ... from user code
        where = _user_frame(e)
        raise RewireError(
            f"torch.fx could not trace {type(model).__name__}.forward{where}: {e}. "
            f"{SUPPORTED}") from e


def _user_frame(e: BaseException) -> str:
    tb, where = e.__traceback__, ""
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if "/torch/" not in f and "restopo/fx" not in f:
            where = f" (at {f}:{tb.tb_lineno})"
        tb = tb.tb_next
    return where


# --------------------------------------------------------------------------- recovery

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
        self.output = next(n for n in self.nodes if n.op == "output")

    def kind(self, n: fx.Node) -> str | None:
        if n.op == "call_module":
            return classify(self.model.get_submodule(n.target))
        if n.op == "call_function" and n.target is F.scaled_dot_product_attention:
            return "attn"
        return None

    def residual_adds(self) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
        """(add, stream x, branch y) for every add whose one operand is an ancestor of the
        other, in graph order."""
        out = []
        for n in self.nodes:
            binary = (n.op == "call_function" and n.target in ADDS or
                      n.op == "call_method" and n.target in ("add", "add_"))
            if not binary or len(n.args) != 2 or n.kwargs:
                continue
            a, b = n.args
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            if a in self.anc[b]:
                out.append((n, a, b))
            elif b in self.anc[a]:
                out.append((n, b, a))
        return out

    def ordered(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        return sorted(nodes, key=self.order.__getitem__)

    def where(self, n: fx.Node) -> str:
        return n.target if n.op == "call_module" else n.name


def recover(model: nn.Module, fixed: Iterable[tuple[str, object]] = ()) -> "_Split":
    """Trace `model` (the (name, value) arguments fixed) and cut it at its residual stream."""
    return _Split(model, _Graph(model, trace(model, fixed)))


class _Split:
    """One traced call pattern cut into front, sublayers and back."""

    def __init__(self, model: nn.Module, G: _Graph):
        self.model, self.G = model, G
        adds = G.residual_adds()
        name = type(model).__name__
        # adds before the first attention/MLP branch belong to the embedding
        # (x = x + pos(x)); the stream starts at the first one that adds a sublayer
        while adds and not self._has_sublayer(adds[0]):
            adds.pop(0)
        if not adds:
            raise RewireError(
                f"{name} has no residual adds (no `x = x + f(...)` whose f reads x): there is "
                f"no residual stream to rewire. {SUPPORTED}")
        self._check_post_norm(adds)
        self.adds, self.streams, self.branches = zip(*adds)
        for k in range(1, len(adds)):
            if self.streams[k] is not self.adds[k - 1]:
                self._check_parallel(k)
                raise RewireError(
                    f"{name}: the residual adds do not form one stream: "
                    f"`{self.adds[k].name}` adds into `{self.streams[k].name}`, not into the "
                    f"previous residual sum `{self.adds[k - 1].name}`. {SUPPORTED}")
        self.v0 = self.streams[0]
        added = set(self.adds)
        self.regions = []
        for x, y in zip(self.streams, self.branches):
            region = {n for n in G.anc[y] if x in G.anc[n]} | {y}
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
        region = {n for n in self.G.anc[y] if x in self.G.anc[n]} | {y}
        return any(self.G.kind(n) in ("attn", "mlp") for n in region)

    # ----------------------------------------------------------------- checks
    def _check_post_norm(self, adds) -> None:
        streams = {x for _, x, _ in adds}
        for add, _, _ in adds:
            users = list(add.users)
            if (len(users) == 1 and self.G.kind(users[0]) == "norm" and users[0] in streams):
                raise RewireError(
                    f"{type(self.model).__name__} is a post-norm transformer: the residual sum "
                    f"`{add.name}` goes through the norm `{self.G.where(users[0])}` before the "
                    f"next sublayer (x = norm(x + f(x))). {SUPPORTED}")

    def _check_parallel(self, k: int) -> None:
        """The stream went through an add that is not a residual add: is its other operand a
        branch of an earlier stream value (attention and MLP side by side, as in GPT-J)?"""
        x, prev = self.streams[k], self.adds[k - 1]
        if x.op == "call_function" and x.target in ADDS and prev in x.args:
            other = next(a for a in x.args if a is not prev)
            if isinstance(other, fx.Node) and any(s in self.G.anc[other] for s in self.streams):
                raise RewireError(
                    f"{type(self.model).__name__} has parallel sublayers: `{x.name}` adds "
                    f"`{other.name}`, computed from the stream before `{prev.name}`, so the "
                    f"attention and the MLP read the same input (a GPT-J / GPT-NeoX parallel "
                    f"block), not one after the other. {SUPPORTED}")

    def _check_front(self, inside: set[fx.Node]) -> None:
        for n in self.front_nodes:
            hit = self.G.anc[n] & inside
            if hit and n is not self.G.output:
                src = self.G.ordered(hit)[-1]
                raise RewireError(
                    f"{type(self.model).__name__}: `{self.G.where(n)}` reads the hidden state "
                    f"`{src.name}` between sublayers, which a rewired stream no longer has. "
                    f"{SUPPORTED}")

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
            if x in n.all_input_nodes and G.kind(n) != "norm" and not _metadata(n):
                raise RewireError(
                    f"{type(self.model).__name__}: the sublayer `{where}` reads the residual "
                    f"stream directly in `{G.where(n)}`, not through a norm, so it is not "
                    f"PreNorm (x = x + f(norm(x))). {SUPPORTED}")
            outside = [u for u in n.users if u not in region and u is not self.adds[k]]
            if outside:
                raise RewireError(
                    f"{type(self.model).__name__}: `{G.where(outside[0])}` reads `{n.name}` "
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
                f"*Attention*/*Attn*, *MLP*/*FeedForward*). {SUPPORTED}")
        return kinds.pop()

    # ----------------------------------------------------------------- pieces
    def names(self) -> tuple[str, ...]:
        return tuple(" + ".join(self.G.where(n) for n in self.G.ordered(r)
                                if n.op == "call_module") for r in self.regions)

    def width(self) -> int:
        for n in self.G.ordered(self.regions[0]):
            if self.G.kind(n) == "norm":
                m = self.model.get_submodule(n.target)
                w = getattr(m, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 1:
                    return w.shape[0]
                shape = getattr(m, "normalized_shape", None)
                if shape:
                    return tuple(shape)[-1]
        raise RewireError(f"{type(self.model).__name__}: cannot read the width from the first "
                          f"sublayer's norm; give it a 1-d weight or normalized_shape")

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
        first = next((n for n in self.G.nodes if n.op == "placeholder"), None)
        for n in self.front_nodes:
            if n.op == "call_module" and first in n.all_input_nodes:
                m = self.model.get_submodule(n.target)
                if isinstance(m, nn.Embedding):
                    return m.num_embeddings
        return None

    def sublayer(self, k: int) -> fx.GraphModule:
        """(h, *context) -> v_k: the nodes between the stream and the branch."""
        inputs = [self.streams[k], *self.context]
        names = ["h", *(f"c{i}" for i in range(len(self.context)))]
        return _extract(self.model, self.G.ordered(self.regions[k]), inputs, names,
                        self.branches[k], "Sublayer")

    def signature_of_region(self, k: int) -> tuple:
        """What must agree between call patterns for their sublayers to be the same: each
        node's op, target and constant arguments."""
        shape = lambda a: fx.map_arg(a, lambda _: "%")  # noqa: E731
        return tuple((n.op, str(n.target), str(shape(n.args)), str(shape(n.kwargs)))
                     for n in self.G.ordered(self.regions[k]))

    def ends(self) -> Ends:
        G = self.G
        placeholders = [n for n in G.nodes if n.op == "placeholder"]
        body = [n for n in self.front_nodes if n.op != "placeholder" and n is not G.output]
        embed = _extract(self.model, body, placeholders, None, self.v0, "Embed", True)
        context = _extract(self.model, body, [self.v0, *placeholders], None,
                           tuple(self.context), "Context", True)
        extra = _extract(self.model, body, placeholders, None, tuple(self.back_reads),
                         "HeadInputs", True)
        back_body = G.ordered(self.back_nodes - {G.output})
        back = _extract(self.model, back_body, [self.adds[-1], *self.back_reads],
                        ["h", *(f"e{i}" for i in range(len(self.back_reads)))],
                        G.output.args[0], "Head")
        self.graph_modules = [embed, context, extra, back]
        sig = inspect.signature(self.model.forward)
        return Ends(front=_spreading(embed, sig), context=_spreading(context, sig, lead=1),
                    extra=_spreading(extra, sig), back=back)


# ops that read only a tensor's shape, dtype or device: a sublayer may apply them to the
# stream itself (to build a mask, say), since every h_l has the stream's shape
METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda")
METADATA_METHODS = ("size", "dim", "new_ones", "new_zeros", "new_full", "new_empty",
                    "new_tensor", "get_device")


def _metadata(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in METADATA_METHODS
    return (n.op == "call_function" and n.target is getattr and len(n.args) == 2
            and n.args[1] in METADATA_ATTRS)


def _extract(root: nn.Module, nodes: list[fx.Node], inputs: list[fx.Node],
             names: list[str] | None, outputs, class_name: str,
             keep_placeholders: bool = False) -> fx.GraphModule:
    """A GraphModule running `nodes` on `inputs` (new placeholders, or copies of the original
    ones with their names and defaults) and returning `outputs` (nodes, nested in tuples)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if keep_placeholders:
        # the first input may be a value fed in from outside (v_0 for the context)
        for n in inputs:
            if n.op == "placeholder":
                env[n] = g.node_copy(n)
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


def recover_structure(model: nn.Module) -> Structure:
    """The Structure of an fx-traceable PreNorm transformer; the call pattern with every
    optional argument at its default is traced first, the others when first called."""
    signature = inspect.signature(model.forward)
    default = pattern(signature, *_defaults_call(signature))
    split = recover(model, default)
    patterns = Patterns(model, default, split)
    return Structure(kinds=split.kinds, width=split.width(),
                     sublayers=[ModeSublayer(patterns, k) for k in range(len(split.adds))],
                     graph_modules=patterns.graph_modules, names=split.names(), ends=patterns,
                     signature=signature, family="fx", vocab=split.vocab(),
                     context_names=split.context_names())


class Patterns:
    """Traces the model once per call pattern and train/eval mode, on first use.

    A forward may read `self.training` outside its leaf modules (functional dropout), so
    each mode has its own trace; within a mode every call pattern must cut into the same
    sublayers. A plain object (not closures), so that copy.deepcopy of a rewired model
    copies the traced pieces along with the model they call.
    """

    def __init__(self, model: nn.Module, default: tuple, split: "_Split"):
        self.model, self.default = model, default
        self.cache: dict[tuple, Ends] = {}
        self.layouts: dict[bool, tuple] = {}
        self.sublayers: dict[bool, list[fx.GraphModule]] = {}
        self.graph_modules: list[fx.GraphModule] = []
        self._add(default, model.training, split)

    def _add(self, key: tuple, training: bool, split: "_Split") -> None:
        layout = ([split.signature_of_region(k) for k in range(len(split.adds))],
                  len(split.context))
        if training not in self.layouts:
            if self.layouts and len(layout[0]) != len(next(iter(self.layouts.values()))[0]):
                raise RewireError(f"{type(self.model).__name__}: in "
                                  f"{'train' if training else 'eval'} mode it has another "
                                  f"number of sublayers")
            self.layouts[training] = layout
            self.sublayers[training] = [split.sublayer(k) for k in range(len(split.adds))]
            self.graph_modules.extend(self.sublayers[training])
        elif layout != self.layouts[training]:
            given = ", ".join(f"{n}={v!r}" for n, v in key) or "no fixed arguments"
            raise RewireError(
                f"{type(self.model).__name__}: called with {given}, its sublayers run "
                f"differently from the default call; rewire needs one set of sublayers "
                f"for every call")
        self.cache[(key, training)] = split.ends()
        self.graph_modules.extend(split.graph_modules)

    def __call__(self, key: tuple) -> Ends:
        training = self.model.training
        if (key, training) not in self.cache:
            self._add(key, training, recover(self.model, key))
        return self.cache[(key, training)]

    def sublayer(self, k: int) -> fx.GraphModule:
        training = self.model.training
        if training not in self.sublayers:
            self(self.default)
        return self.sublayers[training][k]


class ModeSublayer:
    """Sublayer k of the trace for the model's current train/eval mode."""

    def __init__(self, patterns: Patterns, k: int):
        self.patterns, self.k = patterns, k

    def __call__(self, h, *context):
        return self.patterns.sublayer(self.k)(h, *context)


def _defaults_call(signature: inspect.Signature) -> tuple[tuple, dict]:
    """Arguments for the default call: required ones filled with a tensor (never fixed)."""
    args, kwargs = [], {}
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = torch.empty(0)
        else:
            args.append(torch.empty(0))
    return tuple(args), kwargs


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
