"""Text -> syntax tree (nodes.py): Lark LALR with positions, and syntax errors as SpecError.

The grammar (grammars/restopo.lark) only knows the shape of the text; what the sections,
keys and values mean is checked by check.py.
"""
from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from ..words import alts
from .errors import SpecError, source_lines
from .nodes import (SECTIONS, Arg, Call, Entry, Key, ListValue, Name, Number, Pos, Qualified,
                    Section, SpecFile, String)


@lru_cache(maxsize=1)
def parser() -> Lark:
    grammar = resources.files("restopo.grammars").joinpath("restopo.lark").read_text()
    return Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                maybe_placeholders=True, start=["start", "value"])


MAX_WORD = 64  # characters of a name, a key or a number's unit (a path is a quoted string)
_NUMBER = re.compile(r"(-?[0-9][0-9_]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
                     r"((?:[A-Za-z][A-Za-z0-9_]*)?)")


def long_word(word: str) -> tuple[str, str] | None:
    """The message and hint refusing a name, key or unit past MAX_WORD characters, in a
    file or a --set (else quoted whole in messages); None for one of a fitting size."""
    if len(word) <= MAX_WORD:
        return None
    return (f"a word of {len(word):,} characters: '{word[:20]}...'",
            f"names, keys and units are at most {MAX_WORD} characters; a path is quoted, "
            'e.g. data: "corpus.txt"')


