"""ResidualSpec + sublayer kinds -> restopo.topology.Topology.

Named one-liners go through the constructors of restopo.topology (so a one-liner and the
same wiring spelled out build equal IRs); custom wiring builds its Topology from its rules.
The partition depends on the model's depth, so errors about `blocks` and `block_size` are
found here and point at the value that caused them. The checking pass resolves a spec
against its own model once (`Spec.topology`); rewiring resolves the residual section
against the sublayers of the model it rewires.
"""
from __future__ import annotations

from .. import topology as T
from .errors import SpecError
from .nodes import Pos
from .objects import ResidualSpec, SourceText
from ..words import alts, counted

ATTEND_OPTIONS = ("query", "gate", "key_norm", "heads")
SCALARS_OPTIONS = ("gate",)
# Multi-stream methods: the same options as a one-liner and as a rule.
STREAM_OPTIONS = {"hyper_connections": ("streams", "dynamic"), "mhc": ("streams", "sinkhorn"),
                  "mhc_lite": ("streams",)}
# The options each aggregation method takes (the others take none).
METHOD_OPTIONS = {"attend": ATTEND_OPTIONS, "scalars": SCALARS_OPTIONS, **STREAM_OPTIONS}
# The options each named topology takes as a one-liner.
NAMED_OPTIONS = {
    "standard": (), "rezero": (), "layerscale": (), "highway": (),
    "denseformer": SCALARS_OPTIONS,
    "full_attnres": ATTEND_OPTIONS + ("window",),
    "block_attnres": ("blocks", "block_size") + ATTEND_OPTIONS,
    **STREAM_OPTIONS,
}


def allowed_blocks_hint(kinds: tuple[str, ...]) -> str:
    allowed = T.allowed_block_counts(kinds)
    depth = len(T.layer_starts(kinds))
    listed = _span(allowed)
    return (f"for depth {depth} ({counted(len(kinds), 'sublayer')}) blocks may be {listed}; "
            f"{len(kinds)} gives one block per sublayer (Full AttnRes)")


def _span(values: list[int]) -> str:
    """'1, 2, 3 or 8' or '1 to 16, or 32'."""
    run = [v for i, v in enumerate(values) if v == values[0] + i]
    rest = values[len(run):]
    if len(run) <= 4:
        return alts(str(v) for v in values)
    return f"{run[0]} to {run[-1]}" + "".join(f", or {v}" for v in rest)


def block_size_hint(kinds: tuple[str, ...]) -> str:
    return (f"for {'these ' * (len(kinds) > 1)}{counted(len(kinds), 'sublayer')} "
            f"block_size may be "
            f"{_span(T.allowed_block_sizes(kinds))}")


def partition(res: ResidualSpec, kinds: tuple[str, ...], src: SourceText):
    """The blocks of a residual spec: by count, by size, else one block for a single
    running stream (its value is that block's running sum, as in `residual standard`,
    `rezero`, ...) and one per sublayer otherwise (as in Full AttnRes)."""
    try:
        if res.blocks is not None:
            return T.partition_by_count(kinds, res.blocks)
        if res.block_size is not None:
            return T.partition_by_size(kinds, res.block_size)
    except ValueError as e:
        raise _blocks_error(res, kinds, src, e) from None
    if T.keeps_one_stream(res.sublayer_rule):
        return T.partition_by_count(kinds, 1)
    return tuple((i,) for i in range(1, len(kinds) + 1))


def resolve_residual(res: ResidualSpec, kinds: tuple[str, ...]) -> T.Topology:
    """The Topology of a residual section over these sublayers (those of the spec's own
    model, or of a model being rewired); SpecError at the value that makes it impossible."""
    kinds = tuple(kinds)
    src = res.source or SourceText()
    try:
        T._layers(kinds)
    except ValueError as e:
        raise _err(src, res.pos, str(e), "a transformer layer begins with 'attn'") from None
    if res.form == "custom":
        blocks = (T.partition_by_count(kinds, 1) if res.sublayer_rule.multi_stream
                  else partition(res, kinds, src))
        return T.Topology(res.name, blocks, res.sublayer_rule, res.head_rule)
    if res.name in STREAM_OPTIONS:  # checked: streams, dynamic, sinkhorn
        return T.NAMED[res.name](kinds, **dict(res.options))
    options = {k: v for k, v in res.options if k in ATTEND_OPTIONS}
    if res.name == "block_attnres":
        if res.blocks is None and res.block_size is None:
            raise _err(src, res.pos, "block_attnres needs 'blocks: N' or 'block_size: S'",
                       allowed_blocks_hint(kinds))
        try:  # the options were checked, so only the partition can fail
            return T.block_attnres(kinds, blocks=res.blocks, block_size=res.block_size,
                                   **options)
        except ValueError as e:
            raise _blocks_error(res, kinds, src, e) from None
    if res.name == "full_attnres":
        return T.full_attnres(kinds, window=res.option("window"), **options)
    if res.name == "denseformer":
        return T.denseformer(kinds, **options)
    return T.NAMED[res.name](kinds)


def _blocks_error(res: ResidualSpec, kinds: tuple[str, ...], src: SourceText,
                  e: ValueError) -> SpecError:
    """A partition's ValueError, at the `blocks` or `block_size` value that caused it."""
    if res.blocks is not None:
        return _err(src, res.where("blocks"), str(e), allowed_blocks_hint(kinds))
    return _err(src, res.where("block_size"), str(e), block_size_hint(kinds))


def _err(src: SourceText, pos: Pos | None, message: str, hint: str | None) -> SpecError:
    return src.error(pos or Pos("<spec>", 1, 1), message, hint)
