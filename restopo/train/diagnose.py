"""Diagnostics from the paper, read off a trained checkpoint.

On a few validation batches, with hooks on the compiled model's `embed`, `sublayers` and
`head` (no change to the model), we capture every source v_0..v_L and every aggregation
result h_1..h_{L+1}, then one backward pass. From them:
  magnitude.png        RMS of each sublayer output v_l and of its input h_l across depth
                       (with a standard residual h grows with depth; AttnRes keeps it bounded)
  gradients.png        gradient norm of each sublayer's parameters, and RMS of dLoss/dv_l
  depth_attention.png  the weight of every source at every aggregation point, averaged over
                       tokens: recomputed from each aggregation's parameters (pseudo_query,
                       key_norm gain, scalars, gates) over its sources in IR order; for a
                       standard residual every weight is 1
  diagnose.json        the numbers behind the pictures

The weights are recomputed from the IR and the captured sources, not read out of the
aggregation modules, so the picture is the same for the direct and two-phase lowerings. As a
check, sum_i weight_i * v_i is compared with the captured h_l token by token
(`reconstruction_error` in diagnose.json; about 1e-6 in float32).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import load_checkpoint, resolve_checkpoint
from .plots import plot_depth_lines, plot_heatmap

EPS = 1e-6


def _rms(t: torch.Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


def _source_values(graph, v: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every IR value node -> its tensor, built from v_0..v_L (block and partial sums)."""
    vals = {"embedding": v[0]}
    for node, data in graph.nodes(data=True):
        kind = data.get("kind")
        if kind == "sublayer":
            vals[node] = v[data["index"]]
        elif kind in ("block", "partial"):
            vals[node] = torch.stack([v[i] for i in data["members"]]).sum(0)
    return vals


def _attend_weights(module, sources: torch.Tensor, key_norm: bool, gate: str,
                    heads: int) -> torch.Tensor:
    """[n, B, T, d]: the weight of each source per token (a head's weight on its channels)."""
    from ..backends.eager.depth import logits

    d = sources.shape[-1]
    query = module.pseudo_query
    if getattr(module, "query_proj", None) is not None:  # input-dependent query
        query = query + module.query_proj(F.rms_norm(sources[-1], (d,), eps=EPS))
    gain = module.key_norm.weight if getattr(module, "key_norm", None) is not None else None
    z = logits(sources, query, gain, EPS, key_norm, heads)
    alpha = torch.softmax(z, dim=0) if gate == "softmax" else torch.sigmoid(z)
    return alpha.repeat_interleave(d // heads, dim=-1)


def _scalar_weights(a: torch.Tensor, gate: str) -> torch.Tensor:
    """The weight of each source of a scalars aggregation from its raw scalars a and the
    IR's gate (none: DenseFormer's raw weights)."""
    if gate == "softmax":
        return torch.softmax(a, dim=0)
    if gate == "sigmoid":
        return torch.sigmoid(a)
    if gate == "none":
        return a
    raise ValueError(f"diagnose does not know the scalars gate {gate!r}")


def _stream_coefficients(module, h_prev: torch.Tensor):
    """(a, b) with h_l = a * h_{l-1} + b * v_{l-1} for the single-stream methods."""
    if hasattr(module, "alpha"):                     # rezero
        return torch.ones(()), module.alpha
    if hasattr(module, "gamma"):                     # layerscale
        return torch.ones(()), module.gamma
    if hasattr(module, "gate"):                      # highway
        g = torch.sigmoid(module.gate(F.rms_norm(h_prev, (h_prev.shape[-1],), eps=EPS)))
        return 1 - g, g
    raise ValueError(f"cannot read stream weights of {type(module).__name__}")


@torch.no_grad()
def depth_weights(graph, aggregations, v: list[torch.Tensor], h: list[torch.Tensor]):
    """Per aggregation point l = 1..L+1: (source ids, mean weight per source, max abs error of
    sum_i w_i v_i against the captured h_l)."""
    from ..topology import STREAM_METHODS

    vals = _source_values(graph, v)
    L = len(v) - 1
    out = []
    stream = None  # per-token weights of v_0.. in the running stream
    for l in range(1, L + 2):
        node = graph.nodes[f"agg{l}"]
        ids = list(node["sources"])
        method = node["method"]
        module = aggregations[l - 1]
        if method in STREAM_METHODS:
            if l == 1:
                stream = [torch.ones_like(v[0])]
            else:
                a, b = _stream_coefficients(module, h[l - 2])
                stream = [a * w for w in stream] + [b * torch.ones_like(v[l - 1])]
            ids = ["embedding"] + [f"sublayer{i}" for i in range(1, l)]
            w = stream
        else:
            stacked = torch.stack([vals[s] for s in ids])
            if method == "attend":
                w = list(_attend_weights(module, stacked, node["key_norm"] == "rms",
                                         node["gate"], node["heads"]))
            elif method == "scalars":
                w = [a * torch.ones_like(stacked[0])
                     for a in _scalar_weights(module.weights, node["gate"])]
            elif method == "sum":
                w = [torch.ones_like(stacked[0]) for _ in ids]
            else:
                raise ValueError(f"diagnose does not know aggregation method {method!r}")
        recon = sum(wi * vals[s] for wi, s in zip(w, ids))
        err = (recon - h[l - 1]).abs().max().item()
        out.append((ids, [wi.float().mean().item() for wi in w], err))
    return out


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"the model has no `{name}` submodule; diagnose needs a model built "
                         f"by restopo.compile") from None


