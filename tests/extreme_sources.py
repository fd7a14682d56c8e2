"""Sources at the edges of their dtype's range, with the key norm, through restopo.ops on
any backend, against the stacked forms in autograd's ops (tests/test_extreme_sources.py).

torch's RMSNorm (F.rms_norm, which eager runs on CUDA and without autograd) defines the key
norm: a row whose mean square overflows the accumulation dtype (|v| above ~1.8e19 in
float32 and bf16) has rstd 0 and so a key of 0, a logit of 0 and, the key being 0 all
around it, no gradient through the key (F.rms_norm's own backward is NaN there: it forms
dk . v, which overflows too)."""
import os

import pytest
import torch
import torch.nn.functional as F

from restopo import ops
from restopo.registry import get_backend
from restopo.backends.eager.depth import _expand

EPS = 1e-6
# what the extreme sources hold: a scale of a whole source, or one element set
CASES = {
    "huge": {torch.float32: 1e25, torch.float64: 1e160},      # the mean square overflows
    "tiny": {torch.float32: 1e-41, torch.float64: 1e-315},    # subnormal
    "zero": 0.0, "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"),
}
EXTREME = (0, 3)  # the sources made extreme: where the online softmax starts, the partial


def need(backend: str, monkeypatch) -> None:
    """Skip unless `backend` runs here; triton in its interpreter (CPU tensors)."""
    if backend == "triton":
        from restopo.backends.triton import available
        ok = available("cpu")[0]
        monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    else:
        ok = backend == "eager" or get_backend(backend).available()[0]
    if not ok:
        pytest.skip(f"the {backend} backend cannot run here")


def inputs(case: str, dtype: torch.dtype, d: int = 8, heads: int = 1) -> list[torch.Tensor]:
    """Four sources [3, d] (the first and the last, phase 2's partial, extreme) and the
    rest of `results`' inputs."""
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
    return v + queries(d, (3,), 2, gen)


def queries(d: int, batch: tuple, S: int, gen: torch.Generator,
            gains: bool = True) -> list[torch.Tensor | None]:
    """A query and its gain, a query per token, a block's S queries and gains, a norm gain
    (float64; gains None with gains=False)."""
    q, qt, qs = (torch.randn(s, generator=gen, dtype=torch.float64)
                 for s in ((d,), (*batch, d), (S, d)))
    g, gs, nw = (1 + 0.2 * torch.randn(s, generator=gen, dtype=torch.float64)
                 for s in ((d,), (S, d), (d,)))
    return [q, g if gains else None, qt, qs, gs if gains else None, nw]


