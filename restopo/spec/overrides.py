"""--set overrides: `section.key=value` applied to a spec's sections before checking.

An override is parsed with the language's own value grammar and lands in the same place a
key written in the file would, so it is checked exactly like the file. Its text is kept as
the pseudo-file `<--set N>` (shown as `--set model.width=64`), and every position inside it
points into that line.
"""
from __future__ import annotations

import argparse
import re

from .errors import SpecError, did_you_mean
from .fields import Checker, Field, View
from .nodes import Key, Name, Pos, String
from .objects import COMPILE, COMPILE_ALIASES, DATA_ENGINES
from .sections import BUILTIN_DATA, SECTIONS, SHARED, line_head, parallel_head


def override_values(overrides) -> dict[str, str]:
    """`section.key=value` texts as the value each key is left with (the last of a key
    wins, as when they are applied), keyed as override_key spells them (`model. width` and
    `model.width` are one key) and values stripped; not checked."""
    out = {}
    for text in overrides:
        path, _, value = str(text).partition("=")
        out[override_key(text) or path.strip()] = value.strip()
    return out


def override_key(text: str) -> str | None:
    """The key a `section.key=value` override sets, as apply_overrides reads it (blanks
    around the parts dropped, `before_head` as `before head`); None without an '='."""
    path, eq, _ = str(text).partition("=")
    if not eq:
        return None
    section, dot, key = path.partition(".")
    if not dot:
        return section.strip()
    words = key.replace("_", " ").split() if key.strip().startswith("before") else [key.strip()]
    return f"{section.strip()}.{' '.join(words)}"


# keys that set one thing: an override of one replaces the others (apply_overrides), and
# two on one command line are refused (SetOverride)
ONE_SETTING = ({"residual.blocks", "residual.block_size"},)


def same_setting(a: str | None, b: str | None) -> bool:
    """Whether two override keys (override_key) set one thing: the same key, or two ways
    of one setting (residual.blocks and residual.block_size both cut the blocks)."""
    return a is not None and (a == b or any({a, b} <= keys for keys in ONE_SETTING))


class SetOverride(argparse.Action):
    """--set KEY=VALUE, repeatable, collected in order. A key set twice is a usage error
    naming both values: applied in turn, the last would win silently."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = list(getattr(namespace, self.dest, None) or [])  # never the shared default
        key = override_key(value)
        for old in given:
            before = override_key(old)
            if same_setting(key, before):
                was, now = old.partition("=")[2].strip(), value.partition("=")[2].strip()
                raise argparse.ArgumentError(self, (
                    f"{key} is set twice, to {was} and to {now}; give it once" if key == before
                    else f"{before}={was} and {key}={now} set one thing; give one of them"))
        setattr(namespace, self.dest, given + [value])


# the train.compile values that compile: --compile (train.compile=true) leaves them as they are
COMPILING = tuple(m for m in (*COMPILE, *COMPILE_ALIASES) if m not in ("off", "false"))


class FlagConflict(ValueError):
    """A command's flag and a --set of the same key that disagree (with_flags)."""


def with_flags(overrides, flags) -> tuple[str, ...]:
    """The --set `overrides`, then a FlagOverride for each command flag that stands for a spec
    key and was given: `flags` are (flag, value, key), value None or False when not given,
    True for a switch. A flag and a --set of one key that disagree are refused (FlagConflict):
    the flag would win silently (a run asked for `--steps 20 --set train.steps=10` trained
    20 steps)."""
    given = override_values(overrides)
    extra = []
    for flag, value, key in flags:
        if value is None or value is False:
            continue
        text = "true" if value is True else repr(value) if isinstance(value, float) else str(value)
        # --compile asks for compilation; a spec or --set that compiles already says how
        keeps = COMPILING if key == "train.compile" else ()
        if key in given and not (same_value(given[key], text, key)
                                 or given[key].strip().lower() in keeps):
            shown = flag if value is True else f"{flag} {value}"
            raise FlagConflict(f"{shown} and --set {key}={given[key]} disagree; give one of "
                               f"them")
        extra.append(FlagOverride.of(flag, key, text, keeps))
    return tuple(overrides) + tuple(extra)


def same_value(a: str, b: str, key: str = "") -> bool:
    """Whether two values of `key` as typed say the same (1e3 and 1000; a name in any case)."""
    if key == "train.compile":  # `true` is regional compilation's other name, `false` off's
        a, b = (COMPILE_ALIASES.get(x.lower(), x) for x in (a, b))
    try:
        return float(a) == float(b)
    except ValueError:
        return a.lower() == b.lower()


