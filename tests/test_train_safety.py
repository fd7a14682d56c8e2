"""`restopo train` and `restopo diagnose` never lose data or crash on what a user hands them
(issue 16): damaged checkpoints are passed over for the newest good one, settings the hints
document run, one run per folder, bounded data, bounded flags, checked checkpoint contents,
and no leftovers. Each case is the issue's reproducer, under a time limit."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hostile import time_limit
from restopo.cli import main
from restopo.train import checkpoint as ck
from restopo.train.plots import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "golden" / "corpus.txt"
SPEC = f"""\
model t {{ vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }}
residual block_attnres(blocks: 2)
train {{
  data: "{CORPUS}"
  steps: 16; batch: 4; lr: 3e-3; warmup: 2
  eval_every: 4; eval_batches: 1; save_every: 4; log_every: 1
}}
"""


@pytest.fixture(autouse=True)
def _each_under_a_time_limit():
    with time_limit(600):
        yield


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = tmp_path / "t.restopo"
    path.write_text(SPEC)
    return path


def train(*argv, limit=180):
    with time_limit(limit):
        return main(["train", *map(str, argv), "--no-progress"])


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def one_line_error(capsys, argv, code=1, limit=120):
    with time_limit(limit):
        got = main([*map(str, argv)])
    err = capsys.readouterr().err
    assert got == code, err
    assert "Traceback" not in err, err
    return err


def flip(path, offset, n=64):
    data = bytearray(path.read_bytes())
    for i in range(offset % len(data), min(offset % len(data) + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


# -- #2: damaged checkpoints ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_newest_checkpoint_falls_back_and_resumes_exactly(spec, tmp_path, capsys,
                                                                   damage):
    out = tmp_path / "run"
    assert train(spec, "--out", out) == 0
    clean = records(out)
    newest = out / "ckpt" / "step_000016" / "model.safetensors"
    if damage == "flip":  # the reproducer (offset inside this small file)
        flip(newest, 50000 % newest.stat().st_size)
    elif damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:1000])
    else:
        newest.write_bytes(b"\xff" * 8 + newest.read_bytes()[8:])
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume") == 0
    err = capsys.readouterr().err
    assert "step_000016 is damaged (model.safetensors" in err
    assert "moved to ckpt/damaged/step_000016" in err
    assert "resuming from step_000012, the newest checkpoint that verifies" in err
    def timeless(recs):  # the clock's figures differ; every loss must not, bit for bit
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed")}
                for r in recs]
    assert timeless(records(out)) == timeless(clean)
    assert (out / "ckpt" / "damaged" / "step_000016").is_dir()  # kept aside, not deleted
    assert ck.check_checkpoint(out / "ckpt" / "step_000016") is None  # saved again, intact


@pytest.mark.slow
def test_good_checkpoints_survive_a_run_resumed_past_damage(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.steps=12") == 0
    flip(out / "ckpt" / "step_000012" / "optimizer.pt", 5000)
    assert train(spec, "--out", out, "--resume", "--steps", "20") == 0
    kept = [p.name for p in ck.list_checkpoints(out / "ckpt")]
    assert kept == ["step_000012", "step_000016", "step_000020"]
    assert all(ck.check_checkpoint(out / "ckpt" / k) is None for k in kept)


@pytest.mark.slow
def test_checkpoint_contents_that_load_but_are_wrong(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.steps=8") == 0
    step8 = out / "ckpt" / "step_000008"
    torch.save({"step": 8}, step8 / "state.pt")  # the issue's {"step": 30}
    ck.write_manifest(step8)  # checksums agree: the schema must catch it
    assert train(spec, "--out", out, "--resume") == 0
    err = capsys.readouterr().err
    assert "state.pt has no data position" in err and "resuming from step_000004" in err
    meta = out / "ckpt" / "step_000016" / "meta.json"
    meta.write_text(meta.read_text().replace('"overrides": [', '"overrides": [1, '))
    ck.write_manifest(meta.parent)
    for step in ("step_000012", "step_000008", "step_000004"):
        if (out / "ckpt" / step).exists():
            (out / "ckpt" / step / "meta.json").write_text('{"spec_text": 123}')
    err = one_line_error(capsys, ["train", "--resume", "--out", out, "--no-progress"])
    # not 'drop --resume': a plain train into this folder would send them back to --resume
    assert "no intact checkpoint (all" in err and "--overwrite in place of --resume" in err


# -- #3: documented settings ------------------------------------------------------------------
@pytest.mark.slow
def test_save_every_and_eval_every_zero_turn_them_off(spec, tmp_path, capsys):
    """save_every 0 turns the periodic checkpoints off, not the last one: a finished run
    left no model (nothing to eval or export), and a sweep, finding no final checkpoint,
    trained it again."""
    from restopo.experiments import runner
    from restopo.experiments.grid import Job
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.save_every=0",
                 "--set", "train.eval_every=0", "--set", "train.steps=6") == 0
    printed = capsys.readouterr().out
    assert f"checkpoint  {out / 'ckpt' / 'step_000006'}" in printed
    assert [p.name for p in ck.list_checkpoints(out / "ckpt")] == ["step_000006"]
    assert all(r["val_loss"] is None for r in records(out)) and len(records(out)) == 6
    (out / "run.json").write_text(json.dumps({"status": "done"}))  # as a sweep's run
    assert runner.state(tmp_path, Job("run", "run", str(spec), (), 0)) == "done"


# -- #4: one run per folder -------------------------------------------------------------------
HOLD = """
import sys, time
from restopo.train.runlock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_held_run_folder_names_its_holder_and_frees_on_sigkill(spec, tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        err = one_line_error(capsys, ["train", spec, "--out", out, "--steps", "2"])
        assert f"{out} is in use by another run (pid {holder.pid}" in err
        assert "choose another --out" in err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert train(spec, "--out", out, "--steps", "2") == 0  # the kernel dropped the lock


def started_run(spec, out, steps: str, setting: str, *more: str):
    """`restopo train` in a child process, once it has logged its first step; (the child,
    its command, its environment)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "restopo", "train", str(spec), "--out", str(out),
           "--no-progress", "--steps", steps, "--set", setting, *more]
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    return child, cmd, env


def test_a_stop_while_overwrite_deletes_the_old_run_leaves_no_half_of_it(spec, tmp_path,
                                                                          capsys, monkeypatch):
    """Ctrl-C while --overwrite deleted the old run's checkpoints (seconds, for large ones)
    left some of them half deleted, for the next run to take for damaged ones (and --resume
    to go on from an older one). They are set aside in one step, then deleted; the next run
    removes what a stop left of them."""
    import shutil
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 8) == 0
    rmtree = shutil.rmtree

    def stopped(path, *args, **kwargs):  # deletes one file, then the Ctrl-C comes
        newest = sorted(Path(path).rglob("*.safetensors"))[-1]
        newest.unlink()
        monkeypatch.setattr(shutil, "rmtree", rmtree)
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", stopped)
    assert train(spec, "--out", out, "--overwrite") == 130
    assert shutil.rmtree is rmtree  # it came to the delete
    left = {p.name: ck.verify_checkpoint(p) for p in (out / "ckpt").glob("step_*")}
    assert set(left.values()) <= {None}, left  # each whole, or none there
    capsys.readouterr()
    assert train(spec, "--out", out, "--overwrite", "--steps", 2) == 0
    assert "removed .old-ckpt-" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".restopo.lock"]


@pytest.mark.slow
def test_two_runs_into_one_folder(spec, tmp_path):
    """The second run is refused while the first trains (the first, of 200 steps, could end
    before the second had started on a loaded machine: 'already holds a run'); the first,
    then stopped, is whole."""
    out = tmp_path / "run"
    first, cmd, env = started_run(spec, out, "100000", "train.save_every=20")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    first.send_signal(signal.SIGINT)
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 130, first_err
    assert second.returncode == 1 and "is in use by another run" in second.stderr
    steps = [r["step"] for r in records(out)]
    saved = ck.latest_checkpoint(out / "ckpt")
    assert steps == sorted(set(steps)) and steps[-1] == int(saved.name.split("_")[1])
    assert ck.verify_checkpoint(saved) is None
    assert [p.name for p in (out / "ckpt").iterdir() if not p.name.startswith("step")] == \
        ["latest"]  # no temporary or empty folders


@pytest.mark.parametrize("how, every", [("SIGINT", 1000), ("SIGTERM", 1000), ("SIGINT", 0)])
def test_ctrl_c_saves_the_step_it_stops_at(spec, tmp_path, how, every):
    """The first Ctrl-C ends the run after the step it is in, with a checkpoint of that
    step (save_every 1000 here: without it every step would be lost; 0, no periodic
    checkpoints, lost them all), and says where --resume continues; the resumed run then
    goes on from that step. SIGTERM (a scheduler's preemption) is taken the same way: it
    ended the run at once, unsaved."""
    out = tmp_path / "run"
    run, _, _ = started_run(spec, out, "100000", f"train.save_every={every}")
    run.send_signal(getattr(signal, how))
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert "stopping after this step" + ("" if how == "SIGINT" else " (SIGTERM)") in err
    assert "Traceback" not in err, err
    saved = ck.latest_checkpoint(out / "ckpt")
    assert saved is not None and ck.verify_checkpoint(saved) is None
    assert f"--resume continues from its checkpoint {saved}" in err
    stopped = int(saved.name.split("_")[1])
    assert 1 <= stopped < 1000 or every == 0
    # the curve up to the stop is drawn (it was left undrawn: none after --overwrite)
    assert (out / "loss.png").stat().st_size > 1000
    assert train(spec, "--out", out, "--resume", "--steps", stopped + 2) == 0
    assert [r["step"] for r in records(out)][-1] == stopped + 2


def processes_writing(out) -> list[str]:
    """The command lines of live processes that name the run folder `out`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = (Path("/proc") / pid / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if str(out).encode() in args:
            found.append(b" ".join(args).decode(errors="replace"))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_stopping_the_launcher_of_nproc_stops_its_workers(spec, tmp_path, how):
    """torchrun's workers run in sessions of their own: a signal to `restopo train --nproc`
    alone (before: torchrun killed, the workers training on, unlocked) must stop them all,
    SIGINT with one line saying where --resume continues, SIGKILL through the agent's
    parent-death signal; a resume then runs to the end."""
    out = tmp_path / "run"
    run, _, _ = started_run(spec, out, "100000", "train.save_every=2", "--nproc", "2")
    while not (out / "ckpt" / "latest").exists() and run.poll() is None:
        time.sleep(0.2)
    run.send_signal(getattr(signal, how))
    _, err = run.communicate(timeout=120)
    deadline = time.time() + 60  # SIGKILL: the agent then stops its workers, a moment later
    while processes_writing(out) and time.time() < deadline:
        time.sleep(0.5)
    assert processes_writing(out) == []
    saved = ck.latest_checkpoint(out / "ckpt")
    if how == "SIGINT":
        assert run.returncode == 130 and "Traceback" not in err, err
        assert f"stopped (SIGINT); the workers are stopped; --resume continues from " \
               f"{saved.name}" in err, err
    end = int(saved.name.split("_")[1]) + 2
    assert train(spec, "--out", out, "--resume", "--steps", end, "--nproc", "2") == 0
    assert records(out)[-1]["step"] == end


@pytest.mark.slow
def test_ctrl_c_of_nproc_saves_the_step_it_stops_at(spec, tmp_path):
    """With several processes too, Ctrl-C ends the run after a step every rank agrees on,
    with a checkpoint of it (it stopped the workers at once: with train.save_every 0, every
    step was lost), said once, by rank 0; a resume in one process goes on from there."""
    out = tmp_path / "run"
    run, _, _ = started_run(spec, out, "100000", "train.save_every=0", "--nproc", "2")
    while max([r["step"] for r in read_metrics(out / "metrics.jsonl")] or [0]) < 3 \
            and run.poll() is None:  # read_metrics: a line being written is skipped
        time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130 and "Traceback" not in err, err
    saved = ck.latest_checkpoint(out / "ckpt")
    assert saved is not None and ck.verify_checkpoint(saved) is None, err
    stopped = ck.step_of(saved)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == stopped >= 3
    assert err.count("stopping after this step, with a checkpoint of it") == 1, err
    assert err.count(f"--resume continues from its checkpoint {saved}") == 1, err
    assert f"the workers are stopped; --resume continues from {saved.name}\n" in err, err
    assert train(spec, "--out", out, "--resume", "--steps", stopped + 2) == 0
    assert [r["step"] for r in records(out)] == list(range(1, stopped + 3))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_ctrl_c_of_nproc_ends_the_workers_at_once(spec, tmp_path):
    """A second Ctrl-C waited out torchrun's 30 s for workers that do not stop (here rank 1
    is frozen, so rank 0 waits for it in the step's collectives): they now end at once, the
    checkpoint saved before intact, and the line says why the steps after it are lost."""
    from test_train_processes import _worker_pids

    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 2) == 0
    run, _, _ = started_run(spec, out, "100000", "train.save_every=0", "--nproc", "2",
                            "--resume")
    while max([r["step"] for r in read_metrics(out / "metrics.jsonl")] or [0]) < 3 \
            and run.poll() is None:
        time.sleep(0.2)
    frozen = _worker_pids(run.pid, "1")
    assert len(frozen) == 1
    os.kill(frozen[0], signal.SIGSTOP)
    run.send_signal(signal.SIGINT)
    time.sleep(1)
    run.send_signal(signal.SIGINT)
    second = time.time()
    _, err = run.communicate(timeout=120)
    assert time.time() - second < 15, err  # not torchrun's 30 s
    assert run.returncode == 130 and "Traceback" not in err, err
    deadline = time.time() + 5  # killed: gone within moments
    while processes_writing(out) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_writing(out) == []
    saved = ck.latest_checkpoint(out / "ckpt")
    assert saved.name == "step_000002" and ck.verify_checkpoint(saved) is None, err
    reached = [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1]
    assert (f"--resume continues from step_000002; steps 3-{reached} are lost (the second "
            f"stop ended the workers at once)\n") in err, err


@pytest.mark.slow
def test_two_ctrl_c_of_a_raw_torchrun_stop_its_workers_at_once(spec, tmp_path):
    """A terminal's Ctrl-C reaches a raw torchrun (its workers run in sessions of their own),
    which passes the first on as SIGINT and the second as SIGTERM: rank 0 says the stop
    once, as the one-process line says it, and the run ends well within torchrun's 30 s,
    its newest checkpoint whole."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "restopo", "train", str(spec), "--out", str(out),
           "--no-progress", "--steps", "100000", "--set", "train.save_every=2"]
    run = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                           stderr=subprocess.PIPE, start_new_session=True)
    while max([r["step"] for r in read_metrics(out / "metrics.jsonl")] or [0]) < 3 \
            and run.poll() is None:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)  # the terminal's foreground process group
    time.sleep(0.3)
    os.killpg(run.pid, signal.SIGINT)
    second = time.time()
    _, err = run.communicate(timeout=120)
    assert time.time() - second < 15, err
    assert err.count("restopo train: stopping after this step, with a checkpoint of it "
                     "(Ctrl-C again to stop now)") == 1, err
    assert err.count("restopo: interrupted") <= 1, err
    saved = ck.latest_checkpoint(out / "ckpt")
    assert saved is not None and ck.verify_checkpoint(saved) is None, err


def test_a_stop_of_nproc_says_the_steps_it_lost(tmp_path):
    """Steps trained after the last checkpoint (torchrun killed the workers before they
    saved the one they stopped at) are said to be lost, not only where --resume goes."""
    from restopo.train.dist import _after_stop

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    assert _after_stop(tmp_path / "ckpt").startswith(
        "no checkpoint was saved yet; steps 1-7 are lost (torchrun killed the workers")
    ck.save_checkpoint(tmp_path / "ckpt", 5, torch.nn.Linear(2, 2), None, {"step": 5}, {})
    assert _after_stop(tmp_path / "ckpt").startswith(
        "--resume continues from step_000005; steps 6-7 are lost")
    ck.save_checkpoint(tmp_path / "ckpt", 7, torch.nn.Linear(2, 2), None, {"step": 7}, {})
    assert _after_stop(tmp_path / "ckpt") == "--resume continues from step_000007"
    assert _after_stop(tmp_path / "ckpt", at_once=True) == "--resume continues from step_000007"


def test_resume_names_what_differs_not_a_flag_given_again(spec, tmp_path, capsys):
    """Resuming with other --steps and another width: the refusal names the width (it had
    named the stored train.steps as the missing cause); with --steps alone, no note says
    train.steps is not given (it is, with another value)."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4) == 0
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", 6, "--set", "model.width=16") == 1
    err = capsys.readouterr().err
    assert "width 32 there, 16 here" in err and "train.steps=4, which" not in err
    assert train(spec, "--out", out, "--resume", "--steps", 6) == 0
    assert "does not give it" not in capsys.readouterr().err


def test_resume_reads_a_set_train_data_as_the_place_its_run_read(spec, tmp_path, capsys,
                                                                  monkeypatch):
    """A run's --set train.data=a.txt, relative to the folder it was started in, resumed
    from another folder: the refusal told the user to give --set train.data=a.txt (another
    file there) and each resume's --steps in turn; the same file given by its absolute path
    was 'other settings', and its changed content went unsaid. Data is now compared, and
    named, where the run read it."""
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    data = first / "a.txt"
    data.write_text(CORPUS.read_text())
    out = tmp_path / "run"
    monkeypatch.chdir(first)
    assert train(spec, "--out", out, "--steps", 2, "--set", "train.data=a.txt") == 0
    assert train("--out", out, "--resume", "--steps", 4) == 0  # records train.steps again
    monkeypatch.chdir(other)
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", 6, "--set",
                 "model.width=16") == 1
    err = capsys.readouterr().err
    # train.steps is left out: given again, it would end the resume where the run is
    assert f"(--set train.data={data})" in err and "train.steps" not in err, err
    data.write_text(CORPUS.read_text()[::-1])  # as many tokens, other content
    assert train(spec, "--out", out, "--resume", "--steps", 6, "--set",
                 f"train.data={data}") == 0
    err = capsys.readouterr().err
    assert "other settings" not in err, err
    assert "has changed since" in err and "as many tokens, other content" in err, err


@pytest.mark.parametrize("then, now", [
    ("residual.blocks=2", "residual.block_size=2"),  # one setting, two ways of saying it
    ("model. width=32", "model.width=32"),  # one key, spelt with a blank
])
def test_resume_reads_an_override_by_the_setting_it_sets(spec, tmp_path, capsys, then, now):
    """The run's --set and the resume's name one setting: no note that the resume does not
    give it (keys were compared as typed)."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4, "--set", then) == 0
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", 6, "--set", now) == 0
    err = capsys.readouterr().err
    assert "does not give it" not in err, err
    assert records(out)[-1]["step"] == 6


@pytest.mark.parametrize("residual, named", [
    ("full_attnres", "full_attnres"),  # same weight shapes: was resumed without a word
    ("block_attnres(blocks: 1)", "block_attnres(blocks: 1)"),
    ("standard", "standard"),  # other weights: was a late list of weight names
])
def test_resume_under_another_topology_is_refused(spec, tmp_path, capsys, residual, named):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 2) == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_text()
    err = one_line_error(capsys, ["train", spec, "--out", out, "--resume", "--steps", 4,
                                  "--set", f"residual={residual}", "--no-progress"])
    assert f"was trained as block_attnres(blocks: 2); this run's residual is {named}:" in err
    assert "leave the spec file out" in err
    assert "resuming from" not in err and (out / "metrics.jsonl").read_text() == before
    err = one_line_error(capsys, ["train", "--out", out, "--resume", "--set",  # no spec file
                                  f"residual={residual}", "--no-progress"])
    assert "leave out the --set values that change it" in err and "spec file" not in err


def test_resume_from_another_file_of_another_depth_names_the_size_not_the_topology(
        spec, tmp_path, capsys):
    """Another spec file with the same residual line and another depth was refused as
    'trained as block_attnres(blocks: 2); this run's residual is block_attnres(blocks: 2)'
    (the resolved topology counts sublayers), after a note that the file had 'changed'."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 2) == 0
    capsys.readouterr()
    other = tmp_path / "deeper.restopo"
    other.write_text(SPEC.replace("depth: 2", "depth: 4"))
    err = one_line_error(capsys, ["train", other, "--out", out, "--resume", "--no-progress"])
    assert "weights do not fit this run's model (depth 2 there, 4 here)" in err, err
    assert "trained as" not in err and "changed since" not in err
    # the file it was trained from, in the refusal: no note saying 'resuming with' before it
    assert f"was trained from {spec}, not from {other})" in err
    assert "resuming with" not in err and len(err.strip().splitlines()) == 1, err


def test_a_resume_whose_weights_do_not_fit_leaves_the_runs_length_out_of_its_hint(
        spec, tmp_path, capsys):
    """The refusal listed every --set value the run was trained with, train.steps among
    them: given again as said, the resume ran to the step the run had already reached and
    trained nothing. The others are the run's own, to give again (its length is --steps)."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "model.depth=1", "--set", "train.steps=2",
                 "--set", "train.lr=1e-3") == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["train", spec, "--out", out, "--resume", "--no-progress"])
    assert "weights do not fit this run's model (depth 1 there, 2 here)" in err, err
    assert "(--set model.depth=1 --set train.lr=1e-3)" in err and "train.steps" not in err, err


def test_overwrite_deletes_the_old_run_only_once_the_new_one_passed_every_check(
        spec, tmp_path, capsys):
    """--overwrite deleted the old run's checkpoints before the layout, compile and data
    checks: a command then refused for a typo had destroyed the run it was refused for."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4) == 0
    capsys.readouterr()
    kept = sorted(p.name for p in (out / "ckpt").iterdir())
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for extra in (["--pipeline", "2x1"], ["--set", f"train.data={empty}"]):
        one_line_error(capsys, ["train", spec, "--out", out, "--overwrite", "--no-progress",
                                *extra])
        assert sorted(p.name for p in (out / "ckpt").iterdir()) == kept, extra
    assert train(spec, "--out", out, "--overwrite", "--steps", 2) == 0  # and it does replace
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["latest", "step_000002"]


def test_a_parallel_section_set_aside_by_one_process_is_said(spec, tmp_path, capsys):
    """One process trains the whole model whatever the spec's parallel section says (as
    before); it did so without a word, while --pipeline on one process is refused."""
    piped = tmp_path / "piped.restopo"
    piped.write_text(SPEC + "parallel { pipeline(stages: 2) }\n")
    assert train(piped, "--out", tmp_path / "run", "--steps", 1) == 0
    err = capsys.readouterr().err
    assert "the spec's parallel section (pipeline 2x1) is for several processes" in err
    assert "--nproc 2 runs it" in err
    # a flag is named as the flag, not as the spec's section
    assert train(spec, "--out", tmp_path / "run2", "--steps", 1, "--data", "fsdp") == 0
    err = capsys.readouterr().err
    assert "--data fsdp is for several processes" in err and "parallel section" not in err
    assert train(piped, "--out", tmp_path / "run3", "--steps", 1, "--data", "fsdp") == 0
    assert ("the spec's parallel section (pipeline 2x1) and --data fsdp are for several "
            "processes" in capsys.readouterr().err)


@pytest.mark.slow
def test_fsdp_with_one_replica_per_stage_is_said(spec, tmp_path, capsys):
    """--data fsdp with a pipeline as wide as the run: each stage has one replica, so
    nothing is sharded; the run said only 'pipeline 2x1 (2 processes)'."""
    assert train(spec, "--out", tmp_path / "run", "--steps", 1, "--nproc", 2,
                 "--pipeline", 2, "--data", "fsdp") == 0
    err = capsys.readouterr().err
    assert ("--data fsdp shards each stage over its data-parallel replicas, and pipeline 2x1 "
            "on 2 processes leaves one: nothing is sharded (--nproc 4 gives each stage 2)"
            in err), err


def test_resume_past_the_steps_asked_says_there_is_nothing_to_train(spec, tmp_path, capsys):
    """A finished 4-step run resumed with --steps 2 trained nothing (right) but said 'done:
    2 steps' and that the schedule follows a new curve 'from here'."""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4) == 0
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", 2) == 0
    cap = capsys.readouterr()
    assert "is at step 4, at or past train.steps (2): there is nothing to train" in cap.err
    assert "new curve" not in cap.err and cap.out.startswith("done: 4 steps")


