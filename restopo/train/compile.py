"""Compiled training (`train.compile`). `regional` (`true`, `restopo train --compile`):
torch.compile each region of the lowered model in place, as torchtitan compiles per block.
`whole`: the lowered model in place as one graph (compile_model): faster steps, a slower
first step; one process or DDP.

The regions are the modules the lowered graph calls (restopo.fx.lower): `embed`, each of
`sublayers` (attention or MLP, with its PreNorm), each of `aggregations` (one per
aggregation point), each of `phases` (phase 1 of a two-phase group) and `head`; `context`
(slices of the rotary tables) gains nothing and stays eager, as do the graph's own adds.
`nn.Module.compile()` compiles a module's call in place, so parameter names (state_dict,
checkpoints, FSDP units) are unchanged, and every caller of the module runs the compiled
code: the lowered graph, a pipeline chunk (restopo.nn.run) and evaluation alike.

Dynamo keeps compiled code per Python code object, so regions of one class share it: with
inline_inbuilt_nn_modules (torch's default) parameters are graph inputs, and the 32
sublayers of a depth-16 model compile to two graphs (attention, MLP) and run them 16 times
each. What still specialises is what makes the code differ: the number of sources of an
aggregation point (a tuple's length), the `slot=` of a phase-2 member (it indexes phase 1's
tuple of outputs, a Python int by nature), grad mode (evaluation runs under no_grad) and the
shapes. Each such variant is one more entry in the cache of that one code object (e.g.
Attend.forward), whose default limit (8) a Full AttnRes model passes at its ninth
aggregation point; past the limit dynamo would quietly run the rest eagerly. Passing the
variants as data would not remove them (a sum over 5 sources is another graph than over 6)
and stacking the sources would cost a copy of them; so the limit is raised to what these
regions can need at most: every region of the class in both grad modes, and shapes of
training and evaluation (`recompile_limit`, set here once for the process).

Aggregation regions whose calls run the cpu backend's fused C kernels (on the CPU, float32
or float64, backend auto or cpu; static queries, the softmax gate: `runs_kernels`) are left
uncompiled. Inductor would trace their eager forms instead (the kernels are foreign calls),
and on the CPU its code for them is slower than the kernels, whose calls are each one pass
already. `bench/overhead.py --regional --regional-all --streams 0` measures both ways side
by side (step time x standard compiled the same way, median of interleaved rounds): with
`--examples` Block AttnRes 1.28 -> 1.18 and Full 1.81 -> 1.35, both then stepping faster
than eager; at its default width 512 with `--threads 2`, Block 1.11 -> 1.08 and Full 1.28
-> 1.11. The lowered graph's shared logits (restopo.nn.shared_sources) then work as in
eager mode. On CUDA every region is compiled, and backend auto leaves the aggregations'
eager forms to inductor there too (restopo.ops.picked_for says why).

Where the aggregation regions are compiled, the readers of a source make their own logits
(the eager sharing of restopo.nn.shared_sources switches itself off under compile): each
Full AttnRes aggregation point passes over every earlier source for its logits, fused with
the weighted sum. Running the sharing hook eagerly around compiled readers instead (their
forward compiled, not their call; each source's logits then made once, by the eager matmul)
was tried and measured no faster at the examples' size (regional Full 1.697x standard
against 1.705x, Block 1.276x against 1.242x, one interleaved run each): the fused kernel's
extra read of each source costs about what the eager logits' ops and autograd nodes cost.
"""
from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

from ..fx.lower import lowered
from ..words import counted

# Containers of regions in a lowered model (restopo.fx.lower) and in a pipeline chunk
# (backends/pipeline/stage.py ChunkModule), which use the same names.
SINGLE = ("embed", "head")
MANY = ("sublayers", "aggregations", "phases")
# torch.compile's backend: inductor, unless RESTOPO_COMPILE_BACKEND names another (the fast
# tests use aot_eager: the same dynamo regions and autograd graphs, without inductor's C++
# builds, which take minutes on a loaded 2-core machine; the long tests run inductor).
BACKEND_ENV = "RESTOPO_COMPILE_BACKEND"
# Graphs one region can need: grad mode (training, evaluation) times shapes (a training
# microbatch, an evaluation batch).
PER_REGION = 4


class CompileError(ValueError):
    """torch.compile cannot run here (said in one line naming the option)."""


