"""restopo's own transformer, as `Parts` for the lowering."""
from __future__ import annotations

import math

from torch import nn

from .init import Init
from .parts import Parts
from ..topology import sublayer_kinds
from .sublayers import MLP, Attention, Head, Rotary, TokenEmbedding


def model_kinds(model) -> tuple[str, ...]:
    """The sublayer kinds of a model spec (its `.kinds`, or depth x layer)."""
    kinds = getattr(model, "kinds", None)
    if kinds is not None:
        return tuple(kinds)
    return sublayer_kinds(model.depth, tuple(getattr(model, "layer", ("attn", "mlp"))))


def build_parts(model, init: Init | None = None) -> Parts:
    """Embedding, sublayers, head and rotary context for a model spec.

    `model` is a `restopo.spec` ModelSpec (or anything with vocab, width, depth, heads, mlp,
    mlp_ratio, context and optionally layer, tie_embeddings). Init: normal(0, 0.02), output
    projections (attention proj, MLP down) scaled by 1/sqrt(2 * depth) as in GPT-2, norm
    gains 1. With tie_embeddings the LM head shares the embedding matrix.

    Without `init` the weights come from torch's global generator, in order; with an `Init`
    each unit (embed, sublayers.{i}, head) is drawn from its own seeded generator, or built
    on the meta device (restopo.nn.init).
    """
    d, kinds = model.width, model_kinds(model)
    if d % model.heads:
        raise ValueError(f"heads must divide the width: width {d}, heads {model.heads}")
    std, out_std = 0.02, 0.02 / math.sqrt(2 * max(1, model.depth))
    tie = getattr(model, "tie_embeddings", True)

    def embedding():
        return _initialised(TokenEmbedding(model.vocab, d), std, out_std)

    def sublayer(k):
        return _initialised(Attention(d, model.heads) if k == "attn"
                            else MLP(d, model.mlp, float(model.mlp_ratio)), std, out_std)

    def head_():
        return _initialised(Head(d, model.vocab), std, out_std)

    if init is None:
        embed = TokenEmbedding(model.vocab, d)
        subs = nn.ModuleList(
            Attention(d, model.heads) if k == "attn"
            else MLP(d, model.mlp, float(model.mlp_ratio)) for k in kinds)
        head = Head(d, model.vocab)
        for m in [embed, *subs, head]:
            _initialised(m, std, out_std)
    else:
        embed = init.unit("embed", embedding)
        subs = nn.ModuleList(init.unit(f"sublayers.{i}", lambda k=k: sublayer(k))
                             for i, k in enumerate(kinds))
        head = init.unit("head", head_)
        if tie:
            init.tie("head.lm_head.weight", "embed.weight")
    if tie:
        head.lm_head.weight = embed.weight
    return Parts(embed=embed, sublayers=subs, kinds=kinds, head=head,
                 context=Rotary(d // model.heads, model.context),
                 context_names=("cos", "sin"))


def _initialised(m: nn.Module, std: float, out_std: float) -> nn.Module:
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            continue
        out = name in ("proj.weight", "down.weight")
        nn.init.normal_(p, 0.0, out_std if out else std)
    return m