def _ops(ins, backend, heads, key_norm, gate, eps):
    *v, q, g, qt, qs, gs, nw = ins
    kw = dict(key_norm=key_norm, heads=heads, backend=backend)
    out = [ops.depth_attention(v, q, g, eps, gate=gate, **kw),
           ops.depth_attention(v, qt, g, eps, **kw), ops.depth_attention(v[:1], q, g, eps, **kw)]
    o1, m1, s1 = ops.phase1(v[:-1], qs, gs, eps, **kw)
    h1 = o1 if s1[0] is None else [o / s.repeat_interleave(o.shape[-1] // heads, -1)
                                   for o, s in zip(o1, s1)]
    lse = m1 if s1[0] is None else [m + s.log() for m, s in zip(m1, s1)]
    out += [*h1, *lse]
    last = len(qs) - 1
    out += ops.phase2_norm(o1[last], m1[last], s1[last], v[-1], qs[last],
                           None if gs is None else gs[last], eps, norm_weight=nw,
                           key_norm=key_norm, backend=backend)
    return out


def logits(v, q, g, heads, key_norm, eps):
    """[n, *b, H]: the logits of sources v [n, *b, d] against query q ([d] or [*b, d]) with
    key-norm gain g (or None): F.rms_norm's keys, 0 (and no gradient) where a finite row's
    mean square overflows."""
    k = v
    if key_norm:
        over = v.isfinite().all(-1, keepdim=True) & v.square().sum(-1, keepdim=True).isinf()
        k = torch.where(over, 0.0, F.rms_norm(v, (v.shape[-1],), None, eps))
        q = q if g is None else q * g
    return (k.unflatten(-1, (heads, -1)) * q.unflatten(-1, (heads, -1))).sum(-1)


def _reference(ins, heads, key_norm, gate, eps):
    """The same results in autograd's ops over the stacked sources."""
    *v, q, g, qt, qs, gs, nw = ins
    d, gs = v[0].shape[-1], [None] * len(qs) if gs is None else gs
    out = []
    for vs, query, f in ((v, q, gate), (v, qt, "softmax"), (v[:1], q, "softmax")):
        z = logits(torch.stack(vs), query, g, heads, key_norm, eps)
        alpha = torch.softmax(z, 0) if f == "softmax" else torch.sigmoid(z)
        out.append((_expand(alpha, d) * torch.stack(vs)).sum(0))
    c = torch.stack(v[:-1])
    z = torch.stack([logits(c, qs[s], gs[s], heads, key_norm, eps) for s in range(len(qs))])
    lse = torch.logsumexp(z, 1)                                     # [S, *b, H]
    h1 = (_expand(torch.softmax(z, 1), d) * c).sum(1)
    out += [*h1, *lse]
    z2 = logits(v[-1][None], qs[-1], gs[-1], heads, key_norm, eps)[0]
    h = torch.lerp(h1[-1], v[-1], _expand(torch.sigmoid(z2 - lse[-1]), d))
    return out + [h, F.rms_norm(h, (d,), nw, eps)]


def results(backend: str | None, ins: list, dtype: torch.dtype, device: str = "cpu", *,
            heads: int = 1, key_norm: bool = True, gate: str = "softmax",
            eps: float = EPS) -> list[torch.Tensor]:
    """Outputs of depth attention (over every source, with a query per token, over the first
    source alone), phase 1 over all sources but the last and phase 2 of its last query with
    the last as the partial, with the next PreNorm, then every input's gradient (None: not
    used); backend None: the reference. `ins`: sources, then `queries`' tensors."""
    ins = [None if x is None else x.to(device, dtype).requires_grad_() for x in ins]
    out = (_reference(ins, heads, key_norm, gate, eps) if backend is None
           else _ops(ins, backend, heads, key_norm, gate, eps))
    gen = torch.Generator().manual_seed(4)
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device) for o in out]
    total = sum((o.double() * c).sum() for o, c in zip(out, cots))
    leaves = [x for x in ins if x is not None]
    return out + list(torch.autograd.grad(total, leaves, allow_unused=True))


def names(ins: list) -> list[str]:
    """What `results` returns, by name."""
    n, S = len(ins) - 6, ins[-3].shape[0]
    params = [name for name, x in zip(("q", "g", "qt", "qs", "gs", "nw"), ins[n:])
              if x is not None]
    return (["attention", "attention per-token query", "attention over one source"]
            + [f"h1[{s}]" for s in range(S)] + [f"lse[{s}]" for s in range(S)] + ["h", "y"]
            + [f"d v{i}" for i in range(n)] + [f"d {p}" for p in params])


def assert_as_reference(backend: str, ins: list, dtype: torch.dtype, tol: float | None = None,
                        floor: float = 0.0, **kw) -> None:
    """Each result NaN and infinite where the reference's is, and elsewhere within tol
    (rounding) of the reference's largest finite entry; the [d] parameters' gradients also
    within `floor` (the rounding of the terms such a gradient, summed over tokens and
    sources, may cancel from; see tests/triton/triton_testing.py)."""
    tol = tol or (4e-5 if dtype == torch.float32 else 1e-10)
    got, want = results(backend, ins, dtype, **kw), results(None, ins, dtype, **kw)
    for name, a, b in zip(names(ins), got, want):
        if a is None or b is None:
            assert a is None and b is None, f"{name} of {backend}: {a} vs {b}"
            continue
        assert a.dtype == b.dtype, f"{name} of {backend}: {a.dtype}, not {b.dtype}"
        scale = b.nan_to_num(0, 0, 0).abs().max().item()
        atol = tol * scale + (floor if name.startswith("d ") and name[2] != "v" else 0.0)
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{name} of {backend}: {m}")
