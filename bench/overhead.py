"""Overhead of Full and Block AttnRes and mHC against the standard residual, side by side.

For each topology (standard, Full AttnRes, Block AttnRes with N blocks, mHC with n streams)
on the same model
dimensions, in eager mode, under torch.compile of the whole model, and (--regional) with
each region compiled as `restopo train --compile` compiles it (restopo.train.compile), this
measures
  step  the wall time of one forward + backward (loss = mean logsumexp of the logits): the
        fastest of the timed rounds (other processes on the machine only ever add time;
        the median is printed beside it), the topologies taking turns in every round so
        drift hits them alike; and the ratio to standard within each round: its median and
        its spread over the rounds (quartiles, and min-max), which load moves far less
        than the absolute times; with --clock cpu, the process's CPU time instead of wall
        time (one thread): what other processes take of the core then drops out, while
        what they take of the caches and memory bandwidth stays;
  saved the bytes of activations autograd keeps for backward at the end of the forward pass
        (unique storages seen by torch.autograd.graph.saved_tensors_hooks). On CPU there is
        no allocator peak counter; this is the memory that grows with depth and batch, i.e.
        the part of the peak a residual topology changes (weights and optimizer state are
        the same for all three up to the few aggregation parameters).
and prints each as a ratio to the standard residual. On the CPU it then prints FLOP rates:
each topology's training FLOPs a step (from the IR) over its median step, the rate at which
its extra work over standard ran, and the rate that extra work would need for issue 11's goal
ratio, beside this thread's own rates for a matmul and an in-cache multiply-add at the
model's shapes: a goal whose extra work must outrun the multiply-add needs kernels that are
not a sequence of passes over the sources (or a wider model, where that work is a smaller
share), not a faster pass.

    python bench/overhead.py                 # width 512, depth 12, context 256, batch 4
    python bench/overhead.py --quick         # a CI-size smoke run
    python bench/overhead.py --width 256 --depth 6 --no-compile
    python bench/overhead.py --examples --no-compile   # the size of examples/*.restopo:
                                             # width 64, depth 16, context 128, batch 16,
                                             # heads 4, one thread
    python bench/overhead.py --examples --regional --streams 0   # + regional compile
    python bench/overhead.py --examples --regional --regional-all --streams 0
                                             # + regional with the aggregation regions that
                                             # run the C kernels compiled too
    python bench/overhead.py --compile-only --streams 0 --threads 1 --clock cpu
                                             # width 512 on a machine other work shares
    python bench/overhead.py --examples --compile-time  # first step (compilation included)
                                             # of the Block model: whole-model against
                                             # regional, each in a fresh process and cache
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

from restopo import topology as T
from restopo.api import build_model
from restopo.ir.build import build_ir
from restopo.nn.flops import TRAIN_PER_FORWARD, flops_per_token
from restopo.sizes import mlp_hidden

# Issue 11's goals, ratio to standard (regional compilation shares the compiled ones)
GOALS = {"eager": {"full": 1.30, "block": 1.10}, "compile": {"full": 1.10, "block": 1.03}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=12, help="transformer layers")
    p.add_argument("--context", type=int, default=256, help="sequence length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8, help="N of Block AttnRes")
    p.add_argument("--streams", type=int, default=4, help="n of mHC (0: leave mHC out)")
    p.add_argument("--iters", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds (compilation; the last one counts saved activations)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", type=_backends, metavar="B[,B...]",
                   help="aggregation kernels, one or several (comma-separated: each "
                        "topology is built on each and timed in the same rounds): auto (the "
                        "fused C kernels on the CPU where they build, triton on CUDA; "
                        "compiled, inductor's code on either), eager (plain torch, the "
                        "reference), cpu, triton")
    p.add_argument("--no-compile", action="store_true", help="eager mode only")
    p.add_argument("--compile-only", action="store_true", help="torch.compile mode only")
    p.add_argument("--regional", action="store_true",
                   help="also each region compiled in place (restopo.train.compile)")
    p.add_argument("--regional-all", action="store_true",
                   help="also regional with every region compiled, the aggregation regions "
                        "that run the fused C kernels too (restopo train --compile leaves "
                        "those uncompiled)")
    p.add_argument("--compile-time", action="store_true",
                   help="only the first step of the Block model, whole-model against "
                        "regional compilation (fresh process and inductor cache each)")
    p.add_argument("--rounds", type=int, default=2, help="--compile-time: rounds of both")
    p.add_argument("--first-step", choices=("compile", "regional"), help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: width 64, depth 4, context 64, batch 2, 2 rounds")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after the timing, profile 3 steps of each topology in each mode "
                        "(torch.profiler) and print its top ROWS ops by self CPU time and, "
                        "on CUDA, by self device time: where a fixed cost per call hides")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what a step's time is: wall (default) or cpu, this process's CPU "
                        "time (one thread, CPU only): on a shared machine it leaves out the "
                        "time other processes hold the core, which wall time counts")
    p.add_argument("--examples", action="store_true",
                   help="the size of examples/*.restopo: width 64, depth 16, context 128, "
                        "batch 16, heads 4, one thread (unless --threads)")
    args = p.parse_args(argv)
    args.warmup = max(1, args.warmup)
    if args.examples:
        args.width, args.depth, args.context, args.batch, args.heads = 64, 16, 128, 16, 4
        args.threads = args.threads or 1
    if args.quick:
        args.width, args.depth, args.context, args.batch = 64, 4, 64, 2
        args.heads, args.blocks, args.iters, args.warmup = 4, 2, 2, 2
    if args.clock == "cpu" and (args.threads != 1 or not args.device.startswith("cpu")):
        # CPU time sums the threads (a step on 2 threads would read twice its length), and a
        # GPU's work is not the process's CPU time at all
        p.error("--clock cpu times one CPU thread: give --threads 1 (--examples does) and no "
                "--device")
    args.now = time.process_time if args.clock == "cpu" else time.perf_counter
    return args


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(b.strip() for b in text.split(",")))
    bad = [b for b in names if b not in ("auto", "eager", "cpu", "triton")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown backend {', '.join(bad) or text!r}; "
                                         "choose from auto, eager, cpu, triton")
    return names


def topologies(args):
    """name -> (topology, backend). The standard residual has no aggregation op, so it is
    built once; with several backends every other topology is built on each, named
    `block8:eager`, `block8:cpu`."""
    kinds = T.sublayer_kinds(args.depth)
    blocks = min(args.blocks, args.depth)
    mixed = {"full": T.full_attnres(kinds), f"block{blocks}": T.block_attnres(kinds, blocks=blocks)}
    if args.streams:
        mixed[f"mhc{args.streams}"] = T.mhc(kinds, args.streams)
    backends = args.backend
    out = {"standard": (T.standard(kinds), backends[0])}
    for name, topo in mixed.items():
        for b in backends:
            out[name if len(backends) == 1 else f"{name}:{b}"] = (topo, b)
    return out


def model_config(args) -> SimpleNamespace:
    """The model every topology is built on (and whose FLOPs and shapes the rates read)."""
    return SimpleNamespace(vocab=args.vocab, width=args.width, depth=args.depth,
                           heads=args.heads, mlp="swiglu", mlp_ratio=4, context=args.context)


def make(args, topo_backend):
    topo, backend = topo_backend
    torch.manual_seed(0)
    model = build_model(model_config(args), topo, backend=backend).to(args.device)
    with torch.no_grad():  # trained-looking queries: non-uniform depth weights
        for a in model.aggregations:
            if hasattr(a, "pseudo_query"):
                a.pseudo_query.normal_(0, 0.05)
    return model


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step(fn, idx):
    fn(idx).logsumexp(-1).mean().backward()


def saved_bytes(fn, idx) -> int:
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[(s.data_ptr(), t.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(idx).logsumexp(-1).mean()
    loss.backward()
    return sum(storages.values())


def compiled(mode: str, model):
    """(what a step calls in `mode`, the model): the model, torch.compile of it, or the
    model with its regions compiled in place (main gives this mode models of its own)."""
    if mode == "eager":
        return model, model
    if mode == "compile":
        return torch.compile(model), model
    from restopo.train.compile import compile_regions

    compile_regions(model, kernels=mode == "regional-all")
    return model, model


def measure(args, mode: str, models: dict, base: str = "standard") -> dict:
    both = {name: compiled(mode, m) for name, m in models.items()}
    if args.profile:
        for name, (fn, m) in both.items():
            profile(args, mode, fn, m, name)
    fns = {name: fn for name, (fn, _) in both.items()}
    models = {name: m for name, (_, m) in both.items()}
    idx = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    times = {name: [] for name in fns}
    saved = {}
    for r in range(args.warmup + args.iters):
        for name, fn in fns.items():  # take turns every round
            for p in models[name].parameters():
                p.grad = None
            if r == args.warmup - 1:  # the last warm-up round counts the saved activations
                saved[name] = saved_bytes(fn, idx)
                continue
            sync(args.device)
            t0 = args.now()
            step(fn, idx)
            sync(args.device)
            if r >= args.warmup:
                times[name].append(args.now() - t0)
        print(f"  {mode}: round {r + 1}/{args.warmup + args.iters}", file=sys.stderr)
    base = times[base]
    return {name: dict(step=min(times[name]), median=statistics.median(times[name]),
                       ratios=[t / b for t, b in zip(times[name], base)],
                       saved=saved[name]) for name in fns}


def profile(args, mode: str, fn, model, name: str) -> None:
    """3 steps of `fn` under torch.profiler: the host side (self CPU time, call counts) says
    whether a topology's extra time is per call (dispatch, launches, host work) or per
    byte (the device side)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if str(args.device).startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    idx = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    step(fn, idx)
    sync(args.device)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            step(fn, idx)
        sync(args.device)
    table = prof.key_averages()
    for key in ["self_cpu_time_total"] + (["self_device_time_total"] if len(acts) > 1 else []):
        print(f"\n--- profile: {mode} {name}, 3 steps, by {key}")
        print(table.table(sort_by=key, row_limit=args.profile, max_name_column_width=70))
    sys.stdout.flush()


