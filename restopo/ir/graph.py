"""`IR`: the topology IR, a networkx DiGraph whose nodes each carry one typed value.

networkx keeps the graph (its algorithms, its DOT export); every node's meaning is the
frozen dataclass of restopo.ir.nodes stored with it, and the model-level facts (sublayer
kinds, block partition, width) are typed properties. Code outside restopo.ir reads the IR
only through these accessors, never through networkx's string-keyed attribute dicts.
"""
from __future__ import annotations

import networkx as nx

from .nodes import Aggregation, Node, Sublayer

_NODE = "node"  # the one attribute each networkx node carries: its typed value


class IR(nx.DiGraph):
    """The IR of one topology over L sublayers (see restopo.ir.build for what is in it).

    Edges are data flow: a source feeds an aggregation (edge attribute `position`, its
    place in the ordered sources), aggregation l feeds sublayer l (or the head), a sublayer
    feeds its block's sum and the partial sum after it; partial sums chain (p_n^j reads
    p_n^{j-1}), so the IR of a block of S sublayers has O(S) edges.
    """

    @property
    def topology(self) -> str:
        """The topology's name (standard, block_attnres, a custom section's label, ...)."""
        return self.graph["name"]

    @property
    def kinds(self) -> tuple[str, ...]:
        """attn | mlp of sublayers 1..L."""
        return self.graph["kinds"]

    @property
    def n_sublayers(self) -> int:
        return len(self.graph["kinds"])

    @property
    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """The block partition: contiguous runs of sublayer indices."""
        return self.graph["blocks"]

    @property
    def width(self) -> int | None:
        """d, when the IR was built with one (parameter counts and byte figures need it)."""
        return self.graph["width"]

    def add_value(self, value: Node) -> None:
        self.add_node(value.id, **{_NODE: value})

    def node(self, node_id: str) -> Node:
        """The typed value of node `node_id` (KeyError names the id when there is none).
        Read from the graph's own node dict: the analyses call this O(L^2) times for Full
        AttnRes, and networkx's `nodes` view costs several times more per lookup."""
        return self._node[node_id][_NODE]

    def values(self):
        """Every node's typed value, in insertion order."""
        return (data[_NODE] for _, data in self.nodes(data=True))

    def sublayer(self, i: int) -> Sublayer:
        return self.nodes[f"sublayer{i}"][_NODE]

    def aggregation(self, l: int) -> Aggregation:
        """h_l, l = 1..L+1 (L+1: before the head)."""
        return self.nodes[f"agg{l}"][_NODE]

    def aggregations(self) -> tuple[Aggregation, ...]:
        """Every aggregation point in execution order, the head's last."""
        return tuple(self.aggregation(l) for l in range(1, self.n_sublayers + 2))
