"""Where the Triton kernels can run, how they are launched, and how big their tiles are.

Kernels are written as plain Python functions and compiled per device at first launch:
CUDA tensors get a compiled `JITFunction`, CPU tensors get triton's interpreter
(`InterpretedFunction`), which is only allowed when TRITON_INTERPRET=1 is set. Choosing at
launch time (instead of decorating with `@triton.jit` at import) means it does not matter
whether something else imported triton before the variable was set. (One limit of triton
itself: once the interpreter has run in a process, triton.language stays patched for it, so
do not mix interpreted CPU launches and compiled CUDA launches in one process.)
"""
from __future__ import annotations

import contextlib
import os

import torch

try:  # triton is an optional dependency (extra `restopo[triton]`)
    import triton
    import triton.language as tl
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    _IMPORT_ERROR = str(exc)

# Triton refuses tensors above this many elements: rows wider than this are left to eager
# (backends/triton/__init__.py, _too_wide).
MAX_BLOCK = 1 << 20


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(can the triton backend run on `device`, why or why not).

    CUDA: needs triton and a visible GPU. CPU: needs TRITON_INTERPRET=1 (triton's interpreter,
    slow, meant for tests). Other devices: no.
    """
    if triton is None:
        return False, (f"triton is not installed ({_IMPORT_ERROR}); install it with "
                       "`pip install 'restopo[triton]'` or use backend='eager'")
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "triton needs a CUDA device and torch sees none; use backend='eager'"
        return True, f"triton {triton.__version__} on {device}"
    if device.type == "cpu":
        if interpret_requested():
            return True, "TRITON_INTERPRET=1: kernels run in triton's interpreter on CPU (slow)"
        return False, ("triton kernels need a CUDA device; on CPU they run only in triton's "
                       "interpreter: set TRITON_INTERPRET=1, or use backend='eager'")
    return False, f"triton kernels do not run on {device.type} tensors; use backend='eager'"


def require(device: torch.device) -> None:
    ok, why = available(device)
    if not ok:
        raise RuntimeError(f"restopo triton backend unavailable: {why}")


_compiled: dict[tuple[object, bool], object] = {}


def kernel(fn, device: torch.device):
    """The launchable form of kernel `fn` for tensors on `device` (cached)."""
    interpreted = device.type != "cuda"
    key = (fn, interpreted)
    if key not in _compiled:
        if interpreted:
            from triton.runtime.interpreter import InterpretedFunction
            _compiled[key] = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction
            _compiled[key] = JITFunction(fn)
    return _compiled[key]


def device_fn(fn):
    """A helper that kernels call. Inside a compiled kernel triton needs a JITFunction; inside
    an interpreted one a JITFunction refuses to be called, so this one runs `fn` through the
    interpreter when it is called from Python (only the interpreter ever does that)."""
    if triton is None:  # pragma: no cover - triton missing: the kernels never run
        return fn
    from triton.runtime.jit import JITFunction

    class DeviceFunction(JITFunction):
        def __call__(self, *args, **kwargs):
            if not hasattr(self, "interpreted"):
                from triton.runtime.interpreter import InterpretedFunction
                self.interpreted = InterpretedFunction(self.fn)
            return self.interpreted(*args, **kwargs)

    return DeviceFunction(fn)


# ---- launching, with autotuning on a GPU ---------------------------------------------------
# Under the interpreter (and when a test forces tiles) a kernel runs with one fixed config; on
# a GPU `triton.autotune` picks one of a few (rows per program, warps, stages) per key.
_tuners: dict[tuple, object] = {}


def launch(fn, device: torch.device, grid, args: tuple, *, fixed: dict, configs: list[dict],
           key: list[str], **constexprs) -> None:
    """Run kernel `fn` on `grid` (a function of the config's meta-parameters).

    fixed: the config used under the interpreter or when `tiles()` forces one; configs: the
    candidates a GPU autotunes over (dicts of meta-parameters plus num_warps, num_stages),
    keyed on the argument names `key` (the dtypes of tensor arguments are part of triton's
    key too). RESTOPO_TRITON_AUTOTUNE=0 takes the first candidate instead (one compile per
    kernel: quicker correctness checks)."""
    forced = bool(_override) or device.type != "cuda"
    untuned = os.environ.get("RESTOPO_TRITON_AUTOTUNE", "1").strip() == "0"
    if forced or untuned or len(configs) < 2:
        cfg = dict(fixed if forced or not configs else configs[0])
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 1)
        kernel(fn, device)[grid(cfg)](*args, **constexprs, **cfg, num_warps=warps,
                                      num_stages=stages)
        return
    tkey = (fn, tuple(tuple(sorted(c.items())) for c in configs), tuple(key))
    if tkey not in _tuners:
        cands = []
        for c in configs:
            c = dict(c)
            warps, stages = c.pop("num_warps"), c.pop("num_stages")
            cands.append(triton.Config(c, num_warps=warps, num_stages=stages))
        _tuners[tkey] = triton.autotune(configs=cands, key=key)(kernel(fn, device))
    _tuners[tkey][grid](*args, **constexprs)


def row_grid(rows: int):
    """The grid of a kernel with one program per BLOCK_R rows."""
    return lambda meta: (triton.cdiv(max(rows, 1), meta["BLOCK_R"]),)


def persistent_programs(tiles: int, device: torch.device) -> int:
    """Programs for a kernel that sums a per-row quantity (a gradient of a [d] parameter):
    each takes every P-th row tile and writes one partial sum, so the partials are [P, d]
    whatever the row count (a few per SM; 3 under the interpreter, so that tests see
    programs with several tiles and programs with none)."""
    if device.type == "cuda":
        cap = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = 3
    return max(1, min(cap, tiles))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for fp32/fp16/bf16 inputs, fp64 for fp64 (lets gradcheck run)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# ---- tile sizes -------------------------------------------------------------------------
# A program owns BLOCK_R token rows. The interpreter runs one numpy op per tile op, so there
# bigger tiles are much faster; on a GPU the budget keeps the fp32 tiles in registers.
_override: dict[str, int] = {}


@contextlib.contextmanager
def tiles(rows: int | None = None, chunk: int | None = None):
    """Force the row tile (and the channel chunk of the chunked kernels); tests use it to get
    several programs and a ragged last tile out of a few rows."""
    saved = dict(_override)
    if rows is not None:
        _override["rows"] = rows
    if chunk is not None:
        _override["chunk"] = chunk
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def row_tile(rows: int, width: int, device: torch.device, budget: int | None = None) -> int:
    """Rows per program for a kernel holding `width` (padded) fp32 channels per row."""
    if "rows" in _override:
        return _override["rows"]
    if budget is None:
        budget = 4096 if device.type == "cuda" else 1 << 15
    return max(1, min(64, next_pow2(rows), budget // max(1, width)))


def chunk_size(width: int, device: torch.device) -> int:
    """Channels per step of the chunked (multi-query) kernels."""
    if "chunk" in _override:
        return _override["chunk"]
    cap = 128 if device.type == "cuda" else 1024
    return min(cap, next_pow2(width))


def num_warps(elements: int) -> int:
    """Warps for a program whose tiles hold `elements` fp32 values (ignored by the
    interpreter): about 8 values per thread and tile. Checked offline with ptxas for sm_90:
    a [2, 2048] tile on 16 warps uses 63-110 registers with no spill; a [1, 8192] tile (d 7168)
    on 16 warps needs 128 registers and spills a little in the backward kernels."""
    return max(4, min(16, elements // 256))


def row_configs(block_d: int, rows=(1, 2, 4), at_16_warps: int = 64) -> list[dict]:
    """GPU candidates for a kernel whose program holds BLOCK_R whole rows of block_d fp32
    channels: per row count, the warps that give about 16 values per thread and tile (4 to
    16 warps, at most 64 values), one with half the values per thread, and a 2-stage
    variant of the first (5 configs at most, so tuning stays a few seconds a kernel).

    At 16 warps a thread has at most 128 registers (the SM's 64k over 512 threads), so a
    kernel that keeps many tiles alive spills there: `at_16_warps` caps the values per
    thread of a 16-warp candidate (phase 2's backward: 16 values needed ~205 registers and
    spilled 248 bytes a thread at d 2048, in an offline sm_90 compile; 8 fit)."""
    out = []
    for r in rows:
        w = min(16, max(4, r * block_d // 512))
        per_thread = r * block_d // (32 * w)
        if per_thread <= 64 and (w < 16 or per_thread <= at_16_warps):
            out.append(dict(BLOCK_R=r, num_warps=w, num_stages=1))
    if out and out[0]["num_warps"] < 16 and block_d >= 256:
        out.insert(1, dict(out[0], num_warps=2 * out[0]["num_warps"]))
    if out:
        out.append(dict(out[0], num_stages=2))
    return out or [dict(BLOCK_R=1, num_warps=16, num_stages=1)]
