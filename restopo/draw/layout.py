"""The matplotlib drawing of the IR, for machines without Graphviz: a layered layout with
the same boxes, names and edge classes as the DOT picture (restopo.draw.dot)."""
from __future__ import annotations

from ..ir import IR, Aggregation
from .dot import drawn_nodes, kind, label

_COLUMN = {"embedding": 0.0, "aggregation": 1.2, "sublayer": 2.4, "partial": 3.4,
           "block": 4.2, "head": 2.4, "streams": 0.0}
_COLOR = {"embedding": "#cfe8ff", "sublayer": "#ffe9c7", "block": "#d9f2d0",
          "partial": "#eef8ea", "aggregation": "#f3e1ff", "head": "#cfe8ff",
          "streams": "#fde2e2"}


def layered_positions(g: IR, keep) -> dict:
    """Rows in execution order (the embedding on top, the head at the bottom); columns by
    kind: values read by aggregations on the left and right, aggregations and sublayers
    in the middle."""
    L = g.n_sublayers
    pos = {}
    for n in keep:
        node, k = g.node(n), kind(g.node(n))
        if k == "embedding":
            row = 0.0
        elif k == "aggregation":
            row = node.index - 0.4 if not node.is_head else L + 1.3
        elif k == "sublayer":
            row = float(node.index)
        elif k == "partial":
            row = node.produced + 0.5
        elif k == "block":
            row = node.produced + 0.6
        elif k == "streams":  # X_l between the previous sublayer and its own read
            row = node.index - 0.55 if node.index <= L else L + 0.7
        else:
            row = L + 2.0
        pos[n] = (_COLUMN[k], -row)
    return pos


def draw_matplotlib(g: IR, title: str, out: str, fmt: str) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.patches import FancyBboxPatch

    keep = drawn_nodes(g)
    sub = g.subgraph(keep)
    pos = layered_positions(g, keep)
    L = g.n_sublayers
    fig, ax = plt.subplots(figsize=(9, max(4.0, 0.6 * (L + 3))))
    for b, members in enumerate(g.blocks, start=1):
        top, bottom = -(members[0] - 0.75), -(members[-1] + 0.85)
        ax.add_patch(FancyBboxPatch((0.75, bottom), 3.95, top - bottom,
                                    boxstyle="round,pad=0.02", fc="#f7f7f7", ec="#999999",
                                    ls="--", lw=0.8, zorder=0))
        ax.text(4.8, (top + bottom) / 2, f"block {b}", va="center", fontsize=8, color="#555555")
    kinds = {n: kind(g.node(n)) for n in keep}
    member = [(u, v) for u, v in sub.edges() if kinds[v] in ("block", "partial")]
    writes = [(u, v) for u, v in sub.edges()  # n streams: X_l, v_l and the coefficients
              if kinds[v] == "streams" and kinds[u] != "embedding"]
    feeds = [(u, v) for u, v in sub.edges() if isinstance(g.node(u), Aggregation)]
    reads = [(u, v) for u, v in sub.edges() if isinstance(g.node(v), Aggregation)]
    common = dict(ax=ax, arrows=True, arrowsize=7, node_size=700)
    nx.draw_networkx_edges(sub, pos, edgelist=member, width=0.4, style="dotted",
                           edge_color="#aaaaaa", connectionstyle="arc3,rad=0.1", **common)
    nx.draw_networkx_edges(sub, pos, edgelist=reads, width=0.6, edge_color="#3b6fb6",
                           alpha=0.7, connectionstyle="arc3,rad=0.2", **common)
    nx.draw_networkx_edges(sub, pos, edgelist=feeds, width=1.4, edge_color="#333333", **common)
    nx.draw_networkx_edges(sub, pos, edgelist=writes, width=0.8, edge_color="#c0504d",
                           style="dashed", connectionstyle="arc3,rad=0.15", **common)
    for k, shape in (("aggregation", "o"), ("embedding", "s"), ("sublayer", "s"),
                     ("partial", "s"), ("block", "s"), ("head", "s"), ("streams", "D")):
        nodes = [n for n in keep if kinds[n] == k]
        if nodes:
            nx.draw_networkx_nodes(sub, pos, nodelist=nodes, node_shape=shape, node_size=700,
                                   node_color=_COLOR[k], edgecolors="#444444",
                                   linewidths=0.6, ax=ax)
    labels = {n: label(g, n).replace("\\n", "\n") for n in keep}
    nx.draw_networkx_labels(sub, pos, labels=labels, font_size=5, ax=ax)
    legend = ("red dashed: the streams' write X_{l+1} = R X_l + post v_l" if writes else
              "dotted: block and partial sums")
    ax.set_title(title + f"\nblue: what each aggregation reads; {legend}", fontsize=9)
    ax.set_xlim(-0.6, 5.4)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(out, format=fmt, dpi=150)
    plt.close(fig)
