"""Python source that restopo writes (`restopo compile -o model.py`, and any other generator):
every value that reaches generated source goes through `literal` or `text_literal`.

A spec's text, its file name, an output name and the --set overrides are user input. Pasted
into source by hand (`'''%s'''`, a docstring) a quote, a backslash, a NUL byte or a
newline can end the string early, drop characters or run code on import. These functions
render a value as a literal and prove it: the rendering must parse, on its own, as one
constant equal to the value (ast.literal_eval never runs code), else repr() is used, and
a value that repr() cannot round-trip is refused. Stdlib only.
"""
from __future__ import annotations

import ast
import warnings

_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def literal(value) -> str:
    """`value` (str, bytes, numbers, bool, None, and tuples, lists, dicts and sets of
    them) as a Python literal that evaluates to an equal value; TypeError otherwise."""
    _check_type(value)
    text = repr(value)
    if not _round_trips(text, value):  # e.g. a float nan, which equals nothing
        raise TypeError(f"{value!r} has no exact Python literal")
    return text


def text_literal(text: str, quote: str = "'''", raw: bool = True) -> str:
    """A string as a literal a person can read: `text` between triple quotes (raw by
    default), kept only when that parses back to exactly `text`; else repr(text).

    Use it for long multi-line values (a spec's text, a module docstring): the result is
    always one string literal, whatever the text holds."""
    if not isinstance(text, str):
        raise TypeError(f"text_literal takes a str, got {type(text).__name__}")
    if quote not in ("'''", '"""'):
        raise ValueError("quote must be ''' or \"\"\"")
    readable = ("r" if raw else "") + quote + text + quote
    # Only printable characters, newlines and tabs stay as they are: a file's newline
    # translation would turn a \r into \n on import, and a lone surrogate (from a file
    # name) cannot even be written as UTF-8. repr() escapes all of them.
    plain = all(c.isprintable() or c in "\n\t" for c in text)
    return readable if plain and _round_trips(readable, text) else repr(text)


def _check_type(value) -> None:
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            _check_type(v)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_type(k)
            _check_type(v)
        return
    raise TypeError(f"cannot write a {type(value).__name__} into generated source")


def _round_trips(source: str, value) -> bool:
    """True when `source`, parsed alone, is one literal expression equal to `value` (of the
    same type): nothing before or after it, nothing that is not a literal."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an invalid escape ('\s') warns today, fails later
            tree = ast.parse(source, mode="eval")
        got = ast.literal_eval(tree)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError, Warning):
        return False
    return type(got) is type(value) and got == value
