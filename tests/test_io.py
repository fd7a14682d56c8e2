"""restopo.io: the one atomic writer (text, bytes, a library writing to a path or a file,
a folder)."""
import ast
import os
from pathlib import Path

import pytest

from restopo import io as rio
from restopo.io import atomic_folder, atomic_path, cache_folder, replace_folder, write_atomic

ROOT = Path(__file__).resolve().parents[1]


def test_text_bytes_and_callback(tmp_path):
    write_atomic(tmp_path / "a.txt", "héllo\n")
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    write_atomic(tmp_path / "a.txt", b"\x00\x01")
    assert (tmp_path / "a.txt").read_bytes() == b"\x00\x01"
    seen = []

    def savefig(tmp):  # a library that picks the format by the name's extension
        seen.append(tmp)
        with open(tmp, "w") as f:
            f.write("x")

    write_atomic(str(tmp_path / "b.png"), savefig)
    assert seen[0].endswith(".png") and os.path.dirname(seen[0]) == str(tmp_path)
    with atomic_path(tmp_path / "c.bin") as tmp, open(tmp, "wb") as f:
        f.write(b"abc")
    assert (tmp_path / "c.bin").read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.png", "c.bin"]


def test_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640


def test_a_replaced_file_keeps_its_mode_and_a_link_is_written_through(tmp_path):
    """Writing over a file gave it a new file's mode (an executable script lost its x bit),
    and writing over a symbolic link replaced the link with a copy, leaving its file old."""
    script = tmp_path / "model.py"
    script.write_text("old")
    script.chmod(0o750)
    write_atomic(script, "new")
    assert script.read_text() == "new" and script.stat().st_mode & 0o777 == 0o750
    link = tmp_path / "latest.py"
    link.symlink_to(script.name)
    write_atomic(link, "newer")
    assert link.is_symlink() and script.read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.py", "model.py"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    (tmp_path / "f.txt").write_text("old")

    def fail(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(tmp_path / "f.txt", fail)
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "f.txt"):
        raise RuntimeError
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    assert (tmp_path / "f.txt").read_text() == "old"


def test_a_folder_appears_whole_with_the_umask_mode(tmp_path):
    target = tmp_path / "corpus"
    old = os.umask(0o027)
    try:
        with atomic_folder(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".corpus-")
            (tmp / "a.u8").write_bytes(b"abc")
            (tmp / "sub").mkdir()
            (tmp / "sub" / "b.json").write_text("{}")
            assert not target.exists()  # nothing at the target until the block ends
    finally:
        os.umask(old)
    assert (target / "a.u8").read_bytes() == b"abc" and (target / "sub" / "b.json").exists()
    assert target.stat().st_mode & 0o777 == 0o750  # not mkdtemp's 0700
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]


