"""Helpers the rewire tests share: setting a rewired model's AttnRes parameters, training it."""
from __future__ import annotations

import torch

import restopo


def randomise(rewired, seed=2):
    """Random non-zero pseudo-queries and key-norm gains; returns them by aggregation index."""
    g = torch.Generator().manual_seed(seed)
    queries, gains = [], []
    with torch.no_grad():
        for agg in restopo.aggregations(rewired):
            agg.pseudo_query.copy_(torch.randn(agg.pseudo_query.shape, generator=g,
                                               dtype=torch.float64))
            agg.key_norm.weight.copy_(1 + 0.3 * torch.randn(agg.key_norm.weight.shape,
                                                            generator=g, dtype=torch.float64))
            queries.append(agg.pseudo_query.detach().clone())
            gains.append(agg.key_norm.weight.detach().clone())
    return queries, gains


def hf_losses(model, idx, steps=15, lr=3e-3):
    """Losses of `steps` AdamW steps of a Hugging Face-style causal LM on one batch."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def gpt_losses(model, idx, targets, steps=15, lr=3e-3):
    """Losses of `steps` AdamW steps of a nanoGPT-style model, `(logits, loss) = model(idx,
    targets)`, on one batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
