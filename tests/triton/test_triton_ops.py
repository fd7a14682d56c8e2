"""The custom ops: torch.library.opcheck, torch.compile, and a compiled model on backend
"triton" against backend "eager"."""
import pytest
import torch

import restopo.backends.triton as T
from restopo.backends.eager import depth as E
from restopo.backends.triton import custom_ops  # noqa: F401  (registers torch.ops.restopo.*)
from triton_testing import TOL, assert_rel, grads, leaf, make_sources, ref_leaf, ref_phase1

restopo_ops = torch.ops.restopo


def _inputs(dtype=torch.float32, grad=True):
    v, w, g = make_sources(3, (2, 3), 40, dtype=dtype)
    wq = torch.stack([w, 0.5 * w])
    gq = torch.stack([g, g.flip(0)])
    make = leaf if grad else (lambda x: x.detach().clone())
    return [make(x) for x in (v, w, g, wq, gq)]


def _opcheck(op, args):
    with T.tiles(rows=4, chunk=16):
        torch.library.opcheck(op, args)


def _list(v):
    """Separate leaf tensors, one per source (the form the model hands the ops)."""
    return [leaf(x) for x in v.detach().unbind(0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_depth_attention(dtype):
    v, w, g, _, _ = _inputs(dtype)
    vs = _list(v)
    _opcheck(restopo_ops.depth_attention.default, (vs, w, g, 1e-6, True))
    _opcheck(restopo_ops.depth_attention.default, (vs, w, None, 1e-6, False))
    out, lse = restopo_ops.depth_attention(vs, w, g, 1e-6, True)
    for need_du in (True, False):
        _opcheck(restopo_ops.depth_attention_backward.default,
                 (torch.randn_like(out), torch.randn_like(lse), lse.detach(),
                  [x.detach() for x in vs], w.detach(), g.detach(), 1e-6, True, need_du))


def test_opcheck_depth_attention_mixed_dtypes():
    """An fp32 source among bf16 ones (bf16 autocast: the embedding stays fp32)."""
    v, w, g, _, _ = _inputs()
    vs = [leaf(x, torch.bfloat16 if i else torch.float32) for i, x in enumerate(v.unbind(0))]
    _opcheck(restopo_ops.depth_attention.default, (vs, w, g, 1e-6, True))


def test_opcheck_backward_ops_with_three_source_dtypes():
    """bf16, fp16 and fp32 sources (the kernels read them all promoted to fp32): each
    gradient comes back in its source's dtype, as the fake backward ops say (under
    inductor, fp32 gradients taken for bf16 and fp16 ones were off by 8 and 225), and as
    eager's in float64 to bf16's tolerance."""
    v, w, g, wq, _ = _inputs()
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    vs = [leaf(x, dt) for x, dt in zip(v.unbind(0), dtypes)]
    out, lse = restopo_ops.depth_attention(vs, w, g, 1e-6, True)
    plain = [x.detach() for x in vs]
    _opcheck(restopo_ops.depth_attention_backward.default,
             (torch.randn_like(out), torch.randn_like(lse), lse.detach(), plain, w.detach(),
              g.detach(), 1e-6, True, True))
    o1, m1, s1, z = restopo_ops.phase1(vs, wq, None, 1e-6, True)
    _opcheck(restopo_ops.phase1_backward.default,
             ([torch.randn_like(o) for o in o1], torch.randn_like(m1), torch.randn_like(s1),
              plain, wq.detach(), None, z.detach(), m1.detach(), 1e-6, True, True))
    refs = [ref_leaf(x, dt) for x, dt in zip(v.unbind(0), dtypes)]
    cot = torch.randn(out.shape, dtype=torch.float64)
    with T.tiles(rows=4):
        got = grads(T.depth_attention(vs, w, g), vs, cot)
    want = grads(E.depth_attention(refs, w.detach().double(), g.detach().double()), refs, cot)
    for a, b, dt in zip(got, want, dtypes):
        assert a.dtype == dt
        assert_rel(a, b, TOL[torch.bfloat16], f"{dt} source's gradient")


def test_opcheck_phase1():
    v, _, _, wq, gq = _inputs()
    vs = _list(v)
    _opcheck(restopo_ops.phase1.default, (vs, wq, gq, 1e-6, True))
    o1, m1, s1, z = restopo_ops.phase1(vs, wq, gq, 1e-6, True)
    for need_du in (True, False):
        _opcheck(restopo_ops.phase1_backward.default,
                 ([torch.randn_like(o) for o in o1], torch.randn_like(m1),
                  torch.randn_like(s1), [x.detach() for x in vs], wq.detach(), gq.detach(),
                  z.detach(), m1.detach(), 1e-6, True, need_du))


@pytest.mark.parametrize("partial,norm,with_h", [(True, True, True), (True, False, True),
                                                 (False, True, True), (True, True, False)])
def test_opcheck_phase2(partial, norm, with_h):
    v, w, g, wq, gq = _inputs()
    o1, m1, s1 = (leaf(x[0]) for x in ref_phase1(v.detach(), wq.detach(), gq.detach()))
    p = leaf(v[1].detach()) if partial else None
    nw = leaf(g.detach().flip(0))
    args = (o1, m1, s1, p, w, g, nw, 1e-6, 1e-5, True, norm, with_h)
    _opcheck(restopo_ops.phase2.default, args)
    h, y = restopo_ops.phase2(*args)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args[:-1]]
    _opcheck(restopo_ops.phase2_backward.default,
             (torch.randn_like(h), torch.randn_like(y), *plain, True, True, True))


def _block(v, w, g, wq, gq, outs, nw, depth_attention, phase1, phase2_norm):
    """One Block AttnRes block the way a model runs it: the single-read op for the head-like
    aggregation, phase 1 for the block's queries, phase 2 + the next PreNorm per sublayer."""
    o1, m1, s1 = phase1(v, wq, gq)
    total = depth_attention(v, w, g).square().mean()
    for j in range(wq.shape[0]):
        partial = outs[:j].sum(0) if j else None
        h, y = phase2_norm(o1[j], m1[j], s1[j], partial, wq[j], gq[j], norm_weight=nw)
        total = total + (h * y).mean()
    return total


def _eager_phase2_norm(o1, m1, s1, partial, q, g, norm_weight):
    h = E.phase2(o1, m1, s1, partial, q, g)
    return h, torch.nn.functional.rms_norm(h, (h.shape[-1],), norm_weight, 1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend):
    torch._dynamo.reset()
    base = _inputs()
    outs = make_sources(2, (2, 3), 40, seed=3)[0].float()
    nw = torch.linspace(0.5, 1.5, 40)
    ref_in = [leaf(x) for x in base] + [leaf(outs), leaf(nw)]
    ins = [leaf(x) for x in base] + [leaf(outs), leaf(nw)]
    ref = _block(*ref_in, E.depth_attention, E.phase1, _eager_phase2_norm)
    fn = torch.compile(lambda *a: _block(*a, T.depth_attention, T.phase1, T.phase2_norm),
                       backend=backend, fullgraph=True)
    with T.tiles(rows=4, chunk=16):
        got = fn(*ins)
        assert_rel(got, ref, 1e-5, "compiled value")
        for a, b in zip(grads(got, ins, torch.ones(())), grads(ref, ref_in, torch.ones(()))):
            assert_rel(a, b, 1e-5, "compiled gradient")
