"""`restopo generate CKPT --prompt TEXT`: sample from a trained model, streaming to stdout."""
from __future__ import annotations

import argparse
import codecs
import sys

from ..cli import at_least, bounded, device_arg, finite_float, int_range

EXAMPLES = """\
examples:
  restopo generate runs/tiny --prompt "def main(" --max-new-tokens 200
  restopo generate runs/tiny/ckpt/step_000600 --prompt "import " --temperature 0   # greedy
  restopo generate model.safetensors --prompt "class " --top-k 40 --top-p 0.9 --seed 1
  restopo generate runs/tiny --prompt "def " --max-new-tokens 2000 --compile

CKPT is anything restopo.load reads: a run folder (its latest checkpoint), a ckpt/ or
ckpt/step_NNNNNN folder, a .pt from restopo compile / export, or an exported .safetensors.
A model trained on text (bytes) reads the prompt as UTF-8 and prints its bytes as they come
(invalid UTF-8 shows as U+FFFD); one trained on token ids (.bin) takes --prompt-ids and
prints token ids (with its data gone: bytes at vocab 256, else ids).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="sample text from a trained model (KV-cached decoding)",
        description="Load a trained model and continue a prompt, one token at a time with "
                    "per-sublayer KV caches, printing each token as it comes.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a run folder, checkpoint folder, .pt or .safetensors")
    prompt = p.add_mutually_exclusive_group()  # one prompt: text, or token ids
    prompt.add_argument("--prompt", default="\n", metavar="TEXT",
                        help="the text to continue (default: a newline)")
    prompt.add_argument("--prompt-ids", metavar="IDS",
                        help="the prompt as token ids, e.g. '5 17 3' (for a vocab other than "
                             "bytes)")
    p.add_argument("--max-new-tokens", type=at_least(0), default=200, metavar="N",
                   help="tokens to generate (default 200; past the model's context the "
                        "window slides, keeping the last context/2 tokens)")
    p.add_argument("--temperature", default=0.8, metavar="T",
                   type=bounded(finite_float, lambda t: t >= 0, "0 (greedy) or more"),
                   help="sampling temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=at_least(1), default=None, metavar="K",
                   help="sample among the K likeliest tokens only")
    p.add_argument("--top-p", default=None, metavar="P",
                   type=bounded(finite_float, lambda q: 0 < q <= 1, "above 0 and at most 1"),
                   help="sample among the likeliest tokens holding probability P")
    p.add_argument("--seed", type=int_range(-2 ** 63, 2 ** 64 - 1, "a 64-bit seed"),
                   default=None, help="make the sampling repeatable")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", type=device_arg,
                   help="where the model runs (default cpu; there with one thread, as train: "
                        "$OMP_NUM_THREADS sets more)")
    p.add_argument("--compile", action="store_true",
                   help="run the one-token steps through torch.compile: the first new token "
                        "waits for the compile (about a minute on a CPU), the rest come "
                        "faster; worth it for long generations (bench/decode.py)")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"restopo generate: error: {message}", file=sys.stderr)
    return 1


def prompt_tokens(args, vocab: int, kind: str | None = None):
    """The prompt's token ids: UTF-8 bytes for a model that reads bytes (reads_bytes; `kind`
    is what it trained on), else --prompt-ids."""
    from ..train.data import reads_bytes
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--prompt-ids takes integers separated by spaces; got "
                             f"{args.prompt_ids!r}") from None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"--prompt-ids: token {bad[0]} is outside the vocab 0..{vocab - 1}")
    elif reads_bytes(vocab, kind):
        # the bytes as typed: a command line that is not UTF-8 reaches Python as surrogate
        # escapes (os.fsdecode), which this turns back into its own bytes
        ids = list(args.prompt.encode("utf-8", "surrogateescape"))
    else:
        why = ("it was trained on token ids (.bin)" if kind == "ids" else
               f"the model's vocab is {vocab}, not bytes (256)")
        raise ValueError(f"{why}: give the prompt as token ids with --prompt-ids")
    if not ids:
        raise ValueError("the prompt is empty; give at least one character (or token id)")
    return ids


def run(args) -> int:
    from ..train.dist import cpu_threads
    with cpu_threads(None):  # torch's default, every core, ran many times slower shared
        return _generate(args)


def _generate(args) -> int:
    import torch

    from ..decode import stream
    from ..cli import load_model
    from ..saved import LoadError
    from ..train.data import reads_bytes, trained_on
    try:
        model = load_model("generate", args.checkpoint, device=args.device)
        vocab, kind = model.embed.num_embeddings, trained_on(model.restopo_spec)
        ids = prompt_tokens(args, vocab, kind)
        idx = torch.tensor([ids], dtype=torch.long, device=args.device)
        if args.compile and args.max_new_tokens > 1:
            print("restopo generate: compiling the one-token step (once, before the second "
                  "new token)", file=sys.stderr)
        tokens = stream(model, idx, args.max_new_tokens, args.temperature, args.top_k,
                        args.top_p, args.seed, compile=args.compile)
        write = _byte_writer() if reads_bytes(vocab, kind) else _id_writer()
        for token in tokens:
            write(int(token[0]))
        write(None)
    except (LoadError, ValueError, RuntimeError) as e:  # RuntimeError: e.g. no CUDA
        return _fail(str(e))
    return 0


def _byte_writer():
    """Print bytes as UTF-8 as soon as they form characters (replacement for bad ones, and
    for an id past 255, no byte, which a vocab above 256 can draw)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(byte):
        if byte is not None and byte > 255:
            text = decoder.decode(b"", final=True) + "\ufffd"
        else:
            text = decoder.decode(b"" if byte is None else bytes([byte]), final=byte is None)
        if byte is None:
            text += "\n"
        sys.stdout.write(text)
        sys.stdout.flush()
    return write


def _id_writer():
    def write(token):
        sys.stdout.write("\n" if token is None else f"{token} ")
        sys.stdout.flush()
    return write
