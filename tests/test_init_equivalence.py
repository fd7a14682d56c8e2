"""At step 0, every topology that weighs every earlier output alike computes exactly the
standard residual: zero pseudo-queries take the mean of the sources, the next RMSNorm
removes the scale, and restopo's norm epsilon (restopo.nn.norm) is negligible against any
mean square the aggregation can produce, whatever the embedding scale and depth."""
import pytest
import torch
import torch.nn.functional as F

from restopo import topology as T
from restopo.ir import build_ir
from restopo.nn.norm import NORM_EPS
from restopo.spec.objects import ModelSpec
from restopo.train.init_check import (STANDARD_AT_INIT_TOLERANCE, starts_as_standard,
                                      step0_difference, step0_models)

DEPTHS = (1, 2, 16)          # 2, 4 and 32 sublayers (the paper's ablation depth)
SCALES = (0.02, 1e-3, 1.0)   # embedding std: the init, a smaller one, a unit one


def model_spec(depth):
    return ModelSpec(vocab=64, width=32, depth=depth, heads=2, context=8)


def standard_like(kinds):
    """Every topology whose step-0 function is the standard residual."""
    out = {f"block{n}": T.block_attnres(kinds, blocks=n) for n in T.allowed_block_counts(kinds)}
    out.update({
        "full": T.full_attnres(kinds),
        "full_input_dependent": T.full_attnres(kinds, query="input_dependent"),
        "full_sigmoid": T.full_attnres(kinds, gate="sigmoid"),
        "full_no_key_norm": T.full_attnres(kinds, key_norm="none"),
        "full_heads2": T.full_attnres(kinds, heads=2),
        "block_size2": T.block_attnres(kinds, block_size=2),
        "denseformer": T.denseformer(kinds),
        "full_scalars_softmax": T.denseformer(kinds, gate="softmax"),
        "full_scalars_sigmoid": T.denseformer(kinds, gate="sigmoid"),
    })
    return out


def not_standard(kinds):
    return {"window1": T.full_attnres(kinds, window=1), "rezero": T.rezero(kinds),
            "layerscale": T.layerscale(kinds), "highway": T.highway(kinds)}


def _scaled(models, scale):
    for m in models:
        with torch.no_grad():
            m.embed.weight.mul_(scale / 0.02)


