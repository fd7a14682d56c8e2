"""A naive per-sublayer loop written straight from attnres.md, independent of the lowering.

It reads the wiring from the Topology (blocks and rules; not the IR), computes every
aggregation with its own float arithmetic (not restopo.ops), and borrows from the compiled
model only the modules that are not residual wiring (embed, context, sublayers, head) and the
values of the aggregation parameters (by aggregation index).
"""
from __future__ import annotations

import torch

from restopo.nn.norm import NORM_EPS as EPS  # the epsilon is part of the definition
from restopo.topology import Topology


def rms(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _sources(topology: Topology, l: int, L: int, v: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values aggregation l reads, by the definitions in attnres.md (l = L+1: the head)."""
    head = l == L + 1
    rule = topology.head_rule if head else topology.sublayer_rule
    blocks = topology.blocks
    n = len(blocks) + 1 if head else next(k for k, b in enumerate(blocks, 1) if l in b)
    out, seen = [], set()

    def put(key, value):
        if key not in seen:
            seen.add(key)
            out.append(value)

    for s in rule.sources:
        if s.name == "embedding":
            put(("v", 0), v[0])
        elif s.name == "sublayers":
            for i in range(1, l):
                put(("v", i), v[i])
        elif s.name == "window":
            for i in range(max(1, l - s.window), l):
                put(("v", i), v[i])
        elif s.name == "blocks":
            for m in range(1, n):
                members = blocks[m - 1]
                key = ("v", members[0]) if len(members) == 1 else ("b", m)
                put(key, sum(v[i] for i in members))
        elif s.name == "partial" and not head:
            earlier = [i for i in blocks[n - 1] if i < l]
            if earlier:
                put(("p", n, l), sum(v[i] for i in earlier))
    return out


def attend(srcs: list[torch.Tensor], agg, rule) -> torch.Tensor:
    """h = sum_i alpha_i v_i, alpha = softmax_i(w . RMSNorm(v_i)) per depth head."""
    d = srcs[0].shape[-1]
    w = agg.pseudo_query
    if rule.query == "input_dependent":
        w = w + rms(srcs[-1]) @ agg.query_proj.weight.T
    k = rule.heads
    logits = []
    for v in srcs:
        key = rms(v) * agg.key_norm.weight if rule.key_norm == "rms" else v
        logits.append((key * w).reshape(*v.shape[:-1], k, d // k).sum(-1))  # [*batch, k]
    z = torch.stack(logits)
    if rule.gate == "softmax":
        z = z - z.max(0).values
        alpha = z.exp() / z.exp().sum(0)
    else:
        alpha = 1 / (1 + torch.exp(-z))
    out = 0
    for a, v in zip(alpha, srcs):
        out = out + a.repeat_interleave(d // k, dim=-1) * v
    return out


def scalars(srcs: list[torch.Tensor], agg, rule) -> torch.Tensor:
    """h = sum_i alpha_i v_i over static per-source scalars a: alpha = a (gate none,
    DenseFormer), softmax_i(a) or sigmoid(a), written out one source at a time."""
    a = [agg.weights[i] for i in range(len(srcs))]
    if rule.gate == "softmax":
        top = max(a)
        e = [torch.exp(x - top) for x in a]
        total = sum(e)
        alpha = [x / total for x in e]
    elif rule.gate == "sigmoid":
        alpha = [1 / (1 + torch.exp(-x)) for x in a]
    else:
        alpha = a
    out = 0
    for w, v in zip(alpha, srcs):
        out = out + w * v
    return out


def forward(model, topology: Topology, idx: torch.Tensor) -> torch.Tensor:
    """Logits of `model`'s pieces wired as `topology`, one sublayer at a time."""
    L = len(model.sublayers)
    aggs = list(model.aggregations)
    v = [model.embed(idx)]
    ctx = tuple(model.context(idx, v[0])) if hasattr(model, "context") else ()
    h = None
    for l in range(1, L + 2):
        rule = topology.head_rule if l == L + 1 else topology.sublayer_rule
        agg = aggs[l - 1]
        if rule.method in ("rezero", "layerscale", "highway"):
            if l == 1:
                h = v[0]
            elif rule.method == "rezero":
                h = h + agg.alpha * v[l - 1]
            elif rule.method == "layerscale":
                h = h + agg.gamma * v[l - 1]
            else:
                gate = torch.sigmoid(rms(h) @ agg.gate.weight.T + agg.gate.bias)
                h = h + gate * (v[l - 1] - h)
        else:
            srcs = _sources(topology, l, L, v)
            if rule.method == "sum":
                h = sum(srcs)
            elif rule.method == "scalars":
                h = scalars(srcs, agg, rule)
            else:
                h = attend(srcs, agg, rule)
        if l <= L:
            v.append(model.sublayers[l - 1](h, *ctx))
    return model.head(h)
