"""restopo.rewire: rebuild the residual stream of an existing PreNorm transformer.

    rewired = restopo.rewire(model, "full.restopo")   # or a Spec, or spec text

1. Recover the model's structure (restopo.fx.patterns for models torch.fx can follow,
   restopo.fx.hf for Hugging Face Llama-family models): the embedding v_0, the sublayers
   v_l = f_l(norm_l(h_l)) with their kinds, and the head (final norm, LM head, loss).
2. Check the recovery: the sublayers summed as a standard residual reproduce the model's
   own output on a probe batch (`verify=True`); a mismatch is a RewireError, not a silently
   different model.
3. Build the IR from the spec's residual section alone over the recovered kinds (a model
   section in the spec does not override the model) and lower it with `lower(g, parts)`.
4. Return `Rewired`: same forward signature and output type as the original.

The original model is registered as `rewired.model`, unchanged: its state_dict keys and
Parameter objects are the same, so `rewired.model.state_dict()` loads into a fresh copy of
the original; the new aggregation parameters live under `rewired.body.aggregations`.
The pieces handed to the lowering reference the original submodules without registering
them again, so every weight has one name and one owner.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch import nn

from ..ir import build_ir
from ..topology import Topology
from .lower import lower
from ..nn.parts import Parts
from ..nn.sublayers import check_batched, check_token_ids
from .structure import (SUPPORTED, FrontAndBack, RewireError, RewireWarning, Structure, bind,
                        pattern)
from .tracer import classify, compiled, eps_value, eps_words, float_dtype, norm_calls

__all__ = ["rewire", "recover", "Rewired", "RewireError"]


def recover(model: nn.Module) -> Structure:
    """The residual structure of `model`: by its known family layout when it is a supported
    Hugging Face model, else by tracing it with torch.fx."""
    if not isinstance(model, nn.Module):
        raise RewireError(f"rewire takes a torch.nn.Module; got {type(model).__name__}")
    if compiled(model):
        raise RewireError(f"this {type(model._orig_mod).__name__} is compiled (torch.compile), "
                          "which torch.fx cannot trace: rewire the model it wraps "
                          "(model._orig_mod), then compile the rewired one")
    from . import hf
    if hf.is_hf(model):
        return hf.recover(model)
    from .patterns import recover_structure
    return recover_structure(model)


def rewire(model: nn.Module, spec_or_path, backend: str = "auto", *,
           verify: bool = True, two_phase: bool = True,
           norm_eps: float | None = None) -> "Rewired":
    """`model` with its residual stream rebuilt as the spec's residual section says.

    spec_or_path: a Spec, a path to a .restopo file, spec text, or a callable
    `kinds -> Topology` (e.g. `lambda k: restopo.topology.block_attnres(k, blocks=2)`).
    Only the residual section is read. backend: auto | eager | triton | cpu (aggregation
    ops).
    verify: first check on a probe batch that the recovered pieces, summed as a standard
    residual, reproduce the model's output. Raises RewireError for a model that is not a
    PreNorm transformer, SpecError for a residual section the model cannot take.
    norm_eps: set the epsilon of the model's norms (in place, before anything else). An
    aggregation that starts as the mean of its sources (AttnRes, DenseFormer) starts as the
    standard model only when the epsilon is negligible against the mean's scale (README:
    "Starting as the standard model"); with a larger one (Llama's 1e-6, GPT-2's 1e-5) this
    warns, and norm_eps=1e-24 (restopo's own) makes the step-0 model the original one.
    A model that checkpoints its blocks (torch.utils.checkpoint) has each of their sublayers
    recomputed in backward whenever it would checkpoint them, its mode or a bool switch
    (gradient_checkpointing, use_checkpoint, or one read where checkpoint is called) turned
    before or after rewiring (a condition it cannot follow is warned of); a
    Hugging Face model's sublayers recompute while its gradient checkpointing is on.
    """
    residual, spec = _residual(spec_or_path)  # a bad spec is reported before any tracing
    if isinstance(model, Rewired) or hasattr(model, "restopo_ir"):
        raise RewireError(
            f"this model is {'rewired' if isinstance(model, Rewired) else 'built'} by "
            "restopo already: its residual stream is an IR's, not a PreNorm sum to recover; "
            + ("rewire the original model (rewired.model), or " if isinstance(model, Rewired)
               else "") + "compile the spec with the residual you want (restopo.compile)")
    if norm_eps is not None:
        set_norm_eps(model, norm_eps)
    if isinstance(model, nn.Module):  # recover names anything else
        _check_defaults(model)
    structure = recover(model)
    if verify:
        _verify(model, structure)
    if spec is not None and structure.kinds[0] != "attn":  # the spec's error blamed the spec
        raise RewireError(
            f"{type(model).__name__}: its first sublayer `{structure.names[0]}` is an MLP, and "
            f"a spec's residual section groups sublayers into transformer layers that each "
            f"begin with an attention; pass a callable kinds -> Topology instead (e.g. "
            f"restopo.topology.full_attnres)")
    topology = residual(structure.kinds)
    _warn_of_norm_eps(model, topology, structure)
    _warn_of_head_without_norm(model, topology, structure)
    _warn_of_other_sizes(spec, structure)
    g = build_ir(structure.kinds, topology, structure.width)
    default = structure.ends(pattern(structure.signature, *_probe_call(structure, model)))
    names = _context_names(model, structure, default)
    parts = Parts(embed=Embed(structure, default),
                  sublayers=[Borrowed(f, n) for f, n in zip(structure.sublayers, structure.names)],
                  kinds=structure.kinds, head=DeferredHead(),
                  context=Context(structure, default) if names else None,
                  context_names=names or None)
    body = lower(g, parts, backend=backend, two_phase=two_phase)
    # the new parameters follow the model's own dtype and device
    p = next(model.parameters(), None)
    if p is not None:
        body.aggregations.to(device=p.device, dtype=p.dtype if p.is_floating_point() else None)
    rewired = Rewired(model, structure, body, topology)
    if spec is not None:  # as restopo.compile does, so checkpoints can store the spec
        rewired.spec_text, rewired.restopo_spec = spec.text, spec
    return rewired


# The attributes that hold a norm's epsilon: torch's norms, Hugging Face's RMSNorms.
EPS_ATTRS = ("eps", "variance_epsilon")
MEAN_START_EPS = 1e-12  # above this, a mean of small sources can sink to the epsilon


def _norms(model: nn.Module):
    """(name, module) of each norm module, by class, as the tracer finds them."""
    return [(name, m) for name, m in model.named_modules() if classify(m) == "norm"]


def _norm_eps_attrs(model: nn.Module):
    """(name, module, attribute) of each norm module keeping its epsilon in an attribute: a
    number, or None for the dtype's machine epsilon (nn.RMSNorm's default); norms that
    hard-code theirs have none."""
    for name, m in _norms(model):
        for attr in EPS_ATTRS:
            eps = getattr(m, attr, ...)
            if eps is None or isinstance(eps, (int, float)) and not isinstance(eps, bool):
                yield name, m, attr


def norm_eps(model: nn.Module) -> dict[str, float]:
    """{module name: epsilon} of the model's norm modules that keep it in an attribute."""
    dtype = float_dtype(model)
    return {name: eps_value(getattr(m, attr), dtype) for name, m, attr in _norm_eps_attrs(model)}


