"""Phase 1 / phase 2 kernels against the eager reference, and two-phase == single read."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import restopo.backends.triton as T
from restopo.backends.eager import depth as E
from triton_testing import (TOL, assert_grads, assert_rel, grads, leaf, make_sources, ref_leaf,
                            ref_phase1)

BATCH = (2, 5)


def queries(S, d, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(S, d, generator=gen, dtype=torch.float64) * 4 / d ** 0.5
    g = 1 + 0.2 * torch.randn(S, d, generator=gen, dtype=torch.float64)
    return w, g


def cotangents(shapes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def stacked(phase1_result):
    """The fused phase 1's o1 (S separate tensors) stacked like the eager backend's."""
    o1, m1, s1 = phase1_result
    return torch.stack(o1), m1, s1


def check_phase1(n, S, d, dtype, *, batch=BATCH, key_norm=True, tile=None, v64=None):
    # 4-row tiles (3 programs, the last ragged) and channel chunks that do not divide d;
    # fewer chunks at d = 1024 keep the interpreter fast
    tile = tile or (4, 256 if d >= 1024 else 32)
    if v64 is None:
        v64, _, _ = make_sources(n, batch, d, seed=7 * n + d)
    w64, g64 = queries(S, d, seed=S + d)
    refs = [ref_leaf(x, dtype) for x in (v64, w64, g64)]
    ins = [leaf(x, dtype) for x in (v64, w64, g64)]
    with T.tiles(*tile):
        got = stacked(T.phase1(*ins, key_norm=key_norm))
    want = ref_phase1(*refs, key_norm=key_norm, normalised=True)
    tol = TOL[dtype]
    for name, a, b in zip(("o1", "m1", "s1"), got, want):
        assert_rel(a, b, tol, name)
    assert got[0].dtype == dtype
    # upstream gradients on all three outputs (s1 = 1 has none to pass on, as in the ref)
    cots = cotangents([t.shape for t in want])
    with T.tiles(*tile):
        ga = grads(got, ins, [c.to(got[i].dtype) for i, c in enumerate(cots)])
    gb = grads(want, refs, cots)
    assert_grads(ga, gb, tol * (4 if dtype == torch.float32 else 2),
                 ("dcompleted", "dqueries", "dgains"), dtype)


@pytest.mark.parametrize("d", [64, 96, 200, 1024])
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_phase1_fp32_grid(n, d):
    check_phase1(n, 4, d, torch.float32)


@pytest.mark.parametrize("S", [1, 3, 16])
def test_phase1_query_counts(S):
    check_phase1(5, S, 96, torch.float32)


def test_phase1_many_blocks():
    check_phase1(33, 4, 200, torch.float32, batch=(3,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_phase1_half_precision(dtype):
    check_phase1(5, 4, 200, dtype)


def test_phase1_without_key_norm_and_default_tiles():
    check_phase1(5, 3, 96, torch.float32, key_norm=False)
    check_phase1(5, 3, 96, torch.float32, tile=(None, None))


def test_phase1_tied_logits():
    """Identical blocks tie for the max logit (the kernels once split m1's gradient between
    them, as torch.amax; now m1 is the log-sum-exp, whose gradient is alpha)."""
    v, _, _ = make_sources(1, BATCH, 64)
    check_phase1(3, 2, 64, torch.float64, v64=torch.cat([v, v, 0.5 * v]))


def test_phase1_non_contiguous():
    v, _, _ = make_sources(5, (4, 3), 96)
    check_phase1(5, 2, 96, torch.float32, v64=v.transpose(1, 2), batch=(3, 4))


def test_phase1_fp16_blocks_near_the_top_of_its_range():
    """Blocks of about 3e4 in fp16 (whose largest value is 65504): h is their mean and fits,
    but phase 1 kept the un-normalised sum_i e^(z_i - m) v_i, n times that, in fp16, and
    returned inf (the eager and cpu backends normalise). Now every output is finite and
    within fp16's rounding of the float64 answer, gradients included."""
    gen = torch.Generator().manual_seed(5)
    blocks = [3.0e4 + 100 * torch.randn(2, 48, generator=gen, dtype=torch.float64)
              for _ in range(4)]
    w = torch.zeros(2, 48, dtype=torch.float64)  # zero pseudo-queries (the init): the mean
    partial = torch.full((2, 48), 3.0e4, dtype=torch.float64)
    want = [torch.stack(blocks).mean(0), torch.stack([*blocks, partial]).mean(0)]
    ins = [leaf(b, torch.float16) for b in blocks]
    o1, m1, s1 = T.phase1(ins, w.half())
    got = [T.phase2(o1[0], m1[0], s1[0], None, w[0].half()),
           T.phase2(o1[1], m1[1], s1[1], partial.half(), w[1].half())]
    for g, x in zip(got, want):
        assert torch.isfinite(g).all()
        assert_rel(g, x, 2e-3, "h")
    sum(g.float().sum() for g in got).backward()
    for b in ins:  # d h / d v_i at zero queries: 1/4 + 1/5 per channel, the partial's 1/5 off
        assert torch.isfinite(b.grad).all()
        torch.testing.assert_close(b.grad.double(), torch.full_like(blocks[0], 0.45),
                                   rtol=2e-3, atol=0)


