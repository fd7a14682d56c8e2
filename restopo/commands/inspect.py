"""`restopo inspect FILE`: what the compiler sees, as a table or as JSON.

`build_report` makes a dict (the JSON form: restopo.ir.summary plus the spec's model, and
any sections other options add); `format_text` prints that dict for people. To add a view
(e.g. a pipeline plan), add an argument in `register`, put its result under a new key in
`build_report`, and `format_text` shows it (generically, or with a formatter in TEXT_SECTIONS).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from ..cli import SetOverride
from ..registry import get_backend

EXAMPLES = """\
examples:
  restopo inspect examples/block_attnres.restopo
  restopo inspect examples/full_attnres.restopo --format json
  restopo inspect examples/tiny.restopo --set residual=full_attnres --set model.depth=8

The text table lists every aggregation point in execution order: the sublayer it feeds
(attn, mlp, or the head), its method and its ordered sources (embedding, blockN, partial,
sublayerN). JSON has the keys spec (the file), topology, model (its section), sublayers,
blocks, block_sizes, live_values_per_token, live_values_two_phase (with the phase-1 results
the two-phase groups keep; null without any), parameters (the model's: total, embedding for
the vocab x width tables, one when tied, and non_embedding, the rest with the topology's),
added_parameters (the topology's), two_phase_groups,
flops_per_token (forward FLOPs per token of the sublayers, the head and the aggregations,
their sum `forward`, and `train` for a training step: 3x forward),
residual_io (memory I/O per token per sublayer in units of d, unfused, as the paper's Table
1: peak_d, reads_d, writes_d, scalars, mean_d, head_d, formula), aggregations [index,
before, method, sources, ...] and, with a pipeline, pipeline (its chunk table and the bytes
crossing each cut).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="show the aggregation points, their sources and the costs",
        description="Show what a spec compiles to: blocks, live values per token, parameters "
                    "(and the added parameters of the topology), FLOPs per token, residual "
                    "I/O, the two-phase groups and every aggregation's sources.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a .restopo spec")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text (a table, default) or json")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set model.width=64 (repeatable)")
    # Further views (e.g. --pipeline PxV) add their arguments here and a key in build_report.
    # -- pipeline view (the pipeline backend's report) --
    p.add_argument("--pipeline", metavar="PxV", default=None,
                   help="also plan a pipeline of P ranks x V virtual stages (P alone: Px1, "
                        "as in train): the chunk table and the values/bytes per token "
                        "crossing each cut, naive and cached (default: the spec's parallel "
                        "section's pipeline, if it has one, as train runs it)")
    # -- end pipeline view --
    p.set_defaults(func=run)


def build_report(spec, args=None) -> dict:
    """The JSON form: restopo.ir.summary of the spec's IR, plus the model it was built for."""
    from ..ir.summary import summary
    g = spec.ir()
    report = {"spec": spec.path}
    report.update(summary(g))
    m = spec.model
    report["model"] = {"name": m.name, "vocab": m.vocab, "width": m.width, "depth": m.depth,
                       "heads": m.heads, "mlp": m.mlp, "mlp_ratio": m.mlp_ratio,
                       "context": m.context, "layer": list(m.layer),
                       "tie_embeddings": m.tie_embeddings}
    report["parameters"] = _parameters(m, report.get("added_parameters"))
    report["flops_per_token"] = _flops(g, m)
    pv = _pipeline_asked(spec, args)  # -- pipeline view --
    if pv is not None:
        report["pipeline"] = get_backend("pipeline").inspect_section(spec, g, pv)
    return report


def _pipeline_asked(spec, args) -> str | None:
    """The PxV to plan: --pipeline, else the spec's parallel section's pipeline (train runs
    it there), else none."""
    pv = getattr(args, "pipeline", None) if args is not None else None
    parallel = spec.parallel
    if pv is None and parallel is not None and parallel.stages > 1:
        pv = f"{parallel.stages}x{parallel.virtual}"
    return pv


def _parameters(model, added: int | None) -> dict:
    """The model's parameters (restopo.sizes, the topology's added ones with them): in
    all, in the vocab x width tables (one when tied) and in the rest."""
    from ..sizes import model_parameters
    body, embedding = model_parameters(model)
    body += added or 0
    return {"total": body + embedding, "embedding": embedding, "non_embedding": body}


def _flops(g, model) -> dict:
    """Forward FLOPs per token by part (restopo.nn.flops), their sum, and a training step's."""
    from ..nn.flops import flops_per_token
    f = flops_per_token(g, model)
    return {"sublayers": f.sublayers, "head": f.head, "aggregations": f.aggregations,
            "forward": f.forward, "train": f.train}


