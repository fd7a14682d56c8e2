"""The Structure of a model torch.fx can trace: `recover_structure`, with the model traced
once per call pattern (`structure.pattern`), train/eval mode and setting of its checkpointing
switches, each on first use."""
from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from dataclasses import is_dataclass
from types import SimpleNamespace

import torch
import torch.utils.checkpoint
from torch import fx, nn

from .extract import front_and_back, sublayer_module
from .recover import StreamCut, recover
from .structure import (FrontAndBack, Recomputing, RewireError, RewireWarning, Structure,
                        pattern)


def recover_structure(model: nn.Module) -> Structure:
    """The Structure of an fx-traceable PreNorm transformer; the call pattern with every
    optional argument at its default is traced first, the others when first called."""
    signature = inspect.signature(model.forward)
    default = pattern(signature, *_defaults_call(signature))
    cut = recover(model, default)
    patterns = TracesByPattern(model, default, cut)
    return Structure(kinds=cut.kinds, width=cut.width(),
                     sublayers=[Recomputing(patterns, k) for k in range(len(cut.adds))],
                     graph_modules=patterns.graph_modules, names=cut.names(), ends=patterns,
                     signature=signature, family="fx", vocab=cut.vocab(),
                     context_names=cut.context_names(),
                     function_norms=cut.function_norms(), head_norm=cut.head_normed())


# a bool attribute a forward may choose torch.utils.checkpoint by: gradient_checkpointing,
# grad_checkpointing (timm), use_checkpoint, activation_checkpointing, checkpointing; any
# other name (grad_ckpt, remat) is found where the code calling checkpoint reads it
SWITCH = re.compile(r"checkpoint", re.I)
CHECKPOINTS = (torch.utils.checkpoint, torch.utils.checkpoint.checkpoint,
               torch.utils.checkpoint.checkpoint_sequential)


def _codes(code) -> Iterator:
    """A code object and those nested in it (lambdas, inner functions, comprehensions)."""
    yield code
    for c in code.co_consts:
        if inspect.iscode(c):
            yield from _codes(c)


def checkpoint_code(cls: type) -> dict[str, set[str]]:
    """{method: the attribute and global names it reads} of each method of `cls` (and its
    bases below nn.Module) whose code calls torch.utils.checkpoint, however imported."""
    out = {}
    for base in cls.__mro__[:cls.__mro__.index(nn.Module)] if nn.Module in cls.__mro__ else ():
        for name, fn in vars(base).items():
            if name in out or not inspect.isfunction(fn):
                continue
            names = {n for c in _codes(fn.__code__) for n in c.co_names}
            # torch.utils.checkpoint.checkpoint(...), an import of it in the method, or a
            # global it was imported as (not a mere `self.checkpoint_dir`)
            if ({"utils", "checkpoint"} <= names or "torch.utils.checkpoint" in names
                    or any(fn.__globals__.get(n) is c for n in names for c in CHECKPOINTS)):
                out[name] = names
    return out


def _holders(m: nn.Module) -> list[tuple[object, list[dict]]]:
    """(holder, its namespaces) of the attributes a module's code reads a switch from: the
    module (and its class), and a config it holds (a SimpleNamespace or dataclass)."""
    mro = type(m).__mro__
    return [(m, [vars(m), *map(vars, mro[:mro.index(nn.Module)])]),
            *((c, [vars(c)]) for c in vars(m).values() if isinstance(c, SimpleNamespace)
              or is_dataclass(c) and not isinstance(c, type))]


def checkpoint_switches(model: nn.Module) -> tuple[tuple[object, str], ...]:
    """(holder, attribute) of each bool attribute, of a module or a config it holds
    (nanoGPT forks' `self.config.gradient_checkpointing`), named for checkpointing or read by
    a method of the module that calls torch.utils.checkpoint (`if self.remat:`), found once:
    the trace bakes in the branch a forward takes on it, so the rewired model reads them to
    follow the switch when it is turned after rewiring. (The mode, `training`, is followed
    apart.)"""
    out: dict[tuple[int, str], tuple[object, str]] = {}
    for m in model.modules():
        read = set().union(*checkpoint_code(type(m)).values())
        for holder, spaces in _holders(m):
            names = {n for space in spaces for n, v in space.items() if isinstance(v, bool)}
            for n in sorted(names - {"training"}):
                if SWITCH.search(n) or n in read:
                    out.setdefault((id(holder), n), (holder, n))
    return tuple(out.values())


def unfollowed_checkpointing(model: nn.Module, switches) -> list[str]:
    """`Class.method` of each method that calls torch.utils.checkpoint but reads neither a
    switch rewire follows, nor the mode, nor a bool argument (a call pattern): on a condition
    rewire cannot see (a global, an environment variable, a number)."""
    out = []
    followed = {n for _, n in switches} | {"training"}
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        for name, reads in checkpoint_code(cls).items():
            params = inspect.signature(getattr(cls, name)).parameters.values()
            if not reads & followed and not any(type(p.default) is bool for p in params):
                out.append(f"{cls.__name__}.{name}")
    return out


TRACES_SAID = 8  # call patterns traced before rewire says how to need fewer