def collect(model, graph, batches, device) -> dict:
    """Run `batches` ((x, y) pairs) forward and backward with hooks; the diagnose numbers."""
    from ..api import aggregations as list_aggregations

    embed, head = _submodule(model, "embed"), _submodule(model, "head")
    sublayers = list(_submodule(model, "sublayers"))
    L = len(sublayers)
    model.to(device).train()
    model.zero_grad(set_to_none=True)
    v_sq = [0.0] * (L + 1)
    h_sq = [0.0] * (L + 1)
    g_sq = [0.0] * (L + 1)
    captured: dict = {}
    hooks = []

    def keep_output(i):
        def hook(mod, args, output):
            captured[("v", i)] = output
            if output.requires_grad:
                output.register_hook(lambda g: captured.__setitem__(("g", i), g))
        return hook

    def keep_input(i):
        def hook(mod, args):
            captured[("h", i)] = args[0]
        return hook

    hooks.append(embed.register_forward_hook(keep_output(0)))
    for i, sub in enumerate(sublayers, start=1):
        hooks.append(sub.register_forward_pre_hook(keep_input(i)))
        hooks.append(sub.register_forward_hook(keep_output(i)))
    hooks.append(head.register_forward_pre_hook(keep_input(L + 1)))
    per_agg = None
    try:
        for x, y in batches:
            captured.clear()
            x, y = x.to(device), y.to(device)
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            for i in range(L + 1):
                v_sq[i] += captured[("v", i)].detach().float().pow(2).mean().item()
                if ("g", i) in captured:
                    g_sq[i] += captured[("g", i)].float().pow(2).mean().item()
            for i in range(1, L + 2):
                h_sq[i - 1] += captured[("h", i)].detach().float().pow(2).mean().item()
            v = [captured[("v", i)].detach() for i in range(L + 1)]
            h = [captured[("h", i)].detach() for i in range(1, L + 2)]
            batch_w = depth_weights(graph, list_aggregations(model), v, h)
            if per_agg is None:
                per_agg = [[ids, list(w), err] for ids, w, err in batch_w]
            else:
                for acc, (_, w, err) in zip(per_agg, batch_w):
                    acc[1] = [a + b for a, b in zip(acc[1], w)]
                    acc[2] = max(acc[2], err)
    finally:
        for hk in hooks:
            hk.remove()
    n = len(batches)
    grad_norm = [math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in sub.parameters()
                               if p.grad is not None)) / n for sub in sublayers]
    return {
        "kinds": [graph.nodes[f"sublayer{i}"]["op"] for i in range(1, L + 1)],
        "output_rms": [math.sqrt(s / n) for s in v_sq[1:]],
        "embedding_rms": math.sqrt(v_sq[0] / n),
        "input_rms": [math.sqrt(s / n) for s in h_sq],  # h_1..h_L and the head's h_{L+1}
        "param_grad_norm": grad_norm,
        "output_grad_rms": [math.sqrt(s / n) for s in g_sq[1:]],
        "aggregations": [{"index": l, "sources": ids, "weights": [x / n for x in w],
                          "method": graph.nodes[f"agg{l}"]["method"]}
                         for l, (ids, w, _) in enumerate(per_agg, start=1)],
        "reconstruction_error": max(e for _, _, e in per_agg),
    }


