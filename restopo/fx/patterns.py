"""The Structure of a model torch.fx can trace: `recover_structure`, with the model traced
once per call pattern (`structure.pattern`) and train/eval mode, each on first use (the
default call in both modes at once)."""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import fx, nn

from .extract import front_and_back, sublayer_module
from .recover import StreamCut, recover
from .structure import FrontAndBack, RewireError, Structure, pattern


def recover_structure(model: nn.Module) -> Structure:
    """The Structure of an fx-traceable PreNorm transformer; the call pattern with every
    optional argument at its default is traced first, in both modes, the others when first
    called."""
    signature = inspect.signature(model.forward)
    default = pattern(signature, *_defaults_call(signature))
    cut = recover(model, default)
    patterns = TracesByPattern(model, default, cut)
    # a forward may checkpoint only in training (`if self.training: checkpoint(...)`): the
    # other mode is traced too, to see it; one it cannot trace fails when first used, as before
    with contextlib.suppress(RewireError), _in_mode(model, not model.training):
        patterns(default)
    return Structure(kinds=cut.kinds, width=cut.width(),
                     sublayers=[ModeSublayer(patterns, k) for k in range(len(cut.adds))],
                     graph_modules=patterns.graph_modules, names=cut.names(), ends=patterns,
                     signature=signature, family="fx", vocab=cut.vocab(),
                     context_names=cut.context_names(),
                     function_norms=cut.function_norms(),
                     checkpointed=tuple(dict.fromkeys(patterns.checkpointed)))


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool):
    """`model` in train or eval mode for a while; every module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, t in modes:
            m.training = t


class TracesByPattern:
    """Traces the model once per call pattern and train/eval mode, on first use.

    A forward may read `self.training` outside its leaf modules (functional dropout), so
    each mode has its own trace; within a mode every call pattern must cut into the same
    sublayers. A plain object (not closures), so that copy.deepcopy of a rewired model
    copies the traced pieces along with the model they call.
    """

    def __init__(self, model: nn.Module, default: tuple, cut: StreamCut):
        self.model, self.default = model, default
        self.cache: dict[tuple, FrontAndBack] = {}
        self.layouts: dict[bool, tuple] = {}
        self.sublayers: dict[bool, list[fx.GraphModule]] = {}
        self.graph_modules: list[fx.GraphModule] = []
        self.checkpointed: list[str] = []  # what any trace calls under a checkpoint
        self._add(default, model.training, cut)

    def _add(self, key: tuple, training: bool, cut: StreamCut) -> None:
        self.checkpointed += cut.checkpointed
        layout = ([cut.signature_of_region(k) for k in range(len(cut.adds))],
                  len(cut.context))
        if training not in self.layouts:
            if self.layouts and len(layout[0]) != len(next(iter(self.layouts.values()))[0]):
                raise RewireError(f"{type(self.model).__name__}: in "
                                  f"{'train' if training else 'eval'} mode it has another "
                                  f"number of sublayers")
            self.layouts[training] = layout
            self.sublayers[training] = [sublayer_module(cut, k)
                                        for k in range(len(cut.adds))]
            self.graph_modules.extend(self.sublayers[training])
        elif layout != self.layouts[training]:
            raise RewireError(self._differs(key, cut, layout[0], self.layouts[training][0]))
        self.cache[(key, training)], modules = front_and_back(cut)
        self.graph_modules.extend(modules)

    def _differs(self, key: tuple, cut: StreamCut, regions: list, traced: list) -> str:
        """Says which arguments of this call pattern are not the default call's, and which
        sublayer runs other code for them."""
        default, given = dict(self.default), dict(key)
        names = [n for n in default if given.get(n, ...) != default[n]]
        names += [n for n in given if n not in default]
        changed = ", ".join(f"{n}={given[n]!r}" if n in given else f"{n} given" for n in names)
        before = ", ".join(f"{n}={default[n]!r}" for n in names if n in default)
        k = next((k for k, (a, b) in enumerate(zip(regions, traced)) if a != b), None)
        what = (f"the sublayer `{cut.names()[k]}` runs other code" if k is not None else
                "its sublayers read other values")
        name = type(self.model).__name__
        return (f"{name}: called with {changed}" + (f" (the default call has {before})"
                                                     if before else "")
                + f", {what} than in the default call, and a rewired stream has one set of "
                f"sublayers for every call: make {name}.forward give its blocks the same "
                f"arguments in every call (a tensor where it passes None)")

    def __call__(self, key: tuple) -> FrontAndBack:
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

    def __init__(self, patterns: TracesByPattern, k: int):
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