def _coded_norm_calls(model: nn.Module) -> dict[str, list[tuple[str, float | None]]]:
    """{module name: its norm calls (tracer.norm_calls)} of the norm modules that write their
    epsilon in their code (nanoGPT's `F.layer_norm(x, ..., 1e-5)`) or leave it to the
    function's default, read from a trace of their forward; a norm that does not trace, or
    computes its own, is left out."""
    kept = {name for name, _, _ in _norm_eps_attrs(model)}
    out = {}
    for name, m in _norms(model):
        if name in kept or type(m).forward in _TORCH_NORM_FORWARDS:
            continue
        try:
            graph = torch.fx.symbolic_trace(m).graph
        except Exception:  # noqa: BLE001 - any code fx cannot trace: nothing to read
            continue
        calls = list(norm_calls(graph.nodes))
        if calls:
            out[name] = calls
    return out


def coded_norm_eps(model: nn.Module) -> dict[str, float]:
    """{module name: epsilon} of the norm modules whose code gives their epsilon (the
    largest, where one calls two norms), as _coded_norm_calls finds them."""
    dtype = float_dtype(model)
    return {name: max(eps_value(eps, dtype) for _, eps in calls)
            for name, calls in _coded_norm_calls(model).items()}


_TORCH_NORM_FORWARDS = {nn.LayerNorm.forward, nn.GroupNorm.forward,
                        *([nn.RMSNorm.forward] if hasattr(nn, "RMSNorm") else [])}


