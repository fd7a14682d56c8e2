"""How `restopo check` time grows with depth: one process per (topology, depth), each under
a time and address-space limit, printing seconds and the ratio to the previous depth.

    python bench/check_depth.py                                  # depths 64 .. 4096
    python bench/check_depth.py --depths 64,256,1024 --timeout 60

Linear work doubles per doubling of depth (ratio ~2); quadratic work quadruples (~4). A
depth that `check` refuses (limits.MAX_SOURCE_READS) is shown as `refused`, with its time:
the refusal is counted in O(depth) before anything is built. The same script measures an
older checkout: PYTHONPATH=/path/to/old python bench/check_depth.py.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPOLOGIES = ("block_attnres(blocks: 2)", "block_attnres(blocks: 8)", "standard",
              "full_attnres", "full_attnres(window: 8)")


def _check(topology: str, depth: int, timeout: float, memory_gb: float) -> tuple[str, float]:
    def cap():
        limit = int(memory_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    with tempfile.NamedTemporaryFile("w", suffix=".restopo", delete=False) as f:
        f.write(f"model {{ vocab: 256; width: 64; depth: {depth}; heads: 4; context: 64 }}\n"
                f"residual {topology}\n")
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "restopo", "check", f.name],
                              capture_output=True, text=True, timeout=timeout, preexec_fn=cap)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0
    finally:
        Path(f.name).unlink()
    dt = time.perf_counter() - t0
    if done.returncode == 0:
        return "ok", dt
    if "MemoryError" in done.stderr:
        return "memory", dt
    if "sources in all" in done.stderr:
        return "refused", dt
    return f"exit {done.returncode}", dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--topologies", default=";".join(TOPOLOGIES))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="address space per case")
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    status, start = _check("standard", 2, args.timeout, args.memory_gb)
    print(f"start-up (depth 2): {start:.2f} s ({status}); times below include it")
    print(f"{'topology':28s}" + "".join(f"{d:>16d}" for d in depths))
    for topology in args.topologies.split(";"):
        cells, prev = [], None
        for d in depths:
            status, dt = _check(topology, d, args.timeout, args.memory_gb)
            cell = f"{dt:.2f}s" if status == "ok" else f"{status} {dt:.0f}s"
            if status == "ok" and prev is not None:
                cell += f" x{dt / prev:.1f}"
            prev = dt if status == "ok" else None
            cells.append(f"{cell:>16s}")
            if status in ("timeout", "memory"):
                cells += [f"{'-':>16s}"] * (len(depths) - len(cells))
                break
        print(f"{topology:28s}" + "".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
