"""Run a tiny pipelined model against the same model in one process, and count its traffic.

Launched under torchrun (one process per stage), e.g.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 \
        -m restopo.backends.pipeline.selfcheck --pipeline 4x2 --out result.json

For every schedule and with caching off and on, one training step's loss and every
parameter's gradient are compared with a single-process forward/backward of the same model
on the same batch (fp32), and the bytes sent per microbatch at the send calls (summed over
ranks) with the plan's figure. With --dtype bf16 the stages run under autocast and send
bf16 (the plan counts 2 bytes per value); the one-process reference stays fp32. Rank 0 writes the rows as JSON and prints them side by side
with the paper's bound. Tests and bench/pipeline_traffic.py call this.
"""
from __future__ import annotations

import argparse
import json
import types

import torch
import torch.distributed as dist

from .plan import make_plan, parse_pv
from .runtime import SCHEDULES, Pipeline, lm_loss


def tiny_model(topology: str, depth: int, width: int = 16, seed: int = 0):
    from restopo.fx.lower import lower
    from restopo.ir import build_ir
    from restopo.nn.model import build_parts, model_kinds
    from restopo.topology import (block_attnres, full_attnres, hyper_connections, mhc,
                                  standard, sublayer_kinds)

    spec = types.SimpleNamespace(vocab=32, width=width, depth=depth, heads=2, mlp="swiglu",
                                 mlp_ratio=2.0, context=16, tie_embeddings=True)
    kinds = sublayer_kinds(depth)
    if topology == "standard":
        topo = standard(kinds)
    elif topology == "full":
        topo = full_attnres(kinds)
    elif topology.startswith("mhc:"):  # mhc:n streams
        topo = mhc(kinds, int(topology.split(":")[1]))
    elif topology.startswith("dhc:"):  # dynamic Hyper-Connections, n streams
        topo = hyper_connections(kinds, int(topology.split(":")[1]), dynamic=True)
    else:  # block:N
        topo = block_attnres(kinds, blocks=int(topology.split(":")[1]))
    torch.manual_seed(seed)
    parts = build_parts(spec)
    model = lower(build_ir(model_kinds(spec), topo, spec.width), parts, backend="eager")
    # Non-zero pseudo-queries so that the depth softmax is not a plain mean.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pseudo_query"):
                p.normal_(0, 0.5)
    return model


def run(args) -> list[dict]:
    P, V = parse_pv(args.pipeline)
    model = tiny_model(args.topology, args.depth, args.width)
    g = model.restopo_ir
    cuts = [int(c) for c in args.cuts.split(",")] if args.cuts else None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    plan = make_plan(g, P, V, cuts=cuts, dtype_bytes=dtype.itemsize)
    M, T = args.microbatches, args.seq
    size = dtype.itemsize  # bytes per value on the wire
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (M * args.microbatch_size, T), generator=gen)
    tgt = torch.randint(0, 32, (M * args.microbatch_size, T), generator=gen)

    model.zero_grad(set_to_none=True)
    ref_loss = lm_loss(model(idx), tgt)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    rows = []
    schedules = args.schedules.split(",") if args.schedules else SCHEDULES
    tokens = args.microbatch_size * T
    for schedule in schedules:
        for cached in (False, True):
            model.zero_grad(set_to_none=True)
            pipe = Pipeline(model, plan, schedule=schedule, n_microbatches=M, cached=cached,
                            dtype=dtype)
            loss = pipe.step(idx, tgt)
            grad_err, checked = 0.0, set()
            for name, p in pipe.named_parameters(model):
                want = ref.get(name)
                got = p.grad
                if want is None and got is None:
                    continue
                if want is None or got is None:
                    grad_err = float("inf")
                    continue
                grad_err = max(grad_err, (got - want).abs().max().item())
                checked.add(name)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, sorted(checked))
            sent = torch.tensor([pipe.bytes_per_microbatch()["forward"],
                                 pipe.bytes_per_microbatch()["backward"], grad_err],
                                dtype=torch.float64)
            gathered = [torch.zeros_like(sent) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, sent)
            allg = torch.stack(gathered)
            rows.append({
                "pipeline": f"{P}x{V}", "schedule": schedule, "cached": cached,
                "loss": loss.item(), "ref_loss": ref_loss.item(),
                "loss_err": abs(loss.item() - ref_loss.item()),
                "grad_err": allg[:, 2].max().item(),
                "params_checked": len(set().union(*map(set, everyone))),
                "params_total": len(ref),
                "measured_fwd_bytes": allg[:, 0].sum().item(),
                "measured_bwd_bytes": allg[:, 1].sum().item(),
                "dtype": args.dtype,
                "plan_bytes": plan.vectors(cached) * tokens * args.width * size,
                "plan_streams": plan.vectors(cached, "streams"),
                "naive_bytes": plan.vectors(False) * tokens * args.width * size,
                "cached_bytes": plan.vectors(True) * tokens * args.width * size,
                "bound_block_bytes": plan.paper_bound_blocks * tokens * args.width * size,
                "naive_blocks": plan.vectors(False, "block"),
                "cached_blocks": plan.vectors(True, "block"),
                "bound_blocks": plan.paper_bound_blocks,
            })
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'pipeline':8s} {'schedule':17s} {'mode':6s} {'loss err':>9s} {'grad err':>9s} "
            f"{'measured fwd/bwd B/mb':>22s} {'plan naive':>10s} {'plan cached':>11s} "
            f"{'blocks n/c/bound':>17s}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['pipeline']:8s} {r['schedule']:17s} {'cached' if r['cached'] else 'naive':6s} "
            f"{r['loss_err']:9.1e} {r['grad_err']:9.1e} "
            f"{int(r['measured_fwd_bytes']):>10d}/{int(r['measured_bwd_bytes']):<11d} "
            f"{r['naive_bytes']:>10d} {r['cached_bytes']:>11d} "
            f"{r['naive_blocks']:>5d}/{r['cached_blocks']}/{r['bound_blocks']:g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="2x1")
    ap.add_argument("--topology", default="block:4",
                    help="standard | full | block:N | mhc:n | dhc:n (n streams)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--cuts", default="", help="fixed chunk ends, e.g. 3,5,7")
    ap.add_argument("--schedules", default="", help="comma list; default all")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="compute and wire dtype of the stages (bf16: autocast, as on CUDA)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rows = run(args)
        if dist.get_rank() == 0:
            print(table(rows), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from restopo.worker import exit_with

    exit_with(main())  # a torchrun worker exits past torch's teardown