def test_resume_with_other_training_settings_names_them(spec, tmp_path, capsys):
    """(Another seed on resume is refused: test_train_cli, the seed the run started with.)"""
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 2) == 0
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", 3, "--set", "train.batch=2",
                 "--set", "train.lr=1e-3") == 0
    err = capsys.readouterr().err
    assert "other settings than" in err and "batch 4 there, 2 here; lr 0.003 there, 0.001 " \
        "here" in err, err
    assert train(spec, "--out", out, "--resume", "--steps", 4, "--set", "train.batch=2",
                 "--set", "train.lr=1e-3") == 0
    assert "other settings" not in capsys.readouterr().err  # now the same as the checkpoint's
    # how validation is measured changes the curve, not the training: said apart
    assert train(spec, "--out", out, "--resume", "--steps", 5, "--set", "train.batch=2",
                 "--set", "train.lr=1e-3", "--set", "train.eval_batches=2") == 0
    err = capsys.readouterr().err
    assert "train.eval_batches is now 2 (1 in" in err and "other settings" not in err, err


def test_a_second_ctrl_c_stops_at_once_and_the_handler_is_put_back():
    from restopo.train.interrupt import deferred_interrupt
    # (with the handler an interactive run has, whatever launched pytest: conftest)
    said = []
    main = threading.main_thread().ident  # where Python runs its handlers
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt(said.append) as stop:
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
            assert stop.asked and "stopping after this step" in said[0]
            signal.pthread_kill(main, signal.SIGINT)  # the second: at once
            time.sleep(1)
            raise AssertionError("the second Ctrl-C did not stop")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_workers_stop_line_says_a_second_ctrl_c_stops_now(monkeypatch):
    """Rank 0's line under torchrun (whose SIGTERM is the launcher's Ctrl-C passed on) is the
    one-process Ctrl-C line: it lacked "Ctrl-C again to stop now", which holds there too."""
    from restopo.train.interrupt import deferred_interrupt

    said = {}
    main = threading.main_thread().ident
    for torchrun in (False, True):
        if torchrun:
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", "2")
        lines = said.setdefault(torchrun, [])
        # the handler put back after the first: a no-op, so no late SIGTERM ends pytest
        outside = signal.signal(signal.SIGTERM, lambda *a: None)
        try:
            with deferred_interrupt(lines.append):
                signal.pthread_kill(main, signal.SIGTERM)
                time.sleep(0.1)
        finally:
            signal.signal(signal.SIGTERM, outside)
    assert said[False] == ["stopping after this step (SIGTERM), with a checkpoint of it "
                           "(Ctrl-C again to stop now)"]
    assert said[True] == [said[False][0].replace(" (SIGTERM)", "")]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stop_under_torchrun_is_said_by_rank_0_alone(monkeypatch, capsys, rank):
    """A raw torchrun passes its Ctrl-C on to every worker: stopped before training (loading
    data, building the model), each said 'restopo: interrupted', as a mistake is said once."""
    from restopo.commands import check

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "run", stopped)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["check", "any.restopo"]) == 130
    assert capsys.readouterr().err == ("restopo: interrupted\n" if rank == "0" else "")


