"""The cpu backend (backends/cpu: fused C kernels for phase 1, phase 2 + PreNorm, and depth
attention) and the eager PreNorm's hand-written backward (backends/eager/rmsnorm.py).

References: gradcheck in float64, a hand-written float64 loop over sources and queries,
the eager backend on whole models (float64, every gradient), and F.rms_norm."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import infinite_logits
from restopo import ops
from restopo import topology as T
from restopo.api import build_model
from restopo.registry import get_backend

cpu = get_backend("cpu")
needs_kernels = pytest.mark.skipif(not cpu.available()[0],
                                   reason=f"cpu kernels unavailable: {cpu.available()[1]}")
from restopo.backends.cpu.functions import AttendGiven, Phase1, Phase2  # noqa: E402
from restopo.backends.eager.rmsnorm import _RMSNorm, rms_norm  # noqa: E402

D64 = dict(dtype=torch.float64)


def _loop_phase1(sources, queries, eps, key_norm, heads):
    """h1 [S, *b, d] and lse [S, *b, H] by a loop over queries, heads and sources."""
    d = sources[0].shape[-1]
    c = d // heads
    h1 = torch.zeros(len(queries), *sources[0].shape, **D64)
    lse = torch.zeros(len(queries), *sources[0].shape[:-1], heads, **D64)
    for s, q in enumerate(queries):
        for h in range(heads):
            sl = slice(h * c, (h + 1) * c)
            z = []
            for v in sources:
                r = torch.rsqrt(v.pow(2).mean(-1) + eps) if key_norm else torch.ones(v.shape[:-1], **D64)
                z.append((v[..., sl] * q[sl]).sum(-1) * r)
            z = torch.stack(z)
            a = torch.softmax(z, 0)
            lse[s, ..., h] = torch.logsumexp(z, 0)
            h1[s, ..., sl] = sum(a_i[..., None] * v[..., sl] for a_i, v in zip(a, sources))
    return h1, lse


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("n,S", [(1, 1), (4, 3)])
@pytest.mark.parametrize("width", [8, 32, 128])
def test_phase1_kernel_gradcheck_and_loop(heads, key_norm, n, S, width):
    """Width 32 with one head: each row's spans summed in registers (16 doubles to a span
    with 256-bit registers, 32 with 512-bit); width 8: term by term; width 128: a row of
    several spans (its square sum by dot_spans)."""
    torch.manual_seed(n + S + heads)
    src = [torch.randn(2, 3, width, **D64, requires_grad=True) for _ in range(n)]
    q = torch.randn(S, width, **D64, requires_grad=True)
    out = Phase1.apply(q, 1e-6, key_norm, heads, *src)
    h1, lse = _loop_phase1([v.detach() for v in src], q.detach(), 1e-6, key_norm, heads)
    assert torch.allclose(torch.stack(out[:S]), h1, atol=1e-12)
    assert torch.allclose(torch.stack(out[S:]), lse, atol=1e-12)
    assert torch.autograd.gradcheck(lambda q, *s: Phase1.apply(q, 1e-6, key_norm, heads, *s),
                                    (q, *src))


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("norm", ["gain", "no gain", "none"])
@pytest.mark.parametrize("keep_h", [True, False])
@pytest.mark.parametrize("width", [8, 16, 32])
def test_phase2_kernel_gradcheck_and_formula(heads, key_norm, norm, keep_h, width):
    """With one head, a row is one span of doubles at width 32 with 512-bit registers and
    at width 16 with 256-bit ones (the register paths, phase2_fwd_span and
    phase2_bwd_span); width 8: the general loop."""
    if norm == "none" and not keep_h:
        pytest.skip("without the norm, h is the output")
    torch.manual_seed(heads)
    h1, p = (torch.randn(2, 3, width, **D64, requires_grad=True) for _ in range(2))
    lse = torch.randn(2, 3, heads, **D64, requires_grad=True)
    q = torch.randn(width, **D64, requires_grad=True)
    g = torch.randn(width, **D64, requires_grad=True) if norm == "gain" else None
    norm_eps = None if norm == "none" else 1e-5

    def f(h1, lse, p, q, *g):
        out = Phase2.apply(h1, lse, p, q, g[0] if g else None, 1e-6, key_norm, norm_eps, keep_h)
        return [t for t in out if t is not None]

    got = f(h1, lse, p, q, *([g] if g is not None else []))
    # the formula, by hand: w = sigmoid(rstd(p) (q . p) - lse) per head, h = h1 + w (p - h1)
    r = torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) if key_norm else 1
    z2 = (p.unflatten(-1, (heads, -1)) * q.view(heads, -1)).sum(-1) * r
    w = torch.sigmoid(z2 - lse).unsqueeze(-1)
    h = (h1.unflatten(-1, (heads, -1)) + w * (p - h1).unflatten(-1, (heads, -1))).flatten(-2)
    want = [h] if keep_h or norm_eps is None else []
    if norm_eps is not None:
        want.append(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
                    * (g if g is not None else 1))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    assert torch.autograd.gradcheck(f, (h1, lse, p, q, *([g] if g is not None else [])))


@needs_kernels
def test_phase2_backward_takes_output_gradients_that_are_not_rows():
    """Gradients that are not contiguous (a sum's, expanded from a scalar) reach the kernel
    as contiguous copies that live through its call: each held by the caller, not freed
    once its address is read, where the next copy could take its memory."""
    torch.manual_seed(0)
    h1, p = (torch.randn(4, 8, **D64, requires_grad=True) for _ in range(2))
    lse = torch.randn(4, 1, **D64, requires_grad=True)
    q = torch.randn(8, **D64, requires_grad=True)
    g = torch.rand(8, **D64) + 0.5
    inputs = (h1, lse, p, q)
    h, y = Phase2.apply(h1, lse, p, q, g, 1e-6, True, 1e-5, True)
    expanded = torch.autograd.grad(2 * y.sum() + 3 * h.sum(), inputs)
    h, y = Phase2.apply(h1, lse, p, q, g, 1e-6, True, 1e-5, True)
    rows = torch.autograd.grad((h, y), inputs, (torch.full_like(h, 3.0),
                                                torch.full_like(y, 2.0)))
    for a, b in zip(expanded, rows):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("n", [1, 5])
def test_weighted_sum_kernel_and_attend_given_logits(heads, n):
    """The weighted sum (gradcheck through alpha and sources), and depth attention given the
    logits (Full AttnRes's shared ones: a softmax over sources per head, then that sum)
    against a hand loop, with and without autograd."""
    torch.manual_seed(n + heads)
    z = [torch.randn(2, 3, heads, **D64, requires_grad=True) for _ in range(n)]
    src = [torch.randn(2, 3, 8, **D64, requires_grad=True) for _ in range(n)]
    c = 8 // heads
    want = torch.zeros(2, 3, 8, **D64)
    for h in range(heads):
        a = torch.softmax(torch.stack([z_i[..., h] for z_i in z]).detach(), 0)
        for a_i, v in zip(a, src):
            want[..., h * c:(h + 1) * c] += a_i[..., None] * v.detach()[..., h * c:(h + 1) * c]
    q = torch.zeros(8, **D64)  # not read: the logits are given
    got = cpu.depth_attention(src, q, None, heads=heads, logits=z)
    assert torch.allclose(got, want, atol=1e-12)
    with torch.no_grad():
        assert torch.equal(cpu.depth_attention(src, q, None, heads=heads, logits=z), got)
    assert torch.autograd.gradcheck(
        lambda *t: cpu.depth_attention(t[n:], q, None, heads=heads, logits=t[:n]), (*z, *src))


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
def test_phase1_given_logits_equals_eager(heads):
    """Phase 1 given each source's logits for S queries (a group of Full AttnRes readers):
    the eager backend's, forward and backward through logits and sources (gradcheck), and
    the same without autograd."""
    from restopo.backends.eager import depth as eager
    torch.manual_seed(heads)
    n, S = 4, 3
    z = [torch.randn(S, 2, 5, heads, **D64, requires_grad=True) for _ in range(n)]
    src = [torch.randn(2, 5, 8, **D64, requires_grad=True) for _ in range(n)]
    q = torch.zeros(S, 8, **D64)  # not read: the logits are given

    def f(backend, *t):
        h1, lse, _ = backend.phase1(list(t[n:]), q, None, heads=heads, logits=list(t[:n]))
        return (*h1, *lse)

    got, want = f(cpu, *z, *src), f(eager, *z, *src)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    # each source's logits as its S columns (as restopo.nn.shared_sources hands a group's),
    # on both backends: the same values
    for backend in (cpu, eager):
        h1, lse, _ = backend.phase1(src, q, None, heads=heads,
                                    logits=[tuple(z_i.unbind(0)) for z_i in z])
        for a, b in zip((*h1, *lse), want):
            assert torch.allclose(a, b, atol=1e-12)
    with torch.no_grad():
        for a, b in zip(f(cpu, *z, *src), got):
            assert torch.equal(a, b)
    assert torch.autograd.gradcheck(lambda *t: f(cpu, *t), (*z, *src))


@needs_kernels
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("width", [16, 24, 32])
def test_weighted_sum_kernel_gradcheck_with_outputs(heads, width):
    """The weighted sums given logits (functions.AttendGiven: a softmax, the kernel's sums
    and, for S outputs, the lse) with S outputs (a group's phase 1) and one, in float64, by
    gradcheck: with one head and a width that is a multiple of a span (16 doubles with
    256-bit registers, 32 with 512-bit) each output row is summed in registers, otherwise
    term by term into the output."""
    torch.manual_seed(heads)
    n = 4
    src = [torch.randn(3, width, **D64, requires_grad=True) for _ in range(n)]
    # each source's logits: its S rows [S, 3, H]; one row [3, H], or [1, 3, H] as a split
    # of its shared logits hands it
    for outputs, lse, lead in ((None, False, ()), (None, False, (1,)), (3, False, (3,)),
                               (3, True, (3,))):
        z = [torch.randn(*lead, 3, heads, **D64, requires_grad=True) for _ in range(n)]
        assert torch.autograd.gradcheck(
            lambda *t: AttendGiven.apply(heads, outputs, lse, *t), (*z, *src))
    # some outputs and lse without a gradient (None into the backward kernels)
    assert torch.autograd.gradcheck(
        lambda *t: AttendGiven.apply(heads, 3, True, *t)[1::3], (*z, *src))
    with pytest.raises(ValueError, match="logits"):  # not a row of logits a token each
        AttendGiven.apply(heads, 3, True, *[x[:2] for x in z], *src)


@needs_kernels
@pytest.mark.parametrize("heads", [1, 4])
def test_weighted_sum_kernel_over_several_tiles_and_threads(heads):
    """Rows over several of the kernel's tiles (256 KiB of rows each) and threads: the
    eager backend's weighted sum, forward and backward, to rounding; the same bits on one
    thread as on two (each token's sum is its own). One head: each output row is summed in
    registers; four: term by term."""
    from restopo.backends.cpu.functions import _weighted_sum, _weighted_sum_backward
    from restopo.backends.eager.weighted import weighted_sum
    torch.manual_seed(0)
    src = [torch.randn(1100, 64, requires_grad=True) for _ in range(3)]
    alpha = torch.rand(3, 1100, heads, requires_grad=True)
    g = torch.randn(1100, 64)
    got, want = {}, None
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):  # the kernels themselves, forward and backward
            torch.set_num_threads(t)
            out = _weighted_sum(alpha.detach(), [v.detach() for v in src], 1)[0]
            d_alpha, d_src = _weighted_sum_backward(alpha.detach(), [v.detach() for v in src],
                                                    1, [g], [True] * 3, [None] * 3)
            got[t] = (out, d_alpha, *d_src)
    finally:
        torch.set_num_threads(threads)
    want = weighted_sum(alpha, src)
    want = (want, *torch.autograd.grad(want, (alpha, *src), g))
    for a, b, w in zip(got[1], got[2], want):
        assert torch.equal(a, b)
        assert torch.allclose(a, w, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("heads", [1, 4])
def test_given_softmax_kernel_over_several_chunks_and_threads(heads):
    """The softmax over given logits (functions.softmax_given: 256 positions a chunk) and
    its lse, forward, and the gradient of the logits (AttendGiven's backward):
    torch's softmax and logsumexp in float64, and the same bits on one thread as on two."""
    from restopo.backends.cpu.functions import softmax_given
    torch.manual_seed(heads)
    n, S = 5, 3
    rows = [torch.randn(S, 300, heads, **D64, requires_grad=True) for _ in range(n)]
    src = [torch.randn(300, 8, **D64) for _ in range(n)]
    z = torch.stack(rows)
    want_alpha, want_lse = torch.softmax(z, 0), torch.logsumexp(z, 0)
    g = [torch.randn(300, 8, **D64) for _ in range(S)] + [torch.randn(300, heads, **D64)] * S
    sums = torch.einsum("nsth,nthc->sthc", want_alpha,
                        torch.stack(src).view(n, 300, heads, -1)).flatten(-2)
    want_dz = torch.autograd.grad((sums, want_lse), rows,
                                  (torch.stack(g[:S]), torch.stack(g[S:])))
    got = {}
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            alpha, lse = softmax_given([x.detach() for x in rows], src, heads, S, True)
            out = AttendGiven.apply(heads, S, True, *rows, *src)
            got[t] = (alpha, *lse, *torch.autograd.grad(out, rows, g))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(got[1], got[2]):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[1][0], want_alpha, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.stack(got[1][1:1 + S]), want_lse, rtol=1e-12, atol=1e-14)
    for a, w in zip(got[1][1 + S:], want_dz):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)


@needs_kernels
def test_attend_kernel_refuses_logits_of_the_wrong_shape():
    src = [torch.randn(2, 3, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="one logit tensor of shape"):
        cpu.depth_attention(src, torch.zeros(8), None, heads=2,
                            logits=[torch.randn(2, 3, 1) for _ in range(3)])


def _model(topo, backend, dtype=torch.float64, heads=4):
    cfg = SimpleNamespace(vocab=64, width=16, depth=4, heads=heads, mlp="swiglu",
                          mlp_ratio=4, context=16)
    torch.manual_seed(0)
    model = build_model(cfg, topo, backend=backend).to(dtype)
    with torch.no_grad():  # non-uniform depth weights
        for a in model.aggregations:
            if hasattr(a, "pseudo_query"):
                a.pseudo_query.normal_(0, 0.5)
    return model


@needs_kernels
@pytest.mark.parametrize("topo", [
    T.block_attnres(T.sublayer_kinds(4), blocks=2),
    T.block_attnres(T.sublayer_kinds(4), blocks=3),      # blocks not dividing the depth
    T.block_attnres(T.sublayer_kinds(4), blocks=2, heads=2),
    T.block_attnres(T.sublayer_kinds(4), blocks=2, key_norm="none"),
    T.full_attnres(T.sublayer_kinds(4)),
    T.full_attnres(T.sublayer_kinds(4), heads=2),
    T.full_attnres(T.sublayer_kinds(4), key_norm="none"),
    T.full_attnres(T.sublayer_kinds(4), window=3),
    T.full_attnres(T.sublayer_kinds(4), gate="sigmoid"),
], ids=["block2", "block3", "block2-heads2", "block2-no-key-norm", "full", "full-heads2",
        "full-no-key-norm", "full-window3", "full-sigmoid"])
@pytest.mark.filterwarnings("error")
def test_cpu_model_equals_eager_model(topo):
    """Logits and every gradient, over two steps' backward passes (a source's gradient
    buffer belongs to one pass), equal the eager backend's in float64, without a warning
    (the sigmoid gate's readers fall back to the eager backend with the shared logits'
    pieces, which it must take as [*batch, H])."""
    models = {b: _model(topo, b) for b in ("eager", "cpu")}
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out = {}
        for b, m in models.items():
            m.zero_grad()
            logits = m(idx)
            logits.logsumexp(-1).mean().backward()
            out[b] = (logits, {n: p.grad for n, p in m.named_parameters()})
        assert torch.allclose(out["cpu"][0], out["eager"][0], atol=1e-12)
        for n, g in out["eager"][1].items():
            assert torch.allclose(out["cpu"][1][n], g, atol=1e-11), n


@needs_kernels
@pytest.mark.parametrize("window", [None, 3])
def test_full_readers_in_groups_equal_each_reader_alone(window, monkeypatch):
    """Full AttnRes on backend cpu runs groups of readers in two phases (phase 1 over the
    sources a group reads all, then each reader's merge): the same logits and gradients as
    the model with its groups taken away, in float64; and the groups' phase 1 does run."""
    from restopo.fx.lower import lowered
    topo = T.full_attnres(T.sublayer_kinds(4), window=window)
    grouped, alone = _model(topo, "cpu"), _model(topo, "cpu")
    shared = lowered(alone).restopo_shared
    assert lowered(grouped).restopo_shared.groups
    shared.groups, shared.group_of = [], {}
    calls = []
    phase1 = cpu.phase1
    monkeypatch.setattr(cpu, "phase1", lambda *a, **k: calls.append(k) or phase1(*a, **k))
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, m in (("grouped", grouped), ("alone", alone)):
        logits = m(idx)
        logits.logsumexp(-1).mean().backward()
        out[name] = (logits, {n: p.grad for n, p in m.named_parameters()})
    assert calls and all(k.get("logits") is not None for k in calls)
    assert torch.allclose(out["grouped"][0], out["alone"][0], atol=1e-12)
    for n, g in out["alone"][1].items():
        assert torch.allclose(out["grouped"][1][n], g, atol=1e-11), n


@pytest.mark.parametrize("backend", ["eager", "cpu"])
def test_softmax_over_one_given_logit_is_the_source_itself(backend):
    """A grouped Full AttnRes reader that reads nothing besides its group's phase 1 attends
    over one source with a given logit: that is the source itself (weight 1 exactly), not
    a weighted sum's copy of it; with the sigmoid gate it is not, and two sources still
    take their softmax."""
    if backend == "cpu" and not cpu.available()[0]:
        pytest.skip("the cpu kernels do not build here")
    v, w, q = torch.randn(2, 5, 8, **D64), torch.randn(2, 5, 8, **D64), torch.randn(8, **D64)
    z, zw = (ops.logits_against(x, q[None], 1e-6)[0] for x in (v, w))  # as shared ones are
    assert ops.depth_attention([v], q, None, 1e-6, backend=backend, logits=[z]) is v
    assert ops.depth_attention([v], q, None, 1e-6, gate="sigmoid", backend=backend,
                               logits=[z]) is not v
    two = ops.depth_attention([v, w], q, None, 1e-6, backend=backend, logits=[z, zw])
    a = torch.softmax(torch.stack([z, zw]), 0)
    torch.testing.assert_close(two, a[0] * v + a[1] * w)


@needs_kernels
@pytest.mark.parametrize("topo", [
    T.block_attnres(T.sublayer_kinds(4), blocks=3),
    T.block_attnres(T.sublayer_kinds(4), blocks=2, heads=2),
    T.full_attnres(T.sublayer_kinds(4)),
], ids=["block3", "block2-heads2", "full"])
def test_cpu_model_without_autograd_equals_eager(topo, monkeypatch):
    """Evaluation and decoding (no autograd) call the kernels once per point, keeping
    nothing: the same logits as the eager backend, in float64."""
    calls = _count_kernels(monkeypatch)
    models = {b: _model(topo, b) for b in ("eager", "cpu")}
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = {b: m(idx) for b, m in models.items()}
    assert torch.allclose(got["cpu"], got["eager"], atol=1e-12)
    # a phase 1 a group, a merge a member but the first (it has no partial yet), and one
    # depth attention for every point outside the groups (all of Full's, Block's head)
    groups = [len(p.members) for p in models["cpu"].phases]
    alone = len(models["cpu"].aggregations) - sum(groups)
    assert topo.name.startswith("block") == bool(groups)
    assert (calls["phase1_fwd"], calls["phase2_fwd"]) == (len(groups) + alone,
                                                          sum(groups) - len(groups))
    assert set(calls) <= {"phase1_fwd", "phase2_fwd"}


def _count_kernels(monkeypatch) -> dict:
    """Counts of the kernels called by name, through either path (bound or general)."""
    from collections import Counter

    from restopo.backends.cpu import bound, functions
    calls, real = Counter(), functions._kernel

    def counting(name, dtype):
        fn = real(name, dtype)
        return lambda *a: calls.update([name]) or fn(*a)
    monkeypatch.setattr(functions, "_kernel", counting)
    monkeypatch.setattr(bound, "_kernel", counting)
    return calls


def _bound_cases():
    from restopo import ops
    torch.manual_seed(5)
    return ops, [torch.randn(3, 4, 8, **D64) for _ in range(5)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
def test_bound_calls_equal_the_general_calls_bit_for_bit(dtype, heads, key_norm, monkeypatch):
    """ops.bind_* on the cpu backend binds the kernel and its constants (decoding's calls):
    the same kernels on the same arguments as the general path, so the same bits, and
    each call one kernel call."""
    ops, src = _bound_cases()
    src = [v.to(dtype) for v in src]
    q, g = torch.randn(3, 8, dtype=dtype), torch.rand(3, 8, dtype=dtype) + 0.5
    nw, kw = torch.rand(8, dtype=dtype) + 0.5, dict(key_norm=key_norm, heads=heads)
    calls = _count_kernels(monkeypatch)
    with torch.no_grad():
        qg, gg = (q * g, None) if key_norm else (q, None)  # the general path, gain folded
        h1, lse, _ = ops.phase1(src, qg, gg, 1e-6, backend="cpu", **kw)
        got = ops.bind_phase1(q, g, 1e-6, backend="cpu", **kw)(src)
        assert all(torch.equal(a, b) for a, b in zip(got[0], h1))
        assert all(torch.equal(a, b) for a, b in zip(got[1], lse)) and got[2] == (None,) * 3
        one = ops.bind_depth_attention(q[0], g[0], 1e-6, backend="cpu", **kw)(src)
        assert torch.equal(one, ops.depth_attention(src, qg[0], None, 1e-6, backend="cpu", **kw))
        partial = torch.randn(3, 4, 8, dtype=dtype)
        for norm_eps in (None, 1e-5):
            general = ops.phase2_norm if norm_eps else ops.phase2
            extra = dict(norm_weight=nw, norm_eps=norm_eps) if norm_eps else {}
            want = general(h1[1], lse[1], None, partial, qg[1], None, 1e-6, key_norm=key_norm,
                           backend="cpu", **extra)
            bound = ops.bind_phase2(q[1], g[1], 1e-6, norm_weight=nw, norm_eps=norm_eps,
                                    key_norm=key_norm, keep_h=True, backend="cpu")
            have = bound(h1[1], lse[1], None, partial)
            for a, b in zip(have if norm_eps else [have], want if norm_eps else [want]):
                assert torch.equal(a, b)
    assert calls == {"phase1_fwd": 4, "phase2_fwd": 4}


@needs_kernels
def test_bound_calls_hand_what_the_kernel_does_not_take_to_the_general_path(monkeypatch):
    """A call whose tensors the bound kernel does not take (another dtype, not row-major,
    mismatched shapes, phase 1's unnormalised state) gets the general path's answer."""
    ops, src = _bound_cases()
    q = torch.randn(2, 8, **D64)
    bound = ops.bind_phase1(q, None, 1e-6, backend="cpu")
    calls = _count_kernels(monkeypatch)
    with torch.no_grad():
        f32 = [v.float() for v in src]
        assert torch.equal(bound(f32)[0][0], ops.phase1(f32, q, backend="cpu")[0][0])
        strided = [v.transpose(0, 1) for v in src]
        assert torch.equal(bound(strided)[0][1], ops.phase1(strided, q, backend="cpu")[0][1])
        mixed = src[:-1] + [src[-1].float()]
        assert torch.equal(bound(mixed)[0][0], ops.phase1(mixed, q, backend="cpu")[0][0])
        merge = ops.bind_phase2(q[0], None, 1e-6, key_norm=True, backend="cpu")
        o1, m1 = torch.randn(3, 4, 8, **D64), torch.randn(3, 4, 1, **D64)
        s1 = torch.rand(3, 4, 1, **D64) + 1
        p = torch.randn(3, 4, 8, **D64)
        want = ops.phase2(o1, m1, s1, p, q[0], None, 1e-6, backend="eager")
        assert torch.allclose(merge(o1, m1, s1, p), want, atol=1e-12)
        assert torch.equal(merge(o1, m1, None, None),
                           ops.phase2(o1, m1, None, None, q[0], None, 1e-6, backend="cpu"))
        nw = torch.rand(8, **D64) + 0.5
        for keep_h in (True, False):  # a block's first sublayer: no merge, then the PreNorm
            first = ops.bind_phase2(q[0], None, 1e-6, norm_weight=nw, norm_eps=1e-5,
                                    key_norm=True, keep_h=keep_h, backend="cpu")
            want = ops.phase2_norm(o1, m1, None, None, q[0], None, 1e-6, norm_weight=nw,
                                   norm_eps=1e-5, keep_h=keep_h, backend="cpu")
            got = first(o1, m1, None, None)
            assert (got[0] is None) == (not keep_h) and torch.equal(got[1], want[1])
            assert not keep_h or torch.equal(got[0], want[0])
    # the strided sources' general path copies them row-major for the kernel (once bound,
    # once as the reference), the other dtypes' runs eagerly; the unnormalised state is
    # normalised, then merged by the kernel (the reference is the eager backend's)
    assert calls == {"phase1_fwd": 2, "phase2_fwd": 1}


@needs_kernels
def test_a_bound_call_follows_its_parameters(monkeypatch):
    """Decoding keeps each point's bound call while its parameters are unchanged: an in-place
    update (an optimizer step, load_state_dict) makes a new one, never a stale answer."""
    from restopo.nn.aggregate import Attend, TwoPhase
    torch.manual_seed(3)
    members = [Attend(8, backend="cpu").double() for _ in range(2)]
    phase = TwoPhase(members, backend="cpu")
    src = [torch.randn(2, 3, 8, **D64) for _ in range(3)]
    p = torch.randn(2, 3, 8, **D64)
    nw = torch.nn.Parameter(torch.rand(8, **D64) + 0.5)

    def run():
        o1, m1, s1 = phase(*src)
        return members[1](p, phase1=(o1, m1, s1), slot=1, norm_weight=nw, norm_eps=1e-5), o1[0]

    def reference():
        with torch.enable_grad():  # the recorded path: nothing bound
            return tuple(t.detach() for t in run())
    with torch.no_grad():
        for update in (lambda: None, lambda: members[0].pseudo_query.add_(0.3),
                       lambda: members[1].key_norm.weight.mul_(1.5), lambda: nw.add_(0.2),
                       lambda: members[1].pseudo_query.copy_(torch.randn(8, **D64))):
            update()
            got, want = run(), reference()
            assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_phase1_makes_the_first_members_prenorm_without_autograd(dtype, monkeypatch):
    """Without autograd, a group's phase 1 also makes its first member's PreNorm in the same
    kernel call (TwoPhase.fuse_first_norm) and the member hands it on as its output: the
    RMSNorm of its h, as the recorded path's phase 2 makes it; another gain, or a changed
    one, is never served the kept value."""
    from restopo.nn.aggregate import Attend, TwoPhase
    torch.manual_seed(4)
    tol = dict(atol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    members = [Attend(8, backend="cpu").to(dtype) for _ in range(2)]
    for m in members:
        m.pseudo_query.data.normal_()
    phase = TwoPhase(members, backend="cpu")
    norm = torch.nn.RMSNorm(8, eps=1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    phase.fuse_first_norm(norm)
    src = [torch.randn(2, 3, 8, dtype=dtype) for _ in range(3)]

    def first(state, gain):
        return members[0](phase1=state, slot=0, norm_weight=gain, norm_eps=1e-5)
    with torch.enable_grad():  # the recorded path: phase 1, then phase 2's PreNorm
        want = first(phase(*src), norm.weight).detach()
    calls = _count_kernels(monkeypatch)
    with torch.no_grad():
        state = phase(*src)
        assert len(state) == 4 and calls == {"phase1_fwd": 1}
        got = first(state, norm.weight)
        assert got is state[3][0] and calls == {"phase1_fwd": 1}  # no call of its own
        assert torch.allclose(got, want, **tol)
        assert torch.allclose(got, F.rms_norm(state[0][0], (8,), norm.weight, 1e-5), **tol)
        other = first(state, norm.weight * 2)  # not the gain phase 1 was given
        assert other is not got and torch.allclose(other, 2 * want, **tol)
        norm.weight.mul_(3)  # an in-place update: phase 1 binds the new gain
        assert torch.allclose(first(phase(*src), norm.weight), 3 * want, **tol)
        norm.weight = torch.nn.Parameter(norm.weight * 2)  # replaced: bound again, still fused
        state = phase(*src)
        got = first(state, norm.weight)
        assert got is state[3][0] and torch.allclose(got, 6 * want, **tol)


@needs_kernels
def test_cpu_block_model_runs_its_phases_through_the_kernels(monkeypatch):
    """Block AttnRes on backend cpu calls the fused kernels for phase 1 and phase 2 while
    training (the test above could pass with everything on the eager path)."""
    calls = {"phase1": 0, "phase2": 0}
    for cls, name in ((Phase1, "phase1"), (Phase2, "phase2")):
        fwd = cls.forward

        def counted(ctx, *args, _fwd=fwd, _name=name):
            calls[_name] += 1
            return _fwd(ctx, *args)
        monkeypatch.setattr(cls, "forward", staticmethod(counted))
    model = _model(T.block_attnres(T.sublayer_kinds(4), blocks=2), "cpu", torch.float32)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert calls["phase1"] >= 2 and calls["phase2"] >= 4


@needs_kernels
@pytest.mark.parametrize("backend", ["cpu", "eager"])
def test_a_lone_reader_makes_its_own_logits_on_the_cpu_backend(backend, monkeypatch):
    """Block AttnRes's output aggregation is the only Attend to read the block sums (their
    other readers are phase 1s): on the cpu backend it makes their logits in its fused
    kernel (phase 1 with one query), with no logits made apart; on the eager backend, and
    in Full AttnRes, whose readers all share sources, the logits are still shared."""
    from restopo.fx.lower import lowered
    from restopo.nn import shared_sources
    made, fused = [], []
    real = shared_sources.ops.logits_against
    monkeypatch.setattr(shared_sources.ops, "logits_against",
                        lambda v, q, *a, **k: made.append(q.shape[0]) or real(v, q, *a, **k))
    fwd = Phase1.forward
    monkeypatch.setattr(Phase1, "forward", staticmethod(
        lambda ctx, q, *a: fused.append(q.shape[0]) or fwd(ctx, q, *a)))
    block = _model(T.block_attnres(T.sublayer_kinds(4), blocks=2), backend, torch.float32)
    assert len(lowered(block).restopo_shared.alone) == 1
    block(torch.randint(0, 64, (2, 8))).sum().backward()
    if backend == "cpu":
        assert made == [] and fused.count(1) == 1  # the output's one query
    else:
        # the embedding and the two block sums, each against all its readers' queries: the
        # phase 1s' (4 each) and the output's
        assert made == [9, 5, 1] and fused == []
    full = _model(T.full_attnres(T.sublayer_kinds(4)), backend, torch.float32)
    assert lowered(full).restopo_shared.alone == frozenset()


@needs_kernels
@pytest.mark.parametrize("scale", [1.0, 30.0])
@pytest.mark.parametrize("width", [32, 64, 256])
def test_float32_kernels_match_float64(scale, width):
    """The float kernels, whose exp is their own (vectorised), against the double ones
    (libm's exp), forward and backward; at scale 30 the logits spread past the range of a
    float exp (|z| up to about 170), so weights underflow to nothing as they should. Widths
    32 and 64: a row is one span in one precision and not in the other (with 512-bit
    registers), so the register paths meet the general ones; 256: rows of several spans in
    both (square sums by dot_spans)."""
    torch.manual_seed(0)
    d = width
    phase1_in = [torch.randn(3, d, **D64) * scale] + [torch.randn(64, d, **D64)
                                                       for _ in range(5)]
    phase2_in = [torch.randn(64, d, **D64), torch.randn(64, 1, **D64) * scale,
                 torch.randn(64, d, **D64), torch.randn(d, **D64) * scale,
                 torch.randn(d, **D64)]                   # h1, lse, partial, query, gain
    weights = [torch.randn(64, d, **D64) for _ in range(4)] + [torch.randn(64, 1, **D64)
                                                               for _ in range(3)]
    got = {}
    for dtype in (torch.float64, torch.float32):
        a1 = [t.to(dtype).requires_grad_() for t in phase1_in]
        a2 = [t.to(dtype).requires_grad_() for t in phase2_in]
        out = (*Phase1.apply(a1[0], 1e-6, True, 1, *a1[1:]),
               Phase2.apply(*a2, 1e-6, True, 1e-5, False)[1])
        loss = sum((o * w.to(dtype)).sum() for o, w in zip(out, weights))
        got[dtype] = [*out, *torch.autograd.grad(loss, a1 + a2)]
    for a, b in zip(got[torch.float32], got[torch.float64]):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@needs_kernels
def test_float32_kernels_keep_a_nan():
    """A NaN in a source reaches every output of its token (the float exp keeps NaN)."""
    src = [torch.randn(40, 16) for _ in range(3)]
    src[1][7, 2] = float("nan")
    with torch.no_grad():
        out = Phase1.apply(torch.randn(2, 16), 1e-6, True, 1, *src)
    for o in out:
        assert o[7].isnan().all() and not o[torch.arange(40) != 7].isnan().any()


@needs_kernels
@pytest.mark.parametrize("sign", [-1, 1])
def test_infinite_logits_give_the_eager_results_in_every_op(sign):
    """The float exp gave e^-87 below -87 (and e^88 above 88): a logit at -inf got a weight,
    and its source (at 1e37) a share of the output (0.33 off) and of the query's gradient
    (1e37 off), where eager's is 0; now 0 (and inf). At +inf eager's NaN, as before."""
    infinite_logits.assert_as_eager("cpu", sign)


@needs_kernels
def test_kernels_thread_count_changes_only_rounding():
    torch.manual_seed(0)
    src = [torch.randn(300, 16, requires_grad=True) for _ in range(3)]
    q = torch.randn(2, 16, requires_grad=True)
    got = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = Phase1.apply(q, 1e-6, True, 1, *src)
            grads = torch.autograd.grad(sum(o.sum() for o in out), (q, *src))
        finally:
            torch.set_num_threads(prev)
        got.append((out, grads))
    for a, b in zip(got[0][0] + got[0][1], got[1][0] + got[1][1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
def test_phase2_backward_over_several_tiles_and_threads(heads):
    """Phase 2's backward sums the query's and the gain's gradients over tiles of tokens
    (in REAL, then in double): over 300 tokens (an uneven last tile) and one or two
    threads, both kernels equal the eager backend in float64, float32 to its rounding."""
    torch.manual_seed(0)
    inputs = [torch.randn(300, 32, **D64), torch.randn(300, heads, **D64),
              torch.randn(300, 32, **D64), torch.randn(32, **D64), torch.randn(32, **D64)]
    weight = torch.randn(300, 32, **D64)
    a = [t.clone().requires_grad_() for t in inputs]
    h1, lse, p, q, g = a
    y = get_backend("eager").phase2_norm(h1, lse, None, p, q, None, 1e-6, norm_weight=g,
                                         norm_eps=1e-5, key_norm=True, keep_h=False)[1]
    got = [torch.autograd.grad((y * weight).sum(), a)]
    for dtype, threads in ((torch.float64, 1), (torch.float64, 2), (torch.float32, 1),
                           (torch.float32, 2)):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            a = [t.to(dtype).requires_grad_() for t in inputs]
            y = Phase2.apply(*a, 1e-6, True, 1e-5, False)[1]
            got.append(torch.autograd.grad((y * weight.to(dtype)).sum(), a))
        finally:
            torch.set_num_threads(prev)
    for grads in got[1:]:
        for g, want in zip(grads, got[0]):
            assert torch.allclose(g.double(), want, rtol=1e-4,
                                  atol=1e-5 * want.abs().max().item())


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_without_kernels_cpu_says_why_and_auto_runs_eager():
    code = ("import warnings, torch\n"
            "from restopo import ops\n"
            "v = [torch.randn(2, 8, requires_grad=True) for _ in range(3)]\n"
            "q = torch.zeros(8, requires_grad=True)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    for _ in range(2):\n"
            "        ops.depth_attention(v, q, None, 1e-6, backend='auto').sum().backward()\n"
            "print(len(w), str(w[0].message))\n"
            "try:\n"
            "    ops.depth_attention(v, q, None, 1e-6, backend='cpu')\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    out = _run(code, RESTOPO_CPU_KERNELS="0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 ") and "eager backend" in lines[0]  # said once
    assert "RESTOPO_CPU_KERNELS=0" in lines[0]
    assert lines[1] == "backend 'cpu' cannot run: RESTOPO_CPU_KERNELS=0"


def test_a_command_says_the_kernels_are_off_as_a_note_not_a_python_warning(tmp_path):
    """`restopo train` with the kernels off printed a UserWarning: a source path, then the
    line of code that warned. The command says it as its own note; other warnings (not
    restopo's) still print as Python prints them."""
    out = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "restopo", "train",
         "examples/tiny.restopo", "--steps", "1", "--no-progress", "--out", str(tmp_path / "r"),
         "--set", "model.depth=1", "--set", "train.batch=2"],
        capture_output=True, text=True, env={**os.environ, "RESTOPO_CPU_KERNELS": "0"},
        timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("restopo train: note: the fused CPU kernels are unavailable (RESTOPO_CPU_KERNELS=0)"
            in out.stderr), out.stderr
    assert "UserWarning" not in out.stderr and "picked_for(" not in out.stderr
    from restopo.cli import _warnings_as_notes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _warnings_as_notes("eval"):
            warnings.warn("not restopo's")
    assert [str(w.message) for w in seen] == ["not restopo's"]


def test_a_compiler_that_fails_leaves_the_eager_backend(tmp_path):
    """No working C compiler: the reason names it, and nothing half-built is kept."""
    code = ("from restopo.registry import get_backend\n"
            "ok, why = get_backend('cpu').available()\n"
            "print(ok)\n"
            "print(why)\n")
    out = _run(code, CC=str(tmp_path / "no-such-cc"), RESTOPO_CACHE=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    ok, why = out.stdout.splitlines()[:2]
    assert ok == "False" and why.startswith("the C kernels did not build with ")
    assert "no-such-cc" in why
    built = list((tmp_path / "cache").rglob("*.so")) if (tmp_path / "cache").exists() else []
    assert built == []


ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
cpu MHz\t\t: 2596.138
flags\t\t: fpu sse2 avx2 avx512f
"""


def test_the_processor_key_tells_apart_models_that_share_a_name():
    """A VM names several processor generations "AMD EPYC": the key that the kernel cache
    and the golden checkpoints' machine are read by (backends.cpu.build.machine) must
    still tell them apart (the golden test compared this machine's float data with another
    EPYC's at 1e-5 and failed), and must not move with the clock."""
    from restopo.backends.cpu import build

    zen5 = ZEN4.replace("model\t\t: 17", "model\t\t: 2").replace("family\t: 25",
                                                                     "family\t: 26")
    reclocked = ZEN4.replace("2596.138", "3100.000")
    assert build._cpu(ZEN4) != build._cpu(zen5)
    assert build._cpu(ZEN4) != build._cpu(ZEN4.replace("AuthenticAMD", "GenuineIntel"))
    assert build._cpu(ZEN4) != build._cpu(ZEN4.replace(" avx512f", ""))
    assert build._cpu(ZEN4) == build._cpu(reclocked)
    assert build._cpu() in build.machine()


# ---- the PreNorm's RMSNorm (every topology's sublayers and final norm)

def test_rms_norm_gradcheck_with_and_without_gain():
    x = torch.randn(2, 3, 8, **D64, requires_grad=True)
    w = torch.randn(8, **D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x: _RMSNorm.apply(x, None, 1e-6), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(32, dtype=dtype, requires_grad=True)
    gy = torch.randn(4, 5, 32, dtype=dtype)
    a = rms_norm(x, w, 1e-24)
    b = F.rms_norm(x, (32,), w, 1e-24)
    assert a.dtype == b.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.allclose(a, b, **tol)
    for u, v in zip(torch.autograd.grad(a, (x, w), gy), torch.autograd.grad(b, (x, w), gy)):
        assert torch.allclose(u.float(), v.float(), **tol)


def test_rms_norm_zero_row_has_finite_gradients():
    x = torch.zeros(3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    gx, gw = torch.autograd.grad(rms_norm(x, w, 1e-24).sum(), (x, w))
    assert gx.isfinite().all() and gw.isfinite().all()


def test_sublayer_norms_run_the_written_backward_and_keep_their_keys():
    from restopo.nn.norm import RMSNorm
    model = _model(T.standard(T.sublayer_kinds(4)), "eager", torch.float32)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(isinstance(m, RMSNorm) for m in norms)
    assert all(k.endswith("norm.weight") for k in model.state_dict() if "norm" in k)
    x = torch.randn(2, 3, 16, requires_grad=True)
    assert type(norms[0](x).grad_fn).__name__ == "_RMSNormBackward"


@needs_kernels
def test_a_shared_buffer_it_cannot_write_gets_the_gradient_handed_back():
    """Phase 1 writes a shared source's gradient into the source's buffer (rows); where an
    earlier reader left that buffer strided otherwise, it returns its part to autograd
    instead: the gradient is the same either way."""
    from restopo.backends.eager.weighted import gathered

    class Strided(torch.autograd.Function):  # runs first in backward: a transposed buffer
        @staticmethod
        def forward(ctx, x, sink):
            ctx.sink = sink
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            shape = ctx.sink.like_shape
            ctx.sink.grad = torch.zeros(shape[::-1], **D64).t()
            ctx.sink.task = torch._C._current_graph_task_id()
            return g, None

    torch.manual_seed(0)
    v = [torch.randn(5, 8, **D64, requires_grad=True) for _ in range(2)]
    q = torch.randn(2, 8, **D64, requires_grad=True)
    want = torch.autograd.grad(sum(o.sum() for o in Phase1.apply(q, 1e-6, True, 1, *v)[:2]), v)
    views = [gathered(x) for x in v]
    sink = views[0].restopo_sink
    sink.like_shape = tuple(v[0].shape)
    out = Phase1.apply(q, 1e-6, True, 1, *views)
    got = torch.autograd.grad(Strided.apply(out[0], sink).sum() + out[1].sum(), v)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def test_a_cache_that_cannot_be_made_is_said_once_naming_restopo_cache(tmp_path):
    """The reason said '[Errno 20] Not a directory: ...' once per set of compiler flags."""
    (tmp_path / "file").write_text("")
    code = ("from restopo.registry import get_backend\n"
            "print(get_backend('cpu').available()[1])\n")
    out = _run(code, RESTOPO_CACHE=str(tmp_path / "file"))
    assert out.returncode == 0, out.stderr
    why = out.stdout.splitlines()[0]
    assert f"RESTOPO_CACHE={tmp_path / 'file'} cannot hold restopo's cache" in why, why
    assert why.count("RESTOPO_CACHE=") == 1 and "Errno" not in why, why
