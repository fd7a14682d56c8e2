"""A section's fields and reading their values: `View` (a section's entries by key, as
`Field`s), the `Checker` that records errors, and its typed readers (numbers with units,
whole numbers in a range, names from a fixed set, booleans).

Every reader returns None after recording an error, so a check can go on and find the
next, independent mistake.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..words import alts
from .errors import SpecError, did_you_mean
from .nodes import (Call, Key, ListValue, Name, Number, Pos, String, Value, describe,
                    from_command_line)
from .objects import SourceText
from .resolve import NAMED_OPTIONS

RULE_TARGETS = ("sublayer", "head")
UNITS = {"": 1, "k": 1_000, "M": 1_000_000}
# the section a key of two is most often meant for, where it is written in a third
MAIN_HOME = {"heads": "model"}  # (else an option of attend: residual ...(heads: N))
_UNIT_WORDS = {"k": "thousands", "M": "millions", "x": "a ratio"}
MAX_INT = 2**31 - 1        # no count or rate in a spec needs more
MAX_DEPTH = 4_096          # transformer layers (30x the deepest trained); see limits.py
SEP_HINT = "put each entry on its own line or separate entries with ';'"

# How a key is written, for hints.
EXAMPLES = {"vocab": "vocab: 256", "width": "width: 64", "depth": "depth: 4",
            "heads": "heads: 4", "context": "context: 64", "stages": "stages: 2",
            "lr": "lr: 3e-3", "min_lr": "min_lr: 3e-4", "weight_decay": "weight_decay: 0.1",
            "grad_clip": "grad_clip: 1.0", "window": "window(8)", "blocks": "blocks: 8",
            "block_size": "block_size: 4", "mlp ratio": "swiglu(4x)",
            "mlp_ratio": "mlp_ratio: 4x", "sinkhorn": "sinkhorn: 20", "streams": "streams: 4",
            "warmup": "warmup: 30", "steps": "steps: 300", "batch": "batch: 16"}


# digits grouped by single underscores between digits, as Python writes them: 32_768, 1_000.5
_GROUPED = re.compile(r"-?[0-9]+(_[0-9]+)*(\.[0-9]+)?([eE][+-]?[0-9]+)?")


_EXAMPLE_NUMBER = r"[0-9][0-9.]*(e-?[0-9]+)?x?"  # the number in an EXAMPLES form


def _in_base(text: str) -> tuple[int, int] | None:
    """(value, base) of a number written as Python writes one in base 16, 8 or 2 (0x40,
    0o17, 0b101); None for any other text."""
    if not re.fullmatch(r"-?0[xXoObB][0-9A-Fa-f_]+", text):
        return None
    try:
        return int(text, 0), {"x": 16, "o": 8, "b": 2}[text.lstrip("-")[1].lower()]
    except ValueError:  # 0b102: not a number in its base either
        return None


def _written(name: str, number: str) -> str:
    """How `name` is written with this number: window(8), swiglu(4x), width: 64."""
    form = EXAMPLES.get(name)
    return (re.sub(_EXAMPLE_NUMBER, number, form, count=1) if form
            else f"{name}: {number}")


@dataclass
class Field:
    key: Key
    value: Value
    pos: Pos


@dataclass
class View:
    """A section with its entries gathered by key, before and after --set overrides."""

    kind: Name
    label: Name | None = None
    head: Name | None = None          # `block_attnres` in `residual block_attnres(...)`
    fields: dict[str, Field] = field(default_factory=dict)
    braces: bool = True               # written `kind { ... }` (else the one-line form)
    pos: Pos | None = None
    bad: bool = False                 # its head already had an error (don't pile on more)
    repeated: list[Field] = field(default_factory=list)  # a key's later values (gather)
    unvalued: set[str] = field(default_factory=set)  # keys written without a value (said)


class Checker:
    """Collects the errors of one spec (file and overrides) with their source lines."""

    def __init__(self, src: SourceText):
        self.src = src
        self.errors: list[SpecError] = []
        self.nested: set[str] = set()  # sections written inside another's braces
        self.homes: dict[str, str] = {}  # key -> the section it belongs to (keys.KEY_HOMES)
        self.model = None  # the checked model, once known: a hint's suggestion is checked on it

    def error(self, pos: Pos, message: str, hint: str | None = None) -> None:
        self.errors.append(self.src.error(pos, message, hint))

    def example(self, f: Field, name: str, why: str | None = None,
                value: str | None = None) -> str:
        """The hint of a value refused for `name` (never without one): the key's own reason,
        else an example `value` (EXAMPLES' number by default) written in the person's own
        words: gelu(fast) gets e.g. gelu(4x), not another kind's swiglu(4x), and
        full_attnres(window: x) window: 8, not a rule's window(8)."""
        if why:
            return why
        if value is None:
            value = re.search(_EXAMPLE_NUMBER, EXAMPLES.get(name, "1")).group()
        # a flag (--steps, one value of --vary K=a,b or --seed-list 0,-1) gets the key's own
        # form: an example in its place could make a list never meant
        flag = from_command_line(f.pos.source) and not f.pos.source.startswith("<--set ")
        written = None if flag else self.src.rewrite(f.pos, f.value.pos, value)
        return f"e.g. {written or _written(name, value)}"

    # -- value readers: return None after recording an error ---------------------------
    def single(self, f: Field, name: str) -> Value | None:
        if isinstance(f.value, ListValue):
            values = describe(f.value)
            texts = [v.text if isinstance(v, Number) else "" for v in f.value.items]
            # `32 000` (`64 128` may well be two values: only thousands are read as one)
            grouped = re.fullmatch(r"-?[0-9]{1,3}( [0-9]{3})*( 000)+", " ".join(texts))
            self.error(f.value.items[1].pos,
                       f"'{name}' takes one value, got {len(f.value.items)} ({values})",
                       f"numbers are written without blanks: write {''.join(texts)} (or "
                       f"{'_'.join(texts)})" if grouped else "remove the extra values; " + SEP_HINT)
            return None
        return f.value

    def number(self, f: Field, name: str, *, ratio: bool = False, lo=None, above=False,
               hi=None, why=None):
        """The value of a number field; `lo` (`above`: exclusive), `hi` and `why`: the key's
        own bounds, which a value past what any key takes is told of too (not a bound that
        is not this key's, nor the upper one for a value far below zero)."""
        items = f.value.items if isinstance(f.value, ListValue) else ()
        if items and isinstance(items[0], Number) and all(isinstance(v, Name)
                                                          for v in items[1:]):
            # a unit in words: `window(8 layers)`, `steps: 300 steps`
            said = describe(f.value)
            sublayers = name in ("window", "block_size") and any(
                v.text.startswith("layer") for v in items[1:])
            alone = self.src.rewrite(f.pos, f.value.pos, items[0].text)
            self.error(items[1].pos, f"'{name}' takes a number alone, got '{said}'",
                       (f"write the number alone: {alone}" if alone else
                        f"write the number alone, {self.example(f, name)}") + (
                           "; it counts sublayers, 2 per transformer layer" if sublayers
                           else ""))
            return None
        v = self.single(f, name)
        if v is None:
            return None
        if not isinstance(v, Number):
            quoted = isinstance(v, String) and re.fullmatch(r"\s*-?[0-9][0-9_.eE+-]*[xkM]?\s*",
                                                            v.value)
            plain = quoted and (self.src.rewrite(f.pos, v.pos, v.value.strip())
                                or _written(name, v.value.strip()))
            self.error(v.pos, f"'{name}' must be a number, got '{describe(v)}'",
                       f"write it without the quotes: {plain}" if quoted else self.example(f, name))
            return None
        digits = v.text[:len(v.text) - len(v.unit)] if v.unit else v.text
        if "_" in digits and not _GROUPED.fullmatch(digits):
            plain = digits.replace("_", "")
            self.error(v.pos, f"misplaced '_' in '{v.text}'",
                       f"'_' may only separate digits, as in 32_768; write {plain}{v.unit}")
            return None
        based = _in_base(v.text)  # `0x40` lexes as 0 with a unit 'x40'
        if based is not None:
            self.error(v.pos, f"'{name}' is written in base {based[1]}, got {v.text}",
                       "numbers are decimal: write "
                       + (self.src.rewrite(f.pos, v.pos, str(based[0]))
                          or _written(name, str(based[0]))))
            return None
        if v.unit != "x" and v.unit not in UNITS:
            hint = "units: x (a ratio), k (thousand), M (million); e.g. 4x, 32k, 3e-3"
            if v.unit in ("K", "X", "m"):  # a unit in the other case
                unit = v.unit.swapcase()
                hint = f"units are case-sensitive: write {digits}{unit} for {_UNIT_WORDS[unit]}" \
                    + ("; a thousandth is 1e-3" if unit == "M" else "")
            self.error(v.pos, f"unknown unit '{v.unit}' in '{v.text}'", hint)
            return None
        value = v.value * UNITS.get(v.unit, 1)
        if (isinstance(value, int) and abs(value) > MAX_INT) or (
                isinstance(value, float) and not abs(value) <= MAX_INT):
            shown = v.text if len(v.text) <= 24 else v.text[:20] + "..."
            below = value < 0
            bound = lo if below else hi
            if bound is not None:
                said = ("greater than" if above else "at least") if below else "at most"
                self.error(v.pos, f"'{name}' must be {said} {describe_number(bound)}, got "
                           f"{shown}", self.example(f, name, why))
            else:
                self.error(v.pos, f"'{name}' is too {'small' if below else 'large'}: {shown}",
                           f"values are at {'least -' if below else 'most '}{MAX_INT:,}")
            return None
        if v.unit == "x" and not ratio:
            self.error(v.pos, f"'{name}' is not a ratio; write {digits} without 'x'",
                       "the 'x' unit marks a ratio, as in mlp: swiglu(4x)")
            return None
        return value

    def integer(self, f: Field, name: str, lo: int | None = None, hi: int | None = None,
                why: str | None = None) -> int | None:
        n = self.number(f, name, lo=lo, hi=hi, why=why)
        if n is None:
            return None
        if n != int(n):
            self.error(f.value.pos, f"'{name}' must be a whole number, got {f.value.text}",
                       self.example(f, name))
            return None
        n = int(n)
        return self.in_range(f, name, n, lo, hi, why)

    def real(self, f: Field, name: str, lo: float | None = None, *, above: bool = False,
             hi: float | None = None, why: str | None = None,
             ratio: bool = False) -> float | None:
        x = self.number(f, name, ratio=ratio, lo=lo, above=above, hi=hi, why=why)
        if x is None:
            return None
        x = float(x)
        if lo is not None and (x <= lo if above else x < lo):
            self.error(f.value.pos, f"'{name}' must be {'greater than' if above else 'at least'} "
                       f"{describe_number(lo)}, got {f.value.text}", self.example(f, name, why))
            return None
        if hi is not None and x > hi:
            self.error(f.value.pos, f"'{name}' must be at most {describe_number(hi)}, "
                       f"got {f.value.text}", self.example(f, name, why))
            return None
        return x

    def in_range(self, f: Field, name: str, n, lo, hi, why) -> int | None:
        if lo is not None and n < lo:
            self.error(f.value.pos, f"'{name}' must be at least {lo}, got {f.value.text}",
                       self.example(f, name, why))
            return None
        if hi is not None and n > hi:
            self.error(f.value.pos, f"'{name}' must be at most {hi}, got {f.value.text}",
                       self.example(f, name, why))
            return None
        return n

    def choice(self, f: Field, name: str, choices) -> str | None:
        v = self.single(f, name)
        if v is None:
            return None
        if isinstance(v, Call) and v.name.text in choices:  # `schedule: cosine(warmup: 30)`
            keyed = [f"{a.key.text}: {describe(a.value)}" for a in v.args if a.key is not None]
            self.error(v.pos, f"'{name}' takes no options, got '{describe(v)}'",
                       f"write '{name}: {v.name.text}'" + (
                           f"; options are keys of their own: {'; '.join(keyed)}" if keyed
                           else ""))
            return None
        # a word that starts with a digit (the schedule 1f1b) lexes as a number with a unit
        if not (isinstance(v, Name) or (isinstance(v, Number) and v.unit)):
            word = v.value.strip() if isinstance(v, String) else None
            plain = word in choices and self.src.rewrite(f.pos, v.pos, word)
            self.error(v.pos, f"'{name}' must be one of {alts(choices)}, got '{describe(v)}'",
                       f"write it without the quotes: {plain}" if plain
                       else self.example(f, name, value=next(iter(choices))))
            return None
        if v.text not in choices:
            self.error(v.pos, f"unknown {name} '{v.text}'", did_you_mean(v.text, choices))
            return None
        return v.text

    def boolean(self, f: Field, name: str) -> bool | None:
        got = self.choice(f, name, ("true", "false"))
        return None if got is None else got == "true"

    # -- gathering entries by key ------------------------------------------------------
    def gather(self, view: View, entries) -> None:
        for e in entries:
            if e.key is None:
                continue
            k = e.key.text
            if k in view.fields:
                first = view.fields[k].key.pos
                self.error(e.key.pos, f"duplicate key '{k}' in {view.kind.text} (first given "
                           f"at line {first.line})", "remove one of them")
                view.repeated.append(Field(e.key, e.value, e.pos))
                continue
            view.fields[k] = Field(e.key, e.value, e.pos)

    def unknown_keys(self, view: View, allowed, where: str) -> set[str]:
        """Report keys not in `allowed`; returns the keys suggested by did-you-mean."""
        suggested = set()
        for k, f in list(view.fields.items()):
            if k in allowed:
                continue
            del view.fields[k]
            words = f.key.words
            rules = "rules are 'before sublayer:' (every sublayer) and 'before head:'"
            if len(words) == 2 and "_".join(words) in allowed:  # `mlp ratio:`
                self.error(f.key.pos, f"unexpected '{k}:' in {where}",
                           f"keys are one word: write '{'_'.join(words)}:'")
            elif len(words) == 2 and "before sublayer" in allowed and words[0] == "before":
                self.error(f.key.pos, f"unknown rule target '{words[1]}'",
                           rules + dym_suffix(words[1], RULE_TARGETS))
            elif len(words) == 2 and words[0] == "before" and words[1] in RULE_TARGETS \
                    and "before sublayer" not in allowed:  # a rule in the model section
                self.error(f.key.pos, f"unexpected '{k}:' in {where}", "rules belong in custom "
                           f"wiring: residual custom {{ {k}: attend(embedding, sublayers) }}")
            elif len(words) == 2 and "before sublayer" in allowed and words[1] in RULE_TARGETS:
                self.error(f.key.pos, f"unknown rule '{k}:'", rules)  # `after sublayer:`
            elif len(words) == 2 and words[1] in allowed:  # a stray word before a key
                self.error(f.key.pos, f"unexpected '{k}:' in {where}", SEP_HINT)
            elif len(words) == 2:
                self.error(f.key.pos, f"unexpected '{k}:' in {where}",
                           did_you_mean("_".join(words), allowed) or SEP_HINT)
            else:
                hint = self.elsewhere(f, view.kind.text) or did_you_mean(k, allowed)
                if hint and hint.startswith("did you mean"):
                    suggested.add(hint.split("'")[1])
                self.error(f.key.pos, f"unknown key '{k}' in {where}", hint)
        return suggested

    def elsewhere(self, f: Field, here: str) -> str | None:
        """The hint for a key of another section than `here`, with the value given (None
        for any other key)."""
        key = f.key.text
        home = self.homes.get(key) or MAIN_HOME.get(key)
        if home is None or home == here:
            return None
        return home_hint(key, self.src.written(f.value.pos) or describe(f.value), home)


def home_hint(key: str, value: str, home: str) -> str:
    """Where `key: value` goes: its `home` section, or for an option of the residual
    topology, in the parentheses of one that takes it."""
    entry = f"{key}: {value}"
    if home != "residual":
        return f"'{key}' belongs in the {home} section: {home} {{ {entry} }}"
    # a topology the option alone makes whole: full_attnres needs no other, a
    # multi-stream one needs its count
    takes = [name for name, keys in NAMED_OPTIONS.items() if key in keys]
    name = "full_attnres" if "full_attnres" in takes else takes[0]
    if "streams" in NAMED_OPTIONS[name] and key != "streams":
        entry = f"streams: 4, {entry}"
    return f"'{key}' is an option of the residual topology, e.g. residual {name}({entry})"


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (O(sqrt n): widths can be large)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def describe_number(x) -> str:
    return str(int(x)) if float(x) == int(x) else repr(float(x))


def dym_suffix(word, choices) -> str:
    hint = did_you_mean(word, choices)
    return f"; {hint}" if hint and hint.startswith("did") else ""


def positions(view: View) -> tuple[tuple[str, Pos], ...]:
    return tuple((k, f.value.pos) for k, f in view.fields.items())
