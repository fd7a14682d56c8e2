"""Fused Triton depth attention against eager torch, torch.compile(eager), a copy of the same
bytes and the peer packages that are installed, forward+backward, at the in-model call path.

    python bench/triton_depth.py              # on a CUDA GPU: 64k rows, d 2048 and 7168, bf16
    python bench/triton_depth.py --dry-run    # anywhere: tiny shapes in triton's interpreter, to
                                         # exercise the script; its timings mean nothing

In-model call path: every arm gets the sources as the lowered model hands them over, a list
of separately allocated [rows, d] tensors (nothing pre-stacked), and a Block AttnRes member
gets its sublayer's PreNorm fused in, as the lowering calls it. Cases:
- full:   one Full AttnRes aggregation over 32 sources (the single-read kernel).
- block:  the whole aggregation of one Block AttnRes block, 8 completed blocks (embedding
          included) and 4 sublayers: phase 1 for the 4 queries, then per sublayer phase 2
          with its partial sum and its sublayer's RMSNorm (only the normalised input is
          written). Eager runs it two-phase and as 4 single aggregations plus the norm.
- phase2: phase 2 fused with the next RMSNorm (writing h and y, as add + RMSNorm does)
          against torch.compile of add + rms_norm; goal: at most 1.2x its time.
- saved:  bytes autograd keeps for backward in a 12-sublayer Full and Block AttnRes model,
          eager against triton (bf16 autocast on a GPU, as training runs).
Peers (each run only where it imports): fast-attnres (`attnres.attnres`), fla-core
(`fla.ops.attnres.fused.fused_attnres`), flash-attn-res (`phase_1_batched_attention_triton_op`,
one query); the block case runs them per read.

Bandwidth is the minimal traffic of the op (each input read once, each output written once,
forward and backward) over the time; "of copy" is the time of a device-to-device copy moving
the same bytes over the arm's time (the copy is timed in the same run; above 2 GiB it is a
2 GiB copy scaled up). Everything is side by side in one process; no number here is compared
with a stored figure. --json FILE also writes every row as a JSON line (bench/gpu_check.sh
reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script runs)")
    ap.add_argument("--rows", type=int, default=65536, help="token rows (batch x sequence)")
    ap.add_argument("--widths", type=int, nargs="+", default=None,
                    help="model widths d (default 2048 7168; 64 96 in --dry-run)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--full-sources", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=8, help="completed blocks, embedding included")
    ap.add_argument("--block-size", type=int, default=4, help="sublayers per block")
    ap.add_argument("--cases", nargs="+", default=["full", "block", "phase2", "saved"],
                    choices=["full", "block", "phase2", "saved"])
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for the baselines (default: inductor; "
                         "aot_eager in --dry-run)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write rows as JSON lines")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each fused arm, print its kernels by device time "
                         "(torch.profiler, 3 steps)")
    ap.add_argument("--peers", default="all", choices=["all", "none", *PEERS],
                    help="the peer packages' arms: all that import (default), none, or one "
                         "alone beside the fused arm (a peer's fault, e.g. an illegal memory "
                         "access, ends its process: bench/gpu_check.sh runs each alone)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # the eager arms normalise bf16 rows with an fp32 gain, as a model under autocast does
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
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
        print("bench/triton_depth.py needs a CUDA GPU: the fused kernels are compiled by triton "
              "for the GPU, and timings of triton's CPU interpreter mean nothing. Nothing measured. "
              "(`--dry-run` runs the script's logic on tiny shapes under the interpreter.)")
        return 0
    return Bench(args).run()


# ---- peers: adapters to the installed packages' documented entry points ---------------------
PEERS = ("fast-attnres", "fla-core", "flash-attn-res")


def peer_arms(eps: float):
    """[(name, fn(sources, query, gain, norm_weight) -> output or None, why not)] for the peer
    packages; fn None with the reason when one does not import. norm_weight (the next
    sublayer's RMSNorm gain) is applied by the peer where it fuses it, else by F.rms_norm."""
    import torch
    import torch.nn.functional as F
    arms = []

    def normed(y, nw):
        return y if nw is None else F.rms_norm(y, (y.shape[-1],), nw, eps)

    def fast():
        from attnres import attnres as fast_attnres  # fast-attnres: bf16 sources and query
        return lambda s, w, g, nw=None: normed(
            fast_attnres(list(s), w.to(s[0].dtype), eps=eps), nw)

    def fla():
        from fla.ops.attnres.fused import fused_attnres  # fla-core

        def run(s, w, g, nw=None):
            d = s[0].shape[-1]
            out = fused_attnres(query=w, residuals=[x.reshape(-1, d) for x in s],
                                rms_weight=g, output_rms_weight=nw, rms_eps=eps, scale=1.0,
                                return_weights=False)
            out = out[0] if isinstance(out, tuple) else out
            return out.reshape(s[0].shape)
        return run

    def far():
        # flash-attn-res: its phase 1 over stacked [S, B, T, d] sources with [Q, d] queries;
        # one query makes it a single aggregation (the stacking copy is part of its call path)
        from flash_attn_res import phase_1_batched_attention_triton_op as far_phase1

        def run(s, w, g, nw=None):
            d = s[0].shape[-1]
            stacked = torch.stack([x.reshape(1, -1, d) for x in s])
            out, _ = far_phase1(stacked, w.reshape(1, d).to(s[0].dtype), eps)
            return normed(out[0].reshape(s[0].shape).to(s[0].dtype), nw)
        return run

    for name, make in zip(PEERS, (fast, fla, far)):
        try:
            arms.append((f"peer {name}", make(), None))
        except Exception as exc:  # a peer that fails to import (or to build) is left out
            arms.append((f"peer {name}", None, f"does not import ({type(exc).__name__}: {exc})"))
    return arms


class Bench:
    def __init__(self, args):
        import torch
        import torch.nn.functional as F

        import restopo.backends.triton as T
        from restopo import ops
        from restopo.nn.norm import NORM_EPS
        self.torch, self.F, self.T, self.ops, self.eps = torch, F, T, ops, NORM_EPS
        self.args = args
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
                      "fp32": torch.float32}[args.dtype]
        self.esize = torch.empty(0, dtype=self.dtype).element_size()
        self.compile_backend = args.compile_backend or "inductor"
        self.rows_out = open(args.json, "a") if args.json else None
        self.peers = [] if args.peers == "none" else \
            [arm for arm in peer_arms(NORM_EPS) if args.peers in ("all", arm[0][len("peer "):])]
        self.alone = args.peers not in ("all", "none")  # one peer: the fused arm and it alone

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

    def copy_ms(self, nbytes: int) -> float:
        """Milliseconds of a device-to-device copy that reads nbytes/2 and writes nbytes/2
        (above 2 GiB: a 2 GiB copy, scaled)."""
        torch = self.torch
        half = max(1, nbytes // 2)
        moved = min(half, 1 << 31)
        src = torch.empty(moved // 4, dtype=torch.float32, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src)) * half / (src.numel() * 4)
        del src, dst
        return ms

    # ---- inputs --------------------------------------------------------------------------
    def leaf(self, *shape, scale=1.0, dtype=None):
        torch = self.torch
        x = torch.randn(*shape, device=self.device, dtype=torch.float32) * scale
        return x.to(dtype or self.dtype).requires_grad_()

    def sources(self, n, d):
        """n separately allocated [rows, d] leaves, as the model's sublayer outputs are."""
        return [self.leaf(self.args.rows, d, scale=0.5 + i / n) for i in range(n)]

    def params(self, *shape):
        torch = self.torch
        w = self.leaf(*shape, scale=4 / shape[-1] ** 0.5, dtype=torch.float32)
        g = self.leaf(*shape, scale=0.1, dtype=torch.float32)
        with torch.no_grad():
            g += 1
        return w, g

    def fwd_bwd(self, fn, inputs):
        """A closure running fn forward and backward (grads of `inputs`, not accumulated).
        An input fn does not use gets no gradient (a peer without the key norm's gain)."""
        torch = self.torch
        outs = fn(*inputs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        cots = [torch.randn_like(o) for o in outs]

        def step():
            res = fn(*inputs)
            res = res if isinstance(res, (tuple, list)) else (res,)
            torch.autograd.grad(res, inputs, cots, allow_unused=True)
        return step

    def compiled(self, fn):
        return self.torch.compile(fn, backend=self.compile_backend)

    # ---- reporting -----------------------------------------------------------------------
    def emit(self, **row):
        if self.rows_out:
            row["peers"] = self.args.peers  # which run: a peer's alone repeats the fused arm
            self.rows_out.write(json.dumps(row) + "\n")
            self.rows_out.flush()

    def report(self, case, d, variant, ms, nbytes, copy_ms, ref_ms=None):
        """One line: time, effective bandwidth, the same-bytes copy's time over this time,
        and this time over the fused arm's."""
        bw = nbytes / (ms * 1e-3)
        rel = f"{ms / ref_ms:7.2f}x" if ref_ms else "      -"
        print(f"{case:7s} {d:6d}  {variant:46s} {ms:10.3f} ms {bw / 1e9:9.1f} GB/s "
              f"{copy_ms / ms:7.1%}  {rel}")
        sys.stdout.flush()
        self.emit(case=case, d=d, variant=variant, ms=ms, gbps=bw / 1e9,
                  of_copy=copy_ms / ms, vs_fused=(ms / ref_ms) if ref_ms else None)

    def run_variants(self, case, d, variants, inputs, nbytes):
        """Time each variant (the fused one first: the others are reported relative to it),
        then the copy of the same bytes."""
        torch = self.torch
        copy = self.copy_ms(nbytes)
        fused_ms = None
        for name, fn, why_not in variants:
            if fn is None:
                print(f"{case:7s} {d:6d}  {name:46s} not run: {why_not}")
                self.emit(case=case, d=d, variant=name, ms=None, note=f"not run: {why_not}")
                continue
            try:
                ms = self.time_ms(self.fwd_bwd(fn, inputs))
            except Exception as exc:  # an arm that fails (OOM, a peer's API) says so
                msg = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
                print(f"{case:7s} {d:6d}  {name:46s} failed: {msg}")
                self.emit(case=case, d=d, variant=name, ms=None, note=f"failed: {msg}")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            self.report(case, d, name, ms, nbytes, copy, fused_ms)
            if fused_ms is None and self.args.profile:
                self.profile(case, d, self.fwd_bwd(fn, inputs))
            fused_ms = fused_ms or ms
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.report(case, d, "copy of the same bytes", copy, nbytes, copy, fused_ms)

    def profile(self, case, d, step, top=12):
        """Where the fused arm's time goes: its kernels (and the torch ops between them) by
        device time over 3 steps, so a GPU run says which one to look at."""
        torch = self.torch
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        step()
        self.sync()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                step()
            self.sync()
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        print(f"--- profile of the fused arm, {case} d={d}, 3 steps (sorted by {key}):")
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))
        sys.stdout.flush()

    # ---- cases ---------------------------------------------------------------------------
    def case_full(self, d):
        ops = self.ops
        n, rows = self.args.full_sources, self.args.rows
        srcs = self.sources(n, d)
        w, g = self.params(d)
        # minimal traffic: forward reads n rows and writes 1; backward reads dh and the n
        # sources and writes n source gradients (query and gain gradients are d-sized)
        nbytes = (3 * n + 2) * rows * d * self.esize

        def arm(backend):
            return lambda *a: ops.depth_attention(list(a[:n]), a[n], a[n + 1], self.eps,
                                                  backend=backend)
        eager = arm("eager")
        variants = [("fused triton (single read)", arm("triton"), None)]
        if not self.alone:
            variants += [("eager (list of sources)", eager, None),
                         (f"torch.compile(eager) [{self.compile_backend}]",
                          self.compiled(eager), None)]
        variants += [(name, fn and (lambda fn: lambda *a: fn(a[:n], a[n], a[n + 1]))(fn), why)
                     for name, fn, why in self.peers]
        self.run_variants("full", d, variants, [*srcs, w, g], nbytes)

    def case_block(self, d):
        ops, F, torch = self.ops, self.F, self.torch
        n, S, rows = self.args.blocks, self.args.block_size, self.args.rows
        completed = self.sources(n, d)
        outputs = self.sources(S - 1, d)   # the sublayer outputs that build the partials
        queries, gains = self.params(S, d)
        nw = self.leaf(d, scale=0.1, dtype=torch.float32)
        with torch.no_grad():
            nw += 1
        inputs = [*completed, *outputs, queries, gains, nw]

        def unpack(a):
            c, outs = list(a[:n]), list(a[n:n + S - 1])
            w, g, nw = a[n + S - 1:]
            # p^1 is empty; p^j = sum of the first j-1 outputs (the model keeps the running
            # partial anyway: not part of the timed op's traffic model below)
            partials = [None]
            for o in outs:
                partials.append(o if partials[-1] is None else partials[-1] + o)
            return c, partials, w, g, nw

        def two_phase(backend):
            def run(*a):
                c, partials, w, g, nw = unpack(a)
                o1, m1, s1 = ops.phase1(c, w, g, self.eps, backend=backend)
                return [ops.phase2_norm(o1[j], m1[j], s1[j], p, w[j], g[j], self.eps,
                                        norm_weight=nw, norm_eps=self.eps, keep_h=False,
                                        backend=backend)[1]
                        for j, p in enumerate(partials)]
            return run

        def per_read(fn):
            def run(*a):
                c, partials, w, g, nw = unpack(a)
                return [fn(c if p is None else c + [p], w[j], g[j], nw)
                        for j, p in enumerate(partials)]
            return run

        def eager_read(s, w, g, nw):
            h = ops.depth_attention(s, w, g, self.eps, backend="eager")
            return F.rms_norm(h, (d,), nw, self.eps)

        # minimal traffic, forward: phase 1 reads the n completed blocks and writes S o1;
        # phase 2 reads o1 (+ the partial for j > 1) and writes y. Backward: phase 2 reads
        # dy, o1 (+ partial) and writes do1 (+ dpartial); phase 1 reads the blocks and the S
        # do1 and writes the block gradients.
        fwd = n + S + S + (S - 1) + S
        bwd = (S + S + (S - 1) + S + (S - 1)) + (n + S + n)
        nbytes = (fwd + bwd) * rows * d * self.esize
        eager = two_phase("eager")
        variants = [("fused triton (two-phase, fused norm)", two_phase("triton"), None)]
        if not self.alone:
            variants += [("eager two-phase + norm", eager, None),
                         (f"torch.compile(eager 2-phase) [{self.compile_backend}]",
                          self.compiled(eager), None),
                         ("eager, S single aggregations + norm", per_read(eager_read), None)]
        variants += [(f"{name} (per read)", per_read(fn) if fn else None, why)
                     for name, fn, why in self.peers]
        self.run_variants("block", d, variants, inputs, nbytes)

    def case_phase2(self, d):
        ops, F, torch = self.ops, self.F, self.torch
        rows = self.args.rows
        o1, partial = self.leaf(rows, d), self.leaf(rows, d)
        m1 = torch.randn(rows, 1, device=self.device).requires_grad_()
        s1 = (torch.rand(rows, 1, device=self.device) * 3 + 1).requires_grad_()
        w, g = self.params(d)
        nw = self.leaf(d, dtype=torch.float32)

        def fused(o1, m1, s1, p, w, g, nw):
            return ops.phase2_norm(o1, m1, s1, p, w, g, self.eps, norm_weight=nw,
                                   norm_eps=self.eps, backend="triton")

        def fused_y(o1, m1, s1, p, w, g, nw):
            return ops.phase2_norm(o1, m1, s1, p, w, g, self.eps, norm_weight=nw,
                                   norm_eps=self.eps, keep_h=False, backend="triton")[1]

        def add_rms(x, r, nw):  # the standard residual's step: h = x + r, then the PreNorm
            h = x + r
            return h, F.rms_norm(h, (h.shape[-1],), nw, self.eps)
        baseline = self.compiled(add_rms)
        unit = rows * d * self.esize
        # rows x d tensors moved: writing h and y, forward 2 reads and 2 writes, backward
        # reads dh, dy and the 2 inputs and writes 2; writing only y, one fewer each way
        nbytes = {"fwd": 4 * unit, "fwd+bwd": 10 * unit}
        nbytes_y = {"fwd": 3 * unit, "fwd+bwd": 8 * unit}
        ins_f = [o1, m1, s1, partial, w, g, nw]
        ins_b = [o1, partial, nw]
        for mode in ("fwd", "fwd+bwd"):
            copy = self.copy_ms(nbytes[mode])
            if mode == "fwd":
                with torch.no_grad():
                    base_ms = self.time_ms(lambda: baseline(*ins_b))
                    ms = self.time_ms(lambda: fused(*ins_f))
                    y_ms = self.time_ms(lambda: fused_y(*ins_f))
            else:
                base_ms = self.time_ms(self.fwd_bwd(baseline, ins_b))
                ms = self.time_ms(self.fwd_bwd(fused, ins_f))
                y_ms = self.time_ms(self.fwd_bwd(fused_y, ins_f))
            self.report("phase2", d, f"fused phase2+norm (h and y), {mode}", ms,
                        nbytes[mode], copy)
            self.report("phase2", d, f"fused phase2+norm (y only: in-model), {mode}", y_ms,
                        nbytes_y[mode], self.copy_ms(nbytes_y[mode]), ms)
            self.report("phase2", d, f"compile(add + rms_norm), {mode}", base_ms,
                        nbytes[mode], copy, ms)
            print(f"{'':15s}phase2+norm time / add+rms_norm time ({mode}): {ms / base_ms:.2f}"
                  f" (goal: at most 1.2)")
            self.emit(case="phase2", d=d, variant=f"ratio to compiled add+rms_norm, {mode}",
                      ratio=ms / base_ms, goal=1.2)

    def case_saved(self):
        """Bytes autograd keeps for backward, eager against triton, in two 12-sublayer
        models (forward only: that is what is kept)."""
        import restopo
        torch = self.torch
        dry = self.args.dry_run
        width, ctx, batch = (32, 16, 2) if dry else (1024, 512, 4)
        spec = ("model m {{ vocab: 256; width: {w}; depth: 6; heads: {h}; context: {c}\n"
                "  mlp: swiglu(2x) }}\nresidual {r}\n")
        for residual in ("full_attnres", "block_attnres(blocks: 3)"):
            text = spec.format(w=width, h=2 if dry else 8, c=ctx, r=residual)
            got = {}
            for backend in ("eager", "triton"):
                torch.manual_seed(0)
                model = restopo.compile(text, backend=backend).to(self.device)
                idx = torch.randint(0, 256, (batch, ctx), device=self.device)
                got[backend] = saved_bytes(lambda: model(idx), self.device)
                del model
            ratio = got["triton"] / got["eager"]
            print(f"saved   {width:6d}  {residual:24s} eager {got['eager'] / 2**20:9.2f} MiB  "
                  f"triton {got['triton'] / 2**20:9.2f} MiB  triton/eager {ratio:.3f} "
                  f"(goal: at most 1)")
            self.emit(case="saved", d=width, variant=residual, eager_mib=got["eager"] / 2**20,
                      triton_mib=got["triton"] / 2**20, ratio=ratio, goal=1.0)

    def run(self) -> int:
        torch, args = self.torch, self.args
        where = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                 else "CPU, triton interpreter (dry run: timings mean nothing)")
        print(f"device: {where}; dtype {args.dtype}; rows {args.rows}; forward+backward unless "
              f"marked; median of {args.iters}; sources as separate tensors (in-model path)")
        for name, fn, why in self.peers:
            if fn is None:
                print(f"{name}: {why}")
        print(f"{'case':7s} {'d':>6s}  {'variant':46s} {'time':>13s} {'effective bw':>14s} "
              f"{'of copy':>7s}  {'vs fused':>8s}")
        if self.alone and all(fn is None for _, fn, _ in self.peers):
            # the one peer asked for does not import: say so per case, time nothing
            for d in args.widths:
                for case in ("block", "full"):
                    if case in args.cases:
                        for name, _, why in self.peers:
                            self.emit(case=case, d=d, ms=None, note=f"not run: {why}",
                                      variant=name + " (per read)" * (case == "block"))
            return 0
        # what decides most first (a run cut short by a lease keeps it): the saved bytes, then
        # per width the block (the goal), phase 2, and full
        if "saved" in args.cases:
            self.case_saved()
        for d in args.widths:
            if "block" in args.cases:
                self.case_block(d)
            if "phase2" in args.cases:
                self.case_phase2(d)
            if "full" in args.cases:
                self.case_full(d)
        if self.rows_out:
            self.rows_out.close()
        return 0


def saved_bytes(fn, device) -> int:
    """Bytes of the distinct storages autograd keeps while fn runs (under bf16 autocast on a
    GPU, as restopo train runs)."""
    import contextlib

    import torch
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    cast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else contextlib.nullcontext())
    with cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


if __name__ == "__main__":
    sys.exit(main())
