"""The checking pass: syntax tree (nodes.py) + overrides -> checked Spec (objects.py).

The sections are gathered into views (sections.py), the overrides applied to them
(overrides.py), and each view checked into its spec object here (the residual section in
wiring.py).

Every independent mistake is collected (not just the first), each at the line and column
of the text that caused it, with a hint; they are raised together as SpecErrors. Nothing
here evaluates user text: values are matched against fixed vocabularies and number forms.
"""
from __future__ import annotations

import re
from dataclasses import replace

from .. import topology as T
from ..words import alts, counted
from .errors import SpecError, closest, did_you_mean, inside, raise_all
from .fields import (EXAMPLES, MAX_DEPTH, Checker, Field, View, divisors, dym_suffix,
                     positions)
from .nodes import (SECTIONS, Call, Key, ListValue, Name, Number, Pos, Qualified, SpecFile,
                    String, blame, describe, from_command_line)
from .combos import compile_conflict, recompute_conflict
from .limits import (check_microbatches, check_model_limits, check_source_reads,
                     check_train_limits)
from .objects import (COMPILE, COMPILE_ALIASES, DATA_ENGINES, LR_SCHEDULES, RECOMPUTE,
                      SCHEDULES, ModelSpec, ParallelSpec, Spec, SourceText, TrainSpec)
from .overrides import apply_overrides
from .keys import (KEY_HOMES, MODEL_KEYS, MODEL_REQUIRED, PARALLEL_KEYS, PIPELINE_KEYS,
                   TRAIN_KEYS)
from .sections import BUILTIN_DATA, SHARED, views_of
from .wiring import check_against_model, check_residual

MLP_KINDS = ("swiglu", "gelu")


