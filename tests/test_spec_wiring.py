"""Each named one-liner and its wiring spelled out as `residual custom { ... }` build the
same IR (nodes with their data, edges with theirs; only the graph's name may differ)."""
from __future__ import annotations

import networkx as nx
import pytest

from restopo.spec import parse_spec

MODEL = "model { vocab: 256; width: 64; depth: 6; heads: 4; context: 32 }\n"

PAIRS = [
    ("standard",
     "blocks: 1\n before sublayer: sum(embedding, sublayers)"),
    ("full_attnres",
     "before sublayer: attend(embedding, sublayers)\n before head: attend(embedding, sublayers)"),
    ("full_attnres(query: input_dependent, gate: sigmoid, key_norm: none, heads: 4)",
     "before sublayer: attend(embedding, sublayers; query: input_dependent, gate: sigmoid, "
     "key_norm: none, heads: 4)"),
    ("full_attnres(window: 3)",
     "before sublayer: attend(embedding, window(3))"),
    ("block_attnres(blocks: 3)",
     "blocks: 3\n before sublayer: attend(embedding, blocks, partial)\n"
     " before head: attend(embedding, blocks)"),
    ("block_attnres(blocks: 4, heads: 16, key_norm: none)",
     "blocks: 4\n before sublayer: attend(embedding, blocks, partial; heads: 16, key_norm: none)"),
    ("block_attnres(block_size: 4)",
     "block_size: 4; before sublayer: attend(embedding, blocks, partial)"),
    ("block_attnres(blocks: 12)",  # N = L: one block per sublayer
     "blocks: 12\n before sublayer: attend(embedding, blocks, partial)"),
    ("standard", "before sublayer: sum(embedding, sublayers)"),  # one stream: one block
    ("rezero", "blocks: 1\n before sublayer: rezero()"),
    ("rezero", "before sublayer: rezero()"),
    ("layerscale", "blocks: 1\n before sublayer: layerscale(embedding, sublayers)"),
    ("layerscale", "before sublayer: layerscale()"),
    ("highway", "blocks: 1\n before sublayer: highway"),
    ("highway", "before sublayer: highway(embedding, sublayers)"),
    ("denseformer", "before sublayer: scalars(embedding, sublayers)"),
    ("denseformer(gate: none)", "before sublayer: scalars(embedding, sublayers)"),
    ("denseformer(gate: softmax)",
     "before sublayer: scalars(embedding, sublayers; gate: softmax)\n"
     " before head: scalars(embedding, sublayers; gate: softmax)"),
    ("denseformer(gate: sigmoid)", "before sublayer: scalars(embedding, sublayers; gate: sigmoid)"),
    ("hyper_connections(streams: 4)", "before sublayer: hyper_connections(streams: 4)"),
    ("hyper_connections(streams: 2, dynamic: true)",
     "before sublayer: hyper_connections(streams: 2; dynamic: true)"),
    ("mhc(streams: 4)", "before sublayer: mhc(streams: 4, sinkhorn: 20)"),
    ("mhc(streams: 3, sinkhorn: 7)", "before sublayer: mhc(sinkhorn: 7, streams: 3)"),
    ("mhc_lite(streams: 4)", "before sublayer: mhc_lite(streams: 4)"),
]


def graph_data(g: nx.DiGraph):
    nodes = sorted((n, sorted(d.items())) for n, d in g.nodes(data=True))
    edges = sorted((u, v, sorted(d.items())) for u, v, d in g.edges(data=True))
    meta = sorted((k, v) for k, v in g.graph.items() if k != "name")
    return nodes, edges, meta


@pytest.mark.parametrize("one_liner,wiring", PAIRS, ids=[p[0] for p in PAIRS])
def test_one_liner_equals_spelled_out_wiring(one_liner, wiring):
    named = parse_spec(MODEL + f"residual {one_liner}\n")
    custom = parse_spec(MODEL + "residual custom {\n " + wiring + "\n}\n")
    assert named.residual.form == "named" and custom.residual.form == "custom"
    assert named.topology.blocks == custom.topology.blocks
    assert named.topology.sublayer_rule == custom.topology.sublayer_rule
    assert named.topology.head_rule == custom.topology.head_rule
    assert graph_data(named.ir()) == graph_data(custom.ir())


