"""A model's loss over a whole token sequence: every position predicted once.

The tokens are cut into consecutive windows of `context + 1` that overlap by one token
(each window's inputs end where the next one's begin), so each token after the first is a
target exactly once, with as much preceding text as the window gives it. The loss is the
mean negative log-likelihood in nats per token; bits per byte is loss / ln 2 for a
byte-level corpus (one token is one byte), perplexity exp(loss).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def windows(n_tokens: int, context: int) -> list[tuple[int, int]]:
    """(start, end) of each window: inputs tokens[start:end-1], targets tokens[start+1:end]."""
    return [(s, min(s + context + 1, n_tokens)) for s in range(0, max(n_tokens - 1, 0), context)]


@torch.no_grad()
def score(model, tokens: np.ndarray, context: int, batch: int = 16, *,
          device: str | torch.device = "cpu", progress: bool = True) -> dict:
    """{"loss", "bits_per_token", "perplexity", "tokens"} of `model` over all of `tokens`."""
    from tqdm import tqdm

    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens to score; got {len(tokens)}")
    spans = windows(len(tokens), context)
    full = [s for s in spans if s[1] - s[0] == context + 1]
    rest = [s for s in spans if s[1] - s[0] != context + 1]  # the tail: one shorter window
    total, count = 0.0, 0
    model.eval()
    with tqdm(total=len(tokens) - 1, unit="tok", unit_scale=True, disable=not progress,
              desc="eval", file=None) as bar:
        for k in range(0, len(full), batch):
            chunk = full[k:k + batch]
            rows = np.stack([np.asarray(tokens[s:e], dtype=np.int64) for s, e in chunk])
            total_b, count_b = _nll(model, torch.from_numpy(rows).to(device))
            total, count = total + total_b, count + count_b
            bar.update(count_b)
        for s, e in rest:
            row = np.asarray(tokens[s:e], dtype=np.int64)[None]
            total_b, count_b = _nll(model, torch.from_numpy(row).to(device))
            total, count = total + total_b, count + count_b
            bar.update(count_b)
    loss = total / count
    return {"loss": loss, "bits_per_token": loss / math.log(2), "perplexity": math.exp(loss),
            "tokens": count}


def _nll(model, rows: torch.Tensor) -> tuple[float, int]:
    logits = model(rows[:, :-1])
    targets = rows[:, 1:]
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    return nll.item(), targets.numel()
