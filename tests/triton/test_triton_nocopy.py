"""The in-model call path: sources handed over as a list of separate tensors, which the fused
kernels read through a table of addresses (no stacked copy), against the eager backend's list
path, values and every gradient at 1e-5 (fp32); what autograd keeps for backward (no more
than the eager list path, per op and per model); which kernels get scratch for which
gradient; and the autotune wiring (checked without a GPU)."""
import pytest
import torch
import torch.nn.functional as F

import restopo.backends.triton as T
from restopo import ops
from restopo.backends.triton import runtime
from restopo.nn.norm import NORM_EPS
import infinite_logits
from triton_testing import assert_rel, grads, leaf, ref_phase1

TOL = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def separate(n, batch, d, seed=0, dtypes=None):
    """n separately allocated leaf sources with unequal scales (as a model's outputs are)."""
    gen = _gen(seed)
    out = []
    for i in range(n):
        x = torch.randn(*batch, d, generator=gen) * (0.5 + 2 * torch.rand((), generator=gen))
        out.append(leaf(x, dtypes[i] if dtypes else torch.float32))
    return out


def query(d, seed=1, S=None):
    gen = _gen(seed)
    shape = (d,) if S is None else (S, d)
    w = torch.randn(*shape, generator=gen) * 4 / d ** 0.5
    g = 1 + 0.2 * torch.randn(*shape, generator=gen)
    return leaf(w), leaf(g)


def twins(tensors):
    """Fresh leaves with the same values: one set for each backend."""
    return [leaf(t) for t in tensors], [leaf(t) for t in tensors]