def test_block_with_one_block_per_sublayer_is_full_attnres():
    block = parse_spec(MODEL + "residual block_attnres(blocks: 12)").ir()
    full = parse_spec(MODEL + "residual custom { before sublayer: attend(embedding, sublayers) }")
    assert graph_data(block) == graph_data(full.ir())


def test_different_wirings_differ():
    """The comparison can fail: a changed option or block count changes the IR."""
    a = parse_spec(MODEL + "residual block_attnres(blocks: 3)").ir()
    b = parse_spec(MODEL + "residual block_attnres(blocks: 2)").ir()
    c = parse_spec(MODEL + "residual block_attnres(blocks: 3, gate: sigmoid)").ir()
    assert graph_data(a) != graph_data(b) and graph_data(a) != graph_data(c)
    streams = [parse_spec(MODEL + f"residual {r}").ir() for r in (
        "mhc(streams: 4)", "mhc(streams: 2)", "mhc(streams: 4, sinkhorn: 5)",
        "mhc_lite(streams: 4)", "hyper_connections(streams: 4)",
        "hyper_connections(streams: 4, dynamic: true)")]
    assert all(graph_data(x) != graph_data(y) for i, x in enumerate(streams)
               for y in streams[i + 1:])


def test_softmax_scalars_are_not_denseformer():
    """Static per-source scalars under a softmax (the AttnRes ablation) build a different IR
    from DenseFormer's raw scalars: the aggregations carry the gate; the sources and the
    parameter count (one scalar per source) are the same."""
    from restopo.ir import added_parameters, summary
    dense = parse_spec(MODEL + "residual denseformer").ir()
    soft = parse_spec(MODEL + "residual custom { before sublayer: scalars(embedding, "
                      "sublayers; gate: softmax) }").ir()
    assert graph_data(dense) != graph_data(soft)
    assert {a.gate for a in dense.aggregations()} == {"none"}
    assert {a.gate for a in soft.aggregations()} == {"softmax"}
    assert [a["sources"] for a in summary(dense)["aggregations"]] == \
        [a["sources"] for a in summary(soft)["aggregations"]]
    assert added_parameters(dense) == added_parameters(soft) == sum(range(1, 12 + 2))
    assert {a["gate"] for a in summary(soft)["aggregations"]} == {"softmax"}
    assert {a["gate"] for a in summary(dense)["aggregations"]} == {"none"}


def test_scalars_gate_by_override():
    spec = parse_spec(MODEL + "residual denseformer\n", overrides=("residual.gate=softmax",))
    assert spec.topology.sublayer_rule.gate == spec.topology.head_rule.gate == "softmax"
    assert graph_data(spec.ir()) == graph_data(
        parse_spec(MODEL + "residual denseformer(gate: softmax)").ir())


def test_every_named_topology_is_covered():
    from restopo.topology import NAMED
    covered = {p[0].split("(")[0] for p in PAIRS}
    assert covered == set(NAMED)