# -- sections -> spec objects -------------------------------------------------------------
def check_model(view: View, c: Checker) -> ModelSpec | None:
    before = len(c.errors)
    misspelled = c.unknown_keys(view, MODEL_KEYS, "model")
    f = view.fields
    for k in MODEL_REQUIRED:
        if k not in f and k not in misspelled and k not in view.unvalued:
            c.error(view.kind.pos, f"the model section is missing '{k}'",
                    f"add '{EXAMPLES[k]}'" + ("; heads must divide width" if k == "heads" else ""))
    got = {}
    for k, lo, why in (("vocab", 2, "the vocabulary needs at least 2 tokens"),
                       ("width", 1, None), ("depth", 1, "depth counts transformer layers"),
                       ("heads", 1, None), ("context", 1, "the context length in tokens")):
        if k in f:
            got[k] = c.integer(f[k], k, lo, MAX_DEPTH if k == "depth" else None, why=why)
    w, h = got.get("width"), got.get("heads")
    if w and h and (w % h or (w // h) % 2):
        # heads must divide width, and rotary positions rotate channel pairs within a head,
        # so the head size must be even: suggest only heads that pass both
        even = [d for d in divisors(w) if (w // d) % 2 == 0]
        near = sorted(even, key=lambda d: (abs(d - h), d))[:3]
        if w % h:
            msg = f"heads ({h}) must divide width ({w})"
            hint = f"heads that divide {w} with an even head size: "
        else:
            msg = (f"the head size width/heads = {w // h} is odd; rotary "
                   f"positions rotate channel pairs, so it must be even")
            hint = "heads giving an even head size: "
        c.error(blame(f["heads"].value.pos, f["width"].value.pos), msg,
                hint + ", ".join(map(str, sorted(near))) if near
                else f"no heads do for an odd width ({w}); make the width even")
        got["heads"] = None
    mlp, ratio = "swiglu", 4.0
    if "mlp" in f:
        mlp, ratio = _mlp(f["mlp"], c)
    if "mlp_ratio" in f:  # read even when given twice: a mistake in it is one more to fix
        given = c.real(f["mlp_ratio"], "mlp_ratio", 0, above=True, ratio=True)
        if "mlp" in f and isinstance(f["mlp"].value, Call):
            c.error(f["mlp_ratio"].key.pos, "the MLP ratio is given twice (mlp: ...(ratio) and "
                    "mlp_ratio:)", "keep one of them")
        else:
            ratio = given
    layer = ("attn", "mlp")
    if "layer" in f:
        layer = _layer(f["layer"], c)
    tie = True
    if "tie_embeddings" in f:
        tie = c.boolean(f["tie_embeddings"], "tie_embeddings")
    if (mlp == "gelu" and ratio is not None and got.get("width")
            and round(ratio * got["width"]) < 1):
        where = f["mlp_ratio"].value if "mlp_ratio" in f else f["mlp"].value.args[0].value
        c.error(where.pos, f"the MLP's hidden width, ratio x width = {ratio:g} x "
                f"{got['width']}, rounds to 0 units", f"give a ratio of at least "
                f"{1 / got['width']:.3g}x, e.g. gelu(4x)")
    if len(c.errors) > before or view.unvalued or None in (mlp, ratio, layer, tie) \
            or None in got.values():
        return None
    return ModelSpec(got["vocab"], got["width"], got["depth"], got["heads"], got["context"],
                     mlp, float(ratio), layer, tie, view.label.text if view.label else None,
                     pos=view.kind.pos, positions=positions(view))


def _mlp(fl: Field, c: Checker):
    items = fl.value.items if isinstance(fl.value, ListValue) else ()
    if len(items) == 2 and isinstance(items[0], Name) and isinstance(items[1], Number):
        kind, ratio = items[0].text, items[1].text  # `mlp: swiglu 4x`
        called = f"{kind}({ratio})"
        c.error(items[1].pos, f"the MLP ratio goes in parentheses, got '{kind} {ratio}'",
                f"write {c.src.rewrite(fl.pos, fl.value.pos, called) or 'mlp: ' + called}, "
                f"or mlp: {kind} and mlp_ratio: {ratio}")
        return None, None
    v = c.single(fl, "mlp")
    if v is None:
        return None, None
    name = v.name if isinstance(v, Call) else v
    if not isinstance(name, Name):
        hint = c.example(fl, "mlp", value="swiglu(4x)")
        if isinstance(v, String) and v.value.strip() in MLP_KINDS:
            hint = ("write it without the quotes: "
                    + (c.src.rewrite(fl.pos, v.pos, v.value.strip()) or "mlp: " + v.value))
        elif isinstance(v, Number):  # `mlp: 3x`: a ratio without its kind
            called = f"swiglu({v.text})"
            hint = (f"a ratio goes with its kind: "
                    f"{c.src.rewrite(fl.pos, v.pos, called) or 'mlp: ' + called}, or "
                    f"mlp_ratio: {v.text}")
        c.error(v.pos, f"expected an MLP kind ({alts(MLP_KINDS)}), got '{describe(v)}'", hint)
        return None, None
    if name.text not in MLP_KINDS:
        c.error(name.pos, f"unknown MLP kind '{name.text}'", did_you_mean(name.text, MLP_KINDS))
        return None, None
    if isinstance(v, Name):
        return name.text, 4.0
    if len(v.args) != 1 or v.args[0].key is not None:
        c.error(v.pos, f"{name.text}(...) takes one ratio, e.g. {name.text}(4x)",
                "the ratio is the hidden width over the model width")
        return None, None
    ratio = c.real(Field(Key(("mlp",), v.pos), v.args[0].value, v.pos), "mlp ratio", 0,
                   above=True, ratio=True)
    return name.text, ratio


def _layer(fl: Field, c: Checker):
    items = fl.value.items if isinstance(fl.value, ListValue) else (fl.value,)
    out = []
    for it in items:
        if not isinstance(it, Name) or it.text not in T.SUBLAYER_KINDS:
            c.error(it.pos, f"unknown sublayer kind '{describe(it)}'",
                    did_you_mean(describe(it), T.SUBLAYER_KINDS))
            return None
        out.append(it.text)
    if out[0] != "attn":
        c.error(items[0].pos, "a transformer layer must begin with 'attn'",
                "block boundaries fall before attention sublayers; e.g. layer: attn mlp")
        return None
    return tuple(out)


def check_parallel(view: View, c: Checker) -> ParallelSpec | None:
    before = len(c.errors)
    c.unknown_keys(view, PARALLEL_KEYS, "parallel")
    f = view.fields
    if view.bad:
        return None
    # A section made by --set values alone (parallel.cache=false beside --pipeline, which
    # gives the stages) needs no stages; one written in the file does, as does one that
    # sets nothing (`parallel { }`, --set parallel=pipeline): it would ask for nothing.
    made_by_set = bool(f) and from_command_line(view.kind.pos.source)
    if "stages" not in f and "data" not in f and not made_by_set and not view.unvalued:
        at = (view.head or view.kind).pos
        hint = ("e.g. parallel { pipeline(stages: 2, microbatches: 4) } or parallel { data: "
                "fsdp }" + ("" if f else "; or remove the section"))
        call = re.match(r"pipeline[ \t]*\(([^()#]*)\)?", (c.src.line(at) or "")[at.column - 1:])
        if from_command_line(at.source):
            hint = "e.g. --set 'parallel=pipeline(stages: 2)'"
        elif f and call:  # the pipeline(...) as written (on its line), with its stages
            args = call.group(1).strip() if call.group().endswith(")") else "..."
            hint = f"add them: pipeline(stages: 2, {args})"
        elif f:
            hint = "add them, e.g. 'stages: 2'"
        c.error(at, "the parallel section is missing 'stages'" if f else
                "the parallel section is empty: it asks for no pipeline and no data-parallel "
                "engine", hint)
        return None
    stages = c.integer(f["stages"], "stages", 1, why="the number of pipeline ranks") \
        if "stages" in f else 1
    data = "ddp"
    if "data" in f:
        data = None if _misplaced(f["data"], "data", "parallel", c) else \
            c.choice(f["data"], "data", DATA_ENGINES)
    virtual = c.integer(f["virtual"], "virtual", 1,
                        why="model chunks per rank") if "virtual" in f else 1
    if stages == 1 and virtual and virtual > 1 and "stages" in f:
        # train refuses it (a pipeline needs 2 stages), so check must too
        c.error(blame(f["stages"].value.pos, f["virtual"].value.pos),
                f"a pipeline needs at least 2 stages; got stages: 1 with virtual: {virtual}",
                "virtual stages interleave chunks over the pipeline's ranks; use stages: 2 "
                "or more, or leave virtual out")
    schedule = None
    if "schedule" in f:
        schedule = None if _misplaced(f["schedule"], "schedule", "parallel", c) else \
            c.choice(f["schedule"], "schedule", SCHEDULES)
        # gpipe over virtual stages runs looped (the runtime's ScheduleLoopedBFS, tested
        # against one process); 1f1b over them would be interleaved_1f1b: say that instead
        if schedule == "1f1b" and virtual and virtual > 1:
            c.error(blame(f["schedule"].value.pos, f["virtual"].value.pos),
                    f"schedule 1f1b runs one chunk per stage, but virtual is {virtual}",
                    "use schedule: interleaved_1f1b (1F1B over virtual stages) or gpipe, or "
                    "virtual: 1")
    elif virtual:
        schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
    micro = stages
    if "microbatches" in f:
        micro = c.integer(f["microbatches"], "microbatches", 1)
        if micro and stages and micro < stages:
            c.error(blame(f["microbatches"].value.pos, f["stages"].value.pos if "stages" in f
                          else None),
                    f"microbatches ({micro}) must be at least stages ({stages})",
                    "with fewer microbatches than stages some stages would sit idle; "
                    f"use microbatches: {stages} or more")
            micro = None
    cache = True
    if "cache" in f:
        cache = c.boolean(f["cache"], "cache")
    if "stages" not in f and len(c.errors) == before:  # (a key's own mistake said first)
        _without_stages(f, virtual, c)
    if len(c.errors) > before or view.unvalued or None in (stages, virtual, schedule, micro,
                                                          cache, data):
        return None
    return ParallelSpec(stages, virtual, schedule, micro, cache, data,
                        pos=(view.head or view.kind).pos, positions=positions(view))


def _without_stages(f: dict[str, Field], virtual: int, c: Checker) -> None:
    """The pipeline keys of a parallel section without stages (beside data: fsdp, or made
    by --set): each written in the file is refused, as the section without data is; a
    --set of one stands beside `restopo train --pipeline P`, which gives the stages, except
    virtual above 1, which --pipeline PxV gives too (alone it planned a pipeline of 1
    stage)."""
    for key in PIPELINE_KEYS:
        fl = f.get(key)
        if fl is None or (_from_set(fl) and (key != "virtual" or virtual == 1)):
            continue
        said = c.src.written(fl.value.pos) or describe(fl.value)
        if _from_set(fl):
            c.error(fl.value.pos, "virtual stages need a pipeline, but the parallel section "
                    "has no stages", f"add --set parallel.stages=2 (or more); to train, "
                    f"--pipeline 2x{said} gives both")
        else:
            c.error(fl.key.pos, f"'{key}' is for a pipeline, but the parallel section has no "
                    "stages", f"add stages, e.g. parallel {{ pipeline(stages: 2, {key}: "
                    f"{said}) }}, or remove '{key}'")


def check_train(view: View, c: Checker) -> TrainSpec | None:
    before = len(c.errors)
    c.unknown_keys(view, TRAIN_KEYS, "train")
    f = view.fields
    got = {}
    ints = {"steps": 1, "batch": 1, "warmup": 0, "accum": 1, "eval_every": 0, "eval_batches": 1,
            "save_every": 0, "seed": 0, "log_every": 1, "keep": 1}
    whys = {"eval_every": "0 turns evaluation off", "save_every": "0 saves the last step only",
            "steps": "the number of optimizer steps", "batch": "sequences per optimizer step",
            "log_every": "steps between log lines", "eval_batches": "batches per evaluation",
            "accum": "gradient accumulation steps per optimizer step",
            "keep": "checkpoints kept on disk"}
    for k, lo in ints.items():
        if k in f:
            got[k] = c.integer(f[k], k, lo, why=whys.get(k))
    if "lr" in f:
        got["lr"] = c.real(f["lr"], "lr", 0, above=True, why="e.g. lr: 3e-3")
    if "min_lr" in f:
        got["min_lr"] = c.real(f["min_lr"], "min_lr", 0)
    if "weight_decay" in f:
        got["weight_decay"] = c.real(f["weight_decay"], "weight_decay", 0)
    if "grad_clip" in f:
        got["grad_clip"] = c.real(f["grad_clip"], "grad_clip", 0, why="0 turns clipping off")
    if "peak_tflops" in f:  # TFLOP/s: a spec's numbers stay below 2^31
        got["peak_tflops"] = c.real(f["peak_tflops"], "peak_tflops", 0, above=True,
                                    why="one device's peak TFLOP/s for MFU, e.g. 989")
    if "compile" in f:
        mode = c.choice(f["compile"], "compile", (*COMPILE_ALIASES, *COMPILE))
        got["compile"] = COMPILE_ALIASES.get(mode, mode)
    if "schedule" in f:
        got["schedule"] = None if _misplaced(f["schedule"], "schedule", "train", c) else \
            c.choice(f["schedule"], "schedule", LR_SCHEDULES)
    if "recompute" in f:
        got["recompute"] = c.choice(f["recompute"], "recompute", RECOMPUTE)
    if "data" in f:
        got["data"] = None if _misplaced(f["data"], "data", "train", c) else _data(f["data"], c)
    steps = got.get("steps", TrainSpec.steps)
    # A warmup longer than the run is a mistake when both are written together; when steps
    # alone is shortened on the command line (a quick `--steps 10` run) the schedule simply
    # stays in warmup, which is what a person trying a short run expects.
    # That is: steps from a --set, the warmup from the file (a warmup given by --set is
    # checked as written, with whatever steps it meets).
    steps_alone = ("steps" in f and _from_set(f["steps"])
                   and not ("warmup" in f and _from_set(f["warmup"])))
    if ("warmup" in f and got.get("warmup") is not None and steps and got["warmup"] > steps
            and not steps_alone):
        c.error(f["warmup"].value.pos, f"warmup ({got['warmup']}) is longer than steps ({steps})",
                "warmup counts optimizer steps and must be at most steps")
    lr = got.get("lr", TrainSpec.lr)
    if got.get("min_lr") is not None and lr and got["min_lr"] > lr:
        c.error(blame(f["min_lr"].value.pos, f["lr"].value.pos if "lr" in f else None),
                f"min_lr ({f['min_lr'].value.text}) is above lr ({lr:g})",
                "min_lr is where the cosine schedule ends; keep it at most lr")
    if len(c.errors) > before or view.unvalued or None in got.values():
        return None
    return TrainSpec(**got, pos=view.kind.pos, positions=positions(view))


def _check_combinations(train: TrainSpec, parallel: ParallelSpec | None, c: Checker) -> None:
    """train.compile and train.recompute against each other and the spec's own parallel
    section (spec.combos: the rule `restopo train` meets too, with its flags' layout)."""
    pipeline = parallel is not None and parallel.pipelined
    sharded = parallel is not None and parallel.sharded
    where = parallel.pos if parallel is not None else None
    why = compile_conflict(train.compile, train.recompute, sharded=sharded)
    if why is not None:
        c.error(blame(train.where("compile"), train.where("recompute") if not sharded
                      else where), *why)
    why = recompute_conflict(train.recompute, pipeline=pipeline)
    if why is not None:
        c.error(blame(train.where("recompute"), where), *why)


def _misplaced(fl: Field, key: str, section: str, c: Checker) -> bool:
    """True after saying that the value of a key of both train and parallel is the other
    section's kind of value (train { schedule: 1f1b }, parallel { data: "corpus.txt" })."""
    home = "parallel" if section == "train" else "train"
    what, belongs = SHARED[key, home]
    if not belongs(fl.value):
        return False
    said = c.src.written(fl.value.pos) or describe(fl.value)  # as typed: a --set's path bare
    if _from_set(fl):  # the other section's key
        moved = f"--set {home}.{key}={said}"
        if key == "data" and home == "parallel":  # fsdp alone is the engine; a file is ./fsdp
            moved += f"; a data file of that name: --set train.data=./{said}"
    else:
        moved = f"{home} {{ {key}: {said} }}"
    c.error(fl.value.pos, f"'{said}' is {what}, not {SHARED[key, section][0]}",
            f"it goes in the {home} section: {moved}")
    return True


def _from_set(fl: Field) -> bool:
    """True for a field given on the command line (a --set, or a flag standing for one)."""
    return from_command_line(fl.value.pos.source)


def _data(fl: Field, c: Checker) -> str | None:
    v = c.single(fl, "data")
    form = 'data is written builtin:NAME or as a quoted path, e.g. data: "corpus.txt"'
    if v is None:
        return None
    if isinstance(v, String):
        if not v.value.strip():
            c.error(v.pos, "the data path is empty", form)
            return None
        if "\0" in v.value:  # the system refuses such a path (Python: a ValueError)
            c.error(v.pos, "the data path holds a NUL character (U+0000)",
                    "remove it: no file's path holds one")
            return None
        return v.value
    if isinstance(v, Qualified):
        if v.prefix.text != "builtin":
            c.error(v.prefix.pos, f"unknown data kind '{v.prefix.text}:'",
                    "data is builtin:NAME or a quoted path" + dym_suffix(v.prefix.text, ("builtin",)))
            return None
        if v.name.text not in BUILTIN_DATA:
            c.error(v.name.pos, f"unknown builtin corpus '{v.name.text}'",
                    did_you_mean(v.name.text, BUILTIN_DATA))
            return None
        return f"builtin:{v.name.text}"
    if isinstance(v, Name) and v.text in BUILTIN_DATA:
        c.error(v.pos, f"unknown data '{v.text}'", f"did you mean 'builtin:{v.text}'?")
        return None
    c.error(v.pos, f"bad data '{describe(v)}'", form)
    return None


# -- the whole pass ---------------------------------------------------------------------
def check(file: SpecFile, text: str, overrides=()) -> Spec:
    """The checked Spec of a parsed file with its --set overrides, or SpecError(s)."""
    src = SourceText({file.path: text})
    c = Checker(src)
    c.homes = KEY_HOMES
    views = views_of(file, c)
    apply_overrides(views, tuple(overrides), c)
    model, residual, parallel, train, topology = _check_views(views, file, c)
    checks = {"model": check_model, "residual": check_residual, "parallel": check_parallel,
              "train": check_train}
    for kind, view in views.items():
        _check_repeated(view, checks[kind], c)
    if any(view.repeated for view in views.values()):
        _check_last_values(views, file, c)
    raise_all(_reported(sorted(c.errors, key=lambda e: _order(e, file.path))))
    return Spec(residual, model, train if train is not None else TrainSpec(), parallel, text,
                file.path, tuple(overrides), source=src, resolved=topology)


def _check_views(views: dict[str, View], file: SpecFile, c: Checker):
    """Each section checked into its spec object, then the sections against each other:
    (model, residual, parallel, train, topology), each None where refused."""
    model = c.model = check_model(views["model"], c) if "model" in views else None
    residual = None
    if "residual" in views:
        residual = check_residual(views["residual"], c)
    # (else said where it is: inside another section, or misspelt as an unknown one)
    elif "residual" not in c.nested and not any(
            s.kind.text not in SECTIONS and closest(s.kind.text, SECTIONS) == "residual"
            for s in file.sections):
        where = file.sections[0].pos if file.sections else Pos(file.path, 1, 1)
        c.error(where, "the spec has no residual section" if file.sections else "the spec is empty",
                "add a line such as 'residual block_attnres(blocks: 8)' or 'residual standard'")
    parallel = check_parallel(views["parallel"], c) if "parallel" in views else None
    train = check_train(views["train"], c) if "train" in views else TrainSpec()

    if model is not None and not check_model_limits(model, c):
        model = None  # too large to resolve against
    if train is not None:
        check_train_limits(train, model.context if model is not None else None, c)
        if parallel is not None:
            check_microbatches(parallel, train, c)
        _check_combinations(train, parallel, c)
    topology = None
    if model is not None and residual is not None:
        topology = check_against_model(model, residual, c)
    if topology is not None:
        from ..ir.build import source_reads  # networkx loads only for a spec with a model
        check_source_reads(model, source_reads(model.kinds, topology), c,
                           attends=topology.sublayer_rule.method != "sum")
    if model is not None and parallel is not None:
        L = model.sublayers
        if parallel.chunks > L:
            fv = views["parallel"].fields
            where = fv["virtual"] if "virtual" in fv and parallel.virtual > 1 else fv["stages"]
            c.error(blame(where.value.pos, model.where("depth")),
                    f"stages x virtual = {parallel.chunks} model chunks, but the "
                    f"model has only {L} sublayers", "each chunk needs at least one sublayer; "
                    "use fewer stages or virtual stages, or a deeper model")
    return model, residual, parallel, train, topology


def _check_repeated(view: View, check_section, c: Checker) -> None:
    """The mistakes in a key's later values (`width: 64; width: abc`), said beside its being
    given twice: else the second's showed only once the first was removed. The section is
    checked again with each in the first's place, keeping what is said inside that value."""
    for again in view.repeated:
        if again.key.text not in view.fields:  # the first was refused (an unknown key)
            continue
        scratch = Checker(c.src)
        scratch.homes = c.homes
        check_section(replace(view, fields={**view.fields, again.key.text: again}), scratch)
        c.errors += [e for e in scratch.errors if inside(e, again.value.pos)]


def _check_last_values(views: dict[str, View], file: SpecFile, c: Checker) -> None:
    """The mistakes of the spec as it reads with each repeated key's last value in place
    (`width: 64` then `width: 65` beside `heads: 4`): what these values make wrong with the
    others (heads must divide width), said beside the duplicate, not once it is removed.
    A key set by a --set keeps that value, as it would."""
    last, put = {}, {}
    for kind, view in views.items():
        fields = dict(view.fields)
        for again in view.repeated:
            now = fields.get(again.key.text)
            if now is not None and now.pos.source == again.pos.source:
                fields[again.key.text] = put[kind, again.key.text] = again
        last[kind] = replace(view, fields=fields)
    scratch = Checker(c.src)
    scratch.homes, scratch.nested = c.homes, c.nested
    _check_views(last, file, scratch)
    said = {(e.path, e.line, e.column, e.message) for e in c.errors}
    # an error elsewhere names the later values it was found with (the shown line may
    # hold the first: heads: 4 beside width: 64, found with the later width: 65)
    values = "; ".join(f"{fl.key.text}: {c.src.written(fl.value.pos) or describe(fl.value)} "
                       f"(line {fl.pos.line})" for fl in put.values())
    for e in scratch.errors:
        if (e.path, e.line, e.column, e.message) in said:
            continue
        if not any(inside(e, fl.value.pos) for fl in put.values()):
            e = SpecError(e.path, e.line, e.column, e.message, (e.hint + "; " if e.hint else "")
                          + f"this is with the later value of a key given twice: {values}",
                          e.source_line)
        c.errors.append(e)


MAX_REPORTED = 50  # errors shown at once: past that, fixing the first ones comes first


def _reported(errors: list[SpecError]) -> list[SpecError]:
    """The first MAX_REPORTED errors, and one more line saying how many were left out."""
    if len(errors) <= MAX_REPORTED:
        return errors
    rest, nxt = len(errors) - MAX_REPORTED, errors[MAX_REPORTED]
    return errors[:MAX_REPORTED] + [SpecError(
        nxt.path, nxt.line, nxt.column, f"... and {counted(rest, 'more error')} "
        f"from here on, not shown", "fix the errors above first", nxt.source_line)]


def _order(e: SpecError, path: str):
    """Errors in the file first, in source order, then those of each --set in turn, then
    those of the flags that stand for one."""
    if e.path == path:
        return (0, 0, e.line, e.column)
    n = e.path[len("<--set "):-1] if e.path.startswith("<--set ") else ""
    return (1, int(n) if n.isdigit() else 1 << 30, e.line, e.column)