def test_rows_wider_than_a_tile_are_left_to_eager(monkeypatch):
    """The docs said rows past triton's largest tile (runtime.MAX_BLOCK, 2^20 channels) go
    to the eager code; nothing did, and the kernels raised triton's 'numel exceeds' error.
    The bound lowered to 32 here, a width of 40 takes that path: eager's results, exactly."""
    import restopo.backends.triton.runtime as rt
    monkeypatch.setattr(rt, "MAX_BLOCK", 32)
    v, w, g = make_sources(3, (2,), 40, seed=2)
    p = make_sources(1, (2,), 40, seed=3)[0][0]
    launched = []
    monkeypatch.setattr(rt, "launch", lambda *a, **k: launched.append(a[0]))
    got = T.depth_attention(list(v), w, g)
    torch.testing.assert_close(got, E.depth_attention(list(v), w, g), rtol=0, atol=0)
    o1, m1, s1 = E.phase1(v, w[None], g[None])
    for fn, eager in ((T.phase2, E.phase2), (T.phase2_norm, E.phase2_norm)):
        torch.testing.assert_close(fn(o1[0], m1[0], s1[0], p, w, g),
                                   eager(o1[0], m1[0], s1[0], p, w, g), rtol=0, atol=0)
    assert not launched


def check_phase2(d, dtype, *, with_partial=True, with_norm=False, key_norm=True,
                 norm_gain=True, tile=4, prep=None):
    """`prep`: applied to each input of the fused call (e.g. a non-contiguous view)."""
    batch = BATCH
    v, w, g = make_sources(3, batch, d, seed=d)
    o1, m1, s1 = (x[0].detach() for x in ref_phase1(v, w[None], g[None]))
    p = make_sources(1, batch, d, seed=d + 1)[0][0] * 1.5
    nw = 1 + 0.3 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    base = [o1, m1, s1, p, w, g, nw]
    stat = torch.float64 if dtype == torch.float64 else torch.float32  # phase 1's m1, s1
    dtypes = [dtype, stat, stat, dtype, dtype, dtype, dtype]
    refs = [ref_leaf(x, t) for x, t in zip(base, dtypes)]
    ins = [leaf(x, t) for x, t in zip(base, dtypes)]

    def run(a, fn_norm, fused):
        part = a[3] if with_partial else None
        gain = a[6] if norm_gain else None
        if fused:
            if with_norm:
                return fn_norm(a[0], a[1], a[2], part, a[4], a[5], key_norm=key_norm,
                               norm_weight=gain)
            return T.phase2(a[0], a[1], a[2], part, a[4], a[5], key_norm=key_norm)
        h = E.phase2(a[0], a[1], a[2], part, a[4], a[5], key_norm=key_norm)
        return (h, F.rms_norm(h, (d,), gain, 1e-6)) if with_norm else h

    with T.tiles(rows=tile):
        got = run([prep(x) for x in ins] if prep else ins, T.phase2_norm, True)
    want = run(refs, None, False)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    tol = TOL[dtype]
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert_rel(a, b, tol, "h / y")
    cots = cotangents([t.shape for t in want])
    with T.tiles(rows=tile):
        ga = grads(got, ins, [c.to(dtype) for c in cots])
    gb = grads(want, refs, cots)
    for name, a, b in zip(("o1", "m1", "s1", "partial", "query", "gain", "norm_weight"), ga, gb):
        if b is not None and a is not None and not b.abs().max() > 0:
            continue
        assert_rel(a, b, tol * (4 if dtype == torch.float32 else 2), f"d{name}")


@pytest.mark.parametrize("d", [64, 96, 200, 1024])
@pytest.mark.parametrize("with_norm", [False, True])
def test_phase2_fp32(d, with_norm):
    check_phase2(d, torch.float32, with_norm=with_norm)


@pytest.mark.parametrize("with_norm", [False, True])
def test_phase2_first_sublayer_of_block(with_norm):
    """No partial yet: h = o1 / s1."""
    check_phase2(96, torch.float32, with_partial=False, with_norm=with_norm)


def test_phase2_options():
    check_phase2(200, torch.float32, key_norm=False)
    check_phase2(200, torch.float32, with_norm=True, norm_gain=False)
    check_phase2(96, torch.float64, with_norm=True)


