"""torch.compile of a compiled model runs on CPU and matches eager."""
from types import SimpleNamespace

import torch

from restopo import topology as T
from restopo.api import build_model


def test_torch_compile_matches_eager_forward_and_backward():
    torch.manual_seed(0)
    c = SimpleNamespace(vocab=50, width=32, depth=2, heads=4, mlp="swiglu", mlp_ratio=2,
                        context=16)
    model = build_model(c, T.block_attnres(T.sublayer_kinds(2), blocks=2), backend="eager")
    with torch.no_grad():
        for a in model.aggregations:
            a.pseudo_query.normal_()
    idx = torch.randint(0, 50, (2, 8))
    want = model(idx)
    want.square().mean().backward()
    want_grads = [a.pseudo_query.grad.clone() for a in model.aggregations]
    model.zero_grad()
    got = torch.compile(model)(idx)
    got.square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, g in zip(model.aggregations, want_grads):
        torch.testing.assert_close(a.pseudo_query.grad, g, rtol=1e-3, atol=1e-6)