def _row_key(graph, node_id: str):
    if node_id.startswith("partial"):
        return (2, 0)
    return (0 if node_id == "embedding" else 1, graph.nodes[node_id].get("produced", 0))


def _row_label(graph, node_id: str) -> str:
    if node_id.startswith("partial"):
        return "partial (own block)"
    if node_id == "embedding":
        return "v0 embedding"
    data = graph.nodes[node_id]
    if data["kind"] == "block":
        m = data["members"]
        return f"b{data['index']} (sub {m[0]}-{m[-1]})"
    return f"v{data['index']} {data['op']}"


def write_figures(numbers: dict, graph, out_dir: Path, title: str) -> dict[str, Path]:
    """The three PNGs and diagnose.json in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = numbers["kinds"]
    xlabels = [f"{i} {k}" for i, k in enumerate(kinds, start=1)]
    paths = {}
    paths["magnitude"] = plot_depth_lines(
        {"output v_l": numbers["output_rms"], "input h_l": numbers["input_rms"][:-1]},
        out_dir / "magnitude.png", ylabel="RMS over tokens and channels",
        title=f"{title}: sublayer output and input magnitude", xlabels=xlabels, log=True)
    paths["gradients"] = plot_depth_lines(
        {"parameters of sublayer l": numbers["param_grad_norm"],
         "dLoss/dv_l (RMS)": numbers["output_grad_rms"]},
        out_dir / "gradients.png", ylabel="gradient norm", xlabels=xlabels, log=True,
        title=f"{title}: gradient magnitude per sublayer")

    rows = sorted({s for a in numbers["aggregations"] for s in a["sources"]},
                  key=lambda s: _row_key(graph, s))
    labels, seen = [], {}
    for s in rows:  # every partial shares one row
        lab = _row_label(graph, s)
        seen.setdefault(lab, len(labels))
        if seen[lab] == len(labels):
            labels.append(lab)
    matrix = [[math.nan] * len(numbers["aggregations"]) for _ in labels]
    for c, agg in enumerate(numbers["aggregations"]):
        for s, w in zip(agg["sources"], agg["weights"]):
            matrix[seen[_row_label(graph, s)]][c] = w
    cols = xlabels + ["head"]
    methods = {a["method"] for a in numbers["aggregations"]}
    if methods == {"sum"}:
        heat_title = f"{title}: standard residual, every source has weight 1 (uniform)"
    elif methods <= {"attend"}:
        heat_title = f"{title}: depth-attention weights, mean over tokens"
    else:  # scalars, stream updates, mixtures: what each source contributes to h_l
        heat_title = (f"{title}: effective source weights ({', '.join(sorted(methods))}), "
                      f"mean over tokens and channels")
    paths["depth_attention"] = plot_heatmap(matrix, out_dir / "depth_attention.png",
                                            rows=labels, cols=cols, title=heat_title,
                                            vmin=0.0)
    js = out_dir / "diagnose.json"
    js.write_text(json.dumps(numbers, indent=1))
    paths["json"] = js
    return paths


def diagnose(checkpoint: str, out_dir: str | None = None, *, batches: int = 4,
             batch_size: int = 8, device: str = "cpu", data_base: str | None = None) -> dict:
    """Load a checkpoint (its spec travels inside), measure, write the figures."""
    from .data import fixed_batches, open_corpus
    from .runspec import model_from_meta

    step_dir = resolve_checkpoint(checkpoint)
    spec, model, meta = model_from_meta(step_dir)
    load_checkpoint(step_dir, model)
    corpus = open_corpus(spec.train.data, base_dir=data_base or meta.get("data_base"))
    corpus.check(spec.model.vocab, spec.model.context)
    val = fixed_batches(corpus.val, spec.model.context, batch_size, batches)
    graph = spec.ir()
    numbers = collect(model, graph, val, torch.device(device))
    numbers["checkpoint"] = str(step_dir)
    numbers["step"] = meta.get("step")
    out = Path(out_dir) if out_dir else step_dir.parent.parent / "diagnose"
    name = spec.topology.name
    paths = write_figures(numbers, graph, out, f"{name} step {meta.get('step')}")
    return {"out": str(out), "paths": {k: str(p) for k, p in paths.items()},
            "reconstruction_error": numbers["reconstruction_error"]}