def spread(ratios: list[float]) -> str:
    """The median of the per-round ratios, their quartiles and their range."""
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return (f"{statistics.median(ratios):6.3f} [{q[0]:.3f}-{q[2]:.3f}] "
            f"({min(ratios):.3f}-{max(ratios):.3f})")


def train_flops(args, topo) -> float:
    """Training FLOPs a step: restopo.nn.flops's count, with the key norm's mean square
    counted once a source rather than once a read (each source's RMS computed once for all
    its readers, what a fused implementation needs): the least work a topology adds."""
    g = build_ir(T.sublayer_kinds(args.depth), topo, args.width)
    normed = [a for a in g.aggregations() if a.method == "attend" and a.key_norm == "rms"]
    again = sum(len(a.sources) for a in normed) - len({s for a in normed for s in a.sources})
    forward = flops_per_token(g, model_config(args)).forward - 2 * args.width * again
    return TRAIN_PER_FORWARD * forward * args.batch * args.context


def machine_rates(args) -> dict[str, float]:
    """GFLOP/s of this process's threads at the model's own shapes: the MLP's first matmul
    (the kind of work the standard model is made of) and an in-cache multiply-add over one
    [tokens, d] source (the kind an aggregation is made of, acc += a v; and a dot v @ q)."""
    n, d, cfg = args.batch * args.context, args.width, model_config(args)
    x, w = torch.randn(n, d), torch.randn(d, mlp_hidden(d, cfg.mlp, cfg.mlp_ratio))
    v, acc, q = torch.randn(n, d), torch.zeros(n, d), torch.randn(d)
    work = {f"matmul [{n}, {d}] @ {list(w.shape)}": (lambda: x @ w, 2 * n * d * w.shape[1]),
            f"acc += a v, [{n}, {d}]": (lambda: acc.add_(v, alpha=0.5), 2 * n * d),
            f"v @ q, [{n}, {d}]": (lambda: v @ q, 2 * n * d)}
    rates = {}
    for name, (fn, flops) in work.items():
        fn()
        best = float("inf")
        for _ in range(5):  # the fastest of 5 timings of enough calls for ~20 ms
            calls, t0 = 0, args.now()
            while (t := args.now() - t0) < 0.02 or calls < 3:
                fn()
                calls += 1
            best = min(best, t / calls)
        rates[name] = flops / best / 1e9
    return rates


