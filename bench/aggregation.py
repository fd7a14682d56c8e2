"""The depth aggregation's own cost, with the sublayers out of the way.

bench/overhead.py times whole models, where the sublayers' matmuls and attention are most
of a step and move by more than the aggregation costs between runs. Here each topology is
lowered by restopo as usual (restopo.fx.lower: the same aggregation modules, two-phase plan,
shared logits and backends) over stand-in parts: an nn.Embedding, sublayers that are one
[d, d] matmul each (an extern kernel, so their outputs are real tensors as a sublayer's
are) and an identity head. A forward + backward (loss: the mean square of the last
aggregation) then costs the stand-ins plus the aggregations, and the difference to the
standard residual's is the aggregations' cost in milliseconds, eager or compiled (whole
model), measured interleaved:

    python bench/aggregation.py                       # the examples' size, eager and compiled
    python bench/aggregation.py --width 512 --depth 12 --context 256 --batch 4
    python bench/aggregation.py --no-compile --only standard,block8
    python bench/aggregation.py --backend eager       # plain torch's aggregations, eager
    python bench/aggregation.py --quick               # a CI-size smoke run

Eager rows run the aggregations on `--backend`: auto (the default, as `restopo train`: the
fused C kernels on the CPU where they build) or eager (plain torch). Compiled rows trace the
plain-torch forms either way (inductor cannot call the C kernels): inductor's code for the
same aggregations, to hold against the kernels' eager rows.

Used to find where a compiled Block AttnRes step's extra time goes (the inductor kernels of
phase 1's backward); the step itself is bench/overhead.py's to report.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from restopo import topology as T
from restopo.fx.lower import lower
from restopo.ir import build_ir
from restopo.nn.parts import Parts


class Linear(nn.Module):
    """A stand-in sublayer: v = h @ W."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, h):
        return h @ self.w


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=16, help="transformer layers")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8, help="N of Block AttnRes")
    p.add_argument("--only", default="", help="comma-separated topologies "
                                              "(standard, full, blockN, mhc4)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto", choices=("auto", "eager"),
                   help="aggregation kernels of the eager rows (default auto: the fused C "
                        "kernels on the CPU where they build, as restopo train runs)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--compile-only", action="store_true", help="torch.compile only")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: width 32, depth 2, context 16, batch 2, 2 rounds, "
                        "eager")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.context, args.batch = 32, 2, 16, 2
        args.blocks, args.rounds, args.no_compile = 2, 2, True
    return args


def topologies(args) -> dict:
    kinds = T.sublayer_kinds(args.depth)
    blocks = min(args.blocks, args.depth)
    out = {"standard": T.standard(kinds), "full": T.full_attnres(kinds),
           f"block{blocks}": T.block_attnres(kinds, blocks=blocks), "mhc4": T.mhc(kinds, 4)}
    if args.only:
        keep = ["standard", *[n for n in args.only.split(",") if n != "standard"]]
        unknown = [n for n in keep if n not in out]
        if unknown:
            raise SystemExit(f"unknown topology {unknown[0]!r}; choose from {', '.join(out)}")
        out = {n: out[n] for n in keep}
    return out


def build(args, topo) -> nn.Module:
    kinds = T.sublayer_kinds(args.depth)
    torch.manual_seed(0)
    embed = nn.Embedding(256, args.width)
    nn.init.normal_(embed.weight, std=0.5)
    parts = Parts(embed=embed, sublayers=nn.ModuleList(Linear(args.width) for _ in kinds),
                  kinds=kinds, head=nn.Identity())
    model = lower(build_ir(kinds, topo, args.width), parts, backend=args.backend)
    with torch.no_grad():  # trained-looking queries: non-uniform depth weights
        for a in model.aggregations:
            if hasattr(a, "pseudo_query"):
                a.pseudo_query.normal_(0, 0.05)
    return model


def step(fn, idx) -> None:
    fn(idx).square().mean().backward()


def measure(args, mode: str) -> dict:
    """{topology: [seconds per round]}, the topologies taking turns every round."""
    models = {name: build(args, topo) for name, topo in topologies(args).items()}
    fns = {name: torch.compile(m) if mode == "compile" else m for name, m in models.items()}
    idx = torch.randint(0, 256, (args.batch, args.context))
    for name, fn in fns.items():  # warm up (and compile)
        t0 = time.perf_counter()
        step(fn, idx)
        step(fn, idx)
        print(f"  {mode} {name}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            for p in models[name].parameters():
                p.grad = None
            t0 = time.perf_counter()
            step(fn, idx)
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = ([] if args.compile_only else ["eager"]) + ([] if args.no_compile else ["compile"])
    print(f"width {args.width}, depth {args.depth} ({2 * args.depth} sublayers), context "
          f"{args.context}, batch {args.batch}; stand-in sublayers (one [d, d] matmul); "
          f"aggregation backend {args.backend} (eager rows); threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}")
    print(f"{'mode':8} {'topology':10} {'step ms':>9} {'aggregation ms':>15}   per round: "
          f"median [range], {args.rounds} rounds")
    for mode in modes:
        times = measure(args, mode)
        base = times["standard"]
        for name, ts in times.items():
            extra = [1e3 * (t - b) for t, b in zip(ts, base)]
            print(f"{mode:8} {name:10} {1e3 * statistics.median(ts):9.2f} "
                  f"{statistics.median(extra):15.2f}   [{min(extra):.2f} to {max(extra):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
