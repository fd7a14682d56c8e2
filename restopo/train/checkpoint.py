"""Checkpoints that a crash can never leave half-written, and that are never trusted unread.

Layout under a run's checkpoint folder (OUT/ckpt):
    step_000100/model.safetensors   weights (tied tensors stored once, safetensors.torch)
    step_000100/optimizer.pt        optimizer state_dict (tensors and numbers only; only
                                    resuming reads it: RESUME_ONLY)
    step_000100/state.pt            RNG states, data position (tensors and numbers only;
                                    only resuming needs it: RESUME_ONLY)
    step_000100/meta.json           step, spec text, overrides, schedule
    step_000100/manifest.json       size and SHA-256 of each file above; written last
    latest                          the name of the newest complete step folder
    damaged/step_000090             a checkpoint that failed its checks, moved aside by
                                    `restopo train` (never deleted: it may still be read)

A run whose processes each hold part of the model (pipeline stages, FSDP) saves the sharded
layout instead (shards.py: one safetensors share per rank, index.json, state.safetensors,
meta.json, manifest.json): `save_sharded` is called by every rank; each writes its share into
the step's temporary folder, and after a barrier rank 0 writes the rest, renames the folder
into place and moves `latest`, so a crash before that leaves the previous checkpoint whole.
Everything below (verification, fallback, pruning, loading) treats both layouts alike;
`load_checkpoint` fills a whole model from either, and `shards.Reader` reads any layout's
tensors by name for another layout.

A save writes a hidden temporary folder, fsyncs every file, renames the folder into place
(restopo.io.replace_folder), then replaces `latest` (restopo.io.write_atomic). Interrupted
anywhere, the previous `latest` still names a complete checkpoint. The new checkpoint is
then read back against its manifest, and only once it verifies are older ones pruned
(renamed aside first, so a kill mid-delete leaves nothing that looks like a checkpoint).

Loading verifies the manifest (every byte of every file), then checks what state.pt and
meta.json hold against the schema the loop writes, before anything is used: a flipped bit,
a truncated file or a hand-edited value is a CheckpointError that says which file and why,
and `find_resumable` falls back to the newest checkpoint that passes. Loading reads
safetensors and torch.load(weights_only=True) only: nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..io import fsync_file, full_disk_said, new_mode, replace_folder, write_atomic
from ..words import alts
from .shards import INDEX, STATE, Reader, ShardError, files_in_index, is_sharded, \
    load_named, read_state_file, shard_name, write_share, write_state

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FILES = ("model.safetensors", "optimizer.pt", "state.pt", "meta.json")
SHARDED_FILES = (INDEX, STATE, "meta.json")  # and the shards index.json names
# Files only resuming reads: a checkpoint without them (deleted to save space) still holds
# a model that eval, export and generate load. Each function that takes `resume` asks for
# them when it is True (training on), and does without them when it is False.
RESUME_ONLY = ("optimizer.pt", "state.pt")
MANIFEST = "manifest.json"
DAMAGED = "damaged"
# Leftovers of an interrupted save, prune or atomic write (removed by `clean_leftovers`).
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".pruned-", ".restopo-", ".latest-")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded (message names the path)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# -- the manifest -----------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_files(step_dir: str | os.PathLike) -> tuple[str, ...] | None:
    """The files a step folder holds besides its manifest: FILES, or for the sharded layout
    index.json, state, meta and every shard the index names (None: the index is unreadable)."""
    step_dir = Path(step_dir)
    if not is_sharded(step_dir):
        return FILES
    try:
        return SHARDED_FILES + files_in_index(json.loads((step_dir / INDEX).read_text()))
    except (OSError, ValueError):
        return None


def needed_files(step_dir: str | os.PathLike, resume: bool = True) -> tuple[str, ...] | None:
    """The files of `step_dir` that resuming (`resume`) or loading its model needs."""
    files = checkpoint_files(step_dir)
    return files if resume or files is None else tuple(f for f in files
                                                        if f not in RESUME_ONLY)


def write_manifest(step_dir: str | os.PathLike) -> None:
    """manifest.json: size and SHA-256 of every checkpoint file, and its own hash, written
    in one canonical form (so a changed byte anywhere in it is seen too)."""
    step_dir = Path(step_dir)
    files = {name: {"bytes": (step_dir / name).stat().st_size,
                    "sha256": _sha256(step_dir / name)} for name in checkpoint_files(step_dir)}
    body = {"format": 1, "files": files}
    (step_dir / MANIFEST).write_bytes(
        _canonical({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()}))


_VERIFIED: dict[str, tuple] = {}  # folder -> stat of its files when they last verified


def _signature(step_dir: Path) -> tuple | None:
    files = checkpoint_files(step_dir)
    try:
        return tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in
                     (os.stat(step_dir / name) for name in files + (MANIFEST,)))
    except (OSError, TypeError):
        return None


def verify_checkpoint(step_dir: str | os.PathLike, resume: bool = True) -> str | None:
    """Why the files of `step_dir` are not what was saved (a short reason naming the file),
    or None when every file matches its manifest. A folder saved before restopo wrote
    manifests (no manifest.json, every file present) passes: see `has_manifest`. Files
    unchanged since they last verified in this process are not read again. `resume`
    False: the files of RESUME_ONLY may be missing (those present are verified)."""
    step_dir = Path(step_dir)
    files = needed_files(step_dir, resume)
    if files is None:
        return f"{INDEX} unreadable"
    missing = [f for f in files if not (step_dir / f).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    if not has_manifest(step_dir):
        return None
    key, signature = str(step_dir.resolve()), _signature(step_dir)
    if signature is not None and _VERIFIED.get(key) == signature:
        return None
    damage = _verify_manifest(step_dir)
    if damage is None and signature is not None:
        _VERIFIED[key] = signature
    return damage


def _verify_manifest(step_dir: Path) -> str | None:
    try:
        raw = (step_dir / MANIFEST).read_bytes()
        manifest = json.loads(raw)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"} \
        if isinstance(manifest, dict) else None
    if (body is None or raw != _canonical(manifest) or body.get("format") != 1
            or manifest.get("manifest_sha256") != hashlib.sha256(_canonical(body)).hexdigest()
            or not isinstance(body.get("files"), dict)
            or sorted(body["files"]) != sorted(checkpoint_files(step_dir) or ())):
        return f"{MANIFEST} does not match its own checksum"
    for name in checkpoint_files(step_dir):
        want = body["files"][name]
        path = step_dir / name
        if name in RESUME_ONLY and not path.exists():  # verify_checkpoint allowed it
            continue
        try:
            size = path.stat().st_size
            if not isinstance(want, dict) or size != want.get("bytes"):
                return f"{name} has {size:,} bytes, the manifest says {want.get('bytes')}"
            if _sha256(path) != want.get("sha256"):
                return f"{name} does not match its SHA-256 checksum"
        except OSError as e:
            return f"{name} unreadable ({e.strerror or e})"
    return None


def holding_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint step folder that `path` is in (or is), else None: what restopo must
    never write into from outside a save, since its manifest vouches for every byte."""
    here = Path(os.path.abspath(path))
    for folder in (here, *here.parents):
        if STEP_DIR.match(folder.name) and (folder / MANIFEST).is_file():
            return folder
    return None


