"""A naive AttnRes loop over an ORIGINAL model's own modules, written from attnres.md.

It knows nothing of restopo's IR, lowering or ops: the model's pieces are taken by hand
(`nanogpt_pieces`, `llama_pieces`), the blocks are a plain list of sublayer indices, and
every aggregation is computed one at a time with its own float arithmetic.
"""
from __future__ import annotations

import torch

from restopo.nn.norm import NORM_EPS  # the key norm's epsilon is part of the definition


def rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def attend(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """sum_i alpha_i v_i, alpha = softmax_i(query . RMSNorm(v_i)); no scale, raw values."""
    logits = torch.stack([(rmsnorm(v, gain) * query).sum(-1) for v in sources])
    alpha = torch.softmax(logits, dim=0)
    return sum(a.unsqueeze(-1) * v for a, v in zip(alpha, sources))


def mean(sources: list[torch.Tensor], query=None, gain=None) -> torch.Tensor:
    return sum(sources) / len(sources)


def run(v0, sublayers, head, blocks, combine, queries=None, gains=None):
    """Block AttnRes by the definition (Full AttnRes when every block has one sublayer).

    blocks: lists of 1-based sublayer indices; combine(sources, query, gain) -> h;
    queries/gains: index l-1 for aggregation l = 1..L+1 (the head last).
    """
    L = len(sublayers)
    v = [v0]
    b = [v0]  # b_0 = v_0, never folded into block 1
    h = None
    for n, members in enumerate(blocks, start=1):
        for j, l in enumerate(members, start=1):
            sources = list(b)
            if j >= 2:
                sources.append(sum(v[i] for i in members[: j - 1]))  # pre-update partial
            q = None if queries is None else queries[l - 1]
            g = None if gains is None else gains[l - 1]
            h = combine(sources, q, g)
            v.append(sublayers[l - 1](h))
        b.append(sum(v[i] for i in members))
    q = None if queries is None else queries[L]
    g = None if gains is None else gains[L]
    return head(combine(b, q, g))


def full_blocks(L: int) -> list[list[int]]:
    return [[i] for i in range(1, L + 1)]


def layer_blocks(depth: int, n: int) -> list[list[int]]:
    """n contiguous groups of whole layers, as even as possible, larger groups first."""
    q, r = divmod(depth, n)
    out, layer = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)
        out.append([i for t in range(layer, layer + size) for i in (2 * t + 1, 2 * t + 2)])
        layer += size
    return out


def nanogpt_pieces(model, idx):
    """v_0, the sublayers f_l(h) = attn(ln_1(h)) / mlp(ln_2(h)), and the full-logits head."""
    tr = model.transformer
    pos = torch.arange(idx.shape[1])
    v0 = tr.drop(tr.wte(idx) + tr.wpe(pos))
    subs = []
    for blk in tr.h:
        subs.append(lambda h, blk=blk: blk.attn(blk.ln_1(h)))
        subs.append(lambda h, blk=blk: blk.mlp(blk.ln_2(h)))
    return v0, subs, lambda h: model.lm_head(tr.ln_f(h))


def llama_pieces(model, idx):
    """The same for a Hugging Face Llama: rotary cos/sin from the model's own module, an
    additive causal mask written here (no padding)."""
    base = model.model
    v0 = base.embed_tokens(idx)
    T = idx.shape[1]
    cos, sin = base.rotary_emb(v0, torch.arange(T).unsqueeze(0))
    mask = torch.full((T, T), float("-inf"), dtype=v0.dtype).triu(1)[None, None]
    subs = []
    for layer in base.layers:
        subs.append(lambda h, ly=layer: ly.self_attn(
            hidden_states=ly.input_layernorm(h), attention_mask=mask,
            position_embeddings=(cos, sin))[0])
        subs.append(lambda h, ly=layer: ly.mlp(ly.post_attention_layernorm(h)))
    return v0, subs, lambda h: model.lm_head(base.norm(h))
