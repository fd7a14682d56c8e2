"""The syntax tree of a spec: frozen dataclasses that keep where each piece was written.

parse.py builds these from the Lark tree; check.py reads them (never the Lark tree) and
builds the checked spec objects of objects.py. Every node has a `pos`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Pos:
    """Where a node was written: `source` is the file path (or `<--set N>` for an override);
    lines and columns are 1-based, the end exclusive."""

    source: str
    line: int
    column: int
    end_line: int | None = None
    end_column: int | None = None


@dataclass(frozen=True)
class Number:
    text: str           # as written, e.g. "4x", "3e-3"
    value: float        # the number without its unit
    unit: str           # "" or the letters after it ("x", "k", "M", ...)
    pos: Pos


@dataclass(frozen=True)
class Name:
    text: str
    pos: Pos


@dataclass(frozen=True)
class String:
    value: str          # without the quotes
    pos: Pos


@dataclass(frozen=True)
class Qualified:
    """`prefix:name`, e.g. `builtin:stdlib`."""

    prefix: Name
    name: Name
    pos: Pos


@dataclass(frozen=True)
class Key:
    words: tuple[str, ...]    # ("width",) or ("before", "sublayer")
    pos: Pos

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class Arg:
    """One argument of a call: `query: static` (key set) or `embedding` (positional)."""

    key: Key | None
    value: "Value"
    pos: Pos


@dataclass(frozen=True)
class Call:
    """`name(args)`, e.g. `swiglu(4x)`, `attend(embedding, blocks; query: static)`."""

    name: Name
    args: tuple[Arg, ...]
    pos: Pos


Atom = Union[Number, Name, String, Qualified, Call]


@dataclass(frozen=True)
class ListValue:
    """Several atoms in a row: `layer: attn mlp`."""

    items: tuple[Atom, ...]
    pos: Pos


Value = Union[Number, Name, String, Qualified, Call, ListValue]


@dataclass(frozen=True)
class Entry:
    """One entry of a section body: `key: value`, or a bare value (`pipeline(...)`)."""

    key: Key | None
    value: Value
    pos: Pos


@dataclass(frozen=True)
class Section:
    """`kind [label] { body }` or the one-line form `kind atom` (then body is None)."""

    kind: Name
    label: Name | None
    body: tuple[Entry, ...] | None
    line: Atom | None
    pos: Pos


@dataclass(frozen=True)
class SpecFile:
    path: str
    sections: tuple[Section, ...]


SHOWN_VALUE = 60  # characters of a value quoted in a message (the line is shown below it)


def describe(value: Value) -> str:
    """How a value reads in a message: cut short past SHOWN_VALUE characters."""
    text = _described(value)
    return text if len(text) <= SHOWN_VALUE else text[:SHOWN_VALUE - 4] + " ..."


def _described(value: Value) -> str:
    if isinstance(value, Number):
        return value.text
    if isinstance(value, Name):
        return value.text
    if isinstance(value, String):
        return f'"{value.value}"'
    if isinstance(value, Qualified):
        return f"{value.prefix.text}:{value.name.text}"
    if isinstance(value, Call):
        return f"{value.name.text}(...)" if value.args else f"{value.name.text}()"
    if isinstance(value, ListValue):
        return " ".join(describe(i) for i in value.items)
    return repr(value)


def from_command_line(source) -> bool:
    """Whether a position's source is the command line: a --set (`<--set N>`) or a flag
    that stands for one (`<--steps>`, overrides.FlagOverride); spec text has its path or
    <string>."""
    return str(source).startswith("<--")


def blame(first: Pos, *related: Pos | None) -> Pos:
    """Where an error relating several values points: at the first of them given on the
    command line, which is what the person just changed (`--vary model.width=3,4` against
    the file's `heads: 4`), else at `first`."""
    for pos in (first, *related):
        if pos is not None and from_command_line(pos.source):
            return pos
    return first


# The sections a spec is made of (sections.py reads them; wiring.py knows their names too).
SECTIONS = ("model", "residual", "parallel", "train")
