"""The resolved residual topology: what the language hands to the IR builder.

Pure data (no torch, no lark). The named one-liners (`standard`, `full_attnres`,
`block_attnres(...)`, ...) and spelled-out custom wiring both resolve to a `Topology`;
equal Topologies build equal IRs, which is how a test shows that a one-liner and its
wiring mean the same thing.

Counts are in sublayers (an attention or an MLP), never transformer layers; sublayers are
numbered 1..L, the embedding is source 0 and the head is aggregation point L + 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SUBLAYER_KINDS = ("attn", "mlp")

# Source selectors an aggregation rule may read (see `Source`).
SOURCE_NAMES = ("embedding", "sublayers", "window", "blocks", "partial")

# How an aggregation combines its sources.
#   attend      softmax (or sigmoid) depth attention with a pseudo-query (AttnRes)
#   sum         weight one on every source (the standard residual when it reads everything)
#   scalars     a learned static scalar per (aggregation, source): gate none (DenseFormer,
#               raw weights, init 1) or softmax/sigmoid over the scalars (init 0; the AttnRes
#               ablation "Full with static per-source scalars")
#   rezero      stream update h += alpha * v, alpha a learned scalar, init 0
#   layerscale  stream update h += gamma * v, gamma a learned per-channel vector
#   highway     stream update h += g * (v - h), g = sigmoid(W norm(h) + b), an input gate
#   hyper_connections, mhc, mhc_lite   multi-stream residuals (see MULTI_STREAM_METHODS)
METHODS = ("attend", "sum", "scalars", "rezero", "layerscale", "highway",
           "hyper_connections", "mhc", "mhc_lite")
# Methods that update one running stream: their sources are always the embedding and
# every earlier sublayer, and they keep a single live value per token.
STREAM_METHODS = ("rezero", "layerscale", "highway")
# Multi-stream residuals (../shared/hyper.md): each token carries n streams of width d,
# X in R^{n x d}, starting as n copies of the embedding. Before sublayer l the streams are
# read into its input, h_l = sum_i pre_i X_i; after it they are written,
# X <- R X + post (x) v_l; the head reads the sum of the streams. They read no sources.
#   hyper_connections  Hyper-Connections, static (SHC) or dynamic (DHC, `dynamic: true`)
#   mhc                manifold-constrained HC: R is projected by `sinkhorn` Sinkhorn-Knopp
#                      iterations onto the doubly stochastic matrices
#   mhc_lite           mHC with R a softmax mixture of all n! permutation matrices
MULTI_STREAM_METHODS = ("hyper_connections", "mhc", "mhc_lite")
MAX_STREAMS = 16         # papers use 1..8; the parameters grow as n^3 d (mHC)
MAX_LITE_STREAMS = 6     # mhc_lite's H^res mixes n! permutation matrices: 720 at n = 6
DEFAULT_SINKHORN = 20    # mHC's t_max [mHC Eq.9]
MAX_SINKHORN = 1000      # 50x mHC's: every forward runs all the iterations of every
                         # sublayer, and the backward keeps two [tokens, n, n] tensors each

QUERY_KINDS = ("static", "input_dependent")
GATES = ("softmax", "sigmoid")                  # attend
SCALAR_GATES = ("none", "softmax", "sigmoid")   # scalars; none: DenseFormer's raw weights
KEY_NORMS = ("rms", "none")


@dataclass(frozen=True)
class Source:
    """One source selector of a rule.

    embedding  v_0 = b_0, the token embedding (always its own source)
    sublayers  every earlier sublayer output v_1 .. v_{l-1}
    window     the last `window` earlier sublayer outputs
    blocks     the completed blocks b_1 .. b_{n-1} (at the head: every block b_1 .. b_N)
    partial    p_n^j, the sum of the current block's outputs so far (absent when empty:
               for the first sublayer of a block and at the head)
    """

    name: str
    window: int | None = None

    def __str__(self) -> str:
        return f"window({self.window})" if self.name == "window" else self.name


def default_gate(method: str) -> str:
    """The gate a rule gets when none is given: DenseFormer's raw scalars for `scalars`,
    the softmax of AttnRes otherwise (methods other than attend and scalars ignore it)."""
    return "none" if method == "scalars" else "softmax"


def gates_of(method: str) -> tuple[str, ...]:
    """The gates `method` accepts (empty: the method takes no gate)."""
    return {"attend": GATES, "scalars": SCALAR_GATES}.get(method, ())


@dataclass(frozen=True)
class Rule:
    """What one kind of aggregation point reads and how it weighs it.

    `gate=None` means the method's default (`default_gate`), so `Rule("scalars", ...)` is
    DenseFormer and equals `Rule("scalars", ..., gate="none")`.
    """

    method: str
    sources: tuple[Source, ...]
    query: str = "static"
    gate: str | None = None
    key_norm: str = "rms"
    heads: int = 1
    streams: int = 1                 # n, multi-stream methods only
    dynamic: bool = False            # hyper_connections: DHC instead of SHC
    sinkhorn: int | None = None      # mhc: Sinkhorn-Knopp iterations (None: the default)

    def __post_init__(self):
        if self.gate is None:
            object.__setattr__(self, "gate", default_gate(self.method))
        allowed = gates_of(self.method)
        if allowed and self.gate not in allowed:
            raise ValueError(f"{self.method} takes gate {' | '.join(allowed)}; "
                             f"got {self.gate!r}")
        if self.method == "mhc" and self.sinkhorn is None:
            object.__setattr__(self, "sinkhorn", DEFAULT_SINKHORN)
        check_streams(self.method, self.streams, self.sinkhorn)
        if self.multi_stream and self.sources:
            raise ValueError(f"{self.method} reads the residual streams, not sources")

    @property
    def multi_stream(self) -> bool:
        return self.method in MULTI_STREAM_METHODS


def check_streams(method: str, streams: int, sinkhorn: int | None = None) -> None:
    """ValueError (saying why) for a stream count or Sinkhorn count `method` cannot take."""
    if method not in MULTI_STREAM_METHODS:
        if streams != 1:
            raise ValueError(f"{method} keeps one residual stream; streams applies to "
                             f"{', '.join(MULTI_STREAM_METHODS)}")
        return
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be between 1 and {MAX_STREAMS}; got {streams}")
    if method == "mhc_lite" and streams > MAX_LITE_STREAMS:
        raise ValueError(f"mhc_lite mixes all n! permutation matrices, {math.factorial(streams):,} "
                         f"per sublayer at streams: {streams}; it allows at most "
                         f"{MAX_LITE_STREAMS} streams")
    if sinkhorn is not None and not 1 <= sinkhorn <= MAX_SINKHORN:
        raise ValueError(f"sinkhorn counts Sinkhorn-Knopp iterations and must be between 1 "
                         f"and {MAX_SINKHORN}; got {sinkhorn}")


@dataclass(frozen=True)
class Topology:
    """A residual topology over a fixed sequence of sublayers.

    `blocks` partitions 1..L into contiguous runs of sublayer indices; `sublayer_rule`
    applies before every sublayer and `head_rule` once more before the final norm.
    """

    name: str
    blocks: tuple[tuple[int, ...], ...]
    sublayer_rule: Rule
    head_rule: Rule


STANDARD_SOURCES = (Source("embedding"), Source("sublayers"))
BLOCK_SOURCES = (Source("embedding"), Source("blocks"), Source("partial"))


def keeps_one_stream(rule: Rule) -> bool:
    """True for a rule that is one running value: a single-stream method, or the plain sum
    of the embedding and every earlier output (the standard residual)."""
    return rule.method in STREAM_METHODS or (
        rule.method == "sum" and set(rule.sources) == set(STANDARD_SOURCES))


def sublayer_kinds(depth: int, layer: tuple[str, ...] = ("attn", "mlp")) -> tuple[str, ...]:
    """The sublayer sequence of `depth` transformer layers, each `layer` (attention first)."""
    return tuple(layer) * depth


def layer_starts(kinds: tuple[str, ...]) -> list[int]:
    """1-based indices of the sublayers that open a transformer layer (each attention)."""
    return [i for i, k in enumerate(kinds, start=1) if k == "attn"]


def allowed_block_counts(kinds: tuple[str, ...]) -> list[int]:
    """Values `blocks: N` may take: 1..depth, and L (every sublayer its own block)."""
    depth = len(layer_starts(kinds))
    counts = list(range(1, depth + 1))
    if len(kinds) not in counts:
        counts.append(len(kinds))
    return counts


def partition_by_count(kinds: tuple[str, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """Split the sublayers into `n` blocks of whole transformer layers.

    Layers are grouped as evenly as possible, larger groups first; n == L makes every
    sublayer its own block (Full AttnRes). Raises ValueError naming the allowed values.
    """
    L = len(kinds)
    allowed = allowed_block_counts(kinds)
    if n not in allowed:
        depth = len(layer_starts(kinds))
        raise ValueError(
            f"blocks must be between 1 and {depth} (the number of transformer layers), "
            f"or {L} (one block per sublayer, Full AttnRes); got {n}"
        )
    if n == L:
        return tuple((i,) for i in range(1, L + 1))
    layers = _layers(kinds)
    q, r = divmod(len(layers), n)
    out, at = [], 0
    for g in range(n):
        size = q + (1 if g < r else 0)
        out.append(tuple(i for layer in layers[at : at + size] for i in layer))
        at += size
    return tuple(out)


def partition_by_size(kinds: tuple[str, ...], size: int) -> tuple[tuple[int, ...], ...]:
    """Split the sublayers into blocks of `size` sublayers, the last one shorter if need be.

    Every boundary must fall just before an attention sublayer. Raises ValueError.
    """
    L = len(kinds)
    if size < 1:
        raise ValueError(f"block_size must be at least 1 sublayer; got {size}")
    if size > L:
        raise ValueError(f"block_size must be at most {L} (the number of sublayers); got {size}")
    bounds = list(range(1, L + 1, size))
    if size not in allowed_block_sizes(kinds):
        starts = set(layer_starts(kinds))
        bad = next(b for b in bounds if b not in starts)
        raise ValueError(
            f"block_size {size} would begin a block at sublayer {bad}, an {kinds[bad - 1]}; "
            f"blocks must begin at an attention sublayer (block_size counts sublayers)")
    return tuple(tuple(range(b, min(b + size, L + 1))) for b in bounds)


def allowed_block_sizes(kinds: tuple[str, ...]) -> list[int]:
    """Values `block_size: S` may take: 1 (every sublayer its own block), and each size
    whose blocks all begin at an attention sublayer (with one attention a layer, the
    multiples of the layer's length)."""
    starts = set(layer_starts(kinds))
    L = len(kinds)
    return [s for s in range(1, L + 1) if s == 1 or all(b in starts for b in range(1, L + 1, s))]


def _layers(kinds: tuple[str, ...]) -> list[tuple[int, ...]]:
    starts = layer_starts(kinds)
    if not starts or starts[0] != 1:
        raise ValueError("the sublayer pattern must begin with an attention sublayer")
    ends = starts[1:] + [len(kinds) + 1]
    return [tuple(range(s, e)) for s, e in zip(starts, ends)]


def standard(kinds: tuple[str, ...]) -> Topology:
    rule = Rule("sum", STANDARD_SOURCES)
    return Topology("standard", partition_by_count(kinds, 1), rule, rule)


def full_attnres(kinds: tuple[str, ...], window: int | None = None, **options) -> Topology:
    """Full AttnRes; with `window` each point reads the embedding and the last `window`
    sublayer outputs (the sliding-window ablation)."""
    sources = STANDARD_SOURCES if window is None else (Source("embedding"),
                                                        Source("window", window))
    rule = Rule("attend", sources, **options)
    return Topology("full_attnres", tuple((i,) for i in range(1, len(kinds) + 1)), rule, rule)


def block_attnres(kinds: tuple[str, ...], blocks: int | None = None,
                  block_size: int | None = None, **options) -> Topology:
    if (blocks is None) == (block_size is None):
        raise ValueError("give exactly one of blocks or block_size")
    part = (partition_by_count(kinds, blocks) if blocks is not None
            else partition_by_size(kinds, block_size))
    rule = Rule("attend", BLOCK_SOURCES, **options)
    head = Rule("attend", (Source("embedding"), Source("blocks")), **options)
    return Topology("block_attnres", part, rule, head)


def _single_stream(name: str, method: str, kinds: tuple[str, ...]) -> Topology:
    rule = Rule(method, STANDARD_SOURCES)
    return Topology(name, partition_by_count(kinds, 1), rule, rule)


def rezero(kinds: tuple[str, ...]) -> Topology:
    """h += alpha * v with a learned scalar alpha (init 0) per sublayer."""
    return _single_stream("rezero", "rezero", kinds)


def layerscale(kinds: tuple[str, ...]) -> Topology:
    """h += gamma * v with a learned per-channel gamma per sublayer."""
    return _single_stream("layerscale", "layerscale", kinds)


def highway(kinds: tuple[str, ...]) -> Topology:
    """h += g * (v - h) with an input gate g per sublayer."""
    return _single_stream("highway", "highway", kinds)


def denseformer(kinds: tuple[str, ...], gate: str = "none") -> Topology:
    """Static learned scalar weights over the embedding and every earlier sublayer output.

    gate "none": DenseFormer, h_l = sum_i a_i v_i with a init 1 (the standard residual at
    step 0). gate "softmax": the AttnRes ablation "Full with static per-source scalars",
    alpha = softmax(a) with a init 0 (the plain mean at step 0, like Full AttnRes); gate
    "sigmoid": alpha = sigmoid(a), a init 0.
    """
    rule = Rule("scalars", STANDARD_SOURCES, gate=gate)
    return Topology("denseformer", tuple((i,) for i in range(1, len(kinds) + 1)), rule, rule)


def _multi_stream(name: str, kinds: tuple[str, ...], **options) -> Topology:
    rule = Rule(name, (), **options)
    return Topology(name, partition_by_count(kinds, 1), rule, rule)


def hyper_connections(kinds: tuple[str, ...], streams: int, dynamic: bool = False) -> Topology:
    """Hyper-Connections over n = `streams` streams: static (SHC) or, with `dynamic`, DHC."""
    return _multi_stream("hyper_connections", kinds, streams=streams, dynamic=dynamic)


def mhc(kinds: tuple[str, ...], streams: int, sinkhorn: int = DEFAULT_SINKHORN) -> Topology:
    """mHC over n = `streams` streams, H^res from `sinkhorn` Sinkhorn-Knopp iterations."""
    return _multi_stream("mhc", kinds, streams=streams, sinkhorn=sinkhorn)


def mhc_lite(kinds: tuple[str, ...], streams: int) -> Topology:
    """mHC-lite over n = `streams` streams: H^res a mixture of the n! permutations."""
    return _multi_stream("mhc_lite", kinds, streams=streams)


# The named one-liners of the language, by name.
NAMED = {
    "standard": standard, "full_attnres": full_attnres, "block_attnres": block_attnres,
    "rezero": rezero, "layerscale": layerscale, "highway": highway, "denseformer": denseformer,
    "hyper_connections": hyper_connections, "mhc": mhc, "mhc_lite": mhc_lite,
}


def unread_sublayers(topology: Topology) -> list[int]:
    """The sublayers whose output reaches nothing the head reads, directly or through later
    sublayers (their weights would get no gradient), in O(L) without the IR. Multi-stream
    topologies carry every output in their streams: none."""
    if topology.sublayer_rule.multi_stream:
        return []
    L = sum(len(b) for b in topology.blocks)
    block_end = {i: members[-1] for members in topology.blocks for i in members}
    after = [0] * (L + 3)  # after[k]: live points among k..L (sublayers; the head apart)

    def read_by(rule: Rule, i: int, at_head: bool) -> bool:
        """Whether a live point reading by `rule` reads v_i (at the head: the head)."""
        for src in rule.sources:
            if src.name == "sublayers":
                if at_head or after[i + 1]:
                    return True
            elif src.name == "window":
                if at_head and i > L - src.window:
                    return True
                if not at_head and after[i + 1] - after[min(i + src.window, L) + 1]:
                    return True
            elif src.name == "blocks":  # the blocks after v_i's, or the head (all of them)
                if at_head or after[block_end[i] + 1]:
                    return True
            elif src.name == "partial" and not at_head:  # v_i's block, after it
                if after[i + 1] - after[block_end[i] + 1]:
                    return True
        return False

    dead = []
    for i in range(L, 0, -1):
        live = read_by(topology.head_rule, i, True) or read_by(topology.sublayer_rule, i, False)
        after[i] = after[i + 1] + live
        if not live:
            dead.append(i)
    return dead[::-1]
