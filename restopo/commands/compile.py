"""`restopo compile FILE -o model.py|model.pt`: write the compiled model out.

model.py  a standalone Python module that imports only torch (restopo.commands.standalone):
          the sublayers, aggregation modules and eager kernels, and the generated forward;
          the .pt weights load into its build() with strict=True.
model.pt  {"spec": text, "overrides": [...], "data_base": folder, "state_dict": ...,
          "restopo.weights_sha256": hex}
          (restopo.saved.export), loadable with torch.load(weights_only=True);
          restopo.compile(spec, overrides=...) then load_state_dict rebuilds the model, and
          restopo.load reads a relative train.data from data_base.
Both are written atomically (restopo.io).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..cli import SetOverride, output_error

EXAMPLES = """\
examples:
  restopo compile examples/tiny.restopo -o tiny_model.py      # standalone module (torch only)
  restopo compile examples/tiny.restopo -o tiny.pt            # the spec and fresh weights
  restopo compile examples/tiny.restopo -o wide.pt --set model.width=128
  python -c "import torch, tiny_model; m = tiny_model.build(); m.load_state_dict(torch.load('tiny.pt')['state_dict']); print(m)"
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="compile a spec to a Python module (.py) or a checkpoint (.pt)",
        description="Compile the model a .restopo spec describes and write it out: a "
                    "standalone Python module (-o NAME.py) or the spec and fresh weights "
                    "(-o NAME.pt).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="FILE", help="the .restopo file")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="where to write: a path ending in .py or .pt")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (else refused: it may hold trained weights "
                        "or a module of one's own)")
    p.add_argument("--backend", choices=("auto", "eager", "triton", "cpu"), default="auto",
                   help="aggregation kernels to build the model with here, which checks that "
                        "they build (default: triton on CUDA when available, else the fused "
                        "C kernels on the CPU). What is written does not depend on it: a .py "
                        "holds the eager forms, and a .pt's loader picks its own backend")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set model.width=64 (repeatable)")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"restopo compile: error: {message}", file=sys.stderr)
    return 1


def run(args) -> int:
    out = args.output
    kind = os.path.splitext(out)[1]
    if kind not in (".py", ".pt"):
        print(f"restopo compile: error: -o must end in .py or .pt; got {out!r}",
              file=sys.stderr)
        return 2
    from .standalone import module_path_error
    why = output_error(out, args.spec, replace=args.overwrite) or module_path_error(out)
    if why:
        return _fail(why)
    from ..spec import load_spec  # SpecError and OSError (which file, why) go to the CLI
    spec = load_spec(args.spec, overrides=tuple(args.overrides))
    import torch
    from .. import api
    from ..io import write_atomic
    from ..worker import stop_if_interrupted
    stop_if_interrupted()  # imported and checked: the work begins
    torch.manual_seed(spec.train.seed if spec.train is not None else 0)
    try:
        model = api.compile(spec, backend=args.backend)
    except (ValueError, RuntimeError) as e:
        return _fail(str(e))
    if kind == ".pt":
        from ..saved import LoadError, export
        try:
            export(model, out)  # the spec, its overrides and data folder, and the weights
        except LoadError as e:
            return _fail(str(e))
    else:
        from .standalone import module_source
        name = os.path.splitext(os.path.basename(out))[0]
        try:
            text = module_source(model, name, os.path.basename(args.spec))
        except ValueError as e:
            return _fail(str(e))
        write_atomic(out, text)
    print(f"wrote {out}", file=sys.stderr)
    return 0
