"""Multi-stream residuals (Hyper-Connections, mHC, mHC-lite) against the naive loop of
tests/multistream_reference.py, written from ../shared/hyper.md section 8, in float64; and
their step-0 behaviour against the standard PreNorm residual."""
from __future__ import annotations

import pytest
import torch

from restopo import topology as T
from restopo.api import build_model
from restopo.spec.objects import ModelSpec

import multistream_reference as ref
from multistream_reference import forward

M = ModelSpec(vocab=64, width=16, depth=2, heads=2, context=8)
VARIANTS = {  # reference name -> topology constructor
    "shc": lambda kinds, n: T.hyper_connections(kinds, n),
    "dhc": lambda kinds, n: T.hyper_connections(kinds, n, dynamic=True),
    "mhc": lambda kinds, n: T.mhc(kinds, n),
    "mhc_lite": lambda kinds, n: T.mhc_lite(kinds, n),
}


def _model(variant: str, n: int, depth: int = 2, seed: int = 0):
    spec = ModelSpec(vocab=M.vocab, width=M.width, depth=depth, heads=M.heads,
                     context=M.context)
    torch.manual_seed(seed)
    model = build_model(spec, VARIANTS[variant](spec.kinds, n), backend="eager").double()
    return model, spec


def _randomise(model, scale: float = 0.5):
    """Non-trivial coefficients: every multi-stream parameter moved well away from its init
    (mHC's alpha up to O(1), so the logits, not the bias, decide the coefficients)."""
    with torch.no_grad():
        for name, p in model.aggregations.named_parameters():
            p.add_(torch.randn_like(p) * scale)
            if name.endswith("alpha") and p.numel() == 3:
                p.copy_(torch.rand_like(p) + 0.5)


def _idx(spec, seed=1):
    return torch.randint(0, spec.vocab, (2, spec.context),
                         generator=torch.Generator().manual_seed(seed))


def _standard(spec, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(spec, T.standard(spec.kinds), backend="eager").double()


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = [(v, n, depth) for v in VARIANTS for n in (1, 2, 4) for depth in (1, 3)
         if not (v == "mhc_lite" and n == 4 and depth == 3)]  # 24 permutations: one depth


@pytest.mark.parametrize("variant,n,depth", CASES)
def test_random_coefficients_match_the_naive_loop(variant, n, depth):
    model, spec = _model(variant, n, depth)
    _randomise(model)
    idx = _idx(spec)
    want = forward(model, idx, variant, n)
    got = model(idx)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # and the coefficients are non-trivial: the streams are not all alike
    assert _rel(got, _standard(spec)(idx)) > 1e-2


def test_the_reference_catches_a_transposed_mixing_matrix():
    """The loop above holds the transpose of R: applying R^T instead changes the output."""
    model, spec = _model("mhc", 4)
    _randomise(model)
    idx = _idx(spec)
    right = forward(model, idx, "mhc", 4)

    def transposed(P, X):
        pre, post, R = ref.mhc(P, X, 20)
        return pre, post, R.transpose(1, 2)

    wrong = forward(model, idx, "mhc", 4, coeffs=transposed)
    torch.testing.assert_close(model(idx), right, rtol=1e-10, atol=1e-10)
    assert _rel(wrong, right) > 1e-3


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("n", (1, 2, 4))
def test_phi_zero_init_is_the_standard_residual(variant, n):
    """At the documented init with phi = 0 (SHC and DHC have no phi: their default init)
    every variant is standard PreNorm: identical streams stay identical and the read's scale
    goes into the sublayer's own RMSNorm. mHC is exact once its Sinkhorn epsilon is 0 (with
    the default 1e-6 the rows of R sum to 1 - O(1e-6), so the state shrinks by that much per
    sublayer); n = 1 is the plain residual for every variant."""
    model, spec = _model(variant, n, depth=3)
    with torch.no_grad():
        for name, p in model.aggregations.named_parameters():
            if name.endswith("phi"):
                p.zero_()
    idx = _idx(spec)
    want = _standard(spec)(idx)
    if variant == "mhc":
        assert _rel(model(idx), want) < 1e-5
        for m in model.aggregations[:-1]:
            m.sinkhorn_eps = 0.0
    assert _rel(model(idx), want) < 1e-12


def _mhc_at(alpha: float, seed: int = 0):
    model, spec = _model("mhc", 4, depth=3, seed=seed)
    with torch.no_grad():
        for name, p in model.aggregations.named_parameters():
            if name.endswith("alpha"):
                p.fill_(alpha)
    return model, spec


def test_default_mhc_is_within_order_alpha_of_standard():
    """With the default init (phi xavier-uniform, alpha = 0.01) mHC is PreNorm up to O(alpha):
    the distance shrinks in proportion to alpha."""
    d = {}
    for alpha in (0.01, 0.001):
        model, spec = _mhc_at(alpha)
        idx = _idx(spec)
        d[alpha] = _rel(model(idx), _standard(spec)(idx))
    assert 0 < d[0.01] < 0.01
    assert 5 < d[0.01] / d[0.001] < 20


def test_default_mhc_lite_is_within_order_alpha_of_standard():
    model, spec = _model("mhc_lite", 4, depth=3)
    idx = _idx(spec)
    assert 0 < _rel(model(idx), _standard(spec)(idx)) < 0.05


def test_step0_prediction_for_streams():
    """restopo.train.init_check predicts from the IR which topologies start as PreNorm: HC
    (exactly, measured 0 in float32) but not mHC or mHC-lite (O(alpha), measured)."""
    from restopo.ir import build_ir
    from restopo.train.init_check import starts_as_standard, step0_report
    spec = ModelSpec(vocab=64, width=16, depth=3, heads=2, context=8)
    idx = _idx(spec)
    for variant in VARIANTS:
        top = VARIANTS[variant](spec.kinds, 4)
        report = step0_report(spec, top, build_ir(spec.kinds, top), idx)
        assert report["expected_equal"] == starts_as_standard(build_ir(spec.kinds, top)) \
            == (variant in ("shc", "dhc"))
        if variant in ("shc", "dhc"):
            assert report["difference"] == 0.0
        else:
            assert 0 < report["difference"] < 1e-2
