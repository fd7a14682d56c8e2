"""Corpora (builtin:stdlib, text, uint16 .bin), their errors, and the seeded batch sampler."""
import gzip
import hashlib
import io
import os
import re

import numpy as np
import pytest
import torch

from restopo.train import data
from restopo.train.data import BatchSampler, Corpus, DataError, fixed_batches, open_corpus


def _fake_stdlib(root):
    """A small tree shaped like the stdlib: packages, a test dir and site-packages to skip."""
    files = {}
    for i in range(60):
        rel = f"pkg{i % 3}/mod{i:02d}.py"
        files[rel] = (f"# module {i}\n" + f"def f{i}(x):\n    return x * {i}\n" * (i + 3)).encode()
    files["test/test_skip.py"] = b"SKIPPED = True\n"
    files["site-packages/foreign.py"] = b"FOREIGN = True\n"
    files["README.txt"] = b"not python\n"
    for rel, body in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
    return files


def test_stdlib_split_is_deterministic_and_by_file(tmp_path):
    root = tmp_path / "lib"
    files = _fake_stdlib(root)
    c1 = data.stdlib_corpus(tmp_path / "cache1", root=str(root), progress=False)
    c2 = data.stdlib_corpus(tmp_path / "cache2", root=str(root), progress=False)
    assert bytes(c1.train) == bytes(c2.train) and bytes(c1.val) == bytes(c2.val)
    # independent expectation: sorted .py files outside skipped dirs, val chosen by path hash
    kept = sorted(r for r in files if r.endswith(".py") and r.split("/")[0] not in
                  ("test", "site-packages"))
    val = [r for r in kept if hashlib.sha1(r.encode()).digest()[0] < int(256 * 0.05)]
    train = [r for r in kept if r not in val]
    assert bytes(c1.train) == b"".join(files[r] for r in train)
    assert bytes(c1.val) == b"".join(files[r] for r in val)
    assert b"SKIPPED" not in bytes(c1.train) + bytes(c1.val)
    assert b"FOREIGN" not in bytes(c1.train) + bytes(c1.val)
    assert c1.vocab == 256 and isinstance(c1.train, np.memmap)


def test_stdlib_cache_is_reused_and_leaves_no_temp(tmp_path):
    root = tmp_path / "lib"
    _fake_stdlib(root)
    cache = tmp_path / "cache"
    data.stdlib_corpus(cache, root=str(root), progress=False)
    (folder,) = [p for p in cache.iterdir()]
    assert folder.name.startswith("stdlib-") and (folder / "meta.json").is_file()
    stamp = os.stat(folder / "train.u8").st_mtime_ns
    data.stdlib_corpus(cache, root=str(root), progress=False)
    assert os.stat(folder / "train.u8").st_mtime_ns == stamp  # prepared once
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temporary folders left


def test_real_stdlib_corpus(tmp_path):
    c = open_corpus("builtin:stdlib", cache_dir=tmp_path, progress=False)
    assert len(c.train) > 1_000_000 and len(c.val) > 20_000
    assert b"def " in bytes(c.train[:100_000])
    c.check(256, 64)


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(bytes(range(1, 256)) * 40)  # every byte but NUL (binary: refused)
    c = open_corpus(str(f))
    assert bytes(c.train) + bytes(c.val) == f.read_bytes()
    assert len(c.val) == int(len(f.read_bytes()) * 0.05)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.txt").write_text(f"document {i} " * 100)
    c = open_corpus("docs", base_dir=tmp_path)  # relative paths resolve against base_dir
    assert sorted(bytes(c.train) + bytes(c.val)) == sorted(
        b"".join((folder / f"{i}.txt").read_bytes() for i in range(5)))


def test_text_folder_skips_binary_files_and_says_so(tmp_path):
    """A folder of text with a .pyc and an image beside it trained on their bytes as text,
    unsaid (here 90% of the corpus); now they are skipped and counted in the description,
    and a folder of nothing else is refused."""
    folder = tmp_path / "proj"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "notes.txt").write_text("plain notes, caf\u00e9\n" * 50)
    (folder / "__pycache__" / "m.cpython-312.pyc").write_bytes(b"\xcb\r\r\n\0\0" * 3000)
    (folder / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 500)
    c = open_corpus(str(folder))
    assert bytes(c.train) + bytes(c.val) == (folder / "notes.txt").read_bytes()
    assert "(1 file; 2 binary skipped: __pycache__/m.cpython-312.pyc and 1 more)" in \
        c.description
    (folder / "notes.txt").unlink()
    with pytest.raises(DataError, match="holds only binary files .* as in __pycache__"):
        open_corpus(str(folder))


def _npy(text: str) -> bytes:
    out = io.BytesIO()
    np.save(out, np.frombuffer(text.encode(), np.uint8))  # token ids saved by NumPy
    return out.getvalue()


@pytest.mark.parametrize("name, data", [
    ("corpus.txt.gz", lambda text: gzip.compress(text.encode())),
    ("tokens.npy", _npy),
    ("notes.txt", lambda text: text.encode("utf-16")),
])
def test_a_binary_data_file_is_refused(tmp_path, name, data):
    """A gzipped corpus, a NumPy array of ids or UTF-16 text given as the data file trained
    on its raw bytes without a word (a folder skips such files); now it is refused, as a
    text file in another 8-bit encoding is not."""
    text = "caf\u00e9 au lait, s'il vous pla\u00eet\n" * 200
    (tmp_path / name).write_bytes(data(text))
    with pytest.raises(DataError, match=f"data file .*{re.escape(name)}' is binary, not text "
                                        f"\\(a NUL byte in its first 8,000 bytes"):
        open_corpus(name, base_dir=tmp_path)
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    c = open_corpus("latin.txt", base_dir=tmp_path)
    assert bytes(c.train) + bytes(c.val) == text.encode("latin-1")


