"""Cross-stage traffic of pipeline parallelism, measured at the send calls against the plan.

For each configuration a tiny Block AttnRes model is pipelined under torchrun (gloo, CPU);
the bytes each rank hands to isend are summed per microbatch and printed beside the plan's
naive and cached figures and the paper's bound. Also prints the plan alone (no processes)
at the paper's example sizes.

    OMP_NUM_THREADS=1 python bench/pipeline_traffic.py            # measured + plan
    python bench/pipeline_traffic.py --plan-only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from restopo.backends.pipeline.plan import make_plan
from restopo.backends.pipeline.selfcheck import table
from restopo.ir.build import build_ir
from restopo.topology import block_attnres, full_attnres, sublayer_kinds

CONFIGS = [  # (pipeline, topology, depth)
    ("2x2", "block:4", 4),
    ("4x2", "block:8", 8),
    ("4x2", "full", 4),
]


def measured(pipeline: str, topology: str, depth: int) -> list[dict]:
    P = int(pipeline.split("x")[0])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={P}", "-m", "restopo.backends.pipeline.selfcheck",
               "--pipeline", pipeline, "--topology", topology, "--depth", str(depth),
               "--microbatches", str(P), "--schedules", "interleaved_1f1b", "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
        with open(out) as f:
            return json.load(f)


def plan_only() -> None:
    print("plan (block transfers per token, units of d): naive / cached / paper's bound")
    for P, V, n_p in [(2, 2, 1), (4, 2, 1), (4, 4, 1), (8, 4, 1), (4, 2, 2)]:
        C = P * V
        k = sublayer_kinds(C * n_p)
        plan = make_plan(build_ir(k, block_attnres(k, blocks=C * n_p), 64), P, V,
                         costs={"attn": 1, "mlp": 1})
        n, c, b = plan.vectors(False, "block"), plan.vectors(True, "block"), plan.paper_bound_blocks
        print(f"  P={P} V={V} N_p={n_p}: {n:5d} / {c:5d} / {b:7.1f}   cached/naive {c / n:.3f}")
    k = sublayer_kinds(16)
    plan = make_plan(build_ir(k, full_attnres(k), 64), 4, 2, costs={"attn": 1, "mlp": 1})
    print(f"  full AttnRes, 32 sublayers, 4x2: {plan.vectors(False)} / {plan.vectors(True)} "
          f"d-vectors per token (all values)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args()
    plan_only()
    if args.plan_only:
        return 0
    rows = []
    for cfg in CONFIGS:
        rows += measured(*cfg)
    print("\nmeasured at the send calls (bytes per microbatch, summed over ranks):")
    print(table(rows))
    ok = all(r["measured_fwd_bytes"] == r["plan_bytes"] == r["measured_bwd_bytes"]
             for r in rows)
    print("measured == plan (forward and backward):", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