def set_norm_eps(model: nn.Module, eps: float) -> None:
    """Set every norm's epsilon attribute; RewireError when there is none to set."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):  # '1e-24' compared badly
        raise RewireError(f"norm_eps takes a number, e.g. norm_eps=1e-24; got {eps!r}")
    if not eps >= 0:
        raise RewireError(f"norm_eps must be 0 or more; got {eps}")
    settable = list(_norm_eps_attrs(model))
    norms = _norms(model)
    if not norms:  # it was ignored without a word
        raise RewireError(f"{type(model).__name__} has no norm modules whose epsilon norm_eps "
                          "could set: its norms are functions its code calls (F.rms_norm, "
                          "F.layer_norm); pass eps= there")
    if not settable:
        coded = coded_norm_eps(model)
        kind = type(norms[0][1]).__name__
        raise RewireError(f"the model's norms ({kind}) keep their epsilon "
                          + (f"({max(coded.values()):g}) " if coded else "")
                          + f"in their code ({kind}.forward), not in an "
                          "attribute (eps, variance_epsilon): change it there")
    for _, m, attr in settable:
        setattr(m, attr, float(eps))


def _starts_as_mean(topology: Topology) -> bool:
    """Does the topology start as a mean of sources, which equals the standard model's sum
    only behind a norm (README: 'Starting as the standard model')?"""
    return not (topology.sublayer_rule.method == "sum" or topology.sublayer_rule.multi_stream)


def _warn_of_head_without_norm(model: nn.Module, topology: Topology,
                               structure: Structure) -> None:
    """Warn when the head reads the stream without a final norm under a topology that starts
    as a mean: the head then reads the mean, not the sum, and the rewired model does not start
    as the original."""
    import warnings
    if _starts_as_mean(topology) and not structure.head_norm:
        warnings.warn(
            f"{type(model).__name__}'s head reads the residual stream without a final norm: "
            f"{topology.name}'s head aggregation starts as the mean of its sources, not their "
            f"sum, which only a norm makes the same, so the rewired model does not start as the "
            f"original (README: 'Starting as the standard model'); give the model a final norm "
            f"before its head for that", RewireWarning, stacklevel=3)


def _warn_of_norm_eps(model: nn.Module, topology: Topology, structure: Structure) -> None:
    """Warn when the topology starts as a mean of sources and the model's norms have an
    epsilon that is not negligible against it: the rewired model then does not start as
    the original (a standard residual, a sum, is not affected)."""
    import warnings
    if not _starts_as_mean(topology):
        return
    large = _large_norm_eps(model, structure)
    if large:
        warnings.warn(
            f"the model's norms use epsilon up to {max(large.values()):g}: {topology.name}'s "
            "aggregations start as the mean of their sources, whose scale can fall near it at "
            "step 0, so the rewired model does not start as the original (README: 'Starting as "
            "the standard model') unless it is made 1e-24: " + "; ".join(large),
            RewireWarning, stacklevel=3)


def _large_norm_eps(model: nn.Module, structure: Structure) -> dict[str, float]:
    """{where a norm's epsilon is set and how to make it 1e-24: the largest such epsilon},
    for every norm whose epsilon is above MEAN_START_EPS, whichever way it is given: a
    module's attribute, a module's call of a norm function, a norm function the model's own
    code calls; a default (F.rms_norm's eps=None) as much as a number written there."""
    dtype, out = float_dtype(model), {}

    def add(eps: float | None, where: str) -> None:
        value = eps_value(eps, dtype)
        if value > MEAN_START_EPS:
            out[where] = max(value, out.get(where, value))
    for _, m, attr in _norm_eps_attrs(model):
        eps = getattr(m, attr)
        add(eps, f"{type(m).__name__} has {eps_words(eps, dtype, attr)}: "
                 "rewire(..., norm_eps=1e-24) sets it")
    for name, calls in _coded_norm_calls(model).items():
        for fn, eps in calls:
            add(eps, f"{type(model.get_submodule(name)).__name__}.forward calls {fn} with "
                     f"{eps_words(eps, dtype)}: pass eps=1e-24 there (or keep it in an "
                     "attribute eps, which rewire's norm_eps= sets)")
    for fn, eps in structure.function_norms:
        add(eps, f"its code calls {fn} with {eps_words(eps, dtype)}: pass eps=1e-24 there")
    return out


def _warn_of_other_sizes(spec, structure) -> None:
    """Warn when the spec's model section describes another model than the one rewired:
    only its residual section is read, so its sizes were dropped without a word."""
    import warnings

    m = getattr(spec, "model", None)
    if m is None:
        return
    said = {"width": (m.width, structure.width),
            "sublayers": (m.depth * len(m.layer), len(structure.kinds))}
    differ = [f"{k} {mine} there, {theirs} in the model" for k, (mine, theirs) in said.items()
              if mine != theirs]
    if differ:
        warnings.warn(f"the spec's model section is not this model ({'; '.join(differ)}): "
                      "rewire reads only its residual section and keeps the model's own "
                      "sizes", RewireWarning, stacklevel=3)


def _residual(spec_or_path):
    """(kinds -> Topology, the Spec or None): the spec's residual section only."""
    if isinstance(spec_or_path, Topology):
        raise TypeError("pass a Spec, a path, spec text or a callable kinds -> Topology; a "
                        "Topology is tied to one sublayer sequence")
    if callable(spec_or_path) and not hasattr(spec_or_path, "residual"):
        return spec_or_path, None
    from ..spec import as_spec
    from ..spec.resolve import resolve_residual
    spec = as_spec(spec_or_path)
    return (lambda kinds: resolve_residual(spec.residual, kinds)), spec


# ------------------------------------------------------------------ pieces for the lowering

class Call:
    """One call of the rewired model: its arguments in signature order and the FrontAndBack
    of its call pattern. It travels through the lowered graph in place of `idx`."""

    __slots__ = ("args", "ends")

    def __init__(self, args: tuple, ends: FrontAndBack):
        self.args, self.ends = args, ends


def _hold(module: nn.Module, name: str, value) -> None:
    """Keep a reference without registering it: the original model owns those weights."""
    module.__dict__[name] = value


class _Front(nn.Module):
    def __init__(self, structure: Structure, default: FrontAndBack):
        super().__init__()
        _hold(self, "structure", structure)
        _hold(self, "default", default)

    def call(self, call) -> Call:
        if isinstance(call, Call):
            return call
        # plain token ids (the body called on its own): the default call pattern
        return Call(self.default.arguments(self.structure.signature, (call,), {}), self.default)


class Embed(_Front):
    """call -> v_0, through the model's own front for the call's pattern."""

    def forward(self, call):
        call = self.call(call)
        return call.ends.front(*call.args)


class Context(_Front):
    """(call, v_0) -> what every sublayer reads besides h (positions, masks, rotary)."""

    def forward(self, call, v0):
        call = self.call(call)
        return tuple(call.ends.context(v0, *call.args))


class Borrowed(nn.Module):
    """One sublayer of the original model, v = f(norm(h), *context), referenced not owned."""

    def __init__(self, fn: Callable, where: str):
        super().__init__()
        _hold(self, "fn", fn)
        self.where = where

    def forward(self, h, *context):
        return self.fn(h, *context)

    def extra_repr(self) -> str:
        return self.where


class DeferredHead(nn.Module):
    """Hands h_{L+1} back to `Rewired`, which runs the model's own head on it with the call's
    arguments (targets, labels): the head's output type is the original's."""

    def forward(self, h):
        return h


def _check_ids(ids, vocab: int | None) -> None:
    """Token ids [T], or outside the vocabulary, refused as restopo.compile's model refuses
    them (an IndexError deep in the traced front or in Hugging Face's generate otherwise)."""
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        check_batched(ids)
        if vocab is not None:
            check_token_ids(ids, vocab)


class Rewired(nn.Module):
    """The original model with its residual stream rewired; same signature and output.

    model      the original module (registered: its state_dict is unchanged, under model.)
    body       the lowered GraphModule: the call's inputs -> h_{L+1} (read `body.code`)
    topology   the resolved residual topology; `kinds` the recovered sublayer kinds
    """

    def __init__(self, model: nn.Module, structure: Structure, body: nn.Module,
                 topology: Topology):
        super().__init__()
        self.model = model
        self.body = body
        _hold(self, "structure", structure)
        self.topology, self.kinds = topology, structure.kinds
        self.__signature__ = structure.signature
        for name in ("config", "generation_config", "main_input_name"):
            if hasattr(model, name):
                _hold(self, name, getattr(model, name))

    def forward(self, *args, **kwargs):
        # token ids come first (_probe_call)
        _check_ids(bind(self.structure.signature, args, kwargs)[0], self.structure.vocab)
        return self._unchecked(*args, **kwargs)

    def _unchecked(self, *args, **kwargs):
        """forward without its check of the ids: generate's steps feed back tokens the model
        drew, after a prompt checked once, and reading them back at every step would stall
        it (a Python call on the CPU, a wait on CUDA), as restopo's own Decoder does not."""
        s = self.structure
        ends = s.ends(pattern(s.signature, args, kwargs))
        call = Call(ends.arguments(s.signature, args, kwargs), ends)
        h = self.body(call)
        return ends.back(h, *ends.extra(*call.args))

    def generate(self, *args, **kwargs):
        """Hugging Face's generate() of the original model, every forward it makes running
        through the rewired stream: its own cache (past_key_values), attention masks and
        positions, which the rewired front replays (restopo.fx.hf)."""
        generate = getattr(self.model, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.model).__name__} has no generate(); for a model "
                                 f"of restopo's own use restopo.generate")
        _check_ids(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")),
                   self.structure.vocab)
        # an instance attribute: the class is untouched
        self.model.forward = self._unchecked
        try:
            return generate(*args, **kwargs)
        finally:
            del self.model.forward

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.structure.resync(self.model)  # .to()/.double() replace buffers, not update them
        return out

    def extra_repr(self) -> str:
        return f"topology={self.topology.name}, sublayers={len(self.kinds)}"


