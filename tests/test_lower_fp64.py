"""Every lowering (direct and two-phase) against tests/reference.py's naive loop, in fp64,
with random (non-zero) aggregation parameters."""
from types import SimpleNamespace

import pytest
import torch

import reference
from restopo import topology as T
from restopo.api import build_model, direct
from restopo.ir import added_parameters, build_ir
from restopo.topology import BLOCK_SOURCES, Rule, Source, Topology

VOCAB, D = 37, 16


def cfg(depth=3, mlp="swiglu"):
    return SimpleNamespace(vocab=VOCAB, width=D, depth=depth, heads=2, mlp=mlp, mlp_ratio=2,
                           context=16)


def randomise(model, seed=0):
    """Random non-zero values for every aggregation parameter (queries, gains, scalars...)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for agg in model.aggregations:
            for p in agg.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.7)
    return model


def window(kinds, w):
    rule = Rule("attend", (Source("embedding"), Source("window", w)))
    return Topology("window", tuple((i,) for i in range(1, len(kinds) + 1)), rule, rule)


def custom_sum_blocks(kinds):
    rule = Rule("sum", BLOCK_SOURCES)
    head = Rule("sum", (Source("embedding"), Source("blocks")))
    return Topology("sum_blocks", T.partition_by_count(kinds, 2), rule, head)


def mixed_head(kinds, head_method):
    """Sigmoid-gated Full AttnRes before each sublayer, a different method at the head."""
    from restopo.topology import STANDARD_SOURCES
    return Topology(f"head_{head_method}", tuple((i,) for i in range(1, len(kinds) + 1)),
                    Rule("attend", STANDARD_SOURCES, gate="sigmoid"),
                    Rule(head_method, STANDARD_SOURCES))


def block_scalars(kinds, gate):
    """Static per-source scalars over the blocks and the partial (Block wiring, no query)."""
    rule = Rule("scalars", BLOCK_SOURCES, gate=gate)
    head = Rule("scalars", (Source("embedding"), Source("blocks")), gate=gate)
    return Topology(f"block_scalars_{gate}", T.partition_by_count(kinds, 2), rule, head)


def topologies(depth):
    k = T.sublayer_kinds(depth)
    yield "standard", T.standard(k)
    yield "full", T.full_attnres(k)
    for n in sorted({1, 2, depth, 2 * depth}):
        yield f"block{n}", T.block_attnres(k, blocks=n)
    yield "block_size2", T.block_attnres(k, block_size=2)
    yield "block_size4", T.block_attnres(k, block_size=4)
    yield "full_input_dependent", T.full_attnres(k, query="input_dependent")
    yield "full_sigmoid", T.full_attnres(k, gate="sigmoid")
    yield "full_no_key_norm", T.full_attnres(k, key_norm="none")
    yield "full_heads2", T.full_attnres(k, heads=2)
    yield "full_heads4", T.full_attnres(k, heads=4)
    yield "block2_heads4", T.block_attnres(k, blocks=2, heads=4)
    yield "block2_no_key_norm", T.block_attnres(k, blocks=2, key_norm="none")
    yield "block2_input_dependent", T.block_attnres(k, blocks=2, query="input_dependent")
    yield "block2_sigmoid", T.block_attnres(k, blocks=2, gate="sigmoid")
    yield "window2", window(k, 2)
    yield "denseformer", T.denseformer(k)
    yield "full_scalars_softmax", T.denseformer(k, gate="softmax")
    yield "full_scalars_sigmoid", T.denseformer(k, gate="sigmoid")
    yield "block2_scalars_softmax", block_scalars(k, "softmax")
    yield "rezero", T.rezero(k)
    yield "layerscale", T.layerscale(k)
    yield "highway", T.highway(k)
    yield "sum_blocks", custom_sum_blocks(k)
    for method in ("sum", "rezero", "highway"):  # a stream head after a non-stream body
        yield f"head_{method}", mixed_head(k, method)


# depth 3: N = 2 does not divide the 3 layers (blocks of 2 and 1 layers); block_size 4
# leaves a short last block.
CASES = list(topologies(3))


@pytest.mark.parametrize("name,topo", CASES, ids=[c[0] for c in CASES])
def test_lowering_equals_naive_loop(name, topo):
    torch.manual_seed(0)
    model = randomise(build_model(cfg(3), topo, backend="eager").double())
    idx = torch.randint(0, VOCAB, (2, 7))
    want = reference.forward(model, topo, idx)
    torch.testing.assert_close(model(idx), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(direct(model)(idx), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_block_two_phase_equals_direct_depth4(n):
    k = T.sublayer_kinds(4)
    topo = T.block_attnres(k, blocks=n)
    model = randomise(build_model(cfg(4, mlp="gelu"), topo, backend="eager").double(), seed=n)
    assert len(model.phases) == n  # one phase-1 group per block
    idx = torch.randint(0, VOCAB, (2, 5))
    torch.testing.assert_close(model(idx), reference.forward(model, topo, idx),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(model(idx), direct(model)(idx), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,topo", CASES, ids=[c[0] for c in CASES])
def test_added_parameters_match_ir(name, topo):
    model = build_model(cfg(3), topo)
    g = build_ir(T.sublayer_kinds(3), topo, D)
    assert sum(p.numel() for a in model.aggregations for p in a.parameters()) == \
        added_parameters(g)


@pytest.mark.parametrize("name", ["full", "block2", "block_size2", "full_input_dependent"])
def test_gradients_reach_every_query_and_gain(name):
    topo = dict(CASES)[name]
    model = randomise(build_model(cfg(3), topo, backend="eager"))
    idx = torch.randint(0, VOCAB, (2, 6))
    model(idx).logsumexp(-1).mean().backward()
    g = model.restopo_ir
    for i, agg in enumerate(model.aggregations):
        if len(g.aggregation(i + 1).sources) == 1:
            continue  # softmax over one source is 1 whatever the query: no gradient to get
        assert agg.pseudo_query.grad is not None and agg.pseudo_query.grad.abs().sum() > 0, i
        assert agg.key_norm.weight.grad.abs().sum() > 0, i


def test_zero_queries_give_mean_of_sources():
    """A fresh Full/Block model: each attend aggregation is the plain mean of its sources."""
    for topo in (T.full_attnres(T.sublayer_kinds(3)), T.block_attnres(T.sublayer_kinds(3),
                                                                       blocks=2)):
        model = build_model(cfg(3), topo).double()
        with torch.no_grad():
            for agg in model.aggregations:
                agg.key_norm.weight.normal_()  # gains do not matter when the query is zero
        seen = []
        d = direct(model)
        hooks = [a.register_forward_hook(lambda m, args, out: seen.append((args, out)))
                 for a in model.aggregations]
        d(torch.randint(0, VOCAB, (2, 5)))
        for h in hooks:
            h.remove()
        assert len(seen) == len(model.aggregations)
        for args, out in seen:
            torch.testing.assert_close(out, torch.stack(args).mean(0))
        torch.testing.assert_close(model(torch.ones(1, 3, dtype=torch.long)),
                                   d(torch.ones(1, 3, dtype=torch.long)))


@pytest.mark.parametrize("gate,combine", [
    ("softmax", lambda xs: torch.stack(xs).mean(0)),       # zero scalars: the plain mean
    ("sigmoid", lambda xs: 0.5 * torch.stack(xs).sum(0)),  # sigmoid(0) = 1/2 on every source
    ("none", lambda xs: torch.stack(xs).sum(0)),           # DenseFormer: ones, the plain sum
])
def test_fresh_scalars_start_as_their_gate_says(gate, combine):
    """Static per-source scalars under a softmax start like Full AttnRes (the mean of the
    sources); DenseFormer's raw scalars start as the standard residual (their sum)."""
    for topo in (T.denseformer(T.sublayer_kinds(3), gate=gate),
                 block_scalars(T.sublayer_kinds(3), gate)):
        model = build_model(cfg(3), topo).double()
        seen = []
        hooks = [a.register_forward_hook(lambda m, args, out: seen.append((args, out)))
                 for a in model.aggregations]
        model(torch.randint(0, VOCAB, (2, 5)))
        for h in hooks:
            h.remove()
        assert len(seen) == len(model.aggregations)
        for args, out in seen:
            torch.testing.assert_close(out, combine(list(args)), rtol=1e-12, atol=1e-12)
    if gate == "none":  # and the whole model equals the standard residual with its parts
        k = T.sublayer_kinds(3)
        dense = build_model(cfg(3), T.denseformer(k)).double()
        std = build_model(cfg(3), T.standard(k)).double()
        std.load_state_dict(dense.state_dict(), strict=False)
        idx = torch.randint(0, VOCAB, (2, 5))
        torch.testing.assert_close(dense(idx), std(idx), rtol=1e-10, atol=1e-10)


