"""The lowering fuses a two-phase member's merge with its sublayer's PreNorm when the backend
may be a fused one ("auto", "triton", "cpu"), and keeps the sublayer's own norm on "eager";
either way the model computes the same thing, with the same parameters in the same order.
(The fused kernels against eager: tests/triton/test_triton_model.py, tests/test_cpu_backend.py.)"""
import torch

import restopo
from restopo.nn.norm import NORM_EPS

SPEC = """
model m {{
  vocab: 61; width: 32; depth: 3; heads: 2; context: 16
  mlp: swiglu(2x)
}}
residual {residual}
"""


def _build(residual, backend):
    torch.manual_seed(0)
    return restopo.compile(SPEC.format(residual=residual), backend=backend)


def _normed_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and n.target.startswith("sublayers") and n.kwargs.get("normed")]


def test_fused_where_the_backend_may_fuse():
    eager = _build("block_attnres(blocks: 2)", "eager")
    auto = _build("block_attnres(blocks: 2)", "auto")
    assert not _normed_calls(eager) and "norm_eps" not in eager.code
    # every sublayer is a two-phase member here (the head's aggregation reads directly)
    assert len(_normed_calls(auto)) == 6
    assert f"norm_weight = sublayers_0_norm_weight, norm_eps = {NORM_EPS!r}" in auto.code
    # a topology without two-phase groups lowers the same on every backend
    assert _build("full_attnres", "auto").code == _build("full_attnres", "eager").code


def test_same_parameters_same_order_same_results():
    """The get_attr of a norm gain must not reorder the submodules: the optimizer state of a
    checkpoint is matched to parameters by order."""
    eager = _build("block_attnres(blocks: 2)", "eager")
    auto = _build("block_attnres(blocks: 2)", "auto")
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in auto.named_parameters()]
    auto.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 61, (2, 9))
    out_e, out_a = eager(idx), auto(idx)
    # on the CPU "auto" runs the cpu backend's fused phase 2 + norm (or, without its kernels,
    # the eager ops: phase 2, then the very norm the sublayer would run): float32 rounding
    assert torch.allclose(out_e, out_a, rtol=1e-5, atol=1e-6)
    out_e.square().mean().backward()
    out_a.square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), auto.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


def test_switching_backend_keeps_results():
    """restopo.set_backend on a fused lowering: the eager ops run phase2_norm unfused, the
    same function (on the CPU "auto" ran the cpu backend's kernels: float32 rounding)."""
    auto = _build("block_attnres(blocks: 2)", "auto")
    idx = torch.randint(0, 61, (1, 5))
    before = auto(idx)
    restopo.api.set_backend(auto, "eager")
    assert torch.allclose(auto(idx), before, rtol=1e-5, atol=1e-6)


def test_a_point_that_reads_h_itself_keeps_it_unfused():
    """A stream update at the head (rezero, layerscale, highway) after two-phase sublayers
    reads h_L itself: the fused merge handed it RMSNorm(h_L) instead, so the default
    backend computed other logits than eager (0.27 to 1.0 off in float64). The last
    member then keeps its sublayer's own norm, and both backends agree."""
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    for head in ("rezero", "layerscale", "highway"):
        residual = ("custom {\n block_size: 2\n before sublayer: attend(embedding, blocks, "
                    f"partial)\n before head: {head}\n}}")
        out = {}
        for backend in ("eager", "auto"):
            m = _build(residual, backend).double()
            with torch.no_grad():  # a head gate that is not 0, queries and gains not trivial
                for name, p in m.named_parameters():
                    if name.startswith("aggregations."):
                        p.add_(0.5)
                    if name.endswith("norm.weight"):
                        p.mul_(3.0)
            out[backend] = m(idx)
            if backend == "auto":
                assert 6 not in [int(n.target.split(".")[1]) + 1 for n in _normed_calls(m)]
                assert len(_normed_calls(m)) == 5  # the other members still fuse
        torch.testing.assert_close(out["auto"], out["eager"], rtol=0, atol=1e-12, msg=head)