def _dropped_ctrl_c():
    """A Ctrl-C that comes inside a C extension's import and is dropped there, as torch's
    import of numpy drops one: main's handler saw it, and no KeyboardInterrupt is left."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # the handler runs between bytecodes
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize("command, setup", [
    ("train", "restopo.train.runspec.open_data"), ("eval", "restopo.saved.load"),
    ("export", "restopo.saved.load"), ("diagnose", "restopo.train.checkpoint.holding_checkpoint"),
    ("compile", "restopo.spec.load_spec"), ("sweep", "restopo.experiments.runner.adopt_names")])
def test_a_ctrl_c_an_import_dropped_stops_the_command_before_its_work(
        spec, tmp_path, capsys, monkeypatch, command, setup):
    """Ctrl-C in a command's first second, inside torch's import: torch dropped it (about
    8 tries in 30), and the command worked on as if none had come (train --overwrite
    replacing the old run). It stops before its work, as a stop, and nothing is written."""
    import importlib

    out, elsewhere = tmp_path / "run", tmp_path / "new"
    assert train(spec, "--out", out, "--steps", 4) == 0
    argv = {"train": [spec, "--out", out, "--overwrite", "--no-progress"], "eval": [out],
            "export": [out, "-o", elsewhere / "m.pt"], "diagnose": [out, "-o", elsewhere],
            "compile": [spec, "-o", elsewhere / "m.py"],
            "sweep": [spec, "--out", elsewhere, "--set", "train.steps=2"]}[command]
    elsewhere.mkdir()
    module, name = setup.rsplit(".", 1)
    module = importlib.import_module(module)
    setting_up = getattr(module, name)

    def importing(*args, **kwargs):
        _dropped_ctrl_c()
        return setting_up(*args, **kwargs)

    monkeypatch.setattr(module, name, importing)
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")
             if p.is_file() and p.name != ".restopo.lock"}
    capsys.readouterr()
    with time_limit(180):
        assert main([command, *map(str, argv)]) == 130
    said = capsys.readouterr()
    assert said.err.endswith("restopo: interrupted\n") and "Traceback" not in said.err, said
    assert said.out == ""
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")
            if p.is_file() and p.name != ".restopo.lock"} == files  # nothing written


# restopo run with a Ctrl-C as the import of sys.argv[1] begins (as torch's C code imports
# it), started as sys.argv[2] says
_CTRL_C_IN_AN_IMPORT = """
import os, runpy, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
            signal.getsignal(signal.SIGINT)  # the handler runs between bytecodes
