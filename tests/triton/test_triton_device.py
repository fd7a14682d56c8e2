"""The fused kernels on a real GPU, at model sizes: d 2048 and 7168, fp32 and bf16, up to 512k
rows (past 2^31 / d, so the 64-bit offsets are exercised), each op through the in-model call
path (separate source tensors, the fused PreNorm as the lowering calls it), values and every
gradient against the eager backend in fp32.

Run by bench/gpu_check.sh (TRITON_INTERPRET=0 on a CUDA machine); skipped elsewhere. With
RESTOPO_GPU_CHECK_DRY=1 the same checks run on tiny shapes on the CPU under triton's
interpreter (the dry run of the GPU check, which tests/triton/test_gpu_check_dry_run.py runs).

Rows are independent in every op, so the eager reference is computed in chunks of rows
(fp32, on the bf16-rounded inputs), the source gradients chunk by chunk and the parameter
gradients summed over the chunks: a reference at 512k x 7168 would not fit otherwise.
"""
import os

import pytest
import torch

import extreme_sources
from restopo import ops
from restopo.nn.norm import NORM_EPS

DRY = os.environ.get("RESTOPO_GPU_CHECK_DRY") == "1"
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = torch.device("cpu" if DRY else "cuda")
pytestmark = pytest.mark.skipif(not (DRY or ON_GPU),
                                reason="a GPU check: needs CUDA with TRITON_INTERPRET unset "
                                       "(or RESTOPO_GPU_CHECK_DRY=1 for its dry run)")

PAST_2_31 = 2 ** 31 // 7168 + 1000        # rows x 7168 past 2^31
if DRY:
    SHAPES = [(64, 37)]
    BIGGEST = {"single": (96, 300), "block": (96, 300)}
else:
    SHAPES = [(2048, 4096), (2048, 65536), (7168, 4096), (7168, 65536)]
    # bf16 only, few sources: 7.3 GB per [512k, 7168] bf16 tensor; the block's check holds
    # about 12 such tensors, so it stops just past 2^31 / d to fit an 80 GB H100
    BIGGEST = {"single": (7168, 524288), "block": (7168, PAST_2_31)}
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
BIG = 1 << 17    # rows above this: bf16 and few sources only (memory)
CHUNK = 16384 if not DRY else 64


def _cases(kind):
    for d, rows in SHAPES + [BIGGEST[kind]]:
        for dtype in DTYPES:
            if rows > BIG and dtype != torch.bfloat16:
                continue
            yield pytest.param(d, rows, dtype, id=f"d{d}-rows{rows}-{str(dtype)[6:]}")


def _sources(n, rows, d, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(rows, d, device=DEVICE, generator=gen, dtype=torch.float32)
        out.append(x.mul_(0.5 + 0.3 * i).to(dtype).requires_grad_())
    return out


def _params(shape, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    d = shape[-1]
    w = (torch.randn(*shape, device=DEVICE, generator=gen) * 4 / d ** 0.5).requires_grad_()
    g = (1 + 0.2 * torch.randn(*shape, device=DEVICE, generator=gen)).requires_grad_()
    return w, g


def _close(got, want, tol, what):
    got, want = got.float(), want.float()
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs().max() / scale).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def _chunked_reference(fn, sources, params, cots, rows):
    """fn(chunk_sources, params) -> outputs, run in fp32 on row chunks: (outputs per chunk,
    source gradients per chunk, parameter gradients summed)."""
    pgrads = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for start in range(0, rows, CHUNK):
        sl = slice(start, min(rows, start + CHUNK))
        src = [s.detach()[sl].float().requires_grad_() for s in sources]
        prm = [p.detach().float().requires_grad_() for p in params]
        outs = fn(src, prm)
        total = sum((o.float() * c[sl].float()).sum() for o, c in zip(outs, cots))
        grads = torch.autograd.grad(total, src + prm)
        for acc, g in zip(pgrads, grads[len(src):]):
            acc += g
        yield sl, [o.detach() for o in outs], grads[:len(src)]
    yield None, None, pgrads


def _check(fused_fn, eager_fn, sources, params, rows, dtype, what):
    outs = fused_fn(sources, params)
    gen = torch.Generator(device=DEVICE).manual_seed(99)
    cots = [torch.randn(o.shape, device=DEVICE, generator=gen).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, sources + params, cots)
    tol = TOL[dtype]
    for sl, ref_outs, ref_src_grads in _chunked_reference(eager_fn, sources, params, cots, rows):
        if sl is None:      # the last item: parameter gradients summed over all rows
            for k, (g, r) in enumerate(zip(grads[len(sources):], ref_src_grads)):
                _close(g, r, 4 * tol, f"{what}: parameter gradient {k}")
            continue
        for k, (o, r) in enumerate(zip(outs, ref_outs)):
            _close(o[sl], r, tol, f"{what}: output {k}, rows {sl.start}..")
        for k, (g, r) in enumerate(zip(grads, ref_src_grads)):
            _close(g[sl], r, 4 * tol, f"{what}: source gradient {k}, rows {sl.start}..")


@pytest.mark.parametrize("d,rows,dtype", list(_cases("single")))
def test_single_read(d, rows, dtype):
    n = 2 if rows > BIG else 5
    sources = _sources(n, rows, d, dtype, seed=1)
    params = list(_params((d,), seed=2))
    _check(lambda s, p: [ops.depth_attention(s, p[0], p[1], NORM_EPS, backend="triton")],
           lambda s, p: [ops.depth_attention(s, p[0], p[1], NORM_EPS, backend="eager")],
           sources, params, rows, dtype, "single read")


@pytest.mark.parametrize("d,rows,dtype", list(_cases("block")))
def test_block_phase1_and_phase2_norm(d, rows, dtype):
    """A block as the model runs it: phase 1 over the completed blocks for S queries, then
    per sublayer phase 2 with the partial and the sublayer's PreNorm fused (only y)."""
    n, S = (1, 2) if rows > BIG else (3, 4)
    sources = _sources(n + 1, rows, d, dtype, seed=3)  # the completed blocks, then a partial
    wq, gq = _params((S, d), seed=4)
    nw = (1 + 0.1 * torch.randn(d, device=DEVICE)).requires_grad_()

    def block(backend):
        def run(s, p):
            o1, m1, s1 = ops.phase1(s[:n], p[0], p[1], NORM_EPS, backend=backend)
            return [ops.phase2_norm(o1[j], m1[j], s1[j], s[n] if j else None, p[0][j],
                                    p[1][j], NORM_EPS, norm_weight=p[2], norm_eps=NORM_EPS,
                                    keep_h=False, backend=backend)[1] for j in range(S)]
        return run
    _check(block("triton"), block("eager"), sources, [wq, gq, nw], rows, dtype, "block")


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(extreme_sources.CASES))
def test_extreme_sources_give_the_reference_results(case, dtype):
    """Huge (a mean square past the dtype's range), subnormal, zero, +-inf and NaN sources:
    the kernels' results are those of the reference in autograd's ops, as on the CPU
    (tests/test_extreme_sources.py), here with the GPU's own sqrt, division and exp."""
    extreme_sources.assert_as_reference("triton", extreme_sources.inputs(case, dtype, d=64),
                                        dtype, device=DEVICE.type)
