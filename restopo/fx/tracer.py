"""The torch.fx tracer rewire reads a model with: norms, attentions and MLPs stay leaves.

`SublayerTracer` keeps those modules as leaves, so a block's forward
`x = x + self.attn(self.ln_1(x))` shows up as three nodes: the norm, the sublayer and the
add, which is what restopo.fx.recover looks for.
"""
from __future__ import annotations

import inspect
import linecache
import operator
import re
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.utils.checkpoint
from torch import fx, nn
from torch.nn import functional as F

from .guards import guard_outcome
from .structure import SUPPORTED, RewireError

NORM = re.compile(r"norm(\d*d)?$", re.I)  # LayerNorm, LlamaRMSNorm, BatchNorm1d; not NormBlock
ATTN = re.compile(r"attn|attention", re.I)
MLP = re.compile(r"mlp|feed_?forward|ffn|ffw|swiglu|geglu|moe|experts?$", re.I)
# a module whose class says nothing (an nn.Sequential MLP) is known by its attribute name
NAMED = {"attn": re.compile(r"(self_)?(attn|attention)", re.I),
         "mlp": re.compile(r"mlp|ffn?|feed_?forward|ffw|moe|experts", re.I)}


# the functional norms, where each takes its epsilon and its default: (position, keyword,
# default), None for the input dtype's machine epsilon (rms_norm's)
NORM_FUNCTIONS = {F.layer_norm: (4, "eps", 1e-5), torch.layer_norm: (4, "eps", 1e-5),
                  F.group_norm: (4, "eps", 1e-5),
                  **({F.rms_norm: (3, "eps", None), torch.rms_norm: (3, "eps", None)}
                     if hasattr(F, "rms_norm") else {})}


def norm_calls(nodes: Iterable[fx.Node]) -> Iterator[tuple[str, float | None]]:
    """(function, epsilon) of each traced call of a NORM_FUNCTIONS norm among `nodes` whose
    epsilon is a constant: the one passed, else the function's default; None for the input
    dtype's machine epsilon (rms_norm's eps=None)."""
    for n in nodes:
        if n.op == "call_function" and n.target in NORM_FUNCTIONS:
            at, kw, default = NORM_FUNCTIONS[n.target]
            eps = n.args[at] if len(n.args) > at else n.kwargs.get(kw, default)
            if eps is None or isinstance(eps, (int, float)) and not isinstance(eps, bool):
                yield (f"{n.target.__module__}.{n.target.__name__}",
                       None if eps is None else float(eps))


def eps_value(eps: float | None, dtype: torch.dtype) -> float:
    """An epsilon as a norm in `dtype` runs with it: None is the dtype's machine epsilon."""
    return torch.finfo(dtype).eps if eps is None else eps


