"""Graphviz source for the IR's picture (restopo.draw.scene): a cluster per block, the
embedding on top, the head last; boxes named as in model.code."""
from __future__ import annotations

from ..ir import IR
from .scene import Scene, build_scene

_STYLE = {
    "embedding": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
    "sublayer": 'shape=box, style=filled, fillcolor="#ffe9c7"',
    "block": 'shape=box, style="filled,bold", fillcolor="#d9f2d0"',
    "partial": 'shape=box, style="filled,dashed", fillcolor="#eef8ea"',
    "phase": 'shape=box, style="filled,rounded", fillcolor="#e8e1ff"',
    "streams": 'shape=box3d, style=filled, fillcolor="#fde2e2"',
    "aggregation": 'shape=box, style="filled,rounded", fillcolor="#f3e1ff"',
    "head": 'shape=box, style="filled,rounded", fillcolor="#cfe8ff"',
}
_EDGE = {
    "feeds": " [penwidth=1.6]",
    "reads": ' [color="#3b6fb6"]',
    "phase": ' [color="#7a5cc4", style=dashed, arrowsize=0.4]',
    "sums": ' [style=dotted, color="#999999"]',
    "bus": ' [color="#3b6fb6"]',
    "write": ' [style=dashed, color="#c0504d"]',
}


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(g: IR, title: str = "restopo") -> str:
    return scene_to_dot(build_scene(g, title))


def scene_to_dot(scene: Scene) -> str:
    """Clusters per block; the bus becomes explicit edges (Graphviz merges them with
    concentrate=true)."""
    lines = [f"digraph {_q('restopo')} {{",
             f"  label={_q(scene.title)}; labelloc=t; fontname=Helvetica; rankdir=TB; "
             "newrank=true; concentrate=true;",
             '  node [fontname=Helvetica, fontsize=10]; edge [color="#555555", arrowsize=0.6];']

    def node(b, indent="  "):
        text = b.label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'{indent}{_q(b.id)} [label="{text}", {_STYLE[b.kind]}];'

    inside = {n: [] for n, _ in scene.blocks}
    head, outside = [], []
    for b in scene.boxes.values():
        if b.block in inside:
            inside[b.block].append(b)
        else:  # the head's aggregation point and the head; the embedding, the streams
            (head if b.kind in ("aggregation", "head") else outside).append(b)
    lines.extend(node(b) for b in outside)
    for n, members in scene.blocks:
        span = f"sublayer {members[0]}" if len(members) == 1 else \
            f"sublayers {members[0]}-{members[-1]}"
        lines.append(f"  subgraph {_q(f'cluster_block{n}')} {{")
        lines.append(f'    label="block {n} ({span})"; style="rounded,dashed"; color="#888888";')
        lines.extend(node(b, "    ") for b in sorted(inside[n], key=lambda b: b.row))
        lines.append("  }")
    lines.append(f"  subgraph {_q('cluster_head')} {{")
    lines.append('    label="head"; style="rounded,dashed"; color="#888888";')
    lines.extend(node(b, "    ") for b in head)
    lines.append("  }")
    readers = [e.dst for e in scene.edges if e.kind == "bus" and e.src == "bus"]
    onto = [e.src for e in scene.edges if e.kind == "bus" and e.dst == "bus"]
    for e in scene.edges:
        if "bus" in (e.src, e.dst):
            continue
        lines.append(f"  {_q(e.src)} -> {_q(e.dst)}{_EDGE[e.kind]};")
    for r in readers:  # the bus: every output above the reader
        for s in onto:
            if scene.boxes[s].row < scene.boxes[r].row:
                lines.append(f"  {_q(s)} -> {_q(r)}{_EDGE['bus']};")
    lines.append("}")
    return "\n".join(lines) + "\n"