def test_standard_code_keeps_one_running_value():
    model = build_model(cfg(2), T.standard(T.sublayer_kinds(2)))
    code = model.code
    assert "h2 = embedding + sublayer1" in code and "h5 = h4 + sublayer4" in code
    assert "aggregations" not in code  # a plain sum needs no module call


def test_block_code_has_running_sums_and_phases():
    model = build_model(cfg(4), T.block_attnres(T.sublayer_kinds(4), blocks=2))
    code = model.code
    assert "partial1_3 = sublayer1 + sublayer2" in code
    assert "partial1_4 = partial1_3 + sublayer3" in code
    assert "block1 = partial1_4 + sublayer4" in code
    assert code.count("phase1 = getattr(self.phases") == 2
    assert "h9 = getattr(self.aggregations, \"8\")(embedding, block1, block2)" in code


def test_state_dict_names_are_stable():
    model = build_model(cfg(2), T.block_attnres(T.sublayer_kinds(2), blocks=2))
    keys = set(model.state_dict())
    assert {"embed.weight", "head.norm.weight", "head.lm_head.weight",
            "sublayers.0.qkv.weight", "sublayers.1.down.weight",
            "aggregations.0.pseudo_query", "aggregations.4.key_norm.weight"} <= keys
    assert not any(k.startswith("phases") for k in keys)


