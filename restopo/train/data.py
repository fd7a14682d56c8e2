"""Training data: corpora of token ids and the seeded batch sampler.

A `data:` value is one of
  builtin:stdlib      the Python standard library's own .py sources on this machine,
                      byte-level (vocab 256), prepared once into a cached memory-mapped file
  PATH.txt | FOLDER   a text file or a folder of text files, byte-level (vocab 256); a
                      folder's binary files (a NUL byte in the first 8000) are skipped, and
                      a binary file given alone is refused
  PATH.bin | FOLDER   pre-tokenized uint16 token ids (nanoGPT's format): a folder holding
                      train.bin and val.bin, or one .bin split deterministically

Batches: `batch` in the spec is the GLOBAL batch of one optimizer step. Every rank draws the
same window offsets from one seeded generator and keeps its own contiguous slice of them,
so 2 processes x batch/2 see exactly the rows 1 process x batch sees (and gradient
accumulation cuts the rank's slice into micro-batches without changing the rows). The
generator state is the data position a checkpoint saves.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..io import atomic_folder, cache_folder, cache_root
from ..spec.datapath import (BINARY_SNIFF, DataPathError, DataPathMissing, check_data_file,
                             data_base, data_files, data_kind, data_mode, data_path,
                             looks_binary)
from ..spec.datapath import shown as _shown
from ..words import counted

BUILTIN_STDLIB = "builtin:stdlib"
BYTE_VOCAB = 256
VAL_FRACTION = 0.05          # share of files (or of the tail) held out for validation
STDLIB_CAP_BYTES = 16 << 20  # keeps preparation to seconds on any machine
FINGERPRINT_BYTES = 1 << 20  # read at each end of each split by Corpus.fingerprint
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
              "idlelib"}


class DataError(ValueError):
    """Training data that cannot be used; the message says what to do (printed, no traceback).

    `where` names the spec value at fault (section, key), so the command can point at its
    line: ("train", "data") by default. `missing`: nothing is at the path at all (a run's
    data moved since it trained: the command can say how to give its new place).
    """

    def __init__(self, message: str, where: tuple[str, str] = ("train", "data"),
                 missing: bool = False):
        super().__init__(message)
        self.where, self.missing = where, missing


@dataclass
class Corpus:
    """Token ids of one corpus: `train` and `val` are 1-D integer arrays (often memmaps).

    `whole`: the one sequence val was cut from the end of, when it was (a tail split); else
    train and val are apart in their source (train.bin and val.bin, files held out by name).
    """

    train: np.ndarray
    val: np.ndarray
    vocab: int          # ids are < vocab
    description: str
    whole: np.ndarray | None = None

    def parts(self, split: str) -> list[np.ndarray]:
        """The token sequences of `split` ("train", "val" or "all"), each contiguous in its
        source: a window of text must not run from one into the next (the end of train.bin
        is not followed by the start of val.bin)."""
        if split == "all":
            return [self.whole] if self.whole is not None else [self.train, self.val]
        return [{"train": self.train, "val": self.val}[split]]

    @property
    def byte_level(self) -> bool:
        """Raw bytes (vocab 256 by construction), as opposed to pre-tokenized ids."""
        return self.train.dtype == np.uint8

    @functools.cached_property
    def fingerprint(self) -> dict:
        """What a checkpoint records of the data it trained on, for resuming to tell a
        changed corpus: the split sizes, and a SHA-256 of each split's first and last MiB
        (at most 4 MiB read, whatever the corpus's size; once a run: a resume compares it
        with its checkpoint's and records it in its own)."""
        h = hashlib.sha256()
        for part in (self.train, self.val):
            n = FINGERPRINT_BYTES // part.itemsize
            h.update(np.ascontiguousarray(part[:n]).tobytes())
            h.update(np.ascontiguousarray(part[-n:]).tobytes())
        return {"tokens": [len(self.train), len(self.val)], "sha256": h.hexdigest()}

    def check(self, spec_vocab: int, context: int) -> None:
        """Raise DataError unless the spec's model can train on this corpus."""
        if self.vocab > spec_vocab:
            what = ("byte-level data needs model.vocab >= 256" if self.byte_level else
                    f"token ids go up to {self.vocab - 1}, so model.vocab must be at least "
                    f"{self.vocab}")
            raise DataError(f"{self.description}: vocab mismatch: {what}; the spec has "
                            f"vocab {spec_vocab} (set it with --set model.vocab={self.vocab})",
                            ("model", "vocab"))
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < context + 1:
                raise DataError(
                    f"{self.description}: the {name} split has "
                    f"{counted(len(part), 'token')}, fewer than context + 1 = {context + 1:,}; "
                    f"use more text or a smaller model.context")


def open_corpus(source: str, *, base_dir: str | os.PathLike | None = None,
                cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Corpus:
    """The corpus named by a spec's `data:` value (see the module docstring)."""
    source = source.strip()
    if not source:
        raise DataError("train.data is empty; use builtin:stdlib or a path to text or .bin data")
    if source == BUILTIN_STDLIB:
        return stdlib_corpus(cache_dir, progress=progress)
    if source.startswith("builtin:"):
        raise DataError(f"unknown builtin corpus {source!r}; the builtin corpus is "
                        f"{BUILTIN_STDLIB}")
    try:
        path = data_path(source, base_dir)
        mode = data_mode(path)
        files = data_files(path, mode)
    except DataPathError as e:
        raise DataError(str(e), missing=isinstance(e, DataPathMissing)) from None
    if data_kind(path, mode) == "ids":
        return _bin_folder(path, *files) if stat.S_ISDIR(mode) else _bin_file(path)
    return _text_folder(path) if stat.S_ISDIR(mode) else _text_file(path)


def source_kind(source: str, base_dir: str | os.PathLike | None = None) -> str | None:
    """What open_corpus reads `source` as, without reading it: "bytes" (text, byte-level) or
    "ids" (uint16 token ids); None when that cannot be told (nothing there, an unknown
    builtin)."""
    source = source.strip()
    if source == BUILTIN_STDLIB:
        return "bytes"
    if not source or source.startswith("builtin:"):
        return None
    try:
        path = data_path(source, base_dir)
        return data_kind(path, data_mode(path))
    except DataPathError:
        return None


def trained_on(spec) -> str | None:
    """What `spec`'s run trained on, its train.data read from where the run read it: "bytes"
    (text) or "ids" (.bin token ids); None when that cannot be told (no train section, its
    data gone)."""
    return None if spec.train is None else source_kind(spec.train.data, data_base(spec))


def reads_bytes(vocab: int, kind: str | None) -> bool:
    """Whether a model's tokens are bytes: trained on text (a vocab above 256 too, its ids
    past 255 unused), else, with its data not known (trained_on: None), a vocab of 256."""
    return kind == "bytes" if kind is not None else vocab == 256


# --- builtin:stdlib ----------------------------------------------------------------------

def stdlib_files(root: str | None = None) -> list[tuple[str, int]]:
    """(relative path, size) of the standard library's .py files, sorted, within the cap."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                found.append((os.path.relpath(full, root), os.path.getsize(full)))
    found.sort()
    kept, total = [], 0
    for rel, size in found:
        if total + size > STDLIB_CAP_BYTES:
            break
        kept.append((rel, size))
        total += size
    return kept


def is_val_file(rel: str) -> bool:
    """The deterministic split: a file belongs to validation by a hash of its path."""
    return hashlib.sha1(rel.encode()).digest()[0] < int(256 * VAL_FRACTION)


def stdlib_corpus(cache_dir=None, *, progress: bool = True, root: str | None = None) -> Corpus:
    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    if not files:
        raise DataError(f"builtin:stdlib: no .py files found under {root}")
    key = hashlib.sha1(json.dumps([sys.version, root, files]).encode()).hexdigest()[:16]
    folder = cache_root(cache_dir) / f"stdlib-{key}"
    if not (folder / "meta.json").is_file():
        cache_folder(cache_dir=cache_dir)  # or an error that names RESTOPO_CACHE
        _prepare_stdlib(root, files, folder, progress)
    train = np.memmap(folder / "train.u8", dtype=np.uint8, mode="r")
    val = np.memmap(folder / "val.u8", dtype=np.uint8, mode="r")
    return Corpus(train, val, BYTE_VOCAB, f"builtin:stdlib ({counted(len(files), 'file')})")


def _prepare_stdlib(root: str, files, folder: Path, progress: bool) -> None:
    """Concatenate the files into train/val byte files; the folder appears whole or not at all
    (restopo.io.atomic_folder: two ranks preparing at once both succeed, the first rename
    wins and the other's identical copy is dropped)."""
    from tqdm import tqdm

    with atomic_folder(folder, keep_existing=True) as tmp:
        sizes = {"train": 0, "val": 0}
        with open(tmp / "train.u8", "wb") as ftrain, open(tmp / "val.u8", "wb") as fval:
            bar = tqdm(files, desc="preparing builtin:stdlib", unit="file",
                       disable=not progress, file=sys.stderr, leave=False)
            for rel, _ in bar:
                try:
                    data = Path(root, rel).read_bytes()
                except OSError:
                    continue  # an unreadable file only shrinks the corpus
                split = "val" if is_val_file(rel) else "train"
                (fval if split == "val" else ftrain).write(data)
                sizes[split] += len(data)
        (tmp / "meta.json").write_text(json.dumps({"root": root, "files": len(files), **sizes}))


# --- text -------------------------------------------------------------------------------

def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None


def _checked(path: Path, kind: str) -> None:
    """check_data_file's refusal (what `restopo check` says too) as a DataError."""
    try:
        check_data_file(path, kind)
    except DataPathError as e:
        raise DataError(str(e)) from None


def _text_file(path: Path) -> Corpus:
    _checked(path, "bytes")
    try:
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None
    train, val = tail_split(tokens)
    return Corpus(train, val, BYTE_VOCAB, f"text file {path}", tokens)


# A text folder is read whole into memory: bounded, so `data: "~"` is an error, not an
# hour of reading the home folder. Raise the bounds with these environment variables.
MAX_FOLDER_FILES = ("RESTOPO_DATA_MAX_FILES", 100_000)
MAX_FOLDER_BYTES = ("RESTOPO_DATA_MAX_BYTES", 1 << 30)


def _limit(setting: tuple[str, int]) -> int:
    name, default = setting
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise DataError(f"${name} must be a positive whole number, got {text!r}")
    return value


def folder_files(path: Path) -> list[Path]:
    """The regular files under `path`, sorted, hidden files and folders skipped, symbolic
    links to folders not followed; DataError past the file-count or byte bound."""
    max_files, max_bytes = _limit(MAX_FOLDER_FILES), _limit(MAX_FOLDER_BYTES)
    found, total = [], 0
    for dirpath, dirnames, filenames in os.walk(path, onerror=_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue  # a dangling link: not data
            if not stat.S_ISREG(st.st_mode):
                continue  # pipes and devices would block or never end
            found.append(p)
            total += st.st_size
            if len(found) > max_files or total > max_bytes:
                what = (f"more than {max_files:,} files" if len(found) > max_files
                        else f"more than {max_bytes:,} bytes")
                env = (MAX_FOLDER_FILES if len(found) > max_files else MAX_FOLDER_BYTES)[0]
                raise DataError(f"data folder {_shown(path)} holds {what}, the most a text "
                                f"folder may (it is read into memory whole); point data: at a "
                                f"smaller folder, or set {env} to raise the bound")
    return sorted(found)  # the order the corpus has always had (by path parts)


def _walk_error(e: OSError) -> None:
    raise DataError(f"cannot read data folder {_shown(Path(e.filename or '?'))}: "
                    f"{e.strerror or e}")


def _text_folder(path: Path) -> Corpus:
    files = folder_files(path)
    if not files:
        raise DataError(f"data folder {str(path)!r} holds no files (hidden files and folders "
                        f"are skipped)")
    shards = [p for p in files if p.suffix.lower() == ".bin"]
    if shards:  # token ids (shards of a tokenized corpus?) would train as byte text
        raise DataError(f"data folder {str(path)!r} holds .bin files ({shards[0].name}"
                        + (f" and {len(shards) - 1} more" if len(shards) > 1 else "")
                        + ") but no train.bin: a folder is read as text unless it holds "
                        "train.bin and val.bin; name the token ids so, or point data: at "
                        "one .bin file")
    parts, binary = {"train": [], "val": []}, []
    for p in files:
        rel = p.relative_to(path).as_posix()
        data = _read_bytes(p)
        if looks_binary(data):  # an image, a .pyc, a PDF beside the text: not training text
            binary.append(rel)
            continue
        parts["val" if is_val_file(rel) else "train"].append(data)
    train, val = b"".join(parts["train"]), b"".join(parts["val"])
    if binary and len(binary) == len(files):
        raise DataError(f"data folder {str(path)!r} holds only binary files (a NUL byte in "
                        f"the first {BINARY_SNIFF:,} bytes, as in {binary[0]}); a folder is "
                        f"read as text; for token ids give train.bin and val.bin")
    if not train and not val:
        raise DataError(f"data folder {str(path)!r} holds only empty files")
    kept = len(files) - len(binary)
    desc = f"text folder {path} ({counted(kept, 'file')}"
    if binary:
        desc += (f"; {len(binary)} binary skipped: {binary[0]}"
                 + (f" and {len(binary) - 1} more" if len(binary) > 1 else ""))
    desc += ")"
    if len(train) < 2 * len(val) or not val:
        # too few files for a split by file: hold out the tail of the whole text instead
        whole = np.frombuffer(train + val, dtype=np.uint8)
        return Corpus(*tail_split(whole), BYTE_VOCAB, desc, whole)
    return Corpus(np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8),
                  BYTE_VOCAB, desc)


def tail_split(tokens: np.ndarray, fraction: float = VAL_FRACTION):
    """(train, val): the last `fraction` of the tokens is validation."""
    cut = len(tokens) - max(1, int(len(tokens) * fraction))
    return tokens[:cut], tokens[cut:]


# --- pre-tokenized uint16 ---------------------------------------------------------------

def _memmap_u16(path: Path) -> np.ndarray:
    _checked(path, "ids")
    try:
        return np.memmap(path, dtype=np.uint16, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None


def _max_id(*arrays: np.ndarray) -> int:
    top, step = 0, 1 << 24
    for a in arrays:
        for at in range(0, len(a), step):  # chunked: a memmap is scanned, never copied whole
            top = max(top, int(a[at : at + step].max()))
    return top


def _bin_folder(path: Path, train_file: Path, val_file: Path) -> Corpus:
    train, val = _memmap_u16(train_file), _memmap_u16(val_file)
    return Corpus(train, val, _max_id(train, val) + 1, f"token ids {path}")


def _bin_file(path: Path) -> Corpus:
    tokens = _memmap_u16(path)
    train, val = tail_split(tokens)
    return Corpus(train, val, _max_id(tokens) + 1, f"token ids {path}", tokens)


# --- batches ----------------------------------------------------------------------------

def _windows(tokens: np.ndarray, offsets: torch.Tensor, context: int):
    rows = np.stack([np.asarray(tokens[o : o + context + 1], dtype=np.int64)
                     for o in offsets.tolist()])
    xy = torch.from_numpy(rows)
    return xy[:, :-1], xy[:, 1:]


class BatchSampler:
    """Random windows of context + 1 tokens from a seeded generator (see the module doc).

    `next()` returns this rank's (x, y) rows of the next global batch, each [rows, context].
    """

    def __init__(self, tokens: np.ndarray, context: int, batch: int, *, seed: int,
                 rank: int = 0, world: int = 1):
        if batch % world:
            raise DataError(f"train.batch ({batch}) is the global batch and must be divisible "
                            f"by the number of processes ({world})", ("train", "batch"))
        self.tokens, self.context, self.batch = tokens, context, batch
        self.rank, self.world = rank, world
        self.high = len(tokens) - context  # offsets 0 .. high-1 leave room for the target
        self.generator = torch.Generator().manual_seed(seed)

    def next(self):
        offsets = torch.randint(0, self.high, (self.batch,), generator=self.generator)
        per = self.batch // self.world
        return _windows(self.tokens, offsets[self.rank * per : (self.rank + 1) * per],
                        self.context)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


VAL_SEED = 7919


def fixed_batches(tokens: np.ndarray, context: int, batch: int, count: int, *,
                  seed: int = VAL_SEED, rank: int = 0, world: int = 1):
    """The same `count` validation batches every time (this rank's rows of each). The seed
    is not the training seed: runs with different seeds are scored on the same windows."""
    sampler = BatchSampler(tokens, context, batch, seed=seed, rank=rank, world=world)
    return [sampler.next() for _ in range(count)]
