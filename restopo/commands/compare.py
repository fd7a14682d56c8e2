"""`restopo compare RUN...`: one table and plots across runs, arms grouped by seed."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..cli import output_error

EXAMPLES = """\
examples:
  restopo compare runs/ablation --baseline standard          a sweep's folder of runs
  restopo compare runs/a-s0 runs/a-s1 runs/b-s0 runs/b-s1 --baseline a --out runs/ab
  restopo compare runs/ablation runs/scaling --baseline standard --scaling
      loss against compute: runs/scaling holds standard at several widths (sweep --vary)
  restopo compare runs/lr --baseline standard
      runs/lr holds standard and block_attnres at two lrs (sweep --vary train.lr=1e-3,3e-3):
      block_attnres-lr1e_3 against standard-lr1e_3, block_attnres-lr3e_3 against standard-lr3e_3

Runs that differ only by seed form an arm (a sweep records it; otherwise the folder name
less a trailing -s<seed>). Writes OUT/results.md (the table, what it shows and does not,
the plots), OUT/results.csv and the PNGs; prints the table.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare runs: a table with intervals over seeds, and plots",
        description="Compare training runs: final and best validation loss per arm (mean and "
                    "spread over seeds), the difference to a baseline with a 95% interval, "
                    "step time, parameters and live values per token.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders, or folders of runs")
    p.add_argument("--baseline", metavar="ARM",
                   help="the arm (or spec name, or a sweep's --vary value such as "
                        "standard) the others are compared with; an arm of another topology "
                        "is compared with this one at its own other --vary values")
    p.add_argument("--out", metavar="DIR",
                   help="where to write results.md, results.csv and the plots (default: the "
                        "single folder given, else ./compare)")
    p.add_argument("--scaling", action="store_true",
                   help="also fit the baseline's loss against compute over its sizes and say "
                        "what compute each other arm's loss is worth")
    p.add_argument("--title", default="restopo compare",
                   help="the heading of results.md (default: restopo compare)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..experiments import report
    from ..experiments.runs import RunError, find_runs
    from ..io import output_folder

    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"restopo compare: error: --out {args.out} is a file; give a folder for "
              f"results.md, results.csv and the plots", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else (Path(args.runs[0]) if len(args.runs) == 1
                                           else Path("compare"))
    why = output_error(str(out), folder=True)
    if why:
        print(f"restopo compare: error: {'--out ' if args.out else ''}{why}", file=sys.stderr)
        return 1
    try:
        runs = find_runs(args.runs)  # the runs first: a missing one is not an output error
        with output_folder(out):  # before the models are built and the runs compared
            arms = report.group(runs)
            report.describe_models(arms)
            baseline = report.pick_baseline(arms, args.baseline)
            report.compare(arms, baseline)
            command = ["restopo", "compare", *args.runs] + \
                (["--baseline", args.baseline] if args.baseline else []) + \
                (["--out", args.out] if args.out else []) + \
                (["--scaling"] if args.scaling else []) + \
                (["--title", args.title] if args.title != "restopo compare" else [])
            paths = report.write_report(arms, baseline, out, command, scaling=args.scaling,
                                        title=args.title)
    except (RunError, ValueError) as e:
        print(f"restopo compare: error: {e}", file=sys.stderr)
        return 1
    print(report.markdown_table(report.COLUMNS, report.rows(arms, baseline)))
    for line in report.reading(arms, baseline):
        print(line)
    names = ", ".join(Path(p).name for k, p in paths.items() if k != "md" and p)
    print(f"\nwrote {paths['md']} (and {names} beside it)", file=sys.stderr)
    return 0
