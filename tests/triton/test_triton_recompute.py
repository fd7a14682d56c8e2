"""Activation recompute on backend "triton" (the fused kernels run again in backward; phase 2
with the fused PreNorm inside a block region): the same loss and gradients as without."""
import pytest
import torch

import restopo.backends.triton as T
from restopo.api import compile as compile_spec
from restopo.fx import recompute
from test_triton_model import SPEC


@pytest.mark.parametrize("mode", ["sublayer", "block"])
@pytest.mark.parametrize("residual", ["block_attnres(blocks: 2)", "full_attnres"])
def test_triton_recompute_equals_none(residual, mode):
    text = SPEC.format(residual=residual)
    torch.manual_seed(0)
    plain = compile_spec(text, backend="triton")
    with torch.no_grad():  # off init: non-uniform depth weights
        for p in plain.parameters():
            p.add_(0.3 * torch.randn_like(p))
    again = recompute.apply(compile_spec(text, backend="triton"), mode)
    again.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 61, (2, 7))
    losses = []
    with T.tiles(rows=4, chunk=16):
        for m in (plain, again):
            loss = m(idx).square().mean()
            loss.backward()
            losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (n, p), q in zip(plain.named_parameters(), again.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
