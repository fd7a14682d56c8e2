"""The aggregation modules: init semantics, parameter counts, gradcheck."""
import pytest
import torch

from restopo.ir import Aggregation
from restopo.ir.analyses import aggregation_parameters
from restopo.nn import aggregate as A

D = 8


def _attrs(method, n=3, index=4, query="static", gate="softmax", key_norm="rms", heads=1):
    return Aggregation(index, "attn", method, tuple(f"s{i}" for i in range(n)), 1, index,
                       query=query, gate=gate, key_norm=key_norm, heads=heads)


def _randomise(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
    return m


CASES = [
    _attrs("attend"), _attrs("attend", query="input_dependent"), _attrs("attend", gate="sigmoid"),
    _attrs("attend", key_norm="none"), _attrs("attend", heads=2), _attrs("sum"),
    _attrs("scalars", gate="none"), _attrs("scalars", gate="softmax"),
    _attrs("scalars", gate="sigmoid"), _attrs("rezero"), _attrs("layerscale"), _attrs("highway"),
    _attrs("rezero", index=1),
]


@pytest.mark.parametrize("attrs", CASES, ids=lambda a: f"{a.method}-{a.query}-"
                         f"{a.gate}-{a.key_norm}-{a.heads}-{a.index}")
def test_parameter_count_matches_ir(attrs):
    m = A.make_aggregation(attrs, D)
    want = aggregation_parameters(attrs.method, len(attrs.sources), D, attrs.query,
                                  attrs.key_norm, attrs.index)
    assert sum(p.numel() for p in m.parameters()) == want


@pytest.mark.parametrize("attrs", [a for a in CASES if a.index != 1],
                         ids=lambda a: f"{a.method}-{a.query}-{a.gate}-"
                         f"{a.key_norm}-{a.heads}")
def test_gradcheck(attrs):
    m = _randomise(A.make_aggregation(attrs, D, backend="eager").double())
    stream = attrs.method in ("rezero", "layerscale", "highway")
    n = 2 if stream else len(attrs.sources)
    xs = tuple(torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True) for _ in range(n))
    assert torch.autograd.gradcheck(lambda *xs: m(*xs), xs)
    # and with respect to the module's own parameters
    params = tuple(m.parameters())
    if params:
        def f(*ps):
            return torch.func.functional_call(
                m, {k: p for (k, _), p in zip(m.named_parameters(), ps)}, xs)
        assert torch.autograd.gradcheck(f, tuple(p.detach().clone().requires_grad_()
                                                 for p in params))


def test_fresh_attend_is_mean_and_input_dependent_starts_static():
    xs = [torch.randn(2, 3, D) for _ in range(4)]
    for q in ("static", "input_dependent"):
        m = A.make_aggregation(_attrs("attend", n=4, query=q), D)
        assert torch.count_nonzero(m.pseudo_query) == 0
        torch.testing.assert_close(m(*xs), torch.stack(xs).mean(0))
    m = A.Attend(D, query="input_dependent")
    with torch.no_grad():
        m.pseudo_query.normal_()
    static = A.Attend(D)
    static.load_state_dict({k: v for k, v in m.state_dict().items() if "query_proj" not in k})
    torch.testing.assert_close(m(*xs), static(*xs))


def test_fresh_scalars_follow_their_gate():
    """DenseFormer's raw scalars start at 1 (the sum); gated scalars start at 0, so the
    softmax is the plain mean (as a zero pseudo-query) and the sigmoid weighs each by 1/2."""
    xs = [torch.randn(2, 3, D) for _ in range(4)]
    dense = A.make_aggregation(_attrs("scalars", n=4, gate="none"), D)
    soft = A.make_aggregation(_attrs("scalars", n=4, gate="softmax"), D)
    sig = A.make_aggregation(_attrs("scalars", n=4, gate="sigmoid"), D)
    assert torch.all(dense.weights == 1) and torch.all(soft.weights == 0)
    assert torch.all(sig.weights == 0)
    torch.testing.assert_close(dense(*xs), torch.stack(xs).sum(0))
    torch.testing.assert_close(soft(*xs), torch.stack(xs).mean(0))
    torch.testing.assert_close(sig(*xs), 0.5 * torch.stack(xs).sum(0))
    with pytest.raises(ValueError, match="scalars gate"):
        A.Scalars(3, gate="relu")


