"""Checking the residual section: named one-liners (`block_attnres(blocks: 8)`) and custom
wiring (`before sublayer: attend(embedding, blocks, partial)`), then the parts that depend
on the model (the partition of its depth, depth heads that divide its width).

Multi-stream residuals are one-liners (`mhc(streams: 4, sinkhorn: 20)`) or a custom
`before sublayer:` rule of the same name (`mhc(streams: 4; sinkhorn: 20)`); such a rule
reads the streams, not sources, and its head always sums the streams, so the section takes
neither sources, `before head:` nor blocks.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import replace

from .. import topology as T
from .errors import SpecError, did_you_mean, inside
from ..words import alts
from .fields import SEP_HINT, Checker, Field, View, divisors, positions
from .nodes import (SECTIONS, Arg, Call, Key, ListValue, Name, Number, blame, describe,
                    from_command_line)
from .objects import DATA_ENGINES, SCHEDULES, ModelSpec, ResidualSpec
from .resolve import (ATTEND_OPTIONS, METHOD_OPTIONS, NAMED_OPTIONS, STREAM_OPTIONS,
                      resolve_residual)

CUSTOM_KEYS = ("blocks", "block_size", "before sublayer", "before head")


def check_residual(view: View, c: Checker) -> ResidualSpec | None:
    if view.head is not None:  # a named one-liner
        res = _named(view, c)
        return None if view.bad else res
    if not view.braces:
        return None  # the line form already reported its error
    label = view.label
    if label is not None and not any(k.startswith("before") for k in view.fields):
        hint = did_you_mean(label.text, NAMED_OPTIONS)
        if hint and hint.startswith("did"):
            c.error(label.pos, f"unknown topology '{label.text}'", hint)
            return None
    return _custom(view, c)


def _named(view: View, c: Checker) -> ResidualSpec | None:
    name = view.head
    if name.text not in NAMED_OPTIONS:
        if name.text == "custom":
            hint = "custom wiring is written with braces: residual custom { before sublayer: ... }"
        elif name.text in T.METHODS:
            hint = (f"'{name.text}' is an aggregation method; use it in custom wiring: "
                    f"residual custom {{ before sublayer: {name.text}(embedding, sublayers) }}")
        else:
            hint = did_you_mean(name.text, NAMED_OPTIONS)
        c.error(name.pos, f"unknown topology '{name.text}'", hint)
        return None
    allowed = NAMED_OPTIONS[name.text]
    before = len(c.errors)
    for k, f in list(view.fields.items()):
        if k in allowed:
            continue
        del view.fields[k]
        if k in ("before sublayer", "before head"):  # residual block_attnres { before ...: }
            wiring = f"residual my_wiring {{ {k}: ... }}"
            c.error(f.key.pos, f"'{k}:' is a rule of custom wiring, and {name.text} is a named "
                    "topology", f"the spec's residual is {name.text}; custom wiring is written "
                    f"in the spec file: {wiring}" if from_command_line(f.key.pos.source)
                    else f"label custom wiring with a name of its own: {wiring}")
            continue
        if not allowed:
            c.error(f.key.pos, f"'{name.text}' takes no options, got '{k}'",
                    _no_options_hint(name, k, f, c))
            continue
        owners = _owners(k, NAMED_OPTIONS)
        if owners:
            c.error(f.key.pos, f"option '{k}' does not apply to {name.text}",
                    f"'{k}' is an option of {owners}; {name.text} takes {alts(allowed)}")
        else:
            c.error(f.key.pos, f"unknown option '{k}' for {name.text}",
                    c.elsewhere(f, "residual") or did_you_mean(k, allowed))
    if name.text in T.MULTI_STREAM_METHODS:
        # a misspelled 'streams' (or one given without its key, view.bad) was just
        # reported: not as missing too
        opts = _stream_options(view.fields, name.text, name.pos, c,
                               quiet=len(c.errors) > before or view.bad)
        if opts is None or len(c.errors) > before:
            return None
        return ResidualSpec(name.text, "named", tuple(opts.items()), pos=name.pos,
                            positions=positions(view), source=c.src)
    method = "scalars" if name.text == "denseformer" else "attend"
    opts = _rule_options(view.fields, method, c)
    blocks, block_size = _blocks(view, c)
    window = None
    if "window" in view.fields:
        window = c.integer(view.fields["window"], "window", 1,
                           why="the window counts earlier sublayer outputs")
    if len(c.errors) > before or None in opts.values():
        return None
    if window is not None:
        opts["window"] = window
    return ResidualSpec(name.text, "named", tuple(opts.items()), blocks, block_size,
                        pos=name.pos, positions=positions(view), source=c.src)


def option_given_bare(call: str, options, value, taken) -> str | None:
    """The one of a call's `options` (a topology's, pipeline's), `taken` aside, that a value
    given without its key can be (`hyper_connections(3)`, `pipeline(1f1b)`): the option
    whose words hold it, or for a whole number, the option of numbers the call needs
    (streams, stages) or its only one; None when it fits none or several (`block_attnres(8)`:
    blocks, block_size or heads)."""
    yes_no = ("true", "false")
    words = {"query": T.QUERY_KINDS, "key_norm": T.KEY_NORMS, "dynamic": yes_no,
             "gate": T.gates_of("scalars" if call == "denseformer" else "attend"),
             "schedule": SCHEDULES, "data": DATA_ENGINES, "cache": yes_no}
    options = [o for o in options if o not in taken]
    word = value.text if isinstance(value, (Name, Number)) else None  # 1f1b lexes as a number
    fits = [o for o in options if word in words.get(o, ())]
    if not fits and isinstance(value, Number) and not value.unit:
        fits = [o for o in options if o not in words]
        fits = [o for o in fits if o in ("streams", "stages")] or fits
    return fits[0] if len(fits) == 1 else None


def without_options(topology: Name) -> str:
    """How a topology that takes no options is written where it was: `residual rezero` in a
    file, `--set residual=rezero` on the command line."""
    if from_command_line(topology.pos.source):
        return f"--set residual={topology.text}"
    return f"'residual {topology.text}'"


def _no_options_hint(topology: Name, key: str, f: Field, c: Checker) -> str:
    """For an option given to a topology that takes none: the topology bare, as written;
    on the command line also the topology that takes it (or, where that refuses the value
    too, why), and from --set residual.KEY=V, that it sets an option of the spec's
    topology."""
    if not from_command_line(f.key.pos.source):
        return f"write {without_options(topology)}"
    options = {o for opts in NAMED_OPTIONS.values() for o in opts}
    meant = key if key in options else next(iter(difflib.get_close_matches(key, options, 1)),
                                            None)
    owner = next((t for t, opts in NAMED_OPTIONS.items() if meant in opts), None)
    said = (f"write {without_options(topology)}" if from_command_line(topology.pos.source)
            else f"the spec's residual is {topology.text}, and --set residual.KEY sets an "
                 "option of that topology")
    if owner is None:
        return said
    option = Field(Key((meant,), f.key.pos), f.value, f.pos)
    refused = refusal(Name(owner, f.key.pos), {meant: option}, c)
    called = f"{owner}({meant}: {describe(f.value)})"
    return said + (f"; '{meant}' is an option of {owner}, but {called} is refused too: {refused}"
                   if refused else f"; to use {owner}: --set 'residual={called}'")


def refusal(topology: Name, fields: dict[str, Field], c: Checker,
            given: dict[str, Field] | None = None) -> str | None:
    """Why `topology` with the options `fields` is refused (checked as the residual of the
    spec's model), but for the values of the options `given` as typed (said anyway); None
    when it is taken: a hint suggests nothing that is refused."""
    scratch = Checker(c.src)
    residual = _named(View(Name("residual", topology.pos), head=topology, fields=dict(fields)),
                      scratch)
    if residual is not None and c.model is not None:
        check_against_model(c.model, residual, scratch)
    return next((e.message for e in scratch.errors if not any(
        inside(e, f.value.pos) for f in (given or {}).values())), None)


def _rule_options(fields: dict[str, Field], method: str, c: Checker) -> dict:
    """The checked values of the options of an attend or scalars rule (`fields` holds only
    options the method takes)."""
    out = {}
    if "gate" in fields and not _gate_fits(fields["gate"], method, c):
        out["gate"] = None
    for k, choices in (("query", T.QUERY_KINDS), ("gate", T.gates_of(method)),
                       ("key_norm", T.KEY_NORMS)):
        if k in fields and k not in out:
            out[k] = c.choice(fields[k], k, choices)
    if "heads" in fields:
        out["heads"] = c.integer(fields["heads"], "heads", 1,
                                 why="depth-attention heads; they must divide width")
    return out


def _stream_options(fields: dict[str, Field], method: str, pos, c: Checker,
                    quiet: bool = False) -> dict | None:
    """The checked streams, dynamic and sinkhorn of a multi-stream method (`fields` holds
    only options the method takes); None after an error (quiet: a missing 'streams' is
    not reported, because another error of the same call already was)."""
    if "streams" not in fields:
        if quiet:
            return None
        c.error(pos, f"{method} needs 'streams: n', the number of residual streams",
                f"e.g. {method}(streams: 4): n = 4 is the papers' choice" + (
                    "; 1 is a plain residual" if method == "hyper_connections" else
                    "; with 1 the sublayer's output keeps a learned gate (post = 2 sigmoid)"))
        return None
    f = fields["streams"]
    n = c.integer(f, "streams", 1, T.MAX_STREAMS,
                  why="the number of residual streams, each of width d (the papers use 1 to 8)")
    out = {"streams": n}
    if n is not None and method == "mhc_lite" and n > T.MAX_LITE_STREAMS:
        c.error(f.value.pos, f"mhc_lite mixes all n! permutation matrices: streams: {n} "
                f"would need {math.factorial(n):,} of them per sublayer",
                f"use streams: {T.MAX_LITE_STREAMS} or fewer, or mhc(streams: {n}), whose "
                "Sinkhorn projection grows as n^2")
        out["streams"] = None
    if "dynamic" in fields:
        out["dynamic"] = c.boolean(fields["dynamic"], "dynamic")
    if "sinkhorn" in fields:
        out["sinkhorn"] = c.integer(fields["sinkhorn"], "sinkhorn", 1, T.MAX_SINKHORN, why=(
            f"Sinkhorn-Knopp iterations per sublayer (mHC uses {T.DEFAULT_SINKHORN}); at most "
            f"{T.MAX_SINKHORN:,}: every forward runs them all, and the backward recomputes and "
            "keeps them"))
    return None if None in out.values() else out


def _gate_fits(fl: Field, method: str, c: Checker) -> bool:
    """A gate that exists but belongs to the other method gets its own message."""
    v = fl.value
    if not isinstance(v, Name) or v.text in T.gates_of(method):
        return True
    if method == "attend" and v.text in T.SCALAR_GATES:
        c.error(v.pos, "gate 'none' applies to scalars only: depth attention normalises its "
                "weights with softmax or sigmoid",
                "use gate: softmax or gate: sigmoid; unnormalised static weights per source "
                "are scalars(embedding, sublayers), as in residual denseformer")
        return False
    return True


def _blocks(view: View, c: Checker):
    f = view.fields
    # each value is read even when both are given: a mistake in either is one more to fix
    blocks = c.integer(f["blocks"], "blocks", 1, why="the number of blocks") \
        if "blocks" in f else None
    block_size = c.integer(f["block_size"], "block_size", 1,
                           why="block_size counts sublayers (2 per transformer layer)") \
        if "block_size" in f else None
    if "blocks" in f and "block_size" in f:
        second = max(f["blocks"], f["block_size"],
                     key=lambda x: (from_command_line(x.key.pos.source), x.key.pos.source,
                                    x.key.pos.line, x.key.pos.column))
        c.error(second.key.pos, "give either 'blocks' or 'block_size', not both",
                "blocks: N cuts the model into N blocks; block_size: S makes blocks of S sublayers")
        return None, None
    return blocks, block_size


def _custom(view: View, c: Checker) -> ResidualSpec | None:
    before = len(c.errors)
    if view.label is not None and view.label.text in SECTIONS:
        # `residual` alone on its line: the next section's name and braces were read as a
        # custom wiring's label and rules
        c.error(view.kind.pos, f"'residual' needs a topology; here the {view.label.text} "
                "section that follows was read as one", "write e.g. 'residual standard', "
                "'residual block_attnres(blocks: 8)' or 'residual custom { before sublayer: "
                "... }'")
        return None
    # a misspelt rule ('befor sublayer:') is said as unknown; that the rule is then missing
    # is its knock-on, not a second mistake
    misspelt = any(k not in CUSTOM_KEYS and difflib.get_close_matches(  # (before_sublayer)
        fld.key.words[-1].split("_")[-1], ["sublayer"], cutoff=0.75)
        for k, fld in view.fields.items())
    for k in [k for k in view.fields if k not in CUSTOM_KEYS]:
        if hint := _rule_part_hint(k, view.fields[k], c):  # `window: 4` beside the rules
            c.error(view.fields.pop(k).key.pos, f"'{k}' is not a key of custom wiring", hint)
    c.unknown_keys(view, CUSTOM_KEYS, "custom wiring")
    f = view.fields
    blocks, block_size = _blocks(view, c)
    if "before sublayer" not in f:
        if misspelt:
            return None
        c.error((view.label or view.kind).pos, "custom wiring needs a 'before sublayer:' rule",
                "e.g. before sublayer: attend(embedding, blocks, partial)")
        return None
    sub = _rule(f["before sublayer"], "sublayer", c)
    head = _rule(f["before head"], "head", c) if "before head" in f else None
    if len(c.errors) > before or sub is None:
        return None
    if sub.multi_stream or (head is not None and head.multi_stream):
        return _custom_streams(view, sub, head, c)
    if head is None:  # the head reads what the sublayers read; no partial is open there
        head = replace(sub, sources=tuple(s for s in sub.sources if s.name != "partial"))
    if _blocks_unread(view, blocks, sub, head, c):
        return None
    name = view.label.text if view.label else "custom"
    return ResidualSpec(name, "custom", (), blocks, block_size, sub, head,
                        pos=(view.label or view.kind).pos,
                        positions=positions(view) + _heads_positions(view), source=c.src)


def _blocks_unread(view: View, blocks: int | None, sub: T.Rule, head: T.Rule,
                   c: Checker) -> bool:
    """Blocks that no rule reads ('blocks' or 'partial') change nothing but would make their
    sums for no reader (a standard residual, a stream update, depth attention over every
    output); True after the error. `blocks: 1`, no blocks, is the one-stream default."""
    given = next((view.fields[k] for k in ("blocks", "block_size") if k in view.fields), None)
    read = any(s.name in ("blocks", "partial") for rule in (sub, head) for s in rule.sources)
    if given is None or blocks == 1 or read:
        return False
    k = given.key.text
    c.error(given.key.pos, f"'{k}' has no effect here: no rule reads 'blocks' or 'partial'",
            f"remove '{k}'" + (f": {sub.method} updates one running stream, which reads "
                               "every output" if sub.method in T.STREAM_METHODS else
                               ", or read the blocks, e.g. before sublayer: "
                               "attend(embedding, blocks, partial)"))
    return True


def _heads_positions(view: View) -> tuple:
    """Where each rule's `heads` value is ('before sublayer heads'), for the check against
    the model's width to point at it rather than at the rule."""
    return tuple((f"{k} heads", a.value.pos) for k in ("before sublayer", "before head")
                 if k in view.fields and isinstance(view.fields[k].value, Call)
                 for a in view.fields[k].value.args if a.key is not None
                 and a.key.text == "heads")


def _custom_streams(view: View, sub: T.Rule, head: T.Rule | None,
                    c: Checker) -> ResidualSpec | None:
    """A custom section whose rule is multi-stream: the head sums the streams and there are
    no blocks, so neither may be given."""
    f = view.fields
    if not sub.multi_stream:
        c.error(f["before head"].key.pos, f"the head cannot read {head.method} streams "
                f"unless every sublayer does", f"write 'before sublayer: {head.method}(...)' "
                "and leave out 'before head:'")
        return None
    if head is not None:
        c.error(f["before head"].key.pos, f"with {sub.method} the head sums the streams; it "
                "takes no rule of its own", "remove 'before head:'")
        return None
    for k in ("blocks", "block_size"):
        if k in f:
            c.error(f[k].key.pos, f"'{k}' does not apply to {sub.method}: n streams replace "
                    "the blocks", f"remove '{k}'")
            return None
    name = view.label.text if view.label else "custom"
    return ResidualSpec(name, "custom", (), None, None, sub, sub,
                        pos=(view.label or view.kind).pos, positions=positions(view),
                        source=c.src)


def _rule(fl: Field, target: str, c: Checker) -> T.Rule | None:
    v = fl.value
    if isinstance(v, ListValue):
        c.error(v.items[1].pos, f"a rule is one call, got {len(v.items)} values",
                "e.g. attend(embedding, blocks, partial); " + SEP_HINT)
        return None
    name = v.name if isinstance(v, Call) else v
    if not isinstance(name, Name):
        c.error(v.pos, f"expected an aggregation such as attend(...), got '{describe(v)}'",
                f"methods: {', '.join(T.METHODS)}")
        return None
    if name.text not in T.METHODS:
        if name.text in NAMED_OPTIONS:
            hint = (f"'{name.text}' is a named topology: write 'residual {name.text}' instead "
                    f"of custom wiring, or use a method: {', '.join(T.METHODS)}")
        else:
            hint = did_you_mean(name.text, T.METHODS)
        c.error(name.pos, f"unknown aggregation method '{name.text}'", hint)
        return None
    method = name.text
    args = v.args if isinstance(v, Call) else ()
    before = len(c.errors)
    sources, seen, bad = [], {}, set()
    for a in args:
        # a multi-stream method reads the streams: its values without a key are said below
        if a.key is None and method not in T.MULTI_STREAM_METHODS:
            s = _source(a, target, c, v)
            if s is None:
                bad.add(id(a))  # said: not again as a source a stream method cannot read
                continue
            if str(s) in seen:
                c.error(a.pos, f"source '{s}' is listed twice", "list each source once")
                continue
            if s.name == "window" and "window" in seen:
                first = next(x for x in sources if x.name == "window")
                c.error(a.pos, f"a rule reads one window, got '{first}' and '{s}'",
                        "keep one: the larger reads every output the smaller does")
                continue
            # a window's outputs are among 'sublayers': read together, it would add nothing
            inside = {"window": "sublayers", "sublayers": "window"}.get(s.name)
            if inside in seen:
                window = s if s.name == "window" else next(x for x in sources
                                                            if x.name == "window")
                c.error(a.pos, f"'{window}' reads outputs 'sublayers' already reads (every "
                        "earlier one): together they are just 'sublayers'",
                        "keep one: 'sublayers' for every earlier output, or the window for "
                        "the last few")
                continue
            seen[str(s)] = seen[s.name] = a
            sources.append(s)
    options = {}
    named = {a.key.text: Field(a.key, a.value, a.pos) for a in args if a.key is not None}
    takes = METHOD_OPTIONS.get(method, ())
    for k, fa in named.items():
        if k in takes:
            continue
        owners = _owners(k, STREAM_OPTIONS)
        if owners and k not in ATTEND_OPTIONS:
            c.error(fa.key.pos, f"option '{k}' does not apply to {method}",
                    f"'{k}' is an option of {owners}" + (f"; {method} takes {alts(takes)}"
                                                         if takes else ""))
        elif k == "window":  # a named topology's option: here a source
            c.error(fa.key.pos, f"'window' is not an option of {method}",
                    f"a window is a source: {method}(embedding, "
                    f"window({c.src.written(fa.value.pos) or describe(fa.value)}))")
        elif k not in ATTEND_OPTIONS:
            c.error(fa.key.pos, f"unknown option '{k}' for {method}",
                    did_you_mean(k, takes) if takes else f"{method} takes no options")
        else:
            c.error(fa.key.pos, f"option '{k}' does not apply to {method}",
                    _wrong_option_hint(method))
    if len([a for a in args if a.key is not None]) != len(named):
        dup = [a for a in args if a.key is not None]
        keys = [a.key.text for a in dup]
        second = next(a for i, a in enumerate(dup) if a.key.text in keys[:i])
        c.error(second.key.pos, f"option '{second.key.text}' is given twice", "keep one")
    if method in T.MULTI_STREAM_METHODS:
        if any(a.key is None for a in args):
            first = next(a for a in args if a.key is None)
            given = {k: describe(fa.value) for k, fa in named.items()}
            for a in args:  # mhc(4): a value that can only be one option, with its key
                option = a.key is None and option_given_bare(method, takes, a.value, given)
                if option:
                    given[option] = describe(a.value)
            options = ", ".join(f"{k}: {x}" for k, x in given.items()) or "streams: 4"
            c.error(first.pos, f"{method} reads the n residual streams, not sources",
                    f"write {method}({options})")
            return None
        got = _stream_options({k: v for k, v in named.items() if k in takes}, method, v.pos, c,
                              quiet=len(c.errors) > before)
        if got is None or len(c.errors) > before:
            return None
        return T.Rule(method, (), **got)
    if takes:
        options = _rule_options({k: v for k, v in named.items() if k in takes}, method, c)
    if method in T.STREAM_METHODS:
        wrong = [a for a in args if a.key is None and id(a) not in bad
                 and str(_quiet_source(a)) not in ("embedding", "sublayers")]
        given = [str(_quiet_source(a)) for a in args if a.key is None]
        left_out = [s for s in ("embedding", "sublayers") if s not in given and not bad]
        if wrong or (given and left_out):  # its sources are all or nothing, never a part
            c.error(wrong[0].pos if wrong else v.pos,
                    f"{method} updates one running stream and always reads the embedding and "
                    "every earlier sublayer" + ("" if wrong else
                                                f"; it cannot leave out {left_out[0]}"),
                    f"write {method}() or {method}(embedding, sublayers)")
            return None
        if not sources:
            sources = list(T.STANDARD_SOURCES)
    if len(c.errors) > before or None in options.values():
        return None
    pos = v.pos
    if not sources:
        c.error(pos, f"this {method} reads no source",
                f"list its sources, e.g. {method}(embedding, "
                f"{'blocks, partial' if target == 'sublayer' else 'blocks'})")
        return None
    if target == "sublayer" and "embedding" not in seen and method not in T.STREAM_METHODS:
        listed = [f"'{s}'" for s in sources]
        c.error(pos, "the first sublayer would read no source: "
                f"{' and '.join(listed) if len(listed) < 3 else ', '.join(listed)} "
                f"{'is' if len(listed) == 1 else 'are'} empty before it",
                f"add 'embedding', e.g. {method}(embedding, ...)")
        return None
    return T.Rule(method, tuple(sources), **options)


def _wrong_option_hint(method: str) -> str:
    """For an option of attend given to another method."""
    if method == "scalars":
        return (f"scalars takes only gate ({alts(T.SCALAR_GATES)}); "
                "query, key_norm and heads are options of attend")
    takes = METHOD_OPTIONS.get(method, ())
    return (f"{method} takes " + (alts(takes) if takes else "no options")
            + f" (attend takes {alts(ATTEND_OPTIONS)}; scalars takes gate)")


def _rule_part_hint(key: str, fld: Field, c: Checker) -> str | None:
    """Where an option of a named topology goes in custom wiring, as a part of its rule:
    a window is a source, the others options of the rule's method after ';'. None for
    any other key."""
    value = c.src.written(fld.value.pos) or describe(fld.value)
    if key == "window":
        return f"a window is a source of a rule: before sublayer: attend(embedding, " \
               f"window({value}))"
    if key in ATTEND_OPTIONS:
        return f"it is an option of a rule's method, after ';': before sublayer: " \
               f"attend(embedding, blocks, partial; {key}: {value})"
    for method, keys in STREAM_OPTIONS.items():
        if key in keys:
            streams = "" if key == "streams" else "streams: 4; "
            return f"it is an option of a rule's method: before sublayer: " \
                   f"{method}({streams}{key}: {value})"
    return None


def _owners(option: str, table: dict) -> str:
    """Every method or topology of `table` that takes `option`, as a phrase ('' if none):
    naming the first alone sent a person to hyper_connections for mhc's streams."""
    owners = [name for name, opts in table.items() if option in opts]
    return alts(owners) if owners else ""


def _quiet_source(a: Arg):
    v = a.value
    return v.text if isinstance(v, Name) else None


def _source(a: Arg, target: str, c: Checker, rule: Call) -> T.Source | None:
    v = a.value
    names = [n for n in T.SOURCE_NAMES]
    if isinstance(v, Name):
        if v.text == "window":
            c.error(v.pos, "window needs a size", "e.g. window(8): the last 8 sublayer outputs")
            return None
        if v.text not in names:
            c.error(v.pos, f"unknown source '{v.text}'", did_you_mean(v.text, names))
            return None
        if v.text == "partial" and target == "head":
            c.error(v.pos, "'partial' cannot be read before the head: every block is complete "
                    "there", "read 'blocks' (all blocks) at the head")
            return None
        return T.Source(v.text)
    if isinstance(v, Call) and v.name.text == "window":
        if len(v.args) != 1 or v.args[0].key is not None:
            c.error(v.pos, "window takes one size", "e.g. window(8)")
            return None
        w = c.integer(Field(Key(("window",), v.pos), v.args[0].value, v.pos), "window", 1,
                      why="the window counts earlier sublayer outputs")
        return None if w is None else T.Source("window", w)
    if isinstance(v, Call) and v.name.text in T.METHODS:
        c.error(v.name.pos, f"sources do not nest: '{v.name.text}(...)' is an aggregation "
                "method, and a rule is one method over a list of sources", _flat_hint(rule, v))
        return None
    if isinstance(v, Call):
        c.error(v.name.pos, f"unknown source '{v.name.text}(...)'",
                did_you_mean(v.name.text, names))
        return None
    if isinstance(v, ListValue):  # `attend(embedding sublayers)`
        listed = ", ".join(describe(x) for x in v.items)
        c.error(v.items[1].pos, f"sources are separated by ',', got '{describe(v)}'",
                f"write {c.src.rewrite(rule.pos, v.pos, listed) or f'{rule.name.text}({listed})'}")
        return None
    c.error(v.pos, f"expected a source, got '{describe(v)}'",
            f"sources: {', '.join(names)}")
    return None


def _flat_hint(rule: Call, inner: Call) -> str:
    """How to write a rule with a method nested among its sources: its sources listed flat,
    and a sum of consecutive outputs as the block it is."""
    def text(v):
        return (f"{v.name.text}({', '.join(describe(a.value) for a in v.args)})"
                if isinstance(v, Call) and v.args else describe(v))
    flat = []
    for a in rule.args:
        nested = isinstance(a.value, Call) and a.value.name.text in T.METHODS
        for b in (a.value.args if nested else (a,)):
            if b.key is None and text(b.value) not in flat:
                flat.append(text(b.value))
    if "sublayers" in flat:  # a window beside them is refused
        flat = [s for s in flat if not s.startswith("window(")]
    out = f"list the sources in {rule.name.text}(...) itself, e.g. {rule.name.text}" \
          f"({', '.join(flat)})"
    if inner.name.text != "sum" or rule.name.text in T.STREAM_METHODS:
        return out  # (a stream method reads no blocks)
    return (out + "; to read the sum of consecutive outputs, make them a block (blocks: N "
            "or block_size: S) and read 'blocks' and 'partial', as block_attnres does")


def check_against_model(model: ModelSpec, residual: ResidualSpec,
                        c: Checker) -> T.Topology | None:
    """What only the model decides: depth heads must divide its width, and the blocks must
    partition its sublayers (`blocks: N` allowed for this depth, block_size whole layers).
    Returns the residual resolved over the model's sublayers (None after an error)."""
    heads = []
    if residual.form == "named" and residual.option("heads"):
        heads.append((residual.option("heads"), residual.where("heads")))
    for key, rule in (("before sublayer", residual.sublayer_rule),
                      ("before head", residual.head_rule)):
        if rule is not None and rule.heads > 1 and rule.heads not in [h for h, _ in heads]:
            heads.append((rule.heads, dict(residual.positions).get(f"{key} heads")
                          or residual.where(key)))
    for h, pos in heads:
        if model.width % h:
            c.error(blame(pos, model.where("width")),
                    f"depth-attention heads ({h}) must divide width ({model.width})",
                    f"heads that divide {model.width}: "
                    + ", ".join(str(d) for d in divisors(model.width) if d <= 64))
    # The partition depends on the depth; the rules' sources were checked statically (the
    # sublayer rule reads the embedding, the head no partial), so every aggregation the IR
    # will hold reads at least one value and building it here would only cost time.
    try:
        topology = resolve_residual(residual, model.kinds)
    except SpecError as e:
        c.errors.append(e)
        return None
    if residual.form == "custom" and _check_all_read(residual, topology, c):
        return None
    return topology


def _check_all_read(residual: ResidualSpec, topology: T.Topology, c: Checker) -> bool:
    """Custom wiring whose sublayers reach nothing the head reads (a model that trains as an
    embedding and a head, those weights never); True after the error."""
    dead = T.unread_sublayers(topology)
    if not dead:
        return False
    L = sum(len(b) for b in topology.blocks)
    runs = _runs(dead)
    what = (f"no sublayer's output reaches the head (none of the {L}): their weights would "
            "never train" if len(dead) == L else
            "sublayer" + ("s " if len(dead) > 1 else " ") + ", ".join(runs) + f" ({len(dead)} "
            f"of {L}) reach nothing the head reads: their weights would never train")
    own = "before head" in dict(residual.positions or ())
    c.error(residual.where("before head" if own else "before sublayer"), what,
            ("" if own else "without 'before head:' the head reads what 'before sublayer:' "
             "reads, less partial; ") + "let the head read them (e.g. before head: "
            "attend(embedding, blocks) or attend(embedding, sublayers)), or the sublayers "
            "each other (sublayers, window, blocks, partial)")
    return True


def _runs(ids: list[int]) -> list[str]:
    """[1, 2, 3, 5] -> ['1..3', '5']."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}..{a}")
            start = b
    return out
