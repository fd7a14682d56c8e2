"""Build the topology IR (restopo.ir.graph.IR) from a Topology and the sublayer kinds.

Nodes (typed values of restopo.ir.nodes; ids are the names people see in `restopo inspect`):
  embedding        Embedding    v_0 = b_0, the token embedding
  sublayer{i}      Sublayer     v_i = f_i(h_i), i = 1..L
  block{n}         BlockSum     b_n, for blocks of two or more sublayers
  partial{n}.{j}   Partial      p_n^j, the sum of the first j-1 outputs of block n (j >= 2)
                                (running sums only as far as some aggregation reads them)
  agg{l}           Aggregation  h_l, l = 1..L+1 (L+1: before the head)
  head             Head         final norm and LM head
A multi-stream topology (restopo.topology.MULTI_STREAM_METHODS) has no block or partial
sums; instead
  streams{l}       Streams      X_l, the n streams before sublayer l, l = 1..L+1
with edges embedding -> streams1 (n copies) and streams{l}, sublayer{l}, agg{l} ->
streams{l+1} (the write X_{l+1} = R_l X_l + post_l (x) v_l uses agg{l}'s coefficients);
agg{l} reads streams{l}.
"""
from __future__ import annotations

from ..topology import STREAM_METHODS, Rule, Source, Topology
from .graph import IR
from .nodes import Aggregation, BlockSum, Embedding, Head, Partial, Streams, Sublayer


class TopologyError(ValueError):
    """A topology that cannot be built (raised with a message a person can act on)."""


def build_ir(kinds: tuple[str, ...], topology: Topology, width: int | None = None) -> IR:
    """The IR of `topology` over sublayers of the given kinds (attn|mlp, in order)."""
    L = len(kinds)
    _check_partition(topology.blocks, L)
    g = IR(name=topology.name, sublayers=L, kinds=tuple(kinds), width=width,
           blocks=tuple(tuple(b) for b in topology.blocks))
    g.add_value(Embedding())

    block_of, pos_in_block = {}, {}
    for n, members in enumerate(topology.blocks, start=1):
        for j, i in enumerate(members, start=1):
            block_of[i], pos_in_block[i] = n, j
    for i, k in enumerate(kinds, start=1):
        g.add_value(Sublayer(i, k, block_of[i]))
    if topology.sublayer_rule.multi_stream or topology.head_rule.multi_stream:
        return _multi_stream(g, topology)
    names = ["embedding"] + [f"sublayer{i}" for i in range(1, L + 1)]  # shared by all reads
    points = []
    for l in range(1, L + 2):
        head = l == L + 1
        rule = topology.head_rule if head else topology.sublayer_rule
        n = len(topology.blocks) + 1 if head else block_of[l]
        j = 0 if head else pos_in_block[l]
        sources = _resolve(rule, l, n, j, topology.blocks, names)
        if not sources:
            raise TopologyError(
                f"the aggregation before {'the head' if head else f'sublayer {l}'} reads no "
                f"source; add 'embedding' to its sources")
        points.append((l, head, rule, n, j, sources))
    _running_sums(g, topology.blocks, {s for *_, sources in points for s in sources})
    for l, head, rule, n, j, sources in points:
        agg = Aggregation(l, "head" if head else kinds[l - 1], rule.method, tuple(sources),
                          n, j, query=rule.query, gate=rule.gate, key_norm=rule.key_norm,
                          heads=rule.heads, window=_window(rule))
        g.add_value(agg)
        for p, s in enumerate(sources):
            g.add_edge(s, agg.id, position=p)
        g.add_edge(agg.id, "head" if head else f"sublayer{l}")
    g.add_value(Head(L + 1))
    return g


def _multi_stream(g: IR, topology: Topology) -> IR:
    rule, L = topology.sublayer_rule, g.n_sublayers
    if topology.head_rule != rule:
        raise TopologyError(f"a multi-stream topology reads its streams before every sublayer "
                            f"and sums them before the head; it needs the same rule for both, "
                            f"got {rule.method} and {topology.head_rule.method}")
    for l in range(1, L + 2):
        x = Streams(l, rule.streams)
        g.add_value(x)
        if l == 1:
            g.add_edge(Embedding.id, x.id)
        else:
            for prev in (f"streams{l - 1}", f"sublayer{l - 1}", f"agg{l - 1}"):
                g.add_edge(prev, x.id)
        head = l == L + 1
        agg = Aggregation(l, "head" if head else g.kinds[l - 1], rule.method, (x.id,),
                          1 if not head else len(topology.blocks) + 1, 0 if head else l,
                          gate=rule.gate, streams=rule.streams, dynamic=rule.dynamic,
                          sinkhorn=rule.sinkhorn)
        g.add_value(agg)
        g.add_edge(x.id, agg.id, position=0)
        g.add_edge(agg.id, "head" if head else f"sublayer{l}")
    g.add_value(Head(L + 1))
    return g