def eps_words(eps: float | None, dtype: torch.dtype, name: str = "eps") -> str:
    """An epsilon as messages say it: `eps=1e-05`, or what eps=None stands for."""
    return (f"{name}=None (the default: the dtype's machine epsilon, {torch.finfo(dtype).eps:g})"
            if eps is None else f"{name}={eps:g}")


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of `model`'s first floating parameter (float32 without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def classify(module: nn.Module, path: str = "") -> str | None:
    """"norm" | "attn" | "mlp" by the module's class name, else by the attribute it is
    held in (the last part of `path`: `self.mlp = nn.Sequential(...)`), or None."""
    name = type(module).__name__
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or NORM.search(name):
        return "norm"
    if isinstance(module, nn.MultiheadAttention) or ATTN.search(name):
        return "attn"
    if MLP.search(name):
        return "mlp"
    attr = path.rpartition(".")[2]
    return next((kind for kind, words in NAMED.items() if words.fullmatch(attr)), None)


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
        self.checkpointed: list[str] = []  # the outermost modules called under a checkpoint
        self.modes: tuple | None = None  # _modes() as the trace began

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        if compiled(m):  # else fx's "symbolically trace a dynamo-optimized function"
            raise RewireError(
                f"{type(self.root).__name__}: `{path}` is compiled (torch.compile), which "
                f"torch.fx cannot trace into: rewire the model before compiling its modules "
                f"(then compile the rewired one)")
        if _under_checkpoint():  # (the reentrant one runs it with grad off)
            if not any(path.startswith(f"{c}.") for c in self.checkpointed):
                self.checkpointed.append(path)
        elif self.modes is not None and _modes() != self.modes and _mode_matters(m, self.modes):
            raise RewireError(_mode_set_in_forward(self.root, path, self.modes))
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if classify(m, qualname) is not None and self._is_sublayer_leaf(m, qualname):
            return True
        return super().is_leaf_module(m, qualname)

    def _is_sublayer_leaf(self, m: nn.Module, path: str) -> bool:
        key = id(m)
        if key not in self._leaf:
            inner = {classify(c, n) for n, c in m.named_modules() if c is not m}
            block = "norm" in inner and bool(inner & {"attn", "mlp"})
            self._leaf[key] = classify(m, path) == "norm" or not block
        return self._leaf[key]

    def path_of_module(self, mod: nn.Module) -> str:
        try:
            return super().path_of_module(mod)
        except NameError:  # fx says only "module is not installed as a submodule"
            raise RewireError(_unregistered(self.root, mod)) from None

    def to_bool(self, obj):
        # A guard (`assert t <= block_size`, `if t > block_size: raise ...`) branches on a
        # traced value only to raise: take the branch that does not raise and record the
        # condition as a torch._assert, as fx does for asserts on older Pythons.
        # Proxy.__bool__ -> to_bool: the forward's frame is two up.
        frame = inspect.currentframe().f_back.f_back
        passes = guard_outcome(frame)
        if passes is None:  # fx's words say neither where nor what to write instead
            raise RewireError(
                f"torch.fx could not trace {type(self.root).__name__}.forward: "
                f"{_source(frame.f_code.co_filename, frame.f_lineno)} branches on a traced "
                f"value (a tensor, or a size read from one), which one trace cannot follow: "
                f"write it without the branch (a causal mask built for every length, say, not "
                f"only `if seqlen > 1`), or branch on an argument (a Python number or flag, "
                f"traced once per value). {SUPPORTED}")
        cond = obj if passes else self.create_proxy("call_function", operator.not_, (obj,), {})
        self.create_proxy("call_function", torch._assert,
                          (cond, "a guard in the traced forward failed"), {})
        return passes


def trace(model: nn.Module, fixed: Iterable[tuple[str, object]] = ()
          ) -> tuple[fx.Graph, tuple[str, ...]]:
    """The fx graph of `model.forward` with the (name, value) arguments fixed (see
    `structure.pattern`), and the modules it calls under torch.utils.checkpoint (the graph
    calls them plainly: nothing says they were recomputed)."""
    tracer = SublayerTracer()
    tracer.modes = _modes()
    kept = [(m, dict(vars(m)), dict(m._buffers)) for m in model.modules()]
    try:
        graph = tracer.trace(model, concrete_args=dict(fixed))
    except RewireError:
        raise
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError, ... from user code
        where = _user_frame(e)
        raise RewireError(
            f"torch.fx could not trace {type(model).__name__}.forward{where}: {e}. "
            f"{_plain_tensors(model, e)}{SUPPORTED}") from e
    finally:
        assigned = _restore_assigned(model, kept)
    if assigned:
        raise RewireError(
            f"{type(model).__name__}.forward assigns {', '.join(assigned)} a value it computes "
            f"(self.x = ... in a traced forward), which torch.fx records as a value, not as an "
            f"assignment, so the rewired model would never update it: keep it in a local "
            f"variable (a buffer moves with the model's .to() by itself). {SUPPORTED}")
    return graph, tuple(tracer.checkpointed)


def _restore_assigned(model: nn.Module, kept: list) -> list[str]:
    """Put back each attribute or buffer a traced forward assigned a traced value to (it
    would hold an fx Proxy, a value of a graph, and break the model); says which."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for m, attrs, buffers in kept:
        for space, before in ((vars(m), attrs), (m._buffers, buffers)):
            for name, value in list(space.items()):
                if isinstance(value, fx.Proxy):
                    if name in before:
                        space[name] = before[name]
                    else:
                        del space[name]
                    out.append(f"`{names[id(m)] + '.' if names[id(m)] else ''}{name}`")
    return out


def _modes() -> tuple[bool, bool, bool]:
    """What a forward may set around its calls that torch.fx does not record: grad mode,
    autocast on the CPU and on CUDA."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def _mode_matters(m: nn.Module, before: tuple) -> bool:
    """Does calling `m` in the current mode, not in `before`, change what it computes or
    trains? Grad mode only matters for a module with weights that train."""
    now = _modes()
    return now[1:] != before[1:] or any(p.requires_grad for p in m.parameters())


