"""The `restopo` command line: the root parser and the one place user mistakes are printed.

Each subcommand is a module restopo/commands/<name>.py with `register(subparsers)`, which
adds its parser and sets `func=run` (run(args) -> exit code). Exit codes: 0 ok, 1 a mistake
in a spec or an input file (SpecError, missing/unreadable file), 2 a usage error, 130 Ctrl-C.
A user mistake never shows a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import warnings

from . import __version__
from .spec.errors import SpecError
from .spec.overrides import SetOverride  # noqa: F401  (the commands' --set, from here)

COMMANDS = ("check", "inspect", "graph", "compile", "train", "diagnose", "generate", "eval",
            "export", "sweep", "compare")

EXAMPLES = """\
examples:
  restopo check examples/*.restopo              check specs, report every mistake
  restopo inspect examples/block_attnres.restopo  the aggregation points and their sources
  restopo inspect examples/tiny.restopo --format json --set model.depth=8
  restopo graph examples/block_attnres.restopo -o wiring.png
  restopo train examples/tiny.restopo            train the spec's model on CPU or GPU

A spec is a .restopo file: a model section, a residual topology (standard, full_attnres,
block_attnres(blocks: N), ... or custom wiring) and optional parallel and train sections.
`restopo COMMAND --help` shows each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="restopo",
        description="restopo: a language and compiler for the residual topologies of "
                    "transformers (standard residual, Attention Residuals, Block AttnRes, ...).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"restopo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"{__package__}.commands.{name}")
        except ImportError as e:  # a missing optional dependency disables one command only
            _unavailable(sub, name, e)
            continue
        module.register(sub)
    parser.set_defaults(command_parsers=sub.choices)  # main: a command's own usage errors
    return parser


def _unavailable(sub, name: str, error: ImportError) -> None:
    p = sub.add_parser(name, help=f"(unavailable: {error})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def run(args) -> int:
        print(f"restopo {name}: unavailable here: {error}", file=sys.stderr)
        return 1

    p.set_defaults(func=run)


def int_range(lo: int, hi: int, why: str = ""):
    """An argparse `type` for a whole number in lo..hi: a flag outside the range is a usage
    error naming the bound (and why it is there), not a crash deep inside a run."""
    return bounded(int, lambda n: lo <= n <= hi, f"from {lo} to {hi}", why)


def at_least(low: int):
    """An argparse `type`: a whole number of at least `low`."""
    return bounded(int, lambda n: n >= low, f"at least {low}")


def bounded(kind, holds, said: str, why: str = ""):
    """An argparse `type`: `kind` of the text, refused as a usage error naming the flag
    unless `holds` (a check after parsing named the flag only where it remembered to)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {said}, got {text}"
                                             + (f" ({why})" if why else ""))
        return value
    # what argparse calls the type in its own messages
    parse.__name__ = "whole number" if kind is int else getattr(kind, "__name__", "value")
    return parse


def finite_float(text: str) -> float:
    """An argparse `type` for a real number flag: nan and inf are usage errors naming the
    flag, not a failure deep inside sampling."""
    import math
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def device_arg(text: str) -> str:
    """An argparse `type` for --device: cuda where torch sees no CUDA device is a usage
    error that says what to give instead, not a failure deep in loading a checkpoint."""
    if text == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("torch sees no CUDA device here; use --device cpu")
    return text


def output_error(out: str, *inputs: str, folder: bool = False,
                 replace: bool = True) -> str | None:
    """Why a command must not write its output to `out` (None: it may): `out` is one of
    the command's own input files (the spec, the model being exported), a write-protected
    file (the atomic rename would replace it regardless), lies in a checkpoint, whose
    manifest then no longer matches and which later loads pass over as damaged, or in a
    run's checkpoint folder, which its saves prune and its --overwrite deletes, or is a file
    already there and `replace` is False (compile and export without --overwrite: what they
    write may land where trained weights, or a module of one's own, were). A file's
    folder that cannot take it is said too, before the work rather than after it (`folder`:
    `out` is a folder the command makes, parents and all: io.output_folder's to check)."""
    from .io import beside_error
    from .train.checkpoint import holding_checkpoint, holding_checkpoints

    for given in inputs:
        try:
            if os.path.exists(given) and os.path.samefile(out, given):
                return f"{out} is this command's input; write the output to another path"
        except OSError:
            continue
    if os.path.isfile(out) and not os.access(out, os.W_OK):
        return f"{out} is write-protected; remove it or write the output to another path"
    def given(p):  # a folder `out` is in, as relative as `out` was given
        return p if os.path.isabs(out) else os.path.relpath(p)

    held = holding_checkpoint(out)
    if held is not None:
        return (f"{out} is inside the checkpoint {given(held)}, which restopo writes only "
                f"when saving; write the output outside it")
    held = holding_checkpoints(out)
    if held is not None:
        where = ("is" if os.path.abspath(out) == str(held) else f"is inside {given(held)},")
        return (f"{out} {where} the checkpoint folder of the run {given(held.parent)}, "
                f"whose saves prune it and whose --overwrite deletes it whole; write the "
                f"output outside it")
    if not replace and os.path.isfile(out):
        return (f"{out} already exists; write the output to another path, or give --overwrite "
                f"to replace it")
    e = None if folder else beside_error(out)
    return f"{out}: {e.strerror}" if e is not None else None


def noter(command: str):
    """A `say` for library calls made by `restopo COMMAND`: each line a note on stderr."""
    return lambda line: print(f"restopo {command}: note: {line}", file=sys.stderr)


def load_model(command: str, path: str, **kw):
    """restopo.load(path, **kw) for `restopo COMMAND`: each newer checkpoint passed over as
    damaged is a note on stderr, followed by the one the weights came from, so a command
    never answers for older weights than asked without saying so."""
    from .saved import load

    notes = []
    note = noter(command)

    def say(line: str) -> None:
        notes.append(line)
        note(line)

    model = load(path, say=say, **kw)
    from .worker import stop_if_interrupted
    stop_if_interrupted()  # the model is loaded: the command's work begins
    if notes:
        print(f"restopo {command}: note: using {model.restopo_source}", file=sys.stderr)
    return model


def file_error(e: OSError | UnicodeDecodeError) -> str:
    """One line for a file that cannot be read."""
    if isinstance(e, UnicodeDecodeError):
        where = getattr(e, "restopo_path", None) or "input"
        data = e.object if isinstance(e.object, bytes) else b""
        line = data.count(b"\n", 0, e.start) + 1  # where an editor shows the bad byte
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        return (f"restopo: error: {where}:{line}:{col}: not UTF-8 text (byte "
                f"0x{data[e.start]:02x}); is this a .restopo file? save it as UTF-8"
                if e.start < len(data) else
                f"restopo: error: {where}: not UTF-8 text (byte {e.start}); is this a "
                f".restopo file?")
    name = e.filename
    if name == "-" and isinstance(e, FileNotFoundError):  # `... | restopo inspect -`
        return ("restopo: error: '-' (standard input) is read only by restopo check, for a "
                "spec piped in; give a file's path here")
    if name is not None:  # one line, and an empty path seen as one: ''
        name = name if str(name).isprintable() and str(name) else repr(name)
    what = e.strerror or str(e)
    if e.errno is not None and e.strerror == os.strerror(e.errno):  # the system's words
        what = {FileNotFoundError: "no such file", IsADirectoryError: "is a directory, not a "
                "file", PermissionError: "permission denied"}.get(type(e), what)
    if e.filename2 is not None:
        what += f" ({e.filename2})"
    return f"restopo: error: {name}: {what}" if name is not None else f"restopo: error: {what}"


@contextlib.contextmanager
def _warnings_as_notes(command: str):
    """restopo's own warnings to a library caller ("restopo: ...", e.g. the fused CPU
    kernels unavailable) said as the command's notes, not as Python prints a UserWarning
    (a source path and line of code); every other warning as Python prints it."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith("restopo: "):
            noter(command)(text[len("restopo: "):])
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _remember(signum, frame) -> None:
    """main's SIGINT handler: Python's own (KeyboardInterrupt), each Ctrl-C remembered in
    worker.interrupts_seen. One that came inside a C extension's import can be caught and
    dropped by the library importing it (torch, of numpy): the command then stops where its
    work begins (worker.stop_if_interrupted), and what the half-done import breaks before
    then (numpy's next import: 'cannot load module more than once per process', a numpy
    without its attributes, an endless recursion in its __getattr__) main says as the stop
    it was."""
    from .worker import interrupts_seen

    interrupts_seen.append(signum)
    signal.default_int_handler(signum, frame)


def _held(signum, frame) -> None:
    """main's SIGINT handler while torch imports (_import_torch): the Ctrl-C remembered
    only; a second one is taken at once."""
    from .worker import interrupts_seen

    interrupts_seen.append(signum)
    signal.signal(signal.SIGINT, _remember)


# the commands that need no torch, which is not imported for them (tests/test_imports.py)
LIGHT = ("check", "inspect")


def _import_torch() -> None:
    """Import torch with a Ctrl-C during it held till the import is done, then taken as a
    stop: raised inside it, torch's C code caught it and dropped it (the command went on),
    left numpy half-imported, or aborted the process (SIGABRT)."""
    from .worker import stop_if_interrupted

    if signal.getsignal(signal.SIGINT) is _remember:  # else not ours to hold
        signal.signal(signal.SIGINT, _held)
    try:
        importlib.import_module("torch")
    except ImportError:  # the command says what it lacks
        pass
    finally:
        if signal.getsignal(signal.SIGINT) is _held:
            signal.signal(signal.SIGINT, _remember)
    stop_if_interrupted()


@contextlib.contextmanager
def _interrupts_seen():
    """Within the block, Ctrl-C raises KeyboardInterrupt as Python's own handler does, and
    is remembered (the list yielded, worker.interrupts_seen; _remember says why)."""
    from .worker import interrupts_seen as seen

    seen.clear()
    mine = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # else not ours
    if mine:
        try:
            signal.signal(signal.SIGINT, _remember)
        except ValueError:  # main() called on another thread than the main one
            mine = False
    try:
        yield seen
    finally:
        seen.clear()  # (a later command run in this process starts with none)
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv=None) -> int:
    with _interrupts_seen() as interrupts:
        return _main(argv, interrupts)


def _main(argv, interrupts: list[int]) -> int:
    # a character stdout's encoding cannot hold (PYTHONIOENCODING=ascii, a Latin-1 locale)
    # is shown as '?', not a codec error that stops the command: generated text, a report's ±.
    # Line-buffered as stderr is: into one pipe or file (2>&1 | tee log) a block-buffered
    # stdout came out after later stderr lines (compare's table after its 'wrote' line)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace", line_buffering=True)
    try:
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:  # said with the command's usage, not the top level's
                command = getattr(args, "command", None)
                (args.command_parsers[command] if command else parser).error(
                    f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as e:  # --help / --version (0) or a usage error (2)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return 2
        if args.command not in LIGHT:
            _import_torch()
        with _warnings_as_notes(args.command):
            return int(args.func(args) or 0)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except BrokenPipeError:  # `restopo inspect ... | head`
        return 0
    except (OSError, UnicodeDecodeError) as e:  # a path the system refuses: one line
        print(file_error(e), file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Exception) as e:  # a stop that saved first says where
        if not isinstance(e, KeyboardInterrupt) and not interrupts:  # not a stop's doing
            raise
        from .worker import speaks_for_all

        detail = _stop_said(e)
        if speaks_for_all():  # a raw torchrun passes its Ctrl-C on to every worker
            print("restopo: interrupted" + (f"; {detail}" if detail else ""), file=sys.stderr)
        return 130


def _stop_said(e: BaseException) -> str:
    """What the stop that ended a command says (where --resume continues), "" if nothing: a
    Ctrl-C after a run's stop had saved (while loss.png was drawn) replaced that stop's
    KeyboardInterrupt, whose line was then dropped; Python keeps it as the new one's
    context."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt) and str(e):
            return str(e)
        e = e.__context__
    return ""


def run() -> None:
    """The `restopo` console script of an install made when it was this (restopo.__main__.run
    now): main(), then, under torchrun, an exit past torch's teardown (worker.leave)."""
    from .worker import exit_with

    exit_with(main())


if __name__ == "__main__":  # pragma: no cover
    run()
