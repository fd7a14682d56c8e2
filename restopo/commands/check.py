"""`restopo check FILE...`: parse and check specs, reporting every mistake of every file."""
from __future__ import annotations

import argparse
import sys

from ..cli import SetOverride
from ..words import counted

EXAMPLES = """\
examples:
  restopo check examples/*.restopo
  restopo check my.restopo --set model.depth=12     check with an override applied
  make_spec.py | restopo check -                    check a spec piped in

Prints 'FILE: ok (...)' for each good file and every mistake of every bad one as
FILE:LINE:COL: error: MESSAGE, the line, a caret and a hint. Exit status 1 if any file
has a mistake.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check specs and report every mistake",
        description="Parse and check .restopo specs (syntax, names, ranges, block counts, "
                    "that the topology builds for the model, and that train.data names data "
                    "train can read, looked for where train looks: a path that is there "
                    "and, for one file, neither empty nor binary).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help=".restopo spec files (- reads one from standard input)")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a value in every file, e.g. --set model.width=64 (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only mistakes")
    p.set_defaults(func=run)


def describe(spec) -> str:
    """The one-line summary shown after 'ok'."""
    if spec.model is None:
        return f"residual {spec.residual.name} only; no model section"
    from ..ir.analyses import live_values_per_token
    g = spec.ir()
    L = g.n_sublayers
    n = len(g.blocks)
    parts = [counted(L, "sublayer"), f"topology {spec.residual.name}", counted(n, "block"),
             f"{counted(live_values_per_token(g), 'live value')} per token"]
    wide = min((a.window for a in g.aggregations() if a.window and a.window >= L), default=None)
    if wide is not None:  # allowed (a sweep over depth may reach it), but worth a word
        same = "full_attnres" if spec.residual.form == "named" else "reading 'sublayers'"
        parts.append(f"window {wide} covers all {L} sublayers, up to {L + 1} sources with the "
                     f"embedding: the same as {same}")
    if spec.parallel is not None:
        p = spec.parallel
        if p.pipelined:  # (a section of --set values alone, for --pipeline, cuts nothing)
            parts.append(f"pipeline {p.stages}x{p.virtual} {p.schedule}"
                         + ("" if p.cache else ", uncached"))
        if p.data != "ddp":
            parts.append(f"data parallel {p.data}")
    return ", ".join(parts)


def run(args) -> int:
    from ..cli import file_error
    from ..spec import SpecError, load_spec
    from ..spec.datapath import check_data_path
    bad, shown = 0, set()
    for path in args.files:
        name = "<stdin>" if path == "-" else path  # as errors name it
        try:
            if path == "-":  # piped in: `make_spec.py | restopo check -`
                from ..spec import parse_spec
                from ..spec.files import read_spec_stdin
                spec = parse_spec(read_spec_stdin(name), name, tuple(args.overrides))
            else:
                spec = load_spec(path, overrides=tuple(args.overrides))
            check_data_path(spec)  # where train reads it: nothing there, a binary file
            line = f"{name}: ok ({describe(spec)})"
        except SpecError as e:
            text = e.render()
            if len(args.files) > 1 and str(name) not in text:  # all in --set: which file?
                if text in shown:
                    text = f"{name}: the same mistakes in the --set values as above"
                else:
                    text = f"{name}: mistakes in the --set values, checked with this file:\n" \
                        + text
            shown.add(e.render())
            print(text, file=sys.stderr)
            bad += 1
            continue
        except (OSError, UnicodeDecodeError) as e:
            print(file_error(e), file=sys.stderr)
            bad += 1
            continue
        if not args.quiet:
            print(line)
    if bad and len(args.files) > 1:
        print(f"{bad} of {len(args.files)} files {'has' if bad == 1 else 'have'} mistakes",
              file=sys.stderr)
    return 1 if bad else 0
