"""The checked spec: frozen dataclasses the rest of restopo reads.

Built by check.py from the syntax tree, only once every value is valid. Each object keeps
the positions of its keys (`where(key)`), so a later stage that finds a problem (the data
loader, the pipeline planner) can still point at the line that caused it via `Spec.error`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..topology import Rule, Topology, sublayer_kinds
from .errors import SpecError, source_lines
from .nodes import Pos, from_command_line

if TYPE_CHECKING:  # pragma: no cover
    import networkx as nx


class SourceText:
    """The texts positions point into: the spec file and each --set override."""

    def __init__(self, texts: dict[str, str] | None = None):
        self.texts = dict(texts or {})
        self._lines: dict[str, list[str]] = {}  # split once: a spec may have many errors

    def line(self, pos: Pos | None) -> str | None:
        if pos is None or pos.source not in self.texts:
            return None
        lines = self._lines.get(pos.source)
        if lines is None:
            lines = self._lines[pos.source] = source_lines(self.texts[pos.source])
        return lines[pos.line - 1] if 0 < pos.line <= len(lines) else None

    def error(self, pos: Pos, message: str, hint: str | None = None) -> SpecError:
        return SpecError(pos.source, pos.line, pos.column, message, hint, self.line(pos))

    def written(self, pos: Pos) -> str | None:
        """The text at `pos` as typed; None when it spans lines or the text is unknown."""
        line = self.line(pos)
        if line is None or pos.end_line != pos.line or pos.end_column is None:
            return None
        return line[pos.column - 1:pos.end_column - 1]

    def rewrite(self, span: Pos, part: Pos, new: str, *more: tuple[Pos, str]) -> str | None:
        """What a person wrote at `span` with `part` of it replaced by `new` (and each further
        part of `more` by its text), for a hint that corrects one value and keeps the other
        words (`gelu("4x")` -> `gelu(4x)`). On the command line, the whole line as typed
        (`--set train.lr=3e-3`); None when any spans lines or the text is unknown."""
        line = self.line(part)
        changes = sorted(((part, new), *more), key=lambda change: change[0].column)
        if line is None or {span.line, span.end_line} | {
                p.line for p, _ in changes} | {p.end_line for p, _ in changes} != {part.line}:
            return None
        if from_command_line(span.source):  # a --set or a flag: the line as typed
            start, end = 0, len(line)
        else:
            start, end = span.column - 1, span.end_column - 1
        out, at = "", start
        for p, text in changes:
            if not at <= p.column - 1 <= p.end_column - 1 <= end:
                return None
            out += line[at:p.column - 1] + text
            at = p.end_column - 1
        # a tab shown in a hint lands anywhere: the source line is shown with tabs as blanks
        return (out + line[at:end]).strip().replace("\t", " ")


def _where(positions, key: str) -> Pos | None:
    return next((p for k, p in positions if k == key), None)


@dataclass(frozen=True)
class ModelSpec:
    vocab: int
    width: int
    depth: int
    heads: int
    context: int
    mlp: str = "swiglu"            # swiglu | gelu
    mlp_ratio: float = 4.0         # hidden width = mlp_ratio * width
    layer: tuple[str, ...] = ("attn", "mlp")
    tie_embeddings: bool = True
    name: str | None = None
    pos: Pos | None = field(default=None, compare=False, repr=False)
    positions: tuple[tuple[str, Pos], ...] = field(default=(), compare=False, repr=False)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The L sublayer kinds in order (`layer` repeated `depth` times)."""
        return sublayer_kinds(self.depth, self.layer)

    @property
    def sublayers(self) -> int:
        return len(self.kinds)

    def where(self, key: str) -> Pos | None:
        return _where(self.positions, key) or self.pos


@dataclass(frozen=True)
class ResidualSpec:
    """The residual section, not yet tied to a model.

    form "named": a one-liner (`name` in restopo.topology.NAMED) with `options`;
    form "custom": wiring rules, `name` is the section label (default "custom"); a rule's
    position is that of its key (`where("before sublayer")`).
    resolve.py turns it into the Topology over a sequence of sublayer kinds.
    """

    name: str
    form: str
    options: tuple[tuple[str, object], ...] = ()
    blocks: int | None = None
    block_size: int | None = None
    sublayer_rule: Rule | None = None
    head_rule: Rule | None = None
    pos: Pos | None = field(default=None, compare=False, repr=False)
    positions: tuple[tuple[str, Pos], ...] = field(default=(), compare=False, repr=False)
    source: SourceText | None = field(default=None, compare=False, repr=False)

    def option(self, key: str, default=None):
        return next((v for k, v in self.options if k == key), default)

    def where(self, key: str) -> Pos | None:
        return _where(self.positions, key) or self.pos