def print_rates(args, results: dict) -> None:
    """Each topology's FLOP rate, and what its extra work over standard runs at against
    what it would need to run at for its goal ratio: a goal that needs the aggregations to
    outpace the machine's in-cache multiply-add, or the standard model's own rate, is out
    of reach of any faster code for that work."""
    flops = {name: train_flops(args, topo) for name, (topo, _) in topologies(args).items()}
    print(f"\nFLOP rates: training FLOPs a step from the IR ({TRAIN_PER_FORWARD} x forward, "
          "the key norm counted once a source), at the median step")
    threads = torch.get_num_threads()
    who = "this thread" if threads == 1 else f"{threads} threads"
    print(f"  {who}: " + "; ".join(f"{k} {r:.1f} GFLOP/s"
                                   for k, r in machine_rates(args).items()))
    # rows indented: a reader (or a test) taking rows that start with a mode takes the table
    print(f"  {'mode':12} {'topology':12} {'GFLOP':>7} {'GFLOP/s':>8} {'extra GFLOP':>12} "
          f"{'extra ms':>9} {'extra GFLOP/s':>14} {'goal':>5} {'needs GFLOP/s':>14}")
    for mode, res in results.items():
        std = res["standard"]["median"]
        goals = GOALS["eager" if mode == "eager" else "compile"]
        for name, r in res.items():
            extra, ms = flops[name] - flops["standard"], r["median"] - std
            goal = next((v for k, v in goals.items() if name.startswith(k)), None)
            cols = [f"{extra / 1e9:12.4g}", f"{1e3 * ms:9.1f}",
                    f"{extra / ms / 1e9:14.3g}" if ms > 0 else f"{'-':>14}",
                    f"{goal:5.2f}" if goal else f"{'-':>5}",
                    f"{extra / ((goal - 1) * std) / 1e9:14.3g}" if goal else f"{'-':>14}"]
            if name == "standard":
                cols = [f"{'-':>12}", f"{'-':>9}", f"{'-':>14}", f"{'-':>5}", f"{'-':>14}"]
            print(f"  {mode:12} {name:12} {flops[name] / 1e9:7.3f} "
                  f"{flops[name] / r['median'] / 1e9:8.1f} " + " ".join(cols))


