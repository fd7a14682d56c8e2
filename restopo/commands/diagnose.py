"""`restopo diagnose CHECKPOINT`: the paper's diagnostic pictures of a trained model."""
from __future__ import annotations

import argparse
import os
import sys

from ..cli import device_arg, int_range, load_model, noter, output_error

EXAMPLES = """\
examples:
  restopo diagnose runs/tiny                      # latest checkpoint of a run
  restopo diagnose runs/tiny/ckpt/step_000200 -o figures/tiny

Writes magnitude.png (RMS of each sublayer's output v_l and input h_l across depth),
gradients.png (gradient norm per sublayer), depth_attention.png (the weight of every source
at every aggregation point, averaged over tokens), for a multi-stream topology (mHC, HC)
hyper_connections.png (its read, write and mixing weights per sublayer), and diagnose.json
(default folder: RUN/diagnose).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose", help="plot output magnitude, gradients and depth-attention weights",
        description="Measure a trained checkpoint on validation batches and write the "
                    "diagnostic figures of the Attention Residuals paper.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a run folder, its ckpt/ folder, a ckpt/step_NNNNNN folder, or a "
                        "model file restopo export wrote (its run's data is read where the "
                        "run read it, from any folder)")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="where the PNGs go (default RUN/diagnose, or NAME-diagnose beside a "
                        "model file)")
    p.add_argument("--batches", type=int_range(1, 1000), default=4, metavar="N",
                   help="validation batches to average over (default 4)")
    p.add_argument("--batch-size", type=int_range(1, 4096), default=8, metavar="B",
                   help="rows per batch (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", type=device_arg,
                   help="where the model runs (default cpu; there with one thread, as train: "
                        "$OMP_NUM_THREADS sets more)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..train.checkpoint import CheckpointError
    from ..train.data import DataError
    from ..train.diagnose import diagnose
    from ..train.dist import cpu_threads
    from ..worker import stop_if_interrupted

    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"restopo diagnose: error: -o {args.out} is a file, not a folder; choose "
              f"another -o", file=sys.stderr)
        return 1
    why = args.out and output_error(args.out, args.checkpoint, folder=True)
    if why:
        print(f"restopo diagnose: error: {why}", file=sys.stderr)
        return 1
    from ..saved import LoadError
    from ..train.checkpoint import holding_checkpoint
    checkpoint = args.checkpoint
    held = holding_checkpoint(checkpoint)
    if held is not None and checkpoint.endswith(".safetensors"):
        # a checkpoint's own weights file is that checkpoint: figures in RUN/diagnose, not
        # beside the file, inside a folder pruning deletes (a path as relative as given)
        checkpoint = str(held) if os.path.isabs(checkpoint) else os.path.relpath(held)
    stop_if_interrupted()  # imported and checked: the work begins
    try:
        with cpu_threads(None):
            loaded = None
            if os.path.isfile(checkpoint):  # an export: restopo.load reads it
                loaded = load_model("diagnose", checkpoint, backend="eager")
            result = diagnose(checkpoint, args.out, batches=args.batches,
                              batch_size=args.batch_size, device=args.device,
                              say=noter("diagnose"), loaded=loaded)
    except (CheckpointError, DataError, LoadError, ValueError) as e:
        print(f"restopo diagnose: error: {e}", file=sys.stderr)
        return 1
    print(result["step0"])
    print(f"wrote {result['out']}:")
    for name, path in result["paths"].items():
        print(f"  {name:16s}{path}")
    return 0