def test_softmax_scalars_weights_sum_to_one_and_shift_freely():
    """softmax(a) weights sum to one, and adding a constant to every scalar changes nothing
    (only differences between sources matter, as with softmax logits)."""
    m = _randomise(A.Scalars(5, gate="softmax").double())
    xs = [torch.randn(3, D, dtype=torch.float64) for _ in range(5)]
    torch.testing.assert_close(m.alpha().sum(), torch.tensor(1.0, dtype=torch.float64))
    out = m(*xs)
    with torch.no_grad():
        m.weights.add_(3.0)
    torch.testing.assert_close(m(*xs), out)


def test_stream_inits():
    h, v = torch.randn(2, D), torch.randn(2, D)
    torch.testing.assert_close(A.ReZero()(h, v), h)               # alpha = 0
    torch.testing.assert_close(A.LayerScale(D)(h, v), h + 0.1 * v)
    hw = A.Highway(D)
    assert torch.all(hw.gate.bias == -2.0)
    assert isinstance(A.make_aggregation(_attrs("highway", index=1), D), A.StreamStart)


def test_two_phase_members_keep_ownership():
    members = [A.Attend(D) for _ in range(3)]
    tp = A.TwoPhase(members)
    assert list(tp.parameters()) == [] and tp.state_dict() == {}
    with pytest.raises(ValueError):
        A.TwoPhase([A.Attend(D), A.Attend(D, key_norm="none")])


def test_depth_weights_sum_to_one_and_reproduce_output():
    m = _randomise(A.Attend(D, heads=2).double())
    xs = [torch.randn(3, D, dtype=torch.float64) for _ in range(5)]
    w = m.depth_weights(*xs)
    torch.testing.assert_close(w.sum(0), torch.ones(3, 2, dtype=torch.float64))
    out = sum(w[i].repeat_interleave(D // 2, -1) * xs[i] for i in range(5))
    torch.testing.assert_close(out, m(*xs))


def _no_grad_and_autograd(model, idx):
    """(logits without autograd, which may reuse folded queries; logits with it, which
    never do)."""
    with torch.no_grad():
        fast = model(idx)
    return fast, model(idx).detach()


@pytest.mark.parametrize("topology", ["full_attnres", "block_attnres"])
def test_no_grad_forward_follows_every_change_of_the_queries_and_gains(topology):
    """Without autograd an Attend or a two-phase group keeps its gain-folded queries
    (aggregate.derived) while they are unchanged: an optimizer step, load_state_dict, an
    in-place edit or a dtype change must each be seen by the next forward."""
    from types import SimpleNamespace

    from restopo import topology as T
    from restopo.api import build_model
    kinds = T.sublayer_kinds(3)
    topo = (T.full_attnres(kinds) if topology == "full_attnres"
            else T.block_attnres(kinds, blocks=2))
    cfg = SimpleNamespace(vocab=32, width=16, depth=3, heads=2, mlp="swiglu", mlp_ratio=2,
                          context=8)
    torch.manual_seed(0)
    model = build_model(cfg, topo, backend="eager")
    idx = torch.randint(0, 32, (2, 8))
    queries = [p for n, p in model.named_parameters() if "aggregations" in n]
    assert queries, "the model has aggregation parameters"

    fast, slow = _no_grad_and_autograd(model, idx)
    torch.testing.assert_close(fast, slow)
    opt = torch.optim.SGD(queries, lr=1.0)  # an optimizer step: in place
    (model(idx).square().mean() + sum(p.square().sum() for p in queries)).backward()
    opt.step()
    fast2, slow2 = _no_grad_and_autograd(model, idx)
    torch.testing.assert_close(fast2, slow2)
    assert not torch.allclose(fast2, fast)  # the step changed the output

    state = {k: v + 0.5 for k, v in model.state_dict().items() if "aggregations" in k}
    model.load_state_dict(state, strict=False)
    fast3, slow3 = _no_grad_and_autograd(model, idx)
    torch.testing.assert_close(fast3, slow3)
    assert not torch.allclose(fast3, fast2)

    model.double()  # new storage and dtype: the kept float32 form must not be served
    fast4, slow4 = _no_grad_and_autograd(model, idx)
    assert fast4.dtype == torch.float64
    torch.testing.assert_close(fast4, slow4)
