"""Diagnostics from the paper, read off a trained checkpoint.

On a few validation batches, with hooks on the compiled model's `embed`, `sublayers` and
`head` (no change to the model), we capture every source v_0..v_L and every aggregation
result h_1..h_{L+1}, then one backward pass. From them:
  magnitude.png        RMS of each sublayer output v_l and of its input h_l across depth
                       (with a standard residual h grows with depth; AttnRes keeps it bounded)
  gradients.png        gradient norm of each sublayer's parameters, and RMS of dLoss/dv_l
  depth_attention.png  the weight of every source at every aggregation point, averaged over
                       tokens; for a standard residual every weight is 1
  hyper_connections.png  multi-stream topologies only: the mean H^pre, H^post and H^res of
                       every sublayer (restopo.nn.streams)
  diagnose.json        the numbers behind the pictures

The weights come from replaying the one walk over the IR (restopo.ir.walk) on the captured
values: each aggregation module is asked for the weights of its inputs
(`input_weights`, see restopo.nn.aggregate), and stream updates are composed into weights
per source. The replay runs every aggregation directly, so the picture is the same for the
direct and two-phase lowerings. For n streams the replay rebuilds the streams from the
captured outputs with each point's coefficients (pre, post, R) and carries, per source, its
weight in every stream: X_{l+1} = R X_l + post v_l makes those weights R w (and post for
v_l), and h_l = sum_i pre_i X_i gives source weights pre . w. As a check, sum_i weight_i *
v_i is compared with the captured h_l token by token (`reconstruction_error` in diagnose.json; about 1e-6 in
float32).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..ir import Aggregation, BlockSum, Embedding, Partial, Sublayer
from ..ir.walk import Visitor, walk
from ..io import make_folder, output_folder, write_atomic
from ..nn.streams import expand_streams, write_streams
from .checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint
from .plots import plot_depth_lines, plot_depth_weights, plot_stream_coefficients


def _rms(t: torch.Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


class _Replay(Visitor):
    """The walk over captured values: sublayers give their captured outputs v_i, every
    aggregation point its captured h_l, and each point records the mean weight of each of
    its sources and how far sum_i w_i v_i is from the captured h_l."""

    def __init__(self, aggregations, v: list[torch.Tensor], h: list[torch.Tensor]):
        self.modules, self.v, self.h = aggregations, v, h
        self.stream: list[torch.Tensor] = []  # per-token weights of v_0.. in the stream
        self.points: dict[int, tuple[list[str], list[float], float]] = {}
        # n streams: per source its weight in each stream [..., n]; each point's (pre, post,
        # R) averaged over tokens
        self.in_streams: list[torch.Tensor] = []
        self.pre: dict[int, torch.Tensor] = {}
        self.coefficients: dict[int, dict] = {}

    def embedding(self):
        return self.v[0]

    def sublayer(self, node: Sublayer, h):
        return self.v[node.index]

    def add(self, a, b, name: str):
        return a + b

    def stream_update(self, agg: Aggregation, h_prev, v_prev):
        return self.h[agg.index - 1]

    def aggregate(self, agg: Aggregation, sources):
        return self.h[agg.index - 1]

    def head(self, h):
        return h

    def expand(self, agg: Aggregation, v0):
        self.in_streams = [torch.ones(agg.streams, dtype=v0.dtype, device=v0.device)]
        return expand_streams(v0, agg.streams)

    def read(self, agg: Aggregation, x):
        pre, post, res = self.modules[agg.index - 1].coefficients(x)
        self.pre[agg.index] = pre
        self.coefficients[agg.index] = {
            "pre": _token_mean(pre, 1), "post": _token_mean(post, 1), "res": _token_mean(res, 2)}
        return self.h[agg.index - 1], (pre, post, res)

    def write(self, agg: Aggregation, x, v, coefficients):
        _, post, res = coefficients
        res, post = res.to(x.dtype), post.to(x.dtype)
        self.in_streams = [(res @ w.unsqueeze(-1)).squeeze(-1) for w in self.in_streams]
        self.in_streams.append(post)
        return write_streams(x, v, post, res)

    def aggregated(self, agg: Aggregation, inputs, h, stream: bool) -> None:
        l = agg.index
        if agg.multi_stream:  # h_l = sum_i (pre . w_i) v_i; the head sums the streams
            pre = self.pre.get(l)
            weights = [w.sum(-1) if pre is None else (w * pre.to(w.dtype)).sum(-1)
                       for w in self.in_streams]
            self._record(l, [Embedding.id] + [f"sublayer{i}" for i in range(1, l)],
                         [w.unsqueeze(-1) for w in weights], self.v[:l])
            return
        weights = self.modules[l - 1].input_weights(*inputs)
        if stream:  # h_l = a h_{l-1} + b v_{l-1}: every earlier source's weight scales by a
            self.stream = weights if l == 1 else \
                [weights[0] * w for w in self.stream] + [weights[1]]
            ids = [Embedding.id] + [f"sublayer{i}" for i in range(1, l)]
            values = self.v[:l]
            weights = self.stream
        else:
            ids, values = list(agg.sources), inputs
        self._record(l, ids, weights, values)

    def _record(self, l: int, ids, weights, values) -> None:
        recon = sum(w * x for w, x in zip(weights, values))
        err = (recon - self.h[l - 1]).abs().max().item()
        means = [(w * torch.ones_like(x)).float().mean().item() for w, x in zip(weights, values)]
        self.points[l] = (ids, means, err)


def _token_mean(t: torch.Tensor, keep: int) -> list:
    """The mean over every leading (token) axis, keeping the last `keep` axes, as lists."""
    t = t.detach().double()
    return t.reshape(-1, *t.shape[t.dim() - keep:]).mean(0).tolist()


@torch.no_grad()
def depth_weights(graph, aggregations, v: list[torch.Tensor], h: list[torch.Tensor],
                  coefficients: dict | None = None):
    """Per aggregation point l = 1..L+1: (source ids, mean weight per source, max abs error of
    sum_i w_i v_i against the captured h_l). For n streams `coefficients`, when given, is
    filled with each sublayer's mean {"pre", "post", "res"}."""
    replay = _Replay(aggregations, v, h)
    walk(graph, replay)
    if coefficients is not None:
        coefficients.update(replay.coefficients)
    return [replay.points[l] for l in range(1, len(v) + 1)]


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
    streams: dict[int, dict] = {}  # n streams: per sublayer, the summed mean coefficients
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
            coefficients: dict = {}
            batch_w = depth_weights(graph, list_aggregations(model), v, h, coefficients)
            for l, c in coefficients.items():
                streams[l] = c if l not in streams else \
                    {k: _add(streams[l][k], c[k]) for k in c}
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
    extra = {}
    if streams:  # mean H^pre, H^post, H^res per sublayer
        extra["stream_coefficients"] = [
            {k: _scale(c[k], 1 / n) for k in ("pre", "post", "res")}
            for _, c in sorted(streams.items())]
    return {
        "kinds": list(graph.kinds),
        "output_rms": [math.sqrt(s / n) for s in v_sq[1:]],
        "embedding_rms": math.sqrt(v_sq[0] / n),
        "input_rms": [math.sqrt(s / n) for s in h_sq],  # h_1..h_L and the head's h_{L+1}
        "param_grad_norm": grad_norm,
        "output_grad_rms": [math.sqrt(s / n) for s in g_sq[1:]],
        "aggregations": [{"index": l, "sources": ids, "weights": [x / n for x in w],
                          "method": graph.aggregation(l).method}
                         for l, (ids, w, _) in enumerate(per_agg, start=1)],
        "reconstruction_error": max(e for _, _, e in per_agg),
    } | extra