def test_kinds_mismatch_is_a_clear_error():
    from restopo.fx.lower import lower
    from restopo.nn.model import build_parts
    g = build_ir(T.sublayer_kinds(3), T.standard(T.sublayer_kinds(3)), D)
    with pytest.raises(ValueError, match="built for sublayers"):
        lower(g, build_parts(cfg(2)))


def test_foreign_parts_with_probed_context_and_dtype():
    """Parts from elsewhere (as rewire builds them): context arity found by probing, new
    aggregation parameters follow the model's dtype."""
    from torch import nn

    from restopo.fx.lower import lower
    from restopo.nn.parts import Parts

    class Mask(nn.Module):
        def forward(self, idx, v0):
            return (torch.ones(idx.shape[1], 1, dtype=v0.dtype),)

    class Sub(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h, mask):
            return self.lin(h) * mask

    k = T.sublayer_kinds(2)
    parts = Parts(nn.Embedding(10, 8), [Sub() for _ in k], k, nn.Linear(8, 10), Mask())
    parts.embed.double(), parts.sublayers.double(), parts.head.double()
    gm = lower(build_ir(k, T.full_attnres(k)), parts)
    assert gm.restopo_context_names == ("context_0",)
    assert gm.aggregations[0].pseudo_query.dtype == torch.float64
    assert gm(torch.randint(0, 10, (2, 3))).shape == (2, 3, 10)
    with pytest.raises(ValueError, match="one kind per sublayer"):
        Parts(nn.Embedding(10, 8), [Sub()], k, nn.Linear(8, 10))
