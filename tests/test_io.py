"""restopo.io: the one atomic writer (text, bytes, a library writing to a path or a file)."""
import os

import pytest

from restopo.io import atomic_path, write_atomic


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
