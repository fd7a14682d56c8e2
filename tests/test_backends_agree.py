"""Random custom wirings lower to the same function on every CPU backend: the lowering for
a fused backend (two-phase groups, fused PreNorms, shared logits, bound kernels) against
the eager one, in float64 with every aggregation parameter moved off its start. A finding
of this kind (a stream update at the head reading a fused, normalised h) was one wiring
the examples did not have; this draws many."""
import random

import pytest
import torch

import restopo
from restopo.spec import SpecError

MODEL = "model m { vocab: 29; width: 16; depth: 3; heads: 2; context: 12; mlp: swiglu(2x) }\n"
SOURCES = ("embedding", "sublayers", "blocks", "partial", "window(1)", "window(2)")
OPTIONS = ("", "; gate: sigmoid", "; key_norm: none", "; heads: 2", "; input_dependent")


def _rule(rng: random.Random, head: bool) -> str:
    method = rng.choice(("attend", "attend", "scalars", "sum")
                        + (("rezero", "layerscale", "highway") if head else ()))
    if method in ("rezero", "layerscale", "highway"):
        return method
    sources = [s for s in SOURCES if rng.random() < 0.5] or ["embedding", "sublayers"]
    if head:
        sources = [s for s in sources if s != "partial"] or ["embedding", "blocks"]
    options = rng.choice(OPTIONS) if method == "attend" else ""
    return f"{method}({', '.join(sources)}{options})"


def _wirings(n: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        blocks = rng.choice(("", " block_size: 2\n", " blocks: 2\n"))
        text = (MODEL + "residual custom {\n" + blocks + f" before sublayer: {_rule(rng, False)}\n"
                + (f" before head: {_rule(rng, True)}\n" if rng.random() < 0.7 else "") + "}\n")
        try:
            restopo.spec.parse_spec(text)
        except SpecError:
            continue
        out.append(text)
    return out


WIRINGS = _wirings(24)


@pytest.mark.parametrize("text", WIRINGS, ids=[f"wiring{i}" for i in range(len(WIRINGS))])
def test_fused_backend_lowering_computes_what_eager_does(text):
    idx = torch.randint(0, 29, (2, 10), generator=torch.Generator().manual_seed(1))
    out = {}
    for backend in ("eager", "auto"):
        torch.manual_seed(0)
        m = restopo.compile(text, backend=backend).double()
        with torch.no_grad():
            g = torch.Generator().manual_seed(2)
            for name, p in m.named_parameters():
                if name.startswith("aggregations.") or name.endswith("norm.weight"):
                    p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        out[backend] = m(idx)
        out[backend].sum().backward()
        out[backend + "_grads"] = {n: p.grad for n, p in m.named_parameters()}
    torch.testing.assert_close(out["auto"], out["eager"], rtol=0, atol=1e-10)
    for name, grad in out["eager_grads"].items():
        torch.testing.assert_close(out["auto_grads"][name], grad, rtol=1e-8, atol=1e-10,
                                   msg=name)