at, how = sys.argv.pop(1), sys.argv.pop(1)
sys.meta_path.insert(0, CtrlC())
if how == "console script":
    from restopo.__main__ import run  # as the installed `restopo` does
    run()
runpy.run_module("restopo", run_name="__main__", alter_sys=True)
"""


def ctrl_c_in_an_import(at: str, *argv, how: str = "-m") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CTRL_C_IN_AN_IMPORT, at, how,
                           *map(str, argv)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("command", ["graph", "train"])
def test_a_ctrl_c_during_torchs_import_stops_the_command_after_it(spec, tmp_path, command):
    """Ctrl-C while torch imported numpy: torch's C code caught the KeyboardInterrupt and
    dropped it, and restopo graph wrote its graph as if none had come, restopo train loaded
    the data and built the model first (or, in about 1 try in 50, the process aborted).
    torch's import now finishes first, and the stop is taken right after it."""
    out = tmp_path / "out"
    argv = {"graph": [spec, "-o", tmp_path / "g.dot"],
            "train": [spec, "--out", out, "--no-progress"]}[command]
    run = ctrl_c_in_an_import("numpy", command, *argv)
    assert (run.returncode, run.stderr) == (130, "restopo: interrupted\n")
    assert not (tmp_path / "g.dot").exists() and not out.exists()


