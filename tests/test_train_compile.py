"""Regional compilation (train.compile, restopo.train.compile): compiled training gives the
eager losses, resumes exactly, reaches torchrun's workers, and compiles each region once.

The fast tests compile with torch's aot_eager backend (RESTOPO_COMPILE_BACKEND): the same
dynamo regions, guards and traced autograd graphs as inductor (the code paths that differ
from eager under compile, `torch.compiler.is_compiling()`), without inductor's C++ builds,
which take minutes on a loaded 2-core machine. The `long` tests run inductor.
"""
import argparse

import pytest
import torch

from restopo.api import build_model
from restopo.fx.lower import lowered
from restopo.spec.objects import ModelSpec
from restopo.topology import block_attnres, full_attnres, standard
from restopo.train.compile import BACKEND_ENV, compile_model, compile_regions, regions
from restopo.train.loop import train
from test_train_loop import Stop, _stopping, corpus, one_thread  # noqa: F401  (fixtures)
from test_train_processes import env  # noqa: F401  (fixture: process env, corpus ready)
from test_train_loop import cfg as loop_cfg
from test_train_loop import records as losses

TINY = ModelSpec(vocab=256, width=32, depth=2, heads=2, context=16)
TOPOLOGIES = {"standard": standard, "block": lambda k: block_attnres(k, blocks=2),
              "full": full_attnres}


def tiny_model(kind: str, seed: int = 0, backend: str = "eager"):
    torch.manual_seed(seed)
    return build_model(TINY, TOPOLOGIES[kind](TINY.kinds), backend=backend)


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")


def cfg(**kw):
    return loop_cfg(**{**dict(steps=20, batch=4, context=16, warmup=2, eval_every=0,
                              eval_batches=1, save_every=0), **kw})


def compiled(kind, seed=0):
    model = tiny_model(kind, seed)
    return model, compile_regions(model)


def test_regions_are_the_called_modules_each_once():
    model = tiny_model("block")
    found = regions(model, model)  # twice the same root: still each module once
    expected = [model.embed, model.head, *model.sublayers, *model.aggregations, *model.phases]
    assert {id(m) for m in found} == {id(m) for m in expected}
    assert len(found) == len(expected)
    names = [n for n, _ in model.named_parameters()]
    compile_regions(model)
    assert [n for n, _ in model.named_parameters()] == names  # in place: names unchanged
    assert all(m._compiled_call_impl is not None for m in expected)
    assert model.context._compiled_call_impl is None


@pytest.mark.parametrize("kind,backend", [("standard", "eager"), ("block", "eager"),
                                          ("block", "auto"), ("full", "auto")])
def test_compiled_training_gives_the_eager_losses(kind, backend, tmp_path, corpus, aot_eager):
    """backend auto: the aggregations run the C kernels uncompiled between compiled
    sublayers (where the kernels build; else the eager forms, compiled)."""
    train(tiny_model(kind, backend=backend), corpus, cfg(), tmp_path / "eager", progress=False)
    model = tiny_model(kind, backend=backend)
    n = compile_regions(model)
    train(model, corpus, cfg(), tmp_path / "compiled", progress=False, compiled=n)
    want, got = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(got) == len(want) == 20
    # The compiled regions trace autograd's own ops where eager runs hand-written
    # backwards (restopo/backends/eager): float32 roundoff differs, and 20 AdamW steps
    # carry it on; measured differences are ~1e-6 of a loss of ~5.5.
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)


