"""A file's sections gathered into views (entries by key), and the one-line heads
`residual NAME(options)` and `parallel pipeline(...)`.

Shared by the checking pass (check.py) and the --set overrides (overrides.py), which read
a one-line section given on the command line exactly like one written in the file.
"""
from __future__ import annotations

from .keys import KEY_HOMES, PARALLEL_KEYS
from .fields import EXAMPLES, MAIN_HOME, Checker, Field, View, dym_suffix, home_hint
from .nodes import (SECTIONS, Arg, Call, Entry, Key, ListValue, Name, Number, Qualified,
                    Section, SpecFile, String, describe, from_command_line)
from .objects import DATA_ENGINES, LR_SCHEDULES, SCHEDULES
from .wiring import NAMED_OPTIONS, option_given_bare, refusal, without_options

PARALLEL_KINDS = ("pipeline",)
BUILTIN_DATA = ("stdlib",)  # the corpora `data: builtin:NAME` names

# keys of both train and parallel: what each section's value is, and whether `v` is one
SHARED = {("schedule", "train"): ("a learning-rate schedule",
                                  lambda v: _word(v) in LR_SCHEDULES),
          ("schedule", "parallel"): ("a pipeline schedule", lambda v: _word(v) in SCHEDULES),
          # (a quoted engine name in parallel is the engine, quoted: said as such)
          ("data", "train"): ("training data", lambda v: isinstance(v, Qualified) or (
              isinstance(v, String) and v.value.strip() not in DATA_ENGINES)),
          ("data", "parallel"): ("a data-parallel engine", lambda v: _word(v) in DATA_ENGINES)}


def _word(v) -> str | None:
    return v.text if isinstance(v, (Name, Number)) else None


def unknown_section_hint(kind: str, value: str = "...") -> str:
    """What to write for a section of a kind that is none (parse.py says it too, for a word
    that ends the file where a section would start); `value`: what followed it."""
    if kind in NAMED_OPTIONS:  # `residual standard rezero`: a second topology
        return f"'{kind}' is a topology: write 'residual {kind}' (a spec has one residual " \
               "section)"
    if kind in KEY_HOMES:  # `lr 3`: a key, outside any section
        return home_hint(kind, value, KEY_HOMES[kind])
    return "sections are model, residual, parallel and train" + dym_suffix(kind, SECTIONS)


def views_of(file: SpecFile, c: Checker) -> dict[str, View]:
    """Each section's entries by key (unknown and duplicate sections and keys reported)."""
    views: dict[str, View] = {}
    for s in _one_label(file.sections, c):
        kind = s.kind.text
        if kind not in SECTIONS:
            value = s.line  # `lr 3`: what follows the word
            said = (c.src.written(value.pos) or describe(value)) if value is not None else "..."
            c.error(s.kind.pos, f"unknown section '{kind}'", unknown_section_hint(kind, said))
            continue
        if kind in views:
            first = views[kind].kind.pos
            c.error(s.kind.pos, f"duplicate section '{kind}' (first given at line {first.line})",
                    "each section may appear once; merge them or remove one")
            continue
        if s.label is not None and kind in ("parallel", "train"):
            c.error(s.label.pos, f"the {kind} section takes no name, got '{s.label.text}'",
                    f"write '{kind} {{ ... }}'")
        view = View(s.kind, s.label, pos=s.pos, braces=s.body is not None)
        if s.body is not None:
            body = [e for e in (_cut_nested(e, kind, c) for e in s.body) if e is not None]
            body = [e for e in (_keyless(e, view, c) for e in body) if e is not None]
            bare = [e for e in body if e.key is None]
            head = bare[0] if kind == "parallel" and bare else None  # pipeline(...)
            for e in body:  # in source order: a key given twice is said where it is again
                if e is head:
                    parallel_head(view, e.value, c)
                else:
                    c.gather(view, [e])
            bare = [e for e in bare if e is not head]
            for e in bare:
                c.error(e.pos, f"expected 'key: value' in {kind}, got '{describe(e.value)}'",
                        _bare_hint(kind, e.value))
            if kind == "residual" and s.label is not None and s.label.text in NAMED_OPTIONS:
                view.head = s.label
        else:
            if kind in ("model", "train"):
                c.error(s.line.pos, f"the {kind} section needs braces: {kind} {{ key: value ... }}",
                        f"e.g. {kind} {{ {'width: 64' if kind == 'model' else 'steps: 300'} }}")
                continue
            if kind == "parallel":
                parallel_head(view, s.line, c)
            else:
                line_head(view, s.line, c)
        views[kind] = view
    return views


