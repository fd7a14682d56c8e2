"""The multi-stream modules' numerics: Sinkhorn's row and column sums and its gradients at
init (hyper.md section 7's saturation trap), float32 coefficients whatever the model dtype,
weight decay only on the dynamic parts, and the symmetry trap (section 11): from the default
init the n streams come apart in training; with phi = 0 they never do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from restopo import topology as T
from restopo.api import build_model
from restopo.nn.streams import ManifoldHyperConnection, sinkhorn
from restopo.spec.objects import ModelSpec

M = ModelSpec(vocab=64, width=16, depth=2, heads=2, context=16)
ITERS, EPS = 20, 1e-6


def _rows_cols(logits: torch.Tensor):
    """|row sum - 1| and |column sum - 1| of R = Sinkhorn(logits)^T, the largest of each."""
    R = sinkhorn(logits, ITERS).transpose(-1, -2)
    return (R.sum(-1) - 1).abs().max().item(), (R.sum(-2) - 1).abs().max().item()


@pytest.mark.parametrize("n", (2, 4, 8))
def test_sinkhorn_rows_are_exact_columns_within_tolerance(n):
    """float32, 20 iterations, eps 1e-6 in every denominator (DSV4 order). Rows of R (the
    forward gain) sum to 1 within eps = 1e-6, the last denominator's, plus the float32
    rounding of an n-term sum (n 2^-24). Columns (the backward gain) are approximate: within
    2e-6 for logits at init scale (|z| ~ 0.01), within 1e-2 for unit-variance logits."""
    g = torch.Generator().manual_seed(n)
    row_tol = EPS + n * 2.0 ** -24
    for scale, col_tol in ((0.01, 2e-6), (1.0, 1e-2)):
        rows, cols = _rows_cols(torch.randn(4096, n, n, generator=g) * scale)
        assert rows <= row_tol, (scale, rows)
        assert cols <= col_tol, (scale, cols)
    # peaked logits leave the columns visibly off: the tolerance above is not vacuous
    assert _rows_cols(torch.randn(4096, n, n, generator=g) * 3)[1] > 1e-2


def _res_logit_gradient(module: ManifoldHyperConnection, x: torch.Tensor) -> float:
    """The largest |d(loss)/d(b_res)| for a random linear loss on R."""
    module.zero_grad()
    _, _, R = module.coefficients(x)
    w = torch.randn(R.shape, generator=torch.Generator().manual_seed(0))
    (R * w).sum().backward()
    return module.bias.grad[2 * module.n:].abs().max().item()


def test_sinkhorn_gradients_flow_at_init_and_die_when_saturated():
    """At restopo's init (b_res = 0, alpha = 0.01) the mixing logits' gradients are of order
    one. The same check on a saturated init, [TB]'s +-8 logits at temperature 0.05 (written
    as b_res = +-160: no temperature here), finds exactly zero: exp underflows in float32,
    R is exactly the identity and cannot leave it."""
    torch.manual_seed(0)
    n, d = 4, 16
    m = ManifoldHyperConnection(n, d, ITERS)
    x = torch.randn(2, 8, n, d)
    assert _res_logit_gradient(m, x) > 1e-2
    with torch.no_grad():
        m.bias[2 * n:] = ((torch.eye(n) * 2 - 1) * 8 / 0.05).flatten()
    _, _, R = m.coefficients(x)
    assert torch.equal(R.detach().round(decimals=5), torch.eye(n).expand_as(R))
    assert _res_logit_gradient(m, x) == 0.0


@pytest.mark.parametrize("variant", ("mhc", "mhc_lite", "dhc"))
def test_coefficients_stay_float32_in_a_bf16_model(variant):
    """The model cast to bf16 keeps its coefficient parameters in float32, computes pre,
    post and R in float32, and Sinkhorn's rows still sum to 1 within 1e-6 there."""
    top = {"mhc": T.mhc(M.kinds, 4), "mhc_lite": T.mhc_lite(M.kinds, 4),
           "dhc": T.hyper_connections(M.kinds, 4, dynamic=True)}[variant]
    torch.manual_seed(0)
    model = build_model(M, top, backend="eager").to(torch.bfloat16)
    assert {p.dtype for p in model.aggregations.parameters()} == {torch.float32}
    assert model.embed.weight.dtype == torch.bfloat16
    x = torch.randn(2, 8, 4, M.width).to(torch.bfloat16)
    pre, post, R = model.aggregations[0].coefficients(x)
    assert {pre.dtype, post.dtype, R.dtype} == {torch.float32}
    if variant != "dhc":
        assert (R.sum(-1) - 1).abs().max().item() <= EPS + 4 * 2.0 ** -24
    logits = model(torch.randint(0, M.vocab, (2, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_streams_stay_float32_under_autocast():
    """Under bf16 autocast a float32 state is not rounded by the stream mixing's matmul."""
    torch.manual_seed(0)
    model = build_model(M, T.mhc(M.kinds, 4), backend="eager")
    states = []
    model.write_streams.register_forward_hook(lambda mod, args, out: states.append(out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, M.vocab, (2, 8)))
    assert states and {s.dtype for s in states} == {torch.float32}


def test_weight_decay_reaches_only_the_dynamic_parts():
    """HC trains its static coefficients without weight decay and the dynamic ones with it
    [HC section 4]; the optimizer decays matrices only, so the static ones are vectors."""
    from restopo.train.loop import param_groups
    torch.manual_seed(0)
    model = build_model(M, T.hyper_connections(M.kinds, 4, dynamic=True), backend="eager")
    decay, keep = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)].split(".")[-1] for p in decay["params"]
               if names[id(p)].startswith("aggregations")}
    kept = {names[id(p)].split(".")[-1] for p in keep["params"]
            if names[id(p)].startswith("aggregations")}
    assert decayed == {"dynamic_alpha", "dynamic_beta"}
    assert {"alpha_m", "alpha_r", "beta", "s_alpha", "s_beta"} <= kept