@pytest.mark.parametrize("mode", ["sublayer", "block"])
def test_compiled_regions_inside_recomputed_ones_give_the_eager_losses(mode, tmp_path, corpus,
                                                                        aot_eager):
    """train.compile with train.recompute: compiled regions run again in backward."""
    from restopo.fx.recompute import apply as recompute

    c = cfg(steps=6)
    train(tiny_model("block"), corpus, c, tmp_path / "eager", progress=False)
    model = recompute(tiny_model("block"), mode)
    train(model, corpus, c, tmp_path / "both", progress=False,
          compiled=compile_regions(model))
    for a, b in zip(losses(tmp_path / "eager"), losses(tmp_path / "both"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)


@pytest.mark.parametrize("kind,recompute", [("block", "none"), ("full", "none"),
                                            ("block", "block")])
def test_whole_model_compiled_training_gives_the_eager_losses(kind, recompute, tmp_path, corpus,
                                                              aot_eager):
    """train.compile: whole, the lowered model as one graph (backend auto: the eager forms
    traced, where eager mode runs the C kernels), with and without recompute."""
    from restopo.fx.recompute import apply

    c = cfg(steps=8)
    train(apply(tiny_model(kind, backend="auto"), recompute), corpus, c, tmp_path / "eager",
          progress=False)
    model = apply(tiny_model(kind, backend="auto"), recompute)
    what = compile_model(model, None, "whole")
    assert what == "the whole model" and lowered(model)._compiled_call_impl is not None
    assert all(m._compiled_call_impl is None for m in model.sublayers)  # one graph, not regions
    train(model, corpus, c, tmp_path / "whole", progress=False, compiled=what)
    for a, b in zip(losses(tmp_path / "eager"), losses(tmp_path / "whole"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)


def test_whole_model_compile_refuses_what_it_cannot_trace():
    """Recompute by sublayer (torch's composable checkpoint hooks) fails inside one graph
    (the recomputed values differ from the saved ones): refused, naming what works."""
    from restopo.fx.recompute import apply
    from restopo.train.compile import CompileError, check_compile
    from restopo.train.layout import Layout

    with pytest.raises(CompileError, match="recompute: sublayer.*recompute: block"):
        compile_model(apply(tiny_model("block"), "sublayer"), None, "whole")
    with pytest.raises(CompileError, match="recompute: sublayer"):
        check_compile(torch.device("cpu"), "whole", Layout(1), "sublayer")
    with pytest.raises(CompileError, match="FSDP"):
        check_compile(torch.device("cpu"), "whole", Layout(2, data="fsdp"))
    with pytest.raises(CompileError, match="a pipeline"):
        check_compile(torch.device("cpu"), "whole", Layout(2, pipeline=object()))
    check_compile(torch.device("cpu"), "whole", Layout(2, data="ddp"), "block")


def test_resume_of_a_whole_model_compiled_run_is_bitwise(tmp_path, corpus, aot_eager):
    c = cfg(steps=12, save_every=6, eval_every=3)
    model = tiny_model("block")
    train(model, corpus, c, tmp_path / "full", progress=False,
          compiled=compile_model(model, None, "whole"))
    part = tmp_path / "part"
    model = tiny_model("block")
    with pytest.raises(Stop):
        train(_stopping(model, 6), corpus, c, part, progress=False,
              compiled=compile_model(model, None, "whole"))
    model = tiny_model("block", seed=123)
    train(model, corpus, c, part, progress=False, compiled=compile_model(model, None, "whole"),
          resume_from=part / "ckpt" / "step_000006")
    want, got = losses(tmp_path / "full"), losses(part)
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(want[6:], got[6:]):
        assert (b["loss"], b["val_loss"]) == (a["loss"], a["val_loss"])


def test_resume_of_a_compiled_run_is_bitwise(tmp_path, corpus, aot_eager):
    """Train 10, save, resume to 20 == 20 uninterrupted, bitwise: the same compiled code
    runs the same float ops in the same order on the CPU, and the checkpoint holds every
    state the steps read (weights, AdamW moments, data position, RNG)."""
    c = cfg(save_every=10, eval_every=5)  # evaluation: the no-grad variants too
    model, n = compiled("block")
    train(model, corpus, c, tmp_path / "full", progress=False, compiled=n)
    part = tmp_path / "part"
    model, n = compiled("block")
    with pytest.raises(Stop):  # dies in step 11; the last checkpoint is step 10
        train(_stopping(model, 10), corpus, c, part, progress=False, compiled=n)
    model, n = compiled("block", seed=123)  # other weights: all must come from the checkpoint
    train(model, corpus, c, part, progress=False, compiled=n,
          resume_from=part / "ckpt" / "step_000010")
    want, got = losses(tmp_path / "full"), losses(part)
    assert [r["step"] for r in got] == list(range(1, 21))
    for a, b in zip(want[10:], got[10:]):
        assert (b["loss"], b["val_loss"]) == (a["loss"], a["val_loss"])


@pytest.mark.parametrize("backend", ["auto", "eager"])
def test_aggregations_on_the_c_kernels_stay_uncompiled(backend):
    """Regions whose calls run the cpu backend's fused kernels are left as they are (inductor
    would trace their eager forms instead, slower on the CPU); the rest are compiled. The
    eager backend's aggregations, and any of another dtype, are compiled."""
    from restopo import ops

    if backend == "auto" and not ops.cpu_kernels("auto", torch.device("cpu"), torch.float32):
        pytest.skip("the cpu backend's kernels do not build here")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = build_model(TINY, block_attnres(TINY.kinds, blocks=2), backend=backend)
        model.to(dtype)
        compile_regions(model)
        fused = backend == "auto" and dtype == torch.float32
        assert all(m._compiled_call_impl is not None
                   for m in (model.embed, model.head, *model.sublayers))
        wiring = (*model.aggregations, *model.phases)  # all static softmax depth attention
        assert len(wiring) == 7
        assert all((m._compiled_call_impl is None) == fused for m in wiring), dtype


def test_which_regions_run_kernels_never_raises_off_the_cpu():
    """A pipeline's whole model is built on the meta device (its chunks hold the weights):
    the regions' device is read past it, and asking about a device the cpu backend cannot
    run on is an answer (False), not the backend's error."""
    from restopo import ops
    from restopo.train.compile import _home

    assert ops.cpu_kernels("cpu", torch.device("meta"), torch.float32) is False
    assert ops.cpu_kernels("auto", "meta", torch.float32) is False
    with torch.device("meta"):
        meta = tiny_model("block")
    cpu = tiny_model("block").double()
    assert _home([meta, cpu]) == (torch.device("cpu"), torch.float64)
    assert _home([meta]) is None


def test_full_attnres_compiles_every_aggregation_point(monkeypatch):
    """Full AttnRes's aggregation points differ in their number of sources: one graph each
    in the cache of Attend.forward's one code object, more than dynamo's default limit of 8;
    past it the rest would run eagerly without a word. compile_regions raises the limit for
    them; the sublayers of one kind share one graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from restopo.nn.aggregate import Attend
    from restopo.nn.sublayers import MLP, Attention

    monkeypatch.setenv(BACKEND_ENV, "eager")  # dynamo's regions and guards only
    torch._dynamo.reset()
    spec = ModelSpec(vocab=256, width=32, depth=5, heads=2, context=16)  # 11 aggregations
    torch.manual_seed(0)
    model = build_model(spec, full_attnres(spec.kinds), backend="eager")
    compile_regions(model)
    model(torch.randint(0, 256, (2, 16))).mean().backward()
    entries = {f: len(_debug_get_cache_entry_list(f.__code__))
               for f in (Attend.forward, Attention.forward, MLP.forward)}
    assert entries == {Attend.forward: 11, Attention.forward: 1, MLP.forward: 1}


def test_the_flag_reaches_the_spec_and_the_workers():
    from restopo.commands.train import _overrides, _worker_argv
    from restopo.spec import parse_spec

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    from restopo.commands import train as command

    command.register(sub)
    args = p.parse_args(["train", "x.restopo", "--compile", "--nproc", "2"])
    assert "--compile" in _worker_argv(args)
    assert "train.compile=true" in _overrides(args)
    assert "--compile" not in _worker_argv(p.parse_args(["train", "x.restopo"]))
    text = "model m { vocab: 256; width: 32; depth: 2; heads: 2; context: 16 }\n" \
           "residual standard\ntrain { compile: true }\n"
    assert parse_spec(text, "m.restopo").train.compile == "regional"  # true's other name
    assert parse_spec(text.replace("true", "false"), "m.restopo").train.compile == "off"
    assert parse_spec(text, "m.restopo", ("train.compile=false",)).train.compile == "off"
    for mode in ("off", "regional", "whole"):
        assert parse_spec(text, "m.restopo", (f"train.compile={mode}",)).train.compile == mode
    assert parse_spec(text.replace("compile: true", "steps: 3"), "m.restopo").train.compile \
        == "off"
    from restopo.spec import SpecError

    with pytest.raises(SpecError, match=r"m.restopo:3:\d+: .*unknown compile 'wholee'"):
        parse_spec(text.replace("true", "wholee"), "m.restopo")
    # --compile asks for compilation: regional, unless the spec or a --set already says how;
    # only a --set that turns it off disagrees
    def flagged(argv, spec_text=text):
        overrides = _overrides(p.parse_args(["train", "x.restopo", "--compile", *argv]))
        return parse_spec(spec_text, "m.restopo", overrides).train.compile

    assert flagged([], text.replace("compile: true", "steps: 3")) == "regional"
    assert flagged([]) == "regional"
    assert flagged([], text.replace("compile: true", "compile: whole")) == "whole"
    assert flagged([], text.replace("compile: true", "compile: off")) == "regional"
    assert flagged(["--set", "train.compile=whole"]) == "whole"
    assert flagged(["--set", "train.compile=regional"]) == "regional"
    from restopo.commands.train import _Stop

    for off in ("off", "false"):
        with pytest.raises(_Stop, match=f"--compile and --set train.compile={off} disagree"):
            flagged(["--set", f"train.compile={off}"])


CLI_SPEC = """\
model t { vocab: 256; width: 32; depth: 2; heads: 2; context: 16 }
residual block_attnres(blocks: 2)
train { data: builtin:stdlib; steps: 4; batch: 4; warmup: 1; eval_every: 2; eval_batches: 1
        save_every: 2; log_every: 1; compile: true }
"""


@pytest.fixture
def cli_spec(tmp_path, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("RESTOPO_CACHE", str(tmp_path_factory.mktemp("restopo-cache")))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = tmp_path / "t.restopo"
    path.write_text(CLI_SPEC)
    return path


def test_cli_compiles_and_says_the_compile_time(cli_spec, tmp_path, capsys, aot_eager):
    from restopo.cli import main

    from restopo import ops

    assert main(["train", str(cli_spec), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    # embed, head and 4 sublayers; the 5 aggregations and 2 phases too where they would run
    # eager forms, not the C kernels (which regional compilation leaves as they are)
    n = 6 if ops.cpu_kernels("auto", torch.device("cpu"), torch.float32) else 13
    assert err.count(f"compiled {n} regions in ") == 1


def test_cli_compiles_the_whole_model(cli_spec, tmp_path, capsys, aot_eager):
    from restopo.cli import main

    out = tmp_path / "run"
    assert main(["train", str(cli_spec), "--out", str(out), "--no-progress", "--set",
                 "train.compile=whole"]) == 0
    err = capsys.readouterr().err
    assert err.count("compiling the whole model in the first step") == 1  # said before it
    assert err.count("compiled the whole model in ") == 1
    assert err.index("compiling the whole") < err.index("compiled the whole")
    assert (out / "ckpt" / "step_000004").is_dir()


def test_whole_model_compile_that_cannot_run_is_one_line(cli_spec, tmp_path, capsys):
    from restopo.cli import main

    out = tmp_path / "run"
    assert main(["train", str(cli_spec), "--out", str(out), "--no-progress", "--set",
                 "train.compile=whole", "--recompute", "sublayer"]) == 1
    err = capsys.readouterr().err
    # refused by the spec check (spec.combos), pointing at the setting typed, as `restopo
    # check` refuses it
    assert "Traceback" not in err and err.startswith(
        "<--set 1>:1:21: error: train.compile: whole does not combine with train.recompute: "
        "sublayer"), err
    assert "hint: use train.recompute: block, or train.compile: regional" in err
    assert not (out / "ckpt").exists()


def test_whole_model_compile_refused_in_a_sharded_layout_says_a_flag_that_works(
        cli_spec, tmp_path, capsys):
    """A spec (or a resumed checkpoint) saying compile: whole, trained with FSDP: the hint's
    flag must get past the refusal. It said --compile, which keeps a spec's whole."""
    import re
    import shlex

    from restopo.cli import main

    cli_spec.write_text(CLI_SPEC.replace("compile: true", "compile: whole"))
    argv = ["train", str(cli_spec), "--out", str(tmp_path / "run"), "--no-progress",
            "--nproc", "2", "--data", "fsdp"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "whole compiles the model as one graph" in err
    flag = re.search(r"\((--[^)]*)\)", err.split("hint:")[-1]).group(1)
    # an odd batch stops the run at the layout check, after the spec's: no process starts
    assert main(argv + shlex.split(flag) + ["--set", "train.batch=3"]) == 1
    err = capsys.readouterr().err
    assert "one graph" not in err and "train.batch (3) does not split" in err, err


def test_compile_that_cannot_run_is_one_line(cli_spec, tmp_path, capsys, monkeypatch):
    """No C++ compiler for inductor on the CPU: said before any work, naming the option."""
    import restopo.train.compile as regional
    from restopo.cli import main

    monkeypatch.delenv(BACKEND_ENV, raising=False)

    def missing():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(regional, "_cpp_compiler", missing)
    out = tmp_path / "run"
    assert main(["train", str(cli_spec), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--compile" in err and "C++ compiler" in err and "train.compile: false" in err
    assert not (out / "ckpt").exists()


# -- inductor (long: minutes of C++ builds on a loaded 2-core machine) -------------------------
@pytest.mark.long
@pytest.mark.parametrize("kind", ["standard", "block", "full"])
def test_inductor_training_gives_the_eager_losses(kind, tmp_path, corpus, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    train(tiny_model(kind), corpus, cfg(), tmp_path / "eager", progress=False)
    model, n = compiled(kind)
    train(model, corpus, cfg(), tmp_path / "compiled", progress=False, compiled=n)
    for a, b in zip(losses(tmp_path / "eager"), losses(tmp_path / "compiled"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)


LAYOUT_SPEC = CLI_SPEC.replace("steps: 4", "steps: 6; schedule: constant") \
    .replace("eval_every: 2", "eval_every: 3").replace("save_every: 2", "save_every: 3") \
    .replace("; compile: true", "")


@pytest.mark.long
@pytest.mark.parametrize("layout", [[], ["--nproc", "2"], ["--nproc", "2", "--data", "fsdp"],
                                    ["--nproc", "2", "--pipeline", "2x1"]],
                         ids=["1", "ddp", "fsdp", "pipeline"])
def test_inductor_layouts_match_eager_and_resume_exactly(layout, tmp_path, tmp_path_factory):
    """Each layout compiled: the eager layout's losses (fp32), and 3 steps then a resume to 6
    equal 6 uninterrupted compiled steps bitwise (a constant schedule, so that --steps
    changes nothing else)."""
    import os
    import subprocess
    import sys

    spec = tmp_path / "t.restopo"
    spec.write_text(LAYOUT_SPEC)
    env = dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_DIST_TIMEOUT="600",
               RESTOPO_CACHE=str(tmp_path_factory.mktemp("cache")))
    env.pop(BACKEND_ENV, None)

    def run(out, *extra):
        proc = subprocess.run([sys.executable, "-m", "restopo", "train", str(spec), "--out",
                               str(tmp_path / out), "--no-progress", *layout, *extra],
                              env=env, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stderr

    run("eager")
    assert "compiled " in run("compiled", "--compile")
    run("part", "--compile", "--steps", "3")
    run("part", "--compile", "--resume", "--steps", "6")
    eager, full, part = (losses(tmp_path / o) for o in ("eager", "compiled", "part"))
    for a, b in zip(eager, full, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5, abs=0)
    assert [(r["step"], r["loss"], r["val_loss"]) for r in part] == \
        [(r["step"], r["loss"], r["val_loss"]) for r in full]


def test_a_lowered_model_compiles_whole_without_graph_breaks(monkeypatch):
    """Lowering loads the aggregation backend: looked up first inside a compiled frame, its
    entry point was a graph break (and the backend's autograd Functions then ran frame by
    frame) in whichever compiled model called an aggregation op first."""
    from torch._dynamo.utils import counters

    from restopo import registry

    monkeypatch.setattr(registry, "_backends", {})  # as in a fresh process
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("block")
    torch.compile(model, backend="eager")(torch.randint(0, 256, (2, 16))).mean().backward()
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("kind", ["standard", "block", "full"])
def test_whole_model_compile_with_block_recompute_has_no_graph_breaks(kind):
    """compile: whole with recompute: block. Each recomputed region opened the shared-logits
    scope inside its checkpoint, a mutation dynamo refuses there: it broke the graph at
    every region and ran the layers eagerly (no faster than eager, and said as compiled),
    for every topology whose readers share logits; the losses were right, so the tests
    that compare losses passed."""
    from torch._dynamo.utils import counters

    from restopo.fx.recompute import apply

    torch._dynamo.reset()
    counters.clear()
    model = apply(tiny_model(kind, backend="auto"), "block")
    lowered(model).compile(backend="eager")  # what compile_model(model, None, "whole") does
    model(torch.randint(0, 256, (2, 16))).mean().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_the_compile_line_says_the_graph_breaks(monkeypatch):
    from collections import Counter

    from torch._dynamo.utils import counters

    from restopo.train.compile import compiled_line
    monkeypatch.setitem(counters, "graph_break", Counter())
    assert "graph break" not in compiled_line("the whole model", 2.0)
    counters["graph_break"]["a reason"] += 3
    assert compiled_line(4, 2.0).endswith("; 3 graph breaks, past which code runs uncompiled "
                                          "(TORCH_LOGS=graph_breaks says where)")


@pytest.mark.slow
@pytest.mark.parametrize("how", [["--set", "train.compile=whole"],
                                 ["--compile", "--pipeline", "2x1", "--backend", "cpu"]],
                         ids=["whole-ddp", "pipeline"])
def test_compiled_processes_follow_one_process(tmp_path, env, how):
    """2 processes (torchrun, gloo), compiled: train.compile: whole under DDP, and regional
    compilation of a pipeline's stages on the cpu backend (each rank's chunk, its
    aggregations left to the C kernels): the losses of one uncompiled process with the
    same global batch."""
    import json
    import subprocess
    import sys

    from restopo.registry import get_backend

    if "cpu" in how and not get_backend("cpu").available()[0]:
        pytest.skip("the cpu backend's kernels do not build here")

    spec = tmp_path / "t.restopo"
    spec.write_text(CLI_SPEC.replace("compile: true", "compile: false"))

    def run(out, *argv):
        proc = subprocess.run([sys.executable, "-m", "restopo", "train", str(spec), "--out",
                               str(out), "--no-progress", "--device", "cpu", *argv],
                              env={**env, BACKEND_ENV: "aot_eager"}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(out / "metrics.jsonl") as f:
            return proc.stderr, [json.loads(line)["loss"] for line in f]

    _, want = run(tmp_path / "one")
    err, got = run(tmp_path / "two", "--nproc", "2", *how)
    assert err.count("compiled ") == 1  # rank 0 says it
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