def test_uint16_bin_folder_and_single_file(tmp_path):
    ids = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    (tmp_path / "tok").mkdir()
    ids[:4000].tofile(tmp_path / "tok" / "train.bin")
    ids[4000:].tofile(tmp_path / "tok" / "val.bin")
    c = open_corpus(str(tmp_path / "tok"))
    assert c.vocab == 1000 and np.array_equal(c.train, ids[:4000])
    assert np.array_equal(c.val, ids[4000:])
    ids.tofile(tmp_path / "all.bin")
    c = open_corpus(str(tmp_path / "all.bin"))
    assert np.array_equal(np.concatenate([c.train, c.val]), ids) and len(c.val) == 250
    c.check(1000, 64)
    with pytest.raises(DataError, match="model.vocab must be at least 1000"):
        c.check(512, 64)
    # token ids under other names were read as byte text without a word: a .BIN file is
    # ids too, and a folder of .bin shards without train.bin is refused
    ids.tofile(tmp_path / "UPPER.BIN")
    assert open_corpus(str(tmp_path / "UPPER.BIN")).vocab == 1000
    (tmp_path / "shards").mkdir()
    ids[:2500].tofile(tmp_path / "shards" / "shard0.bin")
    ids[2500:].tofile(tmp_path / "shards" / "shard1.bin")
    with pytest.raises(DataError, match=r"holds \.bin files \(shard0.bin and 1 more\) but no "
                                        r"train.bin"):
        open_corpus(str(tmp_path / "shards"))


@pytest.mark.parametrize("make, source, match", [
    (lambda p: None, "missing.txt", "does not exist"),
    (lambda p: (p / "empty.txt").write_bytes(b""), "empty.txt", "is empty"),
    (lambda p: (p / "e").mkdir(), "e", "holds no files"),
    (lambda p: (p / "odd.bin").write_bytes(b"abc"), "odd.bin", "odd number of bytes"),
    (lambda p: None, "builtin:shakespeare", "unknown builtin corpus"),
    (lambda p: None, "", "train.data is empty"),
])
def test_bad_data_sources(tmp_path, make, source, match):
    make(tmp_path)
    with pytest.raises(DataError, match=match):
        open_corpus(source, base_dir=tmp_path)


def test_unreadable_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    f = tmp_path / "secret.txt"
    f.write_text("x" * 1000)
    f.chmod(0)
    with pytest.raises(DataError, match="cannot read"):
        open_corpus(str(f))


def test_too_short_and_byte_vocab(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 100)
    c = open_corpus(str(f))
    with pytest.raises(DataError, match="fewer than context \\+ 1 = 65"):
        c.check(256, 64)
    one = Corpus(np.arange(100, dtype=np.uint16), np.arange(1, dtype=np.uint16), 100, "t")
    with pytest.raises(DataError, match="the validation split has 1 token, fewer than"):
        one.check(256, 8)
    with pytest.raises(DataError, match="byte-level data needs model.vocab >= 256"):
        open_corpus(str(tmp_path / "short.txt")).check(128, 2)


def test_batches_are_windows_and_global_batch_splits_over_ranks():
    tokens = np.arange(10_000, dtype=np.uint16) % 65535
    one = BatchSampler(tokens, 16, 8, seed=3)
    ranks = [BatchSampler(tokens, 16, 8, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(5):
        x, y = one.next()
        assert x.shape == (8, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])                    # targets are the next token
        assert torch.equal(y[:, -1], x[:, -1] + 1)                  # contiguous windows
        parts = [s.next() for s in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)    # 2 x batch/2 == 1 x batch
        assert not torch.equal(parts[0][0], parts[1][0])            # each rank its own shard
    with pytest.raises(DataError, match="divisible by the number of processes"):
        BatchSampler(tokens, 16, 7, seed=0, rank=0, world=2)


def test_sampler_state_resumes_exactly():
    tokens = np.arange(5000, dtype=np.uint16)
    a = BatchSampler(tokens, 8, 4, seed=1)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    expected = [a.next()[0] for _ in range(3)]
    b = BatchSampler(tokens, 8, 4, seed=1)
    b.load_state_dict(state)
    assert all(torch.equal(e, b.next()[0]) for e in expected)


def test_fixed_validation_batches_repeat():
    tokens = np.arange(5000, dtype=np.uint16)
    v1 = fixed_batches(tokens, 8, 4, 3)
    v2 = fixed_batches(tokens, 8, 4, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))
    assert not torch.equal(v1[0][0], BatchSampler(tokens, 8, 4, seed=0).next()[0])
    halves = [fixed_batches(tokens, 8, 4, 3, rank=r, world=2) for r in range(2)]
    assert torch.equal(torch.cat([halves[0][1][0], halves[1][1][0]]), v1[1][0])


@pytest.mark.parametrize("source, quoted", [
    ("'corpus.txt'", True), ("'data/corpus.txt'", True), ('"corpus.txt"', True),
    ("it's.txt", False), ("other.txt", False)])
def test_a_missing_path_in_quotes_is_told_they_are_part_of_it(tmp_path, source, quoted):
    """--set "train.data='c.txt'" (the shell keeps inner quotes) was told only that
    .../'c.txt' does not exist, with the kinds of data to give; quotes at an end of the
    path are now said to be part of its name."""
    (tmp_path / "corpus.txt").write_text("x" * 1000)  # there, without the quotes
    with pytest.raises(DataError, match="does not exist") as info:
        open_corpus(source, base_dir=tmp_path)
    assert ("its quotes are part of the name" in str(info.value)) == quoted