def _add(a, b):
    return [_add(x, y) for x, y in zip(a, b)] if isinstance(a, list) else a + b


def _scale(a, k: float):
    return [_scale(x, k) for x in a] if isinstance(a, list) else a * k


def _row_key(graph, node_id: str):
    node = graph.node(node_id)
    if isinstance(node, Partial):
        return (2, 0)
    return (0 if isinstance(node, Embedding) else 1, node.produced)


def _row_label(graph, node_id: str) -> str:
    node = graph.node(node_id)
    if isinstance(node, Partial):
        return "partial (own block)"
    if isinstance(node, Embedding):
        return "v0 embedding"
    if isinstance(node, BlockSum):
        m = node.members
        return f"b{node.index} (sub {m[0]}-{m[-1]})"
    return f"v{node.index} {node.op}"


def write_figures(numbers: dict, graph, out_dir: Path, title: str) -> dict[str, Path]:
    """The three PNGs (four with streams) and diagnose.json in out_dir."""
    make_folder(out_dir)
    js = out_dir / "diagnose.json"
    try:  # what the diagnose before this one in out_dir wrote, by its numbers
        streams_before = bool(json.loads(js.read_text()).get("stream_coefficients"))
    except (OSError, ValueError, AttributeError):
        streams_before = False
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
    paths["depth_attention"] = plot_depth_weights(matrix, out_dir / "depth_attention.png",
                                                  rows=labels, cols=cols, title=heat_title)
    if numbers.get("stream_coefficients"):
        paths["streams"] = plot_stream_coefficients(
            numbers["stream_coefficients"], out_dir / "hyper_connections.png", xlabels=xlabels,
            title=f"{title}: mean H^pre, H^post and H^res per sublayer")
    write_atomic(js, json.dumps(numbers, indent=1))
    paths["json"] = js
    if streams_before and "streams" not in paths:  # its figure is not of this model
        (out_dir / "hyper_connections.png").unlink(missing_ok=True)
    return paths


