"""`python -m restopo.train.torchrun ARGS`: torchrun (torch.distributed.run) with the same
arguments, minus its own traceback when a worker fails.

A failed worker has already printed its error (a clear line for a user mistake); torchrun
would then print a ChildFailedError traceback and a table about it, which buries that line.
Here the failure is only the exit status, and `restopo train --nproc` adds one line saying
what to do (restopo.train.dist.launch). So is a stop: the launcher passes its signals on as
SIGTERM, torchrun stops the workers, and this exits 128 + the signal, without a traceback.
"""
from __future__ import annotations

import logging
import sys


def main(argv=None) -> int:
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..worker import die_with_parent
    from .dist import USAGE_EXIT

    die_with_parent(signal.SIGTERM)  # the launcher gone: stop the workers (they shut down)

    quiet = _Quiet()  # a filter acts on its own logger only: give it to each of torchrun's
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).addFilter(quiet)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        # a mistake rank 0 has said (or, on another node, every local worker met): pass the
        # status on, so the launcher adds nothing
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if codes.get(0) == USAGE_EXIT or set(codes.values()) == {USAGE_EXIT}:
            return USAGE_EXIT
        print(f"restopo train: {first_failure(e.failures)}", file=sys.stderr)
        return 1
    except SignalException as e:  # stopped by the launcher: the workers are stopped too
        return 128 + int(e.sigval)
    return 0


def first_failure(failures: dict) -> str:
    """Which worker failed first, and how, in one line: a rank killed by a signal (the
    others then fail on the lost connection, with tracebacks that are only that), else
    the earliest to fail, whose error is above."""
    import signal

    from ..words import counted
    from .dist import LOST_PEER_EXIT

    def when(item):
        return getattr(item[1], "timestamp", 0)

    def first_killed(item):
        # torchrun's timestamps are whole seconds: a rank that aborted itself (SIGABRT, as
        # gloo's lost connection ends a process) in the second another was killed is the
        # consequence, not the cause
        return when(item), item[1].exitcode == -signal.SIGABRT
    # SIGTERM is the agent stopping the siblings of a failed rank (restopo's workers take a
    # SIGTERM of their own as a stop, and exit): the cause only when nothing else failed
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    if len(stopped) < len(failures):
        failures = {r: f for r, f in failures.items() if r not in stopped}
    killed = sorted(((r, f) for r, f in failures.items() if f.exitcode < 0), key=first_killed)
    if killed:
        rank, f = killed[0]
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = f"signal {-f.exitcode}"
        return (f"rank {rank} was killed by {name} (out of memory, or stopped by hand?); "
                "the other ranks' errors above are the connection it left them with")
    # a rank that lost its connection to another (LOST_PEER_EXIT) is a consequence too
    causes = {r: f for r, f in failures.items() if f.exitcode != LOST_PEER_EXIT}
    if not causes:  # the rank that stopped is on another node, whose launcher names it
        return (f"{counted(len(failures), 'rank')} lost the connection to a rank of another "
                "node; that node's output says why it stopped")
    rank, f = min(causes.items(), key=when)
    return f"rank {rank} failed first (exit status {f.exitcode}); its error is above"


class _Quiet(logging.Filter):
    """Drop the agent's log lines about workers that stopped for a mistake already said
    (exit status USAGE_EXIT) or a lost connection already said (LOST_PEER_EXIT), and about
    the siblings it then stops."""

    def filter(self, record: logging.LogRecord) -> bool:
        from .dist import LOST_PEER_EXIT, USAGE_EXIT

        text = record.getMessage()
        return (f"exitcode: {USAGE_EXIT})" not in text and "closing signal" not in text
                and f"exitcode: {LOST_PEER_EXIT})" not in text
                and "death signal" not in text)  # a stop the launcher passed on


if __name__ == "__main__":  # pragma: no cover - run as a process by dist.launch
    sys.exit(main())