def _one_label(sections, c: Checker):
    """The sections, one labelled with two words (`model tiny gpt { ... }`) taken as one,
    said once: the grammar reads it as `model tiny` and a section named `gpt`, which
    would be said as a model without braces and an unknown section."""
    i = 0
    while i < len(sections):
        s, t = sections[i], sections[i + 1] if i + 1 < len(sections) else None
        i += 1
        if not (s.kind.text in SECTIONS and isinstance(s.line, Name) and t is not None
                and t.body is not None and t.label is None and t.kind.text not in SECTIONS
                and t.kind.pos.line == s.line.pos.line):
            yield s
            continue
        i += 1
        kind, words = s.kind.text, f"{s.line.text} {t.kind.text}"
        if kind in ("parallel", "train"):
            c.error(s.line.pos, f"the {kind} section takes no name, got '{words}'",
                    f"write '{kind} {{ ... }}'")
        else:
            c.error(t.kind.pos, f"a section's label is one name, got '{words}'",
                    f"join the words: '{kind} {words.replace(' ', '_')} {{ ... }}'")
        label = s.line if kind in ("model", "residual") else None
        yield Section(s.kind, label, t.body, None, s.pos)


def _cut_nested(e: Entry, kind: str, c: Checker) -> Entry | None:
    """The entry up to a section written inside this one's braces (`context: 64` then
    `residual standard` before the '}'), which is reported once, as such, and recorded in
    c.nested: not again as extra values of the entry, nor as a section missing."""
    items = e.value.items if isinstance(e.value, ListValue) else (e.value,)
    first = 1 if e.key is not None else 0  # `data: train` names a value, not a section
    at = next((i for i, v in enumerate(items) if i >= first and isinstance(v, Name)
               and v.text in SECTIONS), None)
    if at is None:
        return e
    name = items[at]
    c.nested.add(name.text)
    c.error(name.pos, f"the {name.text} section is inside the {kind} section's braces",
            f"close the {kind} section with '}}' before '{name.text}': sections do not nest")
    kept = items[:at]
    if not kept:
        return None
    return Entry(e.key, kept[0] if len(kept) == 1 else ListValue(kept, e.value.pos), e.pos)


def _homes(key: str, c: Checker) -> tuple[str, ...]:
    """The sections `key` is a key of (none for a word that is no key)."""
    if key in c.homes:
        return (c.homes[key],)
    return tuple(sec for k, sec in SHARED if k == key) or (
        (MAIN_HOME[key],) if key in MAIN_HOME else ())


def _keyless(e: Entry, view: View, c: Checker) -> Entry | None:
    """An entry whose words plainly hold a key without its ':' (`vocab: 256 width 64`,
    `width 64`: the latter read as `width: 64` after saying so), a key alone (`lr`), or
    another section's head (`block_attnres(blocks: 2)` in model, `pipeline(...)` in train),
    said as such; keys given no clear value are kept in view.unvalued, not said missing
    too. Anything else is returned as it is, for views_of to say; None once said."""
    kind = view.kind.text
    items = e.value.items if isinstance(e.value, ListValue) else (e.value,)
    # `vocab: 256 width 64`: a key's name followed by a value that a key's name does not take
    keys = [v for v, after in zip(items[1:], items[2:]) if isinstance(v, Name)
            and _homes(v.text, c) and not isinstance(after, Name)]
    if e.key is None and isinstance(items[0], Name) and _homes(items[0].text, c):
        keys = [items[0], *keys] if keys else keys  # `steps 3 lr 1e-3`
    if keys:  # said once, with the entries written out; none said missing
        words, starts = [], {id(k) for k in keys}
        for v in items:
            said = c.src.written(v.pos) or describe(v)
            words.append(f"; {said}:" if id(v) in starts else f" {said}")
        line = (f"{e.key.text}:" if e.key is not None else "") + "".join(words)
        c.error(keys[0].pos, f"a ':' is missing after '{keys[0].text}'",
                f"write '{line.lstrip('; ')}'")
        view.unvalued.update([v.text for v in keys] + ([e.key.text] if e.key else []))
        return None
    if e.key is not None:
        return e
    first = items[0]
    homes = _homes(first.text, c) if isinstance(first, Name) else ()
    if homes and len(items) > 1:  # `width 64`
        rest = items[1:]
        written = " ".join(c.src.written(v.pos) or describe(v) for v in rest)
        c.error(first.pos, f"a ':' is missing after '{first.text}'",
                f"write '{first.text}: {written}'")
        value = rest[0] if len(rest) == 1 else ListValue(tuple(rest), rest[0].pos)
        return Entry(Key((first.text,), first.pos), value, e.pos)
    if homes:  # `lr` alone
        value = EXAMPLES.get(first.text, "").partition(": ")[2] or "..."
        view.unvalued.add(first.text)
        c.error(first.pos, f"'{first.text}' is given no value",
                f"write it as 'key: value', e.g. '{first.text}: {value}'" if kind in homes
                else home_hint(first.text, value, homes[0]))
        return None
    name = first.name if isinstance(first, Call) else first
    word = name.text if isinstance(name, Name) else None
    home = "residual" if word in NAMED_OPTIONS else "parallel" if word in PARALLEL_KINDS \
        else None
    if len(items) == 1 and home not in (None, kind):
        c.nested.add(home)  # said here: not as a section missing too
        said = c.src.written(first.pos) or describe(first)
        c.error(first.pos, f"'{said}' is written in the {kind} section",
                f"it goes in the {home} section: "
                + (f"residual {said}" if home == "residual" else f"parallel {{ {said} }}"))
        return None
    return e


