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
    for a builtin corpus (builtin:NAME) or an empty value, which are not paths."""
    source = source.strip()
    if not source or source.startswith("builtin:"):
        return None
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def data_place(spec) -> str:
    """Where `spec`'s train.data is, as one string: the absolute path its run reads (one file
    given as a relative path and as an absolute one is one place), or a builtin as written."""
    path = data_path(spec.train.data, data_base(spec))
    return spec.train.data.strip() if path is None else str(path.resolve())


def data_mode(path: Path) -> int:
    """The st_mode of a data path that is a regular file or a folder; DataPathError when
    nothing is there, the system refuses to look, or it is something else (a pipe)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DataPathMissing(f"data path {str(path)!r} does not exist; give a text file, a "
                            f"folder of text files, a .bin of uint16 token ids or "
                            f"builtin:stdlib") from None
    except OSError as e:  # a name too long, a link loop, no permission
        raise DataPathError(f"cannot use data path {shown(path)}: {e.strerror or e}") from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise DataPathError(f"data path {shown(path)} is not a regular file or a folder (a "
                            f"pipe or a device?); give a text file, a folder or a .bin")
    return mode


def check_data_path(spec) -> None:
    """A SpecError at train.data when it names a path that training would refuse (only
    whether it is there: its content is read when training)."""
    path = data_path(spec.train.data, data_base(spec))
    if path is not None:
        try:
            data_mode(path)
        except DataPathError as e:
            raise spec.error("train", "data", str(e)) from None


def shown(path: Path) -> str:
    """A path for a message: quoted, a very long one cut in the middle."""
    text = str(path)
    return repr(text if len(text) <= 120 else text[:100] + "..." + text[-17:])
