"""The matplotlib drawing of the IR's picture (restopo.draw.scene), for machines without
Graphviz: one row per sublayer in execution order, columns by kind, every label inside its
box, each block a shaded band."""
from __future__ import annotations

from ..ir import IR
from .scene import COLUMN, Scene, build_scene

_COLOR = {"embedding": "#cfe8ff", "sublayer": "#ffe9c7", "block": "#d9f2d0",
          "partial": "#eef8ea", "phase": "#e8e1ff", "streams": "#fde2e2",
          "aggregation": "#f3e1ff", "head": "#cfe8ff"}
_EDGE = {  # color, width, style, curvature
    "feeds": ("#333333", 1.2, "-", 0.0), "reads": ("#3b6fb6", 0.7, "-", 0.15),
    "phase": ("#7a5cc4", 0.7, "--", 0.0), "sums": ("#999999", 0.6, ":", 0.0),
    "bus": ("#3b6fb6", 0.7, "-", 0.0), "write": ("#c0504d", 0.7, "--", 0.1),
}
ROW_INCHES = 0.42


def draw_matplotlib(g: IR, title: str, out: str, fmt: str) -> None:
    draw_scene(build_scene(g, title), out, fmt)


def draw_scene(scene: Scene, out: str, fmt: str) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    rows = scene.rows + 1.5
    fig, ax = plt.subplots(figsize=(9.5, max(4.0, ROW_INCHES * rows + 1.2)))
    ax.set_xlim(COLUMN["bus"] - 0.6, COLUMN["sublayer"] + 0.8)
    ax.set_ylim(-(scene.rows + 0.8), 0.8)
    ax.set_axis_off()
    fs = 6.5 if scene.rows <= 40 else 5.5
    banded = 1 < len(scene.blocks) < scene.rows - 1  # one block, or one per sublayer: none
    for n, members in scene.blocks if banded else ():  # a band per block, on the right
        top, bottom = -(members[0] - 0.95), -(members[-1] + 0.75)
        ax.add_patch(Rectangle((COLUMN["embedding"] - 0.45, bottom),
                               COLUMN["sublayer"] - COLUMN["embedding"] + 0.9, top - bottom,
                               fc="#f4f4f4" if n % 2 else "#ebebeb", ec="#bbbbbb", lw=0.5,
                               zorder=0))
        ax.text(COLUMN["sublayer"] + 0.5, (top + bottom) / 2, f"block {n}", rotation=90,
                va="center", ha="center", fontsize=fs + 0.5, color="#666666")
    boxes = {}
    for b in scene.boxes.values():
        boxes[b.id] = ax.text(b.col, -b.row, b.label, ha="center", va="center", fontsize=fs,
                              zorder=3, bbox=dict(boxstyle="round,pad=0.3", fc=_COLOR[b.kind],
                                                  ec="#555555", lw=0.5))
    if scene.bus is not None:  # the bus: outputs join it once, readers tap it once
        x = COLUMN["bus"]
        ax.plot([x, x], [-scene.bus[0], -scene.bus[1]], color="#3b6fb6", lw=2.2, zorder=1,
                solid_capstyle="round")
    for e in scene.edges:
        color, width, style, rad = _EDGE[e.kind]
        if e.dst == "bus":  # a value joins the bus, just below its box
            box = scene.boxes[e.src]
            ax.plot([COLUMN["bus"], box.col - 0.3], [-box.row - 0.12] * 2, color="#999999",
                    lw=0.5, zorder=1)
            continue
        if e.src == "bus":  # a reader taps it
            box = scene.boxes[e.dst]
            ax.annotate("", xy=(box.col - 0.32, -box.row), xytext=(COLUMN["bus"], -box.row),
                        arrowprops=dict(arrowstyle="-|>", color=color, lw=width,
                                        mutation_scale=6), zorder=1)
            continue
        a, b = scene.boxes[e.src], scene.boxes[e.dst]
        ax.add_patch(FancyArrowPatch(  # centre to centre, clipped at the two boxes
            posA=(a.col, -a.row), posB=(b.col, -b.row), patchA=boxes[e.src].get_bbox_patch(),
            patchB=boxes[e.dst].get_bbox_patch(), arrowstyle="-|>", mutation_scale=6,
            color=color, lw=width, linestyle=style, connectionstyle=f"arc3,rad={rad}",
            zorder=2, shrinkA=1, shrinkB=1))
    legend = ["black: h_l feeds sublayer l; blue: what an aggregation reads"]
    kinds = {e.kind for e in scene.edges}
    if "sums" in kinds:
        legend.append("dotted: the running block and partial sums")
    if "phase" in kinds:
        legend.append("purple: a block's phase 1 reads the completed blocks once and feeds "
                      "each of its sublayers")
    if "bus" in kinds:
        legend.append("left bus: every value joins it once (grey); a tap (blue) reads every "
                      "value that joined above it")
    if "write" in kinds:
        legend.append("red dashed: the streams' write X_{l+1} = R X_l + post v_l")
    ax.set_title(scene.title + "\n" + "\n".join(legend), fontsize=7.5)
    fig.tight_layout()
    fig.savefig(out, format=fmt, dpi=150)
    plt.close(fig)
