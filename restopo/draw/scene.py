"""What a picture of the IR shows, before any renderer places it: boxes named as in
`model.code` and `restopo inspect`, and the edges of the computation restopo runs.

Three things keep a deep picture readable:
- a two-phase group (restopo.ir.two_phase_plan) reads its completed blocks once, into the
  block's phase-1 box (`block3_phase1`, as in model.code), which feeds each member: N edges
  per block instead of N per sublayer;
- block and partial sums are drawn as the running sums the code computes
  (`partial2_4 = partial2_3 + sublayer6`, `block2 = partial2_4 + sublayer7`), only where an
  aggregation reads one; p_n^2 is the block's first output itself, so it has no box;
- a reader of every completed value so far (the embedding and each completed block: every
  earlier output in Full AttnRes and DenseFormer, every block sum for a block's phase 1 and
  the head in Block AttnRes) taps a shared bus that every such value joins once, instead of
  one edge per (value, reader) pair.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import (IR, Aggregation, BlockSum, Head, Partial, Streams,
                  two_phase_plan)
from ..words import counted

# columns, left to right: completed values, phase 1 (or streams), aggregation, partial
# sums, sublayers; the bus runs left of everything
COLUMN = {"bus": -0.7, "embedding": 0.0, "block": 0.0, "phase": 0.9, "streams": 0.9,
          "aggregation": 1.8, "partial": 2.7, "sublayer": 3.6, "head": 3.6}


@dataclass
class Box:
    id: str
    name: str           # as in model.code
    kind: str           # embedding|sublayer|block|partial|phase|streams|aggregation|head
    label: str          # lines separated by "\n"
    row: float
    block: int | None = None

    @property
    def col(self) -> float:
        return COLUMN[self.kind]


@dataclass
class Edge:
    src: str
    dst: str
    kind: str           # feeds|reads|sums|phase|bus|write


@dataclass
class Scene:
    title: str
    boxes: dict[str, Box] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    blocks: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    bus: tuple[float, float] | None = None  # rows the bus spans
    rows: float = 0.0

    def add(self, box: Box) -> None:
        self.boxes[box.id] = box

    def edge(self, src: str, dst: str, kind: str) -> None:
        self.edges.append(Edge(src, dst, kind))


def code_name(node) -> str:
    """The node's name in model.code (partial n.j is `partial{n}_{j}` there)."""
    if isinstance(node, Partial):
        return f"partial{node.block}_{node.j}"
    if isinstance(node, Aggregation):
        return f"h{node.index}"
    if isinstance(node, Head):
        return "logits"
    return node.id


def _options(a: Aggregation) -> str:
    if a.method == "attend":
        bits = [] if a.query == "static" else ["input-dep."]
        bits += [] if a.gate == "softmax" else [a.gate]
        bits += [] if a.key_norm == "rms" else ["no key norm"]
        bits += [] if a.heads == 1 else [f"{a.heads} heads"]
        return ", ".join(bits)
    if a.method == "scalars" and a.gate != "none":
        return a.gate
    if a.multi_stream:
        return "sum of streams" if a.is_head else "read"
    return ""


def _completed(g: IR, block: int) -> list[str]:
    """The embedding and the values of blocks 1..block-1 (a one-sublayer block's value is
    its sublayer's output)."""
    return ["embedding"] + [f"sublayer{b[0]}" if len(b) == 1 else f"block{n}"
                            for n, b in enumerate(g.blocks[:block - 1], start=1)]


def _on_bus(g: IR, block: int, reads) -> bool:
    """Whether a reader in `block` reads exactly every completed value (three or more)."""
    want = _completed(g, block)
    return len(want) >= 3 and list(reads) == want


