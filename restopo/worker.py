"""How a process ends and is stopped: a torchrun worker's exit, its parent's death, stop
signals (stdlib only, so any layer's entry point can use it)."""
from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def speaks_for_all() -> bool:
    """Whether this process says what every process of its run meets (a mistake, a stop):
    rank 0 under torchrun, else the one process."""
    return not under_torchrun() or os.environ["RANK"] == "0"


def leave(code: int) -> None:
    """End a process: under torchrun, at once, skipping the interpreter's teardown; else
    return and let the caller exit as usual.

    With gloo, torch's C++ teardown after destroy_process_group now and then aborts the
    process at exit (std::terminate, "terminate called without an active exception",
    SIGABRT): a finished run, or a mistake rank 0 has already said, then reads as a crashed
    worker. Seen in about one clean CI run in three, never on demand. A worker has nothing
    left to do by then (its files are written through with-blocks and atomic renames, its
    process group destroyed), so it flushes what it printed and exits with its own status."""
    if not under_torchrun():
        return
    import logging  # (here: restopo's first milliseconds import only what they need)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code)


def exit_with(code: int) -> NoReturn:
    """End a script's `__main__` with `code`, through leave(): every script the repository
    runs under torchrun ends here (tests/test_worker.py finds them)."""
    if code == 130:  # interrupted: a second Ctrl-C during teardown would print a traceback
        _ignore_interrupts()
    leave(code)
    # CPython marks a KeyboardInterrupt that ends code run by exec of a string (a dataclass's
    # __init__ as it is made, in torch's import) as uncaught even when it was caught, and
    # `python -m` then ends by SIGINT (status -2), not with `code`; a string's exec resets it
    exec("", {})
    raise SystemExit(code)


# The Ctrl-C a command's own SIGINT handler took (cli.main clears it, its handler adds to
# it): one that came inside a C extension's import can be caught and dropped by the library
# importing it (torch, of numpy), and the command then went on as if none had come.
interrupts_seen: list[int] = []


def stop_if_interrupted() -> None:
    """Stop (KeyboardInterrupt) where a command's work begins, after its imports and
    checks and before it replaces or writes anything, if a Ctrl-C came before it."""
    if interrupts_seen:
        raise KeyboardInterrupt


def _ignore_interrupts() -> None:
    import signal
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


# Set by a sweep for its runs (experiments.runner): `restopo train` then asks to be stopped
# (SIGTERM: it saves, then stops) when the sweep dies, rather than train on unwatched.
STOP_WITH_PARENT = "RESTOPO_STOP_WITH_PARENT"


def die_with_parent(signum: int) -> None:
    """Have the kernel send `signum` to this process when its parent dies (Linux; elsewhere
    nothing). torchrun's agent asks for it: its workers run in sessions of their own, so a
    launcher killed outright would otherwise leave the agent and the workers training,
    unlocked, in a run folder a second run may then take."""
    import ctypes
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took: as if it had
        os.kill(os.getpid(), signum)


@contextmanager
def signals_handled(names, handler: Callable) -> Iterator[Callable[[], None]]:
    """Within the block, `handler(signum, frame)` for each signal named in `names` that this
    platform has; the handlers before are back after, or sooner when the block calls what
    it is given (`with signals_handled(...) as put_back`: a handler that takes only the
    first signal). Only the main thread may set them (and only there does Python run them):
    from another, nothing changes."""
    import signal

    before = {}
    if threading.current_thread() is threading.main_thread():
        for name in names:
            sig = getattr(signal, name, None)
            if sig is not None:
                before[sig] = signal.signal(sig, handler)

    def put_back() -> None:
        for sig, kept in before.items():
            signal.signal(sig, kept)

    try:
        yield put_back
    finally:
        put_back()
