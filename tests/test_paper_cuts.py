"""The newcomer's paper cuts: resume messages, train.keep, file modes under the umask, and
the `compile --help` examples, each as a person would meet it."""
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from restopo.cli import main

ROOT = Path(__file__).resolve().parents[1]
SPEC = """\
model t { vocab: 256; width: 16; depth: 1; heads: 2; context: 16 }
residual block_attnres(blocks: 1)
train { data: "corpus.txt"; steps: 3; batch: 2; warmup: 1; save_every: 1; eval_every: 0 }
"""


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "t.restopo").write_text(SPEC)
    return tmp_path / "t.restopo"


def train(*argv):
    return main(["train", *map(str, argv), "--no-progress"])


def test_resume_without_the_set_values_names_them(spec, capsys):
    assert train(spec, "--out", "run", "--set", "model.width=32") == 0
    capsys.readouterr()
    assert train(spec, "--out", "run", "--resume", "--set", "train.steps=4") == 1
    err = capsys.readouterr().err
    assert "--set model.width=32" in err and "size mismatch" not in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_resuming_with_more_steps_says_the_schedule_stretches(spec, capsys):
    assert train(spec, "--out", "run") == 0
    capsys.readouterr()
    assert train("--out", "run", "--resume", "--set", "train.steps=6",
                 "--set", "train.log_every=1") == 0
    err = capsys.readouterr().err
    assert "re-stretched over 6 steps" in err and "scheduled for 3" in err
    # the rate named is the one metrics.jsonl logs at the step named (it named step 3 for
    # step 4's rate)
    logged = [json.loads(line) for line in open("run/metrics.jsonl") if '"loss"' in line]
    lr4 = next(r["lr"] for r in logged if r["step"] == 4)
    assert "(at step 4, the next: " in err and f"before, {lr4:.3g} now)" in err, err
    assert train("--out", "run", "--resume", "--set", "train.steps=6") == 0  # same steps: quiet
    assert "re-stretched" not in capsys.readouterr().err


def test_resuming_with_other_settings_names_the_first_step_that_uses_them(spec, capsys):
    """The note named the checkpoint's step, trained with the old settings, as the first
    of the new ones (as the stretch note did before it named the next step)."""
    assert train(spec, "--out", "run", "--set", "train.log_every=1") == 0
    capsys.readouterr()
    assert train("--out", "run", "--resume", "--set", "train.steps=5", "--set",
                 "train.lr=1e-4", "--set", "train.schedule=constant") == 0
    err = capsys.readouterr().err
    first = int(err.split("the steps from ")[1].split()[0])
    lr = {r["step"]: r["lr"] for r in map(json.loads, open("run/metrics.jsonl"))}
    assert lr[first] == 1e-4 != lr[first - 1], (first, lr)


def test_min_lr_under_a_constant_schedule_is_said_to_be_unused(spec, capsys):
    """min_lr with schedule: constant trained at lr throughout without a word."""
    assert train(spec, "--out", "run", "--set", "train.schedule=constant",
                 "--set", "train.min_lr=1e-4", "--set", "train.log_every=1") == 0
    err = capsys.readouterr().err
    assert "train.min_lr (0.0001) is unused" in err and "schedule: constant" in err
    lrs = [json.loads(line)["lr"] for line in open("run/metrics.jsonl")]
    assert lrs[-1] == lrs[1] != 1e-4  # after the warmup step: lr, never min_lr
    assert train(spec, "--out", "cosine", "--set", "train.min_lr=1e-4") == 0
    assert "unused" not in capsys.readouterr().err


def test_steps_shorter_than_the_default_warmup_are_said(spec, capsys):
    """A file's `steps: 20` without a warmup trained all 20 steps in the default warmup
    (30), never reaching lr, unsaid (a written warmup that long is refused)."""
    spec.write_text(SPEC.replace("warmup: 1; ", "").replace("steps: 3", "steps: 4"))
    assert train(spec, "--out", "run", "--set", "train.log_every=1") == 0
    err = capsys.readouterr().err
    assert "train.steps (4) is shorter than the default warmup (30)" in err, err
    lrs = [json.loads(line)["lr"] for line in open("run/metrics.jsonl")]
    assert max(lrs) < 3e-3 and lrs[-1] == pytest.approx(3e-3 * 4 / 30)  # as the note says
    assert train(spec, "--out", "quick", "--steps", "2") == 0  # a quick try: as meant
    assert train(spec, "--out", "set", "--set", "train.warmup=2") == 0
    assert "default warmup" not in capsys.readouterr().err