# ------------------------------------------------------------------ self-check

def _check_defaults(model: nn.Module) -> None:
    """Refuse a forward that requires more than the token ids, before tracing it: rewire
    calls it with token ids alone (a bare TypeError from that call otherwise)."""
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    required = [p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise RewireError(
            f"{type(model).__name__}.forward requires {', '.join(required)} besides the token "
            f"ids: rewire calls it with token ids alone (to check what it recovered, and as the "
            f"call every other must cut into the same sublayers), so give "
            f"{'it' if len(required) == 1 else 'them'} a default")


def _probe_call(structure: Structure, model: nn.Module) -> tuple[tuple, dict]:
    """A small call with the default pattern: token ids [2, 4] as the first argument."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = structure.vocab or 2
    idx = torch.randint(0, vocab, (2, 4), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    return (idx,), {}


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, t in modes:
            m.training = t


def _context_names(model, structure: Structure, ends: FrontAndBack) -> tuple[str, ...]:
    if structure.context_names is not None:
        return tuple(structure.context_names)
    args, kwargs = _probe_call(structure, model)
    call = ends.arguments(structure.signature, args, kwargs)
    with _eval_mode(model):
        ctx = ends.context(ends.front(*call), *call)
    return tuple(f"context_{i}" for i in range(len(ctx)))


def _verify(model: nn.Module, structure: Structure) -> None:
    """The recovered pieces, summed as a standard residual, must give the model's output."""
    args, kwargs = _probe_call(structure, model)
    with _eval_mode(model):
        ends = structure.ends(pattern(structure.signature, args, kwargs))
        call = ends.arguments(structure.signature, args, kwargs)
        want = model(*args, **kwargs)
        v0 = ends.front(*call)
        ctx = ends.context(v0, *call)
        h = v0
        for f in structure.sublayers:
            h = h + f(h, *ctx)
        got = ends.back(h, *ends.extra(*call))
    a, b = _first_tensor(want), _first_tensor(got)
    if a is None or b is None or a.shape != b.shape:
        raise RewireError(f"{type(model).__name__}: the recovered head does not give the "
                          f"model's output ({_describe(want)} vs {_describe(got)})")
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 2e-2
    err = (a.double() - b.double()).abs().max().item()
    scale = max(1.0, a.double().abs().max().item())
    if not err <= tol * scale:
        raise RewireError(
            f"{type(model).__name__}: the recovered sublayers, summed as a standard residual, "
            f"do not reproduce the model's output (largest difference {err:.3g}); its forward "
            f"does more than x = x + f(norm(x)). {SUPPORTED}")


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):  # {"loss": ..., "logits": ...}, as many models return
        out = [out.get("logits"), *out.values()]
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


def _describe(out: Any) -> str:
    t = _first_tensor(out)
    return type(out).__name__ if t is None else f"{type(out).__name__} {tuple(t.shape)}"


