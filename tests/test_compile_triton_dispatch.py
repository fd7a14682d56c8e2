"""A compiled model on backend='triton' (triton's CPU interpreter here, CUDA elsewhere)
matches the eager backend: the dispatch in restopo.ops reaches the fused kernels."""
from types import SimpleNamespace

import pytest
import torch

from restopo import ops
from restopo import topology as T
from restopo.api import build_model, set_backend

pytestmark = pytest.mark.skipif(ops.triton_unavailable_reason("cpu") is not None,
                                reason="triton cannot run on CPU here (TRITON_INTERPRET unset)")


@pytest.mark.parametrize("topo", ["block", "full"])
def test_triton_backend_matches_eager(topo, monkeypatch):
    kinds = T.sublayer_kinds(2)
    t = T.block_attnres(kinds, blocks=2) if topo == "block" else T.full_attnres(kinds)
    c = SimpleNamespace(vocab=23, width=32, depth=2, heads=2, mlp="gelu", mlp_ratio=2,
                        context=8)
    torch.manual_seed(0)
    model = build_model(c, t, backend="eager")
    with torch.no_grad():
        for a in model.aggregations:
            a.pseudo_query.normal_()
            a.key_norm.weight.uniform_(0.5, 1.5)
    idx = torch.randint(0, 23, (2, 5))
    want = model(idx)
    want.square().mean().backward()
    want_grads = [a.pseudo_query.grad.clone() for a in model.aggregations]
    model.zero_grad()

    calls = []
    import restopo.backends.triton as tri
    for name in ("depth_attention", "phase1", "phase2"):
        fn = getattr(tri, name)
        monkeypatch.setattr(tri, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n)
                            or _fn(*a, **k))
    set_backend(model, "triton")
    got = model(idx)
    got.square().mean().backward()
    assert calls, "the triton backend was never called"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, g in zip(model.aggregations, want_grads):
        torch.testing.assert_close(a.pseudo_query.grad, g, rtol=1e-3, atol=1e-5)
