"""The eager backend's hand-written backwards (backends/eager/weighted.py, unstacked.py's
_KeyScaled, _Logits and _Lerp) and the logits shared by a source's readers
(restopo.nn.shared_sources): gradcheck in float64, float32 against float64 references
written here, all-zero rows at eps 1e-30, and whole models against tests/reference.py's
loop, gradients included."""
from types import SimpleNamespace

import pytest
import torch

import reference
from restopo import ops
from restopo import topology as T
from restopo.api import build_model
from restopo.backends.eager import depth, unstacked, weighted

torch.manual_seed(0)


def _rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _loop_sum(alpha, sources):
    """sum_i alpha_i v_i, each head's weight over its channel slice, by hand."""
    heads = alpha.shape[-1]
    c = sources[0].shape[-1] // heads
    return sum(a.repeat_interleave(c, dim=-1) * v for a, v in zip(alpha, sources))


@pytest.mark.parametrize("heads", [1, 2])
def test_gradcheck_weighted_sum(heads):
    sources = [_rand(2, 3, 4) for _ in range(3)]
    alpha = _rand(3, 2, 3, heads)
    assert torch.autograd.gradcheck(
        lambda a, *s: weighted.weighted_sum(a, s), (alpha, *sources))
    alphas = _rand(3, 2, 2, 3, heads)  # 3 sources, S = 2 outputs
    assert torch.autograd.gradcheck(
        lambda a, *s: weighted.weighted_sum(a, s, outputs=2), (alphas, *sources))
    out = weighted.weighted_sum(alphas, sources, outputs=2)
    for s in range(2):
        torch.testing.assert_close(out[s], _loop_sum(alphas[:, s], sources))


def test_gathered_source_gradient_is_added_once_for_all_readers():
    """Two weighted sums read one gathered source and another op reads the source too: the
    gradient equals plain autograd's (the sink adds in place, then hands it on once)."""
    v, w = _rand(2, 3, 4), _rand(2, 3, 4)
    a1, a2 = _rand(2, 2, 3, 2), _rand(2, 2, 3, 1)

    def run(share):
        g = weighted.gathered(v) if share else v
        out = weighted.weighted_sum(a1, (g, w)) * 1.5 + weighted.weighted_sum(a2, (w, g))
        return (out.sin() + v.square()).sum()

    def ref():
        out = _loop_sum(a1, (v, w)) * 1.5 + _loop_sum(a2, (w, v))
        return (out.sin() + v.square()).sum()

    inputs = (v, w, a1, a2)
    for got, want in zip(torch.autograd.grad(run(True), inputs),
                         torch.autograd.grad(ref(), inputs)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # again through the same graph: the sink was emptied, nothing carries over
    loss = run(True)
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(loss, inputs)):
        torch.testing.assert_close(a, b)


def _rstd_fp64(v, eps):
    return torch.rsqrt(v.double().pow(2).mean(-1, keepdim=True) + eps)


def test_gradcheck_key_scaled():
    """z = u rstd(v), the key norm applied to logits u (unstacked._KeyScaled)."""
    u, v = _rand(3, 2), _rand(3, 5)
    assert torch.autograd.gradcheck(lambda u, v: unstacked._key_scaled(u, v, 1e-6), (u, v))


@pytest.mark.parametrize("scale", [0.0, 1e-20, 1.0])
def test_key_scaled_backward_of_tiny_rows_in_float32(scale):
    """rstd^3 (and rstd^2 times logits of ordinary size) of a tiny or all-zero row overflows
    fp32 at eps 1e-30; the backward forms neither."""
    v = (torch.randn(4, 16) * scale).requires_grad_()
    u = torch.randn(4, 1).requires_grad_()
    grad = torch.randn(4, 1)
    got = torch.autograd.grad(unstacked._key_scaled(u, v, 1e-30), (u, v), grad)
    u64, v64 = (t.detach().double().requires_grad_() for t in (u, v))
    want = torch.autograd.grad(u64 * _rstd_fp64(v64, 1e-30), (u64, v64), grad.double())
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-30)


def _merge_fp64(o1, m1, s1, p, q, eps, key_norm, heads):
    """Phase 2 written out: h = (a o1 + b p) / (a s1 + b) per head."""
    c = p.shape[-1] // heads
    key = p * _rstd_fp64(p, eps) if key_norm else p
    z2 = (key * q).unflatten(-1, (heads, c)).sum(-1)
    m = torch.maximum(m1, z2)
    a, b = torch.exp(m1 - m), torch.exp(z2 - m)
    den = a * s1 + b
    return (_loop_sum((a / den)[None], (o1,)) + _loop_sum((b / den)[None], (p,)))


@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (2, False)])
def test_gradcheck_merge(heads, key_norm):
    o1, p, q = _rand(2, 3, 4), _rand(2, 3, 4), _rand(4)
    m1, s1 = _rand(2, 3, heads), (torch.rand(2, 3, heads, dtype=torch.float64) + 1).requires_grad_()
    # with autograd the dispatcher runs unstacked.phase2 (_Lerp) on the normalised state
    fn = lambda *a: depth.phase2(*a, None, 1e-6, key_norm=key_norm)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (o1, m1, s1, p, q))
    torch.testing.assert_close(fn(o1, m1, s1, p, q),
                               _merge_fp64(o1, m1, s1, p, q, 1e-6, key_norm, heads))


