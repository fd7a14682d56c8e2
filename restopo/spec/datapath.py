"""Where a spec's `train.data` is: the path training reads it from, and whether anything
readable is there. One place, so that `restopo check` looks where `restopo train` reads."""
from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

from .nodes import from_command_line


class DataPathError(ValueError):
    """A data path with nothing training can read there; the message says what to give."""


class DataPathMissing(DataPathError):
    """Nothing at all at the data path (a run's data moved or deleted since it trained)."""


def data_base(spec) -> str:
    """Folder a relative `data:` path is read from: the spec file's folder, or the current
    folder when the data path came from --set on the command line. A spec read back from a
    checkpoint or an export (`spec.recorded`) reads it where its run did, from any folder,
    unless this command line gives train.data anew."""
    pos = spec.train.where("data")
    given = pos is not None and from_command_line(pos.source)
    if spec.recorded is not None and spec.recorded[1]:
        if not given or _override_number(pos.source) <= spec.recorded[0]:
            return spec.recorded[1]
    if given or str(spec.path).startswith("<"):
        return os.getcwd()
    return str(Path(str(spec.path)).resolve().parent)


def _override_number(source) -> float:
    """N of an override's source `<--set N>` (a flag's, `<--steps>`, counts as the last)."""
    found = re.fullmatch(r"<--set (\d+)>", str(source))
    return int(found.group(1)) if found else math.inf


def data_path(source: str, base_dir: str | os.PathLike | None) -> Path | None:
    """The file or folder a `data:` value names, a relative one read from `base_dir`; None
    for a builtin corpus (builtin:NAME) or an empty value, which are not paths;
    DataPathMissing for a `~user` this machine has no home folder for."""
    source = source.strip()
    if not source or source.startswith("builtin:"):
        return None
    try:
        path = Path(source).expanduser()
    except RuntimeError:  # what pathlib raises for an unknown ~user (or no home at all)
        raise DataPathMissing(f"data path {source!r} starts with "
                              f"'{source.split('/', 1)[0]}', a home folder this machine does "
                              f"not know; give the path in full") from None
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def data_place(spec) -> str:
    """Where `spec`'s train.data is, as one string: the absolute path its run reads (one file
    given as a relative path and as an absolute one is one place), or a builtin as written."""
    try:
        path = data_path(spec.train.data, data_base(spec))
    except DataPathError:
        path = None  # no place on this machine: as written
    return spec.train.data.strip() if path is None else str(path.resolve())


def data_mode(path: Path) -> int:
    """The st_mode of a data path that is a regular file or a folder; DataPathError when
    nothing is there, the system refuses to look, or it is something else (a pipe)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        # --set "train.data='c.txt'": the inner quotes reach the path (a shell keeps them)
        quoted = re.search(r"(^|/)['\"]|['\"]$", str(path))
        raise DataPathMissing(f"data path {str(path)!r} does not exist; " + (
            "its quotes are part of the name: give the path without them" if quoted else
            "give a text file, a folder of text files, a .bin of uint16 token ids or "
            "builtin:stdlib")) from None
    except OSError as e:  # a name too long, a link loop, no permission
        raise DataPathError(f"cannot use data path {shown(path)}: {e.strerror or e}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise DataPathError(f"data path {shown(path)} is not a regular file or a folder (a "
                            f"pipe or a device?); give a text file, a folder or a .bin")
    return mode


def data_kind(path: Path, mode: int) -> str:
    """How training reads the file or folder at `path` (its st_mode `mode`): "ids" (uint16
    token ids: a .bin, any case, or a folder holding train.bin) or "bytes" (text)."""
    if stat.S_ISDIR(mode):
        return "ids" if (path / "train.bin").is_file() else "bytes"
    # .BIN too: token ids read as text would train
    return "ids" if path.suffix.lower() == ".bin" else "bytes"


BINARY_SNIFF = 8000  # git's rule: a file with a NUL byte in its first 8000 bytes is binary


def looks_binary(data: bytes) -> bool:
    """Whether a file of text is binary rather than text (UTF-16 text counts as binary:
    its NULs would train as characters)."""
    return b"\0" in data[:BINARY_SNIFF]


def check_data_file(path: Path, kind: str) -> None:
    """DataPathError for one data file that training refuses on its size and first bytes
    alone: an empty file, a .bin of an odd number of bytes, a binary file given as text.
    A cheap look (a stat and BINARY_SNIFF bytes), so that `restopo check` says it too."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(BINARY_SNIFF) if kind == "bytes" else b""
    except OSError as e:
        raise DataPathError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
    if size == 0:
        raise DataPathError(f"data file {str(path)!r} is empty")
    if kind == "ids" and size % 2:
        raise DataPathError(f"{str(path)!r} has an odd number of bytes; a .bin must hold "
                            f"uint16 token ids (nanoGPT's format)")
    if kind == "bytes" and looks_binary(head):  # as a text folder's binary files are skipped
        raise DataPathError(f"data file {str(path)!r} is binary, not text (a NUL byte in its "
                            f"first {BINARY_SNIFF:,} bytes: compressed, an array, UTF-16?); "
                            f"give text (UTF-8 or any 8-bit encoding), or token ids as a .bin "
                            f"of uint16")


def data_files(path: Path, mode: int) -> tuple[Path, ...]:
    """The files training reads at a data path of st_mode `mode`: the file itself, or a
    token-id folder's train.bin and val.bin (DataPathError without val.bin); none named for
    a text folder, whose files are found as training reads them."""
    if not stat.S_ISDIR(mode):
        return (path,)
    if data_kind(path, mode) == "bytes":
        return ()
    if not (path / "val.bin").is_file():
        raise DataPathError(f"{str(path)!r} has train.bin but no val.bin; add val.bin or "
                            f"point data: at train.bin to split it")
    return path / "train.bin", path / "val.bin"


def check_data_path(spec) -> None:
    """A SpecError at train.data when it names a path that training would refuse: nothing
    there, or a file of data_files that check_data_file refuses (a text folder's files are
    read when training)."""
    try:
        path = data_path(spec.train.data, data_base(spec))
        mode = data_mode(path) if path is not None else None
        for file in data_files(path, mode) if mode is not None else ():
            check_data_file(file, data_kind(path, mode))
    except DataPathError as e:
        raise spec.error("train", "data", str(e)) from None


def shown(path: Path) -> str:
    """A path for a message: quoted, a very long one cut in the middle."""
    text = str(path)
    return repr(text if len(text) <= 120 else text[:100] + "..." + text[-17:])
