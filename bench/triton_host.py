"""Host time per call of the fused Triton ops: eager calls through the autograd.Functions
(backends/triton/functions.py) against the same calls through the torch custom ops
(custom_ops.py, what torch.compile traces), side by side, interleaved, in one process.

At small widths a Block AttnRes step on a GPU is bound by this host time, not by the
kernels: on an H200 at width 512, 1024 rows, fp32, the compiled Block model stepped in
4.4x the standard model's time while its kernels took ~1 ms of a ~67 ms step
(bench/overhead.py --device cuda --profile 20). Each row here is one op at the in-model
call path (phase 2 fused with the next norm; phase 1 over 4 completed blocks for 4
queries; the single read over 8 sources), forward and forward+backward.

    python bench/triton_host.py                  # on a GPU: real launches
    python bench/triton_host.py --stub-launch    # anywhere (the default off a GPU): the
                                                 # kernel launch replaced by a no-op, so the
                                                 # figure is the Python and torch work
                                                 # around the kernels
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=1024, help="token rows (batch x context)")
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stub-launch", action="store_true",
                   help="replace the kernel launch by a no-op (the default without CUDA)")
    args = p.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device.type == "cpu":
        args.stub_launch = True
        os.environ["TRITON_INTERPRET"] = "1"
    return args


def cases(args):
    """name -> fn(path): one call of the op (forward, or forward+backward) through `path`,
    the module whose *_op functions it calls (custom_ops or functions)."""
    dev, d, rows = args.device, args.width, args.rows
    r = lambda *s: torch.randn(*s, device=dev, requires_grad=True)  # noqa: E731
    o1, part, q, g, nw = r(rows, d), r(rows, d), r(d), r(d), r(d)
    m1, s1 = torch.randn(rows, 1, device=dev), torch.ones(rows, 1, device=dev)
    blocks, Q, G = [r(rows, d) for _ in range(4)], r(4, d), r(4, d)
    srcs = [r(rows, d) for _ in range(8)]
    dh = torch.randn(rows, d, device=dev)

    def phase2(ops, back):
        h, y = ops.phase2_op(o1, m1, s1, part, q, g, nw, 1e-6, 1e-6, True, True, True)
        if back:
            torch.autograd.backward([h, y], [dh, dh])

    def phase1(ops, back):
        o, _, _, _ = ops.phase1_op(blocks, Q, G, 1e-6, True)
        if back:
            torch.autograd.backward(list(o), [dh] * len(o))

    def single(ops, back):
        h, _ = ops.depth_attention_op(srcs, q, g, 1e-6, True)
        if back:
            h.backward(dh)

    return {f"{name} {'fwd+bwd' if back else 'fwd'}": (lambda ops, f=f, b=back: f(ops, b))
            for name, f in (("phase2+norm", phase2), ("phase1 (4x4)", phase1),
                            ("single (8)", single)) for back in (False, True)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from restopo.backends.triton import custom_ops, functions, runtime
    launch = runtime.launch
    if args.stub_launch:
        runtime.launch = lambda *a, **k: None
    try:
        return measure(args, custom_ops, functions)
    finally:
        runtime.launch = launch


def measure(args, custom_ops, functions) -> int:
    sync = torch.cuda.synchronize if args.device.type == "cuda" else (lambda: None)
    paths = {"custom op": custom_ops, "Function": functions}
    print(f"host time per call, width {args.width}, {args.rows} rows, fp32, {args.device}"
          f"{' (launch stubbed: Python and torch work only)' if args.stub_launch else ''}; "
          f"median of {args.rounds} interleaved rounds of {args.calls} calls")
    print(f"{'op':24} {'custom op us':>13} {'Function us':>12} {'ratio':>6}")
    for name, fn in cases(args).items():
        times = {p: [] for p in paths}
        for _ in range(args.rounds):
            for label, ops in paths.items():
                for _ in range(5):
                    fn(ops)
                sync()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn(ops)
                sync()
                times[label].append(1e6 * (time.perf_counter() - t0) / args.calls)
        a, b = (statistics.median(times[p]) for p in paths)
        print(f"{name:24} {a:13.1f} {b:12.1f} {b / a:6.2f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
