"""The cpu backend's kernels as custom ops under torch.compile (backends/cpu/custom_ops.py).

References: torch.library.opcheck (fake shapes, schema, autograd registration, AOT
dispatch), gradcheck in float64 through the ops, and the eager backend, uncompiled, on
whole models (float64, every gradient). Compiled with aot_eager: the dynamo graphs and
traced autograd graphs of inductor without its C++ builds (inductor calls a custom op
as the graph's own call, the same as aot_eager)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from restopo import ops
from restopo import topology as T
from restopo.api import build_model
from restopo.registry import get_backend

cpu = get_backend("cpu")
needs_kernels = pytest.mark.skipif(not cpu.available()[0],
                                   reason=f"cpu kernels unavailable: {cpu.available()[1]}")
from restopo.backends.cpu import custom_ops  # noqa: E402

D64 = dict(dtype=torch.float64)


def _phase1_args(n, S, heads, key_norm, width=32):
    g = torch.Generator().manual_seed(n * 10 + S)
    src = [torch.randn(2, 3, width, generator=g, **D64, requires_grad=True) for _ in range(n)]
    q = torch.randn(S, width, generator=g, **D64, requires_grad=True)
    return src, q, 1e-6, key_norm, heads


def _phase2_args(heads, key_norm, gain, with_norm, keep_h):
    g = torch.Generator().manual_seed(heads)
    h1, p = (torch.randn(2, 3, 32, generator=g, **D64, requires_grad=True) for _ in range(2))
    lse = torch.randn(2, 3, heads, generator=g, **D64, requires_grad=True)
    q = torch.randn(32, generator=g, **D64, requires_grad=True)
    w = (torch.rand(32, generator=g, **D64) + 0.5).requires_grad_() if gain else None
    return h1, lse, p, q, w, 1e-6, key_norm, 1e-5, with_norm, keep_h


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("n,S", [(1, 1), (3, 2)])
def test_phase1_op_opcheck_and_gradcheck(heads, key_norm, n, S):
    args = _phase1_args(n, S, heads, key_norm)
    torch.library.opcheck(custom_ops.phase1_op, args)
    src, q = args[0], args[1]

    def f(q, *src):  # h1 and lse, the outputs autograd differentiates
        h1, lse, _, _ = custom_ops.phase1_op(list(src), q, 1e-6, key_norm, heads)
        return (*h1, *lse)
    assert torch.autograd.gradcheck(f, (q, *src))


@needs_kernels
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("key_norm", [True, False])
@pytest.mark.parametrize("norm", ["gain", "no gain", "none"])
@pytest.mark.parametrize("keep_h", [True, False])
def test_phase2_op_opcheck_and_gradcheck(heads, key_norm, norm, keep_h):
    if norm == "none" and not keep_h:
        pytest.skip("without the norm, h is the output")
    args = _phase2_args(heads, key_norm, norm == "gain", norm != "none", keep_h)
    torch.library.opcheck(custom_ops.phase2_op, args)
    h1, lse, p, q, w = args[:5]

    def f(h1, lse, p, q, *w):
        h, y = custom_ops.phase2(h1, lse, p, q, w[0] if w else None, 1e-6, key_norm,
                                 None if norm == "none" else 1e-5, keep_h)
        return tuple(t for t in (h, y) if t is not None)
    assert torch.autograd.gradcheck(f, (h1, lse, p, q) + (() if w is None else (w,)))


def _model(topo, backend, width=16, heads=2):
    cfg = SimpleNamespace(vocab=64, width=width, depth=4, heads=heads, mlp="swiglu",
                          mlp_ratio=4, context=16)
    torch.manual_seed(0)
    model = build_model(cfg, topo, backend=backend).to(torch.float64)
    with torch.no_grad():  # non-uniform depth weights
        for a in model.aggregations:
            if hasattr(a, "pseudo_query"):
                a.pseudo_query.normal_(0, 0.5)
    return model


def _counting_aot_eager(seen: list):
    """aot_eager, noting the call targets of each dynamo graph it is handed."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)
    return backend


@needs_kernels
@pytest.mark.parametrize("topo,two_phase", [
    (T.block_attnres(T.sublayer_kinds(4), blocks=2), True),
    (T.block_attnres(T.sublayer_kinds(4), blocks=3, heads=2), True),
    (T.block_attnres(T.sublayer_kinds(4), blocks=2, key_norm="none"), True),
    (T.full_attnres(T.sublayer_kinds(4)), False),
], ids=["block2", "block3-heads2", "block2-no-key-norm", "full"])
def test_compiled_cpu_model_calls_the_ops_and_equals_eager(topo, two_phase):
    """torch.compile of a model on backend cpu runs phase 1 and phase 2 (Full AttnRes: its
    depth attention, phase 1 with one query) as the custom ops, and its logits and every
    gradient equal the eager backend's, uncompiled, in float64."""
    torch._dynamo.reset()
    ref, model = _model(topo, "eager"), _model(topo, "cpu")
    seen: list[str] = []
    compiled = torch.compile(model, backend=_counting_aot_eager(seen), fullgraph=True)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, fn, m in (("eager", ref, ref), ("compiled", compiled, model)):
        logits = fn(idx)
        logits.logsumexp(-1).mean().backward()
        out[name] = (logits, {n: p.grad for n, p in m.named_parameters()})
    assert any("restopo_cpu.phase1" in s for s in seen), seen
    assert any("restopo_cpu.phase2" in s for s in seen) == two_phase, seen
    assert torch.allclose(out["compiled"][0], out["eager"][0], atol=1e-12)
    for n, g in out["eager"][1].items():
        assert torch.allclose(out["compiled"][1][n], g, atol=1e-11), n


@needs_kernels
def test_auto_under_compile_takes_the_kernels_from_their_width_when_training(monkeypatch):
    """`auto` under torch.compile: the kernels at COMPILED_CPU_WIDTH and wider while
    autograd records; the eager forms below it, and without autograd (decoding)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    wide = torch.zeros(2, ops.COMPILED_CPU_WIDTH)
    narrow = torch.zeros(2, ops.COMPILED_CPU_WIDTH // 2)
    assert ops.picked("auto", wide) == "cpu"
    assert ops.picked("auto", narrow) == "eager"
    assert ops.picked("cpu", narrow) == "cpu"  # asked for by name: the kernels
    with torch.no_grad():
        assert ops.picked("auto", wide) == "eager"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert ops.picked("auto", narrow) == "cpu"  # eager: the kernels at every width