def setting(args) -> str:
    return (f"width {args.width}, depth {args.depth} ({2 * args.depth} sublayers), context "
            f"{args.context}, batch {args.batch}, heads {args.heads}, vocab {args.vocab}, "
            f"device {args.device}, aggregation backend {','.join(args.backend)}, "
            f"threads {torch.get_num_threads()}, clock {args.clock}, torch {torch.__version__}")


def first_step(args) -> dict:
    """Seconds of the first step (compilation included) and of the next two, in this
    process, for the Block model compiled as `args.first_step` says."""
    kinds = T.sublayer_kinds(args.depth)
    model = make(args, (T.block_attnres(kinds, blocks=min(args.blocks, args.depth)),
                        args.backend[0]))
    fn, model = compiled(args.first_step, model)
    idx = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    times = []
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        step(fn, idx)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return {"first": times[0], "steady": min(times[1:])}


def compile_times(args, argv) -> int:
    """Whole-model against regional: each first step in a fresh process with an empty
    inductor cache (a warm cache would hide the compilation), alternating, `rounds` times."""
    got = {"compile": [], "regional": []}
    for r in range(args.rounds):
        for mode in got:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, __file__, *argv, "--first-step", mode],
                                     env=env, capture_output=True, text=True, check=True)
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  round {r + 1}/{args.rounds}: {mode} first step "
                  f"{got[mode][-1]['first']:.1f} s", file=sys.stderr)
    print(f"Block AttnRes ({min(args.blocks, args.depth)} blocks), width {args.width}, depth "
          f"{args.depth}, context {args.context}, batch {args.batch}, threads "
          f"{args.threads or torch.get_num_threads()}: first step (compilation included), "
          f"median of {args.rounds} fresh processes each [range]")
    for mode, rows in got.items():
        first = [r["first"] for r in rows]
        steady = statistics.median(r["steady"] for r in rows)
        print(f"  {'whole-model' if mode == 'compile' else 'regional':12} "
              f"{statistics.median(first):7.1f} s [{min(first):.1f}-{max(first):.1f}]   "
              f"then {1e3 * steady:.0f} ms a step")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.first_step:
        print(json.dumps(first_step(args)))
        return 0
    if args.compile_time:
        return compile_times(args, argv)
    models = {name: make(args, topo) for name, topo in topologies(args).items()}
    print(setting(args))
    modes = ([] if args.compile_only else ["eager"]) + ([] if args.no_compile else ["compile"])
    modes += (["regional"] if args.regional else []) + (
        ["regional-all"] if args.regional_all else [])
    if not modes:
        print("--no-compile and --compile-only leave nothing to measure", file=sys.stderr)
        return 2
    # regional compilation changes the modules in place: that mode gets its own (make seeds
    # the weights, so they are the same)
    results = {mode: measure(args, mode, models if not mode.startswith("regional") else
                             {name: make(args, topo) for name, topo in topologies(args).items()})
               for mode in modes}
    print(f"\n{'mode':12} {'topology':12} {'step ms':>9} {'x std':>6} {'median ms':>10} "
          f"{'x std':>6} {'saved MiB':>10} {'x std':>6}   per-round x std: median "
          f"[quartiles] (range), {args.iters} rounds")
    for mode, res in results.items():
        base = res["standard"]
        for name, r in res.items():
            print(f"{mode:12} {name:12} {1e3 * r['step']:9.1f} {r['step'] / base['step']:6.3f} "
                  f"{1e3 * r['median']:10.1f} {r['median'] / base['median']:6.3f} "
                  f"{r['saved'] / 2**20:10.1f} {r['saved'] / base['saved']:6.3f}   "
                  f"{spread(r['ratios'])}")
    if args.device.startswith("cpu"):
        print_rates(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
