"""Ctrl-C during training: the first stops the run at the end of the step it is in, after
a checkpoint of that step, so nothing trained is lost; a second stops it at once (the
newest checkpoint then is the last one saved). SIGTERM (a scheduler's preemption, `kill`)
is taken the same way.

Under torchrun the launcher's Ctrl-C reaches the workers as torchrun's SIGTERM, each
possibly in another step, and a save is collective: the training loop stops every rank at
the first step at whose end any rank has been asked (restopo.train.dist.any_rank), within
the time torchrun gives its workers before SIGKILL (30 s).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Callable, Iterator

from ..worker import signals_handled, under_torchrun


class Stop:
    """Whether a stop was asked for (`asked`), set by the first Ctrl-C."""

    def __init__(self) -> None:
        self.asked = False


@contextmanager
def deferred_interrupt(say: Callable[[str], None]) -> Iterator[Stop]:
    """Within the block, the first SIGINT or SIGTERM sets `stop.asked` (and says so) instead
    of raising or ending the process; the handlers before the block are back for the
    second, and after the block. Not in the main thread (signals_handled sets nothing
    there): nothing changes."""
    stop = Stop()
    put_back = None

    def first(signum, frame):
        stop.asked = True
        put_back()  # the second signal stops at once
        # under torchrun the signal is the one torchrun passes on (the launcher's Ctrl-C
        # arrives as SIGTERM), and a second Ctrl-C of the launcher stops the workers at once
        by = ("" if signum == signal.SIGINT or under_torchrun() else
              f" ({signal.Signals(signum).name})")
        say(f"stopping after this step{by}, with a checkpoint of it (Ctrl-C again to stop "
            "now)")

    with signals_handled(("SIGINT", "SIGTERM"), first) as put_back:
        yield stop
