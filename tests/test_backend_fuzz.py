"""Random configurations of depth attention, phase 1 and phase 2 with the next PreNorm (heads,
one source or several, widths, batch shapes, queries per block, key norm or not, gains or
not, softmax or sigmoid, restopo's norm epsilon, float32 and float64, sources of scales
from 1e-3 to 1e3 (1e-1 to 10 without the key norm) with zero rows and, rarely, huge ones)
on every backend against the reference in autograd's ops (tests/extreme_sources.py). A
fixed seed: a failure names its case, which reruns alone. 40 cases a backend by default,
360 more under the `long` marker."""
import pytest
import torch

import extreme_sources
from restopo.nn.norm import NORM_EPS

SEED = 20261205


def config(case: int) -> dict:
    """Case `case`'s configuration and inputs, drawn from its own seed."""
    gen = torch.Generator().manual_seed(SEED + case)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=gen))]

    heads, dtype = pick([1, 1, 2, 4]), pick([torch.float32, torch.float64])
    kw = dict(heads=heads, key_norm=pick([True, True, False]), gate=pick(["softmax", "sigmoid"]),
              eps=pick([1e-6, NORM_EPS]))
    d, batch = heads * pick([2, 3, 8]), pick([(1,), (3,), (7,), (2, 3)])
    # without the key norm the logits scale with the sources: at 1e3 a float32 softmax is
    # saturated and its query's gradient a cancelling sum, rounding apart in any two orders
    decades = 3 if kw["key_norm"] else 1
    v = []
    for _ in range(pick([2, 3, 5])):
        x = torch.randn(*batch, d, generator=gen, dtype=torch.float64)
        x *= 10 ** (2 * decades * torch.rand((), generator=gen, dtype=torch.float64) - decades)
        kind = pick(["plain"] * 16 + ["zero row", "huge"])
        if kind == "zero row":
            x.view(-1, d)[0] = 0.0
        elif kind == "huge":
            x *= extreme_sources.CASES["huge"][dtype]
        v.append(x)
    ins = v + extreme_sources.queries(d, batch, pick([1, 2, 3]), gen, gains=pick([True, False]))
    return dict(ins=ins, dtype=dtype, **kw)


def _check(backend, case, monkeypatch):
    extreme_sources.need(backend, monkeypatch)
    cfg = config(case)
    ins, dtype = cfg.pop("ins"), cfg.pop("dtype")
    extreme_sources.assert_as_reference(backend, ins, dtype, floor=floor(ins, dtype, cfg),
                                        **cfg)


def floor(ins, dtype, cfg) -> float:
    """64 ulps of the largest term a query's gradient sums, |cot . v_i| |k_i| (cotangents
    below 5): a saturated softmax's gradient is a difference of such terms, whose rounding
    differs with the order of the sums (seen: 3e-5 of a 1e-8 gradient in float64, from terms
    of 1e3). Sources whose mean square overflows (keys 0) play no part."""
    d = ins[0].shape[-1]
    plain = [v for v in ins[:-6] if v.to(dtype).square().sum(-1).isfinite().all()]
    big = max([v.abs().max().item() for v in plain] + [1.0])
    key = d ** 0.5 if cfg["key_norm"] else big
    return 64 * torch.finfo(dtype).eps * 5 * big * d * key


FILTER = "ignore:(overflow|invalid value) encountered:RuntimeWarning"


@pytest.mark.filterwarnings(FILTER)
@pytest.mark.parametrize("case", range(40))
@pytest.mark.parametrize("backend", ["eager", "cpu", "triton"])
def test_random_cases_give_the_reference_results(backend, case, monkeypatch):
    _check(backend, case, monkeypatch)


@pytest.mark.long
@pytest.mark.filterwarnings(FILTER)
@pytest.mark.parametrize("case", range(40, 400))
@pytest.mark.parametrize("backend", ["eager", "cpu", "triton"])
def test_more_random_cases_give_the_reference_results(backend, case, monkeypatch):
    _check(backend, case, monkeypatch)
