"""The one walk over the IR (restopo.ir.walk): the order it visits, that a model run as
consecutive spans equals one run, and that the eager visitor computes what the lowered fx
model computes."""
from pathlib import Path

import pytest
import torch

from restopo import topology as T
from restopo.api import build_model
from restopo.ir import Aggregation, build_ir, two_phase_plan
from restopo.ir.walk import Visitor, walk
from restopo.nn.run import EagerRun
from restopo.spec import load_spec
from restopo.spec.objects import ModelSpec

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.restopo"))
M = ModelSpec(vocab=64, width=16, depth=3, heads=2, context=8)

TOPOLOGIES = {
    "standard": T.standard(M.kinds),
    "full": T.full_attnres(M.kinds),
    "block2": T.block_attnres(M.kinds, blocks=2),
    "block_size4": T.block_attnres(M.kinds, block_size=4),
    "window2": T.full_attnres(M.kinds, window=2),
    "denseformer": T.denseformer(M.kinds),
    "rezero": T.rezero(M.kinds),
    "highway": T.highway(M.kinds),
    "mhc": T.mhc(M.kinds, 4),
    "dhc3": T.hyper_connections(M.kinds, 3, dynamic=True),
    "mhc_lite2": T.mhc_lite(M.kinds, 2),
}


class Trace(Visitor):
    """Writes down every step as text; values are the step's own name."""

    def __init__(self):
        self.steps, self.points = [], []

    def embedding(self):
        self.steps.append("embedding")
        return "v0"

    def sublayer(self, node, h):
        self.steps.append(f"sublayer{node.index}({h})")
        return f"v{node.index}"

    def add(self, a, b, name):
        self.steps.append(f"{name}={a}+{b}")
        return name

    def stream_update(self, agg, h_prev, v_prev):
        return self._call(agg, [h_prev, v_prev])

    def aggregate(self, agg, sources):
        return self._call(agg, sources)

    def phase1(self, k, group, completed):
        self.steps.append(f"phase1[{k}]({','.join(completed)})")
        return f"p{k}"

    def phase2(self, agg, phase1, slot, partial):
        return self._call(agg, [f"{phase1}[{slot}]"] + ([partial] if partial else []))

    def expand(self, agg, v0):
        self.steps.append(f"x1=expand({v0})")
        return "x1"

    def read(self, agg, x):
        self.steps.append(f"h{agg.index}=read{agg.index}({x})")
        return f"h{agg.index}", f"c{agg.index}"

    def write(self, agg, x, v, coefficients):
        self.steps.append(f"x{agg.index + 1}=write({x},{v},{coefficients})")
        return f"x{agg.index + 1}"

    def head(self, h):
        self.steps.append(f"head({h})")
        return "logits"

    def aggregated(self, agg, inputs, h, stream):
        self.points.append((agg.index, stream))

    def _call(self, agg, args):
        self.steps.append(f"h{agg.index}=agg{agg.index}({','.join(args)})")
        return f"h{agg.index}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_point_once_in_order(path):
    g = load_spec(path).ir()
    L = g.n_sublayers
    for groups in ((), two_phase_plan(g)):
        t = Trace()
        w = walk(g, t, groups)
        assert [l for l, _ in t.points] == list(range(1, L + 2))
        subs = [s for s in t.steps if s.startswith("sublayer")]
        assert [s.split("(")[0] for s in subs] == [f"sublayer{i}" for i in range(1, L + 1)]
        assert t.steps[0] == "embedding" and t.steps[-1].startswith("head(")
        assert w.output == "logits"
        assert sum(s.startswith("phase1") for s in t.steps) == len(groups)


def test_block_steps_read_as_the_paper_says():
    """Block AttnRes, 2 blocks of 4 sublayers, two-phase: phase 1 once per block over the
    completed blocks; each sublayer merges its own pre-update partial."""
    g = build_ir(T.sublayer_kinds(4), T.block_attnres(T.sublayer_kinds(4), blocks=2))
    t = Trace()
    walk(g, t, two_phase_plan(g))
    assert t.steps == [
        "embedding",
        "phase1[0](v0)", "h1=agg1(p0[0])", "sublayer1(h1)",
        "h2=agg2(p0[1],v1)", "sublayer2(h2)",
        "partial1_3=v1+v2", "h3=agg3(p0[2],partial1_3)", "sublayer3(h3)",
        "partial1_4=partial1_3+v3", "h4=agg4(p0[3],partial1_4)", "sublayer4(h4)",
        "block1=partial1_4+v4",
        "phase1[1](v0,block1)", "h5=agg5(p1[0])", "sublayer5(h5)",
        "h6=agg6(p1[1],v5)", "sublayer6(h6)",
        "partial2_3=v5+v6", "h7=agg7(p1[2],partial2_3)", "sublayer7(h7)",
        "partial2_4=partial2_3+v7", "h8=agg8(p1[3],partial2_4)", "sublayer8(h8)",
        "block2=partial2_4+v8", "h9=agg9(v0,block1,block2)", "head(h9)"]


