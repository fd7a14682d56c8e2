"""The Python API: restopo.compile, restopo.aggregations and restopo.set_backend (and
build_model and direct, which tests and tools use)."""
from __future__ import annotations

import os

from torch import fx, nn

from . import ops
from .decode import generate
from .fx.lower import aggregation_modules, give_method, lower, lowered, parts_of
from .ir import build_ir
from .nn.aggregate import Attend, TwoPhase, make_aggregation
from .nn.init import Init
from .nn.model import build_parts, model_kinds
from .spec import as_spec
from .spec.files import SAVED


def build_model(model, topology, backend: str = "auto", two_phase: bool = True, *,
                init: Init | None = None) -> fx.GraphModule:
    """restopo's reference transformer for a model spec, wired by `topology` (no spec file
    needed: tests and tools build models from a topology constructor directly). `init` as
    in `compile`: Init(seed) gives the weights `restopo train` starts from."""
    g = build_ir(model_kinds(model), topology, model.width)
    return _lower_with(g, model, backend, init, two_phase)


def _lower_with(g, model, backend: str, init: Init | None, two_phase: bool = True):
    """The IR `g` lowered over fresh parts of `model`, each unit drawn by `init` if given."""
    if init is None:
        return lower(g, build_parts(model), backend=backend, two_phase=two_phase)
    parts, d = build_parts(model, init), model.width
    aggregations = nn.ModuleList(
        init.unit(f"aggregations.{i}", lambda a=a: make_aggregation(a, d, backend))
        for i, a in enumerate(g.aggregations()))
    out = lower(g, parts, backend=backend, two_phase=two_phase, aggregations=aggregations)
    out.restopo_init = init
    return out


def compile(spec_or_path, backend: str = "auto", overrides=(), *,  # noqa: A001
            init: Init | None = None) -> fx.GraphModule:
    """The model a spec describes: an fx GraphModule, forward(idx [B, T]) -> logits [B, T, V].

    spec_or_path: a Spec, a path to a .restopo file, or spec text. backend: auto (triton on
    CUDA when it imports; on the CPU the fused C kernels where they build, else eager) |
    eager | triton | cpu (a RuntimeError says why one cannot run).
    The spec text and overrides ride along as `model.spec_text` / `model.restopo_overrides`
    (and the Spec as `model.restopo_spec`) so checkpoints can store them.
    init: a restopo.nn.init.Init draws each unit's weights from a generator seeded by (seed,
    unit name), the same in any layout (or builds them on the meta device); without it the
    weights come from torch's global generator.
    """
    ops.check_backend(backend)
    if backend in ("triton", "cpu"):
        ops.require_backend(backend)
    if init is not None and not isinstance(init, Init):  # it failed late, on init.unit
        raise TypeError(f"init takes a restopo.nn.init.Init (e.g. Init(seed=0)), not "
                        f"{type(init).__name__} {init!r}")
    _refuse_saved_model(spec_or_path)
    spec = as_spec(spec_or_path, overrides)
    if spec.model is None:
        raise ValueError(f"{spec.path}: the spec has no model section, so there is nothing to "
                         "compile; add a model block (or use restopo.rewire on a model you have)")
    model = _lower_with(spec.ir(), spec.model, backend, init)
    model.spec_text = spec.text
    model.restopo_overrides = tuple(getattr(spec, "overrides", ()) or ())
    model.restopo_spec = spec
    # model.generate(idx, max_new_tokens, ...), kept by copies of the model
    give_method(model, "generate", generate)
    return model


def _refuse_saved_model(spec_or_path) -> None:
    """A saved model handed to compile: say to load it (compile reads spec text)."""
    if not isinstance(spec_or_path, (str, os.PathLike)):
        return
    path = os.fspath(spec_or_path)
    if "\n" in path or len(path) > 4096:
        return  # spec text, not a path
    if path.endswith(SAVED) or os.path.isdir(path):
        raise ValueError(f"{path} is a saved model or checkpoint, not a spec: load it with "
                         f"restopo.load({path!r})")


def aggregations(model: nn.Module) -> list[nn.Module]:
    """The aggregation modules of a compiled or rewired model, in execution order, the head's
    last. AttnRes aggregations expose `.pseudo_query` (a Parameter of size d) and `.key_norm`
    (an RMSNorm, or None without key norm)."""
    return aggregation_modules(model)


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Switch the aggregation ops of a compiled model to another backend, in place."""
    ops.check_backend(backend)
    if backend in ("triton", "cpu"):
        ops.require_backend(backend)
    for m in model.modules():
        if isinstance(m, (Attend, TwoPhase)):
            m.backend = backend
    for m in model.modules():
        if hasattr(m, "restopo_ir"):
            m.backend = backend
    return model


def direct(model: nn.Module) -> fx.GraphModule:
    """The same model (sharing every module and parameter) lowered without the two-phase
    plan: each aggregation module is called on all its sources, so forward pre-hooks on
    `aggregations(...)` see them (e.g. to read depth-attention weights with
    `Attend.depth_weights`)."""
    gm = lowered(model)
    return lower(gm.restopo_ir, parts_of(gm), backend=gm.backend, two_phase=False,
                 aggregations=gm.aggregations, share=False)
