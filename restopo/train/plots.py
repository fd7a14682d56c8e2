"""PNG figures (matplotlib, Agg): the loss curves of a run and the diagnose pictures.

Every figure is written atomically (restopo.io), so a reader never sees half a PNG.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..io import write_atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                   bbox_inches="tight"))
    finally:
        _pyplot().close(fig)
    return path


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl (a torn last line from a crash, or any line that is
    not a record with a whole-number step, is skipped)."""
    out = []
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and type(rec.get("step")) is int:
            out.append(rec)
    return out


def plot_losses(records: list[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Training and validation loss against step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.6, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    return _save(fig, path)


def plot_depth_lines(series: dict[str, list[float]], path: str | os.PathLike, *, ylabel: str,
                     title: str, xlabels: list[str] | None = None, log: bool = False) -> Path:
    """One line per named series over the sublayers (x = sublayer index 1..L)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * max(len(v) for v in series.values())), 4.2))
    for name, values in series.items():
        ax.plot(range(1, len(values) + 1), values, "o-", label=name, ms=4)
    if xlabels:
        ax.set_xticks(range(1, len(xlabels) + 1), xlabels, rotation=90, fontsize=7)
    ax.set_xlabel("sublayer")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_depth_weights(matrix, path: str | os.PathLike, *, rows: list[str],
                       cols: list[str], title: str) -> Path:
    """matrix[row][col]: the mean weight of source `row` at aggregation point `col`, NaN where
    the point does not read the source (left blank).

    Colour is the weight relative to the mean weight of that point's sources, on a log2
    scale centred on 1 (white: as in a plain mean or sum; red: above; blue: below), so the
    structure stays visible at 32+ sublayers, where a softmax's weights are all near 1/n and
    a linear 0-1 scale is one dark colour. Small maps print every weight in its cell; large
    ones print each point's largest weight, and mark it."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    m = np.asarray(matrix, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        col_mean = np.nanmean(np.where(np.isfinite(m), m, np.nan), axis=0)
        ratio = np.log2(np.clip(m / col_mean, 1 / 64, 64))
    cells = np.isfinite(ratio)
    span = max(1.0, float(np.nanmax(np.abs(ratio[cells]))) if cells.any() else 1.0)
    fig, ax = plt.subplots(figsize=(max(5, 0.3 * len(cols) + 3), max(4, 0.26 * len(rows) + 2)))
    im = ax.imshow(np.ma.masked_invalid(ratio), aspect="auto", cmap="RdBu_r",
                   norm=TwoSlopeNorm(0.0, -span, span), origin="upper", interpolation="nearest")
    small = m.size <= 300
    for c in range(m.shape[1]):
        column = m[:, c]
        if not np.isfinite(column).any():
            continue
        top = int(np.nanargmax(column))
        for r in (range(m.shape[0]) if small else (top,)):
            if np.isfinite(m[r, c]):
                ax.text(c, r, f"{m[r, c]:.2f}", ha="center", va="center",
                        fontsize=6 if small else 4.5,
                        color="white" if abs(ratio[r, c]) > 0.6 * span else "black")
        if not small:
            ax.add_patch(plt.Rectangle((c - 0.5, top - 0.5), 1, 1, fill=False, lw=0.6,
                                       ec="black"))
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=6 if len(cols) > 24 else 7)
    ax.set_yticks(range(len(rows)), rows, fontsize=6 if len(rows) > 24 else 7)
    ax.set_xlabel("aggregation point (before sublayer l; head last)")
    ax.set_ylabel("source")
    ax.set_title(title + ("" if small else "\nboxed: each point's largest weight (value printed)"),
                 fontsize=9)
    bar = fig.colorbar(im, ax=ax, label="weight / the point's mean weight")
    ticks = [t for t in range(-int(span), int(span) + 1)]
    bar.set_ticks(ticks, labels=[f"x{2 ** t:g}" if t >= 0 else f"x1/{2 ** -t:g}" for t in ticks])
    return _save(fig, path)


def plot_stream_coefficients(coefficients: list[dict], path: str | os.PathLike, *,
                             xlabels: list[str], title: str) -> Path:
    """Multi-stream coefficients per sublayer (mean over tokens): H^pre and H^post as
    streams x sublayers maps, and each sublayer's n x n H^res side by side (row i, column j:
    the weight of stream j in the new stream i)."""
    import numpy as np

    plt = _pyplot()
    pre = np.asarray([c["pre"] for c in coefficients], dtype=float).T    # [n, L]
    post = np.asarray([c["post"] for c in coefficients], dtype=float).T
    n, L = pre.shape
    res = np.full((n, L * (n + 1) - 1), np.nan)  # the L matrices, a blank column between
    for l, c in enumerate(coefficients):
        res[:, l * (n + 1):l * (n + 1) + n] = np.asarray(c["res"], dtype=float)
    width = max(7.0, 0.3 * L * (n + 1) / 2 + 2)
    fig, axes = plt.subplots(3, 1, figsize=(width, 2.2 + 1.2 * n),
                             gridspec_kw={"height_ratios": [1, 1, 1.2]})
    for ax, m, name in ((axes[0], pre, "H^pre (read weight of stream i)"),
                        (axes[1], post, "H^post (write weight into stream i)")):
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        ax.set_xticks(range(L), xlabels, rotation=90, fontsize=6)
        ax.set_yticks(range(n), [f"stream {i}" for i in range(n)], fontsize=7)
        ax.set_title(name, fontsize=8)
        fig.colorbar(im, ax=ax)
    im = axes[2].imshow(np.ma.masked_invalid(res), aspect="auto", cmap="viridis")
    axes[2].set_xticks([l * (n + 1) + (n - 1) / 2 for l in range(L)], xlabels, rotation=90,
                       fontsize=6)
    axes[2].set_yticks(range(n), [f"to {i}" for i in range(n)], fontsize=7)
    axes[2].set_title("H^res per sublayer (row: new stream, column: old stream)", fontsize=8)
    axes[2].set_xlabel("sublayer")
    fig.colorbar(im, ax=axes[2])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)