@pytest.mark.parametrize("heads", [1, 2])
def test_merge_with_an_all_zero_partial_row_in_float32(heads):
    o1, p = torch.randn(3, 8), torch.randn(3, 8)
    p[1] = 0
    p[2] *= 1e-20
    m1, s1, q = torch.randn(3, heads), torch.rand(3, heads) + 1, torch.randn(8)
    inputs = [t.requires_grad_() for t in (o1, m1, s1, p, q)]
    grad = torch.randn(3, 8)
    out = depth.phase2(*inputs, None, 1e-30, key_norm=True)
    got = torch.autograd.grad(out, inputs, grad)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = _merge_fp64(*ref_in, 1e-30, True, heads)
    want = torch.autograd.grad(ref, ref_in, grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (2, False)])
def test_logits_against_is_each_query_by_hand(heads, key_norm):
    v, qs = _rand(2, 3, 8), _rand(3, 8)
    got = ops.logits_against(v, qs, 1e-6, key_norm=key_norm, heads=heads)
    key = v * _rstd_fp64(v, 1e-6) if key_norm else v
    for r in range(3):
        torch.testing.assert_close(got[r], (key * qs[r]).unflatten(-1, (heads, -1)).sum(-1))
    assert torch.autograd.gradcheck(
        lambda v, qs: ops.logits_against(v, qs, 1e-6, key_norm=key_norm, heads=heads), (v, qs))


def _logits_fp64(v, qs, eps, key_norm, heads):
    key = v.double() * _rstd_fp64(v, eps) if key_norm else v.double()
    return torch.stack([(key * q).unflatten(-1, (heads, -1)).sum(-1) for q in qs.double()])