def test_sublayers_that_reach_nothing_the_head_reads(monkeypatch):
    """topology.unread_sublayers (O(L), no IR) names exactly the sublayers that are not
    ancestors of the head's aggregation in the IR, over every small custom wiring of these
    selectors; `check` refuses a spec with any (it said 'ok' to a model that trains as an
    embedding and a head), at the rule that leaves them out."""
    import itertools

    import networkx as nx

    from restopo import topology as T
    from restopo.spec import SpecError, parse_spec
    unread = T.unread_sublayers
    model = "model t { vocab: 32; width: 16; depth: 3; heads: 2; context: 8 }\n"
    selectors = ["sublayers", "window(1)", "window(2)", "blocks", "partial"]
    seen = {"none": 0, "some": 0, "all": 0}
    for k in (0, 1, 2):
        for sub in itertools.combinations(selectors, k):
            for head in (None, (), ("window(1)",), ("blocks",), ("sublayers",)):
                for blocks in ("", "block_size: 2\n", "blocks: 2\n"):
                    rules = f"before sublayer: attend({', '.join(('embedding',) + sub)})\n"
                    if head is not None:
                        rules += f"before head: attend({', '.join(('embedding',) + head)})\n"
                    text = model + "residual custom {\n" + blocks + rules + "}\n"
                    with monkeypatch.context() as m:  # the spec as it was accepted before
                        m.setattr(T, "unread_sublayers", lambda topology: [])
                        try:
                            spec = parse_spec(text)
                        except SpecError:
                            continue  # refused for another reason (partial with no blocks)
                    g = spec.ir()
                    L = g.n_sublayers
                    reached = nx.ancestors(g, f"agg{L + 1}")
                    want = [i for i in range(1, L + 1) if f"sublayer{i}" not in reached]
                    assert unread(spec.topology) == want, text
                    seen["none" if not want else "all" if len(want) == L else "some"] += 1
                    if want:
                        with pytest.raises(SpecError, match="would never train"):
                            parse_spec(text)
                    else:
                        parse_spec(text)
    assert min(seen.values()) > 0, seen  # each outcome met
    cases = {"some": "before head: attend(embedding, window(2))",
             "all": "before head: attend(embedding)"}
    for case, head in cases.items():
        text = model + f"residual custom {{\n  before sublayer: attend(embedding)\n  {head}\n}}\n"
        with pytest.raises(SpecError) as e:
            parse_spec(text)
        line = str(e.value).splitlines()[0]
        assert ":4:16:" in line and (("sublayers 1..4 (4 of 6)" in line) if case == "some"
                                     else "no sublayer's output reaches the head" in line)


@pytest.mark.parametrize("rule", ["sum(embedding, sublayers)", "rezero()",
                                  "attend(embedding, sublayers)",
                                  "scalars(embedding, window(2))"])
@pytest.mark.parametrize("blocks", ["blocks: 3", "block_size: 4"])
def test_blocks_that_no_rule_reads_are_refused(rule, blocks):
    """Blocks given to wiring that reads neither 'blocks' nor 'partial' were said ok ('3
    blocks') and changed nothing but the sums made for no reader; they are refused at the
    key. `blocks: 1` (no blocks) stays the one-stream default."""
    from restopo.spec import SpecError
    text = MODEL + "residual custom {\n " + blocks + "\n before sublayer: " + rule + "\n}\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    err = info.value
    key = blocks.split(":")[0]
    assert (err.line, err.column) == (3, 2)
    assert err.message == f"'{key}' has no effect here: no rule reads 'blocks' or 'partial'"
    assert err.hint.startswith(f"remove '{key}'")
    parse_spec(text.replace(blocks, "blocks: 1"))
    # a head that reads the blocks is a reader
    parse_spec(text.replace("\n}", "\n before head: attend(embedding, blocks)\n}"))


@pytest.mark.parametrize("residual", ["standard", "rezero", "denseformer", "full_attnres",
                                      "block_attnres(blocks: 3)", "block_attnres(block_size: 4)",
                                      "custom { blocks: 2; before sublayer: attend(embedding, "
                                      "blocks, partial); before head: attend(embedding, "
                                      "sublayers) }",
                                      "custom { blocks: 3; before sublayer: attend(embedding, "
                                      "sublayers); before head: sum(embedding, blocks) }"])
def test_the_ir_holds_no_running_sum_that_nothing_reads(residual):
    """A standard residual is one block of every sublayer, and the IR held its block sum
    and L - 1 partial sums that no aggregation reads (the lowering builds sums on first
    use, so only the IR carried them). Each running sum now feeds an aggregation, itself or
    through the later partial or block sum it is summed into."""
    from restopo.ir import Aggregation, BlockSum, Partial
    g = parse_spec(MODEL + f"residual {residual}\n").ir()
    sums = [v for v in g.values() if isinstance(v, (BlockSum, Partial))]

    def feeds(v) -> bool:
        if any(isinstance(g.node(s), Aggregation) for s in g.successors(v.id)):
            return True
        n = v.block if isinstance(v, Partial) else None
        later = [w for w in sums if isinstance(w, Partial) and w.block == n and w.j == v.j + 1]
        later += [w for w in sums if isinstance(w, BlockSum) and w.index == n
                  and len(w.members) == v.j]
        return isinstance(v, Partial) and any(feeds(w) for w in later)

    assert [v.id for v in sums if not feeds(v)] == []
    if residual == "standard":
        assert sums == []
