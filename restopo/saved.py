"""A trained model's saved forms: `restopo.load` reads any of them, `export` writes one.

restopo.load(path) takes
  a run folder (its latest checkpoint), a ckpt/ folder or a ckpt/step_NNNNNN folder
      (restopo.train.checkpoint: meta.json has the spec text and overrides);
  a `restopo compile -o model.pt` file or `restopo export -o model.pt`
      ({"spec", "overrides", "state_dict"}, read with torch.load(weights_only=True));
  an exported model.safetensors (the spec and overrides in its metadata), or a checkpoint's
      own model.safetensors (the spec from the meta.json beside it);
and returns restopo.compile(spec, overrides) with the weights loaded strictly (a tied LM
head is the embedding, stored once or twice), in eval mode, in the dtype the weights were
saved in (a float64 export or checkpoint loads as float64). Nothing is unpickled.

An export (.safetensors or .pt) carries a SHA-256 of its weights, which load checks: a
damaged byte is an error, not a wrong weight. An exported .safetensors holds every
state_dict key, the tied head too, so plain
`model.load_state_dict(safetensors.torch.load_file(path))` is strict anywhere, the
standalone model.py of `restopo compile` included.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings
from pathlib import Path

import torch
from torch import nn

from .api import compile as compile_spec
from .io import atomic_path

SPEC_KEY, OVERRIDES_KEY = "restopo.spec", "restopo.overrides"
# the folder the model's run read a relative train.data from (spec.datapath.data_base)
DATA_BASE_KEY = "restopo.data_base"
# a SHA-256 of the weights (weights_digest): neither format checks its data, so a damaged
# byte would load as a wrong weight, unsaid
DIGEST_KEY = "restopo.weights_sha256"
# the first line of a standalone model.py says it (restopo compile / export -o .py)
STANDALONE = "standalone (imports only torch)"


class LoadError(ValueError):
    """A path that holds no model restopo can load (the message names it and says why)."""


def load(path: str | os.PathLike, backend: str = "auto", device: str | torch.device = "cpu",
         say=None) -> nn.Module:
    """The model saved at `path` (see the module docstring), in eval mode on `device`. A
    run or ckpt/ folder gives its newest checkpoint that verifies: each newer one passed
    over (damaged) is told to `say(line)`, by default as a warning, never silently, since
    its weights are older than the user asked for. `model.restopo_source` is the file or
    step folder the weights came from."""
    if say is None:
        def say(line):
            warnings.warn(line, stacklevel=3)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {str(device)!r}: torch sees no CUDA device here; load with "
                        f"device='cpu'")  # torch's own was an AssertionError, mid-load
    p = Path(path)
    if not p.exists():
        from .train.checkpoint import missing
        raise LoadError(missing(p, "give a run folder, a checkpoint folder, a .pt from restopo "
                                   "compile or a .safetensors export"))
    if p.is_dir():
        model = _from_checkpoint(p, backend, device, say)
    elif p.suffix != ".safetensors" and _of_a_checkpoint(p):
        raise LoadError(f"{p} is a file of the checkpoint folder {p.parent}, not a model; "
                        f"give the folder itself: {p.parent}")
    elif p.suffix == ".pt":
        model = _from_pt(p, backend, device)
    elif p.suffix == ".safetensors":
        model = _from_safetensors(p, backend, device)
    elif p.suffix == ".restopo":  # said to CLI users too (eval, generate, diagnose...)
        raise LoadError(f"{p} is a spec, not a trained model; train it first (restopo train "
                        f"{p}) and give its run folder or a checkpoint")
    elif p.suffix == ".py" and STANDALONE.encode() in _head(p, 400):
        raise LoadError(f"{p} is a standalone module, not weights; give the .pt or "
                        f".safetensors its weights are in, or import it ({p.stem}.build(): "
                        f"its docstring says how)")
    elif (p.parent / "ckpt").is_dir():  # metrics.jsonl, loss.png, train.log, ...
        raise LoadError(f"{p} is a file of the run folder {p.parent}, not a model; give the "
                        f"folder itself: {p.parent}")
    else:
        raise LoadError(f"{p}: not a model restopo saved (expected a run folder, .pt or "
                        f".safetensors)")
    if p.is_file():
        model.restopo_source = p
    return model.eval()


def _compile(spec_text: str, overrides, path: Path, backend: str,
             data_base: str | None) -> nn.Module:
    from .spec import parse_spec
    from .train.runspec import recorded
    overrides = tuple(overrides)
    spec = parse_spec(spec_text, path=f"<spec in {path}>", overrides=overrides)
    return compile_spec(recorded(spec, len(overrides), data_base), backend=backend)


def _from_checkpoint(p: Path, backend: str, device, say=None) -> nn.Module:
    from .train.checkpoint import CheckpointError, load_checkpoint, read_meta, \
        resolve_checkpoint
    try:
        step_dir = resolve_checkpoint(p, say=say)
        meta = read_meta(step_dir)
        if "spec_text" not in meta:
            raise LoadError(f"{step_dir}/meta.json carries no spec text")
        from .train.runspec import spec_from_meta
        model = compile_spec(spec_from_meta(meta), backend=backend)
        from .train.shards import Reader
        _as_saved(model, Reader(step_dir).model_floats())
        load_checkpoint(step_dir, model, map_location=device)  # strict: names what differs
        model.restopo_source = step_dir
    except CheckpointError as e:
        raise LoadError(str(e)) from None
    return model.to(device)


def _of_a_checkpoint(p: Path) -> bool:
    """Whether file `p` is ckpt/latest or one of a checkpoint folder's own files (a model.pt
    exported beside some other meta.json is not, nor a file of one's own named latest)."""
    from .train.checkpoint import MANIFEST, STEP_DIR, checkpoint_files
    if p.name == "latest":  # the pointer beside the step folders
        return any(STEP_DIR.match(q.name) and q.is_dir() for q in p.parent.iterdir())
    return (p.parent / "meta.json").is_file() and p.name in (
        checkpoint_files(p.parent) or ()) + (MANIFEST,)