def _mode_set_in_forward(root: nn.Module, path: str, before: tuple) -> str:
    """Says that `path` is called in a mode root's forward sets, which the trace loses."""
    grad, cpu, cuda = _modes()
    off = "off (torch.no_grad or torch.inference_mode)"
    what = (f"with gradients {'on (torch.enable_grad)' if grad else off}" if grad != before[0]
            else f"with torch.autocast {'on' if cpu or cuda else 'off'}")
    name = type(root).__name__
    return (f"{name}: `{path}` is called {what}, set by {name}.forward (a `with` block or a "
            f"decorator), which torch.fx does not record, so the rewired model would run it "
            f"as it is called: take that out of the forward and set it around the call of "
            f"the rewired model (frozen weights: requires_grad_(False))")


def compiled(m: nn.Module) -> bool:
    """Is `m` torch.compile's wrapper of a module (OptimizedModule)?"""
    return isinstance(getattr(m, "_orig_mod", None), nn.Module)


# the frames a checkpointed function runs in: checkpoint's own (non-reentrant) or its
# autograd Function's (reentrant); not any frame of the file: checkpoint_sequential runs its
# last segment plainly, from there
CHECKPOINT_FRAMES = tuple(inspect.unwrap(f).__code__ for f in (
    torch.utils.checkpoint.checkpoint, torch.utils.checkpoint.CheckpointFunction.forward))


def _under_checkpoint() -> bool:
    """Is torch.utils.checkpoint on the stack (either form, however it was imported)?"""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in CHECKPOINT_FRAMES:
            return True
        f = f.f_back
    return False


def _unregistered(root: nn.Module, mod: nn.Module) -> str:
    """Says where `root` keeps `mod` without registering it (a plain list, tuple or dict)."""
    return (f"{type(root).__name__}: {_held_at(root, mod) or f'a {type(mod).__name__} it calls'}"
            f" is not a registered submodule, so torch.fx cannot trace its call, and "
            f"parameters() and state_dict() leave out its weights (no optimizer trains them): "
            f"hold such modules in an nn.ModuleList or nn.ModuleDict")


def _held_at(root: nn.Module, mod: nn.Module) -> str | None:
    for name, m in root.named_modules():
        for attr, value in vars(m).items():
            keys = (range(len(value)) if isinstance(value, (list, tuple)) else
                    value.keys() if isinstance(value, dict) else ())
            for key in keys:
                if value[key] is mod:
                    return (f"`{name + '.' if name else ''}{attr}[{key!r}]` (a "
                            f"{type(mod).__name__} in a plain {type(value).__name__})")
    return None


def _user_frame(e: BaseException) -> str:
    """ (at file:line: `code`) of the model's own code the error came from, or ''."""
    tb, where = e.__traceback__, ""
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if "/torch/" not in f and "restopo/fx" not in f:
            where = f" ({_source(f, tb.tb_lineno)})"
        tb = tb.tb_next
    return where


def _source(filename: str, line: int) -> str:
    """at file:line: `the line's code`, as messages name a place in the model's code."""
    code = linecache.getline(filename, line).strip()
    return f"at {filename}:{line}" + (f": `{code}`" if code else "")


def _plain_tensors(model: nn.Module, e: BaseException) -> str:
    """A hint for a tensor the forward keeps as a plain attribute (Meta's Llama's
    `self.freqs_cis`), named in the failing line: fx proxies buffers, so that slicing one by
    a traced length works, but not such a tensor."""
    code = _user_frame(e)
    names = sorted({f"self.{n}" for m in model.modules() for n, v in vars(m).items()
                    if isinstance(v, torch.Tensor) and f"self.{n}" in code})
    if not names:
        return ""
    return (f"{', '.join(names)} {'is a tensor' if len(names) == 1 else 'are tensors'} kept as "
            f"a plain attribute, which torch.fx cannot index by a traced value: register "
            f"{'it' if len(names) == 1 else 'them'} with self.register_buffer(name, tensor, "
            f"persistent=False). ")
