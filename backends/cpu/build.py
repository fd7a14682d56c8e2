"""Build kernels.c on first use, once per machine, and load it with ctypes.

The C file is a template instantiated for float32 and float64 (gradcheck). It needs no
torch headers, so a build takes about a second: `cc -O2 -march=native -fopenmp -shared`.
The library is kept under the restopo cache (RESTOPO_CACHE, else ~/.cache/restopo), in a
folder named by a hash of the source, the compiler's version, the flags and the processor
(-march=native code must not run on another kind of CPU), written whole or not at all
(restopo.io.atomic_folder), so processes that build at once never load half a library.

When no C compiler works, `library()` returns None with the reason in `why()`, and the cpu
backend hands every call to the eager one: same results, unfused.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from restopo.io import atomic_folder, cache_folder, cache_root

SOURCE = Path(__file__).with_name("kernels.c")
HEADER = "#include <math.h>\n#include <stdlib.h>\n#include <string.h>\n" \
         "#ifdef _OPENMP\n#include <omp.h>\n#endif\n"
# (C type, suffix, its exp, log and sqrt); source() also defines FLOAT32 (1 for float),
# for which kernels.c has an exp of its own that vectorises
TYPES = (("float", "f32", "expf", "logf", "sqrtf"), ("double", "f64", "exp", "log", "sqrt"))
# Tried in order: OpenMP threads, then one thread (a compiler without libgomp).
# -fno-math-errno: sqrt and friends inline (restopo reads no errno); results unchanged.
# -O2: -O3's versioned and peeled loops measured no faster for these short rows (c = 64),
# often slower (phase 1 at n = 9, S = 1: 0.56 against 0.72 ms forward).
FLAG_SETS = (["-O2", "-march=native", "-fno-math-errno", "-fopenmp"],
             ["-O2", "-march=native", "-fno-math-errno", "-fopenmp-simd"], ["-O2"])

# A library with a missing symbol would link (shared objects may) and fail at the call.
STRICT = ["-Werror=implicit-function-declaration", "-Wl,--no-undefined"]

_lib: ctypes.CDLL | None = None
_why: str | None = None
_tried = False


def source() -> str:
    body = SOURCE.read_text()
    parts = [HEADER]
    for real, suffix, exp, log, sqrt in TYPES:
        parts.append(f"#define REAL {real}\n#define NAME(x) x##_{suffix}\n#define EXP {exp}\n"
                     f"#define LOG {log}\n#define SQRT {sqrt}\n"
                     f"#define FLOAT32 {int(real == 'float')}\n{body}\n"
                     "#undef REAL\n#undef NAME\n#undef EXP\n#undef LOG\n#undef SQRT\n"
                     "#undef FLOAT32\n#undef EXP_VEC\n")
    return "".join(parts)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# The /proc/cpuinfo lines that say which processor this is: its make, family, model and
# stepping (a VM's model name can be as vague as "AMD EPYC" for several generations; gcc's
# -march=native picks its target by family and model) and its feature flags; x86, then Arm.
CPU_LINES = ("vendor_id", "cpu family", "model", "stepping", "flags",
             "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def _cpu(text: str | None = None) -> str:
    """What -march=native depends on: the processor's make, model and feature flags (from
    `text`, else /proc/cpuinfo), without what changes while it runs (its clock)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or platform.machine()
    keep = [" ".join(ln.split()) for ln in text.splitlines() if ln.startswith(CPU_LINES)]
    return "\n".join(dict.fromkeys(keep)) + platform.machine()


def machine() -> str:
    """The processor and the C compiler the kernels are built for, as text: their float
    results follow both (tests/test_golden.py keys a checkpoint's float data by it)."""
    cc = _compiler()
    return _cpu() + "\n" + (_version(cc) if cc else "no C compiler")


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(cc: str, code: str) -> tuple[Path | None, str]:
    """(the built library, '') or (None, why not)."""
    errors, version, cpu = [], _version(cc), _cpu()  # one compiler run, one cpuinfo read
    for flags in FLAG_SETS:
        key = hashlib.sha256("\0".join([code, version, " ".join(flags), cpu])
                             .encode()).hexdigest()[:16]
        folder = cache_root() / "kernels" / f"cpu-{key}"
        lib = folder / "restopo_cpu.so"
        if lib.exists():
            return lib, ""
        try:
            cache_folder("kernels")
        except OSError as e:  # every set of flags would meet it: say it once
            return None, e.strerror
        try:
            with atomic_folder(folder, keep_existing=True) as tmp:
                (tmp / "kernels.c").write_text(code)
                out = subprocess.run([cc, *flags, *STRICT, "-shared", "-fPIC", "-o",
                                      str(tmp / lib.name), str(tmp / "kernels.c"), "-lm"],
                                     capture_output=True, text=True, timeout=300)
                if out.returncode:
                    raise RuntimeError(out.stderr.strip().splitlines()[-1:] or ["failed"])
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(flags)}: {e}")
            continue
        if lib.exists():
            return lib, ""
    return None, "; ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    P, L, D, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_double, ctypes.c_int
    for _, suffix, *_ in TYPES:
        getattr(lib, f"phase1_fwd_{suffix}").argtypes = [L, P, L, L, L, L, P, D, I, P, P, P,
                                                         P, P, D, P, I]
        getattr(lib, f"phase1_bwd_{suffix}").argtypes = [L, P, L, L, L, L, P, I, P, P, P, P,
                                                         P, P, P, P, I]
        getattr(lib, f"phase2_fwd_{suffix}").argtypes = [L, L, L, P, P, P, P, D, I, P, D, P,
                                                         P, P, P, I]
        getattr(lib, f"phase2_bwd_{suffix}").argtypes = [L, L, L, P, P, P, P, D, I, P, P, P,
                                                         P, P, P, P, P, P, P, I]
        getattr(lib, f"wsum_fwd_{suffix}").argtypes = [L, P, L, P, L, L, L, P, I]
        getattr(lib, f"wsum_bwd_{suffix}").argtypes = [L, P, L, P, L, L, L, P, P, P, P, I]
        getattr(lib, f"given_softmax_{suffix}").argtypes = [L, L, P, L, L, P, P, I]
        getattr(lib, f"given_softmax_bwd_{suffix}").argtypes = [L, L, P, P, P, L, L, P, I]
        for name in ("phase1_fwd", "phase1_bwd", "phase2_fwd", "phase2_bwd", "wsum_fwd",
                     "wsum_bwd", "given_softmax", "given_softmax_bwd"):
            getattr(lib, f"{name}_{suffix}").restype = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built if need be; None when they cannot be (see why())."""
    global _lib, _why, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("RESTOPO_CPU_KERNELS", "1") == "0":
        _why = "RESTOPO_CPU_KERNELS=0"
        return None
    cc = _compiler()
    if cc is None:
        _why = "no C compiler (cc, gcc or clang) on PATH"
        return None
    path, _why = _build(cc, source())
    if path is None:
        _why = f"the C kernels did not build with {cc}: {_why}"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except OSError as e:
        _why = f"the built kernels did not load: {e}"
        return None
    _lib, _why = lib, None
    return _lib


def why() -> str | None:
    """Why library() is None (None when it is not, or was not tried)."""
    return _why