def split_values(values: str) -> list[str]:
    """`--vary`'s values split at the commas between them, not at those inside a value's
    parentheses or quotes: block_attnres(blocks: 4, gate: sigmoid),standard is two values.
    Unstripped, so that columns can be counted in them."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(values):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            items.append(values[start:i])
            start = i + 1
    return items + [values[start:]]


class FlagOverride(str):
    """The override `key=value` a command's own flag stands for (`--steps 0`: train.steps=0;
    one value of `--vary model.width=32,64`), which an error shows as the flag the person
    typed, not as a --set they never wrote. `source` names it; `bases` are the offsets from
    a column of the key, and of the value, to where it stands in the line `shown`."""

    source: str
    shown: str
    bases: tuple[int, int]
    keeps: tuple[str, ...] = ()  # spec values the flag leaves as they are (see `of`)

    @classmethod
    def of(cls, flag: str, key: str, value: str, keeps: tuple[str, ...] = (),
           typed: str | None = None, at: int = 0) -> "FlagOverride":
        """keeps: values of the key in the spec that already say what the flag asks for, more
        precisely (`--compile` asks for compilation; a spec's `compile: whole` says which),
        which the flag then leaves alone rather than overwrite. typed: the flag's argument
        as typed when `value` is one part of it (`--seed-list 0,-1`), standing at offset
        `at`: the line shown is what the person wrote, not a flag of one value."""
        out = cls(f"{key}={value}")
        base = len(flag) - len(key) + at  # the value follows the flag and a blank
        shown = f"{flag} {value if typed is None else typed}"
        out.source, out.shown, out.bases = f"<{flag}>", shown, (base, base)
        out.keeps = keeps
        return out

    @classmethod
    def vary(cls, text: str) -> list["FlagOverride"]:
        """`--vary KEY=V1,V2,...` as one override per value, each pointing into the line
        `--vary KEY=V1,V2,...` (text as typed; parse_vary has checked its form)."""
        shown = f"--vary {text}"
        key_text, _, values = text.partition("=")
        key = key_text.strip()
        key_base = len("--vary ") + len(key_text) - len(key_text.lstrip())
        out, col = [], len("--vary ") + len(key_text) + 1  # where the first value starts
        for item in split_values(values):
            value = item.strip()
            one = cls(f"{key}={value}")
            at = col + len(item) - len(item.lstrip())
            one.source, one.shown = f"<--vary {key}>", shown
            one.bases = (key_base, at - len(key) - 1)
            out.append(one)
            col += len(item) + 1
        return out


def apply_overrides(views: dict[str, View], overrides, c: Checker) -> None:
    """Apply each `section.key=value` (or `residual=VALUE`, `parallel=VALUE`) to the views,
    recording its text as the source `<--set N>` (a flag's: `<--flag>`, showing the flag
    as typed) so errors can point into it."""
    from .parse import long_word, parse_value  # lark: not for every command line SetOverride

    for i, text in enumerate(overrides, start=1):
        eq = text.find("=")
        if isinstance(text, FlagOverride):  # columns line up with the flag's line
            source, line, (key_base, value_base) = text.source, text.shown, text.bases
        else:
            source, line = f"<--set {i}>", f"--set {text}"
            key_base = value_base = len("--set ")
        # shown on one line, each line break as a blank (a trailing one, pasted, is a blank)
        brk = re.search(r"[\r\n]", line.rstrip())
        line = c.src.texts[source] = re.sub(r"[\r\n]", " ", line)
        if brk:
            c.error(Pos(source, 1, brk.start() + 1), f"a line break in {line.split()[0]}",
                    "give each setting its own --set, e.g. --set model.width=64 --set "
                    "model.depth=4")
            continue

        def at(col0: int, end: int | None = None) -> Pos:
            """Position of 0-based column `col0` of the override text, in the shown line."""
            base = key_base if eq < 0 or col0 <= eq else value_base
            return Pos(source, 1, base + col0 + 1, 1, base + (col0 if end is None else end) + 1)

        path = text[:eq] if eq >= 0 else text
        section, dot, key = path.partition(".")
        sec = section.strip()
        # a section or key too long to quote, refused as the file's lexer refuses one
        long = next(((col + len(word) - len(word.lstrip()), said) for word, col in (
            (section, 0), (key, len(section) + 1)) if (said := long_word(word.strip()))), None)
        if long is not None and eq >= 0:
            c.error(at(long[0]), *long[1])
            continue
        if eq < 0 or not sec:
            key_text, colon, value_text = text.partition(":")  # model.width: 64, as in a file
            home = c.homes.get(key.strip()) if eq >= 0 and dot else None  # `.width=64`
            c.error(at(0), f"an override is written section.key=value, got '{text}'",
                    f"write --set {key_text.strip()}={value_text.strip()}"
                    if eq < 0 and colon and key_text.strip() and value_text.strip()
                    else f"name its section: --set {home}.{key.strip()}={text[eq + 1:].strip()}"
                    if home else "e.g. --set model.width=64 or --set residual=full_attnres")
            continue
        sec_col = len(section) - len(section.lstrip())
        if sec not in SECTIONS:
            c.error(at(sec_col), f"unknown section '{sec}' in {line}",
                    _section_hint(sec, dot, text, at(sec_col, len(section.rstrip())), c))
            continue
        value_text = text[eq + 1:]
        if not value_text.strip():
            c.error(at(eq + 1), f"missing value after '=' in {line}",
                    f"e.g. --set {path}=...")
            continue
        path = None
        if dot and key.strip() == "data" and _bare_path(value_text):
            # a path on the command line needs no quotes: --set train.data=data/corpus.txt
            lead = len(value_text) - len(value_text.lstrip())
            path = String(value_text.strip(), at(eq + 1 + lead, eq + 1 + len(value_text.rstrip())))
        if path is not None and sec == "train":
            value = path
        else:
            try:
                value = parse_value(value_text, source, offset=value_base + eq + 1)
            except SpecError as e:
                # parallel.data=data/c.txt: training data, said as such (not ddp,fsdp)
                if path is not None and re.search(r"[/.]", path.value):
                    value = path
                else:
                    c.errors.append(SpecError(e.path, e.line, e.column, e.message,
                                              _value_hint(e, sec, dot, value_text), line))
                    continue
        if not dot:
            if sec not in ("residual", "parallel"):
                c.error(at(eq), f"name a key of {sec}: --set {sec}.KEY=VALUE",
                        f"e.g. --set {sec}.{'width' if sec == 'model' else 'steps'}=...")
                continue
            new = View(Name(sec, at(sec_col)), braces=False, pos=at(0))
            (parallel_head if sec == "parallel" else line_head)(new, value, c)
            views[sec] = new
            continue
        # `before head` may be written `before_head` (no blank needed on a command line)
        words = tuple(key.replace("_", " ").split()) if key.strip().startswith("before") \
            else (key.strip(),)
        if not words or not words[0]:
            example = {"model": "width", "residual": "blocks"}.get(sec, "steps")
            c.error(at(len(section) + 1), f"missing key after '{sec}.' in {line}",
                    f"e.g. --set {sec}.{example}=...")
            continue
        key_col = len(section) + 1 + (len(key) - len(key.lstrip()))
        k = Key(words, at(key_col, len(section) + 1 + len(key.rstrip())))
        view = views.get(sec)
        if view is None:
            view = views[sec] = View(Name(sec, at(sec_col)), pos=at(0))
        old = view.fields.get(k.text)
        if isinstance(text, FlagOverride) and old is not None and \
                isinstance(old.value, Name) and old.value.text.lower() in text.keeps:
            continue
        view.fields[k.text] = Field(k, value, at(0, len(text)))
        # setting one way of a setting replaces the others (blocks by count or by size)
        for keys in ONE_SETTING:
            if f"{sec}.{k.text}" in keys:
                for other in keys - {f"{sec}.{k.text}"}:
                    view.fields.pop(other.partition(".")[2], None)


def _value_hint(e: SpecError, sec: str, dot: str, value_text: str) -> str | None:
    """The hint of an override's value that is not one of the language."""
    if sec == "residual" and not dot and "{" in value_text:
        return ("--set residual=VALUE takes a one-line topology (e.g. residual=full_attnres); "
                "write custom wiring in the spec file, or change a rule of the file's custom "
                "wiring with --set 'residual.before_sublayer=...'")
    return e.hint


def _section_hint(key: str, dot: str, text: str, where: Pos, c: Checker) -> str | None:
    """For an override that names a key, not a section (--set width=64), at `where`: the key
    with its section; a key of both train and parallel with the one its value tells
    (data=fsdp, schedule=cosine), else with both; a section and key apart (model width=64),
    joined. Each as typed, --set or --vary."""
    value_text = text.partition("=")[2]

    def keyed(new: str) -> str:
        said = c.src.rewrite(where, where, new) or f"--set {new}={value_text.strip()}"
        return said + ("" if value_text.strip() else "...")

    home = c.homes.get(key) if not dot else None
    if home:
        return f"did you mean {keyed(f'{home}.{key}')}?"
    joined = re.fullmatch(r"(\w+?)[\s/:_-]+(\w[\w\s]*)", key)
    if not dot and joined and joined[1] in SECTIONS:  # model width=64, model/width=64
        return f"write {keyed(f'{joined[1]}.{joined[2].strip()}')}"
    if dot or not any(k == key for k, _ in SHARED):
        return did_you_mean(key, SECTIONS)
    from .parse import parse_value
    try:
        value = parse_value(value_text, "<value>")
        homes = [sec for sec in ("train", "parallel") if SHARED[key, sec][1](value)]
    except SpecError:  # not a value of the language: on a command line, a path if anything
        homes = ["train"] if key == "data" and _bare_path(value_text) else []
    if len(homes) == 1:
        return f"did you mean {keyed(f'{homes[0]}.{key}')}?"
    return f"'{key}' is a key of two sections: " + ", ".join(
        f"{keyed(f'{sec}.{key}')} for {SHARED[key, sec][0]}" for sec in ("train", "parallel"))


def _bare_path(text: str) -> bool:
    """An unquoted file path (not `builtin:NAME`, not already quoted). What starts with
    `builtin:` is never a path (datapath.data_path), so it is read as a value, whose
    mistakes (`builtin:stdlib builtin:stdlib`) check then says; so is a builtin's name
    alone or parallel.data's engine (fsdp), said as such, as in the file."""
    t = text.strip()
    return (bool(t) and not t.startswith('"') and t not in BUILTIN_DATA + DATA_ENGINES
            and not re.fullmatch(r"[A-Za-z_]\w*:\w*", t) and not re.match(r"builtin\s*:", t))
