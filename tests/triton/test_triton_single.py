"""The single-read depth-attention kernel against the eager reference (run in float64)."""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import restopo.backends.triton as T
from restopo.backends.eager import depth as E
from triton_testing import TOL, assert_grads, assert_rel, attention_terms, grads, leaf, make_sources, ref_leaf

BATCH = (2, 5)  # 10 rows; with a 4-row tile: 3 programs, the last one ragged


def check(n, d, dtype, *, batch=BATCH, key_norm=True, with_gain=True, rows_tile=4, prep=None):
    v64, w64, g64 = make_sources(n, batch, d, seed=n * 1000 + d)
    if not with_gain:
        g64 = None
    refs = [ref_leaf(x, dtype) for x in (v64, w64, g64) if x is not None]
    ins = [leaf(x, dtype) for x in (v64, w64, g64) if x is not None]
    args = [prep(x) if prep else x for x in ins]  # e.g. a non-contiguous view of the leaf
    with T.tiles(rows=rows_tile):
        out = T.depth_attention(args[0], args[1], args[2] if with_gain else None,
                                key_norm=key_norm)
    ref = E.depth_attention(refs[0], refs[1], refs[2] if with_gain else None, key_norm=key_norm)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL[dtype]
    assert_rel(out, ref, tol, "output")
    cot = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with T.tiles(rows=rows_tile):
        got = grads(out, ins, cot.to(dtype))
    want = grads(ref, refs, cot)
    # a gradient's error is relative to the largest gradient of its kind; fp32 sums of
    # up to 33 products of d channels lose a few more bits than the output
    assert_grads(got, want, tol * (4 if dtype == torch.float32 else 2),
                 ("dsources", "dquery", "dgain"), dtype)


@pytest.mark.parametrize("d", [64, 96, 200, 1024])
@pytest.mark.parametrize("n", [1, 2, 5, 9, 33])
def test_fp32_grid(n, d):
    check(n, d, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,d", [(1, 64), (5, 96), (9, 200), (33, 1024)])
def test_half_precision(n, d, dtype):
    check(n, d, dtype)


@pytest.mark.parametrize("n,d", [(1, 64), (5, 200)])
def test_without_key_norm_or_gain(n, d):
    check(n, d, torch.float32, key_norm=False)
    check(n, d, torch.float32, with_gain=False)


def test_single_program_tile():
    """Default tiles (one program covers every row) give the same numbers."""
    check(5, 96, torch.float32, rows_tile=None, batch=(3, 7))


@pytest.mark.parametrize("layout", ["channel_stride", "batch_major", "transposed_batch"])
def test_non_contiguous(layout):
    def prep(x):
        if layout == "channel_stride":  # every other channel of a wider buffer: strided view
            return torch.stack([x, x], -1).flatten(-2)[..., ::2]
        if layout == "batch_major" and x.dim() > 1:  # [batch, n, d] storage as [n, batch, d]
            return x.transpose(0, 1).contiguous().transpose(0, 1)
        if layout == "transposed_batch" and x.dim() > 2:  # batch dims that need a copy
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        return x

    # one batch dim for the batch-major case, so it reaches the kernel as a strided view
    check(5, 96, torch.float32, prep=prep, batch=(12,) if layout == "batch_major" else (3, 4))
    if layout == "channel_stride":
        check(5, 96, torch.float32, prep=prep)


def test_gradcheck_float64():
    v, w, g = make_sources(4, (5,), 40)
    with T.tiles(rows=2):
        assert torch.autograd.gradcheck(
            lambda a, b, c: T.depth_attention(a, b, c), (leaf(v), leaf(w), leaf(g)),
            fast_mode=True)  # one random projection of the Jacobian: few kernel launches


def test_backward_is_deterministic():
    v, w, g = make_sources(9, (4, 9), 200, dtype=torch.float32)
    runs = []
    for _ in range(2):
        ins = [leaf(x) for x in (v, w, g)]
        with T.tiles(rows=4):
            out = T.depth_attention(*ins)
            runs.append(torch.autograd.grad(out.square().sum(), ins))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [dict(gate="sigmoid"), dict(heads=4)])
def test_unfused_options_fall_back_to_eager(kw):
    v, w, g = make_sources(5, (3,), 64)
    torch.testing.assert_close(T.depth_attention(v, w, g, **kw), E.depth_attention(v, w, g, **kw))


def test_bad_shapes_say_what_is_wrong():
    v, w, g = make_sources(3, (2,), 64)
    with pytest.raises(ValueError, match="query has shape"):
        T.depth_attention(v, w[:10], g)
    with pytest.raises(ValueError, match="n >= 1"):
        T.depth_attention(v[:0], w, g)


def test_cpu_without_interpreter_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = T.available("cpu")
    assert not ok and "TRITON_INTERPRET=1" in why
    v, w, g = make_sources(3, (2,), 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        T.depth_attention(v, w, g)
    assert T.available("meta")[0] is False


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 12), rows=st.integers(1, 9), d=st.integers(1, 70),
       tile=st.sampled_from([1, 2, 4, 8]), key_norm=st.booleans(), seed=st.integers(0, 99))
# a saturated softmax (weights 1 and 1e-11): the query's gradient cancels to 5e-11
@example(n=2, rows=1, d=1, tile=1, key_norm=False, seed=0)
def test_any_shape_float64(n, rows, d, tile, key_norm, seed):
    """Random shapes, odd widths included, in float64: values and gradients to 1e-12."""
    v, w, g = make_sources(n, (rows,), d, seed=seed)
    refs, ins = [ref_leaf(x, torch.float64) for x in (v, w, g)], [leaf(x) for x in (v, w, g)]
    with T.tiles(rows=tile):
        out = T.depth_attention(*ins, key_norm=key_norm)
        ref = E.depth_attention(*refs, key_norm=key_norm)
        assert_rel(out, ref, 1e-12, "output")
        gen = torch.Generator().manual_seed(seed)
        cot = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
        assert_grads(grads(out, ins, cot), grads(ref, refs, cot), 1e-10,
                     ("dsources", "dquery", "dgain"), torch.float64,
                     terms=attention_terms(v, cot, key_norm))
