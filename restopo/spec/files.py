"""Reading a spec file: a regular file of at most MAX_SPEC_BYTES of UTF-8, or one clear error.

A path can name anything: a FIFO (reading it blocks until a writer comes), /dev/zero (never
ends), a folder, a symbolic-link loop, /proc/self/mem (EIO). The file is opened without
blocking, checked to be a regular file on the open descriptor (so it cannot be swapped
between the check and the read), and read up to the cap, never further.
"""
from __future__ import annotations

import errno
import os
import re
import stat

MAX_SPEC_BYTES = 64 << 10  # a spec is a few dozen lines (the examples are under 2 KiB);
#                           Lark reads 64 KiB of the worst text in a few seconds

SAVED = (".pt", ".safetensors")  # what a saved model's file name ends in, never a spec's

_KINDS = ((stat.S_ISDIR, "is a directory, not a spec file"),
          (stat.S_ISFIFO, "is a named pipe (FIFO), not a regular file"),
          (stat.S_ISCHR, "is a character device, not a regular file"),
          (stat.S_ISBLK, "is a block device, not a regular file"),
          (stat.S_ISSOCK, "is a socket, not a regular file"))


class SpecFileError(OSError):
    """A spec path that cannot be read as a spec (`filename` and a message that says why).

    An OSError, so every caller that reports unreadable files reports it the same way."""

    def __init__(self, path: str, message: str, code: int = errno.EINVAL):
        super().__init__(code, message, path)


def read_spec_file(path: str | os.PathLike) -> str:
    """The text of a spec file (a byte-order mark dropped). Raises SpecFileError for what is
    not a regular file or is too large, OSError for what the system refuses (no such
    file, permission, a link loop, a name too long, I/O errors) and UnicodeDecodeError
    (with `restopo_path` set) for text that is not UTF-8."""
    path = os.fspath(path)
    saved = _saved_not_a_spec(path)
    if saved:
        raise SpecFileError(path, saved)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        for test, what in _KINDS:
            if test(mode):
                raise SpecFileError(path, what + "; restopo reads specs from regular files")
        if not stat.S_ISREG(mode):
            raise SpecFileError(path, "is not a regular file")
        data = _read_capped(fd, MAX_SPEC_BYTES + 1)
    except OSError as e:
        if e.filename is None:  # os.read names no file
            e.filename = path
        raise
    finally:
        os.close(fd)
    return _text(data, path)


def _saved_not_a_spec(path: str) -> str | None:
    """What a run folder, a checkpoint or a saved model given for a spec is, and what to
    give (said as restopo.load says a spec given for a model); None for anything else."""
    name, run = os.path.basename(os.path.normpath(path)), "RUN"
    if os.path.isdir(os.path.join(path, "ckpt")):
        what, run = "a run folder", path
    elif os.path.isdir(path) and (name == "ckpt" or re.fullmatch(r"step_\d{6,}", name)):
        what = "a checkpoint folder"  # the names train.checkpoint gives them
    elif os.path.isfile(path) and name.endswith(SAVED):
        what = "a saved model"
    else:
        return None
    return (f"is {what}, not a spec; give a .restopo file (restopo train --resume --out "
            f"{run} continues a run, with the spec its checkpoint holds)")


def read_spec_stdin(name: str = "<stdin>") -> str:
    """The text of a spec piped in (`restopo check -`), read to its end or the cap, with
    the errors read_spec_file gives, naming it `name`."""
    try:
        data = _read_capped(0, MAX_SPEC_BYTES + 1)
    except OSError as e:
        e.filename = name
        raise
    return _text(data, name)


def _text(data: bytes, path: str) -> str:
    """Spec bytes as text, or SpecFileError (too large) / UnicodeDecodeError (not UTF-8)."""
    if len(data) > MAX_SPEC_BYTES:
        raise SpecFileError(path, f"is larger than {MAX_SPEC_BYTES:,} bytes, the most a spec "
                                  f"may hold (a spec is a few dozen lines); is it a spec?",
                            errno.EFBIG)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        e.restopo_path = path  # so the CLI can name the file
        raise
    return as_read(text)


def as_read(text: str) -> str:
    """Spec text as a spec file is read: a leading byte-order mark dropped and line breaks
    as '\n' (a CR LF or a lone CR, as open() in text mode reads them), so that the lines
    positions count are the lines an error shows. parse_spec reads text given to it so."""
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _read_capped(fd: int, cap: int) -> bytes:
    """At most `cap` bytes (files under /proc report size 0, so read until EOF or the cap)."""
    chunks, total = [], 0
    while total < cap:
        chunk = os.read(fd, min(1 << 16, cap - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
