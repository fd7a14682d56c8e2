"""The checking pass: syntax tree (nodes.py) + overrides -> checked Spec (objects.py).

Every independent mistake is collected (not just the first), each at the line and column
of the text that caused it, with a hint; they are raised together as SpecErrors. Nothing
here evaluates user text: values are matched against fixed vocabularies and number forms.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import topology as T
from .errors import SpecError, did_you_mean, raise_all
from .nodes import (Arg, Call, Entry, Key, ListValue, Name, Number, Pos, Qualified, Section,
                    SpecFile, String, Value, describe)
from .objects import (ModelSpec, ParallelSpec, ResidualSpec, RuleSpec, SourceText, Spec,
                      TrainSpec)
from .resolve import ATTEND_OPTIONS, allowed_blocks_hint

SECTIONS = ("model", "residual", "parallel", "train")
MODEL_REQUIRED = ("vocab", "width", "depth", "heads", "context")
MODEL_KEYS = MODEL_REQUIRED + ("mlp", "mlp_ratio", "layer", "tie_embeddings")
MLP_KINDS = ("swiglu", "gelu")
NAMED_OPTIONS = {
    "standard": (), "rezero": (), "layerscale": (), "highway": (), "denseformer": (),
    "full_attnres": ATTEND_OPTIONS + ("window",),
    "block_attnres": ("blocks", "block_size") + ATTEND_OPTIONS,
}
CUSTOM_KEYS = ("blocks", "block_size", "before sublayer", "before head")
RULE_TARGETS = ("sublayer", "head")
PARALLEL_KINDS = ("pipeline",)
PARALLEL_KEYS = ("stages", "virtual", "schedule", "microbatches", "cache")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
TRAIN_KEYS = ("data", "steps", "batch", "lr", "schedule", "warmup", "min_lr", "weight_decay",
              "grad_clip", "accum", "eval_every", "eval_batches", "save_every", "seed",
              "log_every")
LR_SCHEDULES = ("cosine", "constant")
BUILTIN_DATA = ("stdlib",)
UNITS = {"": 1, "k": 1_000, "M": 1_000_000}
SEP_HINT = "put each entry on its own line or separate entries with ';'"

_EXAMPLES = {"vocab": "vocab: 256", "width": "width: 64", "depth": "depth: 4",
             "heads": "heads: 4", "context": "context: 64", "stages": "stages: 2",
             "lr": "lr: 3e-3", "min_lr": "min_lr: 3e-4", "weight_decay": "weight_decay: 0.1",
             "grad_clip": "grad_clip: 1.0", "window": "window(8)", "blocks": "blocks: 8",
             "block_size": "block_size: 4", "mlp ratio": "swiglu(4x)",
             "mlp_ratio": "mlp_ratio: 4x"}


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


class Checker:
    def __init__(self, src: SourceText):
        self.src = src
        self.errors: list[SpecError] = []

    def error(self, pos: Pos, message: str, hint: str | None = None) -> None:
        self.errors.append(self.src.error(pos, message, hint))

    # -- value readers: return None after recording an error ---------------------------
    def single(self, f: Field, name: str) -> Value | None:
        if isinstance(f.value, ListValue):
            self.error(f.value.items[1].pos,
                       f"'{name}' takes one value, got {len(f.value.items)}", SEP_HINT)
            return None
        return f.value

    def number(self, f: Field, name: str, *, ratio: bool = False):
        v = self.single(f, name)
        if v is None:
            return None
        if not isinstance(v, Number):
            self.error(v.pos, f"'{name}' must be a number, got '{describe(v)}'",
                       f"e.g. {_EXAMPLES.get(name, name + ': 1')}")
            return None
        if v.unit == "x":
            if ratio:
                return v.value
            self.error(v.pos, f"'{name}' is not a ratio; write {describe_number(v.value)} "
                       f"without 'x'", "the 'x' unit marks a ratio, as in mlp: swiglu(4x)")
            return None
        if v.unit not in UNITS:
            self.error(v.pos, f"unknown unit '{v.unit}' in '{v.text}'",
                       "units: x (a ratio), k (thousand), M (million); e.g. 4x, 32k, 3e-3")
            return None
        return v.value * UNITS[v.unit]

    def integer(self, f: Field, name: str, lo: int | None = None, hi: int | None = None,
                why: str | None = None) -> int | None:
        n = self.number(f, name)
        if n is None:
            return None
        if n != int(n):
            self.error(f.value.pos, f"'{name}' must be a whole number, got {f.value.text}",
                       f"e.g. {_EXAMPLES.get(name, name + ': 1')}")
            return None
        n = int(n)
        return self.in_range(f, name, n, lo, hi, why)

    def real(self, f: Field, name: str, lo: float | None = None, *, above: bool = False,
             hi: float | None = None, why: str | None = None,
             ratio: bool = False) -> float | None:
        x = self.number(f, name, ratio=ratio)
        if x is None:
            return None
        x = float(x)
        if lo is not None and (x <= lo if above else x < lo):
            self.error(f.value.pos, f"'{name}' must be {'greater than' if above else 'at least'} "
                       f"{describe_number(lo)}, got {f.value.text}", why)
            return None
        if hi is not None and x > hi:
            self.error(f.value.pos, f"'{name}' must be at most {describe_number(hi)}, "
                       f"got {f.value.text}", why)
            return None
        return x

    def in_range(self, f: Field, name: str, n, lo, hi, why) -> int | None:
        if lo is not None and n < lo:
            self.error(f.value.pos, f"'{name}' must be at least {lo}, got {f.value.text}", why)
            return None
        if hi is not None and n > hi:
            self.error(f.value.pos, f"'{name}' must be at most {hi}, got {f.value.text}", why)
            return None
        return n

    def choice(self, f: Field, name: str, choices) -> str | None:
        v = self.single(f, name)
        if v is None:
            return None
        if not isinstance(v, Name):
            self.error(v.pos, f"'{name}' must be one of {_alts(choices)}, got '{describe(v)}'")
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
            if len(words) == 2 and words[0] != "before":
                self.error(f.key.pos, f"unexpected '{k}:' in {where}", SEP_HINT)
            elif len(words) == 2:
                self.error(f.key.pos, f"unknown rule target '{words[1]}'",
                           "rules are 'before sublayer:' (every sublayer) and 'before head:'"
                           + _dym_suffix(words[1], RULE_TARGETS))
            else:
                hint = did_you_mean(k, allowed)
                if hint and hint.startswith("did you mean"):
                    suggested.add(hint.split("'")[1])
                self.error(f.key.pos, f"unknown key '{k}' in {where}", hint)
        return suggested


def describe_number(x) -> str:
    return str(int(x)) if float(x) == int(x) else repr(float(x))


def _alts(choices) -> str:
    choices = list(choices)
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def _dym_suffix(word, choices) -> str:
    hint = did_you_mean(word, choices)
    return f"; {hint}" if hint and hint.startswith("did") else ""


# -- sections -> views ----------------------------------------------------------------------
def views_of(file: SpecFile, c: Checker) -> dict[str, View]:
    views: dict[str, View] = {}
    for s in file.sections:
        kind = s.kind.text
        if kind not in SECTIONS:
            c.error(s.kind.pos, f"unknown section '{kind}'",
                    did_you_mean(kind, SECTIONS) if did_you_mean(kind, SECTIONS).startswith("did")
                    else "sections are model, residual, parallel and train")
            continue
        if kind in views:
            first = views[kind].kind.pos
            c.error(s.kind.pos, f"duplicate section '{kind}' (first given at line {first.line})",
                    "each section may appear once; merge them or remove one")
            continue
        view = View(s.kind, s.label, pos=s.pos, braces=s.body is not None)
        if s.body is not None:
            c.gather(view, s.body)
            bare = [e for e in s.body if e.key is None]
            if kind == "parallel" and bare:
                _parallel_head(view, bare[0].value, c)
                bare = bare[1:]
            for e in bare:
                c.error(e.pos, f"expected 'key: value' in {kind}, got '{describe(e.value)}'",
                        _bare_hint(kind))
            if kind == "residual" and s.label is not None and s.label.text in NAMED_OPTIONS:
                view.head = s.label
        else:
            if kind in ("model", "train"):
                c.error(s.line.pos, f"the {kind} section needs braces: {kind} {{ key: value ... }}",
                        f"e.g. {kind} {{ {'width: 64' if kind == 'model' else 'steps: 300'} }}")
                continue
            if kind == "parallel":
                _parallel_head(view, s.line, c)
            else:
                _line_head(view, s.line, c)
        views[kind] = view
    return views


def _bare_hint(kind: str) -> str:
    return {"model": "e.g. 'width: 64'", "train": "e.g. 'steps: 300'",
            "residual": "custom wiring is written 'before sublayer: attend(embedding, blocks, "
                        "partial)'; a named topology is 'residual block_attnres(blocks: 8)'",
            "parallel": "write one 'pipeline(stages: 2, ...)' or 'stages: 2'"}[kind]


def _line_head(view: View, atom, c: Checker) -> None:
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
    for a in call.args:
        if a.key is None:
            view.bad = True
            c.error(a.pos, f"'{call.name.text}' takes named options, got '{describe(a.value)}'",
                    _options_example(call.name.text))
    c.gather(view, [Entry(a.key, a.value, a.pos) for a in call.args if a.key is not None])


def _options_example(name: str) -> str:
    return {"block_attnres": "e.g. block_attnres(blocks: 8) or block_attnres(block_size: 4)",
            "full_attnres": "e.g. full_attnres(query: input_dependent) or full_attnres(window: 8)",
            "pipeline": "e.g. pipeline(stages: 2, microbatches: 4)"}.get(
                name, "write options as 'key: value'")


def _parallel_head(view: View, value, c: Checker) -> None:
    if not isinstance(value, (Call, Name)):
        c.error(value.pos, f"expected pipeline(...), got '{describe(value)}'",
                "e.g. parallel { pipeline(stages: 2, microbatches: 4) }")
        view.bad = True
        return
    name = value.name if isinstance(value, Call) else value
    if name.text not in PARALLEL_KINDS:
        c.error(name.pos, f"unknown parallelism '{name.text}'",
                "restopo plans pipeline parallelism: pipeline(stages: 2, ...)"
                + _dym_suffix(name.text, PARALLEL_KINDS))
        view.bad = True
        return
    view.head = name
    if isinstance(value, Call):
        _call_options(view, value, c)


# -- overrides --------------------------------------------------------------------------
def apply_overrides(views: dict[str, View], overrides, c: Checker) -> None:
    from .parse import parse_value
    for i, text in enumerate(overrides, start=1):
        source = f"<--set {i}>"
        line = f"--set {text}"
        c.src.texts[source] = line
        base = len("--set ")

        def at(col0: int, end: int | None = None) -> Pos:
            return Pos(source, 1, base + col0 + 1, 1, base + (end if end is not None else col0) + 1)

        eq = text.find("=")
        if eq < 0:
            c.error(at(0), f"an override is written section.key=value, got '{text}'",
                    "e.g. --set model.width=64 or --set residual=full_attnres")
            continue
        path = text[:eq]
        section, dot, key = path.partition(".")
        sec = section.strip()
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
        try:
            value = parse_value(value_text, source, offset=base + eq + 1)
        except SpecError as e:
            e.source_line = line
            c.errors.append(SpecError(e.path, e.line, e.column, e.message, e.hint, line))
            continue
        view = views.get(sec)
        if not dot:
            if sec not in ("residual", "parallel"):
                c.error(at(eq), f"name a key of {sec}: --set {sec}.KEY=VALUE",
                        f"e.g. --set {sec}.{'width' if sec == 'model' else 'steps'}=...")
                continue
            new = View(Name(sec, at(sec_col)), braces=False, pos=at(0))
            (_parallel_head if sec == "parallel" else _line_head)(new, value, c)
            views[sec] = new
            continue
        words = tuple(key.replace("_", " ").split()) if key.strip().startswith("before") \
            else (key.strip(),)
        key_col = len(section) + 1 + (len(key) - len(key.lstrip()))
        kpos = at(key_col, len(section) + 1 + len(key.rstrip()))
        if not words or not words[0]:
            c.error(at(len(section) + 1), f"missing key after '{sec}.' in --set {text}",
                    f"e.g. --set {sec}.{ {'model': 'width', 'residual': 'blocks'}.get(sec, 'steps') }=...")
            continue
        if view is None:
            view = View(Name(sec, at(sec_col)), pos=at(0))
            views[sec] = view
        k = Key(words, kpos)
        view.fields[k.text] = Field(k, value, at(0, len(text)))


# -- sections -> spec objects ---------------------------------------------------------------
def _positions(view: View) -> tuple[tuple[str, Pos], ...]:
    return tuple((k, f.value.pos) for k, f in view.fields.items())


def check_model(view: View, c: Checker) -> ModelSpec | None:
    before = len(c.errors)
    misspelled = c.unknown_keys(view, MODEL_KEYS, "model")
    f = view.fields
    for k in MODEL_REQUIRED:
        if k not in f and k not in misspelled:
            c.error(view.kind.pos, f"the model section is missing '{k}'",
                    f"add '{_EXAMPLES[k]}'" + ("; heads must divide width" if k == "heads" else ""))
    got = {}
    for k, lo, why in (("vocab", 2, "the vocabulary needs at least 2 tokens"),
                       ("width", 1, None), ("depth", 1, "depth counts transformer layers"),
                       ("heads", 1, None), ("context", 1, "the context length in tokens")):
        if k in f:
            got[k] = c.integer(f[k], k, lo, why=why)
    if got.get("width") and got.get("heads") and got["width"] % got["heads"]:
        w, h = got["width"], got["heads"]
        near = [d for d in range(1, w + 1) if w % d == 0]
        near = sorted(near, key=lambda d: (abs(d - h), d))[:3]
        c.error(f["heads"].value.pos, f"heads ({h}) must divide width ({w})",
                f"heads that divide {w}: {', '.join(map(str, sorted(near)))}")
        got["heads"] = None
    mlp, ratio = "swiglu", 4.0
    if "mlp" in f:
        mlp, ratio = _mlp(f["mlp"], c)
    if "mlp_ratio" in f:
        if "mlp" in f and isinstance(f["mlp"].value, Call):
            c.error(f["mlp_ratio"].key.pos, "the MLP ratio is given twice (mlp: ...(ratio) and "
                    "mlp_ratio:)", "keep one of them")
        else:
            ratio = c.real(f["mlp_ratio"], "mlp_ratio", 0, above=True, ratio=True)
    layer = ("attn", "mlp")
    if "layer" in f:
        layer = _layer(f["layer"], c)
    tie = True
    if "tie_embeddings" in f:
        tie = c.boolean(f["tie_embeddings"], "tie_embeddings")
    if len(c.errors) > before or None in (mlp, ratio, layer, tie) or None in got.values():
        return None
    return ModelSpec(got["vocab"], got["width"], got["depth"], got["heads"], got["context"],
                     mlp, float(ratio), layer, tie, view.label.text if view.label else None,
                     pos=view.kind.pos, positions=_positions(view))


def _mlp(fl: Field, c: Checker):
    v = c.single(fl, "mlp")
    if v is None:
        return None, None
    name = v.name if isinstance(v, Call) else v
    if not isinstance(name, Name):
        c.error(v.pos, f"expected an MLP kind ({_alts(MLP_KINDS)}), got '{describe(v)}'",
                "e.g. mlp: swiglu(4x)")
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
        if not allowed:
            c.error(f.key.pos, f"'{name.text}' takes no options, got '{k}'",
                    f"write 'residual {name.text}'")
            continue
        owner = next((n for n, opts in NAMED_OPTIONS.items() if k in opts), None)
        if owner:
            c.error(f.key.pos, f"option '{k}' does not apply to {name.text}",
                    f"'{k}' is an option of {owner}; {name.text} takes {_alts(allowed)}")
        else:
            c.error(f.key.pos, f"unknown option '{k}' for {name.text}",
                    did_you_mean(k, allowed))
    opts = _attend_options(view.fields, c)
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
                        pos=name.pos, positions=_positions(view), source=c.src)


def _attend_options(fields: dict[str, Field], c: Checker) -> dict:
    out = {}
    for k, choices in (("query", T.QUERY_KINDS), ("gate", T.GATES), ("key_norm", T.KEY_NORMS)):
        if k in fields:
            out[k] = c.choice(fields[k], k, choices)
    if "heads" in fields:
        out["heads"] = c.integer(fields["heads"], "heads", 1,
                                 why="depth-attention heads; they must divide width")
    return out


def _blocks(view: View, c: Checker):
    f = view.fields
    blocks = block_size = None
    if "blocks" in f and "block_size" in f:
        second = max(f["blocks"], f["block_size"], key=lambda x: (x.key.pos.source, x.key.pos.line,
                                                                  x.key.pos.column))
        c.error(second.key.pos, "give either 'blocks' or 'block_size', not both",
                "blocks: N cuts the model into N blocks; block_size: S makes blocks of S sublayers")
        return None, None
    if "blocks" in f:
        blocks = c.integer(f["blocks"], "blocks", 1, why="the number of blocks")
    if "block_size" in f:
        block_size = c.integer(f["block_size"], "block_size", 1,
                               why="block_size counts sublayers (2 per transformer layer)")
    return blocks, block_size


def _custom(view: View, c: Checker) -> ResidualSpec | None:
    before = len(c.errors)
    c.unknown_keys(view, CUSTOM_KEYS, "custom wiring")
    f = view.fields
    blocks, block_size = _blocks(view, c)
    if "before sublayer" not in f:
        c.error((view.label or view.kind).pos, "custom wiring needs a 'before sublayer:' rule",
                "e.g. before sublayer: attend(embedding, blocks, partial)")
        return None
    sub = _rule(f["before sublayer"], "sublayer", c)
    head = _rule(f["before head"], "head", c) if "before head" in f else None
    if len(c.errors) > before or sub is None:
        return None
    if head is None:  # the head reads what the sublayers read; no partial is open there
        head = RuleSpec(sub.method, tuple(s for s in sub.sources if s.name != "partial"),
                        sub.query, sub.gate, sub.key_norm, sub.heads, pos=sub.pos)
    name = view.label.text if view.label else "custom"
    return ResidualSpec(name, "custom", (), blocks, block_size, sub, head,
                        pos=(view.label or view.kind).pos, positions=_positions(view),
                        source=c.src)


def _rule(fl: Field, target: str, c: Checker) -> RuleSpec | None:
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
    sources, seen = [], {}
    for a in args:
        if a.key is None:
            s = _source(a, target, c)
            if s is None:
                continue
            if str(s) in seen or (s.name == "window" and "window" in seen):
                c.error(a.pos, f"source '{s}' is listed twice", "list each source once")
                continue
            seen[str(s)] = seen[s.name] = a
            sources.append(s)
    options = {}
    named = {a.key.text: Field(a.key, a.value, a.pos) for a in args if a.key is not None}
    for k, fa in named.items():
        if k not in ATTEND_OPTIONS:
            c.error(fa.key.pos, f"unknown option '{k}' for {method}",
                    did_you_mean(k, ATTEND_OPTIONS) if method == "attend"
                    else f"{method} takes no options")
        elif method != "attend":
            c.error(fa.key.pos, f"option '{k}' does not apply to {method}",
                    f"only attend takes {_alts(ATTEND_OPTIONS)}")
    if len([a for a in args if a.key is not None]) != len(named):
        dup = [a for a in args if a.key is not None]
        keys = [a.key.text for a in dup]
        second = next(a for i, a in enumerate(dup) if a.key.text in keys[:i])
        c.error(second.key.pos, f"option '{second.key.text}' is given twice", "keep one")
    if method == "attend":
        options = _attend_options({k: v for k, v in named.items() if k in ATTEND_OPTIONS}, c)
    if method in T.STREAM_METHODS:
        wrong = [a for a in args if a.key is None and str(_quiet_source(a)) not in
                 ("embedding", "sublayers")]
        if wrong:
            c.error(wrong[0].pos, f"{method} updates one running stream and always reads the "
                    f"embedding and every earlier sublayer",
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
        c.error(pos, f"the first sublayer would read no source: {_alts([str(s) for s in sources])} "
                "are all empty before it", f"add 'embedding', e.g. {method}(embedding, ...)")
        return None
    return RuleSpec(method, tuple(sources), pos=pos, **options)


def _quiet_source(a: Arg):
    v = a.value
    return v.text if isinstance(v, Name) else None


def _source(a: Arg, target: str, c: Checker) -> T.Source | None:
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
    if isinstance(v, Call):
        c.error(v.name.pos, f"unknown source '{v.name.text}(...)'",
                did_you_mean(v.name.text, names))
        return None
    c.error(v.pos, f"expected a source, got '{describe(v)}'",
            f"sources: {', '.join(names)}")
    return None


def check_parallel(view: View, c: Checker) -> ParallelSpec | None:
    before = len(c.errors)
    c.unknown_keys(view, PARALLEL_KEYS, "parallel")
    f = view.fields
    if view.bad:
        return None
    if "stages" not in f:
        c.error((view.head or view.kind).pos, "the parallel section is missing 'stages'",
                "e.g. parallel { pipeline(stages: 2, microbatches: 4) }")
        return None
    stages = c.integer(f["stages"], "stages", 1, why="the number of pipeline ranks")
    virtual = c.integer(f["virtual"], "virtual", 1,
                        why="model chunks per rank") if "virtual" in f else 1
    schedule = None
    if "schedule" in f:
        schedule = c.choice(f["schedule"], "schedule", SCHEDULES)
        if schedule and virtual and virtual > 1 and schedule != "interleaved_1f1b":
            c.error(f["schedule"].value.pos, f"schedule {schedule} runs one chunk per stage, "
                    f"but virtual is {virtual}", "use schedule: interleaved_1f1b, or virtual: 1")
    elif virtual:
        schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
    micro = stages
    if "microbatches" in f:
        micro = c.integer(f["microbatches"], "microbatches", 1)
        if micro and stages and micro < stages:
            c.error(f["microbatches"].value.pos,
                    f"microbatches ({micro}) must be at least stages ({stages})",
                    "with fewer microbatches than stages some stages would sit idle; "
                    f"use microbatches: {stages} or more")
            micro = None
    cache = True
    if "cache" in f:
        cache = c.boolean(f["cache"], "cache")
    if len(c.errors) > before or None in (stages, virtual, schedule, micro, cache):
        return None
    return ParallelSpec(stages, virtual, schedule, micro, cache,
                        pos=(view.head or view.kind).pos, positions=_positions(view))


def check_train(view: View, c: Checker) -> TrainSpec | None:
    before = len(c.errors)
    c.unknown_keys(view, TRAIN_KEYS, "train")
    f = view.fields
    got = {}
    ints = {"steps": 1, "batch": 1, "warmup": 0, "accum": 1, "eval_every": 0, "eval_batches": 1,
            "save_every": 0, "seed": 0, "log_every": 1}
    whys = {"eval_every": "0 turns evaluation off", "save_every": "0 turns checkpoints off",
            "steps": "the number of optimizer steps", "batch": "sequences per optimizer step",
            "log_every": "steps between log lines", "eval_batches": "batches per evaluation",
            "accum": "gradient accumulation steps per optimizer step"}
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
    if "schedule" in f:
        got["schedule"] = c.choice(f["schedule"], "schedule", LR_SCHEDULES)
    if "data" in f:
        got["data"] = _data(f["data"], c)
    steps = got.get("steps", TrainSpec.steps)
    if "warmup" in f and got.get("warmup") is not None and steps and got["warmup"] > steps:
        c.error(f["warmup"].value.pos, f"warmup ({got['warmup']}) is longer than steps ({steps})",
                "warmup counts optimizer steps and must be at most steps")
    lr = got.get("lr", TrainSpec.lr)
    if got.get("min_lr") is not None and lr and got["min_lr"] > lr:
        c.error(f["min_lr"].value.pos, f"min_lr ({f['min_lr'].value.text}) is above lr ({lr:g})",
                "min_lr is where the cosine schedule ends; keep it at most lr")
    if len(c.errors) > before or None in got.values():
        return None
    return TrainSpec(**got, pos=view.kind.pos, positions=_positions(view))


def _data(fl: Field, c: Checker) -> str | None:
    v = c.single(fl, "data")
    form = 'data is written builtin:NAME or as a quoted path, e.g. data: "corpus.txt"'
    if v is None:
        return None
    if isinstance(v, String):
        if not v.value.strip():
            c.error(v.pos, "the data path is empty", form)
            return None
        return v.value
    if isinstance(v, Qualified):
        if v.prefix.text != "builtin":
            c.error(v.prefix.pos, f"unknown data kind '{v.prefix.text}:'",
                    "data is builtin:NAME or a quoted path" + _dym_suffix(v.prefix.text, ("builtin",)))
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
    src = SourceText({file.path: text})
    c = Checker(src)
    views = views_of(file, c)
    apply_overrides(views, tuple(overrides), c)
    model = check_model(views["model"], c) if "model" in views else None
    residual = None
    if "residual" in views:
        residual = check_residual(views["residual"], c)
    else:
        pos = file.sections[0].pos if file.sections else Pos(file.path, 1, 1)
        c.error(Pos(pos.source, pos.line, pos.column) if file.sections else pos,
                "the spec has no residual section" if file.sections else "the spec is empty",
                "add a line such as 'residual block_attnres(blocks: 8)' or 'residual standard'")
    parallel = check_parallel(views["parallel"], c) if "parallel" in views else None
    train = check_train(views["train"], c) if "train" in views else TrainSpec()

    if model is not None and residual is not None:
        _check_against_model(model, residual, views["residual"], c)
    if model is not None and parallel is not None:
        L = model.sublayers
        if parallel.chunks > L:
            fv = views["parallel"].fields
            where = fv["virtual"] if "virtual" in fv and parallel.virtual > 1 else fv["stages"]
            c.error(where.value.pos, f"stages x virtual = {parallel.chunks} model chunks, but the "
                    f"model has only {L} sublayers", "each chunk needs at least one sublayer; "
                    "use fewer stages or virtual stages, or a deeper model")
    raise_all(sorted(c.errors, key=lambda e: _order(e, file.path)))
    return Spec(residual, model, train if train is not None else TrainSpec(), parallel, text,
                file.path, tuple(overrides), source=src)


def _order(e: SpecError, path: str):
    """Errors in the file first, in source order, then those of each --set in turn."""
    if e.path == path:
        return (0, 0, e.line, e.column)
    n = e.path[len("<--set "):-1] if e.path.startswith("<--set ") else ""
    return (1, int(n) if n.isdigit() else 0, e.line, e.column)


def _check_against_model(model: ModelSpec, residual: ResidualSpec, view: View, c: Checker):
    heads = []
    if residual.form == "named" and residual.option("heads"):
        heads.append((residual.option("heads"), view.fields["heads"].value.pos))
    for rule in (residual.sublayer_rule, residual.head_rule):
        if rule is not None and rule.heads > 1 and rule.heads not in [h for h, _ in heads]:
            heads.append((rule.heads, rule.pos))
    for h, pos in heads:
        if model.width % h:
            c.error(pos, f"depth-attention heads ({h}) must divide width ({model.width})",
                    f"heads that divide {model.width}: "
                    + ", ".join(str(d) for d in range(1, min(model.width, 64) + 1)
                                if model.width % d == 0))
    try:
        topology = residual.resolve(model.kinds)
    except SpecError as e:
        c.errors.append(e)
        return
    from ..ir.build import TopologyError, build_ir
    try:
        build_ir(model.kinds, topology, model.width)
    except TopologyError as e:
        c.error(residual.pos, str(e))