@pytest.mark.parametrize("how", ["-m", "console script"])
def test_a_ctrl_c_while_the_cli_imports_is_said_as_a_stop(spec, how):
    """Ctrl-C in the first tenth of a second, as `import restopo` and restopo.cli imported
    the spec front end, before main takes Ctrl-C: a KeyboardInterrupt's traceback, and
    python -m restopo ended by SIGINT (-2)."""
    run = ctrl_c_in_an_import("restopo.cli", "check", spec, how=how)
    assert (run.returncode, run.stderr) == (130, "restopo: interrupted\n")


# a stop handled by a process busy in one long C call (hashlib's, as a collective waiting
# for a slower rank or a large save would be): both signals come before Python can run the
# handler of the first
_DURING_A_C_CALL = """
import hashlib, os, signal, sys, threading, time
from restopo.train.interrupt import deferred_interrupt
signal.signal(signal.SIGINT, signal.default_int_handler)
inside = threading.Event()
def send():
    inside.wait()
    for name in sys.argv[1:]:  # apart as keys are pressed: the kernel merges a SIGINT sent
        os.kill(os.getpid(), getattr(signal, name))  # before the one pending is delivered
        time.sleep(0.05)
threading.Thread(target=send).start()
try:
    with deferred_interrupt(print):
        inside.set()
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 5_000_000)
        print("went on")
except KeyboardInterrupt:
    print("stopped at once")
"""


