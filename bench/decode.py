"""Per-token decode latency of Full and Block AttnRes against the standard residual.

Each topology gets the same model dimensions (the aggregation parameters, a few d-vectors,
are the only difference in weights) and a KV-cached decoder (restopo.decode). A round
prefills a `--prompt`-token prompt (untimed), then decodes `--new` tokens greedily; the
topologies take turns every `--turn` tokens (default every token; the order rotating), so
drift and other processes on the machine hit them alike. Turns of one token measure each
step just after three other models' steps: on the CPU their weights (150 MB each at the
default size, four models past a 480 MB last-level cache) have then pushed this model's
weights and its Python objects out of the cache, which one model decoding alone never
sees; `--turn 16` measures that steady state, still interleaved. Per topology, the
per-token latency is a round's decode time over `--new`; the fastest round is reported
(other load only ever adds time) with the median beside it, each also as a ratio to the
standard residual; and each round's own ratio (the models interleaved within it), its
median and range over the rounds. Modes: eager, and torch.compile of the one-token step
(fixed shapes: the cache attended over its full, masked length).

The standard model is also built a second time (`standard'`, the same weights in other
memory) and timed like the others: its ratio to the first is this run's noise floor. On a
shared CPU two such twins came out up to 5% apart at batch 1, more than the difference a
goal of 1.02 asks to see; a ratio within the twin's distance of 1 is not resolved. The
twin bounds the noise within one run only: from one run to the next (the same code, the
same machine) a ratio has moved by several times that distance, so compare runs by the
per-round ratios' range, and a goal near a figure by several runs.

    python bench/decode.py                    # width 512, depth 12, batch 1 and 16, CPU
    python bench/decode.py --quick            # a CI-size smoke run
    python bench/decode.py --batch 1 --no-compile --rounds 5
    python bench/decode.py --batch 1 --no-compile --turn 16   # each model's steady state
    python bench/decode.py --count-ops --backend eager   # torch ops per one-token eager step
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from restopo import topology as T
from restopo.api import build_model
from restopo.decode import Decoder


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=12, help="transformer layers")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8, help="N of Block AttnRes")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefilled)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds")
    p.add_argument("--turn", type=int, default=1,
                   help="tokens a topology decodes before the next takes its turn (1: every "
                        "token, the closest interleaving; on the CPU each model's step then "
                        "starts with its weights and code pushed out of the last-level cache "
                        "by the others', which one model decoding alone does not see: try 16)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (compilation)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=("auto", "eager", "cpu", "triton"),
                   help="aggregation kernels (auto: the fused C kernels on the CPU where they "
                        "build, triton on CUDA; eager: plain torch, the reference)")
    p.add_argument("--no-compile", action="store_true", help="eager mode only")
    p.add_argument("--compile-only", action="store_true", help="torch.compile mode only")
    p.add_argument("--count-ops", action="store_true",
                   help="count the torch ops one eager one-token step dispatches, per "
                        "topology, instead of timing (with --backend eager, the same on every "
                        "machine; the cpu backend's kernels dispatch none)")
    p.add_argument("--no-twin", action="store_true",
                   help="leave out the standard model's twin (the noise floor)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: width 64, depth 4, batch 1 and 2, 8 + 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.heads, args.blocks = 64, 4, 4, 2
        args.batch, args.prompt, args.new, args.rounds = [1, 2], 8, 8, 1
    args.twin = not args.no_twin
    return args


TWIN = "standard'"  # the standard model built again: the noise floor


def models(args) -> dict:
    kinds = T.sublayer_kinds(args.depth)
    blocks = min(args.blocks, args.depth)
    topologies = {"standard": T.standard(kinds), "full": T.full_attnres(kinds),
                  f"block{blocks}": T.block_attnres(kinds, blocks=blocks)}
    if args.twin:
        topologies[TWIN] = topologies["standard"]
    cfg = SimpleNamespace(vocab=args.vocab, width=args.width, depth=args.depth,
                          heads=args.heads, mlp="swiglu", mlp_ratio=4,
                          context=args.prompt + args.new)
    out = {}
    for name, topo in topologies.items():
        torch.manual_seed(0)  # the same sublayer weights for every topology
        model = build_model(cfg, topo, backend=args.backend).to(args.device).eval()
        with torch.no_grad():  # trained-looking queries: non-uniform depth weights
            for a in model.aggregations:
                if hasattr(a, "pseudo_query"):
                    a.pseudo_query.normal_(0, 0.05)
        out[name] = model
    return out


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measure(args, mode: str, models: dict, batch: int) -> dict:
    """Per-token decode seconds of each topology, one list entry per timed round."""
    length = args.prompt + args.new
    decoders = {name: Decoder(m, batch, length, compile=mode == "compile")
                for name, m in models.items()}
    prompt = torch.randint(0, args.vocab, (batch, args.prompt), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(1))
    names = list(decoders)
    per_token = {name: [] for name in names}
    for r in range(args.warmup + args.rounds):
        tokens, spent = {}, {name: 0.0 for name in names}
        for name in names:
            decoders[name].reset()
            tokens[name] = decoders[name](prompt).argmax(-1, keepdim=True)
        for turn, t in enumerate(range(0, args.new - 1, args.turn)):
            k = turn % len(names)
            for name in names[k:] + names[:k]:  # every topology once a turn, rotating
                for _ in range(min(args.turn, args.new - 1 - t)):
                    sync(args.device)
                    t0 = time.perf_counter()
                    logits = decoders[name](tokens[name])
                    sync(args.device)
                    spent[name] += time.perf_counter() - t0
                    tokens[name] = logits.argmax(-1, keepdim=True)
        if r >= args.warmup:
            for name in names:
                per_token[name].append(spent[name] / (args.new - 1))
        print(f"  batch {batch} {mode}: round {r + 1}/{args.warmup + args.rounds}",
              file=sys.stderr)
    return per_token


def count_ops(args, models: dict, batch: int) -> dict:
    """Per topology: a Counter of the aten ops one eager one-token step dispatches."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for name, model in models.items():
        if name == TWIN:  # the same ops as standard's
            continue
        decoder = Decoder(model, batch, args.prompt + 1)
        prompt = torch.zeros(batch, args.prompt, dtype=torch.long, device=args.device)
        token = decoder(prompt).argmax(-1, keepdim=True)
        with Count() as count:
            decoder(token)
        out[name] = count.ops
    return out


