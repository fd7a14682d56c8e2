"""SpecError: a mistake in a spec, located at FILE:LINE:COL, with a hint a person can act on."""
from __future__ import annotations

import difflib
from typing import Iterable, Sequence

from ..words import counted


class SpecError(Exception):
    """A mistake in a .restopo spec (or in a --set override).

    `line` and `column` are 1-based. `source_line` is the text of that line when known, so
    `str()` can show it with a caret without re-reading the file.
    """

    def __init__(self, path: str, line: int, column: int, message: str,
                 hint: str | None = None, source_line: str | None = None):
        self.path = path
        self.line = line
        self.column = column
        self.message = message
        self.hint = hint
        self.source_line = source_line
        super().__init__(self.render())

    def render(self, source_text: str | None = None) -> str:
        """`FILE:LINE:COL: error: MESSAGE`, the source line, a caret, then `hint: ...`."""
        out = [f"{self.path}:{self.line}:{self.column}: error: {self.message}"]
        text = self.source_line
        if source_text is not None:
            lines = source_lines(source_text)
            text = lines[self.line - 1] if 0 < self.line <= len(lines) else None
        if text is not None:
            # the window first: a tab becomes one blank either way, and an error is made
            # for each mistake on a long line (O(line) each, O(line^2) in all, before)
            text, caret = _window(text, max(self.column - 1, 0))
            text = text.expandtabs(1)
            out.append(f"    {text}")
            out.append("    " + " " * _display_width(text[:caret]) + "^")
        if self.hint:
            out.append(f"hint: {self.hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()

    def __reduce__(self):  # keep the error picklable (multiprocessing, pytest-xdist)
        return (type(self), (self.path, self.line, self.column, self.message, self.hint,
                             self.source_line))


class SpecErrors(SpecError):
    """Several independent mistakes; `.errors` lists them in source order.

    It is itself a SpecError (the first one's location), so `except SpecError` catches it.
    """

    def __init__(self, errors: Sequence[SpecError]):
        if not errors:
            raise ValueError("SpecErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        Exception.__init__(self, self.render())
        self.path, self.line, self.column = first.path, first.line, first.column
        self.message, self.hint, self.source_line = first.message, first.hint, first.source_line

    def render(self, source_text: str | None = None) -> str:
        body = "\n".join(e.render(source_text if e.path == self.errors[0].path else None)
                         for e in self.errors)
        n = len(self.errors)
        return f"{body}\n{counted(n, 'error')}"

    def __str__(self) -> str:
        return self.render()

    def __reduce__(self):
        return (type(self), (self.errors,))


def source_lines(text: str) -> list[str]:
    """The lines of spec text as the parser counts them: split at '\n' alone (the text is
    read with every line break as one, files.as_read); a form feed or U+2028 is inside a
    line, not the end of one, as str.splitlines() would have it."""
    return text.split("\n")


SHOWN_LINE = 100  # characters of a long source line shown around the caret


def _display_width(text: str) -> int:
    """The terminal columns `text` takes: wide (CJK) characters two, combining marks and
    zero-width characters none, so the caret lands under its character."""
    import unicodedata
    return sum(0 if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf")
               else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def _window(text: str, caret: int) -> tuple[str, int]:
    """The part of a long line around column `caret` (0-based), and the caret's place in it."""
    if len(text) <= SHOWN_LINE:
        return text, caret
    start = max(0, min(caret - SHOWN_LINE // 2, len(text) - SHOWN_LINE))
    part = text[start:start + SHOWN_LINE]
    left, right = ("..." if start else ""), ("..." if start + SHOWN_LINE < len(text) else "")
    return left + part + right, caret - start + len(left)


def inside(e: SpecError, pos) -> bool:
    """Whether error `e` is at a place within the span of `pos` (a nodes.Pos)."""
    end = (pos.end_line or pos.line, pos.end_column or pos.column + 1)
    return e.path == pos.source and (pos.line, pos.column) <= (e.line, e.column) < end


def raise_all(errors: Sequence[SpecError]) -> None:
    """Raise nothing, the one error, or SpecErrors for several."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise SpecErrors(errors)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice close to `word`, if any."""
    # by lower case, so that a word in capitals (WIDTH, TRUE) finds its choice too
    lower = {c.lower(): c for c in reversed(list(choices))}
    close = difflib.get_close_matches(word.lower(), lower, n=1, cutoff=0.6)
    return lower[close[0]] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A hint naming the closest choice, or listing them all when none is close."""
    choices = list(choices)
    near = closest(word, choices)
    if near is not None:
        return f"did you mean '{near}'?"
    if choices:
        return "expected one of: " + ", ".join(choices)
    return None
