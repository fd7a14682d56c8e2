"""Writing files and folders atomically: a reader, or a crash, sees the old file (folder) or
the new one, never part of one. Everything restopo writes atomically goes through here.

The new content goes to a temporary file beside the target (the same filesystem, so the
rename is atomic), is fsynced, gets the target's mode (or, for a new file, the mode a newly
created one would: 0o666 & ~umask; mkstemp makes it 0600) and is renamed over the target
(a symbolic link's target: the link stays); the folder is then fsynced so the
rename survives a power cut. Any failure removes the temporary file. A folder (a
checkpoint, a prepared corpus) is written the same way: a temporary folder beside the
target, its files fsynced, then one rename (`atomic_folder`, `replace_folder`). Stdlib only.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where restopo keeps what it makes once per machine (the prepared builtin corpus, the
    built CPU kernels): `cache_dir`, else $RESTOPO_CACHE, else ~/.cache/restopo."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("RESTOPO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "restopo"


def cache_folder(*parts: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """cache_root(cache_dir) / parts, made if need be, for restopo to write in. An OSError
    that says which setting to change where it cannot be (a $RESTOPO_CACHE at a file, or
    somewhere not writable, was named by the path alone, as if the path were a mistake)."""
    folder = cache_root(cache_dir).joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))
    except OSError as e:
        why = _why_no_folder(folder, e)
        env = os.environ.get("RESTOPO_CACHE")
        if cache_dir is not None:
            what = f"cannot keep a cache in {cache_dir}: {why}; give a folder you can write to"
        elif env:
            what = (f"RESTOPO_CACHE={env} cannot hold restopo's cache: {why}; set "
                    f"RESTOPO_CACHE to a folder you can write to, or unset it to use "
                    f"~/.cache/restopo")
        else:
            what = (f"cannot keep restopo's cache in {cache_root()}: {why}; set RESTOPO_CACHE "
                    f"to a folder you can write to")
        raise type(e)(e.errno, what) from None
    return folder


def make_folder(path: str | os.PathLike, instead: str = "choose another --out") -> Path:
    """`path` as a folder, made with its parents if need be (a command's --out). An OSError
    naming it that says which part of it is in the way and what to do (`instead`), where
    mkdir's own said only 'Not a directory' or 'File exists'; and one for a folder already
    there that cannot be written in (said by the first file written, after the work)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(e.errno, f"cannot make this folder: {_why_no_folder(path, e)}; {instead}",
                      str(path)) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"cannot write in this folder (permission denied); "
                              f"{instead}, or fix the folder's permissions", str(path))
    return path


@contextmanager
def output_folder(path: str | os.PathLike, instead: str = "choose another --out"
                  ) -> Iterator[Path]:
    """make_folder(path) for a block that fills it: made before the work, so a folder that
    cannot be made is said before the work is done, not after (and the work lost). If the
    block fails, the folders made here are removed again when they are still empty."""
    path = Path(path)
    made = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    make_folder(path, instead)
    try:
        yield path
    except BaseException:
        for p in made:  # innermost first; rmdir keeps any that holds something
            try:
                p.rmdir()
            except OSError:
                break
        raise