def _bare_hint(kind: str, value) -> str:
    if isinstance(value, Qualified):  # `builtin:stdlib` alone: the data, without its key
        data = f"data: {describe(value)}"
        return f"write '{data}'" if kind == "train" else f"it is train data: train {{ {data} }}"
    return {"model": "e.g. 'width: 64'", "train": "e.g. 'steps: 300'",
            "residual": "custom wiring is written 'before sublayer: attend(embedding, blocks, "
                        "partial)'; a named topology is 'residual block_attnres(blocks: 8)'",
            "parallel": "write one 'pipeline(stages: 2, ...)' or 'stages: 2'"}[kind]


def line_head(view: View, atom, c: Checker) -> None:
    """`residual NAME` or `residual NAME(key: value, ...)`."""
    if isinstance(atom, Name):
        view.head = atom
    elif isinstance(atom, Call):
        view.head = atom.name
        _call_options(view, atom, c)
    else:
        c.error(atom.pos, f"expected a topology name after 'residual', got '{describe(atom)}'",
                "e.g. 'residual standard' or 'residual block_attnres(blocks: 8)'")
        view.head = None
        view.fields = {}
        view.braces = False


def _call_options(view: View, call: Call, c: Checker) -> None:
    # each value given without its key that can only be one option, named in the words typed
    taken, named, bare = {a.key.text for a in call.args if a.key is not None}, [], {}
    name = call.name.text
    options = PARALLEL_KEYS if name == "pipeline" else NAMED_OPTIONS.get(name, ())
    for a in call.args:
        option = a.key is None and option_given_bare(name, options, a.value, taken)
        if option:
            taken.add(option)
            written = c.src.written(a.value.pos) or describe(a.value)
            named.append((a.value.pos, f"{option}: {written}"))
            bare[option] = Field(Key((option,), a.value.pos), a.value, a.pos)
    # `block_attnres(blocks 2)`, `mhc(streams 4 sinkhorn 3)`, `mhc(streams: 4 sinkhorn 3)`:
    # options' ':' left out (their values are checked once they are in), each after the first
    # with the ',' before it too; one error each argument, the call written out in full
    colonless = {id(a): _colonless(a, options) for a in call.args}
    parts = [part for a in call.args for k, before in colonless[id(a)]
             for part in (((before.pos, (c.src.written(before.pos) or describe(before)) + ","),)
                          if before is not None else ()) + ((k.pos, f"{k.text}:"),)]
    # the keyed arguments, each up to an option written in its words (`streams: 4 sinkhorn 3`)
    args = [a if not colonless[id(a)] else Arg(a.key, _words(a.value.items, None,
                                                             colonless[id(a)]), a.pos)
            for a in call.args if a.key is not None]
    given = {a.key.text: Field(a.key, a.value, a.pos) for a in args}
    split = {k.text: Field(Key((k.text,), k.pos), _words(a.value.items, k, colonless[id(a)]),
                           a.pos) for a in call.args for k, _ in colonless[id(a)]}
    rewritten = named and _checked(c.src.rewrite(call.pos, *named[0], *named[1:]),
                                   call.name, {**given, **bare}, given, c)
    fixed = parts and _checked(c.src.rewrite(call.pos, *parts[0], *parts[1:]), call.name,
                               {**given, **split}, given, c)
    for a in call.args:
        if colonless[id(a)]:
            key = colonless[id(a)][0][0]
            c.error(key.pos, f"a ':' is missing after '{key.text}'",
                    fixed or f"write '{key.text}: ...'")
            view.bad = True
        elif a.key is None:
            view.bad = True
            fits = any(pos == a.value.pos for pos, _ in named)
            if NAMED_OPTIONS.get(name) == ():  # rezero(2)
                c.error(a.pos, f"'{name}' takes no options, got '{describe(a.value)}'",
                        f"write {without_options(call.name)}")
                continue
            c.error(a.pos, f"'{name}' takes named options, got '{describe(a.value)}'",
                    rewritten if fits and rewritten else _options_example(name))
    c.gather(view, [Entry(a.key, a.value, a.pos) for a in args])


