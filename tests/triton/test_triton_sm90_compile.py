"""Every kernel compiles for a real GPU (sm_90, to cubin), and what it compiles to is
checked: 64-bit index arithmetic, vector loads.

The interpreter accepts things the compiler rejects (and the other way round); this runs the
whole triton compiler offline, so a CPU-only machine still checks the GPU path compiles. It
runs in a child process without TRITON_INTERPRET: once the interpreter has run in a process,
triton.language is patched for it and the real compiler cannot run there.

The signature is what the launchers pass at d = 7168 (and 2048) with rows just past
2^31 / 7168 (R still a 32-bit argument): every row offset (row index x width or row stride)
must then be computed in 64 bits, so the TTIR may hold no 32-bit multiplication at all.
"""
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

from restopo.backends.triton import runtime as rt
from restopo.backends.triton import single, twophase

triton = pytest.importorskip("triton")
tl = triton.language

TABLES = {"SRC", "DSRC", "OUTS", "DO1S"}                    # int64 address tables
ACTIVATIONS = {"OUT", "DOUT", "O1", "P", "H", "Y", "DH", "DY", "DO1", "DP", "NW"}
BIG_ROWS = 2 ** 31 // 7168 + 1                               # rows * d overflows int32


def signature(fn, constexprs):
    """Argument types as the launcher passes them for bf16 activations."""
    sig = {}
    for name in inspect.signature(fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("R", "D", "S", "n", "n0") or name.startswith("stride"):
            sig[name] = "i32"
        elif name in ("eps", "norm_eps"):
            sig[name] = "fp32"
        elif name in TABLES:
            sig[name] = "*i64"
        else:
            sig[name] = "*bf16" if name in ACTIVATIONS else "*fp32"
    return sig


def divisible(fn, sig, rows):
    """The arguments triton's launcher marks divisible by 16: every pointer (torch allocations
    are aligned), the width and row strides (d 2048, 7168), R only when it is."""
    names = list(inspect.signature(fn).parameters)
    div = [n for n, t in sig.items() if t.startswith("*") or n == "D" or n.startswith("stride")]
    if rows % 16 == 0:
        div.append("R")
    return {(names.index(n),): [["tt.divisibility", 16]] for n in div}


def _strip(cfg):
    cfg = dict(cfg)
    return cfg, cfg.pop("num_warps"), cfg.pop("num_stages", 1)


def cases():
    """(kernel, constexprs, warps, stages, d, rows): each kernel at the first config the GPU
    autotunes from (the others differ only in rows per program, warps and stages; the
    autotuner skips one that does not compile), for the model's case (key norm, bf16
    sources) at d 2048 and 7168, and at 7168 its other specialisations too (no key norm,
    no partial or norm, no parameter gradient, fp32 + bf16 sources)."""
    S = 4
    for d in (2048, 7168):
        every = d == 7168
        bd = rt.next_pow2(d)
        src = dict(DT0=tl.bfloat16, DT1=tl.bfloat16, NGROUPS=1, ALIGNED=True, ACC=tl.float32)
        mixed = dict(src, DT1=tl.float32, NGROUPS=2)
        meta, warps, stages = _strip(rt.row_configs(bd)[0])
        for v in ([dict(KEY_NORM=True), dict(KEY_NORM=False), dict(KEY_NORM=True, mixed=True)]
                  if every else [dict(KEY_NORM=True)]):
            base = dict(mixed if v.pop("mixed", False) else src, **v, **meta, BLOCK_D=bd)
            yield single._depth_fwd, base, warps, stages, d, BIG_ROWS
            for has_du in ((True, False) if every else (True,)):
                yield single._depth_bwd, dict(base, HAS_DU=has_du), warps, stages, d, BIG_ROWS
        p2 = [dict(HAS_PARTIAL=True, HAS_NORM=True, HAS_NW=True, WRITE_H=False)]
        if every:
            p2 += [dict(HAS_PARTIAL=False, HAS_NORM=False, HAS_NW=False, WRITE_H=True),
                   dict(HAS_PARTIAL=True, HAS_NORM=False, HAS_NW=False, WRITE_H=True)]
        for flags in p2:
            c = dict(flags, KEY_NORM=True, ACC=tl.float32, **meta, BLOCK_D=bd)
            yield twophase._phase2_fwd, c, warps, stages, d, BIG_ROWS
            bwd = dict(c, HAS_DH=flags["WRITE_H"], HAS_DP=flags["HAS_PARTIAL"],
                       HAS_DU=flags["HAS_PARTIAL"], HAS_DNW=flags["HAS_NW"])
            del bwd["WRITE_H"]
            yield twophase._phase2_bwd, bwd, warps, stages, d, BIG_ROWS
        for fn, kind in ((twophase._phase1_fwd, "fwd"), (twophase._phase1_dlogits, "dlogits"),
                         (twophase._phase1_dsources, "dsources")):
            meta, warps, stages = _strip(twophase._phase1_configs(d, S, kind)[0])
            for srcs in ((src, mixed) if every else (src,)):
                c = dict(srcs, KEY_NORM=True, BLOCK_S=rt.next_pow2(S), **meta)
                out = tl.bfloat16 if srcs is src else tl.float32
                c["ODT" if kind == "fwd" else "GDT"] = out
                if kind == "dsources":
                    c.update(HAS_DU=True, DOT_S=max(16, rt.next_pow2(S)))
                yield fn, c, warps, stages, d, BIG_ROWS


def candidates(d=2048):
    """Every candidate the GPU autotunes over, for each kernel at the model's case (key
    norm, bf16 sources, every gradient) at width d."""
    S, bd = 4, rt.next_pow2(d)
    src = dict(DT0=tl.bfloat16, DT1=tl.bfloat16, NGROUPS=1, ALIGNED=True, ACC=tl.float32,
               KEY_NORM=True)
    p2 = dict(HAS_PARTIAL=True, HAS_NORM=True, HAS_NW=True, KEY_NORM=True, ACC=tl.float32,
              BLOCK_D=bd)
    whole = [(single._depth_fwd, dict(src, BLOCK_D=bd), rt.row_configs(bd)),
             (single._depth_bwd, dict(src, BLOCK_D=bd, HAS_DU=True), rt.row_configs(bd)),
             (twophase._phase2_fwd, dict(p2, WRITE_H=False), rt.row_configs(bd)),
             (twophase._phase2_bwd, dict(p2, HAS_DH=False, HAS_DP=True, HAS_DU=True,
                                         HAS_DNW=True), rt.row_configs(bd, at_16_warps=8))]
    for fn, kind, extra in ((twophase._phase1_fwd, "fwd", dict(ODT=tl.bfloat16)),
                            (twophase._phase1_dlogits, "dlogits", dict(GDT=tl.bfloat16)),
                            (twophase._phase1_dsources, "dsources",
                             dict(GDT=tl.bfloat16, HAS_DU=True, DOT_S=16))):
        whole.append((fn, dict(src, BLOCK_S=rt.next_pow2(S), **extra),
                      twophase._phase1_configs(d, S, kind)))
    for fn, constexprs, configs in whole:
        for cfg in configs:
            meta, warps, stages = _strip(cfg)
            yield fn, dict(constexprs, **meta), warps, stages, d, 65536


def _stack_bytes(cubin: bytes) -> int | None:
    """Bytes of stack (spilled registers) a thread of the compiled kernel uses, from
    cuobjdump's resource usage; None where no cuobjdump is at hand."""
    import shutil
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.findall(r"STACK:(\d+)", out)
    return max(map(int, found)) if found else None


def compile_all() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction
    for kind, each in (("first", cases()), ("candidate", candidates())):
        for fn, constexprs, warps, stages, d, rows in each:
            sig = signature(fn, constexprs)
            src = ASTSource(JITFunction(fn), sig, constexprs=constexprs,
                            attrs=divisible(fn, sig, rows))
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
            muls = re.findall(r"arith\.muli [^:]*: (\S+)", compiled.asm["ttir"])
            print(json.dumps(dict(
                kind=kind, kernel=fn.__name__, d=d, warps=warps, stages=stages,
                config=str(sorted((k, str(v)) for k, v in constexprs.items())),
                cubin=bool(compiled.asm.get("cubin")), muls=sorted(set(muls)),
                stack=(_stack_bytes(compiled.asm["cubin"]) if kind == "candidate" else None),
                vector_loads=bool(re.search(r"ld\.global(\.nc)?\.v[24]",
                                            compiled.asm["ptx"])))))
    return 0


@pytest.fixture(scope="module")
def compiled():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton has no NVIDIA backend to compile with: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=900)
    if res.returncode and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("no ptxas for an offline compile")
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def first(compiled):
    return [c for c in compiled if c["kind"] == "first"]