def test_stream_steps():
    """A standard residual keeps one running value; ReZero calls its module on it."""
    kinds = T.sublayer_kinds(1)
    t = Trace()
    walk(build_ir(kinds, T.standard(kinds)), t)
    assert t.steps == ["embedding", "sublayer1(v0)", "h2=v0+v1", "sublayer2(h2)",
                       "h3=h2+v2", "head(h3)"]
    assert t.points == [(1, True), (2, True), (3, True)]
    t = Trace()
    walk(build_ir(kinds, T.rezero(kinds)), t)
    assert t.steps[1:4] == ["sublayer1(v0)", "h2=agg2(v0,v1)", "sublayer2(h2)"]


def test_multi_stream_steps():
    """n streams: expanded from the embedding, read before each sublayer, written after it
    with that read's coefficients; the head's point sums the last streams."""
    kinds = T.sublayer_kinds(1)
    t = Trace()
    walk(build_ir(kinds, T.mhc(kinds, 4)), t)
    assert t.steps == ["embedding", "x1=expand(v0)", "h1=read1(x1)", "sublayer1(h1)",
                       "x2=write(x1,v1,c1)", "h2=read2(x2)", "sublayer2(h2)",
                       "x3=write(x2,v2,c2)", "h3=agg3(x3)", "head(h3)"]
    assert t.points == [(1, False), (2, False), (3, False)]


def _model(name, seed=0):
    torch.manual_seed(seed)
    model = build_model(M, TOPOLOGIES[name], backend="eager").double()
    with torch.no_grad():  # away from init, so every weight matters
        for agg in model.aggregations:
            for p in agg.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    return model


def _run(model, idx, **kw):
    gm = model
    return EagerRun(sublayers=gm.sublayers, aggregations=gm.aggregations, embed=gm.embed,
                    head=gm.head, idx=idx, **kw)


class SpanRun(EagerRun):
    """Values from before the span: whatever an earlier span computed under that name."""

    def __init__(self, before: dict, **kw):
        super().__init__(**kw)
        self.before = before

    def provide(self, node):
        return self.before.get(node.id)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_eager_walk_equals_the_lowered_model(name):
    model = _model(name)
    idx = torch.randint(0, M.vocab, (2, M.context))
    cos, sin = model.context(idx, model.embed(idx))
    g = model.restopo_ir
    for groups in ((), two_phase_plan(g)):
        from restopo.nn.aggregate import TwoPhase
        phases = [TwoPhase([model.aggregations[g.node(m).index - 1] for m in grp.members])
                  for grp in groups]
        out = walk(g, _run(model, idx, context=(cos, sin), phases=phases), groups).output
        torch.testing.assert_close(out, model(idx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_spans_chain_to_the_whole_model(name):
    """Cut the sublayers anywhere into two spans: the second span, given only what the
    first computed, gives the whole model's logits (running sums straddling the cut are
    rebuilt from what came before, the stream is carried)."""
    model = _model(name)
    idx = torch.randint(0, M.vocab, (2, M.context))
    ctx = model.context(idx, model.embed(idx))
    g, L = model.restopo_ir, model.restopo_ir.n_sublayers
    whole = walk(g, _run(model, idx, context=ctx)).output
    for cut in range(1, L):
        first = walk(g, _run(model, idx, context=ctx), span=(1, cut))
        assert first.output is None
        second = walk(g, SpanRun(first.values, sublayers=model.sublayers,
                                 aggregations=model.aggregations, head=model.head,
                                 context=ctx), span=(cut + 1, L))
        torch.testing.assert_close(second.output, whole, rtol=0, atol=0)


def test_a_span_without_what_it_needs_says_so():
    model = _model("full")
    g = model.restopo_ir
    run = SpanRun({}, sublayers=model.sublayers, aggregations=model.aggregations,
                  head=model.head)
    with pytest.raises(RuntimeError, match="embedding is needed but was neither computed in this span nor provided"):
        walk(g, run, span=(2, g.n_sublayers))


def test_every_aggregation_module_states_its_input_weights():
    """forward(*inputs) == sum_i input_weights(*inputs)_i * inputs_i for every module the
    lowering makes (the one method diagnose reads)."""
    for name in sorted(TOPOLOGIES):
        model = _model(name)
        g = model.restopo_ir
        if g.aggregation(1).multi_stream:
            continue  # their modules state (pre, post, R): tests/test_multistream_fp64.py
        for a, m in zip(g.aggregations(), model.aggregations):
            stream = a.method in T.STREAM_METHODS
            n = (1 if a.index == 1 else 2) if stream else len(a.sources)
            xs = [torch.randn(2, 3, M.width, dtype=torch.float64) for _ in range(n)]
            w = m.input_weights(*xs)
            assert len(w) == n
            torch.testing.assert_close(sum(wi * x for wi, x in zip(w, xs)), m(*xs))
    assert isinstance(g.aggregation(1), Aggregation)
