"""The sharded checkpoint format, and reading any checkpoint's tensors by name.

A run whose processes each hold part of the model (pipeline stages, FSDP shards) saves a
step folder in which every process wrote its own share, in safetensors:

    step_000100/shard-00000-of-00004.safetensors   rank 0's tensors
    ...
    step_000100/shard-00003-of-00004.safetensors
    step_000100/state.safetensors                  RNG states and data position (rank 0)
    step_000100/meta.json                          step, spec text, overrides, layout
    step_000100/index.json                         which file holds which tensor (rows)
    step_000100/manifest.json                      size and SHA-256 of every file above

Tensors are named after the whole model's parameters: `model/NAME` for a weight and
`optim/exp_avg/NAME`, `optim/exp_avg_sq/NAME`, `optim/step/NAME` for its AdamW state. A
process with a whole tensor writes it whole; an FSDP process writes its rows (the shard of
dimension 0 it holds), and index.json lists the parts of each tensor with their rows, in the
spirit of Hugging Face's model.safetensors.index.json (whose `weight_map` it also carries,
for the tensors stored whole).
So any layout reads what it needs by name and row range: one process, another pipeline,
another FSDP size (`Reader`, `load_named`). Nothing is unpickled.

`Reader` reads the single-process layout (model.safetensors, optimizer.pt) through the same
interface, so every layout resumes from every other. How a save is committed (every rank
writes, a barrier, then rank 0 writes the index and moves `latest`) is in checkpoint.py.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch

INDEX = "index.json"
STATE = "state.safetensors"
FORMAT = "restopo.sharded"
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # AdamW's state of one parameter
# safetensors' names of torch's floating dtypes (model.safetensors' header says these)
_FLOAT_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class ShardError(ValueError):
    """A checkpoint whose tensors cannot fill this model (the message says which and why)."""


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def is_sharded(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / INDEX).exists()


def model_key(name: str) -> str:
    return f"model/{name}"


def optim_key(kind: str, name: str) -> str:
    return f"optim/{kind}/{name}"


# -- rows of a sharded parameter ------------------------------------------------------------
def local_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """The rows [a, b) of the whole tensor that this process holds of `t`: None for a plain
    tensor (held whole), the dimension-0 shard of an FSDP DTensor (torch.chunk's split:
    ceil(n / size) rows per rank, the last ones shorter or empty)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return None
    placements = t.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ShardError(f"cannot save a DTensor placed as {placements}; restopo shards "
                         f"dimension 0 over one mesh dimension (FSDP)")
    n, size = t.shape[0], t.device_mesh.size()
    per = -(-n // size)
    a = min(t.device_mesh.get_local_rank() * per, n)
    b = min(a + per, n)
    if t.to_local().shape[0] != b - a:
        raise ShardError(f"a shard of {tuple(t.shape)} holds {t.to_local().shape[0]} rows, "
                         f"expected {b - a}")
    return a, b


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t` (the local shard of a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


# -- writing one rank's share -----------------------------------------------------------------
def share(named, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(tensors, entries) this process writes for the parameters `named` [(name, param)]:
    each weight and its AdamW state, whole or this process's rows, and for the index each
    tensor's whole shape, dtype and rows."""
    tensors, entries = {}, {}

    def add(key, t, rows):
        local = local_tensor(t).detach()
        tensors[key] = local.to("cpu").contiguous().clone()
        entries[key] = {"shape": list(t.shape), "dtype": str(local.dtype).removeprefix("torch."),
                        "rows": list(rows) if rows is not None else None}

    for name, p in named:
        rows = local_rows(p)
        add(model_key(name), p, rows)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for kind in OPTIM_KEYS:
            if kind in state:
                t = state[kind]
                t = t if torch.is_tensor(t) else torch.tensor(float(t))
                add(optim_key(kind, name), t, rows if t.dim() else None)
    return tensors, entries


def write_share(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": FORMAT})


def build_index(parts: list[tuple[str, dict[str, dict]]], world: int, layout: str) -> dict:
    """index.json from each shard file's entries [(file, {key: entry})]: every tensor with
    its shape, dtype and parts (file and rows), checked to cover each tensor exactly once."""
    tensors: dict[str, dict] = {}
    for file, entries in parts:
        for key, e in entries.items():
            t = tensors.setdefault(key, {"shape": e["shape"], "dtype": e["dtype"], "parts": []})
            if t["shape"] != e["shape"]:
                raise ShardError(f"{key} is {t['shape']} in one shard and {e['shape']} in "
                                 f"{file}")
            t["parts"].append({"file": file, "rows": e["rows"]})
    for key, t in tensors.items():
        _check_cover(key, t)
    files = [f for f, _ in parts]
    size = sum(_bytes(t) for t in tensors.values())
    return {"format": FORMAT, "version": 1, "world": world, "layout": layout, "files": files,
            "metadata": {"total_size": size},
            # Hugging Face's name -> file, for the tensors one file holds whole; a tensor
            # cut by rows is in no one file (its parts say where), so it is left out
            "weight_map": {k: t["parts"][0]["file"] for k, t in sorted(tensors.items())
                           if t["parts"][0]["rows"] is None},
            "tensors": dict(sorted(tensors.items()))}


def _check_cover(key: str, t: dict) -> None:
    """The parts of one tensor cover its rows exactly once (or one part holds it whole)."""
    parts = t["parts"]
    if any(p["rows"] is None for p in parts):
        if len(parts) > 1 and any(p["rows"] is not None for p in parts):
            raise ShardError(f"{key} is stored whole and in rows")
        t["parts"] = parts[:1]  # a whole tensor held by several ranks: one copy is enough
        return
    spans = sorted((p["rows"][0], p["rows"][1]) for p in parts if p["rows"][1] > p["rows"][0])
    at = 0
    for a, b in spans:
        if a != at:
            raise ShardError(f"{key}: rows {at}..{a} are in no shard" if a > at
                             else f"{key}: rows {a}..{at} are in two shards")
        at = b
    if at != (t["shape"][0] if t["shape"] else 0):
        raise ShardError(f"{key}: rows {at}..{t['shape'][0]} are in no shard")
    t["parts"] = [p for p in parts if p["rows"][1] > p["rows"][0]]


def _bytes(t: dict) -> int:
    n = 1
    for s in t["shape"]:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()


def files_in_index(index: dict) -> tuple[str, ...]:
    files = index.get("files") if isinstance(index, dict) else None
    if (not isinstance(files, list) or not all(isinstance(f, str) for f in files)
            or any("/" in f or f.startswith(".") for f in files)):
        raise ShardError("index.json names no valid shard files")
    return tuple(files)


def read_index(step_dir: Path) -> dict:
    try:
        index = json.loads((step_dir / INDEX).read_text())
    except (OSError, ValueError) as e:
        raise ShardError(f"{INDEX} unreadable ({type(e).__name__})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT \
            or not isinstance(index.get("tensors"), dict):
        raise ShardError(f"{INDEX} is not a restopo sharded index")
    files_in_index(index)
    return index


# -- the run state (RNG states, data position) without pickle --------------------------------
def write_state(path: Path, state: dict) -> None:
    """state.safetensors: the tensors of the loop's state dict (RNG states, the data
    generator) by dotted name, its numbers in the metadata."""
    from safetensors.torch import save_file

    tensors, numbers = {}, {}

    def walk(prefix, obj):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(key + ".", v)
            elif torch.is_tensor(v):
                tensors[key] = v.detach().cpu().contiguous()
            else:
                numbers[key] = v
    walk("", state)
    save_file(tensors, str(path), metadata={"format": FORMAT, "numbers": json.dumps(numbers)})


def read_state_file(path: Path) -> dict:
    """The dict `write_state` wrote (nested again by the dots of its names)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            flat = {k: f.get_tensor(k) for k in f.keys()}
        flat.update(json.loads(meta.get("numbers", "{}")))
    except Exception as e:  # safetensors and JSON errors alike: one line
        raise ShardError(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") \
            from None
    out: dict = {}
    for key, v in flat.items():
        *path_, last = key.split(".")
        d = out
        for k in path_:
            d = d.setdefault(k, {})
        d[last] = v
    return out


# -- reading tensors by name, from either layout ------------------------------------------------
class Reader:
    """The tensors of one checkpoint folder by name (`model/NAME`, `optim/KIND/NAME`), whole
    or a range of rows, from the sharded layout or the single-process one.

    For the single-process layout, optimizer.pt numbers parameters in the optimizer's order:
    `order` gives their names (restopo.train.loop.optimizer_order of the whole model)."""

    def __init__(self, step_dir: str | os.PathLike, order: list[str] | None = None,
                 aliases: dict[str, str] | None = None):
        self.dir = Path(step_dir)
        self.aliases = aliases or {}  # tied names: "head.lm_head.weight" -> "embed.weight"
        self.sharded = is_sharded(self.dir)
        self._open: dict[str, object] = {}
        if self.sharded:
            self.index = read_index(self.dir)
            self.entries = self.index["tensors"]
        else:
            self.index = None
            self.entries = self._single_entries(order)

    def _single_entries(self, order) -> dict[str, dict]:
        from safetensors import safe_open

        entries = {}
        with safe_open(str(self.dir / "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                entries[model_key(k)] = {"shape": list(s.get_shape()), "where": ("model", k),
                                         "dtype": _FLOAT_NAMES.get(s.get_dtype())}
        self._optim = None
        if order is not None and (self.dir / "optimizer.pt").exists():
            try:
                opt = torch.load(self.dir / "optimizer.pt", map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                raise ShardError("optimizer.pt holds objects other than tensors and numbers, "
                                 "which restopo never unpickles") from None
            state = opt.get("state", {}) if isinstance(opt, dict) else {}
            if state and len(order) <= max(state):
                raise ShardError(f"optimizer.pt has state for {max(state) + 1} parameters, "
                                 f"this model {len(order)}")
            self._optim = state
            for i, st in state.items():
                for kind in OPTIM_KEYS:
                    if kind in st:
                        t = st[kind]
                        entries[optim_key(kind, order[i])] = {
                            "shape": list(t.shape) if torch.is_tensor(t) else [],
                            "where": ("optim", i, kind)}
        return entries

    def has(self, key: str) -> bool:
        return self._key(key) in self.entries

    def _key(self, key: str) -> str:
        if key in self.entries:
            return key
        kind, _, name = key.rpartition("/")
        alias = self.aliases.get(name)
        return f"{kind}/{alias}" if alias is not None else key

    def shape(self, key: str) -> list[int]:
        return self.entries[self._key(key)]["shape"]

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `key` (rows [a, b) of it when given) on the CPU."""
        e = self.entries[self._key(key)]
        if not self.sharded:
            t = self._single(e["where"])
            return t if rows is None else t[rows[0]:rows[1]]
        want = rows if rows is not None else (0, e["shape"][0] if e["shape"] else 0)
        out = []
        for part in e["parts"]:
            f = self._file(part["file"])
            if part["rows"] is None:  # held whole
                t = f.get_tensor(self._key(key))
                return t if rows is None else t[rows[0]:rows[1]]
            a, b = part["rows"]
            lo, hi = max(a, want[0]), min(b, want[1])
            if lo < hi:
                out.append(f.get_slice(self._key(key))[lo - a:hi - a])
        if not out:
            return torch.empty([0, *e["shape"][1:]], dtype=getattr(torch, e["dtype"]))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _single(self, where) -> torch.Tensor:
        if where[0] == "model":
            return self._file("model.safetensors").get_tensor(where[1])
        t = self._optim[where[1]][where[2]]
        return t if torch.is_tensor(t) else torch.tensor(float(t))

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.dir / name), framework="pt")
        return self._open[name]

    def model_names(self) -> set[str]:
        return {k.removeprefix("model/") for k in self.entries if k.startswith("model/")}

    def model_floats(self) -> set[torch.dtype]:
        """The floating-point dtypes the model's tensors were saved in."""
        kinds = {getattr(torch, e.get("dtype") or "", None)
                 for k, e in self.entries.items() if k.startswith("model/")}
        return {d for d in kinds if isinstance(d, torch.dtype) and d.is_floating_point}


def load_named(reader: Reader, named, optimizer=None, whole: bool = True) -> None:
    """Fill the parameters `named` [(name, param)] (whole, or this process's FSDP rows) and,
    with an optimizer, their AdamW state from `reader`. Every name and shape is checked
    before anything is written; a mismatch is a ShardError naming the first ones. `whole`:
    `named` is the whole model (a pipeline process holds a part), so the checkpoint must
    hold nothing else."""
    named = list(named)
    missing = [n for n, _ in named if not reader.has(model_key(n))]
    if missing:
        raise ShardError(f"the checkpoint has no {', '.join(missing[:4])}"
                         + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""))
    bad = [f"{n} is {reader.shape(model_key(n))} there, {list(p.shape)} here"
           for n, p in named if reader.shape(model_key(n)) != list(p.shape)]
    if bad:
        raise ShardError("tensors differ in shape: " + "; ".join(bad[:3]))
    if whole:
        extra = reader.model_names() - {n for n, _ in named} - set(reader.aliases)
        if extra:
            raise ShardError(f"the checkpoint has tensors this model lacks: "
                             f"{', '.join(sorted(extra)[:4])}")
    with torch.no_grad():
        for name, p in named:
            rows = local_rows(p)
            local_tensor(p).copy_(reader.read(model_key(name), rows))
            if optimizer is None or not reader.has(optim_key("exp_avg", name)):
                continue
            state = optimizer.state[p]
            state["step"] = reader.read(optim_key("step", name)).to(torch.float32).clone()
            for kind in ("exp_avg", "exp_avg_sq"):
                t = torch.zeros_like(p)
                local_tensor(t).copy_(reader.read(optim_key(kind, name), rows))
                state[kind] = t