def diagnose(checkpoint: str, out_dir: str | None = None, *, batches: int = 4,
             batch_size: int = 8, device: str = "cpu", data_base: str | None = None,
             say=None, loaded=None) -> dict:
    """Load a checkpoint (its spec travels inside), measure, write the figures. `say(line)`
    hears of damaged checkpoints passed over. `loaded`: instead, a model restopo.load made
    from a file (an export: figures beside it, data as its spec says)."""
    from .data import fixed_batches, open_corpus
    from .init_check import step0_report
    from ..spec.datapath import data_base as spec_data_base
    from .runspec import model_from_meta

    if loaded is not None:  # a model file the caller loaded (restopo.load: an export)
        model = loaded
        step_dir, spec = Path(model.restopo_source), model.restopo_spec
        meta = {"step": None}
        if spec.train is None:
            raise CheckpointError(f"{step_dir}: its spec has no train section, so no data "
                                  f"to measure on")
    else:
        step_dir = resolve_checkpoint(checkpoint, say=say)
        spec, model, meta = model_from_meta(step_dir)
        load_checkpoint(step_dir, model)
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"{step_dir} holds NaN or infinite weights ({', '.join(bad[:3])}"
                         f"{', ...' if len(bad) > 3 else ''}): the run diverged before it was "
                         f"saved; diagnose an earlier checkpoint")
    out = Path(out_dir) if out_dir else (
        step_dir.parent / f"{step_dir.stem}-diagnose" if step_dir.is_file()
        else step_dir.parent.parent / "diagnose")
    with output_folder(out):  # before measuring: a folder that cannot be made is said first
        # the spec, read back from a checkpoint or an export, knows where its run read its data
        corpus = open_corpus(spec.train.data, base_dir=data_base or spec_data_base(spec))
        corpus.check(spec.model.vocab, spec.model.context)
        val = fixed_batches(corpus.val, spec.model.context, batch_size, batches)
        graph = spec.ir()
        numbers = collect(model, graph, val, torch.device(device))
        if not all(math.isfinite(x) for k in ("output_rms", "input_rms", "param_grad_norm",
                                              "output_grad_rms") for x in numbers[k]):
            raise ValueError(f"{step_dir}: the model's activations or gradients overflow to "
                             f"NaN or infinity on the validation batches, so there is nothing "
                             f"to plot")
        numbers["checkpoint"] = str(step_dir)
        numbers["step"] = meta.get("step")
        # The spec's model as training initialised it, against the standard residual.
        numbers["step0"] = step0_report(spec.model, spec.topology, graph, val[0][0],
                                        seed=spec.train.seed)
        name = spec.topology.name
        when = step_dir.name if meta.get("step") is None else f"step {meta['step']}"
        paths = write_figures(numbers, graph, out, f"{name} {when}")
    return {"out": str(out), "paths": {k: str(p) for k, p in paths.items()},
            "reconstruction_error": numbers["reconstruction_error"],
            "step0": numbers["step0"]["line"]}
