"""restopo.rewire with a multi-stream residual (Hyper-Connections, mHC) on the nanoGPT-style
GPT of tests/models: the original weights drive n streams; HC starts as the original model
(exactly for n = 1, up to the norms' epsilon otherwise); coefficients train and stay float32
in a bf16 model."""
import pytest
import torch

import restopo
from restopo.fx.rewire import rewire

from models.nanogpt import GPT, GPTConfig
from models.rewired import gpt_losses


def gpt(n_layer=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer)).double()


def tokens(T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, T), generator=g), torch.randint(0, 128, (2, T), generator=g)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dynamic", ("false", "true"))
def test_hyper_connections_start_as_the_original(dynamic):
    """One stream: the original model exactly. Four: the same stream four times, read
    one-hot; only the final LayerNorm sees the sum, 4 h, and its epsilon (1e-5) is not
    negligible against nanoGPT's activations, so the logits move by that much, no more."""
    m = gpt()
    idx, targets = tokens()
    want = m(idx, targets)[0]
    one = rewire(m, f"residual hyper_connections(streams: 1, dynamic: {dynamic})\n")
    torch.testing.assert_close(one(idx, targets)[0], want, rtol=0, atol=1e-12)
    four = rewire(m, f"residual hyper_connections(streams: 4, dynamic: {dynamic})\n")
    assert 0 < _rel(four(idx, targets)[0], want) < 1e-2


def test_mhc_trains_its_coefficients_and_keeps_the_original_weights():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = rewire(m, "residual mhc(streams: 4)\n")
    for k, v in r.model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(k.startswith("body.aggregations.") for k in r.state_dict()
               if not k.startswith("model."))
    losses = gpt_losses(r, *tokens(T=16), steps=12)
    assert losses[-1] < losses[0] - 0.5, losses
    phis = [a.phi for a in restopo.aggregations(r) if hasattr(a, "phi")]
    assert len(phis) == 4 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in phis)


def test_a_bf16_model_keeps_float32_coefficients():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2)).to(torch.bfloat16)
    r = rewire(m, "residual mhc(streams: 2)\n")
    assert {p.dtype for a in restopo.aggregations(r) for p in a.parameters()} == {torch.float32}
    idx, targets = tokens()
    logits, loss = r(idx, targets)
    assert logits.dtype == torch.bfloat16 and loss.isfinite()