def test_a_folder_replaces_the_old_one_or_keeps_it(tmp_path):
    target = tmp_path / "f"
    target.mkdir()
    (target / "old").write_text("old")
    with atomic_folder(target) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new"]
    with atomic_folder(target, keep_existing=True) as tmp:  # another process made it first
        (tmp / "mine").write_text("mine")
    assert [p.name for p in target.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # nothing aside, no temporary
    spare = tmp_path / ".spare"
    spare.mkdir()
    assert replace_folder(spare, target, keep_existing=True) is False and spare.exists()
    assert replace_folder(spare, target) is True and not spare.exists()


def test_a_failed_folder_keeps_the_old_one_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "f"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_folder(target) as tmp:
        (tmp / "half").write_text("half")
        raise RuntimeError("disk full")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
    assert [p.name for p in target.iterdir()] == ["old"]
    with pytest.raises(FileNotFoundError, match="does not exist.*nowhere"):
        with atomic_folder(tmp_path / "nowhere" / "f"):
            pass


def _renames(path: Path):
    """(function, call) for every rename in a module: os.replace/rename/renames,
    shutil.move, and a path's .replace/.rename (one argument, no keywords: str.replace takes
    two, dataclasses.replace keywords)."""
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner, attr = ast.unparse(node.func.value), node.func.attr
            if (owner == "os" and attr in ("replace", "rename", "renames")) or \
                    (owner == "shutil" and attr == "move") or \
                    (attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords):
                yield fn.name, ast.unparse(node)


def test_nothing_else_renames_a_written_file_into_place():
    """One atomic writer: outside restopo/io.py no module renames what it wrote into place
    (a temporary file or folder of its own would be a second, unreviewed writer). The other
    renames move a finished checkpoint aside: pruning and quarantine of a damaged one."""
    found = set()
    for folder in ("restopo", "backends"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for function, _ in _renames(path):
                found.add((path.relative_to(ROOT).as_posix(), function))
    assert found == {("restopo/io.py", "atomic_path"), ("restopo/io.py", "replace_folder"),
                     ("restopo/io.py", "remove_folder"),
                     ("restopo/train/checkpoint.py", "_prune"),
                     ("restopo/train/checkpoint.py", "quarantine")}, sorted(found)


def _raiser(message):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        raise RuntimeError(message)
    return write


def test_a_full_disk_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    """Writer libraries say a full disk in their own exceptions (safetensors: '... No space
    left on device (os error 28)'; torch.save's zip writer: 'unexpected pos ...'), which
    reached the user as tracebacks; now they are OSError(ENOSPC) naming the user's file,
    found by the words or by the free space the write left, and other errors stay as
    they are. No partial file is left either way."""
    import errno
    from restopo.train import checkpoint as ck
    target = tmp_path / "m.safetensors"
    with pytest.raises(OSError) as got:
        write_atomic(target, _raiser("Error while serializing: I/O error: No space left on "
                                     "device (os error 28)"))
    assert got.value.errno == errno.ENOSPC and got.value.filename == str(target)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # plenty of room: not a full disk
        write_atomic(target, _raiser("unexpected pos 146304 vs 146192"))
    real = os.statvfs

    def full(path):
        st = real(path)
        return type("St", (), {"f_bavail": 3, "f_frsize": st.f_frsize})()
    monkeypatch.setattr(os, "statvfs", full)
    with pytest.raises(OSError, match="no space left") as got:
        write_atomic(target, _raiser("unexpected pos 146304 vs 146192"))
    assert got.value.__cause__ is not None and os.listdir(tmp_path) == []
    with pytest.raises(OSError, match="no space left"):  # the same inside a folder's write
        with atomic_folder(tmp_path / "f") as f:
            _raiser("unexpected pos 1 vs 2")(f / "x")
    assert os.listdir(tmp_path) == []
    import torch  # a checkpoint's files: the folder named, nothing left behind
    monkeypatch.setattr(ck.torch, "save", lambda obj, p: _raiser("unexpected pos 9 vs 8")(p))
    with pytest.raises(OSError, match="no space left") as got:
        ck.save_checkpoint(tmp_path / "ckpt", 3, torch.nn.Linear(2, 2), None, {}, {})
    assert got.value.filename == str(tmp_path / "ckpt" / "step_000003")
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_full_disk_met_appending_metrics_names_the_file(tmp_path, monkeypatch):
    """A write() to an open file says 'No space left on device' of no file; the metrics
    log, appended to at every logged step, now names itself (the commands say the
    OSError as FILE: WHAT)."""
    import errno

    from restopo.train import loop

    class Full:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    log = loop.MetricsLog(tmp_path, True, None)
    monkeypatch.setattr(loop, "open", lambda *a, **k: Full(), raising=False)
    with pytest.raises(OSError) as got:
        log.write({"step": 1, "loss": 2.0})
    assert got.value.errno == errno.ENOSPC and got.value.filename == str(log.path)
    from restopo.cli import file_error
    assert file_error(got.value) == f"restopo: error: {log.path}: No space left on device"


def test_a_cache_folder_restopo_cannot_write_in_names_the_setting(tmp_path, monkeypatch):
    """(Root writes anywhere: os.access stands in for a folder the user cannot write in.)"""
    monkeypatch.setenv("RESTOPO_CACHE", str(tmp_path / "cache"))
    assert cache_folder("kernels") == tmp_path / "cache" / "kernels"
    monkeypatch.setattr(rio.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError) as e:
        cache_folder("kernels")
    assert str(e.value.strerror) == (
        f"RESTOPO_CACHE={tmp_path / 'cache'} cannot hold restopo's cache: "
        f"{tmp_path / 'cache' / 'kernels'} is not writable; set RESTOPO_CACHE to a folder you "
        f"can write to, or unset it to use ~/.cache/restopo")
    with pytest.raises(PermissionError, match=f"cannot keep a cache in {tmp_path}: "):
        cache_folder(cache_dir=tmp_path)  # a folder given by the caller: no setting to name
