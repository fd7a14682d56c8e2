"""The eager backend's no-grad forms (backends/eager/stacked.py, one stacked pass) against
its autograd forms (unstacked.py) and a float64 hand loop, for every option."""
import pytest
import torch

from restopo import ops
from restopo.backends.eager import stacked, unstacked

EPS = 1e-30


def hand_depth_attention(sources, q, gain, key_norm, gate, heads):
    """sum_i alpha_i v_i per head, one source and one head at a time."""
    d = sources[0].shape[-1]
    c = d // heads
    out = torch.zeros_like(sources[0])
    w = q * gain if key_norm else q
    logits = []
    for v in sources:
        k = v / v.pow(2).mean(-1, keepdim=True).add(EPS).sqrt() if key_norm else v
        logits.append(torch.stack([(k[..., h * c:(h + 1) * c] * w[..., h * c:(h + 1) * c]).sum(-1)
                                   for h in range(heads)], -1))
    z = torch.stack(logits)
    alpha = torch.softmax(z, 0) if gate == "softmax" else torch.sigmoid(z)
    for i, v in enumerate(sources):
        out = out + alpha[i].repeat_interleave(c, -1) * v
    return out


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("per_token", [False, True])
def test_depth_attention_forms_agree(heads, key_norm, gate, per_token):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 3, 16, generator=g, dtype=torch.float64) for _ in range(5)]
    q = torch.randn(*((2, 3, 16) if per_token else (16,)), generator=g, dtype=torch.float64)
    gain = torch.rand(16, generator=g, dtype=torch.float64) + 0.5
    w = q * gain if key_norm else q
    kw = dict(key_norm=key_norm, gate=gate, heads=heads)
    want = hand_depth_attention(sources, q, gain, key_norm, gate, heads)
    torch.testing.assert_close(stacked.depth_attention(sources, q, w, EPS, **kw), want)
    torch.testing.assert_close(stacked.depth_attention(sources, q, w, EPS, loops=True, **kw),
                               want)  # the form torch.compile traces (products and sums)
    torch.testing.assert_close(unstacked.depth_attention(sources, q, w, EPS, **kw), want)
    with torch.no_grad():  # the dispatch picks the stacked form without autograd
        got = ops.depth_attention(tuple(sources), q, gain, EPS, backend="eager", **kw)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
def test_two_phase_forms_agree(heads, key_norm):
    g = torch.Generator().manual_seed(1)
    completed = [torch.randn(2, 3, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    queries = torch.randn(3, 16, generator=g, dtype=torch.float64)
    gains = torch.rand(3, 16, generator=g, dtype=torch.float64) + 0.5
    w = queries * gains if key_norm else queries
    a = stacked.phase1(completed, w, EPS, key_norm=key_norm, heads=heads)
    b = unstacked.phase1(completed, w, EPS, key_norm=key_norm, heads=heads)
    loops = stacked.phase1(completed, w, EPS, key_norm=key_norm, heads=heads, loops=True)
    assert a[2] == b[2] == loops[2] == (None,) * 3  # normalised: (o1/s1, m1 + log s1, 1)
    for x, y, z in zip(a[:2], b[:2], loops[:2]):
        torch.testing.assert_close(x, y)
        torch.testing.assert_close(z, y)
    partial = torch.randn(2, 3, 16, generator=g, dtype=torch.float64)
    for slot in range(3):
        normal = (b[0][slot], b[1][slot], None)           # (h1, lse, s1 = 1)
        c = torch.rand(b[1][slot].shape, generator=g, dtype=torch.float64) + 0.5
        o1 = (b[0][slot].unflatten(-1, (heads, -1)) * c.unsqueeze(-1)).flatten(-2)
        state = (o1, b[1][slot] - c.log(), c)             # the same state, s1 = c
        for p in (None, partial):
            want = hand_depth_attention(completed + ([] if p is None else [p]), queries[slot],
                                        gains[slot], key_norm, "softmax", heads)
            for form in (state, normal):  # either form, into either phase 2
                for phase2 in (stacked.phase2, unstacked.phase2):
                    got = phase2(*unstacked.normalised(*form), p, w[slot], EPS,
                                 key_norm=key_norm)
                    torch.testing.assert_close(got, want)


def test_training_keeps_the_autograd_forms():
    """With gradients wanted, the unstacked forms run (they save no stacked copy)."""
    v = [torch.randn(2, 8, requires_grad=True) for _ in range(3)]
    q = torch.zeros(8, requires_grad=True)
    assert not stacked.without_grad(q, *v)
    with torch.no_grad():
        assert stacked.without_grad(q, *v)
    out = ops.depth_attention(tuple(v), q, None, EPS, backend="eager")
    out.sum().backward()
    assert all(t.grad is not None for t in v)


def test_bf16_logits_stay_finite_for_tiny_rows():
    """A near-zero source has a huge 1/RMS: the logits are taken in float32."""
    sources = [torch.full((2, 16), 1e-20, dtype=torch.bfloat16), torch.randn(2, 16).bfloat16()]
    q = torch.ones(16, dtype=torch.bfloat16)
    out = stacked.depth_attention(sources, q, q, EPS, key_norm=True, gate="softmax", heads=1)
    assert torch.isfinite(out).all() and out.dtype == torch.bfloat16
