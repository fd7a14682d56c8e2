"""Writing files atomically: a reader, or a crash, sees the old file or the new one, never
part of one.

The new content goes to a temporary file beside the target (the same filesystem, so the
rename is atomic), is fsynced, gets the mode a newly created file would (0o666 & ~umask;
mkstemp makes it 0600) and is renamed over the target; the folder is then fsynced so the
rename survives a power cut. Any failure removes the temporary file. Stdlib only.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Callable, Iterator


def write_atomic(path: str | os.PathLike, content: str | bytes | Callable[[str], object]) -> None:
    """Replace `path` with `content`: text (written as UTF-8), bytes, or `write(tmp_path)`
    for a library that writes to a path itself (matplotlib, Graphviz)."""
    with atomic_path(path) as tmp:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path beside `path` that replaces it when the block ends without error
    (for a library that writes to a file object: `with atomic_path(p) as tmp, open(tmp,
    "wb") as f: ...`). It keeps the target's extension, which some libraries read."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".restopo-", suffix=os.path.splitext(path)[1],
                                   dir=folder)
    except OSError as e:  # name the folder the user gave, not the temporary file
        what = ("the folder to write it in does not exist"
                if isinstance(e, FileNotFoundError) else e.strerror or str(e))
        raise type(e)(e.errno, what, path) from None
    os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, _new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def _new_file_mode() -> int:
    return new_mode()


def new_mode(folder: bool = False) -> int:
    """The mode a newly created file (or folder) gets under the user's umask: for what was
    made by mkstemp/mkdtemp (0600/0700) or by a library that picks its own mode."""
    umask = os.umask(0)  # the only way to read it; set straight back
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)
