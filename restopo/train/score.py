"""A model's loss over whole token sequences: every position predicted once.

Each sequence (Corpus.parts: train.bin and val.bin are two) is scored apart, no window
running from one into the next: its tokens are cut into consecutive windows of `context + 1`
that overlap by one token (each window's inputs end where the next one's begin), so each
token after its first is a target exactly once, with as much preceding text as the window
gives it. The loss is the mean negative log-likelihood in nats per token; bits per byte is
loss / ln 2 for a byte-level corpus (one token is one byte), perplexity exp(loss).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def windows(n_tokens: int, context: int) -> list[tuple[int, int]]:
    """(start, end) of each window: inputs tokens[start:end-1], targets tokens[start+1:end]."""
    return [(s, min(s + context + 1, n_tokens)) for s in range(0, max(n_tokens - 1, 0), context)]


def scored_tokens(parts: list[np.ndarray]) -> int:
    """How many tokens of `parts` score predicts: each but the first of each sequence."""
    return sum(max(len(t) - 1, 0) for t in parts)


@torch.no_grad()
def score(model, parts: list[np.ndarray], context: int, batch: int = 16, *,
          device: str | torch.device = "cpu", progress: bool = True) -> dict:
    """{"loss", "bits_per_token", "perplexity", "tokens"} of `model` over all of each token
    sequence in `parts`, none of its windows crossing from one sequence into another."""
    from tqdm import tqdm

    n_targets = scored_tokens(parts)
    if not n_targets:
        raise ValueError(f"need at least 2 tokens to score; got {max(map(len, parts))}")
    spans = [(t, s, e) for t in parts for s, e in windows(len(t), context)]
    full = [w for w in spans if w[2] - w[1] == context + 1]
    rest = [w for w in spans if w[2] - w[1] != context + 1]  # each part's shorter tail
    total, count = 0.0, 0
    model.eval()
    with tqdm(total=n_targets, unit="tok", unit_scale=True, disable=not progress,
              desc="eval", file=None) as bar:
        for k in range(0, len(full), batch):
            chunk = full[k:k + batch]
            rows = np.stack([np.asarray(t[s:e], dtype=np.int64) for t, s, e in chunk])
            total_b, count_b = _nll(model, torch.from_numpy(rows).to(device))
            total, count = total + total_b, count + count_b
            bar.update(count_b)
        for t, s, e in rest:
            row = np.asarray(t[s:e], dtype=np.int64)[None]
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
