"""`restopo graph FILE -o OUT`: a picture of the wiring, drawn from the IR.

OUT.dot is Graphviz text written here (a cluster per block, the head last). For .png/.svg
the `dot` program renders it when installed; otherwise matplotlib draws the same graph with
a layered layout, so a picture always comes out. The output appears whole or not at all
(written to a temporary file, then renamed).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess

from ..io import write_atomic

EXAMPLES = """\
examples:
  restopo graph examples/block_attnres.restopo -o block.png
  restopo graph examples/full_window8.restopo -o window.svg
  restopo graph examples/tiny.restopo -o tiny.dot        Graphviz source
  dot -Tpdf tiny.dot -o tiny.pdf                          render it yourself

Boxes are values (the embedding, sublayer outputs, block and partial sums), ellipses are
aggregation points; an edge from a value to an aggregation means the aggregation reads it.
"""

FORMATS = (".dot", ".gv", ".png", ".svg")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "graph", help="draw the wiring as DOT, PNG or SVG",
        description="Draw which values each aggregation point reads, grouped by block.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a .restopo spec")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="output file: .dot/.gv (Graphviz text), .png or .svg")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set residual.blocks=4 (repeatable)")
    p.add_argument("--engine", choices=("auto", "graphviz", "matplotlib"), default="auto",
                   help="how to draw .png/.svg (default: graphviz when `dot` is installed)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from ..spec import load_spec
    suffix = os.path.splitext(args.output)[1].lower()
    if suffix not in FORMATS:
        print(f"restopo graph: error: cannot write {args.output!r}: the output must end in "
              f"{', '.join(FORMATS)}", file=sys.stderr)
        return 2
    spec = load_spec(args.file, overrides=tuple(args.overrides))
    g = spec.ir()
    title = f"{os.path.basename(spec.path)}: {g.graph['name']}"
    dot = to_dot(g, title)
    engine = args.engine
    if engine == "graphviz" and shutil.which("dot") is None:
        print("restopo graph: error: --engine graphviz needs the `dot` program (Graphviz); "
              "install it or use --engine matplotlib", file=sys.stderr)
        return 1
    if suffix in (".dot", ".gv"):
        write_atomic(args.output, dot)
    elif engine != "matplotlib" and shutil.which("dot"):
        try:
            write_atomic(args.output, lambda tmp: _render_dot(dot, suffix[1:], tmp))
        except (OSError, subprocess.SubprocessError) as e:
            if engine == "graphviz":
                print(f"restopo graph: error: dot failed: {_dot_message(e)}", file=sys.stderr)
                return 1
            print(f"restopo graph: dot failed ({_dot_message(e)}); drawing with matplotlib",
                  file=sys.stderr)
            write_atomic(args.output, lambda tmp: draw_matplotlib(g, title, tmp, suffix[1:]))
    else:
        write_atomic(args.output, lambda tmp: draw_matplotlib(g, title, tmp, suffix[1:]))
    print(f"wrote {args.output}")
    return 0


def _dot_message(e: Exception) -> str:
    err = getattr(e, "stderr", None)
    text = err.decode(errors="replace").strip() if isinstance(err, bytes) else str(e)
    return text.splitlines()[-1] if text else type(e).__name__


def _render_dot(dot: str, fmt: str, out: str) -> None:
    subprocess.run(["dot", f"-T{fmt}", "-o", out], input=dot.encode(), check=True,
                   capture_output=True, timeout=120)


# -- what is drawn ----------------------------------------------------------------------
def drawn_nodes(g) -> list[str]:
    """Every node except block and partial sums that no aggregation reads (a standard
    residual has a partial per sublayer that nothing reads: drawing them is noise)."""
    keep = []
    for n, a in g.nodes(data=True):
        if a["kind"] in ("block", "partial") and not any(
                g.nodes[s]["kind"] == "aggregation" for s in g.successors(n)):
            continue
        keep.append(n)
    return keep


def _label(g, n: str) -> str:
    a = g.nodes[n]
    kind = a["kind"]
    if kind == "sublayer":
        return f"{n}\\n{a['op']}"
    if kind == "aggregation":
        extra = ""
        if a["method"] == "attend":
            bits = [] if a["query"] == "static" else ["input-dep."]
            bits += [] if a["gate"] == "softmax" else [a["gate"]]
            bits += [] if a["key_norm"] == "rms" else ["no key norm"]
            bits += [] if a["heads"] == 1 else [f"{a['heads']} heads"]
            extra = ("\\n" + ", ".join(bits)) if bits else ""
        elif a["method"] == "scalars" and a["gate"] != "none":
            extra = f"\\n{a['gate']}"
        return f"h{a['index']}: {a['method']}{extra}"
    if kind == "partial":
        return f"partial p{a['block']}^{a['j']}"
    if kind == "block":
        return f"block b{a['index']}"
    if kind == "embedding":
        return "embedding b0"
    return "head\\nnorm + LM head"


_STYLE = {
    "embedding": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
    "sublayer": 'shape=box, style=filled, fillcolor="#ffe9c7"',
    "block": 'shape=box, style="filled,bold", fillcolor="#d9f2d0"',
    "partial": 'shape=box, style="filled,dashed", fillcolor="#eef8ea"',
    "aggregation": 'shape=ellipse, style=filled, fillcolor="#f3e1ff"',
    "head": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(g, title: str = "restopo") -> str:
    """Graphviz source for the IR: a cluster per block (its aggregations, sublayers and
    sums), the embedding on top, the head's aggregation and the head at the bottom."""
    keep = set(drawn_nodes(g))
    lines = [f"digraph {_q('restopo')} {{",
             f"  label={_q(title)}; labelloc=t; fontname=Helvetica; rankdir=TB; newrank=true;",
             '  node [fontname=Helvetica, fontsize=10]; edge [color="#555555", arrowsize=0.6];']

    def node(n: str, indent: str = "  ") -> str:
        kind = g.nodes[n]["kind"]
        label = _label(g, n).replace('"', '\\"')
        return f'{indent}{_q(n)} [label="{label}", {_STYLE[kind]}];'

    lines.append(node("embedding"))
    blocks = g.graph["blocks"]
    for b, members in enumerate(blocks, start=1):
        inside = []
        for i in members:
            inside += [f"agg{i}", f"sublayer{i}"]
        inside += [n for n, a in g.nodes(data=True)
                   if a["kind"] in ("block", "partial") and a.get("block", a.get("index")) == b
                   and n in keep and (a["kind"] == "partial" or a["index"] == b)]
        span = f"sublayer {members[0]}" if len(members) == 1 else \
            f"sublayers {members[0]}-{members[-1]}"
        lines.append(f"  subgraph {_q(f'cluster_block{b}')} {{")
        lines.append(f'    label="block {b} ({span})"; style="rounded,dashed"; color="#888888";')
        lines.extend(node(n, "    ") for n in inside if n in keep)
        lines.append("  }")
    head_agg = f"agg{len(g.graph['kinds']) + 1}"
    lines.append(f"  subgraph {_q('cluster_head')} {{")
    lines.append('    label="head"; style="rounded,dashed"; color="#888888";')
    lines.append(node(head_agg, "    "))
    lines.append(node("head", "    "))
    lines.append("  }")
    for u, v, a in g.edges(data=True):
        if u not in keep or v not in keep:
            continue
        style = ""
        if g.nodes[v]["kind"] in ("block", "partial"):
            style = ' [style=dotted, color="#999999"]'
        elif g.nodes[u]["kind"] == "aggregation":
            style = " [penwidth=1.6]"
        lines.append(f"  {_q(u)} -> {_q(v)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- the matplotlib fallback ----------------------------------------------------------------
def layered_positions(g, keep) -> dict:
    """Rows in execution order (the embedding on top, the head at the bottom); columns by
    kind: values read by aggregations on the left and right, aggregations and sublayers
    in the middle."""
    column = {"embedding": 0.0, "aggregation": 1.2, "sublayer": 2.4, "partial": 3.4,
              "block": 4.2, "head": 2.4}
    L = len(g.graph["kinds"])
    pos = {}
    for n in keep:
        a = g.nodes[n]
        kind = a["kind"]
        if kind == "embedding":
            row = 0.0
        elif kind == "aggregation":
            row = a["index"] - 0.4 if a["before"] != "head" else L + 1.3
        elif kind == "sublayer":
            row = float(a["index"])
        elif kind == "partial":
            row = a["produced"] + 0.5
        elif kind == "block":
            row = a["produced"] + 0.6
        else:
            row = L + 2.0
        pos[n] = (column[kind], -row)
    return pos


def draw_matplotlib(g, title: str, out: str, fmt: str) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.patches import FancyBboxPatch

    keep = drawn_nodes(g)
    sub = g.subgraph(keep)
    pos = layered_positions(g, keep)
    L = len(g.graph["kinds"])
    fig, ax = plt.subplots(figsize=(9, max(4.0, 0.6 * (L + 3))))
    for b, members in enumerate(g.graph["blocks"], start=1):
        top, bottom = -(members[0] - 0.75), -(members[-1] + 0.85)
        ax.add_patch(FancyBboxPatch((0.75, bottom), 3.95, top - bottom,
                                    boxstyle="round,pad=0.02", fc="#f7f7f7", ec="#999999",
                                    ls="--", lw=0.8, zorder=0))
        ax.text(4.8, (top + bottom) / 2, f"block {b}", va="center", fontsize=8, color="#555555")
    colors = {"embedding": "#cfe8ff", "sublayer": "#ffe9c7", "block": "#d9f2d0",
              "partial": "#eef8ea", "aggregation": "#f3e1ff", "head": "#cfe8ff"}
    kinds = {n: g.nodes[n]["kind"] for n in keep}
    member = [(u, v) for u, v in sub.edges() if kinds[v] in ("block", "partial")]
    feeds = [(u, v) for u, v in sub.edges() if kinds[u] == "aggregation"]
    reads = [(u, v) for u, v in sub.edges() if kinds[v] == "aggregation"]
    common = dict(ax=ax, arrows=True, arrowsize=7, node_size=700)
    nx.draw_networkx_edges(sub, pos, edgelist=member, width=0.4, style="dotted",
                           edge_color="#aaaaaa", connectionstyle="arc3,rad=0.1", **common)
    nx.draw_networkx_edges(sub, pos, edgelist=reads, width=0.6, edge_color="#3b6fb6",
                           alpha=0.7, connectionstyle="arc3,rad=0.2", **common)
    nx.draw_networkx_edges(sub, pos, edgelist=feeds, width=1.4, edge_color="#333333", **common)
    for kind, shape in (("aggregation", "o"), ("embedding", "s"), ("sublayer", "s"),
                        ("partial", "s"), ("block", "s"), ("head", "s")):
        nodes = [n for n in keep if kinds[n] == kind]
        if nodes:
            nx.draw_networkx_nodes(sub, pos, nodelist=nodes, node_shape=shape, node_size=700,
                                   node_color=colors[kind], edgecolors="#444444",
                                   linewidths=0.6, ax=ax)
    labels = {n: _label(g, n).replace("\\n", "\n") for n in keep}
    nx.draw_networkx_labels(sub, pos, labels=labels, font_size=5, ax=ax)
    ax.set_title(title + "\nblue: what each aggregation reads; dotted: block and partial sums",
                 fontsize=9)
    ax.set_xlim(-0.6, 5.4)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(out, format=fmt, dpi=150)
    plt.close(fig)