def _from_pt(p: Path, backend: str, device) -> nn.Module:
    try:
        blob = torch.load(p, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        from .train.checkpoint import refused_pickle
        raise LoadError(f"{p}: {refused_pickle(p)}") from None
    except Exception as e:  # not a torch file, or one cut short or damaged
        zipped = _head(p, 4) == b"PK\x03\x04"  # how every torch.save file begins
        raise _unreadable(p, "torch file", zipped, e) from None
    if not isinstance(blob, dict) or not {"spec", "state_dict"} <= set(blob):
        raise LoadError(f"{p}: not a restopo model file (no 'spec' and 'state_dict'); "
                        f"write one with restopo compile -o model.pt or restopo export")
    model = _compile(blob["spec"], blob.get("overrides", ()), p, backend,
                     blob.get("data_base")).to(device)
    _load_strict(model, blob["state_dict"], p, blob.get(DIGEST_KEY))
    return model


def _from_safetensors(p: Path, backend: str, device) -> nn.Module:
    from safetensors import safe_open
    # safetensors names devices its own way ("cpu:0", which torch takes, it refuses)
    where = "cpu" if torch.device(device).type == "cpu" else str(device)
    try:  # opened once: its header gives the spec, then the tensors
        f = safe_open(str(p), framework="pt", device=where)
    except Exception as e:
        raise _unreadable(p, "safetensors file", _safetensors_header(p), e) from None
    with f:
        metadata = f.metadata() or {}
        if SPEC_KEY not in metadata:
            if (p.parent / "meta.json").is_file():  # a checkpoint's own weights file
                return _from_checkpoint(p.parent, backend, device)
            raise LoadError(f"{p}: the file carries no restopo spec (metadata {SPEC_KEY!r}); "
                            f"export one with restopo export CKPT -o model.safetensors")
        overrides = json.loads(metadata.get(OVERRIDES_KEY, "[]"))
        model = _compile(metadata[SPEC_KEY], overrides, p, backend,
                         metadata.get(DATA_BASE_KEY)).to(device)
        state = {name: f.get_tensor(name) for name in f.keys()}
    _load_strict(model, state, p, metadata.get(DIGEST_KEY))
    return model


def _unreadable(p: Path, kind: str, begins_as_one: bool, e: Exception) -> LoadError:
    """A file that did not read as `kind`: empty, one that begins as one (so it was cut
    short or damaged since it was written), or none at all."""
    if _size(p) == 0:
        return LoadError(f"{p}: the file is empty; write it again (restopo export CKPT -o "
                         f"{p.name} --overwrite)")
    if begins_as_one:
        return LoadError(f"{p}: begins as a {kind} but is cut short or damaged "
                         f"({_one_line(e)}); write it again (restopo export CKPT -o {p.name} "
                         f"--overwrite)")
    return LoadError(f"{p}: not a {kind} restopo wrote ({_one_line(e)})")


def _safetensors_header(p: Path) -> bool:
    """Whether `p` begins as a safetensors file: a header length, then that much JSON."""
    head = _head(p, 9)
    return (len(head) == 9 and head[8:] == b"{"
            and 8 + int.from_bytes(head[:8], "little") <= _size(p))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


def _head(p: Path, n: int) -> bytes:
    """The first `n` bytes of `p` (fewer in a shorter file; none when it cannot be read)."""
    try:
        with open(p, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _as_saved(model: nn.Module, dtypes: set[torch.dtype]) -> None:
    """`model` in the floating dtype its weights were saved in, when they share one: a
    float64 (or bf16) model loads back as one, not rounded to float32 by loading into it."""
    if len(dtypes) == 1:
        model.to(next(iter(dtypes)))


def _load_strict(model: nn.Module, state_dict, where: Path, digest: str | None) -> None:
    """Load `state_dict` into `model` strictly, in the dtype it was saved in (_as_saved),
    and check it against the `digest` export wrote (None: a file written before it did)."""
    _as_saved(model, {v.dtype for v in state_dict.values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()})
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        raise LoadError(f"{where}: does not fit its own spec ({_one_line(e)})") from None
    if digest is not None and digest != weights_digest(state_dict):
        raise LoadError(f"{where}: its weights do not match the checksum written with them: "
                        f"the file is damaged (or was changed by other means than restopo "
                        f"export); export it again from its run")


def weights_digest(state_dict) -> str:
    """SHA-256 of a state_dict's names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state_dict[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def export(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write a loaded or compiled model to `path`, atomically: .safetensors (every
    state_dict key, the spec and overrides in the metadata) or .pt (as restopo compile -o
    model.pt). Both load back with restopo.load."""
    p = Path(path)
    spec_text = getattr(model, "spec_text", None)
    if spec_text is None:
        raise LoadError("this model carries no spec text; export models made by "
                        "restopo.compile or restopo.load")
    spec = getattr(model, "restopo_spec", None)
    if spec is not None and spec.model is None:  # restopo.rewire's: the spec is wiring only
        raise LoadError("this model was rewired from a model of your own (restopo.rewire): "
                        "its spec has no model section for restopo.load to build it from; "
                        "save its state_dict (torch.save(model.state_dict(), path)) and load "
                        "it into restopo.rewire(YourModel(), spec) again")
    overrides = list(getattr(model, "restopo_overrides", ()) or ())
    # a relative train.data keeps meaning the run's data, read from wherever it is loaded
    from .spec.datapath import data_base
    base = None if spec is None else data_base(spec)
    # every key, tied ones as their own contiguous copies (safetensors refuses shared memory)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    digest = weights_digest(state)
    if p.suffix == ".safetensors":
        from safetensors.torch import save_file
        meta = {SPEC_KEY: spec_text, OVERRIDES_KEY: json.dumps(overrides), DIGEST_KEY: digest,
                **({DATA_BASE_KEY: base} if base else {})}
        with atomic_path(p) as tmp:
            save_file(state, tmp, metadata=meta)
    elif p.suffix == ".pt":
        with atomic_path(p) as tmp, open(tmp, "wb") as f:
            torch.save({"spec": spec_text, "overrides": overrides, "state_dict": state,
                        DIGEST_KEY: digest, **({"data_base": base} if base else {})}, f)
    else:
        raise LoadError(f"{p}: export writes .safetensors or .pt (for a standalone "
                        f"model.py use restopo export CKPT -o model.py)")
    return p