def run(args) -> int:
    from ..spec import load_spec
    spec = load_spec(args.file, overrides=tuple(args.overrides))
    # a pipeline that cannot be planned is a usage error
    usage_errors = (get_backend("pipeline").PlanError,) if _pipeline_asked(spec, args) else ()
    try:
        report = build_report(spec, args)
    except usage_errors as e:
        print(f"restopo inspect: error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(report))
    return 0


# -- text -----------------------------------------------------------------------------------
_NUMBERED = re.compile(r"([a-z]+)(\d+)")


def compact_sources(sources: list[str]) -> str:
    """'embedding, sublayer1..sublayer7': runs of three or more consecutive blockN or
    sublayerN are shortened."""
    def key(s):
        m = _NUMBERED.fullmatch(s)
        return (m.group(1), int(m.group(2))) if m else None

    out, i = [], 0
    while i < len(sources):
        j = i
        k = key(sources[i])
        while k and j + 1 < len(sources) and key(sources[j + 1]) == (k[0], k[1] + j + 1 - i):
            j += 1
        if j - i >= 2:
            out.append(f"{sources[i]}..{sources[j]}")
        else:
            out.extend(sources[i:j + 1])
        i = j + 1
    return ", ".join(out)


def _options(a: dict) -> str:
    if a["method"] == "scalars":
        return f"gate {a['gate']}"
    if "streams" in a:
        return f"{a['streams']} streams" + (" dynamic" if a.get("dynamic") else "") + (
            f" sinkhorn {a['sinkhorn']}" if a.get("sinkhorn") else "")
    if a["method"] != "attend":
        return ""
    opts = [a["query"], a["gate"], f"key_norm {a['key_norm']}"]
    if a.get("heads", 1) != 1:
        opts.append(f"{a['heads']} heads")
    return " ".join(opts)


def _aggregation_table(report: dict) -> list[str]:
    rows = [("point", "before", "method", "options", "sources")]
    for a in report["aggregations"]:
        rows.append((str(a["index"]), a["before"], a["method"], _options(a),
                     f"({len(a['sources'])}) {compact_sources(a['sources'])}"))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]
            for r in rows]


def format_text(report: dict) -> str:
    m = report.get("model") or {}
    head = f"{report['spec']}: {report['topology']}, {report['sublayers']} sublayers"
    if m:
        head += (f" (depth {m['depth']}, width {m['width']}, heads {m['heads']}, "
                 f"{m['mlp']} x{m['mlp_ratio']:g}, vocab {m['vocab']}, context {m['context']})")
    sizes = report["block_sizes"]
    same = len(set(sizes)) == 1
    lines = [head,
             f"  blocks                 {report['blocks']} ("
             + (f"{sizes[0]} sublayer{'s' * (sizes[0] != 1)}{' each' * (len(sizes) > 1)}"
                if same else "sizes " + " ".join(map(str, sizes)))
             + ")",
             f"  live values per token  {report['live_values_per_token']}"
             + (f" ({report['live_values_two_phase']} as the two-phase groups run: each "
                "phase 1 keeps one result per member until its last)"
                if report.get("live_values_two_phase") else "")]
    if report.get("parameters"):
        p = report["parameters"]
        lines.append(f"  parameters             {p['total']:,} (embedding {p['embedding']:,}, "
                     f"non-embedding {p['non_embedding']:,})")
    if report.get("added_parameters") is not None:
        lines.append(f"  added parameters       {report['added_parameters']:,}")
    if report.get("flops_per_token"):
        f = report["flops_per_token"]
        lines.append(f"  FLOPs per token        {f['forward']:,.0f} forward "
                     f"({f['aggregations'] / f['forward']:.1%} in the aggregations), "
                     f"{f['train']:,.0f} per training step")
    if report.get("residual_io"):
        lines.extend(_io_lines(report["residual_io"]))
    groups = report.get("two_phase_groups") or []
    if groups:
        lines.append(f"  two-phase groups       {len(groups)}: "
                     + ", ".join(f"{g[0]}..{g[-1]}" if len(g) > 2 else "+".join(g)
                                 for g in groups))
    lines.append("")
    lines.extend(_aggregation_table(report))
    known = {"spec", "topology", "sublayers", "blocks", "block_sizes", "live_values_per_token",
             "live_values_two_phase",
             "added_parameters", "two_phase_groups", "aggregations", "model", "residual_io",
             "flops_per_token", "parameters"}
    for key, value in report.items():
        if key in known:
            continue
        lines.append("")
        fmt = TEXT_SECTIONS.get(key)
        lines.extend(fmt(value) if fmt else _generic(key, value))
    return "\n".join(lines) + "\n"


def _d(x: float) -> str:
    if x == 1:
        return "d"
    # .6g: 12.125d as it is (.4g printed 12.12d), a third as 3.33333d
    return f"{int(x)}d" if float(x).is_integer() else f"{x:.6g}d"


def _io_lines(io: dict) -> list[str]:
    """Residual memory I/O per token per sublayer, and the two-phase Full figure."""
    def figure(r: dict) -> str:
        text = _d(r["peak_d"]) + (f" + {r['scalars']}" if r["scalars"] else "")
        if r["mean_d"] != r["peak_d"]:
            text += f" at the peak, {_d(r['mean_d'])} on average"
        return text

    lines = [f"  residual I/O           {figure(io)} per sublayer (reads {_d(io['reads_d'])}, "
             f"writes {_d(io['writes_d'])}"
             + (f", {io['scalars']} coefficients" if io["scalars"] else "")
             + "; unfused, per token)" + (f"; {io['formula']}" if io.get("formula") else "")]
    if io.get("two_phase_full"):
        t = io["two_phase_full"]
        lines.append(f"    two-phase, if grouped {figure(t)}; {t['formula']} (restopo runs "
                     "these points directly)")
    return lines


def _generic(key: str, value, indent: str = "") -> list[str]:
    if isinstance(value, dict):
        out = [f"{indent}{key}:"]
        for k, v in value.items():
            out.extend(_generic(k, v, indent + "  "))
        return out
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        out = [f"{indent}{key}:"]
        for v in value:
            out.append(f"{indent}  - {json.dumps(v)}")
        return out
    return [f"{indent}{key}: {json.dumps(value) if not isinstance(value, str) else value}"]


# Text formatters for report keys added by other views: key -> function(value) -> lines.
TEXT_SECTIONS: dict = {}


def _pipeline_text(value) -> list[str]:  # -- pipeline view --
    return get_backend("pipeline").describe(value).splitlines()


TEXT_SECTIONS["pipeline"] = _pipeline_text
