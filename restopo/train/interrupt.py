"""Ctrl-C during training: the first stops the run at the end of the step it is in, after
a checkpoint of that step, so nothing trained is lost; a second stops it at once (the
newest checkpoint then is the last one saved). SIGTERM (a scheduler's preemption, `kill`)
is taken the same way.

Only a run of one process defers the first Ctrl-C. Under torchrun every rank gets the
signal, each possibly in a different step, and a save is collective: ranks that stopped
at different steps would wait on each other forever. There the signal works as before
(KeyboardInterrupt at once; resume from the last checkpoint).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Callable, Iterator

from ..worker import signals_handled


class Stop:
    """Whether a stop was asked for (`asked`), set by the first Ctrl-C."""

    def __init__(self) -> None:
        self.asked = False


@contextmanager
def deferred_interrupt(enabled: bool, say: Callable[[str], None]) -> Iterator[Stop]:
    """Within the block, the first SIGINT or SIGTERM sets `stop.asked` (and says so) instead
    of raising or ending the process; the handlers before the block are back for the
    second, and after the block. `enabled` False (several processes), or not the main
    thread (signals_handled sets nothing there): nothing changes."""
    stop = Stop()
    if not enabled:
        yield stop
        return
    put_back = None

    def first(signum, frame):
        stop.asked = True
        put_back()  # the second signal stops at once
        by = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        say(f"stopping after this step{by}, with a checkpoint of it (Ctrl-C again to stop "
            "now)")

    with signals_handled(("SIGINT", "SIGTERM"), first) as put_back:
        yield stop
