"""`restopo eval CKPT [--data FILE|builtin:stdlib]`: loss, bits per byte and perplexity."""
from __future__ import annotations

import argparse
import json
import sys

from ..cli import at_least, device_arg
from ..words import counted

EXAMPLES = """\
examples:
  restopo eval runs/tiny                          # the run's held-out split (its train.data)
  restopo eval runs/tiny --data builtin:stdlib    # the standard library's held-out files
  restopo eval runs/tiny --data notes.txt         # all of your own text
  restopo eval model.safetensors --data notes.txt --split val --format json

Every token of the split is predicted once, with up to `context` tokens before it from its
own file (--split all of train.bin and val.bin reads no window across the two). Bits per
byte is the loss in bits for byte-level data (vocab 256); for token-id data (.bin) it is
bits per token.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="loss, bits per byte and perplexity of a trained model on text",
        description="Score a trained model on a corpus: the mean loss over every token of "
                    "its held-out split (or of a file of your own), bits per byte and "
                    "perplexity.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a run folder, checkpoint folder, .pt or .safetensors")
    p.add_argument("--data", metavar="SOURCE", type=_data_source,
                   help="builtin:stdlib, a text file or folder, or .bin token ids (default: "
                        "the checkpoint's train.data)")
    p.add_argument("--split", choices=("val", "train", "all"), default=None,
                   help="which part to score (default: all of a --data text file or folder, "
                        "else the held-out split, val)")
    p.add_argument("--batch-size", type=at_least(1), default=16, metavar="B",
                   help="windows per forward pass (default 16)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text (one figure a line, default) or json")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", type=device_arg,
                   help="where the model runs (default cpu; there with one thread, as train: "
                        "$OMP_NUM_THREADS sets more)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _data_source(text: str) -> str:
    """--data: a blank one is a usage error naming the flag (open_corpus's own message names
    train.data, which this command does not read then)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty; give builtin:stdlib, a text "
                                         "file or folder, or .bin token ids")
    return text


def _fail(message: str) -> int:
    print(f"restopo eval: error: {message}", file=sys.stderr)
    return 1


def _kind_mismatch(spec, corpus, source: str) -> str | None:
    """Why `corpus` (from --data `source`) cannot score this model: byte text for a model
    trained on token ids, or token ids for one trained on bytes (ids below the vocab would
    score, meaninglessly: the same number means another symbol). None when they agree or
    the run's data is gone."""
    from ..train.data import trained_on
    trained = trained_on(spec)
    given = "bytes" if corpus.byte_level else "ids"
    if trained is None or trained == given:
        return None
    name = {"bytes": "byte-level text", "ids": "token ids (.bin)"}
    return (f"--data {source} is {name[given]}, but this model was trained on "
            f"{name[trained]} ({spec.train.data}); an id means another symbol in each, so "
            f"the score would mean nothing: give --data of the kind it was trained on")


def run(args) -> int:
    from ..train.dist import cpu_threads
    with cpu_threads(None):  # torch's default, every core, ran many times slower shared
        return _score(args)


def _score(args) -> int:
    from ..cli import load_model
    from ..saved import LoadError
    from ..train.data import DataError, open_corpus
    from ..train.score import score, scored_tokens
    try:
        model = load_model("eval", args.checkpoint, device=args.device)
        spec = model.restopo_spec
        source = args.data
        if source is None:
            if spec.train is None:
                return _fail("the checkpoint's spec has no train.data; give --data")
            source = spec.train.data
        from ..spec.datapath import data_base
        base = None
        if args.data is None:  # the run's data, read from where the run read it
            base = data_base(spec)
        try:
            corpus = open_corpus(source, base_dir=base, progress=not args.no_progress)
        except DataError as e:
            if args.data is None and e.missing:
                return _fail(f"{e} (the run's train.data; if it has moved since the run "
                             f"trained, give its new place with --data PATH)")
            raise
        # all of a text file or folder of the user's own (--data); else the held-out split:
        # token ids (a .bin, any case, or a folder of train.bin and val.bin) have a train
        # split the model may have trained on, as builtin:stdlib has
        own_text = corpus.byte_level and not str(source).strip().startswith("builtin:")
        split = args.split or ("all" if args.data is not None and own_text else "val")
        mismatch = _kind_mismatch(spec, corpus, source) if args.data is not None else None
        if mismatch:
            return _fail(mismatch)
        if corpus.vocab > spec.model.vocab:
            return _fail(f"{corpus.description} has token ids up to {corpus.vocab - 1}, past "
                         f"the model's vocab {spec.model.vocab}")
        parts = corpus.parts(split)
        if not scored_tokens(parts):  # score's own error would not say which split, or what to do
            tokens = counted(sum(map(len, parts)), "token")
            return _fail(f"the {split} split of {corpus.description} is too short to score "
                         f"({tokens}; it takes 2 or more in a row); "
                         + ("give more data" if split == "all" else
                            "score all of it with --split all, or give more data"))
        result = score(model, parts, spec.model.context, args.batch_size,
                       device=args.device, progress=not args.no_progress)
    except (LoadError, DataError, ValueError, RuntimeError) as e:
        return _fail(str(e))
    result.update(data=source, split=split, byte_level=bool(corpus.byte_level),
                  checkpoint=str(model.restopo_source))
    if args.format == "json":
        print(json.dumps(result, indent=1))
        return 0
    unit = "bits per byte" if corpus.byte_level else "bits per token"
    print(f"{result['checkpoint']} on {corpus.description} ({split} split, "
          f"{counted(result['tokens'], 'token')})")
    print(f"{'loss':<16}{result['loss']:.4f} nats/token")
    print(f"{unit:<16}{result['bits_per_token']:.4f}")
    print(f"{'perplexity':<16}{result['perplexity']:.3f}")
    return 0
