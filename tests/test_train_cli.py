"""`restopo train` through the CLI: a run, resume without the spec file, and user mistakes
(bad overrides, bad data) as one clear error with exit 1 and no traceback."""
import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from restopo.cli import main

SPEC = """\
model t { vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }
residual block_attnres(blocks: 2)
train {
  data: builtin:stdlib
  steps: 8; batch: 4; lr: 3e-3; warmup: 2
  eval_every: 4; eval_batches: 1; save_every: 4; log_every: 1
}
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("restopo-cache")


@pytest.fixture
def spec(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("RESTOPO_CACHE", str(cache))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the default: one thread
    path = tmp_path / "t.restopo"
    path.write_text(SPEC)
    return path


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_then_extend_from_the_checkpoint_alone(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "done: 8 steps" in printed and "step_000008" in printed
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    spec.unlink()  # the spec travels inside the checkpoint
    assert main(["train", "--resume", "--out", str(out), "--steps", "12", "--no-progress"]) == 0
    # the time said is this command's, for the steps it trained ('done: 12 steps (0 s)' read
    # as the run's twelve steps in no time)
    assert re.search(r"^done: 12 steps, .*\(steps 9 to 12 in \d+\.\d s\)$",
                     capsys.readouterr().out, re.M)
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 13))
    meta = json.loads((out / "ckpt" / "step_000012" / "meta.json").read_text())
    assert "train.steps=12" in meta["overrides"] and meta["spec_text"] == SPEC


def test_a_new_run_never_mixes_with_an_old_ones_checkpoints(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress", "--steps", "8"]) == 0
    err = _error(capsys, ["train", str(spec), "--out", str(out), "--steps", "4"])
    assert "already holds a run (latest checkpoint step_000008)" in err and "--resume" in err
    assert main(["train", str(spec), "--out", str(out), "--no-progress", "--steps", "4",
                 "--overwrite"]) == 0
    assert [p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step")] == [
        "step_000004"]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


def _error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    return err


def test_bad_override_names_the_flag(spec, capsys, tmp_path):
    err = _error(capsys, ["train", str(spec), "--set", "model.widht=64", "--out", str(tmp_path)])
    assert "--set model.widht=64" in err and "width" in err  # did you mean


@pytest.mark.parametrize("argv, said", [
    (["--steps", "20", "--set", "train.steps=10"], "--steps 20 and --set train.steps=10"),
    (["--seed", "1", "--set", "train.seed=2"], "--seed 1 and --set train.seed=2"),
    (["--data", "fsdp", "--set", "parallel.data=ddp"], "--data fsdp and --set parallel.data=ddp"),
    (["--compile", "--set", "train.compile=false"], "--compile and --set train.compile=false"),
])
def test_a_flag_and_a_set_that_disagree_are_refused(spec, capsys, tmp_path, argv, said):
    """The flag used to win silently: `--steps 20 --set train.steps=10` trained 20 steps."""
    out = tmp_path / "o"
    err = _error(capsys, ["train", str(spec), *argv, "--out", str(out)])
    assert said in err and "disagree" in err
    assert not out.exists()


def test_a_flag_and_a_set_that_agree_run(spec, tmp_path):
    out = tmp_path / "o"
    assert main(["train", str(spec), "--steps", "2", "--set", "train.steps=2", "--set",
                 "train.peak_tflops=5", "--peak-tflops", "5.0", "--out", str(out),
                 "--no-progress"]) == 0
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2]


def test_bad_data_path_points_at_the_value(spec, capsys, tmp_path):
    err = _error(capsys, ["train", str(spec), "--set", 'train.data="nowhere.txt"',
                          "--out", str(tmp_path / "o")])
    assert "<--set 1>:1:" in err and "nowhere.txt" in err and "does not exist" in err
    spec.write_text(SPEC.replace("builtin:stdlib", '"missing/corpus.txt"'))
    err = _error(capsys, ["train", str(spec), "--out", str(tmp_path / "o")])
    assert f"{spec}:4:9: error:" in err and "missing/corpus.txt" in err


def test_data_problems_are_spec_errors(spec, capsys, tmp_path):
    (tmp_path / "short.txt").write_text("tiny corpus")
    spec.write_text(SPEC.replace("builtin:stdlib", '"short.txt"'))  # relative to the spec
    err = _error(capsys, ["train", str(spec), "--out", str(tmp_path / "o")])
    assert "fewer than context + 1 = 33" in err
    err = _error(capsys, ["train", str(spec), "--set", "model.vocab=128", "--set",
                          "train.data=builtin:stdlib", "--out", str(tmp_path / "o")])
    assert "vocab mismatch" in err and "model.vocab" in err


def test_resume_mistakes(spec, capsys, tmp_path):
    err = _error(capsys, ["train", str(spec), "--resume", "--out", str(tmp_path / "fresh")])
    assert "no checkpoint" in err and "drop --resume" in err
    err = _error(capsys, ["train", "--out", str(tmp_path / "fresh")])
    assert "give a SPEC file" in err


def test_a_run_without_a_checkpoint_is_pointed_at_overwrite_not_resume(spec, capsys,
                                                                       tmp_path):
    """A run stopped before its first checkpoint left metrics.jsonl: plain train had said
    to --resume, and --resume to drop --resume, so neither way out was named."""
    out = tmp_path / "stopped"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    err = _error(capsys, ["train", str(spec), "--out", str(out)])
    assert "saved no checkpoint" in err and "--overwrite" in err and "--resume" not in err
    err = _error(capsys, ["train", str(spec), "--out", str(out), "--resume"])
    assert "--overwrite in place of --resume" in err and "drop --resume" not in err
    assert main(["train", str(spec), "--out", str(out), "--resume", "--overwrite"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    err = _error(capsys, ["train", str(spec), "--out", str(out), "--max-restarts", "2"])
    assert "--max-restarts is torchrun's, so it needs --nproc N" in err
    events = tmp_path / "events"  # a new run deletes TensorBoard's folder: only if asked
    (events / "tensorboard").mkdir(parents=True)
    err = _error(capsys, ["train", str(spec), "--out", str(events)])
    assert "already holds tensorboard of a run" in err and "--overwrite" in err


def test_console_script_bad_data_has_no_traceback(spec, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "restopo", "train", str(spec), "--set",
         'train.data="/no/such/dir"', "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "does not exist" in proc.stderr


def test_help_has_examples(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--nproc" in out and "restopo train examples/tiny.restopo" in out


def test_relative_data_is_read_next_to_the_spec_even_when_resuming(spec, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    moved = folder / "t.restopo"
    moved.write_text(SPEC.replace("builtin:stdlib", '"corpus.txt"'))
    monkeypatch.chdir(tmp_path)  # a relative spec path: the data is next to the spec
    out = tmp_path / "run"
    assert main(["train", "project/t.restopo", "--out", str(out), "--no-progress",
                 "--steps", "4"]) == 0
    moved.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # resumed from another folder, without the spec file
    assert main(["train", "--resume", "--out", str(out), "--steps", "6", "--no-progress"]) == 0
    assert [r["step"] for r in metrics(out)] == list(range(1, 7))


@pytest.mark.parametrize("with_spec", [True, False])
def test_a_resume_reads_the_checkpoint_and_parses_each_spec_once(spec, tmp_path, monkeypatch,
                                                                 with_spec):
    """Resuming read the checkpoint's meta.json twice (the spec and its notes, then the data
    note) and parsed the spec it records once for each note, and once more as the run's own
    when resumed without the spec file."""
    import restopo.spec
    import restopo.train.checkpoint as checkpoint
    import restopo.train.runspec as runspec
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress", "--steps", "4"]) == 0
    reads, read = [], checkpoint.read_meta
    parsed, parse = [], restopo.spec.parse_spec

    def read_meta(step_dir):  # the checkpoint module's own reads verify and load it
        if sys._getframe(1).f_globals["__name__"] != checkpoint.__name__:
            reads.append(step_dir)
        return read(step_dir)
    for module in (checkpoint, runspec):
        monkeypatch.setattr(module, "read_meta", read_meta)
    monkeypatch.setattr(restopo.spec, "parse_spec",
                        lambda text, *a, **kw: parsed.append((text, a, kw)) or parse(text, *a,
                                                                                     **kw))
    assert main(["train", *[str(spec)] * with_spec, "--resume", "--out", str(out),
                 "--no-progress"]) == 0
    assert len(reads) == 1 and parsed
    assert len(parsed) == len({repr(p) for p in parsed}), parsed


@pytest.mark.parametrize("change", ["append", "same size"])
def test_resuming_on_data_that_changed_since_the_checkpoint_says_so(spec, tmp_path, capsys,
                                                                   change):
    """Data edited between a run and its --resume went on unsaid: the saved data position
    then draws other windows than the run would have, and the validation split moves."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    spec.write_text(SPEC.replace("builtin:stdlib", f'"{corpus}"'))
    out = tmp_path / "run"
    argv = ["train", "--resume", "--out", str(out), "--no-progress", "--steps"]
    assert main(["train", str(spec), "--out", str(out), "--no-progress", "--steps", "4"]) == 0
    assert main(argv + ["5"]) == 0  # the same data: no note
    assert "has changed" not in capsys.readouterr().err
    text = corpus.read_text()
    corpus.write_text(text + "more text\n" * 50 if change == "append" else
                      text.replace("x + 1", "x - 1", 1))
    assert main(argv + ["6"]) == 0
    err = capsys.readouterr().err
    before, now = len(text.encode()), len(corpus.read_bytes())
    how = (f"{before:,} tokens then, {now:,} now" if change == "append" else
           "as many tokens, other content")
    assert (f"note: train.data, text file {corpus}, has changed since "
            f"{out / 'ckpt' / 'step_000005'} was saved ({how}" in err)


