"""Fused Triton depth attention against eager torch and torch.compile(eager), forward+backward.

    python bench/kernels.py              # on a CUDA GPU: rows 16k, d 2048 and 7168, bf16
    python bench/kernels.py --dry-run    # anywhere: tiny shapes in triton's interpreter, to
                                         # exercise the script; its timings mean nothing

Cases (per token row, n sources of width d):
- full:  one Full AttnRes aggregation over 32 sources (the single-read kernel).
- block: the whole aggregation of one Block AttnRes block, 8 completed blocks (embedding
         included) and 4 sublayers: phase 1 for the 4 queries, then phase 2 with the partial
         sum before each sublayer. Eager is run both two-phase and as 4 separate
         single aggregations over [completed..., partial].
- phase2: phase 2 fused with the next sublayer's RMSNorm, against torch.compile of
         add + rms_norm, which moves the same bytes (2 reads, 2 writes per row).

Bandwidth is the minimal traffic of the op (each input read once, each output written once,
forward and backward) divided by the time, as a fraction of the device-to-device copy
bandwidth measured in the same run. Everything is side by side in one process; no number
here is compared with a stored figure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script runs)")
    ap.add_argument("--rows", type=int, default=16384, help="token rows (batch x sequence)")
    ap.add_argument("--widths", type=int, nargs="+", default=None,
                    help="model widths d (default 2048 7168; 64 96 in --dry-run)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--full-sources", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=8, help="completed blocks, embedding included")
    ap.add_argument("--block-size", type=int, default=4, help="sublayers per block")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for the baselines (default: inductor; "
                         "aot_eager in --dry-run)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # must be set before the backend's kernels are first launched; tiny everything
        os.environ["TRITON_INTERPRET"] = "1"
        args.rows, args.iters, args.warmup = 37, 1, 0
        args.widths = args.widths or [64, 96]
        args.full_sources, args.blocks, args.block_size = 5, 3, 2
        args.compile_backend = args.compile_backend or "aot_eager"
    args.widths = args.widths or [2048, 7168]
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU: the fused kernels are compiled by triton for "
              "the GPU, and timings of triton's CPU interpreter mean nothing. Nothing measured. "
              "(`--dry-run` runs the script's logic on tiny shapes under the interpreter.)")
        return 0
    return Bench(args).run()


class Bench:
    def __init__(self, args):
        import torch
        import torch.nn.functional as F

        import restopo.backends.triton as T
        from restopo.backends.eager import depth as E
        self.torch, self.F, self.T, self.E = torch, F, T, E
        self.args = args
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
                      "fp32": torch.float32}[args.dtype]
        self.esize = torch.empty(0, dtype=self.dtype).element_size()
        self.compile_backend = args.compile_backend or "inductor"
        self.copy_bw = None

    # ---- timing --------------------------------------------------------------------------
    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn() over --iters runs after --warmup runs."""
        torch = self.torch
        for _ in range(self.args.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.args.iters):
            if self.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times[len(times) // 2]

    def measure_copy_bandwidth(self) -> float:
        """Bytes/s of a big device-to-device copy (read + write), the roofline reference."""
        torch = self.torch
        numel = (1 << 28) if self.device.type == "cuda" else (1 << 16)  # 1 GiB of fp32 on GPU
        src = torch.randn(numel, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * src.numel() * src.element_size() / (ms * 1e-3)

    # ---- cases ---------------------------------------------------------------------------
    def leaf(self, *shape, scale=1.0):
        torch = self.torch
        x = torch.randn(*shape, device=self.device, dtype=torch.float32) * scale
        return x.to(self.dtype).requires_grad_()

    def fwd_bwd(self, fn, inputs):
        """A closure running fn forward and backward (grads of `inputs`, not accumulated)."""
        torch = self.torch
        outs = fn(*inputs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        cots = [torch.randn_like(o) for o in outs]

        def step():
            res = fn(*inputs)
            res = res if isinstance(res, (tuple, list)) else (res,)
            torch.autograd.grad(res, inputs, cots)
        return step

    def compiled(self, fn):
        return self.torch.compile(fn, backend=self.compile_backend)

    def report(self, case, d, variant, ms, nbytes, ref_ms=None):
        """One line; the last column is this variant's time over the reference's."""
        bw = nbytes / (ms * 1e-3)
        rel = f"{ms / ref_ms:7.2f}x" if ref_ms else "      -"
        print(f"{case:7s} {d:6d}  {variant:44s} {ms:10.3f} ms {bw / 1e9:9.1f} GB/s "
              f"{bw / self.copy_bw:7.1%}  {rel}")
        sys.stdout.flush()

    def case_full(self, d):
        T, E = self.T, self.E
        n, rows = self.args.full_sources, self.args.rows
        inputs = [self.leaf(n, rows, d), self.leaf(d, scale=4 / d ** 0.5), self.leaf(d, scale=0.1)]
        with self.torch.no_grad():
            inputs[2] += 1
        # minimal traffic: forward reads n rows and writes 1; backward reads the n sources, dh
        # and h, and writes n source gradients (query/gain gradients are d-sized)
        nbytes = (3 * n + 3) * rows * d * self.esize
        eager = lambda v, w, g: E.depth_attention(v, w, g)  # noqa: E731
        variants = [("fused triton (single read)", lambda v, w, g: T.depth_attention(v, w, g)),
                    ("eager", eager),
                    (f"torch.compile(eager) [{self.compile_backend}]", self.compiled(eager))]
        self.run_variants("full", d, variants, inputs, nbytes)

    def case_block(self, d):
        T, E = self.T, self.E
        torch = self.torch
        n, S, rows = self.args.blocks, self.args.block_size, self.args.rows
        completed = self.leaf(n, rows, d)
        outputs = self.leaf(S - 1, rows, d)   # the sublayer outputs that build the partials
        queries = self.leaf(S, d, scale=4 / d ** 0.5)
        gains = self.leaf(S, d, scale=0.1)
        with torch.no_grad():
            gains += 1
        inputs = [completed, outputs, queries, gains]

        def partials(outs):
            # p^1 is empty; p^j = sum of the first j-1 outputs (not part of the timed op's
            # traffic model below: a model keeps the running partial anyway)
            return [None] + list(torch.cumsum(outs, 0).unbind(0))

        def two_phase(ops):
            def run(c, outs, w, g):
                o1, m1, s1 = ops.phase1(c, w, g)
                return [ops.phase2(o1[j], m1[j], s1[j], p, w[j], g[j])
                        for j, p in enumerate(partials(outs))]
            return run

        def single_reads(c, outs, w, g):
            return [E.depth_attention(c if p is None else torch.cat([c, p[None]]), w[j], g[j])
                    for j, p in enumerate(partials(outs))]

        # minimal traffic of the two-phase pair, forward: phase 1 reads the n completed blocks
        # and writes S o1; phase 2 reads o1 (+ the partial for j > 1) and writes h.
        # Backward: phase 2 reads dh, o1 (+ partial) and writes do1 (+ dpartial); phase 1
        # reads the blocks and the S do1 and writes the block gradients.
        fwd = n + S + S + (S - 1) + S
        bwd = (S + S + (S - 1) + S + (S - 1)) + (n + S + n)
        nbytes = (fwd + bwd) * rows * d * self.esize
        variants = [("fused triton (two-phase)", two_phase(T)),
                    ("eager two-phase", two_phase(E)),
                    (f"torch.compile(eager 2-phase) [{self.compile_backend}]",
                     self.compiled(two_phase(E))),
                    ("eager, S single aggregations", single_reads)]
        self.run_variants("block", d, variants, inputs, nbytes)

    def case_phase2(self, d):
        T, F = self.T, self.F
        torch = self.torch
        rows = self.args.rows
        o1, partial = self.leaf(rows, d), self.leaf(rows, d)
        m1 = torch.randn(rows, 1, device=self.device).requires_grad_()
        s1 = (torch.rand(rows, 1, device=self.device) * 3 + 1).requires_grad_()
        w, g, nw = self.leaf(d, scale=4 / d ** 0.5), self.leaf(d), self.leaf(d)

        def fused(o1, m1, s1, p, w, g, nw):
            return T.phase2_norm(o1, m1, s1, p, w, g, norm_weight=nw)

        def add_rms(x, r, nw):  # the standard residual's step: h = x + r, then the PreNorm
            h = x + r
            return h, F.rms_norm(h, (h.shape[-1],), nw, 1e-6)
        baseline = self.compiled(add_rms)
        nbytes = {"fwd": 4 * rows * d * self.esize,       # 2 reads, 2 writes
                  "fwd+bwd": 10 * rows * d * self.esize}  # + read dh, dy, 2 inputs; write 2
        for mode in ("fwd", "fwd+bwd"):
            ins_f = [o1, m1, s1, partial, w, g, nw]
            ins_b = [o1, partial, nw]
            if mode == "fwd":
                with torch.no_grad():
                    base_ms = self.time_ms(lambda: baseline(*ins_b))
                    ms = self.time_ms(lambda: fused(*ins_f))
            else:
                base_ms = self.time_ms(self.fwd_bwd(baseline, ins_b))
                ms = self.time_ms(self.fwd_bwd(fused, ins_f))
            self.report("phase2", d, f"fused phase2+norm, {mode}", ms, nbytes[mode])
            self.report("phase2", d, f"compile(add + rms_norm), {mode}", base_ms, nbytes[mode],
                        ms)
            print(f"{'':15s}phase2+norm time / add+rms_norm time ({mode}): {ms / base_ms:.2f}"
                  f" (goal: at most 1.5)")

    def run_variants(self, case, d, variants, inputs, nbytes):
        """Time each variant (the fused one first: the others are reported relative to it)."""
        fused_ms = None
        for name, fn in variants:
            try:
                ms = self.time_ms(self.fwd_bwd(fn, inputs))
            except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
                if "out of memory" not in str(exc):
                    raise
                print(f"{case:7s} {d:6d}  {name:44s} out of memory")
                ms = None
            if ms is not None:
                self.report(case, d, name, ms, nbytes, fused_ms)
                fused_ms = fused_ms or ms
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()

    def run(self) -> int:
        torch, args = self.torch, self.args
        where = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                 else "CPU, triton interpreter (dry run: timings mean nothing)")
        print(f"device: {where}; dtype {args.dtype}; rows {args.rows}; forward+backward unless "
              f"marked; median of {args.iters}")
        self.copy_bw = self.measure_copy_bandwidth()
        print(f"copy bandwidth (read+write of a big tensor): {self.copy_bw / 1e9:.1f} GB/s")
        print(f"{'case':7s} {'d':>6s}  {'variant':44s} {'time':>13s} {'effective bw':>14s} "
              f"{'of copy':>7s}  {'vs fused':>8s}")
        for d in args.widths:
            self.case_full(d)
            self.case_block(d)
            self.case_phase2(d)
        return 0


if __name__ == "__main__":
    sys.exit(main())