def test_train_keep_is_a_spec_key(spec):
    assert train(spec, "--out", "run", "--set", "train.keep=2") == 0
    assert sorted(p.name for p in (spec.parent / "run" / "ckpt").iterdir()) == [
        "latest", "step_000002", "step_000003"]
    assert main(["check", str(spec), "--set", "train.keep=0"]) == 1


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_run_files_follow_the_umask(spec, umask):
    old = os.umask(umask)
    try:
        assert train(spec, "--out", "run") == 0
    finally:
        os.umask(old)
    run = spec.parent / "run"
    paths = [p for p in run.rglob("*")]
    assert any(p.name == "model.safetensors" for p in paths) and (run / "loss.png").exists()
    for p in paths:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_compile_help_examples_run(tmp_path, capsys):
    assert main(["compile", "--help"]) == 0
    lines = [ln.strip() for ln in capsys.readouterr().out.split("examples:")[1].splitlines()]
    commands = [ln.split("  #")[0] for ln in lines if ln.startswith(("restopo ", "python "))]
    assert any(c.startswith("python ") for c in commands) and ".code" not in " ".join(commands)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for command in commands:
        argv = shlex.split(command)
        argv = [sys.executable, "-m", "restopo", *argv[1:]] if argv[0] == "restopo" else \
            [sys.executable, *argv[1:]]
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0, (command, r.stderr)


def test_counts_of_steps_and_tokens_have_thousands_separators(spec, capsys, monkeypatch):
    """'20000 steps x 16 x 64 tokens' and 'done: 20000 steps' where the same lines said
    '1,024 parameters'; so did the resume note and compare's scale note."""
    import dataclasses

    import restopo
    import restopo.train.loop
    from restopo.decode import Decoder
    from restopo.experiments import report
    from restopo.experiments.runs import Run
    from restopo.train.runspec import Resumed, load, resume_notes, run_meta

    def trained(model, corpus, cfg, out, ctx, **kw):  # the run's own lines, not its steps
        return {"steps": cfg.steps, "loss": 1.0, "val_loss": None, "seconds": 1.0,
                "metrics": "m", "plot": "p", "checkpoint": None}

    monkeypatch.setattr(restopo.train.loop, "train", trained)
    assert train(spec, "--set", "model.context=1024", "--out", "r") == 1
    assert f"fewer than context + 1 = {1025:,};" in capsys.readouterr().err
    (spec.parent / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 1000)
    assert train(spec, "--steps", "20000", "--set", "model.context=1024", "--out", "r") == 0
    out, err = capsys.readouterr()
    assert f"{20000:,} steps x 2 x {1024:,} tokens" in err and f"done: {20000:,} steps" in out
    old = load(str(spec), ("train.steps=1500",))
    then = {**run_meta(old, str(spec.parent)), "step": 1, "config": dataclasses.asdict(
        restopo.train.loop.TrainConfig.from_spec(old.train, old.model.context))}
    note = resume_notes(load(str(spec), ("train.steps=20000",)), Resumed("ckpt", then))[-1]
    assert f"scheduled for {1500:,} steps" in note and f"over {20000:,} steps" in note
    meta = {"step": 1500, "spec_path": "/x/a.restopo", "spec_text": SPEC,
            "config": {"steps": 1500, "batch": 64, "context": 16}}
    note = report.scale_note(report.group([Run(Path("/x/a-s0"), "a", 0, meta, [])]))
    assert f"({1500:,} steps of {1024:,} tokens)" in note
    with pytest.raises(ValueError, match=f"is {2000:,} tokens, .* context {1024:,};"):
        Decoder(restopo.compile(SPEC.replace("context: 16", "context: 1024")), 1, 2000)


@pytest.mark.parametrize("broken", [
    ImportError("cannot load module more than once per process"),
    AttributeError("module 'numpy' has no attribute 'may_share_memory'"),
    RecursionError("maximum recursion depth exceeded")],
    ids=["import", "attribute", "recursion"])
def test_ctrl_c_inside_an_extensions_import_ends_as_a_stop(spec, capsys, monkeypatch, broken):
    """Ctrl-C in a command's first second, while torch imported numpy: torch caught and
    dropped the KeyboardInterrupt, and what used the half-imported numpy next failed with
    a traceback, exit 1: numpy's next import ('cannot load module more than once per
    process'), a numpy without its attributes, numpy.linalg's import recursing forever."""
    import signal

    import restopo.commands.check as check

    def importing(args):
        try:  # torch's import of numpy, stopped in its C code and the stop dropped
            os.kill(os.getpid(), signal.SIGINT)
            signal.getsignal(signal.SIGINT)  # the handler runs between bytecodes
        except KeyboardInterrupt:
            pass
        raise broken

    monkeypatch.setattr(check, "run", importing)
    assert main(["check", str(spec)]) == 130  # (SIGINT as interactive: conftest)
    assert capsys.readouterr().err == "restopo: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

    def failing(args):  # without a Ctrl-C, an error is no stop
        raise broken

    monkeypatch.setattr(check, "run", failing)
    with pytest.raises(type(broken)):
        main(["check", str(spec)])
