"""Sizes of the reference sublayers, without torch: restopo.nn reads them (its MLP,
its FLOPs), restopo.spec (the parameter bound) and `restopo inspect`, which prints FLOPs
and parameters without importing torch."""
from __future__ import annotations

import math


def swiglu_hidden(d: int, ratio: float) -> int:
    """SwiGLU has three matrices, so its hidden size is 2/3 of ratio*d (the same parameter
    count as a two-matrix MLP of ratio*d), rounded up to a multiple of 8."""
    return 8 * math.ceil(2 * ratio * d / 3 / 8)


def mlp_hidden(d: int, kind: str, ratio: float) -> int:
    """The hidden width of restopo.nn.sublayers.MLP: SwiGLU's, or GELU's ratio x d."""
    return swiglu_hidden(d, ratio) if kind == "swiglu" else int(round(ratio * d))


def sublayer_parameters(kind: str, d: int, mlp: str = "swiglu", mlp_ratio: float = 4.0) -> int:
    """One reference sublayer's parameters with its PreNorm gain (d): attention's qkv and
    output projections (4d^2), an MLP's two (GELU) or three (SwiGLU) matrices."""
    if kind == "attn":
        return 4 * d * d + d
    return (3 if mlp == "swiglu" else 2) * d * mlp_hidden(d, mlp, mlp_ratio) + d


def model_parameters(model) -> tuple[int, int]:
    """(non-embedding, embedding) parameters of the reference model of a ModelSpec, the
    topology's own left out: the sublayers and the final norm; the vocab x width tables,
    one when the LM head is tied to the embedding, else two."""
    d = model.width
    attn = sum(k == "attn" for k in model.kinds)
    body = (attn * sublayer_parameters("attn", d) + d + (len(model.kinds) - attn)
            * sublayer_parameters("mlp", d, model.mlp, float(model.mlp_ratio)))
    return body, model.vocab * d * (1 if model.tie_embeddings else 2)