@pytest.mark.parametrize("signals", [("SIGINT", "SIGINT"), ("SIGINT", "SIGTERM")])
def test_a_second_stop_that_comes_before_the_first_is_handled_stops_at_once(signals):
    """Two Ctrl-C while the main thread was in one C call ran the handler once, and a raw
    torchrun's second Ctrl-C (SIGTERM after its SIGINT) was dropped with 'Signal 15 ignored
    due to race condition': the run went on to the end of its step and saved, and torchrun
    waited its 30 s for it. A second stop now ends it at once, as the signal would."""
    got = subprocess.run([sys.executable, "-c", _DURING_A_C_CALL, *signals],
                         capture_output=True, text=True, timeout=120)
    assert "went on" not in got.stdout and "race condition" not in got.stderr, got
    if signals[-1] == "SIGTERM":
        assert got.returncode == -signal.SIGTERM, got
    else:
        assert got.stdout.strip() == "stopped at once", got


# -- #5, #6: data, paths and flags --------------------------------------------------------
def test_data_folders_are_bounded_and_data_paths_checked(spec, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text("some text " * 50)
    monkeypatch.setenv("RESTOPO_DATA_MAX_FILES", "5")
    err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "a", "--set",
                                  f"train.data={folder}"])
    assert "more than 5 files" in err and "RESTOPO_DATA_MAX_FILES" in err
    monkeypatch.setenv("RESTOPO_DATA_MAX_FILES", "100")
    monkeypatch.setenv("RESTOPO_DATA_MAX_BYTES", "1000")
    err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "a", "--set",
                                  f"train.data={folder}"])
    assert "more than 1,000 bytes" in err and "RESTOPO_DATA_MAX_BYTES" in err
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for data, words in ((fifo, "not a regular file"), (tmp_path / ("d" * 300), "too long")):
        err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "a", "--set",
                                      f"train.data={data}"])
        assert words in err