@pytest.mark.parametrize("heads,key_norm", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("logits_first", [True, False])
def test_gathered_logits_add_their_gradient_into_the_sources_buffer(heads, key_norm,
                                                                    logits_first):
    """The logits of a gathered source (Full AttnRes's, restopo.nn.shared_sources) add
    their part of its gradient into the readers' buffer in place, whether their backward
    runs before the weighted sums' or after; the source's gradient equals plain autograd's,
    another op reading it too, and a second backward through the graph carries nothing."""
    v, w, qs = _rand(2, 3, 8), _rand(2, 3, 8), _rand(3, 8)
    a = _rand(2, 2, 3, heads)

    def run(share):
        g = weighted.gathered(v) if share else v
        mix = weighted.weighted_sum if share else (lambda a, s: _loop_sum(a, s))
        if logits_first:  # made after the weighted sum: autograd runs their backward first
            out = mix(a, (g, w)).sin().sum()
            z = (ops.logits_against(g, qs, 1e-6, key_norm=key_norm, heads=heads) if share
                 else _logits_fp64(v, qs, 1e-6, key_norm, heads))
            return out + z.exp().sum() + v.square().sum()
        z = (ops.logits_against(g, qs, 1e-6, key_norm=key_norm, heads=heads) if share
             else _logits_fp64(v, qs, 1e-6, key_norm, heads))
        # the weights made from the logits, as a reader does: its backward runs first
        return (mix(torch.softmax(z[:2], 0) * a, (g, w)).sin().sum() + v.square().sum())

    inputs = (v, w, qs, a)
    for got, want in zip(torch.autograd.grad(run(True), inputs),
                         torch.autograd.grad(run(False), inputs)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    loss = run(True)
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    for x, y in zip(first, torch.autograd.grad(loss, inputs)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.autograd.gradcheck(
        lambda v, qs: ops.logits_against(weighted.gathered(v), qs, 1e-6, key_norm=key_norm,
                                         heads=heads), (v, qs))


@pytest.mark.parametrize("scale", [0.0, 1e-20, 1.0])
def test_logits_backward_of_tiny_rows_in_float32(scale):
    """As _Rstd's: the logits' backward through the key norm never forms rstd^3 (which
    overflows fp32 for an all-zero row at eps 1e-30)."""
    v = (torch.randn(4, 16) * scale).requires_grad_()
    qs, grad = torch.randn(3, 16), torch.randn(3, 4, 1)
    got, = torch.autograd.grad(ops.logits_against(v, qs, 1e-30), v, grad)
    v64 = v.detach().double().requires_grad_()
    want, = torch.autograd.grad(_logits_fp64(v64, qs, 1e-30, True, 1), v64, grad.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-30)


def test_a_shared_buffer_is_row_major_or_not_handed_out():
    """_Sink.buffer hands out a row-major buffer whatever the source's layout (a kernel or a
    matmul writes it whole), and none where the readers' sum so far took a gradient's
    strides (the caller then returns its part to autograd); that sum stays as it was."""
    sink = weighted._Sink()
    buf, summed = sink.buffer(torch.empty(8, 6).t())
    assert buf.is_contiguous() and not summed
    sink = weighted._Sink()
    g = torch.randn(3, 4, 2, 5).transpose(0, 1)                   # [4, 3, H=2, c=5]
    sink.add(g, torch.ones(4, 3, 2, 1))
    assert not sink.grad.is_contiguous()
    kept = sink.grad.clone()
    assert sink.buffer(torch.empty(4, 3, 10)) == (None, False)
    assert torch.equal(sink.grad, kept)


# -- whole models: the shared logits and gradient buffers against tests/reference.py -------

def _cfg(depth):
    return SimpleNamespace(vocab=37, width=16, depth=depth, heads=2, mlp="swiglu",
                           mlp_ratio=2, context=16)


MODELS = {
    "full": T.full_attnres(T.sublayer_kinds(3)),
    "full_heads2_sigmoid": T.full_attnres(T.sublayer_kinds(3), heads=2, gate="sigmoid"),
    "full_no_key_norm": T.full_attnres(T.sublayer_kinds(3), key_norm="none"),
    "block2": T.block_attnres(T.sublayer_kinds(3), blocks=2),
    "block2_heads4_no_key_norm": T.block_attnres(T.sublayer_kinds(3), blocks=2, heads=4,
                                                 key_norm="none"),
    "full_input_dependent": T.full_attnres(T.sublayer_kinds(3), query="input_dependent"),
}


def _randomised(topo):
    torch.manual_seed(0)
    model = build_model(_cfg(3), topo, backend="eager").double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for agg in model.aggregations:
            for p in agg.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.7)
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_model_gradients_equal_the_reference_loop(name):
    topo = MODELS[name]
    model = _randomised(topo)
    idx = torch.randint(0, 37, (2, 7))
    params = list(model.parameters())
    got = torch.autograd.grad(model(idx).logsumexp(-1).square().mean(), params)
    want = torch.autograd.grad(reference.forward(model, topo, idx).logsumexp(-1).square().mean(),
                               params)
    for (pname, _), g, w in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=pname)


def test_full_attnres_makes_each_sources_logits_once(monkeypatch):
    """Every source's logits against all its readers in one call: one per source (the
    embedding and 6 sublayer outputs), not one per (source, reader) pair (28)."""
    from restopo.nn import shared_sources
    calls = []
    real = shared_sources.ops.logits_against
    monkeypatch.setattr(shared_sources.ops, "logits_against",
                        lambda v, q, *a, **k: calls.append(q.shape[0]) or real(v, q, *a, **k))
    model = _randomised(MODELS["full"])
    model(torch.randint(0, 37, (2, 7))).sum().backward()
    assert sorted(calls) == [1, 2, 3, 4, 5, 6, 7]  # source i is read by 7 - i aggregations
    calls.clear()
    with torch.no_grad():  # without autograd: the stacked form, nothing shared
        model(torch.randint(0, 37, (2, 7)))
    assert calls == []


@pytest.mark.parametrize("name", ["full", "block2"])
def test_model_saves_no_stacked_copy_of_the_sources(name):
    """Autograd keeps no [n, batch, time, d] tensor (n > 1): the sources only, once."""
    model = _randomised(MODELS[name]).float()
    idx = torch.randint(0, 37, (3, 5))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx).sum()
    loss.backward()
    assert shapes
    stacked = [s for s in shapes if len(s) == 4 and s[1:] == (3, 5, 16) and s[0] > 1]
    assert stacked == []


def test_a_deep_copy_shares_as_the_model_does():
    """fx drops a GraphModule's forward hooks when it deep-copies it: the copy must still
    share (same results to the bit) and its scope must be its own."""
    import copy
    model = _randomised(MODELS["full"])
    twin = copy.deepcopy(model)
    idx = torch.randint(0, 37, (2, 7))
    torch.testing.assert_close(twin(idx), model(idx), rtol=0, atol=0)
    hooks = [h.__self__ for h in twin._forward_pre_hooks.values()]
    readers = {h.__self__ for a in twin.aggregations for h in a._forward_pre_hooks.values()}
    assert len(hooks) == 1 and readers == set(hooks)
    assert hooks[0] is not next(iter(model._forward_pre_hooks.values())).__self__


def test_a_backward_that_skips_the_source_leaves_nothing_behind():
    """A first backward that wants only alpha's gradient runs the weighted sums but not the
    gathered view's node: what they added must not reach a later backward's source gradient."""
    v, w = _rand(2, 3, 4), _rand(2, 3, 4)
    a = _rand(2, 2, 3, 2)
    g = weighted.gathered(v)
    loss = (weighted.weighted_sum(a, (g, w)) * 1.5).sin().sum()
    torch.autograd.grad(loss, [a], retain_graph=True)
    got = torch.autograd.grad(loss, [v, w, a])
    want = torch.autograd.grad((_loop_sum(a, (v, w)) * 1.5).sin().sum(), [v, w, a])
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