# train.recompute's modes (restopo.fx.recompute says what each recomputes)
RECOMPUTE = ("none", "sublayer", "block")
# train.compile's modes (restopo.train.compile): off, each region compiled in place
# (`true` says the same), or the whole model as one graph
COMPILE = ("off", "regional", "whole")
COMPILE_ALIASES = {"true": "regional", "false": "off"}  # what spec files said before
LR_SCHEDULES = ("cosine", "constant")  # train.schedule
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # parallel.schedule: the pipeline's
DATA_ENGINES = ("ddp", "fsdp")  # parallel.data: replicated (DDP) or sharded (FSDP2)


@dataclass(frozen=True)
class TrainSpec:
    data: str = "builtin:stdlib"   # builtin:NAME or a path
    steps: int = 300
    batch: int = 16
    lr: float = 3e-3
    schedule: str = "cosine"       # cosine | constant
    warmup: int = 30
    min_lr: float | None = None    # None -> lr / 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0         # 0 turns clipping off
    accum: int = 1
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 100
    seed: int = 0
    log_every: int = 10
    keep: int = 3                  # checkpoints kept on disk (the newest)
    peak_tflops: float | None = None  # one device's peak TFLOP/s for MFU (None: its default)
    recompute: str = "none"        # none | sublayer | block (restopo.fx.recompute)
    compile: str = "off"           # off | regional | whole (restopo.train.compile)
    pos: Pos | None = field(default=None, compare=False, repr=False)
    positions: tuple[tuple[str, Pos], ...] = field(default=(), compare=False, repr=False)

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def where(self, key: str) -> Pos | None:
        return _where(self.positions, key) or self.pos


@dataclass(frozen=True)
class ParallelSpec:
    stages: int
    virtual: int = 1
    schedule: str = "1f1b"         # gpipe | 1f1b | interleaved_1f1b
    microbatches: int = 1
    cache: bool = True
    data: str = "ddp"              # data parallel engine: ddp | fsdp
    pos: Pos | None = field(default=None, compare=False, repr=False)
    positions: tuple[tuple[str, Pos], ...] = field(default=(), compare=False, repr=False)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def pipelined(self) -> bool:
        """Whether the section cuts the model into pipeline chunks."""
        return self.chunks > 1

    @property
    def sharded(self) -> bool:
        """Whether each process runs a part of the model (pipeline chunks or FSDP units)."""
        return self.pipelined or self.data == "fsdp"

    def where(self, key: str) -> Pos | None:
        return _where(self.positions, key) or self.pos


@dataclass(frozen=True)
class Spec:
    """A checked spec. `model` and `parallel` may be None; `train` always has defaults.
    `resolved`: the residual section resolved over the model's sublayers, once, by the
    checking pass (None without a model); read it as `topology`."""

    residual: ResidualSpec
    model: ModelSpec | None = None
    train: TrainSpec = field(default_factory=TrainSpec)
    parallel: ParallelSpec | None = None
    text: str = ""
    path: str = "<string>"
    overrides: tuple[str, ...] = ()
    source: SourceText | None = field(default=None, compare=False, repr=False)
    resolved: Topology | None = field(default=None, compare=False, repr=False)
    # A spec read back from a checkpoint or an exported model: (how many of `overrides`
    # came recorded with it, the folder its run read a relative train.data from), so that
    # data is read from there whatever the current folder (spec.datapath.data_base)
    recorded: tuple[int, str] | None = field(default=None, compare=False, repr=False)

    def _need_model(self, what: str) -> ModelSpec:
        if self.model is None:
            pos = self.residual.pos or Pos(self.path, 1, 1)
            raise self._src().error(
                pos, f"{what} needs a model section; this spec only has a residual topology",
                "add e.g. 'model { vocab: 256; width: 64; depth: 4; heads: 4; context: 64 }', "
                "or use the spec to rewire an existing model (restopo.rewire)")
        return self.model

    def _src(self) -> SourceText:
        return self.source or SourceText({self.path: self.text})

    @property
    def topology(self) -> Topology:
        """The residual topology over the model's sublayers (SpecError without a model)."""
        self._need_model("the topology")
        return self.resolved

    def ir(self, width: int | None = None) -> "nx.DiGraph":
        """A fresh IR of this spec (a new graph each call; callers may annotate it)."""
        from ..ir.build import TopologyError, build_ir
        model = self._need_model("the IR")
        try:
            return build_ir(model.kinds, self.topology, width or model.width)
        except TopologyError as e:
            raise self._src().error(self.residual.pos or Pos(self.path, 1, 1), str(e)) from None

    def error(self, section: str, key: str | None, message: str,
              hint: str | None = None) -> SpecError:
        """A SpecError at `section.key` as written (for checks made by later stages)."""
        obj = {"model": self.model, "residual": self.residual, "train": self.train,
               "parallel": self.parallel}.get(section)
        pos = None
        if obj is not None:
            pos = obj.where(key) if key else obj.pos
        return self._src().error(pos or Pos(self.path, 1, 1), message, hint)
