"""Every kernel compiles for a real GPU (sm_90, to cubin) with the tiles the launchers pick.

The interpreter accepts things the compiler rejects (and the other way round); this runs the
whole triton compiler offline, so a CPU-only machine still checks the GPU path compiles. It
runs in a child process without TRITON_INTERPRET: once the interpreter has run in a process,
triton.language is patched for it and the real compiler cannot run there.
"""
import inspect
import os
import subprocess
import sys

import pytest
import torch

from restopo.backends.triton import runtime as rt
from restopo.backends.triton import single, twophase

triton = pytest.importorskip("triton")
tl = triton.language

BF16_ARGS = {"V", "OUT", "DOUT", "DV", "O1", "P", "H", "Y", "DH", "DY", "DO1", "DP", "NW"}


def signature(fn, constexprs):
    """Argument types as the launcher passes them for bf16 activations."""
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("R", "D", "S", "n") or name.startswith("stride"):
            sig[name] = "i32"
        elif name in ("eps", "norm_eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "*bf16" if name in BF16_ARGS else "*fp32"
    return sig


def cases(d=2048, rows=16384, S=4):
    cuda = torch.device("cuda")
    bd = rt.next_pow2(d)
    br = rt.row_tile(rows, bd, cuda)
    warps = rt.num_warps(br * bd)
    for key_norm in (True, False):
        for fn in (single._depth_fwd, single._depth_bwd):
            yield fn, dict(KEY_NORM=key_norm, ACC=tl.float32, BLOCK_R=br, BLOCK_D=bd), warps
    for partial, norm in ((True, True), (False, False)):
        for fn in (twophase._phase2_fwd, twophase._phase2_bwd):
            yield fn, dict(HAS_PARTIAL=partial, KEY_NORM=True, HAS_NORM=norm, HAS_NW=norm,
                           ACC=tl.float32, BLOCK_R=br, BLOCK_D=bd), warps
    for fn, kind in ((twophase._phase1_fwd, "fwd"), (twophase._phase1_dlogits, "dlogits"),
                     (twophase._phase1_dsources, "dsources")):
        br, bs, bc = twophase._phase1_tiles(rows, d, S, cuda, kind)
        c = dict(ACC=tl.float32, KEY_NORM=True, BLOCK_R=br, BLOCK_S=bs, BLOCK_C=bc)
        yield fn, c, rt.num_warps(br * bs * bc)


def compile_all() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    for fn, constexprs, warps in cases():
        src = ASTSource(JITFunction(fn), signature(fn, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        assert compiled.asm.get("cubin"), fn.__name__
        print("compiled", fn.__name__, constexprs, "warps", warps)
    return 0


def test_kernels_compile_for_sm90():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton has no NVIDIA backend to compile with: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    if res.returncode and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("no ptxas for an offline compile")
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("compiled") == len(list(cases()))


if __name__ == "__main__":
    sys.exit(compile_all())
