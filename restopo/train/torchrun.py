"""`python -m restopo.train.torchrun ARGS`: torchrun (torch.distributed.run) with the same
arguments, minus its own traceback when a worker fails.

A failed worker has already printed its error (a clear line for a user mistake); torchrun
would then print a ChildFailedError traceback and a table about it, which buries that line.
Here the failure is only the exit status, and `restopo train --nproc` adds one line saying
what to do (restopo.train.dist.launch).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .dist import USAGE_EXIT

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        # a worker's mistake said once by rank 0: pass its status on, so nothing is added
        _, first = e.get_first_failure()
        return USAGE_EXIT if first.exitcode == USAGE_EXIT else 1
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by dist.launch
    sys.exit(main())
