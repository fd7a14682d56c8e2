"""One run per run folder: an exclusive lock on OUT/.restopo.lock while `restopo train` runs.

Two runs writing one folder prune each other's temporary checkpoints and interleave their
metrics. The lock is an flock on a file in the folder: the kernel drops it when the holder
exits, however it exits (SIGKILL included), so a lock is never stale. The file records who
holds it (pid, host, start time, command) so the refused run can say so.

With `--nproc N` the launching process takes the lock and its torchrun workers inherit the
right to the folder through RESTOPO_RUN_LOCK (the lock file's path); a worker started by a
bare `torchrun` takes it itself (rank 0 only: the other ranks never write there).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..io import make_folder

LOCK_NAME = ".restopo.lock"
ENV = "RESTOPO_RUN_LOCK"


class RunLocked(RuntimeError):
    """The run folder is held by another live run (the message names it)."""


@contextlib.contextmanager
def run_lock(out: str | os.PathLike, who: str = "run"):
    """Hold the lock on run folder `out` (created if need be) for the block's duration;
    RunLocked when another process holds it. `who`: what takes it, for the refusal (a
    sweep locks its folder as a run does, its runs their own folders inside it)."""
    out = Path(out)
    path = (out / LOCK_NAME).resolve()
    if os.environ.get(ENV) == str(path):  # our launcher holds it for us
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (restopo is tested on Linux and macOS)
        yield
        return
    created = not out.exists()
    make_folder(out)
    try:  # 0o666: the user's umask decides, as for every file a run writes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:  # named for the folder the user gave, not the lock file alone
        if created:  # made just now, for nothing
            with contextlib.suppress(OSError):
                out.rmdir()
        why = "permission denied" if isinstance(e, PermissionError) else (e.strerror or e)
        raise type(e)(e.errno, f"cannot write in this folder ({why} opening its lock file "
                      f"{LOCK_NAME}); choose another --out, or fix the folder's permissions",
                      str(out)) from None
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RunLocked(f"{out} is in use by another {who} ({_holder(fd)}); wait for "
                            f"it to finish, or choose another --out") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(["restopo", *sys.argv[1:]])[:500]}
        locked = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        if locked and created:  # a run that stopped before writing leaves no folder behind
            _remove_if_only_lock(out, path)
        os.close(fd)  # releases the lock


def _remove_if_only_lock(out: Path, lock: Path) -> None:
    """Remove the folder a run made when the lock is all it holds (done while holding the
    lock, so no other run is inside)."""
    try:
        if [p.name for p in out.iterdir()] == [lock.name]:
            lock.unlink()
            out.rmdir()
    except OSError:  # something appeared meanwhile, or the folder is not ours to remove
        pass


def held_by(out: str | os.PathLike) -> str | None:
    """Who holds the lock on folder `out` now (None: nobody; taken and let go at once, so
    a check, not a hold)."""
    path = Path(out) / LOCK_NAME
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (ImportError, OSError):  # no lock file: never run, or not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError:
        return _holder(fd)
    finally:
        os.close(fd)  # releases the shared lock, if it was taken


def hand_down(out: str | os.PathLike) -> dict:
    """Environment for child processes that may use `out` while this process holds it."""
    return {ENV: str((Path(out) / LOCK_NAME).resolve())}


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "its owner did not say who it is"
