"""What activation recompute (train.recompute) buys and costs, per topology, side by side.

For each topology (standard, Full AttnRes, Block AttnRes with N blocks, DenseFormer, ReZero,
mHC with n streams) and each mode (none, sublayer, block), on the same weights, this measures
  held   the bytes a forward leaves alive for backward (restopo.nn.activations.held_bytes:
         the storages it made that are alive when it returns: saved tensors, what the
         checkpointed regions hold, the logits), and its ratio to none;
  saved  for comparison, the unique storages torch.autograd.graph.saved_tensors_hooks sees
         (bench/overhead.py's figure): it counts weights that matmuls save and misses what a
         checkpointed region holds, so it understates what recompute keeps;
  step   the wall time of one forward + backward (loss = mean logsumexp of the logits); the
         modes of a topology take turns in every round and the ratio to none is taken
         within the round: its median over the rounds, quartiles and range.

    python bench/recompute.py --examples      # width 64, depth 16, context 128, batch 16,
                                              # heads 4, one thread (examples/*.restopo)
    python bench/recompute.py --quick         # a CI-size smoke run
    python bench/recompute.py --examples --only full,block8 --iters 9
(the options are bench/overhead.py's, and --only; the default size is its width 512 depth 12)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch

from restopo import topology as T
from restopo.fx.recompute import MODES, apply
from restopo.nn.activations import held_bytes


def _sibling(name: str):
    """bench/<name>.py, imported by its path: bench/ goes on no import path, where a
    script's name would hide an installed package of that name from everything after."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_overhead = _sibling("overhead")
make, setting, spread, topologies = (_overhead.make, _overhead.setting, _overhead.spread,
                                     _overhead.topologies)
overhead_measure, overhead_args = _overhead.measure, _overhead.parse_args


def parse_args(argv=None):
    """bench/overhead.py's options (sizes, --examples, --quick, --iters, --threads...), and
    --only NAMES (comma-separated topologies)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--only", default="", help="comma-separated topology names")
    own, rest = p.parse_known_args(argv)
    args = overhead_args(rest)
    args.only = own.only
    return args


def all_topologies(args) -> dict:
    kinds = T.sublayer_kinds(args.depth)
    out = dict(topologies(args))
    backend = args.backend[0]
    out["denseformer"], out["rezero"] = (T.denseformer(kinds), backend), (T.rezero(kinds), backend)
    if args.only:
        out = {k: v for k, v in out.items() if k in args.only.split(",")}
    return out


def measure(args, name: str, topo) -> dict:
    """bench/overhead.py's interleaved rounds over the modes of one topology (ratios to
    none), and the bytes each mode holds."""
    models = {mode: apply(make(args, topo), mode) for mode in MODES}
    idx = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    held = {}
    for mode, m in models.items():
        held[mode], loss = held_bytes(lambda: m(idx).logsumexp(-1).mean())
        loss.backward()
    print(f"  {name}:", file=sys.stderr)
    res = overhead_measure(args, "eager", models, base="none")
    return {mode: {**r, "held": held[mode]} for mode, r in res.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{setting(args)}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = {name: measure(args, name, topo) for name, topo in all_topologies(args).items()}
    print(f"\n{'topology':11} {'mode':8} {'held MiB':>9} {'x none':>7} {'saved MiB':>10} "
          f"{'x none':>7} {'median ms':>10}   step x none: median [quartiles] (range), "
          f"{args.iters} rounds")
    for name, res in rows.items():
        base = res["none"]
        for mode, r in res.items():
            print(f"{name:11} {mode:8} {r['held'] / 2**20:9.2f} {r['held'] / base['held']:7.3f} "
                  f"{r['saved'] / 2**20:10.2f} {r['saved'] / base['saved']:7.3f} "
                  f"{1e3 * r['median']:10.1f}   {spread(r['ratios'])}")
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