def check_compile(device, mode: str = "regional", layout=None,
                  recompute: str = "none") -> None:
    """Raise CompileError when torch.compile cannot compile for `device` here, or `mode`
    cannot run in `layout` (restopo.train.layout) with `recompute`: before any work,
    rather than a traceback from inside the first step."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    if mode == "whole":
        _whole_runs(layout, recompute)
    drop = "drop --compile (or set train.compile: false)"
    try:
        check_if_dynamo_supported()
    except RuntimeError as e:
        raise CompileError(f"--compile: torch.compile cannot run here ({e}); {drop}") from None
    if (os.environ.get(BACKEND_ENV) or "inductor") != "inductor":
        return
    if device.type == "cpu":
        try:
            _cpp_compiler()
        except Exception as e:
            raise CompileError(f"--compile: torch.compile (inductor) needs a C++ compiler on "
                               f"the CPU and found none ({e}); install g++, or "
                               f"{drop}") from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileError(f"--compile: torch.compile (inductor) needs triton on CUDA; "
                               f"pip install triton, or {drop}")


def _cpp_compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def regions(*roots: nn.Module) -> list[nn.Module]:
    """The region modules of lowered models or pipeline chunks, each once."""
    found: dict[int, nn.Module] = {}
    for root in roots:
        for name in SINGLE:
            m = getattr(root, name, None)
            if isinstance(m, nn.Module):
                found.setdefault(id(m), m)
        for name in MANY:
            many = getattr(root, name, None) or ()
            for m in (many.values() if isinstance(many, nn.ModuleDict) else many):
                found.setdefault(id(m), m)
    return list(found.values())


def compile_regions(model: nn.Module, stepper=None, *, kernels: bool = False) -> int:
    """Compile in place every region of `model` (and of the pipeline chunks a stepper runs)
    but the aggregation regions that run the fused C kernels (see above; `kernels`: those
    too, for comparison); the number compiled. Compilation itself happens at each region's
    first call."""
    roots = [lowered(model)]
    trained = getattr(stepper, "trained", None)
    if isinstance(trained, nn.ModuleList):  # pipeline chunks: their own phase-1 modules
        roots += list(trained)
    found = regions(*roots)
    home = _home(roots)
    if home is not None and not kernels:
        found = [m for m in found if not _runs_kernels(m, *home)]
    per_code = Counter(type(m).forward.__code__ for m in found)
    needed = PER_REGION * max(per_code.values(), default=1)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit,
                                             PER_REGION * len(found))
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    for m in found:
        m.compile(backend=backend)
    return len(found)


def compile_model(model: nn.Module, stepper=None, mode: str = "regional") -> int | str:
    """train.compile's `mode`: regional (compile_regions; the number of regions compiled),
    or whole: the lowered model compiled in place as one graph (what bench/overhead.py
    times as `compile`), for one process or DDP (check_compile refuses the rest). Whole
    steps faster and compiles slower: at the examples' size a Block AttnRes step took 202
    against 230 ms, and the first step 68 against 14 s (`bench/overhead.py --examples
    --compile-time --rounds 1`)."""
    if mode != "whole":
        return compile_regions(model, stepper)
    gm = lowered(model)
    _whole_runs(None, getattr(gm, "restopo_recompute", "none"), stepper)
    gm.compile(backend=os.environ.get(BACKEND_ENV) or "inductor")
    return "the whole model"


def _whole_runs(layout, recompute: str, stepper=None) -> None:
    """Raise CompileError where train.compile: whole cannot run (spec.combos says where: a
    pipeline's chunks or FSDP units, in the layout or a stepper that runs them, and
    recompute by sublayer)."""
    from ..spec.combos import compile_conflict, said

    sharded = stepper is not None or (layout is not None and not layout.whole)
    why = compile_conflict("whole", recompute, sharded=sharded)
    if why is not None:
        raise CompileError(said(why))


def _home(roots) -> tuple[torch.device, torch.dtype] | None:
    """(device, dtype) of the models' floating-point parameters (None: they have none),
    past those on the meta device (a pipeline's whole model, whose chunks hold the real
    ones)."""
    for root in roots:
        for p in root.parameters():
            if p.is_floating_point() and p.device.type != "meta":
                return p.device, p.dtype
    return None


def _runs_kernels(module: nn.Module, device, dtype) -> bool:
    """Whether `module` is an aggregation region that runs the fused C kernels as it is."""
    runs = getattr(module, "runs_kernels", None)
    return runs is not None and runs(device, dtype)


def _compiled(what: int | str) -> str:
    """compile_model's answer in words: a number of regions, or what was compiled."""
    return f"{what} regions" if isinstance(what, int) else what


def compiling_line(what: int | str) -> str:
    """What rank 0 says before the first step of a compiled run."""
    return f"compiling {_compiled(what)} in the first step (seconds to minutes) ..."


def compiled_line(what: int | str, seconds: float) -> str:
    """What rank 0 says after the first step of a compiled run, with the graph breaks dynamo
    met in it: code past a break runs uncompiled, and a run whose layers all ran so was
    once said to be compiled and nothing more."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return (f"compiled {_compiled(what)} in {seconds:.1f} s (the first step, compilation "
            f"included; evaluation compiles its no-grad variants at its first batch)"
            + (f"; {counted(breaks, 'graph break')}, past which code runs "
               f"uncompiled (TORCH_LOGS=graph_breaks says where)" if breaks else ""))