def holding_checkpoints(path: str | os.PathLike) -> Path | None:
    """The checkpoint folder of a run (RUN/ckpt: step folders or `latest`) that `path` is in
    (or is), else None: the run prunes what is there, and --overwrite deletes it whole."""
    here = Path(os.path.abspath(path))
    for folder in (here, *here.parents):
        if folder.name == "ckpt" and ((folder / "latest").is_file()
                                      or list_checkpoints(folder, resume=False)):
            return folder
    return None


def has_manifest(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / MANIFEST).exists()


# -- saving -------------------------------------------------------------------------------
def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, state: dict, meta: dict,
                    keep: int = 3, _write_file=None) -> Path:
    """Save one checkpoint atomically and point `latest` at it; once it reads back intact,
    keep the newest `keep` (older ones are pruned; if it does not verify, none are).

    `state` holds tensors and plain numbers (RNG states, data position); `meta` is JSON.
    `_write_file(name, path)` runs after each file is written (tests use it to fail midway).
    """
    from safetensors.torch import save_model

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        writers = {
            "model.safetensors": lambda p: save_model(model, str(p)),
            "optimizer.pt": lambda p: torch.save(
                optimizer.state_dict() if optimizer is not None else {}, p),
            "state.pt": lambda p: torch.save(state, p),
            "meta.json": lambda p: p.write_text(json.dumps({**meta, "step": step}, indent=1)),
            MANIFEST: write_manifest,
        }
        for name in FILES + (MANIFEST,):
            path = tmp if name == MANIFEST else tmp / name
            with full_disk_said(final):
                writers[name](path)
            os.chmod(tmp / name, new_mode())  # safetensors writes 0600: use the umask
            fsync_file(tmp / name)
            if _write_file is not None:
                _write_file(name, tmp / name)
        replace_folder(tmp, final)  # a same-step folder from a restarted run is swapped out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(root / "latest", final.name + "\n")
    damage = verify_checkpoint(final)
    if damage is not None:
        raise CheckpointError(f"checkpoint {final} did not read back intact ({damage}); the "
                              f"older checkpoints are kept. Is the disk failing or full?")
    _prune(root, keep)
    return final