@pytest.mark.parametrize("flag, value", [("--threads", "100000"), ("--threads", "0"),
                                         ("--max-restarts", "-1"), ("--nproc", "0")])
def test_numeric_flags_are_bounded(spec, tmp_path, capsys, flag, value):
    err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "r", flag, value], code=2)
    assert f"argument {flag}: must be from" in err


@pytest.mark.parametrize("argv, said", [
    (["sweep", "S", "--out", "O", "--seeds", "0"], "argument --seeds: must be at least 1, got 0"),
    (["sweep", "S", "--out", "O", "--jobs", "0"], "argument --jobs: must be at least 1, got 0"),
    (["eval", "R", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["diagnose", "R", "--batches", "0"], "argument --batches: must be from 1 to 1000, got 0")])
def test_a_count_flag_out_of_range_is_named_as_typed(capsys, argv, said):
    """sweep said '--seeds and --jobs must be at least 1' of either, naming both."""
    err = one_line_error(capsys, argv, code=2)
    assert said in err


@pytest.mark.parametrize("flag, value, said", [
    ("--steps", "0", "'steps' must be at least 1, got 0"),
    ("--peak-tflops", "0", "'peak_tflops' must be greater than 0, got 0.0"),
    ("--seed", "-5", "'seed' must be at least 0, got -5")])
def test_a_flag_the_spec_refuses_is_shown_as_typed(spec, tmp_path, capsys, flag, value, said):
    """A train flag that stands for a spec value is checked by the spec's rules, and its
    error points at the flag as typed (it showed '<--set 1>' and a --set never written)."""
    err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "r", flag, value])
    shown = f"{flag} {'0.0' if flag == '--peak-tflops' else value}"
    col = len(flag) + 2
    assert f"<{flag}>:1:{col}: error: {said}" in err and f"    {shown}\n" in err, err
    assert "--set" not in err and not (tmp_path / "r").exists()