def print_op_counts(args, ms: dict) -> None:
    for batch in args.batch:
        counts = count_ops(args, ms, batch)
        base = counts["standard"]
        print(f"\nbatch {batch}: torch ops per eager one-token step")
        for name, ops in counts.items():
            extra = ops - base
            top = ", ".join(f"{op} {n}" for op, n in extra.most_common(6))
            print(f"  {name:10} {sum(ops.values()):6d}  beyond standard "
                  f"{sum(extra.values()):5d}" + (f"  ({top}, ...)" if top else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = ([] if args.compile_only else ["eager"]) + ([] if args.no_compile else ["compile"])
    if not modes:
        print("--no-compile and --compile-only leave nothing to measure", file=sys.stderr)
        return 2
    ms = models(args)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in ms.items()}
    print(f"width {args.width}, depth {args.depth} ({2 * args.depth} sublayers), heads "
          f"{args.heads}, vocab {args.vocab}, prompt {args.prompt}, new {args.new}, "
          f"device {args.device}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("parameters: " + ", ".join(f"{n} {p:,}" for n, p in params.items()))
    if args.count_ops:
        with torch.no_grad():
            print_op_counts(args, ms)
        return 0
    rows = []
    with torch.no_grad():
        for batch in args.batch:
            for mode in modes:
                rows.append((batch, mode, measure(args, mode, ms, batch)))
    print(f"\n{'batch':>5} {'mode':8} {'topology':10} {'ms/token':>9} {'x std':>6} "
          f"{'median':>9} {'x std':>6}   {'per round: x std, median [min-max]'}")
    floor = []  # the twin's distance from standard, best and median of each row group
    for batch, mode, res in rows:
        best = {n: min(v) for n, v in res.items()}
        median = {n: statistics.median(v) for n, v in res.items()}
        if TWIN in res:
            floor += [abs(stat[TWIN] / stat["standard"] - 1) for stat in (best, median)]
        for name in res:
            # each round's ratio (the topologies interleaved within it): drift between
            # rounds cancels out, and their spread says how far one figure can be trusted
            rounds = [t / s for t, s in zip(res[name], res["standard"])]
            print(f"{batch:5d} {mode:8} {name:10} {1e3 * best[name]:9.3f} "
                  f"{best[name] / best['standard']:6.3f} {1e3 * median[name]:9.3f} "
                  f"{median[name] / median['standard']:6.3f}   "
                  f"{statistics.median(rounds):.3f} [{min(rounds):.3f}-{max(rounds):.3f}]")
    if floor:
        print(f"noise floor: {TWIN} (standard built again, the same weights) is up to "
              f"{max(floor):.3f} from 1.000 in this run; a ratio closer to 1 than that is "
              f"not resolved")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
