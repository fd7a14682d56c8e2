"""`restopo export CKPT -o model.safetensors|model.pt|model.py`: ship a trained model."""
from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """\
examples:
  restopo export runs/tiny -o tiny.safetensors     # weights + spec: restopo.load("tiny.safetensors")
  restopo export runs/tiny -o tiny.pt              # the restopo compile -o .pt format
  restopo export runs/tiny -o tiny_model.py        # standalone module, imports only torch
  python -c "import tiny_model, safetensors.torch as st; m = tiny_model.build(); m.load_state_dict(st.load_file('tiny.safetensors'))"

.safetensors holds every weight (a tied LM head too), so load_state_dict is strict anywhere.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="write a trained model as .safetensors, .pt or a standalone .py",
        description="Write the model of a checkpoint (or of any file restopo.load reads) "
                    "in a form to ship: weights with the spec inside, or a standalone "
                    "PyTorch module.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a run folder, checkpoint folder, .pt or .safetensors")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="a path ending in .safetensors, .pt or .py")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists (else refused: it may hold other weights)")
    p.set_defaults(func=run)


def run(args) -> int:
    out = args.output
    kind = os.path.splitext(out)[1]
    if kind not in (".safetensors", ".pt", ".py"):
        print(f"restopo export: error: -o must end in .safetensors, .pt or .py; got {out!r}",
              file=sys.stderr)
        return 2
    from ..io import write_atomic
    from ..cli import load_model, output_error
    from ..saved import LoadError, export
    from .standalone import module_path_error, module_source
    why = output_error(out, args.checkpoint, replace=args.overwrite) or module_path_error(out)
    if why:
        print(f"restopo export: error: {why}", file=sys.stderr)
        return 1
    try:
        model = load_model("export", args.checkpoint)
        if kind == ".py":
            name = os.path.splitext(os.path.basename(out))[0]
            write_atomic(out, module_source(model, name, _source(model), "export"))
        else:
            export(model, out)
    except (LoadError, ValueError, RuntimeError) as e:  # RuntimeError: e.g. no CUDA
        print(f"restopo export: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _source(model) -> str:
    """What a standalone module says it was written from: the run and step of a checkpoint
    (its folder alone was 'ckpt' or 'step_000300'), else the file's name."""
    from pathlib import Path
    from ..train.checkpoint import step_of
    p = Path(model.restopo_source)
    if p.parent.name == "ckpt" and step_of(p) >= 0:
        return f"run {p.parent.parent.resolve().name}, step {step_of(p)}"
    return p.name
