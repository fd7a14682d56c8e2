"""Where commands may write: never over their own input, into a checkpoint (whose manifest
vouches for every byte) or over a write-protected file; a failed write names the user's
path, not a temporary one."""
import os
import shutil
from pathlib import Path

import pytest
import torch

import restopo
from restopo.cli import main
from restopo.train.checkpoint import save_checkpoint, verify_checkpoint
from restopo.train.runspec import run_meta

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.restopo"


def error(capsys, argv, code=1):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and ".restopo-" not in err  # no temporary names
    return err


def test_a_spec_is_never_its_own_output(tmp_path, capsys):
    spec = tmp_path / "spec.py"
    shutil.copy(TINY, spec)
    before = spec.read_bytes()
    assert "is this command's input" in error(capsys, ["compile", str(spec), "-o", str(spec)])
    link = tmp_path / "link.dot"
    os.symlink(spec, link)  # the same file by another name
    dot = tmp_path / "spec.dot"
    shutil.copy(TINY, dot)
    assert "is this command's input" in error(capsys, ["graph", str(dot), "-o", str(dot)])
    assert spec.read_bytes() == before and dot.read_bytes() == before


def test_a_folder_in_the_way_is_named(tmp_path, capsys):
    (tmp_path / "w.png").mkdir()
    (tmp_path / "w.py").mkdir()
    err = error(capsys, ["graph", str(TINY), "-o", str(tmp_path / "w.png")])
    assert f"{tmp_path / 'w.png'}: is a directory" in err
    err = error(capsys, ["compile", str(TINY), "-o", str(tmp_path / "w.py")])
    assert f"{tmp_path / 'w.py'}: is a directory" in err


def test_a_write_protected_file_is_kept(tmp_path, capsys, monkeypatch):
    out = tmp_path / "kept.dot"
    out.write_text("mine")
    real = os.access
    # root may write anywhere, so the protection is seen through os.access, as a user's
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out else real(p, mode))
    assert "write-protected" in error(capsys, ["graph", str(TINY), "-o", str(out)])
    assert out.read_text() == "mine"


def saved_run(tmp_path, trained=False):
    """tmp_path/run: a run of tmp_path/t.restopo with one checkpoint (`trained`: of weights
    no compile makes, else of fresh ones); returns the checkpoint's folder."""
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x\n" * 50)
    (tmp_path / "t.restopo").write_text(
        'model t { vocab: 256; width: 16; depth: 1; heads: 2; context: 8 }\n'
        'residual standard\ntrain { data: "corpus.txt"; steps: 2; batch: 2 }\n')
    spec = restopo.load_spec(str(tmp_path / "t.restopo"))
    state = {"step": 1, "data": {"generator": torch.Generator().get_state()},
             "torch_cpu": torch.get_rng_state()}
    model = restopo.compile(spec)
    if trained:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    save_checkpoint(tmp_path / "run" / "ckpt", 1, model, None, state,
                    run_meta(spec, str(tmp_path)))
    return tmp_path / "run" / "ckpt" / "step_000001"


def test_nothing_is_written_into_a_checkpoint(tmp_path, capsys):
    step = saved_run(tmp_path)
    weights = step / "model.safetensors"
    for argv in (["export", str(tmp_path / "run"), "-o", str(weights)],
                 ["export", str(tmp_path / "run"), "-o", str(step / "extra.pt")],
                 ["compile", str(tmp_path / "t.restopo"), "-o", str(step / "m.py")],
                 ["graph", str(tmp_path / "t.restopo"), "-o", str(step / "g.dot")],
                 ["diagnose", str(tmp_path / "run"), "-o", str(step / "figures")]):
        assert "inside the checkpoint" in error(capsys, argv)
    assert verify_checkpoint(step) is None
    assert sorted(p.name for p in step.iterdir()) == sorted(
        ["model.safetensors", "optimizer.pt", "state.pt", "meta.json", "manifest.json"])


def test_nothing_is_written_into_a_runs_checkpoint_folder(tmp_path, capsys):
    """train --out RUN/ckpt (or a folder in it, or in one of its checkpoints) trained a run
    there, and sweep and compare --out wrote there: RUN's saves prune its step folders and
    its --overwrite deletes ckpt/ whole, that run and those files with it."""
    step = saved_run(tmp_path)
    ckpt, spec, run = step.parent, str(tmp_path / "t.restopo"), str(tmp_path / "run")
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    for out in (ckpt, ckpt / "inner", step / "inner"):
        for argv in (["train", spec, "--no-progress", "--out", str(out)],
                     ["sweep", spec, "--out", str(out), "--dry-run"],
                     ["compare", run, "--out", str(out)],
                     ["graph", spec, "-o", str(out / "g.dot")]):
            err = error(capsys, argv)
            said = "is the checkpoint folder" if str(ckpt) in argv else "is inside"
            assert said in err and "write the output outside it" in err, argv
            assert err.count("\n") == 1, err  # one line
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    # beside the checkpoints, in the run's own folder, is where a run may hold others
    assert main(["sweep", spec, "--out", str(tmp_path / "run" / "sw"), "--dry-run"]) == 0


