"""Golden outputs of the shipped examples: what `restopo inspect --format json` prints, the
module `restopo compile -o model.py` writes, and the checkpoint one training step leaves.

They hold refactors to "behaviour must not change". Regenerate (only when a change of output
is intended, and say so in the commit) with

    RESTOPO_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

Inspect and compile outputs are compared byte for byte. Checkpoints are compared byte for
byte in everything but the float data (file names, the safetensors header, meta.json but
its float values, the structure of optimizer.pt and state.pt). The float data depends on
the machine: a matmul's blocking and vector width follow the CPU's instruction set, and
AdamW's first step turns a gradient that is rounding noise (a query's that is zero in
exact arithmetic, say) into a step of +-lr, so the same code's weights differ between two
x86 machines by up to 20% in such a tensor's sum of squares, where its losses agree to 1e-7.
Each golden file records the machine that wrote it (`machine`: torch, its CPU capability,
and a hash of the processor's make, family, model and flags and of the C compiler that
builds the fused kernels, backends.cpu.build.machine; a VM's processor name alone, "AMD
EPYC", covers generations whose float data differ): on that machine the float data is
compared by a fingerprint per tensor (sum, sum of squares, first values) at 1e-5,
elsewhere the losses in meta.json are (at 1e-6), and the tensors by shape and dtype. With
RESTOPO_GOLDEN_EXACT=1 the data must also hash identically (the check to run before and
after a refactor on one machine; regenerate on yours first).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import platform
import re
import struct
from pathlib import Path

import pytest
import torch

from restopo.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.restopo"))
UPDATE = os.environ.get("RESTOPO_UPDATE_GOLDEN") == "1"
EXACT = os.environ.get("RESTOPO_GOLDEN_EXACT") == "1"
# One step at the example's own model size, on a small batch, saving at step 1.
# Data: a frozen text file in the repository (the builtin corpus is this machine's stdlib).
STEP = ("train.steps=1", "train.batch=2", "train.eval_batches=1", "train.eval_every=1",
        "train.save_every=1", "train.warmup=0", f'train.data="{GOLDEN / "corpus.txt"}"')


def _cli(*argv) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, f"restopo {' '.join(argv)} exited {code}:\n{err.getvalue()}"
    return out.getvalue()


def _compare_text(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden {path}; run with RESTOPO_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file"


@pytest.mark.parametrize("example", EXAMPLES)
def test_inspect_json(example):
    _compare_text(f"inspect/{example}.json", _cli("inspect", f"examples/{example}.restopo",
                                                   "--format", "json"))


@pytest.mark.parametrize("example", EXAMPLES)
def test_compile_module(example, tmp_path):
    out = tmp_path / "model.py"
    _cli("compile", f"examples/{example}.restopo", "-o", str(out))
    _compare_text(f"compile/{example}.py", out.read_text())


def _machine() -> dict:
    """What a training step's float data depends on, besides the code."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    from restopo.backends.cpu import build

    # the name alone is not the machine ("AMD EPYC" covers generations whose steps differ
    # in the float data): the processor's family, model and flags and the C kernels'
    # compiler, hashed
    exact = hashlib.sha256(build.machine().encode()).hexdigest()[:16]
    return {"torch": torch.__version__, "cpu": model,
            "capability": torch.backends.cpu.get_cpu_capability(), "processor_and_cc": exact}


_FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


def _fingerprint(t: torch.Tensor) -> dict:
    x = t.detach().to(torch.float64).flatten()
    return {"shape": list(t.shape), "dtype": str(t.dtype), "sum": x.sum().item(),
            "sumsq": x.pow(2).sum().item(), "first": x[:4].tolist()}


def _structure(obj):
    """Everything of a torch.load'ed object but its float data (fingerprinted instead)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            fp = _fingerprint(obj)
            del fp["first"]
            return {"tensor": fp}
        return {"tensor": {"shape": list(obj.shape), "dtype": str(obj.dtype),
                           "sha256": hashlib.sha256(obj.numpy().tobytes()).hexdigest()}}
    if isinstance(obj, dict):
        return {str(k): _structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_structure(v) for v in obj]
    return obj


def _checkpoint_record(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    raw = (step_dir / "model.safetensors").read_bytes()
    meta_text = (step_dir / "meta.json").read_text().replace(str(ROOT), "<ROOT>")
    (n,) = struct.unpack("<Q", raw[:8])
    state = torch.load(step_dir / "state.pt", weights_only=True)
    state.pop("elapsed")  # wall-clock time: the one field that differs between runs
    record = {
        "files": sorted(p.name for p in step_dir.iterdir()),
        "safetensors_header": raw[8:8 + n].decode(),
        "tensors": {k: _fingerprint(v) for k, v in load_file(step_dir / "model.safetensors").items()},
        "optimizer": _structure(torch.load(step_dir / "optimizer.pt", weights_only=True)),
        "state": _structure(state),
        "meta": json.loads(meta_text),
        "meta_bytes": meta_text,  # the clone's own path replaced by <ROOT>
        "sha256": {name: hashlib.sha256((step_dir / name).read_bytes()).hexdigest()
                   for name in ("model.safetensors", "optimizer.pt")},
    }
    return record


def _shapes(obj):
    """obj with each tensor fingerprint cut to its shape and dtype, and other floats
    dropped (the float data of another machine's golden)."""
    if isinstance(obj, dict):
        if "sumsq" in obj:
            return {"shape": obj["shape"], "dtype": obj["dtype"]}
        return {k: _shapes(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shapes(v) for v in obj]
    return None if isinstance(obj, float) else obj


def _close(a, b, path="") -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("example", EXAMPLES)
def test_checkpoint(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    argv = ["train", f"examples/{example}.restopo", "--out", str(out), "--no-progress",
            "--threads", "1"]
    for s in STEP:
        argv += ["--set", s]
    _cli(*argv)
    record = _checkpoint_record(out / "ckpt" / "step_000001")
    # the run folder is a temp path: meta names it nowhere, but say so if that changes
    assert str(tmp_path) not in record["meta_bytes"]
    path = GOLDEN / "checkpoint" / f"{example}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        record["machine"] = _machine()
        path.write_text(json.dumps(record, sort_keys=True) + "\n")
        return
    golden = json.loads(path.read_text())
    sha, golden_sha = record.pop("sha256"), golden.pop("sha256")
    for key in ("files", "safetensors_header"):
        assert record[key] == golden[key], f"{example}: {key} differs from the golden"
    masked = [_FLOAT.sub("<float>", r.pop("meta_bytes")) for r in (record, golden)]
    assert masked[0] == masked[1], f"{example}: meta.json differs from the golden"
    if golden.pop("machine", None) == _machine():
        _close(record, golden, example)
    else:  # another machine: its losses, and everything but the float data
        for key in ("loss", "val_loss"):
            assert math.isclose(record["meta"][key], golden["meta"][key], rel_tol=1e-6), \
                f"{example}: {key} {record['meta'][key]} != {golden['meta'][key]}"
        _close(_shapes(record), _shapes(golden), example)
    if EXACT:
        assert sha == golden_sha, f"{example}: checkpoint data bytes differ"
