"""Logits that overflow to +-inf, through restopo.ops on a fused backend and on the eager
one, which gives such a source weight 0 at -inf and NaN at +inf (torch.softmax's)
(tests/test_cpu_backend.py, tests/triton/test_triton_nocopy.py)."""
import torch

from restopo import ops
from restopo.backends.eager.depth import logits


def results(backend: str, sign: int) -> list[torch.Tensor]:
    """Outputs and every input's gradient of depth attention, phase 1 and phase 2 without
    the key norm, over sources of which the first (where an online softmax starts) and
    phase 2's partial make a logit at sign * inf."""
    gen = torch.Generator().manual_seed(1)
    d = 24
    w = torch.randn(d, generator=gen).abs() + 2  # 1e37 * sum(w) overflows fp32, 1e37 * dh not
    big = torch.full((2, 3, d), sign * 1e37)
    assert (logits(big[None], w, None, 1e-6, key_norm=False) == sign * float("inf")).all()
    ins = [x.requires_grad_() for x in (big, torch.randn(2, 3, d, generator=gen),
                                        torch.randn(2, 3, d, generator=gen), big.clone(),
                                        w, torch.stack([w.flip(0), w]))]
    *v, q, qs = ins
    out = [ops.depth_attention(v, q, key_norm=False, backend=backend)]
    o1, m1, s1 = ops.phase1(v[:3], qs, key_norm=False, backend=backend)
    out.append(ops.phase2(o1[1], m1[1], s1[1], v[3], qs[1], key_norm=False, backend=backend))
    cots = [torch.randn(o.shape, generator=gen) for o in out]
    total = sum((o.double() * c).sum() for o, c in zip(out, cots))
    return out + list(torch.autograd.grad(total, ins))


def assert_as_eager(backend: str, sign: int, tol: float = 4e-5) -> None:
    """`backend`'s results equal eager's within tol of each one's largest finite entry (float
    rounding, summed in another order), NaN where eager's is NaN (and, at -inf, eager's are
    all finite)."""
    got, want = results(backend, sign), results("eager", sign)
    assert sign > 0 or all(b.isfinite().all() for b in want)
    for k, (a, b) in enumerate(zip(got, want)):
        scale = b.nan_to_num(0).abs().max().item()
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * scale,
                                   equal_nan=True, msg=f"result {k} of {backend}")
