"""Checkpoints that a crash can never leave half-written.

Layout under a run's checkpoint folder (OUT/ckpt):
    step_000100/model.safetensors   weights (tied tensors stored once, safetensors.torch)
    step_000100/optimizer.pt        optimizer state_dict (tensors and numbers only)
    step_000100/state.pt            RNG states, data position (tensors and numbers only)
    step_000100/meta.json           step, spec text, overrides, schedule; written last
    latest                          the name of the newest complete step folder

A save writes a hidden temporary folder, fsyncs every file and the folder, renames it into
place, then replaces `latest` (restopo.io.write_atomic). Interrupted anywhere, the previous
`latest` still names a complete checkpoint. Loading reads safetensors and
torch.load(weights_only=True) only: nothing is unpickled.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..io import fsync_dir, fsync_file, new_mode, write_atomic

STEP_DIR = re.compile(r"^step_(\d{6,})$")
FILES = ("model.safetensors", "optimizer.pt", "state.pt", "meta.json")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded (message names the path)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, state: dict, meta: dict,
                    keep: int = 3, _write_file=None) -> Path:
    """Save one checkpoint atomically and point `latest` at it; keep the newest `keep`.

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
        }
        for name in FILES:
            writers[name](tmp / name)
            os.chmod(tmp / name, new_mode())  # safetensors writes 0600: use the umask
            fsync_file(tmp / name)
            if _write_file is not None:
                _write_file(name, tmp / name)
        os.chmod(tmp, new_mode(folder=True))  # mkdtemp made it 0700
        fsync_dir(tmp)
        if final.exists():  # the same step saved again (a restarted run): swap it out
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(root / "latest", final.name + "\n")
    _prune(root, keep)
    return final


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete step folders, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and p.is_dir() and _complete(p)]
    return [p for _, p in sorted(found)]


def _prune(root: Path, keep: int) -> None:
    for p in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():  # leftovers of saves that crashed
        if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _step_of(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The folder `latest` names, or the newest complete one if the pointer is missing or
    stale (a crash between the folder rename and the pointer update)."""
    root = Path(root)
    pointer = root / "latest"
    candidates = list_checkpoints(root)
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.is_dir() and _complete(named):
            newer = [p for p in candidates if _step_of(p) > _step_of(named)]
            return newer[-1] if newer else named
    return candidates[-1] if candidates else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step folder from a step folder, a checkpoint folder (with `latest`) or a run folder
    (with ckpt/). Raises CheckpointError saying what was looked for."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if p.is_dir() and _complete(p):
        return p
    for root in (p, p / "ckpt"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint in {str(p)!r}; give a run folder (with "
                          f"ckpt/), its ckpt/ folder or a ckpt/step_NNNNNN folder")


def read_meta(step_dir: str | os.PathLike) -> dict:
    path = Path(step_dir) / "meta.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def load_checkpoint(step_dir: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    map_location: str | torch.device = "cpu") -> tuple[dict, dict]:
    """Load weights (and optimizer state) in place; returns (state, meta)."""
    from safetensors.torch import load_model

    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    try:
        missing, unexpected = load_model(model, str(step_dir / "model.safetensors"),
                                         strict=False, device=str(map_location))
        if missing or unexpected:
            raise CheckpointError(
                f"{step_dir} does not fit this model: missing {sorted(missing)[:4]}, "
                f"unexpected {sorted(unexpected)[:4]} (was it saved from another spec?)")
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(step_dir / "optimizer.pt",
                                                 map_location=map_location, weights_only=True))
        state = torch.load(step_dir / "state.pt", map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError:
        raise CheckpointError(f"cannot load checkpoint {step_dir}: it holds objects other "
                              f"than tensors and numbers, which restopo never unpickles") from None
    except Exception as e:  # safetensors, torch and OS errors: one line naming the folder
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        text = " ".join(lines)
        text = text if len(text) < 300 else text[:300] + "..."
        if "state_dict" in text:
            text += " (was it saved from another spec?)"
        raise CheckpointError(f"cannot load checkpoint {step_dir}: {text}") from None
    return state, meta