def beside_error(path: str | os.PathLike) -> OSError | None:
    """The error write_atomic(path) would meet at the end of a command's work (the folder
    to write it in missing, not a folder, or not writable), found before the work starts;
    None when none is foreseen. Its strerror says what to do."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        if os.access(folder, os.W_OK | os.X_OK):
            return None
        return PermissionError(errno.EACCES, f"cannot write a file in {folder} (permission "
                               f"denied); write it to another path, or fix the folder's "
                               f"permissions", path)
    e = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), folder)
    why = _why_no_folder(Path(folder), e)
    if why.startswith("cannot make"):  # only missing: as the write would say it
        return _as_users(e, path, "write")
    return NotADirectoryError(errno.ENOTDIR, f"cannot write it there: {why}; write it to "
                              f"another path", path)


def _why_no_folder(path: Path, e: OSError) -> str:
    """Why the folder `path` could not be made (or written in), naming the part at fault:
    the nearest part of it that is there (or a symbolic link that leads nowhere)."""
    path = Path(path)
    part = next((p for p in (path, *path.parents) if os.path.lexists(p)), Path("."))
    if os.path.islink(part) and not os.path.exists(part):
        return f"{part} is a symbolic link to {os.readlink(part)}, which does not exist"
    if part.exists() and not part.is_dir():
        return f"{part} is a file, not a folder"
    if part == path:
        return f"{path} is not writable"
    return f"cannot make a folder in {part} ({e.strerror or e})"


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
    # through a symbolic link to its file (replacing the link made a copy of the file in its
    # place, and left the file it named as it was)
    path = os.path.realpath(path) if os.path.islink(path) else os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".restopo-", suffix=os.path.splitext(path)[1],
                                   dir=folder)
    except OSError as e:
        raise _as_users(e, path, "write") from None
    os.close(fd)
    try:
        with full_disk_said(path):
            yield tmp
        fsync_file(tmp)
        os.chmod(tmp, _kept_mode(path))
        try:
            os.replace(tmp, path)
        except OSError as e:  # e.g. a folder at `path`: name it, not the temporary file
            raise type(e)(e.errno, e.strerror or str(e), path) from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


# A writer library's own error for a write the filesystem refused (safetensors: "No space
# left on device (os error 28)"; torch.save's zip writer: "unexpected pos ..." only).
_FULL_WORDS = ("No space left on device", "os error 28", "Disk quota exceeded")


@contextmanager
def full_disk_said(path: str | os.PathLike) -> Iterator[None]:
    """Within the block, a writer library's error for a full disk (while writing `path`)
    becomes OSError(ENOSPC) naming `path`, which the commands say in one line, and so does
    an OSError that names no file (a write() to an open file: 'No space left on device',
    of nothing); any other error stays as it is. Looked at before the caller removes its
    partial file, while the free space is what the write left."""
    try:
        yield
    except Exception as e:
        if isinstance(e, OSError):
            if e.filename is None and e.errno is not None:
                raise type(e)(e.errno, e.strerror or str(e), os.fspath(path)) from None
            raise
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(path)))
            nearly_full = st.f_bavail * st.f_frsize < (1 << 20)
        except (OSError, AttributeError):  # no statvfs (Windows): by the words alone
            nearly_full = False
        if nearly_full or any(w in str(e) for w in _FULL_WORDS):
            raise OSError(errno.ENOSPC, "no space left on the device", os.fspath(path)) from e
        raise


@contextmanager
def atomic_folder(path: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """A temporary folder beside `path` that becomes `path` when the block ends without
    error: every file written in it is fsynced, then the folder is put in place by
    `replace_folder`. With keep_existing, a folder already at `path` by then (another
    process made it meanwhile) is kept and this one dropped. Any failure removes the
    temporary folder and leaves `path` as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _mkdtemp_beside(path, folder)
    try:
        with full_disk_said(path):
            yield Path(tmp)
        for dirpath, _, files in os.walk(tmp):
            for name in files:
                fsync_file(os.path.join(dirpath, name))
        replace_folder(tmp, path, keep_existing=keep_existing)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(tmp: str | os.PathLike, path: str | os.PathLike, *,
                   keep_existing: bool = False) -> bool:
    """Make the written folder `tmp` (beside `path`, on its filesystem; its files already
    fsynced) `path` in one rename, durably: it gets the mode a new folder would (mkdtemp
    makes 0700) and is fsynced; a folder already at `path` is renamed aside and removed
    first (keep_existing: kept, and `tmp` left for the caller to remove; returns False);
    the parent folder is fsynced after the rename. Returns True when `tmp` became `path`."""
    tmp, path = os.fspath(tmp), os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.chmod(tmp, new_mode(folder=True))
    fsync_dir(tmp)
    if os.path.exists(path):
        if keep_existing:
            return False
        remove_folder(path)
    try:
        os.replace(tmp, path)
    except OSError:
        # a non-empty folder appeared at `path` since the check: another process won
        if keep_existing and os.path.isdir(path):
            return False
        raise
    fsync_dir(folder)
    return True


def remove_folder(path: str | os.PathLike) -> None:
    """Remove the folder `path` (nothing if it is not there): renamed aside in one step,
    then deleted, so a stop during a long delete leaves no half of it at `path`, only a
    hidden `.old-NAME-PID` beside it (restopo.train.checkpoint's leftovers)."""
    path = os.fspath(path)
    old = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".old-{os.path.basename(path)}-{os.getpid()}")
    try:
        os.replace(path, old)
    except FileNotFoundError:
        return
    shutil.rmtree(old, ignore_errors=True)


def _mkdtemp_beside(path: str, folder: str) -> str:
    try:
        return tempfile.mkdtemp(prefix=f".{os.path.basename(path)}-", dir=folder)
    except OSError as e:
        raise _as_users(e, path, "make") from None


def _as_users(e: OSError, path: str, verb: str) -> OSError:
    """The error of making a temporary file or folder beside `path`, naming `path` (what
    the user gave) rather than the temporary name, and saying why in their terms."""
    folder = os.path.dirname(os.path.abspath(path))
    if isinstance(e, FileNotFoundError) and not os.path.isdir(folder):
        # a file's folder is not made for it (a mistyped folder would be, silently); only
        # the commands' --out DIR folders are
        near = os.path.relpath(folder)
        what = (f"the folder to {verb} it in does not exist; make it first (mkdir -p "
                f"{shlex.quote(folder if near.startswith('..') else near)})")
    elif isinstance(e, FileNotFoundError):  # e.g. /proc: the folder is there, not writable
        what = f"cannot {verb} a file in {folder}"
    else:
        what = e.strerror or str(e)
    return type(e)(e.errno, what, path)


def _kept_mode(path: str) -> int:
    """The mode `path` has (an executable script stays one), or a new file's."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return _new_file_mode()


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
