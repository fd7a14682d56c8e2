"""Hold one training step of a layout against one process: losses and every gradient.

Launched under torchrun, e.g.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m restopo.train.layoutcheck \
        --pipeline 2x1 --data fsdp --set residual=rezero --out rows.json

Each process builds the model as `restopo train` does for the layout (restopo.train.layout:
on the meta device, then its own share, FSDP-sharded or not) and runs one step of its rows of
a fixed batch through the layout's Stepper (fp32, CPU). Every process also builds the whole
model in one piece from the same seed and runs the whole batch through it. For each parameter
a process holds (whole, or its FSDP rows) the gradient is compared with the one-process
gradient (the same rows); rank 0 writes the loss difference, the largest gradient difference
over all processes, how many of the model's parameters some process checked and how many
sublayer forwards ran again in backward (train.recompute), as JSON.
Tests (tests/test_layouts.py) call this.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..ops import BACKENDS
from ..spec.check import DATA_ENGINES
from ..spec.overrides import FlagConflict, SetOverride, with_flags

SPEC = """\
model check {
  vocab: 64; width: 32; depth: 2; heads: 2; context: 16
  mlp: swiglu(2x)
}
residual block_attnres(blocks: 2)
train { steps: 1; batch: 8; seed: 3 }
"""


def run(args, spec) -> dict:
    from .dist import exchange, setup
    from .layout import build, check_layout, resolve
    from .runspec import build_model
    from .shards import local_rows, local_tensor
    from .stepper import lm_loss

    ctx = setup("cpu")
    layout = resolve(args.pipeline, spec.parallel, ctx.world)
    check_layout(spec, layout, None)
    model, stepper = build(spec, layout, ctx, args.backend)
    if stepper is None:
        from .stepper import DataParallelStep

        stepper = DataParallelStep(model, ctx, spec.train.accum)

    ref = build_model(spec, "eager")
    gen = torch.Generator().manual_seed(1)
    B, T, V = spec.train.batch, spec.model.context, spec.model.vocab
    x = torch.randint(0, V, (B, T), generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    ref_loss = lm_loss(ref, x, y)
    ref_loss.backward()
    rows = B // stepper.data_world
    at = stepper.data_rank * rows
    recomputed = []  # sublayer forwards run again in backward (train.recompute)
    for m in model.sublayers:
        m.register_forward_pre_hook(
            lambda *_: recomputed.append(1) if torch._C._current_graph_task_id() >= 0 else None)
    loss = stepper.step(x[at:at + rows], y[at:at + rows])

    grad_err, checked = 0.0, []
    for name, p in stepper.held():
        want = ref.get_parameter(name).grad
        got = p.grad
        if got is None or want is None:
            grad_err = float("inf") if (got is None) != (want is None) else grad_err
            continue
        r = local_rows(p)
        want = want if r is None else want[r[0]:r[1]]
        grad_err = max(grad_err, (local_tensor(got) - want).abs().max().item()
                       if want.numel() else 0.0)
        checked.append(name)
    loss_mean = sum(exchange(ctx, loss.item())) / ctx.world
    everyone = exchange(ctx, {"err": grad_err, "checked": checked,
                              "recomputed": len(recomputed)})
    total = [n for n, _ in ref.named_parameters()]
    seen = set().union(*(set(e["checked"]) for e in everyone))
    return {"layout": stepper.layout, "loss": loss_mean, "ref_loss": ref_loss.item(),
            "loss_err": abs(loss_mean - ref_loss.item()),
            "grad_err": max(e["err"] for e in everyone),
            "params_checked": len(seen & set(total)), "params_total": len(total),
            "recomputed": sum(e["recomputed"] for e in everyone),
            "rank": ctx.rank}


def overrides(args) -> tuple[str, ...]:
    """--set, then the --data flag, read as `restopo train` reads them."""
    return with_flags(args.overrides, [("--data", args.data, "parallel.data")])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m restopo.train.layoutcheck",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", metavar="PxV",
                    help="P stages x V virtual stages, as `restopo train --pipeline` takes it "
                         "(default: none, unless --set parallel=... gives one)")
    ap.add_argument("--data", choices=DATA_ENGINES,
                    help="the data-parallel engine (same as --set parallel.data=...; default: "
                         "the spec's, ddp)")
    ap.add_argument("--set", dest="overrides", action=SetOverride, default=[],
                    metavar="KEY=VALUE",
                    help="override a value of the small spec it checks, e.g. --set "
                         "residual=rezero (repeatable)")
    ap.add_argument("--backend", choices=BACKENDS, default="eager",
                    help="the layout's lowering (default eager; auto: the PreNorm fused into "
                         "phase 2, as `restopo train` lowers); the reference is always eager")
    ap.add_argument("--out", metavar="FILE", help="also write rank 0's JSON row here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from ..spec import SpecError, parse_spec
    from .layout import LayoutError

    args = parse_args(argv)
    torch.set_num_threads(1)
    try:  # a mistake in the flags: every rank meets it, the first to stop says it
        row = run(args, parse_spec(SPEC, path="<layoutcheck>", overrides=overrides(args)))
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except (LayoutError, FlagConflict) as e:
        print(f"layoutcheck: error: {e}", file=sys.stderr)
        return 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if row["rank"] == 0:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(row, f)
    return 0


if __name__ == "__main__":
    from ..worker import exit_with

    exit_with(main())  # a torchrun worker exits past torch's teardown
