"""How far each topology's freshly initialised model is from the standard residual with the
same embedding, sublayers and head, for the usual norm epsilon (1e-6) and restopo's
(restopo.nn.norm.NORM_EPS), side by side.

    python bench/step0.py [--width 64] [--depths 2 16] [--dtype float64]

Prints max |logits - standard logits| / max |standard logits| on one batch, per topology,
depth and epsilon (not a test: tests/test_init_equivalence.py holds the bounds).
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from restopo import topology as T
from restopo.nn import aggregate, sublayers
from restopo.nn.norm import NORM_EPS
from restopo.spec.objects import ModelSpec
from restopo.train.init_check import step0_difference, step0_models


@contextlib.contextmanager
def norm_eps(eps: float):
    """Build models whose every norm uses `eps` (the constants are read at construction)."""
    saved = sublayers.NORM_EPS, aggregate.EPS
    sublayers.NORM_EPS = aggregate.EPS = eps
    try:
        yield
    finally:
        sublayers.NORM_EPS, aggregate.EPS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 16])
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    print(f"step-0 distance from the standard residual ({args.dtype}, width {args.width}, "
          f"embedding std 0.02): max|dlogits| / max|logits|")
    print(f"{'depth':>5} {'sublayers':>9}  {'topology':<24}{'eps 1e-6':>12}"
          f"{f'eps {NORM_EPS:g}':>12}")
    for depth in args.depths:
        m = ModelSpec(vocab=256, width=args.width, depth=depth, heads=4, context=64)
        tops = {"full_attnres": T.full_attnres(m.kinds),
                f"block_attnres({min(8, depth)})": T.block_attnres(m.kinds, blocks=min(8, depth)),
                "denseformer(softmax)": T.denseformer(m.kinds, gate="softmax")}
        for name, top in tops.items():
            row = []
            for eps in (1e-6, NORM_EPS):
                with norm_eps(eps):
                    other, standard = step0_models(m, top, dtype)
                row.append(step0_difference(other, standard, idx))
            print(f"{depth:>5} {2 * depth:>9}  {name:<24}{row[0]:>12.3g}{row[1]:>12.3g}")


if __name__ == "__main__":
    main()
