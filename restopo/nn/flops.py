"""Floating-point operations per token of restopo's reference model, read off the IR.

Counted as 2 per multiply-add, forward pass; a training step costs about three forward
passes (forward, and backward's two matmuls per forward one). Sublayers are restopo's
reference ones (restopo.nn.sublayers); the residual topology's own work is counted per
aggregation point from the IR, so topologies compare by what they add.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import IR, Aggregation, BlockSum, Partial, stream_fed
from ..topology import DEFAULT_SINKHORN, STREAM_METHODS
from ..sizes import mlp_hidden

TRAIN_PER_FORWARD = 3


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs per token, by part."""

    sublayers: float
    head: float
    aggregations: float

    @property
    def forward(self) -> float:
        return self.sublayers + self.head + self.aggregations

    @property
    def train(self) -> float:
        return TRAIN_PER_FORWARD * self.forward


def sublayer_flops(kind: str, d: int, context: int, mlp: str = "swiglu",
                   mlp_ratio: float = 4.0) -> float:
    """One sublayer, per token: attention's projections and (causal, averaged over the
    positions of a full context) scores and values; an MLP's matrices. Norms are linear in
    d and left out next to these."""
    if kind == "attn":
        return 2 * 4 * d * d + 2 * d * (context + 1)
    return 2 * (3 if mlp == "swiglu" else 2) * d * mlp_hidden(d, mlp, mlp_ratio)


def aggregation_flops(g: IR, d: int) -> float:
    """The topology's own arithmetic per token: every aggregation point, and the running
    block and partial sums it reads."""
    return float(sum(point_flops(g, a, d) for a in g.aggregations())
                 + sum(running_sum_flops(g, d).values()))


def point_flops(g: IR, a: Aggregation, d: int) -> float:
    """One aggregation point's arithmetic per token (the running sums it reads aside)."""
    n = len(a.sources)
    if a.multi_stream:
        return stream_flops(a, d)
    if a.method == "attend":
        return n * attend_flops_per_source(a.key_norm, d) + (
            2 * d * d if a.query == "input_dependent" else 0)
    if a.method == "scalars":
        return 2 * n * d
    if a.method == "sum":  # fed by the running value: one add; else summed as written
        return (d if a.index > 1 else 0) if stream_fed(g, a) else (n - 1) * d
    if a.method in STREAM_METHODS and a.index > 1:
        return {"rezero": 2 * d, "layerscale": 2 * d, "highway": 2 * d * d + 5 * d}[a.method]
    return 0


def running_sum_flops(g: IR, d: int) -> dict[int, float]:
    """Sublayer i -> the add that puts its output into its block's running sum (d), for
    the members up to the longest sum any point reads: built once per block."""
    longest: dict[int, int] = {}
    for a in g.aggregations():
        for s in a.sources:
            v = g.node(s)
            if isinstance(v, (BlockSum, Partial)):
                n = v.index if isinstance(v, BlockSum) else v.block
                longest[n] = max(longest.get(n, 0), len(v.members))
    return {i: d for n, k in longest.items() for i in g.blocks[n - 1][1:k]}


def attend_flops_per_source(key_norm: str, d: int) -> float:
    """Depth attention's work per source read: the logit (w * gain) . v_i (2d; the key
    norm's gain folds into the query), with a key norm the mean square its 1/RMS scales the
    logit by (2d), and the weighted sum (2d)."""
    return (6 if key_norm == "rms" else 4) * d


def stream_flops(a: Aggregation, d: int) -> float:
    """A multi-stream point (restopo.nn.streams), n streams: the read sum_i pre_i X_i, the
    write R X + post (x) v, the coefficients' matrices (DHC's [d, n+2] per stream, mHC's
    [n d, 2n + n^2] and mHC-lite's [n d, 2n + n!]) and mHC's Sinkhorn iterations; the head
    sums the streams. Norms, linear in d, are left out as the sublayers' are."""
    n = a.streams
    if a.is_head:
        return (n - 1) * d
    total = 2 * n * d + 2 * n * n * d + 2 * n * d  # read; R X; post (x) v added
    if a.method == "hyper_connections":
        return total + (2 * n * d * (n + 2) if a.dynamic else 0)
    k = n * n if a.method == "mhc" else math.factorial(n)
    total += 2 * n * d * (2 * n + k)
    return total + (sinkhorn_flops(n, a.sinkhorn or DEFAULT_SINKHORN) if a.method == "mhc"
                    else 0)


def sinkhorn_flops(n: int, iters: int) -> float:
    """restopo.nn.streams.sinkhorn on one token's n x n logits: a row softmax (n exp, n - 1
    adds and n divisions a row) and + eps, then 2 iters - 1 normalisations, each n sums of
    n numbers, n + eps and n^2 divisions. Free of d, but at mHC's 20 iterations about as
    much as a [n d, n] matrix at d = 40 (n = 4)."""
    return n * (3 * n - 1) + n * n + (2 * iters - 1) * (n * (n - 1) + n + n * n)


def flops_per_token(g: IR, model) -> Flops:
    """`model`: a ModelSpec (width, context, vocab, mlp, mlp_ratio) of the IR's sublayers."""
    d = model.width
    subs = sum(sublayer_flops(k, d, model.context, model.mlp, float(model.mlp_ratio))
               for k in g.kinds)
    return Flops(subs, head_flops(model), aggregation_flops(g, d))


def head_flops(model) -> float:
    """The LM head's matrix, per token."""
    return 2 * model.width * model.vocab