def test_out_and_diagnose_o_naming_a_file(spec, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = one_line_error(capsys, ["train", spec, "--out", afile])
    assert "is a file, not a folder" in err
    err = one_line_error(capsys, ["diagnose", tmp_path, "-o", afile])
    assert "is a file, not a folder" in err and afile.read_text() == "mine"


# -- #7: leftovers and misleading lines ----------------------------------------------------
@pytest.mark.slow
def test_leftovers_of_killed_runs_are_swept_on_start(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.steps=8") == 0
    ckpt = out / "ckpt"
    (ckpt / ".pruned-step_000001-99").mkdir()
    (ckpt / ".tmp-step_000009-x").mkdir()
    (ckpt / ".latest-abc").write_text("step_000008\n")
    (out / ".restopo-xyz.jsonl").write_text("{}")
    half = ckpt / "step_000002"  # a kill mid-delete by an older restopo
    half.mkdir()
    (half / "state.pt").write_bytes(b"x")
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", "12") == 0
    err = capsys.readouterr().err
    assert "tidied" in err and "removed .pruned-step_000001-99" in err
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "damaged", "latest", "step_000004", "step_000008", "step_000012"]
    assert not (out / ".restopo-xyz.jsonl").exists()


def test_an_unrelated_metrics_file_is_never_replaced(spec, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"my": "numbers"}\n')
    err = one_line_error(capsys, ["train", spec, "--out", out, "--steps", "2"])
    assert "already holds metrics.jsonl" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == '{"my": "numbers"}\n'


@pytest.mark.slow
def test_diagnose_on_nan_weights_is_one_line(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.steps=4") == 0
    from safetensors.torch import load_file, save_file
    step = out / "ckpt" / "step_000004"
    weights = load_file(step / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, step / "model.safetensors")
    ck.write_manifest(step)
    err = one_line_error(capsys, ["diagnose", out, "-o", tmp_path / "fig"])
    assert "NaN or infinite weights" in err and "log-scaled" not in err


@pytest.mark.slow
def test_a_failed_nproc_run_shows_no_torchrun_traceback(spec, tmp_path):
    """A layout mistake under --nproc is now said before torchrun starts (so no worker
    runs here); a worker that fails under torchrun is held to the same in test_layouts
    (a said mistake, on every rank) and test_train_processes (a rank killed mid-run)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_DIST_TIMEOUT="60")
    done = subprocess.run([sys.executable, "-m", "restopo", "train", str(spec), "--out",
                           str(tmp_path / "r"), "--nproc", "2", "--pipeline", "3x1",
                           "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    # said once, as the last line, before any worker starts
    assert done.stderr.count("needs a multiple of 3 processes") == 1
    assert done.stderr.rstrip().splitlines()[-1].startswith(
        "restopo train: error: --pipeline 3x1 needs a multiple of 3 processes")


@pytest.mark.slow
def test_a_checkpoint_from_before_manifests_resumes_with_a_note(spec, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.steps=4") == 0
    (out / "ckpt" / "step_000004" / "manifest.json").unlink()
    capsys.readouterr()
    assert train(spec, "--out", out, "--resume", "--steps", "8") == 0
    err = capsys.readouterr().err
    assert "step_000004 has no manifest.json (saved by an older restopo)" in err
    assert ck.has_manifest(out / "ckpt" / "step_000008")


def test_data_moved_since_the_run_says_how_to_give_its_new_place(spec, tmp_path, capsys):
    """The run's data moved: resuming and eval said only that the path does not exist
    (which reads as a typo in the spec); they say how to point at its new place, and that
    works."""
    data = tmp_path / "notes.txt"
    data.write_text(CORPUS.read_text())
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4, "--set", f'train.data="{data}"') == 0
    capsys.readouterr()
    data.rename(tmp_path / "moved.txt")
    err = one_line_error(capsys, ["train", "--out", out, "--resume", "--steps", 6,
                                  "--no-progress"])
    assert "does not exist" in err and "hint: if the run's data has moved since it " \
        "trained, give its new place: --set train.data=PATH" in err, err
    err = one_line_error(capsys, ["eval", out, "--no-progress"])
    assert "give its new place with --data PATH" in err, err
    assert train("--out", out, "--resume", "--steps", 6, "--set",
                 f'train.data="{tmp_path / "moved.txt"}"') == 0
    assert records(out)[-1]["step"] == 6
    capsys.readouterr()
    # a path that was never there is not said to have moved
    err = one_line_error(capsys, ["train", spec, "--out", tmp_path / "new", "--set",
                                  'train.data="nosuch.txt"', "--no-progress"])
    assert "does not exist" in err and "moved" not in err, err


def test_resume_from_another_folder_reads_the_run_s_relative_data(spec, tmp_path, monkeypatch,
                                                                   capsys):
    """A run given a relative train.data by --set, resumed from its checkpoint alone in
    another folder, reads the data its run read (it read the path from the new folder:
    silently other data, or none), unless the resume gives train.data anew."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    (first / "notes.txt").write_text(CORPUS.read_text())
    monkeypatch.chdir(first)
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--steps", 4, "--set", 'train.data="notes.txt"') == 0
    monkeypatch.chdir(elsewhere)
    assert train("--out", out, "--resume", "--steps", 8) == 0
    assert [r["step"] for r in records(out)][-1] == 8
    # a train.data given with the resume is read from here, and missing here is said
    err = one_line_error(capsys, ["train", "--out", out, "--resume", "--steps", 12, "--set",
                                  'train.data="notes.txt"', "--no-progress"])
    assert "notes.txt" in err and str(elsewhere) in err, err


@pytest.mark.parametrize("then", ["draw", "close"])
def test_a_ctrl_c_after_a_stops_save_still_says_where_resume_continues(
        spec, tmp_path, capsys, monkeypatch, then):
    """A second Ctrl-C after the stop's checkpoint was saved (while loss.png was drawn, or
    the metrics closed) came out as a bare 'restopo: interrupted': the line saying where
    --resume continues, whose checkpoint was on disk, was dropped."""
    from restopo.train import loop

    lr_at = loop.lr_at

    def ctrl_c_at_step_3(step, cfg):  # the first Ctrl-C, as a terminal sends it
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return lr_at(step, cfg)

    def ctrl_c(*args):  # the second, taken by the handler the stop put back
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # the handler runs between bytecodes

    monkeypatch.setattr(loop, "lr_at", ctrl_c_at_step_3)
    monkeypatch.setattr(loop, "draw_losses", ctrl_c)
    if then == "close":
        monkeypatch.setattr(loop, "draw_losses", lambda *a: None)
        monkeypatch.setattr(loop.MetricsLog, "close", ctrl_c)
    out = tmp_path / "run"
    assert train(spec, "--out", out, "--set", "train.save_every=1000") == 130
    err = capsys.readouterr().err
    saved = ck.latest_checkpoint(out / "ckpt")
    assert saved is not None and saved.name.endswith("3"), err
    assert f"stopped after step 3; --resume continues from its checkpoint {saved}" in err, err