def compare(got, want, ins_got, ins_want, what, rows=slice(None)):
    """Values at TOL, gradients at 4 TOL, each relative to its largest entry (or to 1e-2 of
    the largest gradient, for one that is zero in exact arithmetic: the s1 of a normalised
    phase 2, whose scale cancels in the norm); `rows` restricts the gradient comparison."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
        assert_rel(a, b, TOL, f"{what} value")
    cots = [torch.randn(w.shape, dtype=torch.float64, generator=_gen(7)) for w in want]
    ga, gb = grads(got, ins_got, cots), grads(want, ins_want, cots)
    top = max(b.abs().max().item() for b in gb if b is not None)
    for k, (a, b) in enumerate(zip(ga, gb)):
        if a is None and b is None:
            continue
        assert torch.isfinite(a).all(), (what, k)
        a, b = a.double()[rows] if a.dim() > 1 else a.double(), \
            b.double()[rows] if b.dim() > 1 else b.double()
        scale = max(b.abs().max().item(), 1e-2 * top)
        err = (a - b).abs().max().item() / scale
        assert err <= 4 * TOL, f"{what} gradient of input {k}: relative error {err:.3g}"


@pytest.mark.parametrize("n", [1, 5, 12])
@pytest.mark.parametrize("key_norm", [True, False])
def test_depth_attention_list_equals_eager(n, key_norm):
    vs = separate(n, (2, 5), 40, seed=n)
    (v1, v2), (q1, q2) = twins(vs), twins(query(40))
    with T.tiles(rows=4):
        got = ops.depth_attention(v1, *q1, key_norm=key_norm, backend="triton")
        want = ops.depth_attention(v2, *q2, key_norm=key_norm, backend="eager")
        compare(got, want, v1 + q1, v2 + q2, "depth_attention")


@pytest.mark.parametrize("n,S", [(1, 3), (4, 4)])
def test_phase1_list_equals_eager(n, S):
    vs = separate(n, (2, 5), 40, seed=n + 10)
    (v1, v2), (q1, q2) = twins(vs), twins(query(40, S=S))
    with T.tiles(rows=4, chunk=16):
        o1, m1, s1 = ops.phase1(v1, *q1, backend="triton")
        want = ref_phase1(v2, *q2, normalised=True)  # the state the kernels return
        assert isinstance(o1, tuple) and len(o1) == S  # one buffer per query: no [S, ...]
        compare([*o1, m1, s1], [*want[0].unbind(0), want[1], want[2]], v1 + q1, v2 + q2,
                "phase1")


@pytest.mark.parametrize("fused_norm", [None, "keep_h", "y_only"])
@pytest.mark.parametrize("with_partial", [True, False])
def test_phase2_list_equals_eager(fused_norm, with_partial):
    d = 40
    blocks = separate(3, (2, 5), d, seed=3)
    wq, gq = query(d, S=2)
    o1, m1, s1 = (x[1].detach() for x in ref_phase1([b.detach() for b in blocks],
                                                     wq.detach(), gq.detach()))
    partial = separate(1, (2, 5), d, seed=4)[0]
    nw = leaf(1 + 0.3 * torch.randn(d, generator=_gen(5)))
    base = [o1, m1, s1, partial, wq[1].detach(), gq[1].detach(), nw]
    a, b = twins(base)

    def run(x, backend):
        p = x[3] if with_partial else None
        if fused_norm is None:
            return ops.phase2(*x[:3], p, x[4], x[5], NORM_EPS, backend=backend)
        h, y = ops.phase2_norm(*x[:3], p, x[4], x[5], NORM_EPS, norm_weight=x[6],
                               norm_eps=NORM_EPS, keep_h=fused_norm == "keep_h",
                               backend=backend)
        return (h, y) if fused_norm == "keep_h" else y

    with T.tiles(rows=4):
        compare(run(a, "triton"), run(b, "eager"), a, b, f"phase2 {fused_norm}")


def test_mixed_dtypes_as_under_autocast():
    """An fp32 embedding among bf16 outputs: no cast, the promoted output dtype, each source's
    gradient in its own dtype; equal to the eager list path up to bf16 rounding."""
    dtypes = [torch.float32] + [torch.bfloat16] * 4
    vs = separate(5, (3, 4), 64, seed=2, dtypes=dtypes)
    (v1, v2), (q1, q2) = twins(vs), twins(query(64))
    with T.tiles(rows=4, chunk=32):
        got = ops.depth_attention(v1, *q1, backend="triton")
        want = ops.depth_attention(v2, *q2, backend="eager")
        assert got.dtype == want.dtype == torch.float32
        assert_rel(got, want, 3e-2, "mixed value")
        cot = torch.randn(want.shape, generator=_gen(3))
        for k, (a, b) in enumerate(zip(grads(got, v1 + q1, cot), grads(want, v2 + q2, cot))):
            assert a.dtype == b.dtype, k
            assert_rel(a, b, 3e-2, f"mixed gradient {k}")
        o1, m1, s1 = ops.phase1(v1, *twins(query(64, S=2))[0], backend="triton")
        ref = ops.phase1(v2, *twins(query(64, S=2))[1], backend="eager")
        assert o1[0].dtype == ref[0].dtype == torch.float32
        # the eager one, with autograd, is normalised: o1 / s1
        assert_rel(torch.stack(o1) / s1, ref[0], 3e-2, "mixed phase 1")


def test_strided_and_stacked_sources():
    """A source with a row stride other than d, one whose batch dims do not collapse (read
    through a copy), and views of a stacked tensor: all read right."""
    d = 48
    wide = torch.randn(2, 5, 2 * d, generator=_gen(1))
    strided = leaf(wide)[..., :d]                                  # row stride 2d
    transposed = leaf(torch.randn(5, 2, d, generator=_gen(2))).transpose(0, 1)
    stacked = leaf(torch.randn(3, 2, 5, d, generator=_gen(3)))
    w, g = query(d)
    args = [strided, transposed, *stacked.unbind(0)]
    with T.tiles(rows=4):
        got = ops.depth_attention(args, w, g, backend="triton")
        want = ops.depth_attention([a.detach().clone() for a in args], w, g, backend="eager")
        assert_rel(got, want, TOL, "strided")
        cot = torch.randn(want.shape, generator=_gen(4))
        ga = torch.autograd.grad(got, [strided, transposed, stacked], cot)
        ref_in = [leaf(a) for a in args]
        ref = ops.depth_attention(ref_in, w, g, backend="eager")
        gb = torch.autograd.grad(ref, ref_in, cot)
        assert_rel(ga[0], gb[0], 4 * TOL, "strided gradient")
        assert_rel(ga[1], gb[1], 4 * TOL, "transposed gradient")
        assert_rel(ga[2], torch.stack(gb[2:]), 4 * TOL, "stacked gradient")


def test_zero_rows_with_the_norm_epsilon():
    """restopo's norm epsilon (NORM_EPS) with an all-zero row and padded tiles: values and
    gradients finite and equal to eager's, in every op, the fused PreNorm included."""
    d = 32
    vs = separate(4, (7,), d, seed=6)
    with torch.no_grad():
        for v in vs:
            v[2].zero_()                     # one token whose every source is zero
    (v1, v2), (q1, q2) = twins(vs), twins(query(d))
    nw = torch.ones(d)
    with T.tiles(rows=4, chunk=16):         # 7 rows: the second tile is padded
        got = ops.depth_attention(v1, *q1, NORM_EPS, backend="triton")
        want = ops.depth_attention(v2, *q2, NORM_EPS, backend="eager")
        assert torch.isfinite(got).all() and not got[2].any()
        # the eager backward is NaN on the zero row itself (its rsqrt backward meets
        # 1/sqrt(eps)^3 = inf times 0); the fused one is finite there, equal elsewhere
        compare(got, want, v1 + q1, v2 + q2, "zero row, single read", rows=[0, 1, 3, 4, 5, 6])
        (qs1, qs2) = twins(query(d, S=2))
        o1, m1, s1 = ops.phase1(v1[:3], *qs1, NORM_EPS, backend="triton")
        ref = ops.phase1(v2[:3], *qs2, NORM_EPS, backend="eager")
        _, y = ops.phase2_norm(o1[1], m1[1], s1[1], v1[3], qs1[0][1], qs1[1][1], NORM_EPS,
                               norm_weight=nw, norm_eps=NORM_EPS, keep_h=False,
                               backend="triton")
        h_ref = ops.phase2(ref[0][1], ref[1][1], ref[2][1], v2[3], qs2[0][1], qs2[1][1],
                           NORM_EPS, backend="eager")
        y_ref = F.rms_norm(h_ref, (d,), nw, NORM_EPS)
        assert torch.isfinite(y).all() and not y[2].any()
        assert_rel(y, y_ref, TOL, "zero row, phase 2 + norm")
        cot = torch.randn(y.shape, generator=_gen(8))
        for a in torch.autograd.grad(y, v1 + list(qs1), cot):
            assert torch.isfinite(a).all()


