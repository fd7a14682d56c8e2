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

# Triton refuses tensors above this many elements; rows wider than this fall back to eager.
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