class TracesByPattern:
    """Traces the model once per call pattern and state (train/eval mode, checkpointing
    switches), on first use.

    A forward may read `self.training` outside its leaf modules (functional dropout), so
    each mode has its own trace; within a mode every call pattern must cut into the same
    sublayers. Whether the original recomputes a sublayer in backward (torch.utils.checkpoint
    around its block, often chosen by `self.training` or a switch) is read from the trace of
    the current state, so the rewired sublayer recomputes exactly then. A plain object (not
    closures), so that copy.deepcopy of a rewired model copies the traced pieces along with
    the model they call.
    """

    def __init__(self, model: nn.Module, default: tuple, cut: StreamCut):
        self.model, self.default = model, default
        self.switches = checkpoint_switches(model)
        self.cache: dict[tuple, FrontAndBack] = {}
        self.layouts: dict[bool, tuple] = {}
        self.sublayers: dict[bool, list[fx.GraphModule]] = {}
        self.graph_modules: list[fx.GraphModule] = []
        # the modules each sublayer calls, and per call pattern and state those a trace calls
        # under a checkpoint (a bool argument may choose it)
        self.modules = [{n.target for n in r if n.op == "call_module"} for r in cut.regions]
        self.checkpointed: dict[tuple, set[str]] = {}
        self.recomputed: dict[tuple, tuple[bool, ...]] = {}  # from checkpointed
        # the call pattern of the forward running now, whose sublayers ask `recomputes`
        # (the last one's when the body is called on its own)
        self.key = default
        self._add(default, self.state(), cut)
        unseen = [] if cut.checkpointed else unfollowed_checkpointing(model, self.switches)
        if unseen:
            warnings.warn(
                f"{', '.join(unseen)} calls torch.utils.checkpoint on a condition rewire cannot "
                f"follow (it follows the mode, bool arguments, and bool attributes of the module "
                f"or its config read there), and did not call it now: the rewired model will "
                f"not recompute where that condition turns checkpointing on; make the condition "
                f"such an attribute, or rewire with checkpointing on", RewireWarning,
                stacklevel=5)

    def state(self) -> tuple:
        """What a trace is specialised on besides the call: the mode and the switches."""
        return (self.model.training, *(getattr(m, n) for m, n in self.switches))

    def _add(self, key: tuple, state: tuple, cut: StreamCut) -> None:
        training = state[0]
        self.checkpointed[(key, state)] = set(cut.checkpointed)
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
        self.cache[(key, state)], modules = front_and_back(cut)
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
        values = [v for n in names for v in (given.get(n, ...), default.get(n, ...))]
        # a number is a constant of the trace (Meta's Llama's start_pos); a tensor is not
        numbers = [n for n in names if type(given.get(n, default.get(n))) in (int, float)]
        hints = (["a tensor where it passes None"] if None in values else []) + (
            [f"{', '.join(numbers)} a tensor, its default too, not a Python number"]
            if numbers else [])
        return (f"{name}: called with {changed}" + (f" (the default call has {before})"
                                                     if before else "")
                + f", {what} than in the default call, and a rewired stream has one set of "
                f"sublayers for every call: make {name}.forward give its blocks the same "
                f"arguments in every call" + (f" ({'; '.join(hints)})" if hints else ""))

    def __call__(self, key: tuple) -> FrontAndBack:
        state, self.key = self.state(), key
        if (key, state) not in self.cache:
            self._add(key, state, recover(self.model, key))
            if len(self.cache) == TRACES_SAID:
                self._say_traces()
        return self.cache[(key, state)]

    def _say_traces(self) -> None:
        """Each new value of a number argument is a trace of its own, kept: a loop that
        passes a new one each call (a decoding position) traces every call and keeps them
        all. Said once, as torch.compile says its recompilations."""
        calls = [dict(key) for key, _ in self.cache]
        varied = [n for n in calls[0] if len({repr(c.get(n)) for c in calls}) > 1]
        numbers = [n for n in varied
                   if any(type(c.get(n)) in (int, float) for c in calls)]
        name = type(self.model).__name__
        warnings.warn(f"{name} has been traced for {len(calls)} call patterns, which differ "
                      f"in {', '.join(varied) or 'mode or checkpointing'}: each new value of "
                      f"a Python number or flag is traced anew and kept"
                      + (f"; pass {', '.join(numbers)} as a tensor (its default too), which "
                         f"one trace serves" if numbers else ""),
                      RewireWarning, stacklevel=4)

    def recomputes(self, k: int) -> bool:
        """Does the original, as it is now and for this call, call sublayer k's modules
        under a checkpoint?"""
        at = (self.key, self.state())
        if at not in self.checkpointed:
            self(self.key)
        if at not in self.recomputed:  # once per call pattern and state, not per sublayer
            self.recomputed[at] = tuple(
                any(m == c or m.startswith(f"{c}.") for c in self.checkpointed[at]
                    for m in modules) for modules in self.modules)
        return self.recomputed[at][k]

    def sublayer(self, k: int) -> fx.GraphModule:
        training = self.model.training
        if training not in self.sublayers:
            self(self.default)
        return self.sublayers[training][k]


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
