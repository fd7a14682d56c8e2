"""--set overrides: `section.key=value` applied to a spec's sections before checking.

An override is parsed with the language's own value grammar and lands in the same place a
key written in the file would, so it is checked exactly like the file. Its text is kept as
the pseudo-file `<--set N>` (shown as `--set model.width=64`), and every position inside it
points into that line.
"""
from __future__ import annotations

import re

from .errors import SpecError, did_you_mean
from .fields import Checker, Field, View
from .nodes import Key, Name, Pos, String
from .parse import parse_value
from .sections import BUILTIN_DATA, SECTIONS, line_head, parallel_head


def override_values(overrides) -> dict[str, str]:
    """`section.key=value` texts as the value each key is left with (the last of a key
    wins, as when they are applied), keys and values stripped; not checked."""
    out = {}
    for text in overrides:
        key, _, value = str(text).partition("=")
        out[key.strip()] = value.strip()
    return out


class FlagOverride(str):
    """The override `key=value` a command's own flag stands for (`--steps 0`: train.steps=0),
    which an error shows as the flag the person typed, not as a --set they never wrote."""

    flag: str
    shown: str

    @classmethod
    def of(cls, flag: str, key: str, value: str) -> "FlagOverride":
        out = cls(f"{key}={value}")
        out.flag, out.shown = flag, f"{flag} {value}"
        return out


def apply_overrides(views: dict[str, View], overrides, c: Checker) -> None:
    """Apply each `section.key=value` (or `residual=VALUE`, `parallel=VALUE`) to the views,
    recording its text as the source `<--set N>` (a flag's: `<--flag>`, showing the flag
    as typed) so errors can point into it."""
    for i, text in enumerate(overrides, start=1):
        if isinstance(text, FlagOverride):  # columns of the value line up with the flag's
            source, line = f"<{text.flag}>", text.shown
            base = len(text.flag) - text.index("=")
        else:
            source, line, base = f"<--set {i}>", f"--set {text}", len("--set ")
        c.src.texts[source] = line

        def at(col0: int, end: int | None = None) -> Pos:
            """Position of 0-based column `col0` of the override text, in the shown line."""
            return Pos(source, 1, base + col0 + 1, 1, base + (col0 if end is None else end) + 1)

        eq = text.find("=")
        path = text[:eq] if eq >= 0 else text
        section, dot, key = path.partition(".")
        sec = section.strip()
        if eq < 0 or not sec:
            c.error(at(0), f"an override is written section.key=value, got '{text}'",
                    "e.g. --set model.width=64 or --set residual=full_attnres")
            continue
        sec_col = len(section) - len(section.lstrip())
        if sec not in SECTIONS:
            c.error(at(sec_col), f"unknown section '{sec}' in --set {text}",
                    did_you_mean(sec, SECTIONS))
            continue
        value_text = text[eq + 1:]
        if not value_text.strip():
            c.error(at(eq + 1), f"missing value after '=' in --set {text}",
                    f"e.g. --set {path}=...")
            continue
        if dot and key.strip() == "data" and sec == "train" and _bare_path(value_text):
            # a path on the command line needs no quotes: --set train.data=data/corpus.txt
            lead = len(value_text) - len(value_text.lstrip())
            value = String(value_text.strip(), at(eq + 1 + lead, eq + 1 + len(value_text.rstrip())))
        else:
            try:
                value = parse_value(value_text, source, offset=base + eq + 1)
            except SpecError as e:
                c.errors.append(SpecError(e.path, e.line, e.column, e.message, e.hint, line))
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
            c.error(at(len(section) + 1), f"missing key after '{sec}.' in --set {text}",
                    f"e.g. --set {sec}.{example}=...")
            continue
        key_col = len(section) + 1 + (len(key) - len(key.lstrip()))
        k = Key(words, at(key_col, len(section) + 1 + len(key.rstrip())))
        view = views.get(sec)
        if view is None:
            view = views[sec] = View(Name(sec, at(sec_col)), pos=at(0))
        view.fields[k.text] = Field(k, value, at(0, len(text)))
        # setting one way of cutting blocks replaces the other
        other = {"blocks": "block_size", "block_size": "blocks"}.get(k.text)
        if sec == "residual" and other:
            view.fields.pop(other, None)


def _bare_path(text: str) -> bool:
    """An unquoted file path (not `builtin:NAME`, not already quoted)."""
    t = text.strip()
    return (bool(t) and not t.startswith('"') and t not in BUILTIN_DATA
            and not re.fullmatch(r"[A-Za-z_]\w*:\w*", t))
