"""Sources at the edges of their dtype's range, with the key norm, through restopo.ops on
any backend, against the stacked forms in autograd's ops (tests/test_extreme_sources.py).

torch's RMSNorm (F.rms_norm, which eager runs on CUDA and without autograd) defines the key
norm: a row whose mean square overflows the accumulation dtype (|v| above ~1.8e19 in
float32 and bf16) has rstd 0 and so a key of 0, a logit of 0 and, the key being 0 all
around it, no gradient through the key (F.rms_norm's own backward is NaN there: it forms
dk . v, which overflows too)."""
import torch
import torch.nn.functional as F

from restopo import ops
from restopo.backends.eager.depth import _expand

EPS = 1e-6
# what the extreme sources hold: a scale of a whole source, or one element set
CASES = {
    "huge": {torch.float32: 1e25, torch.float64: 1e160},      # the mean square overflows
    "tiny": {torch.float32: 1e-41, torch.float64: 1e-315},    # subnormal
    "zero": 0.0, "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"),
}
EXTREME = (0, 3)  # the sources made extreme: where the online softmax starts, the partial


def inputs(case: str, dtype: torch.dtype, d: int, heads: int,
           device: str = "cpu") -> list[torch.Tensor]:
    """Four sources [3, d] (the first and the last, phase 2's partial, extreme), a query and
    its gain, a query per token, a block's two queries and gains, a norm gain: fresh
    leaves."""
    gen = torch.Generator().manual_seed(3)
    v = [torch.randn(3, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    value = CASES[case]
    for i in EXTREME:
        if isinstance(value, dict):
            v[i] = v[i] * value[dtype]
        elif value == 0:
            v[i][1] = 0.0                         # one token's row
        else:
            v[i][1, d // heads - 1] = value       # one element of the first head
    q, qt, qs = (torch.randn(s, generator=gen, dtype=torch.float64)
                 for s in ((d,), (3, d), (2, d)))
    g, gs, nw = (1 + 0.2 * torch.randn(s, generator=gen, dtype=torch.float64)
                 for s in ((d,), (2, d), (d,)))
    return [x.to(device, dtype).requires_grad_() for x in (*v, q, g, qt, qs, gs, nw)]


def _ops(ins, heads, backend):
    *v, q, g, qt, qs, gs, nw = ins
    out = [ops.depth_attention(v, query, g, EPS, heads=heads, backend=backend)
           for query in (q, qt)]
    o1, m1, s1 = ops.phase1(v[:3], qs, gs, EPS, heads=heads, backend=backend)
    h1 = o1 if s1[0] is None else [o / s.repeat_interleave(o.shape[-1] // heads, -1)
                                   for o, s in zip(o1, s1)]
    lse = m1 if s1[0] is None else [m + s.log() for m, s in zip(m1, s1)]
    out += [*h1, *lse]
    out += ops.phase2_norm(o1[1], m1[1], s1[1], v[3], qs[1], gs[1], EPS, norm_weight=nw,
                           backend=backend)
    return out


def logits(v, q, g, heads):
    """[n, *b, H]: the logits of sources v [n, *b, d] against query q ([d] or [*b, d]) with
    key-norm gain g: F.rms_norm's keys, 0 (and no gradient) where a finite row's mean
    square overflows."""
    over = v.isfinite().all(-1, keepdim=True) & v.square().sum(-1, keepdim=True).isinf()
    k = torch.where(over, 0.0, F.rms_norm(v, (v.shape[-1],), None, EPS))
    return (k.unflatten(-1, (heads, -1)) * (q * g).unflatten(-1, (heads, -1))).sum(-1)


def _reference(ins, heads):
    """The same results in autograd's ops over the stacked sources: keys F.rms_norm's."""
    *v, q, g, qt, qs, gs, nw = ins
    d = v[0].shape[-1]
    c = torch.stack(v[:3])
    out = [(_expand(torch.softmax(logits(torch.stack(v), query, g, heads), 0), d)
            * torch.stack(v)).sum(0) for query in (q, qt)]
    z = torch.stack([logits(c, qs[s], gs[s], heads) for s in range(2)])
    lse = torch.logsumexp(z, 1)                                     # [S, *b, H]
    h1 = (_expand(torch.softmax(z, 1), d) * c).sum(1)
    out += [*h1, *lse]
    w = torch.sigmoid(logits(v[3][None], qs[1], gs[1], heads)[0] - lse[1])
    h = torch.lerp(h1[1], v[3], _expand(w, d))
    return out + [h, F.rms_norm(h, (d,), nw, EPS)]


def results(backend: str | None, case: str, dtype: torch.dtype, d: int = 8,
            heads: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    """Outputs of depth attention, phase 1 and phase 2 with the next PreNorm, and every
    input's gradient; backend None: the reference."""
    ins = inputs(case, dtype, d, heads, device)
    out = _reference(ins, heads) if backend is None else _ops(ins, heads, backend)
    gen = torch.Generator().manual_seed(4)
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device) for o in out]
    total = sum((o.double() * c).sum() for o, c in zip(out, cots))
    return out + list(torch.autograd.grad(total, ins))


def assert_as_reference(backend: str, case: str, dtype: torch.dtype, **kw) -> None:
    """Each result NaN and infinite where the reference's is, and elsewhere within rounding
    of the reference's largest finite entry."""
    tol = 4e-5 if dtype == torch.float32 else 1e-10
    got, want = results(backend, case, dtype, **kw), results(None, case, dtype, **kw)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"result {k} of {backend}: {a.dtype}, not {b.dtype}"
        scale = b.nan_to_num(0, 0, 0).abs().max().item()
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * scale,
                                   equal_nan=True, msg=lambda m: f"result {k} of {backend}: {m}")
