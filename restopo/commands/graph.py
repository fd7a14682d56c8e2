"""`restopo graph FILE -o OUT`: a picture of the wiring, drawn from the IR.

OUT.dot is Graphviz text (restopo.draw.dot: a cluster per block, the head last). For
.png/.svg the `dot` program renders it when installed; otherwise matplotlib draws the same
graph with a layered layout (restopo.draw.layout), so a picture always comes out. The output
appears whole or not at all (written to a temporary file, then renamed).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess

from ..cli import SetOverride, output_error
from ..io import write_atomic
from ..words import alts

EXAMPLES = """\
examples:
  restopo graph examples/block_attnres.restopo -o block.png
  restopo graph examples/full_window8.restopo -o window.svg
  restopo graph examples/tiny.restopo -o tiny.dot        Graphviz source
  dot -Tpdf tiny.dot -o tiny.pdf                          render it yourself

Boxes are values (the embedding, sublayer outputs, block and partial sums), ellipses are
aggregation points; an edge from a value to an aggregation means the aggregation reads it.
"""

FORMATS = (".dot", ".gv", ".png", ".svg")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "graph", help="draw the wiring as DOT, PNG or SVG",
        description="Draw which values each aggregation point reads, grouped by block.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a .restopo spec")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="output file: .dot/.gv (Graphviz text), .png or .svg")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set residual.blocks=4 (repeatable)")
    p.add_argument("--engine", choices=("auto", "graphviz", "matplotlib"), default="auto",
                   help="how to draw .png/.svg (default: graphviz when `dot` is installed)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from ..draw.dot import to_dot
    from ..draw.layout import draw_matplotlib
    from ..spec import load_spec
    suffix = os.path.splitext(args.output)[1].lower()
    if suffix not in FORMATS:
        print(f"restopo graph: error: -o must end in {alts(FORMATS)}; got {args.output!r}",
              file=sys.stderr)
        return 2
    if suffix in (".dot", ".gv") and args.engine != "auto":
        print(f"restopo graph: error: --engine {args.engine} draws .png and .svg; "
              f"{args.output!r} is Graphviz text, written without drawing: leave --engine out "
              f"(or write a .png or .svg)", file=sys.stderr)
        return 2
    why = output_error(args.output, args.file)
    if why:
        print(f"restopo graph: error: {why}", file=sys.stderr)
        return 1
    spec = load_spec(args.file, overrides=tuple(args.overrides))
    g = spec.ir()
    title = f"{os.path.basename(spec.path)}: {g.topology}"
    dot = to_dot(g, title)
    engine = args.engine
    if engine == "graphviz" and shutil.which("dot") is None:
        print("restopo graph: error: --engine graphviz needs the `dot` program (Graphviz); "
              "install it or use --engine matplotlib", file=sys.stderr)
        return 1
    if suffix in (".dot", ".gv"):
        write_atomic(args.output, dot)
    elif engine != "matplotlib" and shutil.which("dot"):
        try:
            write_atomic(args.output, lambda tmp: _render_dot(dot, suffix[1:], tmp))
        except (OSError, subprocess.SubprocessError) as e:
            if engine == "graphviz":
                print(f"restopo graph: error: dot failed: {_dot_message(e)}", file=sys.stderr)
                return 1
            print(f"restopo graph: dot failed ({_dot_message(e)}); drawing with matplotlib",
                  file=sys.stderr)
            write_atomic(args.output, lambda tmp: draw_matplotlib(g, title, tmp, suffix[1:]))
    else:
        write_atomic(args.output, lambda tmp: draw_matplotlib(g, title, tmp, suffix[1:]))
    print(f"wrote {args.output}")
    return 0


def _dot_message(e: Exception) -> str:
    err = getattr(e, "stderr", None)
    text = err.decode(errors="replace").strip() if isinstance(err, bytes) else str(e)
    return text.splitlines()[-1] if text else type(e).__name__


def _render_dot(dot: str, fmt: str, out: str) -> None:
    subprocess.run(["dot", f"-T{fmt}", "-o", out], input=dot.encode(), check=True,
                   capture_output=True, timeout=120)
