"""Memory per process of each parallel layout: does it divide the model?

For 1 process, pipelines of 2 and 4 stages, FSDP over 2 and 4 processes (and a pipeline of 2
x FSDP 2) this trains a model where the sublayers dominate (width 256, depth 16, vocab 256 by
default) for a few steps through `restopo train` under torchrun, and reports per process:
  params  bytes of the parameters its optimizer updates (an FSDP shard counts its rows)
  grads   bytes of their gradients at the optimizer step
  optim   bytes of the AdamW state (exp_avg, exp_avg_sq, step)
  held    bytes of every parameter tensor the process holds in memory (not on the meta
          device), trained or not
  ratio   (params + optim) / ((total params + total optim) / processes), where the totals are
          the one-process run's: 1.0 is a perfect split (the goal is at most 1.15)
  rss     peak resident memory of the process (torch's runtime included)
Figures are measured in the workers, not computed: AdamW.step is wrapped to read the
optimizer just before and after each update (the largest figures of the run are kept; a
checkpoint is saved before the last step, so what a save gathers counts too), and the loop's
`train` to see the model.

    python bench/memory.py                         # all layouts, 3 steps each
    python bench/memory.py --layouts 1,pp2,fsdp2    # some of them
    python bench/memory.py --baseline              # the same table for code without FSDP
                                                   # (fsdpN rows run as --nproc N: DDP)
    PYTHONPATH=/path/to/older/restopo python bench/memory.py --baseline   # another checkout

Layouts: 1 | ppN (pipeline N x 1 on N processes) | fsdpN | ppNxfsdpM (N*M processes).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("1", "pp2", "pp4", "fsdp2", "fsdp4", "pp2xfsdp2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=16, help="transformer layers")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--baseline", action="store_true",
                   help="run fsdpN as plain --nproc N (for code that has no FSDP)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per layout")
    return p.parse_args(argv)


def command(layout: str, args, out: str) -> tuple[int, list[str]]:
    """(processes, restopo train arguments) of one layout."""
    spec = ["--set", f"model.width={args.width}", "--set", f"model.depth={args.depth}",
            "--set", f"model.vocab={args.vocab}", "--set", f"model.context={args.context}",
            "--set", "model.heads=4", "--set", f"train.batch={args.batch}",
            "--set", "train.eval_every=0", "--set", f"train.save_every={max(1, args.steps - 1)}",
            "--set", "train.warmup=1", "--steps", str(args.steps), "--no-progress",
            "--device", "cpu", "--backend", "eager", "--out", out]
    extra, n = [], 1
    for part in layout.split("x"):
        if part.startswith("pp"):
            k = int(part[2:])
            extra += ["--pipeline", f"{k}x1"]
            n *= k
        elif part.startswith("fsdp"):
            k = int(part[4:])
            if not args.baseline:
                extra += ["--set", "parallel.data=fsdp"]
            n *= k
    return n, [os.path.join(os.path.dirname(HERE), "examples", "tiny.restopo"), *spec, *extra]


def run_layout(layout: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="restopo-memory-") as tmp:
        n, argv = command(layout, args, os.path.join(tmp, "run"))
        env = dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_MEMORY_OUT=tmp)
        worker = [os.path.abspath(__file__), "--worker", "train", *argv]
        if n == 1:
            cmd = [sys.executable, *worker]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={n}", *worker]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{layout}: the run failed:\n{proc.stderr[-3000:]}")
        rows = []
        for r in range(n):
            with open(os.path.join(tmp, f"memory-rank{r}.json")) as f:
                rows.append({"layout": layout, "processes": n, **json.load(f)})
        return rows


# -- inside each worker ----------------------------------------------------------------------
def _local_bytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return 0 if t.is_meta else t.numel() * t.element_size()


def worker(argv) -> int:
    """Run `restopo <argv>`, measuring this process's share (see the module docstring)."""
    import torch

    import restopo.train.loop as loop
    from restopo.cli import main

    seen = {"model": None, "rank": int(os.environ.get("RANK", "0"))}
    record = {}
    original_step = torch.optim.AdamW.step
    original_train = loop.train

    def step(self, *a, **k):
        params = [p for g in self.param_groups for p in g["params"]]
        now = {"params": sum(_local_bytes(p) for p in params),
               "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None)}
        out = original_step(self, *a, **k)
        now["optim"] = sum(_local_bytes(v) for s in self.state.values()
                           for v in s.values() if torch.is_tensor(v))
        if seen["model"] is not None:
            held = {id(p): p for p in seen["model"].parameters()}
            now["held"] = sum(_local_bytes(p) for p in held.values())
        for key, v in now.items():
            record[key] = max(record.get(key, 0), v)
        return out

    def train(model, *a, **k):
        seen["model"] = model
        return original_train(model, *a, **k)

    torch.optim.AdamW.step = step
    loop.train = train
    code = main(argv)
    record["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(os.environ["RESTOPO_MEMORY_OUT"],
                           f"memory-rank{seen['rank']}.json"), "w") as f:
        json.dump(record, f)
    return code


# -- the table -----------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    one = [r for r in rows if r["processes"] == 1]
    total = (one[0]["params"] + one[0]["optim"]) if one else None
    mib = 1 << 20
    lines = [f"{'layout':11s} {'rank':>4s} {'params':>9s} {'grads':>9s} {'optim':>9s} "
             f"{'held':>9s} {'ratio':>6s} {'rss':>9s}   (MiB; ratio = (params+optim) / "
             f"(one process's / processes))"]
    for r in rows:
        ratio = (r["params"] + r["optim"]) / (total / r["processes"]) if total else float("nan")
        lines.append(f"{r['layout']:11s} {r['rank']:>4d} {r['params'] / mib:9.2f} "
                     f"{r['grads'] / mib:9.2f} {r['optim'] / mib:9.2f} "
                     f"{r.get('held', 0) / mib:9.2f} {ratio:6.3f} {r['rss'] / mib:9.1f}")
    worst = {}
    for r in rows:
        if total:
            ratio = (r["params"] + r["optim"]) / (total / r["processes"])
            worst[r["layout"]] = max(worst.get(r["layout"], 0.0), ratio)
    if worst:
        lines.append("largest ratio per layout: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # inside torchrun: the rest is `restopo` arguments
        return worker(argv[1:])
    args = parse_args(argv)
    rows = []
    for layout in args.layouts.split(","):
        got = run_layout(layout, args)
        for i, r in enumerate(got):
            r["rank"] = i
        rows += got
        print(f"measured {layout}", file=sys.stderr, flush=True)
    print(f"model: width {args.width}, depth {args.depth} ({2 * args.depth} sublayers), vocab "
          f"{args.vocab}; batch {args.batch} x {args.context} tokens, {args.steps} steps"
          + ("; baseline: fsdpN run as --nproc N" if args.baseline else ""))
    print(table(rows))
    return 0


if __name__ == "__main__":
    from restopo.worker import exit_with

    exit_with(main())  # its torchrun workers exit past torch's teardown