def test_a_changed_data_folder_is_said_without_brackets_in_brackets(tmp_path):
    """The note named a folder's data as 'train.data (text folder F (2 files)) has
    changed', brackets in brackets; the corpus's own description is now set off by commas."""
    from restopo.spec import parse_spec
    from restopo.train.data import open_corpus
    from restopo.train.runspec import Resumed, data_note, run_meta
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(f"{name} holds some text\n" * 50)
    spec = parse_spec(SPEC.replace("builtin:stdlib", f'"{folder}"'))
    corpus = open_corpus(spec.train.data)
    then = {"source": spec.train.data, "tokens": [1, 1], "sha256": "0"}  # other data then
    meta = {**run_meta(spec, str(tmp_path)), "data": then, "step": 3}
    note = data_note(spec, corpus, Resumed("ckpt/step_000003", meta))
    assert note.startswith(f"train.data, {corpus.description}, has changed since "), note
    depth = deepest = 0
    for ch in note:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    assert deepest == 1 and depth == 0, note


def test_a_checkpoint_without_optimizer_state_evaluates_and_exports_but_does_not_resume(
        spec, tmp_path, capsys):
    """Deleting optimizer.pt (needed only to train on) made eval and export refuse the step
    or fall back to an older one; train --resume must refuse it, saying why, not train on
    from an older step (which would replace it)."""
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    newest = out / "ckpt" / "step_000008"
    (newest / "optimizer.pt").unlink()
    capsys.readouterr()
    for argv in (["eval", str(out), "--no-progress", "--format", "json"],
                 ["eval", str(newest), "--no-progress", "--format", "json"]):
        assert main(argv) == 0
        said = capsys.readouterr()
        assert json.loads(said.out)["checkpoint"] == str(newest) and "note" not in said.err
    assert main(["export", str(out), "-o", str(tmp_path / "m.safetensors")]) == 0
    assert "note" not in capsys.readouterr().err
    err = _error(capsys, ["train", str(spec), "--out", str(out), "--resume", "--steps", "12"])
    assert "step_000008 has no optimizer.pt" in err and "step_000004" in err
    assert (newest / "model.safetensors").is_file() and not (out / "ckpt" / "damaged").exists()