def _checked(call: str | None, topology: Name, fields, given, c: Checker) -> str | None:
    """The hint writing a topology's `call` with its options `fields`, or, where the checker
    refuses it past the options `given` as typed (said anyway), why."""
    if call is None:
        return None
    why = refusal(topology, fields, c, given) if topology.text in NAMED_OPTIONS else None
    return f"{call} would still be refused: {why}" if why else f"write {call}"


def _words(items, key, colonless):
    """The words of an argument from option `key` (from the start when None) up to the next
    option written in them, as one value."""
    starts = [items.index(k) for k, _ in colonless] + [len(items)]
    start = 0 if key is None else items.index(key) + 1
    part = items[start:min(i for i in starts if i > start - (key is None))]
    return part[0] if len(part) == 1 else ListValue(part, part[0].pos)


def _colonless(a: Arg, options) -> list[tuple[Name, object]]:
    """The options written without their ':' in one argument's words, each with the word
    before it (None for the first word of an argument without a key); each has a value."""
    if not isinstance(a.value, ListValue):
        return []
    found, items = [], a.value.items
    for i, v in enumerate(items[:-1]):
        if isinstance(v, Name) and v.text in options and (i or a.key is None) and (
                not found or items.index(found[-1][0]) < i - 1):
            found.append((v, items[i - 1] if i else None))
    return found


def _options_example(name: str) -> str:
    return {"block_attnres": "e.g. block_attnres(blocks: 8) or block_attnres(block_size: 4)",
            "full_attnres": "e.g. full_attnres(query: input_dependent) or full_attnres(window: 8)",
            "denseformer": "e.g. denseformer(gate: softmax)",
            "hyper_connections": "e.g. hyper_connections(streams: 4)",
            "mhc": "e.g. mhc(streams: 4, sinkhorn: 20)", "mhc_lite": "e.g. mhc_lite(streams: 4)",
            "pipeline": "e.g. pipeline(stages: 2, microbatches: 4)"}.get(
                name, "write options as 'key: value'")


def parallel_head(view: View, value, c: Checker) -> None:
    option = option_given_bare("pipeline", PARALLEL_KEYS, value, ())
    if option is not None:  # `parallel fsdp`: the value of one of its keys, without the key
        said = describe(value)
        c.error(value.pos, f"'{said}' is a value of parallel.{option}, given without its key",
                f"write --set parallel.{option}={said}" if from_command_line(value.pos.source)
                else f"write parallel {{ {option}: {said} }}")
        view.bad = True
        return
    if not isinstance(value, (Call, Name)):
        c.error(value.pos, f"expected pipeline(...), got '{describe(value)}'",
                "e.g. parallel { pipeline(stages: 2, microbatches: 4) }")
        view.bad = True
        return
    name = value.name if isinstance(value, Call) else value
    if name.text not in PARALLEL_KINDS:
        c.error(name.pos, f"unknown parallelism '{name.text}'",
                "restopo plans pipeline parallelism: pipeline(stages: 2, ...)"
                + dym_suffix(name.text, PARALLEL_KINDS))
        view.bad = True
        return
    view.head = name
    if isinstance(value, Call):
        _call_options(view, value, c)