class ToNodes(Transformer):
    """Builds nodes.py dataclasses; one method per tree shape of the grammar."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def _meta(self, meta) -> Pos:
        return Pos(self.source, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, tok: Token) -> Pos:
        word = _NUMBER.fullmatch(tok).group(2) if tok.type == "NUMBER" else tok.rstrip(": \t")
        if tok.type != "STRING" and (said := long_word(word)):
            raise SpecError(self.source, tok.line, tok.column, *said)
        return Pos(self.source, tok.line, tok.column, tok.end_line, tok.end_column)

    # -- file and sections --------------------------------------------------------------
    def start(self, children):
        return tuple(children)

    @v_args(meta=True)
    def block_section(self, meta, children):
        kind, label, body = children
        return Section(Name(str(kind), self._tok(kind)),
                       Name(str(label), self._tok(label)) if label is not None else None,
                       body, None, self._meta(meta))

    @v_args(meta=True)
    def line_section(self, meta, children):
        kind, atom = children
        return Section(Name(str(kind), self._tok(kind)), None, None, atom, self._meta(meta))

    def body(self, children):
        return tuple(children)

    @v_args(meta=True)
    def keyed_entry(self, meta, children):
        key, value = children
        return Entry(self._key(key), value, self._meta(meta))

    @v_args(meta=True)
    def bare_entry(self, meta, children):
        return Entry(None, children[0], self._meta(meta))

    def _key(self, tok: Token) -> Key:
        return Key(tuple(str(tok)[:-1].split()), self._tok(tok))

    # -- values -------------------------------------------------------------------------
    @v_args(meta=True)
    def value(self, meta, children):
        if len(children) == 1:
            return children[0]
        return ListValue(tuple(children), self._meta(meta))

    def number(self, children):
        (tok,) = children
        text = str(tok)
        digits, unit = _NUMBER.fullmatch(text).groups()
        plain = digits.replace("_", "")
        if re.fullmatch(r"-?[0-9]+", plain):
            # beyond any sane value; also keeps clear of int()'s digit limit
            value = int(plain) if len(plain) <= 40 else float("inf") * (-1 if plain[0] == "-" else 1)
        else:
            value = float(plain)
        return Number(text, value, unit, self._tok(tok))

    def string(self, children):
        (tok,) = children
        return String(str(tok)[1:-1], self._tok(tok))

    def name(self, children):
        (tok,) = children
        return Name(str(tok), self._tok(tok))

    @v_args(meta=True)
    def qualified(self, meta, children):
        prefix, name = children
        return Qualified(Name(str(prefix), self._tok(prefix)), Name(str(name), self._tok(name)),
                         self._meta(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        name, *args = children
        return Call(Name(str(name), self._tok(name)), tuple(a for a in args if a is not None),
                    self._meta(meta))

    @v_args(meta=True)
    def named_arg(self, meta, children):
        key, value = children
        return Arg(self._key(key), value, self._meta(meta))

    @v_args(meta=True)
    def positional_arg(self, meta, children):
        return Arg(None, children[0], self._meta(meta))


def parse_text(text: str, path: str = "<string>") -> SpecFile:
    """Parse a whole spec; raises SpecError on a syntax error."""
    check_nesting(text, path)
    try:
        tree = parser().parse(text, start="start")
        return SpecFile(path, _transform(tree, path, text))
    except UnexpectedInput as e:
        raise syntax_error(e, text, path) from None
    except RecursionError:  # a shape check_nesting does not foresee: still one clear error
        raise SpecError(path, 1, 1, "the spec is nested too deeply to read") from None


def parse_value(text: str, source: str, offset: int = 0):
    """Parse one value (the right side of a --set override). `offset` is the column (0-based)
    where `text` starts in the line shown to the user, so positions point into that line."""
    padded = " " * offset + text
    check_nesting(padded, source)
    try:
        tree = parser().parse(padded, start="value")
    except UnexpectedInput as e:
        raise syntax_error(e, padded, source, what="value") from None
    return _transform(tree, source, padded)


def _transform(tree, source: str, text: str):
    """The nodes of a parse tree; a SpecError raised on the way (lark wraps it) as itself,
    with its line."""
    try:
        return ToNodes(source).transform(tree)
    except VisitError as e:
        err = e.orig_exc
        if not isinstance(err, SpecError):
            raise
        raise SpecError(err.path, err.line, err.column, err.message, err.hint,
                        _line(text, err.line)) from None


# The language nests at most three levels (`residual custom { before sublayer:
# attend(embedding, window(8)) }`); the parse tree is transformed recursively, so a deeper
# text (`f(f(f(...)))`) is refused before it can exhaust Python's recursion limit.
MAX_NESTING = 16


def check_nesting(text: str, path: str) -> None:
    """SpecError at the first '(' or '{' that opens more than MAX_NESTING levels (comments
    and strings skipped; one pass over the text)."""
    depth, line, col, i, n = 0, 1, 1, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#" or c == '"':  # a comment, or a string: both end at the line's end
            end = text.find("\n", i + 1) if c == "#" else _string_end(text, i)
            end = n if end == -1 else end
            col += end - i
            i = end
            continue
        if c in "({":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecError(path, line, col, f"nested too deeply: more than {MAX_NESTING} "
                                f"'(' or '{{' open at once",
                                "a spec nests a few levels at most, e.g. "
                                "'before sublayer: attend(embedding, window(8))'",
                                _line(text, line))
        elif c in ")}":
            depth = max(0, depth - 1)
        if c == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1


def _string_end(text: str, start: int) -> int:
    """The offset just after the string opened at `start` (or its line's end if unclosed)."""
    close, nl = text.find('"', start + 1), text.find("\n", start + 1)
    if close != -1 and (nl == -1 or close < nl):
        return close + 1
    return nl


# -- syntax errors in words -----------------------------------------------------------------
_WORDS = {
    "NAME": "a name", "NUMBER": "a number", "STRING": 'a "quoted string"',
    "KEY": "a key such as 'width:'", "LBRACE": "'{'", "RBRACE": "'}'", "LPAR": "'('",
    "RPAR": "')'", "COLON": "':'", "SEMICOLON": "';'", "COMMA": "','",
    "$END": "the end of the file",
}
_ORDER = list(_WORDS)


def expected_words(names) -> str:
    words = sorted({_WORDS.get(n, n) for n in names},
                   key=lambda w: next((i for i, k in enumerate(_ORDER) if _WORDS[k] == w), 99))
    return alts(words) if words else "nothing more"


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "KEY":
        return f"key '{str(tok).rstrip(':').strip()}:'"
    kind = {"NAME": "name", "NUMBER": "number", "STRING": "string"}.get(tok.type)
    return f"{kind} {str(tok)!r}" if kind else f"'{tok}'"


def _line(text: str, line: int) -> str | None:
    lines = source_lines(text)
    return lines[line - 1] if 0 < line <= len(lines) else None


def _unclosed(text: str, upto: int):
    """The innermost '{' or '(' still open at offset `upto` (skipping comments, strings)."""
    stack, i, line, col = [], 0, 1, 1
    while i < min(upto, len(text)):
        c = text[i]
        if c == "#":
            while i < len(text) and text[i] != "\n":
                i += 1
                col += 1
            continue
        if c == '"':
            j = text.find('"', i + 1)
            nl = text.find("\n", i + 1)
            j = j if j != -1 and (nl == -1 or j < nl) else (nl if nl != -1 else len(text))
            col += j - i
            i = j
            continue
        if c in "{(":
            stack.append((c, line, col))
        elif c in "})" and stack:
            stack.pop()
        if c == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1
    return stack[-1] if stack else None


def _offset(text: str, line: int, column: int) -> int:
    """The offset of 1-based (line, column) in `text`."""
    return sum(len(row) + 1 for row in source_lines(text)[:line - 1]) + column - 1


def _end_position(text: str) -> tuple[int, int]:
    lines = source_lines(text) or [""]
    n = len(lines)
    while n > 1 and not lines[n - 1].split("#", 1)[0].strip():
        n -= 1
    last = lines[n - 1].split("#", 1)[0].rstrip()
    return n, len(last) + 1


def _in_context(expected: set, text: str, offset: int) -> set:
    """Drop closers that cannot apply here: LALR merges states, so Lark may offer ')' outside
    any parenthesis or '}' outside any braces."""
    opened = _unclosed(text, offset)
    inner = opened[0] if opened else None
    if inner != "(":
        expected -= {"RPAR", "COMMA"}
    if inner != "{":
        expected -= {"RBRACE"}
    return expected


# Look-alikes of ASCII characters that NFKC keeps as they are.
_LOOKALIKES = {"\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-",
               "\u2212": "-", "\u00d7": "x"}


def _word_at(text: str, pos: int, extra: str = "") -> str:
    """The word around offset `pos`: letters (any script), digits, '_' and `extra`."""
    def inside(ch):
        return ch.isalnum() or ch == "_" or ch in extra
    start, end = pos, pos + 1
    while start > 0 and inside(text[start - 1]):
        start -= 1
    while end < len(text) and inside(text[end]):
        end += 1
    return text[start:end]


def _foreign(char: str, hint: str | None, word: str) -> tuple[str, str | None]:
    """The message and hint for a character outside printable ASCII (where strings and
    comments are not): named by its code point, since an invisible one shows as nothing
    (a control character has no name), and what to
    write for a look-alike (a no-break space, a full-width ':', a dash for '-') or for the
    `word` an accented letter is in."""
    import unicodedata
    name = unicodedata.name(char, "")
    code = f"U+{ord(char):04X}" + (f" {name}" if name else "")
    shown = f"'{char}' ({code})" if char.isprintable() and not char.isspace() else code
    plain = _LOOKALIKES.get(char) or unicodedata.normalize("NFKC", char)
    if unicodedata.category(char) == "Nd":  # a digit of another script: NFKC keeps it
        plain = str(unicodedata.digit(char))
    if plain.isascii() and plain.isprintable():
        what = "a plain space" if plain.isspace() else f"'{plain}'"
        hint = f"write {what} instead; outside strings and comments a spec is ASCII"
    elif char.isspace():  # a line separator (U+2028), a vertical tab
        hint = "write a plain space or a new line instead; outside strings and comments a " \
               "spec is ASCII"
    elif unicodedata.category(char) in ("Cf", "Cc"):
        hint = "remove it: an invisible character, often pasted in with the text"
    elif char.isalpha():
        base = unicodedata.normalize("NFKD", word).encode("ascii", "ignore").decode()
        hint = "names and keys are ASCII letters, digits and '_'" + (
            f": write '{base}'" if base.isidentifier() and base != word else "")
    return f"unexpected character {shown}", hint


def _comment_took(text: str, line: int, close: str, upto: int | None) -> int | None:
    """The line, from `line` to `upto`, whose '#' comment holds a `close` (the ')' or '}' a
    person meant to end what is open, read as part of the comment); None if none does."""
    for n, row in enumerate(source_lines(text)[line - 1:upto], start=line):
        code = re.sub(r'"[^"\n]*"', '""', row)
        if "#" in code and close in code.split("#", 1)[1]:
            return n
    return None


CLOSER = {"{": "}", "(": ")"}


def _never_closed(text: str, path: str, opened, hint: str, upto: int | None = None) -> SpecError:
    """'this ( is never closed' at the opener; the hint says so if a comment up to line
    `upto` took its closer."""
    c, line, col = opened
    close = CLOSER[c]
    took = _comment_took(text, line, close, upto)
    if took is not None:
        hint = (f"the '#' on line {took} starts a comment that runs to the end of the line, "
                f"so the '{close}' after it is part of the comment; put the '{close}' before "
                "the '#'")
    return SpecError(path, line, col, f"this '{c}' is never closed", hint, _line(text, line))


def _escaped_end(text: str, pos: int) -> str | None:
    """The string ending in a backslash and its quote (`"a\\"`) that the words up to offset
    `pos`, on its line and in the same entry, follow: one written with an escaped quote in
    it, as in C or Python."""
    start = text.rfind("\n", 0, pos) + 1
    last = None
    for last in re.finditer(r'"[^"\n]*"', text[start:pos]):
        pass
    if last is None or not last.group().endswith('\\"') or not re.fullmatch(
            r'[^;{}()#,"]*', text[start + last.end():pos]):
        return None
    return last.group()


def _enclosed(text: str, pos: int, closers: str) -> str | None:
    """What stands between the opener at offset `pos` and the first of `closers` after it
    on its line; None when none is there."""
    found = re.match(f"[^{re.escape(closers)}\n]*(?=[{re.escape(closers)}])", text[pos + 1:])
    return found.group() if found else None


def _number_hint(text: str, pos: int) -> str | None:
    """The hint for a number the grammar does not take, whose '.', '+' or '-' is at offset
    `pos`, written as it takes one: a point with no digit before it (.003, -.5) or after it
    (3., 1.e-3), a leading '+' (+3e-3)."""
    start = pos - len(re.search(r"[0-9]*\Z", text[:pos]).group())
    if 0 < start and text[start - 1] in "+-":
        start -= 1
    if 0 < start and (text[start - 1].isalnum() or text[start - 1] in "._"):
        return None  # inside a longer word (3.5.1, v.2): not a number
    m = re.match(r"([+-]?)([0-9]*)(\.?)([0-9]*)([eE][+-]?[0-9]+)?(?![\w.])", text[start:])
    if text[pos] not in ".+-" or not m or not (m.group(2) or m.group(4)) or not (
            m.group(3) or m.group(1) == "+"):
        return None
    sign, whole, _, frac, exp = m.groups()
    plain = ("-" if sign == "-" else "") + (whole or "0") + (f".{frac}" if frac else "") + (
        exp or "")
    return f"write the number as {plain}"


def _grouped(text: str, comma: int) -> str | None:
    """The number written with thousands separators (`32,000`) whose ',' is at offset
    `comma`; None if there is none."""
    start = comma - len(re.search(r"-?[0-9]*\Z", text[:comma]).group())
    found = re.match(r"-?[0-9]{1,3}(,[0-9]{3})+(?![\w.])", text[start:])
    before = text[start - 1:start]
    return found.group() if found and not (before.isalnum() or before in "_.") else None


# a --set value that runs on into another setting ('64; model.depth=2', '64 model.depth=2')
ONE_SETTING = ("--set gives one value, with nothing after it; give each setting its own "
               "--set, e.g. --set model.width=64 --set model.depth=2")


def _second_setting(text: str, pos: int) -> bool:
    """Whether the word at `pos` of a --set value starts another KEY=VALUE after the value."""
    return bool(re.search(r"\S\s+[A-Za-z_][\w.]*$", text[:pos])
                and re.match(r"[\w.]*=", text[pos:]))


def syntax_error(e: UnexpectedInput, text: str, path: str, what: str = "spec") -> SpecError:
    """Map Lark's UnexpectedToken/UnexpectedCharacters/UnexpectedEOF to a SpecError in words."""
    if isinstance(e, UnexpectedCharacters):
        line, col, pos = e.line, e.column, e.pos_in_stream
        char = text[pos] if pos < len(text) else ""
        expected = _in_context(set(e.allowed or ()), text, pos)
        message = f"unexpected character {char!r}"
        hint = f"expected {expected_words(expected)}" if expected else None
        if path.startswith("<--set") and _second_setting(text, pos):
            hint = ONE_SETTING
        elif escaped := _escaped_end(text, pos):  # "a\"b": the string ended at \"
            hint = (f"strings have no escapes, so {escaped} ended at its \\\"; a string cannot "
                    "hold a '\"'")
        elif char == "=":
            hint = "write 'key: value' (with a colon) or, on the command line, --set section.key=value" \
                if what == "spec" else hint
            message = "unexpected '='"
        elif char == "[" and (call := re.search(r"[A-Za-z_]\w*[ \t]*\Z", text[:pos])):
            inside = _enclosed(text, pos, "]")
            hint = "a call's arguments go in parentheses" + (
                f": write {call.group().strip()}({inside})" if inside is not None
                else ", e.g. attend(embedding, sublayers)")
        elif char == "[" and (table := re.match(r"\[[ \t]*(\w+)[ \t]*\][ \t]*$",
                                                source_lines(text)[line - 1].strip())):
            # `[model]`, as TOML or INI heads a table
            name = table.group(1) if table.group(1) in SECTIONS else "model"
            hint = f"a section is written '{name} {{ key: value ... }}', its entries in braces"
        elif char in "[]":
            inside = _enclosed(text, pos, "]") if char == "[" else None
            key = re.search(r"[A-Za-z_]\w*:[ \t]*$", text[:pos])
            items = " ".join(inside.replace(",", " ").split()) if inside else None
            hint = "lists are written as names separated by spaces" + (
                f": write '{key.group() if key else ''}{items}'" if items
                else ", e.g. 'layer: attn mlp'")
        elif char == "-" and text[pos - 1:pos].isidentifier():
            word = _word_at(text, pos, "-")
            hint = f"names are letters, digits and '_': write '{word.replace('-', '_')}'"
            if re.fullmatch(r"before-(sublayer|head)", word):  # a rule's key is two words
                hint = f"a rule is written '{word.replace('-', ' ')}:'"
        elif text.startswith(("//", "/*"), pos):
            hint = "comments start with '#' and run to the end of the line"
        elif number := _number_hint(text, pos):  # `.003`, `3.`, `+3e-3`
            hint = number
        elif char in "./\\~":
            word = re.search(r'[^\s;{}()"#,]*\Z', text[:pos]).group() + re.match(
                r'[^\s;{}()"#,]*', text[pos:]).group()
            hint = f'paths are quoted: write "{word}"'
            ratio = re.fullmatch(r"(-?[0-9]+(?:\.[0-9]+)?)/([0-9]+(?:\.[0-9]+)?)", word)
            if char == "/" and ratio and float(ratio.group(2)):  # `lr: 1/1000`
                hint = f"write the number as {float(ratio.group(1)) / float(ratio.group(2)):g}"
            dotted = re.fullmatch(r"(model|residual|parallel|train)\.([A-Za-z_]\w*):?", word)
            first = re.search(r"(?:^|[{;\n])[ \t]*$", text[:pos - len(dotted.group(1))]) \
                if dotted else None  # where an entry starts, not a value (data: model.txt)
            if char == "." and first and what == "spec":  # `train.steps: 3`, as --set names it
                sec, key = dotted.groups()
                value = re.match(r"[ \t:]*([^#;}\n]*)", text[pos + len(key) + 1:]).group(1)
                entry = f"{key}: {value.strip() or '...'}"
                hint = (f"inside braces a key is written alone: '{entry}' ({sec}.{key} is how "
                        "--set names it)" if _unclosed(text, pos) else
                        f"write '{sec} {{ {entry} }}' ({sec}.{key} is how --set names it)")
        elif char == "'":
            inside = _enclosed(text, pos, "'")
            hint = "strings use double quotes" + (f': write "{inside}"' if inside is not None
                                                  else ', e.g. data: "corpus.txt"')
        elif char in "\u201c\u201d\u2018\u2019":  # a word processor's quotes
            inside = _enclosed(text, pos, "\u201c\u201d\u2018\u2019")
            hint = 'strings use plain double quotes (")' + (
                f': write "{inside}"' if inside is not None else ', e.g. data: "corpus.txt"')
        elif char == '"' and '"' not in text[pos + 1:].split("\n", 1)[0]:
            # a string ends on its line: "expected a quoted string" named what was written
            message = "this '\"' is never closed"
            hint = 'end the string with " on the same line, e.g. data: "corpus.txt"'
        elif not (char.isascii() and char.isprintable()):
            message, hint = _foreign(char, hint, _word_at(text, pos))
        return SpecError(path, line, col, message, hint, _line(text, line))

    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        opened = _unclosed(text, tok.start_pos)
        if tok.type == "LBRACE" and opened is not None and _unclosed(text, len(text)) is None:
            # every brace is closed: this one opens inside another (`train { { steps: 3 } }`)
            start = _offset(text, *opened[1:])
            outer = re.search(r"(\w+)(?:[ \t]+\w+)?\s*$", text[:start])
            # the first section inside it, which its '}' should come before
            inner = re.compile(r"(?:^|[;{\n])[ \t]*(model|residual|parallel|train)\b",
                               re.M).search(text, start, tok.start_pos)
            if inner and outer and outer.group(1) in SECTIONS:  # said as _cut_nested says it
                at = inner.start(1)
                line = text.count("\n", 0, at) + 1
                return SpecError(path, line, at - text.rfind("\n", 0, at),
                                 f"the {inner.group(1)} section is inside the {outer.group(1)} "
                                 "section's braces", f"close the {outer.group(1)} section with "
                                 f"'}}' before '{inner.group(1)}': sections do not nest",
                                 _line(text, line))
            return SpecError(path, tok.line, tok.column,
                             f"unexpected '{{' inside the braces opened at line {opened[1]}",
                             "braces do not nest: a section's entries are 'key: value'; "
                             "remove this '{' and the '}' that closes it", _line(text, tok.line))
        if tok.type == "LBRACE" and opened is not None:  # the next section, inside this one
            return _never_closed(text, path, opened,
                                 f"add '{CLOSER[opened[0]]}' where it should end: before line "
                                 f"{tok.line} at the latest, where "
                                 f"'{source_lines(text)[tok.line - 1].strip()}' opens another",
                                 tok.line)
        label = re.search(r"(?:^|[;\n}])[ \t]*(model|residual|parallel|train)[ \t]+"
                          r"(\S+)[ \t]*$", text[:tok.start_pos])
        if tok.type == "LBRACE" and label and not label.group(2).isidentifier():
            kind, at = label.group(1), label.start(2)  # `model 3 {`: not a name
            line = text.count("\n", 0, at) + 1
            return SpecError(path, line, at - text.rfind("\n", 0, at),
                             f"a section's label is a name, got '{label.group(2)}'",
                             f"e.g. '{kind} tiny {{ ... }}', or no label: '{kind} {{ ... }}'",
                             _line(text, line))
        expected = _in_context(set(e.expected or ()), text, tok.start_pos)
        message = f"unexpected {_describe_token(tok)}"
        hint = f"expected {expected_words(expected)}"
        before = text[:tok.start_pos].split()
        quoted = re.search(r'"([A-Za-z_]\w*(?:[ \t]+[A-Za-z_]\w*)?)"[ \t]*\Z', text[:tok.start_pos])
        if tok.type == "COLON" and quoted:  # `"steps": 3`, as JSON writes a key
            hint = f"keys are written without quotes: '{quoted.group(1)}:'"
        elif tok.type == "COLON" and "LBRACE" in expected and before and before[-1] not in (
                "model", "residual", "parallel", "train"):
            from .keys import KEY_HOMES  # (keys reads the topologies: not at import)
            from .fields import home_hint
            key, home = before[-1], KEY_HOMES.get(before[-1])
            value = re.match(r"[ \t]*([^#;}\n]*)", text[tok.end_pos:]).group(1).strip()
            entry = f"{key}: {value or '...'}"
            if len(before) > 2 and before[-3] == home in ("residual", "parallel"):
                # `residual block_attnres blocks: 2`: an option after a one-line head
                hint = f"options go in parentheses: {home} {before[-2]}({entry})"
            else:
                hint = home_hint(key, value or "...", home) if home else (
                    f"'{entry}' must be inside a section's braces, e.g. 'model {{ {entry} }}'")
        elif tok.type == "COLON" and "LBRACE" in expected:
            row = source_lines(text)[tok.line - 1]  # the line without that ':', as meant
            rest = re.match(r'(?:"[^"\n]*"|[^"#])*', row[tok.column:]).group().strip()
            code = f"{row[:tok.column - 1].strip()} {rest}".strip()
            code = code if len(code) <= 60 else code[:56] + " ..."
            hint = f"a section has no ':' after its name: write '{code}'"
        elif tok.type == "COMMA" and (number := _grouped(text, tok.start_pos)):
            hint = (f"numbers are written without ',': write {number.replace(',', '')} "
                    f"(or {number.replace(',', '_')})")
        elif tok.type == "SEMICOLON" and opened is None and path.startswith("<--set"):
            hint = ONE_SETTING
        elif tok.type == "COMMA" and opened is None and path.startswith("<--set"):
            hint = ("--set gives one value, and a list's values are separated by spaces "
                    "(--set 'model.layer=attn mlp'); to compare several values, use "
                    "restopo sweep SPEC --vary KEY=V1,V2")
        elif tok.type == "COMMA" and opened is not None and opened[0] == "{":
            hint = ("in braces, entries are separated by ';' or a new line and a list's values "
                    "by spaces (layer: attn mlp); ',' separates a call's arguments")
        elif tok.type == "KEY" and "KEY" not in expected and _unclosed(text, tok.start_pos):
            hint = f"separate it from the value before with ',' or ';'; {hint}"
        elif tok.type == "KEY" and "KEY" not in expected and what == "spec":
            hint = ("keys belong inside a section's braces, e.g. 'model tiny { width: 64 }'; "
                    f"{hint}")
        elif tok.type in ("RBRACE", "RPAR") and _unclosed(text, tok.start_pos) is None:
            message = f"unexpected '{tok}': nothing is open here"
            opener = "{" if tok.type == "RBRACE" else "("
            # a --set is one line: nothing is above it
            hint = f"remove it, or check the opening '{opener}' " + (
                "before it" if what == "value" else "above")
        elif braceless := re.search(r"(?:^|[;\n])\s*(model|parallel|train)(?:\s+\w+)?\s+"
                                    r"(\w+)\s*:\s*$", text[:tok.start_pos]):
            kind, key = braceless.groups()  # `train steps: 3`: a key without the braces
            hint = f"the {kind} section's entries go in braces, e.g. '{kind} {{ {key}: {tok} }}'"
        elif text[:tok.start_pos].rstrip().endswith(":"):
            hint = f"a value is missing after ':'; {hint}"
        return SpecError(path, tok.line, tok.column, message, hint, _line(text, tok.line))

    # end of input (UnexpectedEOF, or UnexpectedToken at $END)
    expected = set(getattr(e, "expected", ()) or ())
    opened = _unclosed(text, len(text))
    if opened is not None:
        return _never_closed(text, path, opened, f"add '{CLOSER[opened[0]]}' to close it")
    line, col = _end_position(text)
    message = "unexpected end of file" if what == "spec" else "the value ends too soon"
    code = "\n".join(row.split("#", 1)[0] for row in source_lines(text))  # no comments
    last = re.findall(r"[^\s#]+", code)
    after = f" after '{last[-1]}'" if last else ""
    hint = f"expected {expected_words(expected)}{after}"
    if what == "spec" and "LBRACE" in expected and last and last[-1].isidentifier() \
            and last[-1] not in SECTIONS:  # the file ends on a word that starts a section
        from .sections import unknown_section_hint
        at = code.rindex(last[-1])
        line, col = code.count("\n", 0, at) + 1, at - code.rfind("\n", 0, at)
        message, hint = f"unknown section '{last[-1]}'", unknown_section_hint(last[-1])
    return SpecError(path, line, col, message, hint, _line(text, line))
