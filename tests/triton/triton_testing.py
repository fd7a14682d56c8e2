"""Helpers shared by the triton kernel tests (independent references and tolerances)."""
import torch

# max |got - ref| / max |ref| allowed, per input dtype; refs are computed in float64
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_rel(got, ref, tol, what="", floor=0.0):
    """max |got - ref| <= tol * max |ref| + floor (floor: see `assert_grads`)."""
    if got is None and ref is None:  # an input that plays no part (e.g. the gain, key_norm off)
        return
    assert got is not None and ref is not None, f"{what}: {got} vs {ref}"
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = rel_err(got, ref)
    if floor:
        diff = (got.double() - ref.double()).abs().max().item()
        allowed = tol * ref.double().abs().max().item() + floor
        assert diff <= allowed, (f"{what}: max error {diff:.3g} > {allowed:.3g} "
                                 f"(relative {err:.3g}, tol {tol:.3g}, roundoff floor {floor:.3g})")
        return
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


# a kernel that sums in another order than the reference may differ by this many ulps of the
# largest term its gradient sums; see `assert_grads`
ROUNDOFF_ULPS = 64


def assert_grads(got, want, tol, names, dtype, terms=0.0):
    """Each gradient within tol of its own largest entry, or within roundoff of the largest
    term the gradients are summed from (`terms`, at least the largest gradient), whichever
    is larger. A gradient that cancels to nearly zero keeps only the digits the cancellation
    leaves, in the float64 reference as in the kernel: with a saturated softmax the query's
    gradient is sum_i alpha_i (s_i - s_bar) k_i with s_bar ~= s_1 (seen: 5.4120e-11 against
    5.4091e-11, from terms ~40), so relative to itself it cannot be checked to 1e-10. A wrong
    gradient of that size (zero, say) is still far above the floor."""
    scale = max([terms] + [b.double().abs().max().item() for b in want if b is not None])
    floor = ROUNDOFF_ULPS * torch.finfo(dtype).eps * scale
    for name, a, b in zip(names, got, want):
        assert_rel(a, b, tol, name, floor=floor)


def attention_terms(v, cot, key_norm, eps=1e-6):
    """The largest term of depth attention's query gradient, |cot . v_i| * |k_i|: the scale
    its roundoff is measured against (`assert_grads`)."""
    from restopo.backends.eager.depth import keys
    v, cot = v.double(), cot.double()
    s = (cot.unsqueeze(0) * v).sum(-1).abs().max()
    return (s * keys(v, eps, key_norm).abs().max()).item()


def leaf(x, dtype=None):
    """A fresh leaf (optionally cast), requiring grad."""
    x = x.detach().clone()
    if dtype is not None:
        x = x.to(dtype)
    return x.requires_grad_()


def ref_leaf(x, dtype):
    """The float64 reference input for a kernel input of `dtype`: the same rounded values,
    so the comparison measures the kernel, not the rounding of its inputs (phase 1's max
    makes its standalone gradient jump when rounding changes which logit is largest)."""
    return x.detach().to(dtype).to(torch.float64).requires_grad_()


def grads(out, inputs, cotangent):
    """d(sum(out * cotangent))/d(inputs) with None where an input is unused."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    cots = cotangent if isinstance(cotangent, (tuple, list)) else (cotangent,)
    total = sum((o.double() * c.double()).sum() for o, c in zip(outs, cots))
    return torch.autograd.grad(total, inputs, allow_unused=True)


def make_sources(n, batch, d, dtype=torch.float64, seed=0, spread=1.0):
    """Sources with unequal scales (so the softmax is not flat) and a random query and gain."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand((n,) + (1,) * (len(batch) + 1), generator=gen, dtype=torch.float64) * 2 + 0.5
    v = torch.randn((n, *batch, d), generator=gen, dtype=torch.float64) * scale
    w = torch.randn(d, generator=gen, dtype=torch.float64) * spread / d ** 0.5 * 4
    g = 1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64)
    return v.to(dtype), w.to(dtype), g.to(dtype)


def ref_phase1(completed, queries, gains=None, eps=1e-6, key_norm=True, normalised=False):
    """Phase 1's online-softmax state (o1 [S, *b, d], m1 [S, *b, 1], s1 [S, *b, 1]) in
    autograd's ops over the stacked blocks, written out by hand. `normalised`: the form
    the fused kernels return, (h1, lse, 1) with 1 as sum_i alpha_i (so its gradient, zero,
    comes from autograd too); otherwise the un-normalised (sum_i e^(z_i - m) v_i, max z,
    sum_i e^(z_i - m)), a state phase 2 must take as well."""
    from restopo.backends.eager.depth import logits
    c = completed if isinstance(completed, torch.Tensor) else torch.stack(tuple(completed))
    gains = [None] * len(queries) if gains is None else gains
    z = torch.stack([logits(c, q, g, eps, key_norm) for q, g in zip(queries, gains)], 1)
    m1 = torch.logsumexp(z, 0) if normalised else z.amax(0)  # [S, *b, 1]; amax: ties split
    e = torch.exp(z - m1)                            # [n, S, *b, 1]
    return (e * c.unsqueeze(1)).sum(0), m1, e.sum(0)