def test_no_tokens_give_the_eager_gradients_in_every_op():
    """A batch of zero tokens: every gradient is eager's (zeros, float64), the [d] ones
    (queries, gains, norm gain) too, which phase 2 read from partial sums no kernel wrote
    (in deterministic mode torch.empty fills with NaN, so unwritten memory cannot pass)."""
    d = 24
    vs = separate(3, (0, 2), d, seed=9)
    ins = vs + list(query(d)) + list(query(d, seed=2, S=2)) + [leaf(torch.randn(d))]
    got_ins, want_ins = twins([x.double() for x in ins])
    got, want = [], []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for backend, (*v, q, g, qs, gs, nw), out in (("triton", got_ins, got),
                                                     ("eager", want_ins, want)):
            out.append(ops.depth_attention(v, q, g, backend=backend))
            o1, m1, s1 = ops.phase1(v[:2], qs, gs, backend=backend)
            out.extend(ops.phase2_norm(o1[1], m1[1], s1[1], v[2], qs[1], gs[1],
                                       norm_weight=nw, backend=backend))
        cots = [torch.ones(o.shape, dtype=torch.float64) for o in want]
        pairs = zip(grads(got, got_ins, cots), grads(want, want_ins, cots))
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(o.shape == (0, 2, d) for o in got + want)
    for k, (a, b) in enumerate(pairs):
        assert a is not None and torch.equal(a, b), f"gradient of input {k}: {a} vs {b}"


@pytest.mark.parametrize("sign", [-1, 1])
def test_infinite_logits_give_the_eager_results_in_every_op(sign):
    """Without the key norm, a source whose logit overflows to -inf gets weight 0, as in
    eager, as the first source or a later one and as phase 2's partial (the kernels gave NaN:
    their key-norm scale without the norm was z * 0 + 1, and the online softmax's first step
    e^(-inf - -inf)); one at +inf gives eager's NaN. Values and every gradient."""
    with T.tiles(rows=4, chunk=16):
        infinite_logits.assert_as_eager("triton", sign)


# ---- what autograd keeps for backward ------------------------------------------------------
def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn runs."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saved_bytes_per_op_are_no_more_than_eager():
    """Full AttnRes's single read over 12 sources, a block's phase 1 and phase 2 with the
    fused norm: the fused path keeps the sources (alive anyway) and per-token scalars."""
    d, batch = 128, (4, 32)
    vs = separate(12, batch, d)
    w, g = query(d)
    src_bytes = sum(v.numel() * 4 for v in vs)
    fused = saved_bytes(lambda: ops.depth_attention(vs, w, g, backend="triton"))
    eager = saved_bytes(lambda: ops.depth_attention(vs, w, g, backend="eager"))
    stacked = saved_bytes(lambda: ops.depth_attention(torch.stack(vs), w, g, backend="eager"))
    assert fused <= eager < 1.1 * src_bytes < stacked
    wq, gq = query(d, S=4)
    fused = saved_bytes(lambda: ops.phase1(vs[:5], wq, gq, backend="triton"))
    eager = saved_bytes(lambda: ops.phase1(vs[:5], wq, gq, backend="eager"))
    assert fused <= eager
    o1, m1, s1 = ops.phase1(vs[:5], wq, gq, backend="triton")
    nw = leaf(torch.ones(d))

    def merge_and_norm(backend):
        _, y = ops.phase2_norm(o1[1], m1[1], s1[1], vs[5], wq[1], gq[1], norm_weight=nw,
                               keep_h=False, backend=backend)
        return y
    assert saved_bytes(lambda: merge_and_norm("triton")) <= saved_bytes(
        lambda: merge_and_norm("eager"))