def test_phase2_strided_inputs():
    """Every input a view with a channel stride of 2 (the norm gain's was read as if 1)."""
    check_phase2(24, torch.float64, with_norm=True,
                 prep=lambda x: torch.stack([x, x], -1)[..., 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_phase2_half_precision(dtype):
    check_phase2(200, dtype, with_norm=True)


def test_phase2_tie_between_block_and_partial():
    """m1 == z2 exactly: torch.maximum sends half the max's gradient each way."""
    d = 64
    p = make_sources(1, (6,), d, seed=5)[0][0]
    w, g = queries(1, d, seed=2)
    z2 = E.logits(p[None], w[0], g[0], 1e-6)[0]
    o1, m1, s1 = make_sources(1, (6,), d, seed=6)[0][0] * 2.0, z2.clone(), torch.full_like(z2, 2.0)
    refs, ins = [[leaf(x) for x in (o1, m1, s1, p, w[0], g[0])] for _ in range(2)]
    with T.tiles(rows=4):
        h = T.phase2(*ins)
    ref = E.phase2(*refs)
    assert_rel(h, ref, 1e-12, "h")
    cot = torch.randn(ref.shape, dtype=torch.float64)
    for a, b in zip(grads(h, ins, cot), grads(ref, refs, cot)):
        assert_rel(a, b, 1e-10, "tie gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_phase_equals_single_read(dtype):
    """For every sublayer j of a block: phase2(phase1(completed)[j], partial_j) equals
    depth_attention over [completed..., partial_j] with the same query and gain, values and
    gradients."""
    n, S, d = 4, 4, 96
    completed = make_sources(n, (3, 5), d, seed=11)[0]
    outputs = make_sources(S, (3, 5), d, seed=12)[0]   # the block's sublayer outputs
    w, g = queries(S, d, seed=13)
    c1, w1, g1 = leaf(completed, dtype), leaf(w, dtype), leaf(g, dtype)
    c2, w2, g2 = leaf(completed, dtype), leaf(w, dtype), leaf(g, dtype)
    outs2 = leaf(outputs, dtype)
    outs1 = leaf(outputs, dtype)
    with T.tiles(rows=4, chunk=32):
        o1, m1, s1 = T.phase1(c1, w1, g1)
        two, one = [], []
        for j in range(S):
            partial1 = outs1[:j].sum(0) if j else None
            partial2 = outs2[:j].sum(0)
            two.append(T.phase2(o1[j], m1[j], s1[j], partial1, w1[j], g1[j]))
            src = torch.cat([c2, partial2[None]]) if j else c2
            one.append(T.depth_attention(src, w2[j], g2[j]))
        tol = 3 * TOL[dtype]
        for j in range(S):
            assert_rel(two[j], one[j], tol, f"sublayer {j}")
        cot = [torch.randn(t.shape, dtype=torch.float64) for t in one]
        ga = grads(two, (c1, w1, g1, outs1), cot)
        gb = grads(one, (c2, w2, g2, outs2), cot)
    for name, a, b in zip(("completed", "queries", "gains", "outputs"), ga, gb):
        assert_rel(a, b, 4 * tol, f"d{name}")


@pytest.mark.parametrize("rows", [2, 16])
def test_gradcheck_float64(rows):
    """2-row tiles sum phase 1's du with tl.sum; 16-row ones with tl.dot (36 rows: the
    second tile is ragged)."""
    v, _, _ = make_sources(3, (5 if rows == 2 else 36,), 24)
    w, g = queries(3, 24, seed=1)
    with T.tiles(rows=rows, chunk=16):
        assert torch.autograd.gradcheck(
            lambda a, b, c: stacked(T.phase1(a, b, c)), (leaf(v), leaf(w), leaf(g)),
            fast_mode=True)
        o1, m1, s1 = (leaf(x[0]) for x in ref_phase1(v, w, g))
        p, nw = leaf(v[1] * 0.7), leaf(g[2])
        assert torch.autograd.gradcheck(
            lambda *a: T.phase2_norm(*a[:6], norm_weight=a[6]),
            (o1, m1, s1, p, leaf(w[0]), leaf(g[0]), nw), fast_mode=True)


def test_heads_fall_back_to_eager():
    v, _, _ = make_sources(3, (4,), 64)
    w, g = queries(2, 64, seed=0)
    got = T.phase1(v, w, g, heads=4)
    want = E.phase1(v, w, g, heads=4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    h = T.phase2(got[0][0], got[1][0], got[2][0], v[0], w[0], g[0])
    torch.testing.assert_close(h, E.phase2(want[0][0], want[1][0], want[2][0], v[0], w[0], g[0]))


@pytest.mark.parametrize("shape", [(8,), (0, 8)])
def test_phase1_queries_that_are_not_s_by_d_are_refused(shape):
    """No query (S = 0) got past the shape check and failed on an empty o1."""
    v = make_sources(2, (3,), 8)[0]
    want = re.escape(f"queries must be [S >= 1, d], got shape {shape}")
    with pytest.raises(ValueError, match=want):
        T.phase1(v, torch.zeros(shape), None)


def test_phase2_shape_errors():
    o1 = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="m1 and s1"):
        T.phase2(o1, torch.zeros(3), torch.zeros(3), None, torch.zeros(8))
    with pytest.raises(ValueError, match="partial has shape"):
        T.phase2(o1, torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(2, 8), torch.zeros(8))


@pytest.mark.parametrize("op,name", [
    ("depth_attention", "query"), ("depth_attention", "key_norm_weight"),
    ("phase1", "queries"), ("phase1", "key_norm_weights"), ("phase2", "m1"), ("phase2", "s1"),
    ("phase2", "partial"), ("phase2", "query"), ("phase2", "key_norm_weight"),
    ("phase2_norm", "norm_weight")])
def test_an_input_on_another_device_is_refused_by_name(op, name):
    """The kernels read every input by its address: one on another device than the sources
    (meta here, as a CPU query would be beside CUDA sources) is refused, named."""
    v, w, g = make_sources(2, (3,), 8)
    two = dict(o1=v[0], m1=torch.zeros(3, 1), s1=torch.ones(3, 1), partial=v[1], query=w,
               key_norm_weight=g)
    kw = {"depth_attention": dict(sources=v, query=w, key_norm_weight=g),
          "phase1": dict(completed=v, queries=torch.stack([w, w]),
                         key_norm_weights=torch.stack([g, g])),
          "phase2": two, "phase2_norm": dict(two, norm_weight=g)}[op]
    kw[name] = kw[name].to("meta")
    with pytest.raises(ValueError, match=f"^{name} is on meta, the other inputs on cpu"):
        getattr(T, op)(**kw)


def test_phase1_backward_reads_output_gradients_at_aligned_addresses(monkeypatch):
    """The phase-1 backward kernels take each output gradient's address as 16-byte aligned
    (tl.multiple_of: vector loads on a GPU, where a misaligned one faults); a gradient that
    is a view at an odd offset (here of a torch.cat) reaches them as an aligned copy, with
    eager's values."""
    import restopo.backends.triton.runtime as rt
    v, w, _ = make_sources(2, (3,), 8)
    ins = [leaf(x) for x in (*v, torch.stack([w, w]))]
    seen = []
    real = rt.launch

    def launch(fn, device, grid, args, **kw):
        if fn.__name__ == "_phase1_dlogits":
            seen.extend(args[1].tolist())  # DO1S: the output gradients' addresses
        return real(fn, device, grid, args, **kw)

    monkeypatch.setattr(rt, "launch", launch)
    o1, _, _ = T.phase1(ins[:2], ins[2], None)
    got = grads(torch.cat([o1[0].new_ones(1), *(o.flatten() for o in o1)]), ins,
                torch.ones(1 + 2 * 24, dtype=torch.float64))
    assert len(seen) == 2 and all(a % 16 == 0 for a in seen), seen
    refs = [leaf(x) for x in ins]
    want = grads(E.phase1(refs[:2], refs[2], None)[0], refs, torch.ones(2, 3, 8))
    for a, b in zip(got, want):
        assert_rel(a, b, 1e-12, "gradient")


def test_phase1_backward_kernels_with_different_tiles(monkeypatch):
    """On a GPU each phase-1 kernel is tuned on its own (the backward ones share their
    scratch by row): the gradients must not depend on their tiles."""
    from restopo.backends.triton import runtime
    real = runtime.launch
    tiles = {"_phase1_fwd": (4, 32), "_phase1_dlogits": (2, 64), "_phase1_dsources": (16, 16)}

    def launch(fn, device, grid, args, *, fixed, **kw):
        if fn.__name__ in tiles:
            fixed = dict(fixed, BLOCK_R=tiles[fn.__name__][0], BLOCK_C=tiles[fn.__name__][1])
        return real(fn, device, grid, args, fixed=fixed, **kw)

    monkeypatch.setattr(runtime, "launch", launch)
    check_phase1(5, 3, 96, torch.float32, tile=(None, None))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 6), S=st.integers(1, 5), rows=st.integers(1, 7), d=st.integers(1, 50),
       tile=st.sampled_from([(1, 16), (2, 8), (4, 32)]), seed=st.integers(0, 99))
def test_phase1_any_shape_float64(n, S, rows, d, tile, seed):
    """Random shapes, odd widths and chunk sizes, in float64."""
    v, _, _ = make_sources(n, (rows,), d, seed=seed)
    check_phase1(n, S, d, torch.float64, batch=(rows,), tile=tile, v64=v)