# Tests set this to STEP_FOLDER/FILE (or STEP_FOLDER/rename, STEP_FOLDER/latest) to kill the
# process that has just written that file of that step, as a crash there would.
CRASH_AFTER = "RESTOPO_CRASH_AFTER"


def _crash_point(step_dir: Path, name: str) -> None:
    if os.environ.get(CRASH_AFTER) == f"{step_dir.name}/{name}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def save_sharded(root: str | os.PathLike, step: int, named, optimizer, state: dict | None,
                 meta: dict | None, *, rank: int, world: int, exchange, keep: int = 3,
                 layout: str = "") -> Path:
    """Save one sharded checkpoint; called by every rank of the run.

    Each rank writes its share (the parameters `named` [(name, param)] it owns, whole or its
    FSDP rows, and their AdamW state; shards.share) into the step's temporary folder.
    `exchange(obj)` hands a JSON-able object to every rank and returns all ranks' (it is
    also the barrier). Once every share is written, rank 0 writes state.safetensors
    (`state`), meta.json (`meta`), index.json and manifest.json, renames the folder into
    place and moves `latest`; it then verifies the checkpoint and prunes older ones, as
    `save_checkpoint` does. A crash before the rename leaves `latest` on the previous
    checkpoint. Every rank raises CheckpointError if any rank failed."""
    from .shards import share

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-sharded"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
            tmp.mkdir()
        except OSError as e:
            error = f"cannot make {tmp}: {e.strerror or e}"
    _agree(exchange(error))
    file, entries = shard_name(rank, world), {}
    try:
        tensors, entries = share(named, optimizer)
        with full_disk_said(final):
            write_share(tmp / file, tensors)
        os.chmod(tmp / file, new_mode())
        fsync_file(tmp / file)
    except (OSError, ShardError) as e:
        error = f"rank {rank} could not write {file}: {_one_line(e)}"
    _crash_point(final, file)
    parts = exchange({"file": file, "entries": entries, "error": error})
    _agree([p["error"] for p in parts])
    if rank == 0:
        try:
            _commit_sharded(root, tmp, final, parts, state, meta, step, world, layout)
        except (OSError, ShardError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = _one_line(e)
    _agree(exchange(error))
    if rank == 0:
        _prune(root, keep)
    return final


def _commit_sharded(root: Path, tmp: Path, final: Path, parts, state, meta, step, world,
                    layout) -> None:
    from .shards import build_index

    index = build_index([(p["file"], p["entries"]) for p in parts], world, layout)
    writers = {
        STATE: lambda p: write_state(p, state),
        "meta.json": lambda p: p.write_text(json.dumps({**meta, "step": step}, indent=1)),
        INDEX: lambda p: p.write_text(json.dumps(index, indent=1)),
    }
    for name in SHARDED_FILES + (MANIFEST,):
        if name == MANIFEST:
            write_manifest(tmp)
        else:
            with full_disk_said(final):
                writers[name](tmp / name)
        os.chmod(tmp / name, new_mode())
        fsync_file(tmp / name)
        _crash_point(final, name)
    replace_folder(tmp, final)  # a same-step folder from a restarted run is swapped out
    _crash_point(final, "rename")
    write_atomic(root / "latest", final.name + "\n")
    _crash_point(final, "latest")
    damage = verify_checkpoint(final)
    if damage is not None:
        raise CheckpointError(f"checkpoint {final} did not read back intact ({damage}); the "
                              f"older checkpoints are kept. Is the disk failing or full?")


def _agree(errors) -> None:
    """Raise the first rank's error on every rank (errors: what each rank reported)."""
    errors = errors if isinstance(errors, list) else [errors]
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(f"saving a sharded checkpoint failed: {first}")


def _complete(path: Path, resume: bool = True) -> bool:
    files = needed_files(path, resume)
    return files is not None and all((path / f).is_file() for f in files)


def list_checkpoints(root: str | os.PathLike, resume: bool = True) -> list[Path]:
    """Complete step folders (every file present, or every file but RESUME_ONLY's when not
    `resume`; not yet verified), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and p.is_dir() and _complete(p, resume)]
    return [p for _, p in sorted(found)]


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (the newest has just verified). Each is
    renamed aside before it is deleted, so a kill mid-delete leaves a `.pruned-` folder
    (swept by the next save or start), never a half-deleted step folder."""
    for p in list_checkpoints(root)[:-keep] if keep > 0 else []:
        aside = root / f".pruned-{p.name}-{os.getpid()}"
        os.replace(p, aside)
        shutil.rmtree(aside, ignore_errors=True)
    for p in root.iterdir():  # leftovers of saves and prunes that crashed
        if p.name.startswith((".tmp-", ".old-", ".pruned-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def clean_leftovers(root: str | os.PathLike) -> list[str]:
    """Remove what interrupted saves, prunes and atomic writes left in a checkpoint folder
    (temporary and half-pruned folders, temporary files), and move step folders missing a
    file into damaged/. Call it only while holding the run's lock. Returns what it did."""
    root = Path(root)
    done = remove_leftovers(root)
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if _incomplete_step(p):
            why = verify_checkpoint(p) or "files missing"  # before the move: its own files
            done.append(f"moved {p.name} to {quarantine(p).relative_to(root)} "
                        f"(incomplete: {why})")
    return done


def remove_leftovers(folder: Path) -> list[str]:
    """Remove the temporary files and folders (LEFTOVER_PREFIXES) that interrupted writes
    left in `folder`; what was removed."""
    done = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        if p.name.startswith(LEFTOVER_PREFIXES):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            done.append(f"removed {p.name}")
    return done


def quarantine(step_dir: Path) -> Path:
    """Move a checkpoint that failed its checks to ROOT/damaged/ (kept, never trusted)."""
    dest_root = step_dir.parent / DAMAGED
    dest_root.mkdir(exist_ok=True)
    dest, n = dest_root / step_dir.name, 1
    while dest.exists():
        n += 1
        dest = dest_root / f"{step_dir.name}.{n}"
    os.replace(step_dir, dest)
    return dest


def gone_step(path: Path) -> str | None:
    """What to give instead of a step folder that is not there (None: `path` is no step
    folder, or none is beside it): the steps its ckpt/ folder still holds, since a run
    prunes its older checkpoints and a step seen there once may be gone."""
    if not STEP_DIR.match(path.name):
        return None
    held = [p.name for p in list_checkpoints(path.parent, resume=False)]
    if not held:
        return None
    from ..spec.objects import TrainSpec
    said = alts(held) if len(held) <= 4 else f"{held[0]} to {held[-1]} ({len(held)} in all)"
    return (f"give one {path.parent} holds: {said} (a run keeps its newest train.keep "
            f"checkpoints, {TrainSpec.keep} unless set)")


def missing(path: Path, give: str | None = None) -> str:
    """What every command taking a run or checkpoint (generate, eval, export, diagnose,
    restopo.load) says of one that is not there: `give`, or the steps still held beside a
    pruned step folder."""
    return f"{path}: no such file or folder; " + (gone_step(path) or give or GIVE_CHECKPOINT)


def step_of(path: Path) -> int:
    """The step a step_NNNNNN folder holds (-1 for any other name)."""
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def latest_checkpoint(root: str | os.PathLike, resume: bool = True) -> Path | None:
    """The folder `latest` names, or the newest complete one if the pointer is missing or
    stale (a crash between the folder rename and the pointer update). Not verified: see
    `find_resumable`."""
    root = Path(root)
    pointer = root / "latest"
    candidates = list_checkpoints(root, resume)
    if pointer.is_file():
        named = root / pointer.read_text(errors="replace").strip()
        if STEP_DIR.match(named.name) and named.is_dir() and _complete(named, resume):
            newer = [p for p in candidates if step_of(p) > step_of(named)]
            return newer[-1] if newer else named
    return candidates[-1] if candidates else None


def newest_meta(root: str | os.PathLike) -> tuple[Path | None, dict]:
    """(step folder, its meta.json) of the newest checkpoint under `root` whose meta.json
    reads, newer ones with a damaged meta.json passed over (as `restopo train --resume`
    passes over them); (None, {}) when none does. Files are not verified: for what a
    report or a sweep reads of a run (its step, spec and overrides), not to resume from
    (so a checkpoint without its optimizer state counts)."""
    newest = latest_checkpoint(root, resume=False)
    older = [q for q in reversed(list_checkpoints(root, resume=False)) if q != newest]
    for p in ([newest] if newest is not None else []) + older:
        try:
            return p, read_meta(p)
        except CheckpointError:
            continue
    return None, {}


def check_checkpoint(step_dir: str | os.PathLike, resume: bool = True) -> str | None:
    """Why `step_dir` cannot be resumed from (`resume`), or its model loaded (damaged
    files, or contents that do not fit the schema), or None when it can."""
    step_dir = Path(step_dir)
    damage = verify_checkpoint(step_dir, resume)
    if damage is not None:
        return damage
    try:
        meta = read_meta(step_dir)
        _state_if_there(step_dir, meta, resume)
    except CheckpointError as e:
        return str(e).removeprefix(f"cannot load checkpoint {step_dir}: ")
    return None


def find_resumable(root: str | os.PathLike, resume: bool = True
                   ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that verifies and fits the schema (with what
    resuming needs: `resume`), and the newer ones passed over, each with why (newest
    first)."""
    skipped = []
    for p in reversed(list_checkpoints(root, resume)):
        why = check_checkpoint(p, resume)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


GIVE_CHECKPOINT = "give a run folder (with ckpt/), its ckpt/ folder or a ckpt/step_NNNNNN folder"


def resolve_checkpoint(path: str | os.PathLike, say=None) -> Path:
    """A step folder from a step folder, a checkpoint folder (with `latest`) or a run folder
    (with ckpt/): the newest whose model verifies (its optimizer state may be gone: see
    RESUME_ONLY); `say(line)` hears of each one passed over. Raises CheckpointError
    saying what was looked for."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(missing(p))
    if p.is_dir() and _complete(p, resume=False):
        why = check_checkpoint(p, resume=False)
        if why is not None:
            run = next((q.parent for q in p.parents if q.name == "ckpt"), p.parent)
            raise CheckpointError(f"checkpoint {p} is damaged: {why}; give its run folder "
                                  f"({run}) to use the newest one that verifies")
        return _unverified_said(p, say)
    if p.is_dir() and STEP_DIR.match(p.name) and not (p / "ckpt").is_dir():
        # a step folder given, missing a file: say which
        raise CheckpointError(f"checkpoint {p} is incomplete: "
                              f"{verify_checkpoint(p, resume=False)}; give "
                              "its run folder to use the newest complete one")
    for root in (p, p / "ckpt"):
        found, skipped = find_resumable(root, resume=False)
        # newer step folders missing a file are passed over too, and said so (a damaged
        # file was; a missing one was not, and an older step was used without a word)
        skipped += [(q, f"incomplete: {verify_checkpoint(q, resume=False)}")
                    for q in _incomplete(root)
                    if found is None or step_of(q) > step_of(found)]
        for bad, why in sorted(skipped, key=lambda x: -step_of(x[0])):
            if say is not None:
                say(f"{bad} is damaged ({why}); passing over it")
        if found is not None:
            return _unverified_said(found, say)
        if skipped:
            raise CheckpointError(f"no intact checkpoint in {str(root)!r}: "
                                  + "; ".join(f"{b.name}: {w}" for b, w in skipped))
    runs = runs_in(p)
    if runs:  # a folder of runs where one run is wanted: name runs to give instead
        # a sweep's runs keep its run.json; runs/, where train puts runs, is no sweep's
        kind = ("a sweep's folder (a folder of runs)" if any(
            (r / "run.json").is_file() for r in runs) else "a folder of runs")
        raise CheckpointError(f"{str(p)!r} is {kind}, not one run; give one of its runs, e.g. "
                              + " or ".join(repr(str(r)) for r in runs[:2]))
    raise CheckpointError(f"no complete checkpoint in {str(p)!r}; {GIVE_CHECKPOINT}")


def runs_in(p: Path) -> list[Path]:
    """The run folders (with ckpt/) inside `p`, those with a complete checkpoint first."""
    if not p.is_dir():
        return []
    runs = sorted(q for q in p.iterdir() if (q / "ckpt").is_dir())
    return sorted(runs, key=lambda q: not list_checkpoints(q / "ckpt", resume=False))


def _incomplete(root: Path) -> list[Path]:
    """Step folders under `root` missing a file a model needs."""
    return [q for q in root.iterdir() if _incomplete_step(q)] if root.is_dir() else []


def _incomplete_step(p: Path) -> bool:
    """Whether `p` is a step folder missing a file its model needs (one without just the
    optimizer state is no leftover of a save, which never leaves one: a person removed it,
    and its weights are kept in place)."""
    return bool(STEP_DIR.match(p.name)) and p.is_dir() and not _complete(p, resume=False)


def _unverified_said(step_dir: Path, say) -> Path:
    """`step_dir`, after saying (to `say`) that it has no manifest to verify it by."""
    if say is not None and not has_manifest(step_dir):
        say(f"{step_dir} has no {MANIFEST} (saved before restopo wrote them, or deleted): "
            "its files are used unverified")
    return step_dir


# -- what the files must hold -----------------------------------------------------------
_META_TYPES = {"step": int, "spec_text": str, "spec_path": str, "data_base": str,
               "title": str, "world": int, "config": dict, "data": dict,
               "loss": (int, float, type(None)), "val_loss": (int, float, type(None))}


def read_meta(step_dir: str | os.PathLike) -> dict:
    """meta.json, checked: a JSON object whose known keys have the types the loop wrote."""
    path = Path(step_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"cannot read {path}: not a JSON object")
    for key, kind in _META_TYPES.items():
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise CheckpointError(f"cannot read {path}: '{key}' is {meta[key]!r}, "
                                  f"not {_kind_name(kind)}")
    overrides = meta.get("overrides", [])
    if not (isinstance(overrides, list) and all(isinstance(o, str) for o in overrides)):
        raise CheckpointError(f"cannot read {path}: 'overrides' must be a list of strings, "
                              f"got {overrides!r}"[:300])
    if "step" in meta and meta["step"] < 0:
        raise CheckpointError(f"cannot read {path}: 'step' is negative")
    return meta


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "a whole number", float: "a number", str: "a string", dict: "an object",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def read_state(step_dir: str | os.PathLike, step: int | None = None) -> dict:
    """state.pt, loaded without unpickling and checked: 'step' (that of meta.json), the data
    sampler's and torch's RNG states (each accepted by a scratch generator), 'elapsed'."""
    step_dir = Path(step_dir)
    name = STATE if is_sharded(step_dir) else "state.pt"
    if name == STATE:
        try:
            state = read_state_file(step_dir / STATE)
        except ShardError as e:
            raise CheckpointError(f"cannot load checkpoint {step_dir}: {e}") from None
    else:
        state = _load_pt(step_dir, "state.pt", "cpu")

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"cannot load checkpoint {step_dir}: {name} {what}")

    if not isinstance(state, dict):
        raise bad("is not a dict")
    s = state.get("step")
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        raise bad(f"holds step {s!r}, not a whole number" if "step" in state
                  else "has no 'step'")
    if step is not None and s != step:
        raise bad(f"is for step {s}, but meta.json says step {step}")
    if not isinstance(state.get("elapsed", 0.0), (int, float)):
        raise bad("holds a non-numeric 'elapsed'")
    data = state.get("data")
    if not isinstance(data, dict):
        raise bad("has no data position ('data')")
    for name, rng in (("data position", data.get("generator")),
                      ("torch RNG state", state.get("torch_cpu"))):
        if not _valid_rng_state(rng):
            raise bad(f"holds no valid {name}")
    if "torch_cuda" in state and not (isinstance(state["torch_cuda"], torch.Tensor)
                                      and state["torch_cuda"].dtype == torch.uint8):
        raise bad("holds no valid CUDA RNG state")
    return state


def _valid_rng_state(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        return False
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def refused_pickle(path: Path) -> str:
    """Why torch.load(path, weights_only=True) raised UnpicklingError, in words: a torch
    file (a zip archive) holding more than tensors and numbers, or no torch file at all
    (then torch falls back to reading the bytes as a pickle of its old format)."""
    import zipfile
    if zipfile.is_zipfile(path):
        return "holds objects other than tensors and numbers, which restopo never unpickles"
    return "is not a torch file (torch.save writes a zip archive; these bytes are none)"


def _load_pt(step_dir: Path, name: str, map_location):
    try:
        return torch.load(step_dir / name, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"cannot load checkpoint {step_dir}: {name} "
                              f"{refused_pickle(step_dir / name)}") from None
    except Exception as e:  # torch and OS errors: one line naming the folder
        raise CheckpointError(f"cannot load checkpoint {step_dir}: {name}: {_one_line(e)}") \
            from None


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    text = " ".join(lines)
    return text if len(text) < 300 else text[:300] + "..."


def load_checkpoint(step_dir: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    map_location: str | torch.device = "cpu") -> tuple[dict, dict]:
    """Verify, check and load weights (and optimizer state) in place; returns (state, meta).
    Nothing is loaded into `model` or `optimizer` unless the whole checkpoint verifies."""
    from safetensors.torch import load_model

    step_dir = Path(step_dir)
    if is_sharded(step_dir):
        return load_into(step_dir, model.named_parameters(), optimizer,
                         aliases=tie_aliases(model))
    state, meta = _checked(step_dir, resume=optimizer is not None)
    opt_state = _load_pt(step_dir, "optimizer.pt", map_location) if optimizer else None
    if opt_state is not None and not (isinstance(opt_state, dict)
                                      and isinstance(opt_state.get("state"), dict)
                                      and isinstance(opt_state.get("param_groups"), list)):
        raise CheckpointError(f"cannot load checkpoint {step_dir}: optimizer.pt is not an "
                              f"optimizer state (no 'state' and 'param_groups')")
    try:
        missing, unexpected = load_model(model, str(step_dir / "model.safetensors"),
                                         strict=False, device=str(map_location))
        if missing or unexpected:
            raise CheckpointError(
                f"{step_dir} does not fit this model: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(unexpected)[:4]} (was it saved from another spec?)")
        if opt_state is not None:
            _load_moments(optimizer, opt_state)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors, torch and OS errors: one line naming the folder
        text = _one_line(e)
        if "state_dict" in text or "size" in text:
            text += " (was it saved from another spec?)"
        raise CheckpointError(f"cannot load checkpoint {step_dir}: {text}") from None
    return state, meta


def _load_moments(optimizer: torch.optim.Optimizer, opt_state: dict) -> None:
    """The checkpoint's per-parameter state (AdamW's moments and step) into `optimizer`,
    whose group settings (weight decay, ...) stay this run's, as load_into leaves them:
    load_state_dict brings back the saved ones, so a resume with another
    train.weight_decay kept the old one while saying it used the new."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(opt_state)
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _checked(step_dir: Path, resume: bool = True) -> tuple[dict, dict]:
    """(state, meta) of a checkpoint that verifies against its manifest and schema (with
    the files only resuming needs when `resume`)."""
    damage = verify_checkpoint(step_dir, resume)
    if damage is not None:
        raise CheckpointError(f"cannot load checkpoint {step_dir}: it is damaged: {damage}")
    meta = read_meta(step_dir)
    return _state_if_there(step_dir, meta, resume), meta


def _state_if_there(step_dir: Path, meta: dict, resume: bool) -> dict:
    """The checked state of `step_dir`; {} for a model-only load of a single-process
    checkpoint whose state.pt is gone (RESUME_ONLY: verify_checkpoint allowed it)."""
    if not resume and not is_sharded(step_dir) and not (step_dir / "state.pt").exists():
        return {}
    return read_state(step_dir, meta.get("step"))


def load_into(step_dir: str | os.PathLike, named, optimizer=None, *, order=None,
              aliases=None, whole: bool = True) -> tuple[dict, dict]:
    """Verify a checkpoint of either layout, then fill the parameters `named` [(name,
    param)], whole or this process's FSDP rows, and their AdamW state, reading tensors by
    name (shards.load_named). `order`: the whole model's parameter names in the optimizer's
    order (to read a single-process optimizer.pt); `whole`: `named` is the whole model."""
    step_dir = Path(step_dir)
    state, meta = _checked(step_dir)
    try:
        reader = Reader(step_dir, order=order if optimizer is not None else None,
                        aliases=aliases)
        load_named(reader, named, optimizer, whole=whole)
    except ShardError as e:
        raise CheckpointError(f"{step_dir} does not fit this model: {e} (was it saved from "
                              f"another spec?)") from None
    return state, meta


def tie_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each tied parameter's other names -> the name named_parameters() gives it."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
