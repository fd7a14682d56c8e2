"""Time to parse, check and build the IR of a 128-sublayer Full AttnRes spec.

    python bench/parse.py [--sublayers 128] [--runs 15]

Prints the median of several runs of each stage (not a test: the figure is for people).
The grammar is compiled once per process, before the timed runs; that cost is printed too.
"""
from __future__ import annotations

import argparse
import statistics
import time


def spec_text(sublayers: int) -> str:
    return (f"model bench {{ vocab: 256; width: 256; depth: {sublayers // 2}; heads: 4; "
            f"context: 256 }}\nresidual full_attnres\n")


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sublayers", type=int, default=128)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()

    t0 = time.perf_counter()
    from restopo.ir import summary
    from restopo.spec import parse_spec
    from restopo.spec.parse import parser
    parser()
    grammar_ms = 1000 * (time.perf_counter() - t0)

    text = spec_text(args.sublayers)
    spec = parse_spec(text)
    parse_ms = median_ms(lambda: parse_spec(text), args.runs)
    ir_ms = median_ms(lambda: spec.ir(), args.runs)
    both_ms = median_ms(lambda: parse_spec(text).ir(), args.runs)
    g = spec.ir()
    s = summary(g)
    print(f"Full AttnRes, {s['sublayers']} sublayers: IR with {g.number_of_nodes()} nodes, "
          f"{g.number_of_edges()} edges, {s['live_values_per_token']} live values per token")
    print(f"  import + grammar compile (once) {grammar_ms:8.1f} ms")
    print(f"  parse + check                   {parse_ms:8.1f} ms  (median of {args.runs})")
    print(f"  build IR                        {ir_ms:8.1f} ms  (median of {args.runs})")
    print(f"  parse + check + build IR        {both_ms:8.1f} ms  (median of {args.runs})")


if __name__ == "__main__":
    main()