def test_kernels_compile_for_sm90(first):
    assert len(first) == len(list(cases()))
    assert all(c["cubin"] for c in first)
    assert {c["kernel"] for c in first} == {
        "_depth_fwd", "_depth_bwd", "_phase1_fwd", "_phase1_dlogits", "_phase1_dsources",
        "_phase2_fwd", "_phase2_bwd"}


def test_row_offsets_are_64_bit_past_2_31_over_d(first):
    """At d = 7168 and 2^31 / 7168 + 1 rows, every multiplication in every kernel is 64-bit
    (row x width, row x stride, source x query x row of the scratch)."""
    for c in first:
        assert c["muls"], c
        assert all(t == "i64" or t.endswith("xi64>") for t in c["muls"]), c


def test_sources_are_read_with_vector_loads(first):
    """The table's alignment hints reach the compiler: the whole-row kernels load their bf16
    rows 16 bytes at a time."""
    for c in first:
        if c["kernel"] in ("_depth_fwd", "_depth_bwd", "_phase2_fwd", "_phase2_bwd"):
            assert c["vector_loads"], c


def test_no_autotune_candidate_spills_at_d_2048(compiled):
    """Every config the GPU autotunes over, for every kernel at d 2048, fits its registers:
    a candidate that spills (two did: phase 2's backward at 4 rows and 16 warps, 248
    bytes a thread; phase 1's dsources at 8192-value tiles) is slow, and the autotuner only
    picks among the candidates it is given."""
    got = [c for c in compiled if c["kind"] == "candidate"]
    assert {c["kernel"] for c in got} == {
        "_depth_fwd", "_depth_bwd", "_phase1_fwd", "_phase1_dlogits", "_phase1_dsources",
        "_phase2_fwd", "_phase2_bwd"}
    if any(c["stack"] is None for c in got):
        pytest.skip("no cuobjdump to read the compiled kernels' resource usage")
    spilled = [(c["kernel"], c["warps"], c["config"]) for c in got if c["stack"]]
    assert not spilled, spilled


if __name__ == "__main__":
    sys.exit(compile_all())
