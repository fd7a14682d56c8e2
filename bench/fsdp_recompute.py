"""What activation recompute costs under FSDP: the parameters gathered again, and the time.

FSDP2 (`--data fsdp`) keeps each unit's parameters sharded and all-gathers them for its
forward and again for its backward. A `block` recompute region (one transformer layer, its
aggregations included) runs its forward a second time inside backward, which can gather its
units once more; `sublayer` regions are the units themselves. For each recompute mode (none,
sublayer, block) this trains the same model through `restopo train`, on one process and as
FSDP over `--nproc` processes, and reports per process and optimizer step
  gathers  the all-gather calls and the bytes they bring in (counted in the workers:
           torch.distributed's all_gather_single and all_gather_into_tensor wrapped, which
           FSDP2 gathers through), and the bytes' ratio to mode none of the same layout;
  step     the wall time between successive optimizer steps (forward, backward, gathers,
           update), median over the steps after the first two, and its ratio to mode none
           of the same layout: the cost recompute adds, with FSDP's re-gathers in it;
runs alternate over the modes and layouts in every round, and each ratio's median and
range over the rounds are printed.

    python bench/fsdp_recompute.py                 # examples/block_attnres.restopo's size
    python bench/fsdp_recompute.py --quick         # a CI-size smoke run
    python bench/fsdp_recompute.py --spec examples/full_attnres.restopo --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("none", "sublayer", "block")
LAYOUTS = ("1", "fsdp")  # one process; FSDP over --nproc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=os.path.join(ROOT, "examples", "block_attnres.restopo"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec value (repeatable), as restopo train --set")
    p.add_argument("--nproc", type=int, default=2, help="FSDP processes")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: examples/tiny.restopo at width 32, depth 2, "
                        "context 32, batch 4; 3 steps, modes none and block, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.spec = os.path.join(ROOT, "examples", "tiny.restopo")
        args.set = ["model.width=32", "model.depth=2", "model.heads=2", "model.context=32",
                    "train.batch=4"] + args.set
        args.steps, args.rounds, args.modes = 3, 1, "none,block"
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    return args


def command(args, layout: str, mode: str, out: str) -> list[str]:
    """The worker's command line for one run (layout "1" or "fsdp")."""
    train = [args.spec, "--out", out, "--steps", str(args.steps), "--no-progress",
             "--device", "cpu", "--backend", "eager", "--recompute", mode,
             "--set", "train.eval_every=0", "--set", f"train.save_every={args.steps}",
             "--set", "train.log_every=1"]
    for kv in args.set:
        train += ["--set", kv]
    worker = [os.path.abspath(__file__), "--worker", "train", *train]
    if layout == "1":
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={args.nproc}", *worker, "--data", "fsdp"]


def run(args, layout: str, mode: str) -> dict:
    """One run: rank 0's gathers per step and median step seconds."""
    with tempfile.TemporaryDirectory(prefix="restopo-fsdp-recompute-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_BENCH_OUT=tmp)
        proc = subprocess.run(command(args, layout, mode, os.path.join(tmp, "run")), env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{layout} {mode}: the run failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(tmp, "rank0.json")) as f:
            return json.load(f)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.3f} ({min(xs):.3f}-{max(xs):.3f})"


def measure(args) -> dict:
    """{(layout, mode): [one run's record per round]}, the runs alternating every round."""
    got = {(lay, m): [] for lay in LAYOUTS for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            for lay in LAYOUTS:
                got[(lay, mode)].append(run(args, lay, mode))
                print(f"  round {r + 1}/{args.rounds}: {lay} {mode} "
                      f"{1e3 * got[(lay, mode)][-1]['step']:.0f} ms a step", file=sys.stderr)
    return got


def table(args, got: dict) -> str:
    lines = [f"{os.path.relpath(args.spec, ROOT)} {' '.join(args.set)}; FSDP over "
             f"{args.nproc} processes, {args.steps} steps a run, {args.rounds} rounds, one "
             f"thread a process",
             f"{'layout':8} {'mode':9} {'gathers':>8} {'MiB':>8} {'x none':>7} "
             f"{'step ms':>8}   step x none: median (range)"]
    for lay in LAYOUTS:
        base = got.get((lay, "none"))
        for mode in args.modes:
            rows = got[(lay, mode)]
            calls, nbytes = rows[-1]["gathers"], rows[-1]["gather_bytes"]
            ratio = (f"{nbytes / base[-1]['gather_bytes']:7.3f}"
                     if base and base[-1]["gather_bytes"] else f"{'-':>7}")
            step = statistics.median(x["step"] for x in rows)
            times = spread([x["step"] / b["step"] for x, b in zip(rows, base)]) if base else "-"
            name = "1 proc" if lay == "1" else f"fsdp{args.nproc}"
            lines.append(f"{name:8} {mode:9} {calls:8.1f} {nbytes / 2**20:8.2f} {ratio} "
                         f"{1e3 * step:8.1f}   {times}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    print(table(args, measure(args)))
    return 0


# -- inside each worker ----------------------------------------------------------------------
def worker(argv) -> int:
    """Run `restopo <argv>`, counting this process's all-gathers and timing its steps."""
    import torch
    import torch.distributed as dist

    from restopo.cli import main as restopo

    rank = int(os.environ.get("RANK", "0"))
    counts = {"calls": 0, "bytes": 0, "depth": 0}
    stamps = []
    step = torch.optim.AdamW.step

    def counted(gather):
        def wrapper(output, *a, **k):
            # FSDP2 gathers through all_gather_single (torch 2.13) or all_gather_into_tensor
            # (earlier); either may call the other: count the outermost call only
            if counts["depth"] == 0:
                counts["calls"] += 1
                counts["bytes"] += output.numel() * output.element_size()
            counts["depth"] += 1
            try:
                return gather(output, *a, **k)
            finally:
                counts["depth"] -= 1
        return wrapper

    def timed_step(self, *a, **k):
        out = step(self, *a, **k)
        stamps.append((time.perf_counter(), counts["calls"], counts["bytes"]))
        return out

    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))
    torch.optim.AdamW.step = timed_step
    code = restopo(argv)
    if code == 0 and rank == 0:
        # per step, between successive optimizer steps (the first two warm up)
        tail = stamps[2:] if len(stamps) > 3 else stamps
        deltas = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(tail, tail[1:])]
        record = {"step": statistics.median(d[0] for d in deltas),
                  "gathers": statistics.median(d[1] for d in deltas),
                  "gather_bytes": statistics.median(d[2] for d in deltas)}
        with open(os.path.join(os.environ["RESTOPO_BENCH_OUT"], "rank0.json"), "w") as f:
            json.dump(record, f)
    return code


if __name__ == "__main__":
    from restopo.worker import exit_with

    exit_with(main())  # its torchrun workers exit past torch's teardown
