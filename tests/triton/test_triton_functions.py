"""Eager calls run the kernels through autograd.Functions (functions.py), compiled ones
through the custom ops (custom_ops.py): both paths give the same outputs and gradients bit
for bit, whatever gradients are asked for, and each is taken where it should be."""
import itertools

import pytest
import torch

import restopo.backends.triton as T
from restopo.backends.triton import custom_ops, functions

OPS = {"custom op": custom_ops, "Function": functions}


def _leaves(tensors, wanted):
    return [None if t is None else t.detach().clone().requires_grad_(w)
            for t, w in zip(tensors, wanted)]


def _run(ops, name, tensors, wanted, flags, seed):
    """Outputs and the gradients of every input that asked for one, for a random cotangent
    of every floating output (the private ones, lse and z, included)."""
    xs = _leaves(tensors, wanted)
    with T.tiles(rows=2, chunk=16):
        if name == "depth_attention":
            sources, rest = xs[:-2], xs[-2:]
            out = ops.depth_attention_op(sources, *rest, *flags)
        elif name == "phase1":
            sources, rest = xs[:-2], xs[-2:]
            o1, m1, s1, z = ops.phase1_op(sources, *rest, *flags)
            out = (*o1, m1, s1, z)
        else:
            out = ops.phase2_op(*xs, *flags)
        outs = [o for o in out if o.numel() and o.requires_grad]
        gen = torch.Generator().manual_seed(seed)
        cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, cots)
    grads = [None if x is None else x.grad for x in xs]
    return [o.detach() for o in out], grads


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    d = 24
    three = [r(2, 3, d) for _ in range(3)]
    mixed = [three[0], *(t.double() for t in three[1:])]
    for key_norm, gained in itertools.product((True, False), (True, False)):
        gain = r(d) if gained else None
        yield "depth_attention", three + [r(d), gain], (1e-6, key_norm)
        yield "phase1", three + [r(4, d), r(4, d) if gained else None], (1e-6, key_norm)
    yield "depth_attention", mixed + [r(d), r(d)], (1e-6, True)
    yield "phase1", mixed + [r(2, d), None], (1e-6, True)
    o1, m1, s1 = r(2, 3, d), r(2, 3, 1), r(2, 3, 1).abs() + 0.5
    for partial, norm_weight, with_norm, with_h in itertools.product(
            (r(2, 3, d), None), (r(d), None), (True, False), (True, False)):
        if not (with_h or with_norm):
            continue
        yield "phase2", [o1, m1, s1, partial, r(d), r(d), norm_weight], (
            1e-6, 1e-5, True, with_norm, with_h)


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_function_and_custom_op_agree_bit_for_bit(case):
    name, tensors, flags = case
    n = len(tensors)
    # every gradient wanted; then each input alone not wanted (the backward then skips it)
    for wanted in [[True] * n] + [[j != k for j in range(n)] for k in range(n)]:
        got = {label: _run(ops, name, tensors, wanted, flags, seed=1)
               for label, ops in OPS.items()}
        (out_a, grad_a), (out_b, grad_b) = got["custom op"], got["Function"]
        assert len(out_a) == len(out_b)
        for a, b in zip(out_a, out_b):
            assert torch.equal(a, b), name
        for k, (a, b) in enumerate(zip(grad_a, grad_b)):
            assert (a is None) == (b is None), (name, k, wanted)
            if a is not None:
                assert torch.equal(a, b), (name, k, wanted)


def test_eager_calls_take_the_function_and_compiled_ones_the_custom_op():
    v = [torch.randn(2, 8, requires_grad=True) for _ in range(3)]
    w = torch.randn(8, requires_grad=True)
    with T.tiles(rows=2, chunk=16):
        h = T.depth_attention(v, w)
    assert type(h.grad_fn).__name__ == "DepthAttentionBackward"

    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with T.tiles(rows=2, chunk=16):
        got = torch.compile(T.depth_attention, backend=backend, fullgraph=True)(v, w)
    assert torch.ops.restopo.depth_attention.default in targets
    assert torch.equal(got, h)


def test_a_second_order_gradient_is_refused_with_torch_s_message():
    v = [torch.randn(2, 8, requires_grad=True) for _ in range(2)]
    w = torch.randn(8, requires_grad=True)
    with T.tiles(rows=2, chunk=16):
        h = T.depth_attention(v, w)
        (gw,) = torch.autograd.grad(h.square().sum(), w, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gw.sum().backward()


def test_host_bench_prints_both_paths_for_every_op(capsys):
    """bench/triton_host.py (launches stubbed off a GPU): one row per op and direction,
    the custom op's time and the Function's side by side."""
    from file_modules import bench as load_bench
    assert load_bench("triton_host").main(["--rows", "4", "--calls", "2", "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[-1:] and line.split()[-1].replace(".", "").isdigit()]
    assert [" ".join(r[:-3]) for r in rows] == [
        f"{op} {way}" for op in ("phase2+norm", "phase1 (4x4)", "single (8)")
        for way in ("fwd", "fwd+bwd")]
    assert all(float(r[-3]) > 0 and float(r[-2]) > 0 for r in rows)
    from restopo.backends.triton import runtime
    assert runtime.launch.__name__ == "launch"  # the stub is gone: later kernels launch