def test_a_damaged_checkpoint_without_optimizer_state_is_passed_over_as_damaged(
        spec, tmp_path, capsys):
    """The newest checkpoint lacking optimizer.pt whose weights were damaged too was passed
    over without a word: --resume trained on from the step before it and saved over it. Its
    weights are nothing to keep, so it is passed over as a damaged one is: said, naming it
    and why, and moved to ckpt/damaged/."""
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--no-progress"]) == 0
    newest = out / "ckpt" / "step_000008"
    (newest / "optimizer.pt").unlink()
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["train", str(spec), "--out", str(out), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (f"{newest} is damaged (model.safetensors has 1,000 bytes, the manifest says "
            in err and "and it has no optimizer.pt); moved to ckpt/damaged/step_000008" in err)
    assert "resuming from step_000004, the newest checkpoint that verifies" in err
    assert (out / "ckpt" / "damaged" / "step_000008" / "model.safetensors").stat().st_size \
        == 1000  # kept aside, not saved over


def test_resume_keeps_the_seed_the_run_was_started_with(spec, tmp_path, capsys):
    """`train SPEC --resume` without --seed recorded seed 0 for a run started with --seed 5
    (the seed only drew its first weights and data order, which the checkpoint restores:
    another one on resume changes nothing but the record, so asking for one is refused)."""
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--steps", "4", "--seed", "5",
                 "--no-progress"]) == 0
    for argv, shown in (([str(spec), "--seed", "7"], "--seed 7"),
                        (["--set", "train.seed=7"], "--set train.seed=7")):  # no SPEC
        err = _error(capsys, ["train", *argv, "--out", str(out), "--resume", "--steps", "8"])
        assert "step_000004 is a run of seed 5" in err and f"leave {shown} out" in err
    assert main(["train", str(spec), "--out", str(out), "--resume", "--steps", "8",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "train.seed" not in err and "seed 5" not in err  # nothing changed: nothing said
    meta = json.loads((out / "ckpt" / "step_000008" / "meta.json").read_text())
    assert meta["config"]["seed"] == 5 and "train.seed=5" in meta["overrides"]
    assert main(["train", str(spec), "--out", str(out), "--resume", "--steps", "10",
                 "--seed", "5", "--no-progress"]) == 0  # the same seed again: fine


@pytest.mark.parametrize("where", ["file", "file/sub", "/proc/no-such/cache"])
def test_a_cache_that_cannot_be_made_names_restopo_cache(spec, capsys, tmp_path, monkeypatch,
                                                         where):
    """The error named only the path ('afile: File exists'), not the setting to change."""
    (tmp_path / "file").write_text("")
    value = where if where.startswith("/") else str(tmp_path / where)
    monkeypatch.setenv("RESTOPO_CACHE", value)
    err = _error(capsys, ["train", str(spec), "--out", str(tmp_path / "o"), "--backend",
                          "eager"])
    assert err.startswith(f"restopo: error: RESTOPO_CACHE={value} cannot hold restopo's "
                          "cache: "), err
    assert "set RESTOPO_CACHE to a folder you can write to" in err and err.count("\n") == 1
    if not where.startswith("/"):
        assert f"{tmp_path / 'file'} is a file, not a folder" in err, err


def test_diagnose_and_compare_make_their_folder_before_the_work(spec, capsys, tmp_path,
                                                                monkeypatch):
    """The folder was made once the numbers were in: one that could not be was said after
    the work was done, and the work lost. A folder they made is gone again if the work fails."""
    from restopo.experiments import report
    from restopo.train import diagnose

    run = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(run), "--steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "figures"
    worked = []
    for module, name in ((diagnose, "collect"), (report, "describe_models")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: (
            worked.append(name), real(*a, **k))[1])
    said = (f"restopo: error: {out}: cannot make this folder: {tmp_path / 'file'} is a file, "
            "not a folder; choose another --out\n")
    for argv in (["diagnose", str(run), "-o", str(out), "--batches", "1"],
                 ["compare", str(run), "--out", str(out)]):
        assert _error(capsys, argv) == said
    assert worked == []
    new = tmp_path / "new" / "figures"  # the work fails: no empty folders left behind
    assert _error(capsys, ["compare", str(run), "--out", str(new), "--baseline", "nope"])
    assert worked == ["describe_models"] and not (tmp_path / "new").exists()
    assert main(["diagnose", str(run), "-o", str(new), "--batches", "1"]) == 0
    assert worked[-1] == "collect" and (new / "diagnose.json").is_file()


def test_an_out_folder_that_cannot_be_written_says_so_in_one_line(spec, capsys, tmp_path,
                                                                   monkeypatch):
    """An existing --out whose lock file could not be opened was said as '.restopo.lock:
    permission denied', naming neither the folder nor what to do; compare and diagnose
    found theirs unwritable only when writing, after the work."""
    import restopo.train.runlock as runlock

    run = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(run), "--steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    real_open = os.open

    def refused(path, *a, **k):
        if os.path.basename(path) == runlock.LOCK_NAME:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", refused)
    said = (f"restopo: error: {out}: cannot write in this folder (permission denied opening "
            f"its lock file .restopo.lock); choose another --out, or fix the folder's "
            "permissions\n")
    assert _error(capsys, ["train", str(spec), "--out", str(out), "--steps", "2"]) == said
    err = _error(capsys, ["sweep", str(spec), "--out", str(out), "--set", "train.steps=2"])
    assert err.endswith(said) and err.count("\n") == 2, err  # its count of runs, then this
    assert os.listdir(out) == []
    monkeypatch.setattr(os, "open", real_open)
    real_access = os.access
    # root may write anywhere, so the protection is seen through os.access, as a user's
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == out
                        else real_access(p, mode))
    said = (f"restopo: error: {out}: cannot write in this folder (permission denied); "
            "choose another --out, or fix the folder's permissions\n")
    for argv in (["train", str(spec), "--out", str(out), "--steps", "2"],
                 ["diagnose", str(run), "-o", str(out), "--batches", "1"],
                 ["compare", str(run), "--out", str(out)]):
        assert _error(capsys, argv) == said
    assert os.listdir(out) == []


@pytest.mark.parametrize("blocker", ["file", "link"])
def test_an_out_folder_that_cannot_be_made_says_which_part_is_in_the_way(spec, capsys, tmp_path,
                                                                          blocker):
    """mkdir's own words named the path alone: 'Not a directory', 'File exists'."""
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    out = tmp_path / blocker / "run"
    why = {"file": f"{tmp_path / 'file'} is a file, not a folder",
           "link": f"{tmp_path / 'link'} is a symbolic link to {tmp_path / 'nowhere'}, which "
                   f"does not exist"}[blocker]
    err = _error(capsys, ["train", str(spec), "--out", str(out), "--steps", "2"])
    assert err == f"restopo: error: {out}: cannot make this folder: {why}; choose another " \
                  "--out\n"
    # diagnose's figures go in a folder of their own (-o), made before the numbers are taken
    run = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(run), "--steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(run), "-o", str(out), "--batches", "1"]) == 1
    err = capsys.readouterr().err
    assert err == f"restopo: error: {out}: cannot make this folder: {why}; choose another " \
                  "--out\n"


def test_the_options_a_spec_or_torchrun_decides_say_their_default():
    """--out said runs/<spec name> (the model's name, or the file's?), and --nproc, --pipeline
    and --data said no default, though the spec's parallel section (or torchrun) gives it."""
    from restopo.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    helps = {a.option_strings[-1]: " ".join(a.help.split())
             for a in sub.choices["train"]._actions if a.option_strings and a.help}
    assert "default: runs/ and the spec file's name, e.g. runs/tiny for tiny.restopo" in \
        helps["--out"]
    assert "default: this one process, or those torchrun started" in helps["--nproc"]
    assert "default: the spec's parallel section's, if any" in helps["--pipeline"]
    assert "default: the spec's, else ddp" in helps["--data"]
