"""Ctrl-C during training: the first stops the run at the end of the step it is in, after
a checkpoint of that step, so nothing trained is lost; a second stops it at once (the
newest checkpoint then is the last one saved). SIGTERM (a scheduler's preemption, `kill`)
is taken the same way.

Under torchrun the launcher's Ctrl-C reaches the workers as torchrun's SIGTERM, each
possibly in another step, and a save is collective: the training loop stops every rank at
the first step at whose end any rank has been asked (restopo.train.dist.any_rank), within
the time torchrun gives its workers before SIGKILL (30 s). A raw torchrun passes a
terminal's Ctrl-C on as SIGINT, and a second one as SIGTERM.
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Callable, Iterator

from ..worker import signals_handled, under_torchrun


class Stop:
    """Whether a stop was asked for (`asked`), set by the first Ctrl-C."""

    def __init__(self) -> None:
        self.asked = False


STOP_SIGNALS = ("SIGINT", "SIGTERM")


@contextmanager
def deferred_interrupt(say: Callable[[str], None]) -> Iterator[Stop]:
    """Within the block, the first SIGINT or SIGTERM sets `stop.asked` (and says so) instead
    of raising or ending the process; the handlers before the block are back for the
    second, and after the block. Not in the main thread (signals_handled sets nothing
    there): nothing changes."""
    stop = Stop()
    put_back = None

    def first(signum, frame):
        came = arrived()
        stop.asked = True
        put_back()  # the second signal stops at once
        if len(came) > 1:  # the second came before this handler could run: stop now, as
            # they would; SIGTERM first: its default, once back, drops one still pending
            for n in sorted(set(came), reverse=True):
                signal.raise_signal(n)
            return
        # under torchrun the signal is the one torchrun passes on (the launcher's Ctrl-C
        # arrives as SIGTERM), and a second Ctrl-C of the launcher stops the workers at once
        by = ("" if signum == signal.SIGINT or under_torchrun() else
              f" ({signal.Signals(signum).name})")
        say(f"stopping after this step{by}, with a checkpoint of it (Ctrl-C again to stop "
            "now)")

    with _counted() as arrived, signals_handled(STOP_SIGNALS, first) as put_back:
        yield stop


@contextmanager
def _counted() -> Iterator[Callable[[], list[int]]]:
    """Within the block, `arrived()` is the stop signals that reached the process since it
    was last called, each as it came (signal.set_wakeup_fd, written in C). Python runs a
    handler only once the main thread is back in Python: two Ctrl-C during one long C call
    (a collective waiting for a slower rank, a large save) ran it once, and a SIGTERM after
    a SIGINT (a raw torchrun's second Ctrl-C) found SIGINT's handler had put back SIGTERM's
    default and was dropped ('Signal 15 ignored due to race condition')."""
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        before = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (OSError, ValueError):  # not the main thread (no handlers there), or a platform
        # where the fd must be a socket (Windows)
        os.close(r)
        os.close(w)
        yield lambda: []
        return
    stops = {getattr(signal, name) for name in STOP_SIGNALS}

    def arrived() -> list[int]:
        came = b""
        try:
            while chunk := os.read(r, 512):
                came += chunk
        except BlockingIOError:  # read all
            pass
        return [n for n in came if n in stops]

    try:
        yield arrived
    finally:
        signal.set_wakeup_fd(before)
        os.close(r)
        os.close(w)