def build_scene(g: IR, title: str) -> Scene:
    scene = Scene(title)
    L = g.n_sublayers
    groups = two_phase_plan(g)
    group_of = {m: k for k, grp in enumerate(groups) for m in grp.members}
    aggs = g.aggregations()
    read = {s for a in aggs for s in a.sources}
    bus: list[tuple[str, int]] = []  # (reader box, its block): what taps the bus

    scene.add(Box("embedding", "embedding", "embedding", "embedding\nv0 = b0", 0.0))
    for n, members in enumerate(g.blocks, start=1):
        scene.blocks.append((n, tuple(members)))
    for i in range(1, L + 1):
        sub = g.sublayer(i)
        scene.add(Box(sub.id, sub.id, "sublayer", f"sublayer{i}\n{sub.op}", i, sub.block))
    for a in aggs:
        extra = _options(a)
        label = f"h{a.index}: {a.method}" + (f"\n{extra}" if extra else "")
        scene.add(Box(a.id, f"h{a.index}", "aggregation", label, a.index - 0.35,
                      None if a.is_head else a.block))
        scene.edge(a.id, f"sublayer{a.index}" if not a.is_head else "head", "feeds")
    scene.add(Box("head", "logits", "head", "head\nnorm + LM head", L + 1))

    _running_sums(g, scene, read)
    for v in g.values():
        if isinstance(v, Streams):
            scene.add(Box(v.id, v.id, "streams", f"{v.id}\n{v.n} streams", v.index - 0.75))
    for k, grp in enumerate(groups):
        first = g.node(grp.members[0])
        phase = f"block{first.block}_phase1"
        # below the sum of the block before (it reads it: a tap reads what joined above it)
        # and above its first member's aggregation
        queries = counted(len(grp.members), "query", "queries")
        scene.add(Box(phase, phase, "phase", f"{phase}\n{queries}", first.index - 0.45,
                      first.block))
        if _on_bus(g, first.block, grp.completed):
            bus.append((phase, first.block))
        else:
            for s in grp.completed:
                scene.edge(_drawn(g, s), phase, "reads")
        for m in grp.members:
            scene.edge(phase, m, "phase")
    for a in aggs:
        if a.id in group_of:
            partial = a.sources[-1] if isinstance(g.node(a.sources[-1]), Partial) else None
            if partial is not None:
                scene.edge(_drawn(g, partial), a.id, "reads")
        elif not a.multi_stream and _on_bus(g, a.block, a.sources):
            bus.append((a.id, a.block))
        else:
            for s in a.sources:
                scene.edge(_drawn(g, s), a.id, "reads")
    if bus:
        for reader, _ in bus:
            scene.edge("bus", reader, "bus")
        for s in _completed(g, max(block for _, block in bus)):
            scene.edge(s, "bus", "bus")
        scene.bus = (0.0, max(scene.boxes[r].row for r, _ in bus))
    for u, v in g.edges():  # the n streams' write after sublayer l (and X_1 = n x v_0)
        if isinstance(g.node(v), Streams):
            scene.edge(u, v, "write")
    scene.rows = L + 1
    return scene


def _drawn(g: IR, node_id: str) -> str:
    """The box that carries `node_id`: p_n^2 is drawn as the block's first output."""
    node = g.node(node_id)
    if isinstance(node, Partial) and node.j == 2:
        return f"sublayer{node.members[0]}"
    return node_id


def _running_sums(g: IR, scene: Scene, read: set[str]) -> None:
    """Boxes and edges for the block and partial sums some aggregation reads, built as the
    code builds them: each from the previous partial and the next output."""
    longest: dict[int, int] = {}  # block -> members summed by the longest sum read
    for s in read:
        v = g.node(s)
        if isinstance(v, (BlockSum, Partial)):
            n = v.index if isinstance(v, BlockSum) else v.block
            longest[n] = max(longest.get(n, 0), len(v.members))
    for n, count in longest.items():
        members = g.blocks[n - 1]
        prev = f"sublayer{members[0]}"
        for j in range(3, count + 2):  # partial n.j sums members[:j-1]
            node = (g.node(f"block{n}") if j - 1 == len(members)
                    else g.node(f"partial{n}.{j}"))
            kind = "block" if isinstance(node, BlockSum) else "partial"
            name = code_name(node)
            label = f"{name}\n= {code_name_of(g, prev)} + sublayer{members[j - 2]}"
            # just after the output it adds (it joins the bus 0.12 lower: above the phase 1
            # of the next block, which reads it)
            scene.add(Box(node.id, name, kind, label, members[j - 2] + 0.3, n))
            scene.edge(prev, node.id, "sums")
            scene.edge(f"sublayer{members[j - 2]}", node.id, "sums")
            prev = node.id


def code_name_of(g: IR, node_id: str) -> str:
    return code_name(g.node(node_id))
