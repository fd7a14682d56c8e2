"""Graphviz source for the IR: a cluster per block, the embedding on top, the head last.

Boxes are values (the embedding, sublayer outputs, block and partial sums, a multi-stream
model's n streams X_l), ellipses are aggregation points; an edge from a value to an
aggregation means the aggregation reads it. For n streams, X_l feeds its point (the read
h_l), and X_l, v_l and the point's coefficients make X_{l+1} (the write).
Names are the IR's (as in `restopo inspect` and `model.code`).
"""
from __future__ import annotations

from ..ir import IR, Aggregation, BlockSum, Embedding, Partial, Streams, Sublayer


def kind(node) -> str:
    """The drawing style class of an IR value."""
    return {Embedding: "embedding", Sublayer: "sublayer", BlockSum: "block", Partial: "partial",
            Streams: "streams", Aggregation: "aggregation"}.get(type(node), "head")


def drawn_nodes(g: IR) -> list[str]:
    """Every node except block and partial sums that no aggregation reads (a standard
    residual has a partial per sublayer that nothing reads: drawing them is noise)."""
    keep = []
    for n in g.nodes:
        if isinstance(g.node(n), (BlockSum, Partial)) and not any(
                isinstance(g.node(s), Aggregation) for s in g.successors(n)):
            continue
        keep.append(n)
    return keep


def label(g: IR, n: str) -> str:
    """The text in node n's box; `\\n` separates lines (Graphviz's escape)."""
    a = g.node(n)
    if isinstance(a, Sublayer):
        return f"{n}\\n{a.op}"
    if isinstance(a, Aggregation):
        extra = ""
        if a.method == "attend":
            bits = [] if a.query == "static" else ["input-dep."]
            bits += [] if a.gate == "softmax" else [a.gate]
            bits += [] if a.key_norm == "rms" else ["no key norm"]
            bits += [] if a.heads == 1 else [f"{a.heads} heads"]
            extra = ("\\n" + ", ".join(bits)) if bits else ""
        elif a.method == "scalars" and a.gate != "none":
            extra = f"\\n{a.gate}"
        elif a.multi_stream and a.is_head:
            return f"h{a.index}: sum of streams"
        elif a.multi_stream:
            extra = "\\nread, coefficients"
        return f"h{a.index}: {a.method}{extra}"
    if isinstance(a, Partial):
        return f"partial p{a.block}^{a.j}"
    if isinstance(a, BlockSum):
        return f"block b{a.index}"
    if isinstance(a, Streams):
        return f"X{a.index}: {a.n} streams" + ("\\n= n x b0" if a.index == 1 else "")
    if isinstance(a, Embedding):
        return "embedding b0"
    return "head\\nnorm + LM head"


_STYLE = {
    "embedding": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
    "sublayer": 'shape=box, style=filled, fillcolor="#ffe9c7"',
    "block": 'shape=box, style="filled,bold", fillcolor="#d9f2d0"',
    "partial": 'shape=box, style="filled,dashed", fillcolor="#eef8ea"',
    "streams": 'shape=box3d, style=filled, fillcolor="#fde2e2"',
    "aggregation": 'shape=ellipse, style=filled, fillcolor="#f3e1ff"',
    "head": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(g: IR, title: str = "restopo") -> str:
    """Graphviz source for the IR: a cluster per block (its aggregations, sublayers and
    sums), the embedding on top, the head's aggregation and the head at the bottom."""
    keep = set(drawn_nodes(g))
    lines = [f"digraph {_q('restopo')} {{",
             f"  label={_q(title)}; labelloc=t; fontname=Helvetica; rankdir=TB; newrank=true;",
             '  node [fontname=Helvetica, fontsize=10]; edge [color="#555555", arrowsize=0.6];']

    def node(n: str, indent: str = "  ") -> str:
        text = label(g, n).replace('"', '\\"')
        return f'{indent}{_q(n)} [label="{text}", {_STYLE[kind(g.node(n))]}];'

    lines.append(node("embedding"))
    sums = [v for v in g.values() if isinstance(v, (BlockSum, Partial)) and v.id in keep]
    for b, members in enumerate(g.blocks, start=1):
        inside = []
        for i in members:
            inside += [f"streams{i}", f"agg{i}", f"sublayer{i}"]
        inside += [v.id for v in sums
                   if (v.block if isinstance(v, Partial) else v.index) == b]
        span = f"sublayer {members[0]}" if len(members) == 1 else \
            f"sublayers {members[0]}-{members[-1]}"
        lines.append(f"  subgraph {_q(f'cluster_block{b}')} {{")
        what = span if g.aggregation(1).multi_stream else f"block {b} ({span})"  # n streams
        lines.append(f'    label="{what}"; style="rounded,dashed"; color="#888888";')
        lines.extend(node(n, "    ") for n in inside if n in keep)
        lines.append("  }")
    lines.append(f"  subgraph {_q('cluster_head')} {{")
    lines.append('    label="head"; style="rounded,dashed"; color="#888888";')
    if f"streams{g.n_sublayers + 1}" in keep:
        lines.append(node(f"streams{g.n_sublayers + 1}", "    "))
    lines.append(node(f"agg{g.n_sublayers + 1}", "    "))
    lines.append(node("head", "    "))
    lines.append("  }")
    for u, v in g.edges():
        if u not in keep or v not in keep:
            continue
        style = ""
        if isinstance(g.node(v), (BlockSum, Partial)):
            style = ' [style=dotted, color="#999999"]'
        elif isinstance(g.node(v), Streams) and isinstance(g.node(u), Aggregation):
            style = ' [style=dashed, label="post, R"]'  # the write's coefficients
        elif isinstance(g.node(u), Aggregation):
            style = " [penwidth=1.6]"
        lines.append(f"  {_q(u)} -> {_q(v)}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"