def _idx(seed=1):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("depth", DEPTHS)
def test_standard_like_topologies_equal_standard_in_float64(depth):
    spec = model_spec(depth)
    worst = {}
    for name, top in standard_like(spec.kinds).items():
        assert starts_as_standard(build_ir(spec.kinds, top)), name
        for scale in SCALES:
            other, standard = step0_models(spec, top, torch.float64)
            _scaled((other, standard), scale)
            worst[name, scale] = step0_difference(other, standard, _idx())
    assert max(worst.values()) <= STANDARD_AT_INIT_TOLERANCE[torch.float64], \
        max(worst.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("depth", (2, 16))
def test_standard_like_topologies_equal_standard_in_float32(depth):
    spec = model_spec(depth)
    for name, top in standard_like(spec.kinds).items():
        for scale in SCALES:
            other, standard = step0_models(spec, top, torch.float32)
            _scaled((other, standard), scale)
            diff = step0_difference(other, standard, _idx())
            assert diff <= STANDARD_AT_INIT_TOLERANCE[torch.float32], (name, scale, diff)


@pytest.mark.parametrize("depth", (2, 16))
def test_the_others_do_not_and_the_prediction_agrees(depth):
    """ReZero, LayerScale, Highway and a sliding window start elsewhere: the IR criterion
    says so, and so does the measurement."""
    spec = model_spec(depth)
    for name, top in not_standard(spec.kinds).items():
        assert not starts_as_standard(build_ir(spec.kinds, top)), name
        other, standard = step0_models(spec, top, torch.float64)
        assert step0_difference(other, standard, _idx()) > 1e-3, name


def test_the_old_epsilon_breaks_it(monkeypatch):
    """The trap this guards against: with every norm's epsilon at 1e-6 (the usual default),
    Full AttnRes at 32 sublayers starts far from the standard model (the mean of 33 sources
    of an embedding at std 0.02 has a mean square below 1e-6)."""
    import restopo.nn.aggregate as aggregate
    import restopo.nn.sublayers as sublayers

    spec = model_spec(16)
    monkeypatch.setattr(sublayers, "NORM_EPS", 1e-6)  # read when the norms are built
    monkeypatch.setattr(aggregate, "EPS", 1e-6)
    other, standard = step0_models(spec, T.full_attnres(spec.kinds), torch.float64)
    assert step0_difference(other, standard, _idx()) > 0.1


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_epsilon_in_half_precision(dtype, grad):
    """An all-zero row normalises to zeros (no 0/0, no inf) and a tiny row to unit RMS, in
    every norm path: F.rms_norm (sublayers, head) and depth attention's key norm, in both
    eager forms (the stacked one without autograd, the unstacked one that training runs),
    single and two-phase. In bf16 the backward is finite too; in pure fp16 it is not at an
    exactly zero row (the gradient there is 1/sqrt(eps): restopo.nn.norm says so)."""
    from restopo.ops import depth_attention, phase1, phase2

    x = torch.zeros(3, 16, dtype=dtype)
    x[1] = 1e-3
    x[2] = torch.linspace(-2, 2, 16, dtype=dtype)
    y = F.rms_norm(x, (16,), None, NORM_EPS)
    assert torch.isfinite(y).all() and (y[0] == 0).all()
    assert y[1].float().pow(2).mean().item() == pytest.approx(1.0, rel=1e-2)
    sources = [s.clone().requires_grad_(grad) for s in (x, x.flip(0), torch.ones_like(x))]
    q = torch.randn(16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    queries = torch.stack([q, -q]).requires_grad_(grad)
    partial = torch.zeros(3, 16, dtype=dtype, requires_grad=grad)
    gain = torch.ones(16, dtype=dtype)
    h = depth_attention(sources, queries[0], gain, NORM_EPS, backend="eager")
    o1, m1, s1 = phase1(sources, queries, None, NORM_EPS, backend="eager")
    h2 = phase2(o1[1], m1[1], s1[1], partial, queries[1], None, NORM_EPS, backend="eager")
    assert torch.isfinite(h).all() and torch.isfinite(h2).all()
    assert h.requires_grad == grad  # the form training runs was the one tested
    if grad and dtype == torch.bfloat16:
        (h.float().sum() + h2.float().sum()).backward()
        for t in (*sources, queries, partial):
            assert torch.isfinite(t.grad).all()


SPEC = """model m {{ vocab: 64; width: 32; depth: 2; heads: 2; context: 8 }}
residual {residual}
train {{ data: builtin:stdlib; seed: 3 }}
"""


@pytest.mark.parametrize("residual", ["block_attnres(blocks: 2)", "mhc(streams: 2)",
                                      "full_attnres(query: input_dependent)"])
def test_diagnose_measures_the_runs_own_step0(residual):
    """restopo diagnose's step-0 line (init_check.step0_report) builds the topology's model
    exactly as `restopo train` with the run's seed does (restopo.nn.init.Init), so it
    measures the run's own step 0 and sees a change to the training initialisation."""
    from restopo.spec import as_spec
    from restopo.train.runspec import build_model

    spec = as_spec(SPEC.format(residual=residual))
    want = build_model(spec, backend="eager").state_dict()
    other, _ = step0_models(spec.model, spec.topology, torch.float32, seed=spec.train.seed)
    got = other.state_dict()
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_row_has_a_finite_gradient_through_every_norm(dtype):
    """torch's RMSNorm backward forms rstd^3; at an all-zero row that is eps^-1.5, which
    overflowed float32 with the earlier epsilon 1e-30 (NaN gradients). With NORM_EPS it is
    finite, through F.rms_norm and nn.RMSNorm and through a whole model whose embedding has
    an all-zero row (every topology's first sublayer then normalises zeros)."""
    x = torch.zeros(2, 64, dtype=dtype)
    x[1].normal_()
    x.requires_grad_(True)
    norm = torch.nn.RMSNorm(64, eps=NORM_EPS, dtype=dtype)
    (F.rms_norm(x, (64,), None, NORM_EPS).sum() + norm(x).square().sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(norm.weight.grad).all()

    import restopo
    for residual in ("standard", "full_attnres", "block_attnres(blocks: 2)"):
        spec = (f"model m {{ vocab: 16; width: 32; depth: 2; heads: 2; context: 8 }}\n"
                f"residual {residual}\n")
        torch.manual_seed(0)
        model = restopo.compile(spec, backend="eager").to(dtype)
        with torch.no_grad():
            model.embed.weight[0].zero_()
        idx = torch.tensor([[0, 3, 0, 5, 0, 0, 7, 0]])
        model(idx).float().logsumexp(-1).mean().backward()
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), (residual, name)