MODEL = """
model m {{
  vocab: 61; width: 32; depth: 6; heads: 2; context: 16
  mlp: swiglu(2x)
}}
residual {residual}
"""


@pytest.mark.parametrize("residual", ["full_attnres", "block_attnres(blocks: 3)"])
def test_saved_bytes_per_model_are_no_more_than_eager(residual):
    """A 12-sublayer model on backend "triton" keeps no more for backward than on "eager"
    (before the table of addresses, Full AttnRes kept a stacked copy per aggregation)."""
    import restopo
    torch.manual_seed(0)
    eager = restopo.compile(MODEL.format(residual=residual), backend="eager")
    fused = restopo.compile(MODEL.format(residual=residual), backend="triton")
    fused.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 61, (2, 16))
    with T.tiles(rows=8, chunk=32):
        assert saved_bytes(lambda: fused(idx)) <= saved_bytes(lambda: eager(idx))


# ---- scratch and autotuning -----------------------------------------------------------------
def _record_launches(monkeypatch):
    seen = []
    real = runtime.launch

    def launch(fn, device, grid, args, **kw):
        seen.append((fn.__name__, kw, grid(kw["fixed"])))
        return real(fn, device, grid, args, **kw)
    monkeypatch.setattr(runtime, "launch", launch)
    return seen


@pytest.mark.parametrize("params_learn", [True, False])
def test_gradient_scratch_only_when_wanted(monkeypatch, params_learn):
    """The per-program partial sums of a parameter's gradient exist only when that gradient
    is wanted, and their count is bounded (persistent programs), not one per row tile."""
    seen = _record_launches(monkeypatch)
    d = 32
    vs = separate(3, (11,), d)
    w, g = query(d)
    wq, gq = query(d, S=2)
    nw = torch.ones(d, requires_grad=params_learn)
    for p in (w, g, wq, gq):
        p.requires_grad_(params_learn)
    with T.tiles(rows=2, chunk=16):                     # 6 row tiles
        h = ops.depth_attention(vs, w, g, backend="triton")
        o1, m1, s1 = ops.phase1(vs, wq, gq, backend="triton")
        _, y = ops.phase2_norm(o1[1], m1[1], s1[1], vs[0], wq[1], gq[1], norm_weight=nw,
                               keep_h=False, backend="triton")
        (h.sum() + y.sum()).backward()
    flags = {name: (kw.get("HAS_DU"), kw.get("HAS_DNW"), grid) for name, kw, grid in seen}
    for name in ("_depth_bwd", "_phase1_dsources", "_phase2_bwd"):
        assert flags[name][0] is params_learn, (name, flags[name])
        assert flags[name][2][0] == 3  # persistent programs (3 under the interpreter)
    assert flags["_phase2_bwd"][1] is params_learn


def test_autotune_wiring_on_cuda(monkeypatch):
    """On a CUDA device the launcher autotunes over the kernel's candidates keyed as asked
    (checked with a stand-in for triton.autotune: no GPU here); a forced tile bypasses it."""
    calls = []

    class Tuner:
        def __init__(self, configs, key):
            self.configs, self.key = configs, key

        def __call__(self, fn):
            self.fn = fn
            return self

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((self, grid, args, kw))

    monkeypatch.setattr(runtime.triton, "autotune", lambda configs, key: Tuner(configs, key))
    monkeypatch.setattr(runtime, "_tuners", {})
    cuda = torch.device("cuda")
    configs = runtime.row_configs(2048)
    grid = runtime.row_grid(100)
    from restopo.backends.triton import single
    runtime.launch(single._depth_fwd, cuda, grid, (1, 2), fixed=dict(BLOCK_R=64, num_warps=4),
                   configs=configs, key=["n", "D"], KEY_NORM=True)
    tuner, g, args, kw = calls[-1]
    assert [c.kwargs["BLOCK_R"] for c in tuner.configs] == [c["BLOCK_R"] for c in configs]
    assert [(c.num_warps, c.num_stages) for c in tuner.configs] == [
        (c["num_warps"], c["num_stages"]) for c in configs]
    assert tuner.key == ["n", "D"] and kw == {"KEY_NORM": True} and args == (1, 2)
    assert 2 <= len(configs) <= 5
    for c in configs:  # registers: at most 64 fp32 values per thread and tile
        assert c["BLOCK_R"] * 2048 // (32 * c["num_warps"]) <= 64
    # the same candidates and key reuse the tuner (its cache of best configs per key)
    runtime.launch(single._depth_fwd, cuda, grid, (1, 2), fixed={}, configs=configs,
                   key=["n", "D"], KEY_NORM=True)
    assert calls[-1][0] is tuner