def _running_sums(g: IR, blocks, read: set[str]) -> None:
    """The block and partial sums some aggregation reads, with the partials they are summed
    from (none for a standard residual, one block of every sublayer that nobody reads)."""
    for n, members in enumerate(blocks, start=1):
        whole = f"block{n}" in read and len(members) >= 2
        last = len(members) if whole else max(
            (j for j in range(2, len(members) + 1) if f"partial{n}.{j}" in read), default=1)
        if whole:
            g.add_value(BlockSum(n, members))
            for i in members:
                g.add_edge(f"sublayer{i}", f"block{n}")
        for j in range(2, last + 1):
            # members as a range (blocks are contiguous) and p_n^j = p_n^{j-1} + v: two
            # edges, so a block of S sublayers costs O(S), not O(S^2)
            partial = Partial(n, j, range(members[0], members[j - 2] + 1))
            g.add_value(partial)
            if j > 2:
                g.add_edge(f"partial{n}.{j - 1}", partial.id)
            g.add_edge(f"sublayer{members[j - 2]}", partial.id)


def _window(rule: Rule) -> int | None:
    return next((s.window for s in rule.sources if s.name == "window"), None)


def _block_value(n: int, blocks) -> str:
    members = blocks[n - 1]
    return f"sublayer{members[0]}" if len(members) == 1 else f"block{n}"


def source_reads(kinds: tuple[str, ...], topology: Topology) -> int:
    """How many sources the aggregations of build_ir(kinds, topology) read in all (sources
    two selectors share are counted twice): the IR's size, in O(L) without building it."""
    L, count = len(kinds), 0
    if topology.sublayer_rule.multi_stream:  # every point reads its streams X_l alone
        return L + 1
    pos = {i: (n, j) for n, members in enumerate(topology.blocks, start=1)
           for j, i in enumerate(members, start=1)}
    for l in range(1, L + 2):
        rule = topology.head_rule if l == L + 1 else topology.sublayer_rule
        n, j = (len(topology.blocks) + 1, 0) if l == L + 1 else pos[l]
        selectors = _selectors(rule)
        count += sum({"embedding": 1, "sublayers": l - 1, "blocks": n - 1,
                      "partial": int(j >= 2)}.get(s.name, 0) for s in selectors)
        count += sum(min(s.window, l - 1) for s in selectors if s.name == "window")
    return count


def _selectors(rule: Rule) -> tuple[Source, ...]:
    return (Source("embedding"), Source("sublayers")) if rule.method in STREAM_METHODS \
        else rule.sources


def _resolve(rule: Rule, l: int, n: int, j: int, blocks, names) -> list[str]:
    """The ordered source ids that `rule` reads before aggregation point l.

    l is the aggregation index (L+1 for the head), n the block it sits in (N+1 for the
    head), j its position in that block; names[i] is the id of v_i. Duplicates are
    dropped, first occurrence kept.
    """
    out: dict[str, None] = {}  # ordered set: linear in the number of sources
    for s in _selectors(rule):
        if s.name == "embedding":
            ids = ["embedding"]
        elif s.name == "sublayers":
            ids = names[1:l]
        elif s.name == "window":
            ids = names[max(1, l - s.window):l]
        elif s.name == "blocks":
            ids = [_block_value(m, blocks) for m in range(1, n)]
        elif s.name == "partial":
            ids = [f"partial{n}.{j}"] if j >= 2 else []
        else:  # the checker rejects unknown names before this point
            raise TopologyError(f"unknown source {s.name!r}")
        out.update(dict.fromkeys(ids))
    return list(out)


def _check_partition(blocks, L: int) -> None:
    flat = [i for b in blocks for i in b]
    if flat != list(range(1, L + 1)) or any(len(b) == 0 for b in blocks):
        raise TopologyError(
            f"blocks must cover sublayers 1..{L} in order, each block non-empty; got {blocks}")