def _spread_after_training(top, steps=10, zero_phi=False, seed=0) -> float:
    """Train `steps` AdamW steps on random tokens from the default init; the largest
    |X_i - X_0| / |X_0| over the streams of the last sublayer's state on a fresh batch."""
    torch.manual_seed(seed)
    model = build_model(M, top, backend="eager")
    if zero_phi:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("phi"):
                    p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, M.vocab, (4, M.context + 1), generator=g)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    states = []
    model.write_streams.register_forward_hook(lambda mod, args, out: states.append(out))
    with torch.no_grad():
        model(torch.randint(0, M.vocab, (2, M.context), generator=g))
    X = states[-1]
    return ((X - X[..., :1, :]).norm(dim=-1) / X[..., :1, :].norm(dim=-1)).max().item()


@pytest.mark.parametrize("name", ("mhc", "mhc_lite", "shc", "dhc"))
def test_streams_differ_after_ten_steps(name):
    top = {"mhc": T.mhc(M.kinds, 4), "mhc_lite": T.mhc_lite(M.kinds, 4),
           "shc": T.hyper_connections(M.kinds, 4),
           "dhc": T.hyper_connections(M.kinds, 4, dynamic=True)}[name]
    before, after = _spread_after_training(top, steps=0), _spread_after_training(top)
    assert after > 5e-3 and after > 4 * before  # SHC and DHC start exactly alike (0)


def test_the_symmetry_trap_with_phi_zero():
    """With phi = 0 and stream-symmetric biases every stream gets the same gradient: after
    the same ten steps the streams are still exactly alike (mHC has silently become PreNorm),
    which is why restopo's default phi is random."""
    assert _spread_after_training(T.mhc(M.kinds, 4), zero_phi=True) == 0.0


def test_recomputed_sinkhorn_backward_is_the_unrolled_gradient():
    """Sinkhorn's backward re-runs the iterations from the saved logits: the same gradient
    as autograd through the unrolled loop (float64, to 1e-12), and gradcheck agrees."""
    from restopo.nn.streams import unrolled_sinkhorn
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=g)
    (mine,) = torch.autograd.grad((sinkhorn(z, ITERS) * w).sum(), z)
    (want,) = torch.autograd.grad((unrolled_sinkhorn(z, ITERS) * w).sum(), z)
    torch.testing.assert_close(mine, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, 5), (z[:1, :2].detach()
                                                               .requires_grad_(),))


def test_sinkhorn_forms_agree_with_a_hand_loop():
    """The iterations run with the n x n matrices in front of the tokens (in place without
    autograd): the same numbers as DeepSeek's order written over the last two axes, in
    float64 to 1e-12, returned contiguous in [..., n, n] (a token-last result made each
    batched matmul of R copy its matrices one token at a time)."""
    from restopo.nn.streams import unrolled_sinkhorn
    z = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    m = torch.softmax(z, dim=-1) + EPS
    m = m / (m.sum(-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        m = m / (m.sum(-1, keepdim=True) + EPS)
        m = m / (m.sum(-2, keepdim=True) + EPS)
    with torch.no_grad():
        in_place = unrolled_sinkhorn(z, ITERS)
    autograd = unrolled_sinkhorn(z.clone().requires_grad_(), ITERS)
    for got in (in_place, autograd, sinkhorn(z.clone().requires_grad_(), ITERS)):
        torch.testing.assert_close(got, m, rtol=1e-12, atol=1e-12)
        assert got.is_contiguous()


def test_read_streams_of_a_half_state_rounds_once():
    """h = sum_i pre_i X_i of a bf16 state is the exact sum rounded to bf16 once (as a
    matmul accumulates), within half a bf16 ulp of the float64 sum."""
    from restopo.nn.streams import read_streams
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, 32, generator=g).bfloat16()
    pre = torch.rand(6, 4, generator=g)
    want = (pre.double().unsqueeze(-1) * x.double()).sum(-2)
    got = read_streams(x, pre)
    assert got.dtype == torch.bfloat16
    ulp = 2.0 ** (torch.frexp(want)[1].double() - 8)  # bf16 keeps 8 significant bits
    assert ((got.double() - want).abs() <= ulp / 2 + 1e-30).all()