def test_a_standalone_module_gets_a_name_it_can_be_imported_by(tmp_path, capsys):
    """compile -o my-model.py wrote a module no import can name (its own docstring said
    `import torch, my-model`), and -o torch.py one that hid torch from every script beside
    it, itself included."""
    for name, said in (("my-model", "e.g. my_model.py"), ("class", "e.g. model_class.py"),
                       ("torch", "would shadow the torch module")):
        out = tmp_path / f"{name}.py"
        assert said in error(capsys, ["compile", str(TINY), "-o", str(out)])
        assert not out.exists()
    assert main(["compile", str(TINY), "-o", str(tmp_path / "tiny_model.py")]) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_that_exists_but_takes_no_files_is_not_called_missing(tmp_path, capsys):
    err = error(capsys, ["graph", str(TINY), "-o", "/proc/self/w.dot"])
    assert "cannot write a file in /proc/self" in err and "does not exist" not in err
    err = error(capsys, ["graph", str(TINY), "-o", str(tmp_path / "none" / "w.dot")])
    assert "the folder to write it in does not exist" in err
    # and says what to do, with the folder as a shell takes it
    assert f"make it first (mkdir -p {tmp_path / 'none'})" in err
    assert not (tmp_path / "none").exists()


def test_an_output_folder_that_cannot_take_it_is_said_before_the_work(tmp_path, capsys,
                                                                      monkeypatch):
    """compile, export and graph built the model (or loaded the checkpoint) and only then
    found the output's folder missing, in the way or not writable."""
    import restopo.api
    import restopo.cli
    import restopo.draw.dot

    worked = []
    for module, name in ((restopo.api, "compile"), (restopo.cli, "load_model"),
                         (restopo.draw.dot, "to_dot")):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: worked.append(name))
    (tmp_path / "file").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    # root may write anywhere, so the protection is seen through os.access, as a user's
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked
                        else real(p, mode))
    for argv in (["compile", str(TINY), "-o"], ["export", str(tmp_path), "-o"],
                 ["graph", str(TINY), "-o"]):
        ext = ".dot" if argv[0] == "graph" else ".pt"
        err = error(capsys, argv + [str(tmp_path / "none" / f"m{ext}")])
        assert "the folder to write it in does not exist; make it first" in err
        err = error(capsys, argv + [str(tmp_path / "file" / f"m{ext}")])
        assert f"{tmp_path / 'file'} is a file, not a folder; write it to another path" in err
        err = error(capsys, argv + [str(locked / f"m{ext}")])
        assert err.count("\n") == 1 and f"{locked / f'm{ext}'}: cannot write a file in " \
            f"{locked} (permission denied); write it to another path, or fix the folder's " \
            "permissions" in err
    assert worked == []


def test_exported_weights_are_not_replaced_unasked(tmp_path, capsys):
    """`export RUN -o tiny.pt`, then `compile SPEC -o tiny.pt` (both --help examples) put
    fresh weights where the trained ones were, without a word; so could a second export."""
    saved_run(tmp_path, trained=True)
    spec, out = str(tmp_path / "t.restopo"), tmp_path / "tiny.pt"
    assert main(["export", str(tmp_path / "run"), "-o", str(out)]) == 0
    capsys.readouterr()
    before = out.read_bytes()
    for argv in (["compile", spec, "-o", str(out)],
                 ["export", str(tmp_path / "run"), "-o", str(out)]):
        err = error(capsys, argv)
        assert err.count("\n") == 1 and f"{out} already exists" in err and "--overwrite" in err
        assert out.read_bytes() == before
    module = tmp_path / "tiny_model.py"
    module.write_text("# my own\n")
    assert "already exists" in error(capsys, ["compile", spec, "-o", str(module)])
    assert module.read_text() == "# my own\n"
    trained = torch.load(out, weights_only=True)["state_dict"]
    assert main(["compile", spec, "-o", str(out), "--overwrite"]) == 0
    fresh = torch.load(out, weights_only=True)["state_dict"]
    assert not torch.equal(fresh["embed.weight"], trained["embed.weight"])
