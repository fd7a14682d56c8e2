"""`restopo sweep` and `restopo compare`: the grid, restarts, failures, the statistics and
the compute-equivalence fit."""
import csv
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from restopo.cli import main
from restopo.experiments import report
from restopo.experiments.grid import make_grid, parse_vary
from restopo.experiments.runs import Run, find_runs
from restopo.experiments.stats import difference, fit_power_law, mean_std, t975

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "golden" / "corpus.txt"
TINY = """\
model m {{ vocab: 256; width: 16; depth: 1; heads: 2; context: 16 }}
residual {residual}
train {{ data: "{data}"; steps: 5; batch: 4; warmup: 1; eval_every: 5; eval_batches: 1
        save_every: 1; log_every: 1 }}
"""


def _specs(tmp_path, data=CORPUS):
    out = []
    for name, residual in (("std", "standard"), ("blk", "block_attnres(blocks: 1)")):
        p = tmp_path / f"{name}.restopo"
        p.write_text(TINY.format(residual=residual, data=data))
        out.append(str(p))
    return out


def _sweep(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "restopo", "sweep", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_grid_names_runs_by_what_differs():
    jobs = make_grid(["a/std.restopo", "b/blk.restopo"], [0, 1], ["train.steps=5"],
                     ["model.width=16,32"])
    assert [j.name for j in jobs] == [
        "std-width16-s0", "std-width16-s1", "std-width32-s0", "std-width32-s1",
        "blk-width16-s0", "blk-width16-s1", "blk-width32-s0", "blk-width32-s1"]
    assert jobs[2].overrides == ("train.steps=5", "model.width=32") and jobs[2].seed == 0
    assert [j.name for j in make_grid(["x/std.restopo"], [3], [], [])] == ["std-s3"]
    # a whole section varied is named by its value alone
    assert [j.name for j in make_grid(["x/std.restopo"], [0], [], [
        "residual=standard,block_attnres(blocks: 4)", "train.compile=off,whole"])] == [
        "standard-compileoff-s0", "standard-compilewhole-s0",
        "block_attnres_blocks_4-compileoff-s0", "block_attnres_blocks_4-compilewhole-s0"]
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_vary("model.width")
    with pytest.raises(ValueError, match="share the name 'std'"):
        make_grid(["a/std.restopo", "b/std.restopo"], [0])


def test_a_sweep_again_with_other_specs_keeps_the_folders_names(tmp_path, capsys):
    """A lone spec's name is left out of its runs' names: sweeping a folder again with one
    spec of the two it was swept with (to add a seed) named its runs anew and would have
    trained them all again. They keep the folder's names, a new seed its arm's name."""
    std, blk = _specs(tmp_path)
    out = tmp_path / "sw"
    for job in make_grid([std, blk], [0], [], ["model.width=16,32"]):
        (out / job.name).mkdir(parents=True)
        (out / job.name / "run.json").write_text(json.dumps(
            {"arm": job.arm, "seed": job.seed, "spec": job.spec,
             "overrides": list(job.overrides), "status": "done"}))
    assert main(["sweep", std, "--vary", "model.width=16, 32", "--seeds", "2", "--out",
                 str(out), "--dry-run"]) == 0
    err = capsys.readouterr()
    names = [line.split()[0] for line in err.out.splitlines()]
    assert names == ["std-width16-s0", "std-width16-s1", "std-width32-s0", "std-width32-s1"]
    assert "note: 4 runs keep the names" in err.err and "(this grid alone names it " \
        "width16-s0)" in err.err
    # another spec of one name is another arm: named by the grid
    other = tmp_path / "o" / "std.restopo"
    other.parent.mkdir()
    other.write_text(Path(std).read_text())
    assert main(["sweep", str(other), "--vary", "model.width=16", "--out", str(out),
                 "--dry-run"]) == 0
    assert capsys.readouterr().out.split()[0] == "width16-s0"


def test_a_dry_run_lists_a_finished_run_with_a_command_that_keeps_it(tmp_path, capsys):
    """--dry-run listed a finished run's `restopo train` with --overwrite (what a run never
    saved starts with): pasted, as the listing means it to be, it deleted the run and
    trained it again. A run the sweep skips is listed resuming, which leaves it as it is."""
    std, _ = _specs(tmp_path)
    out = tmp_path / "sw"
    assert main(["sweep", std, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["sweep", std, "--out", str(out), "--dry-run"]) == 0
    name, state, *command = shlex.split(capsys.readouterr().out)
    assert (name, state, command[0]) == ("std-s0", "done", "train")
    assert "--resume" in command and "--overwrite" not in command
    saved = sorted((out / name / "ckpt").iterdir())
    assert main(command) == 0  # as pasted: nothing to train, nothing deleted
    assert sorted((out / name / "ckpt").iterdir()) == saved
    # the help's 'restopo compare OUT' redid no comparison the sweep's --baseline made: it
    # names the line results.md opens with, which does
    first = (out / "results.md").read_text().split("```sh\n")[1].splitlines()[0]
    assert first.startswith(f"restopo compare {out} ")
    capsys.readouterr()
    assert main(["sweep", "--help"]) == 0
    assert "(OUT/results.md, which opens with the `restopo compare OUT --baseline ...` line " \
           "that redoes it)" in " ".join(capsys.readouterr().out.split())


def test_a_run_and_a_sweep_do_not_share_a_folder(tmp_path, capsys):
    """`restopo train --out SWEEP` trained a run beside the sweep's runs, which compare then
    took for another arm (named after the folder) and eval for the sweep's one run; a sweep
    into a run's folder nested its runs inside that run. Each is refused, before any work:
    a folder of a sweep's runs (run.json, before any checkpoint) or of runs with ckpt/."""
    spec = _specs(tmp_path)[0]
    job = make_grid([spec], [0])[0]
    swept, trained_into = tmp_path / "sweep", tmp_path / "mine"
    (swept / job.name).mkdir(parents=True)
    (swept / job.name / "run.json").write_text(json.dumps({"arm": job.arm, "seed": 0}))
    for name in ("std-s0", "std-s1", "std-s2"):
        (trained_into / name / "ckpt").mkdir(parents=True)
    # a folder of runs train made (runs/, train's default) is not called a sweep's
    for folder, held, first in ((swept, "1 run", f"{job.name}: a sweep's"),
                                (trained_into, "3 runs", "std-s0")):
        before = sorted(p.name for p in folder.iterdir())
        for argv in (["train", spec, "--out", str(folder), "--no-progress"],
                     ["train", "--resume", "--out", str(folder), "--no-progress"]):
            assert main(argv) == 1
            assert capsys.readouterr().err == (
                f"restopo train: error: --out {folder} is a folder of runs ({held}, such as "
                f"{first}), which restopo compare would take this run for one of; "
                f"give it a folder of its own, e.g. --out {folder / 'NAME'} (inside it: "
                f"compared with them)\n")
        assert sorted(p.name for p in folder.iterdir()) == before
    trained = tmp_path / "trained"
    assert main(["train", spec, "--out", str(trained), "--no-progress", "--steps", "1"]) == 0
    capsys.readouterr()
    kept = sorted(p.name for p in trained.iterdir())
    assert main(["sweep", spec, "--out", str(trained), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert f"error: --out {trained} holds a run of restopo train" in err, err
    assert sorted(p.name for p in trained.iterdir()) == kept


def test_one_run_is_said_as_one(tmp_path, capsys):
    """A sweep of one run said 'restopo sweep: 1 runs in ...' (and 'note: 1 runs keep the
    names'); counts are said by one helper, the singular for one."""
    std, _ = _specs(tmp_path)
    out = tmp_path / "sw"
    assert main(["sweep", std, "--out", str(out), "--dry-run"]) == 0
    assert f"restopo sweep: 1 run in {out} (0 done, 0 to resume)" in capsys.readouterr().err
    job = make_grid([std], [0], [], ["model.width=16"])[0]  # named by its width, in the folder
    (out / "std-width16-s0").mkdir(parents=True)
    (out / "std-width16-s0" / "run.json").write_text(json.dumps(
        {"arm": "std-width16", "seed": 0, "spec": job.spec, "overrides": list(job.overrides),
         "status": "done"}))
    assert main(["sweep", std, "--vary", "model.width=16", "--out", str(out), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "note: 1 run keeps the names" in err and "restopo sweep: 1 run in" in err


def test_a_grid_that_would_collide_or_drop_a_value_is_refused():
    for vary, said in (("model.width=32,,64", "empty value"), ("model.width=32,32", "32 twice")):
        with pytest.raises(ValueError, match=said):
            parse_vary(vary)
    with pytest.raises(ValueError, match="more than once"):
        make_grid(["a/std.restopo"], [0], [], ["model.width=32", "model.width=64"])
    with pytest.raises(ValueError, match="repeat one"):
        make_grid(["a/std.restopo"], [1, 1])
    with pytest.raises(ValueError, match=re.escape(  # named: it said "two specs" only
            "a/std.restopo and b/std.restopo share the name 'std'; run names")):
        make_grid(["a/std.restopo", "a/blk.restopo", "b/std.restopo"], [0])
    # each run's `train --set` would give the key twice (the --vary value won silently)
    with pytest.raises(ValueError, match=re.escape(
            "--set model.width=16 and --vary model.width=32,64 both set model.width; give "
            "it in one of them")):
        make_grid(["a/std.restopo"], [0], ["model.width=16"], ["model.width=32,64"])
    # distinct values that a run's name writes alike: one folder for two runs
    for vary, said in (("residual=block_attnres(blocks: 4),block_attnres(blocks:4)",
                        "'residual=block_attnres(blocks: 4)' and 'residual=block_attnres"
                        "(blocks:4)' would both train in the run folder "
                        "block_attnres_blocks_4-width32-s0"),
                       ("train.data=a/b.txt,a-b.txt", "'train.data=a/b.txt' and "
                        "'train.data=a-b.txt' would both train in the run folder "
                        "dataa_b.txt-width32-s0")):
        with pytest.raises(ValueError, match=re.escape(said)):
            make_grid(["a/std.restopo"], [0], ["train.steps=3"], [vary, "model.width=32,64"])


def test_sweep_mistakes_are_refused_before_any_run(tmp_path, capsys):
    specs = _specs(tmp_path)
    out = tmp_path / "sweep"
    for extra, said in ((["--seed-list", "a,b"], "--seed-list takes whole numbers"),
                        (["--baseline", "nosuch"], "names no arm, spec or --vary value"),
                        (["--seeds", "1", "--vary", "model.width=abc,16"], "abc"),
                        (["--set", 'train.data="nosuch.txt"'], "nosuch.txt' does not exist"),
                        (["--set", "train.seed=3"], "give --seeds N or --seed-list"),
                        (["--set", "residual.blocks=2", "--vary", "residual.block_size=2,4"],
                         "both set residual.block_size"),
                        (["--vary", "train.seed=1,2"], "the seed is the sweep's to give"),
                        # every run would fail in train, or --seeds be dropped silently
                        (["--seed-list", "1,-2"], "'seed' must be at least 0, got -2"),
                        (["--seed-list", "5000000000"], "'seed' is too large"),
                        (["--seeds", "3", "--seed-list", "1"], "give one of them"),
                        # dropped silently: the runs went on, locally, without a time limit
                        (["--slurm", "timeout_min=5"], "--slurm timeout_min=5 is a parameter "
                         "of submitit's jobs, but the runs are local processes"),
                        # a typo whose grid of runs would fill memory before any check
                        (["--seeds", "3000000000"], "give at most 10,000")):
        assert main(["sweep", *specs, "--out", str(out), *extra]) in (1, 2)
        assert said in capsys.readouterr().err
        assert not out.exists()  # nothing trained, not even the folder made


@pytest.mark.parametrize("vary, said, under", [
    ("residual=standard,nosuch", "unknown topology 'nosuch'", "nosuch"),
    ("model.widht=16,32", "unknown key 'widht' in model", "widht"),
    (" model.width = 16 , 6", "heads (4) must divide width (6)", "6")])
def test_a_bad_vary_value_is_shown_in_the_vary_typed(tmp_path, capsys, vary, said, under):
    """An error in one value of --vary points into the --vary as typed (it showed a
    `--set 1` never written, or the file's heads for a width the --vary gave)."""
    spec = tmp_path / "std.restopo"
    spec.write_text(TINY.format(residual="standard", data=CORPUS).replace("heads: 2",
                                                                          "heads: 4"))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--vary", vary]) == 1
    err = capsys.readouterr().err
    key = vary.partition("=")[0].strip()
    first, line, caret = err.splitlines()[:3]
    col = line.rindex(under) - 3  # past the 4 blanks that indent the shown line, 1-based
    assert first == f"<--vary {key}>:1:{col}: error: {said}", err
    assert line == f"    --vary {vary}" and caret.index("^") == line.rindex(under), err
    assert "--set" not in err and not (tmp_path / "sw").exists()


def test_every_bad_vary_value_is_said_once(tmp_path, capsys):
    """Two bad values of one --vary, over two seeds: both are said (only the first was),
    each once (not once per run)."""
    spec = tmp_path / "std.restopo"
    spec.write_text(TINY.format(residual="standard", data=CORPUS))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--seeds", "2",
                 "--vary", "model.width=abc,16,xyz"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "'abc'" in err and "'xyz'" in err, err
    assert "2 errors" in err and not (tmp_path / "sw").exists()


@pytest.mark.parametrize("seeds, bad", [("0, 1,-1", "-1"), ("0,99999999999", "99999999999")])
def test_a_bad_seed_list_is_shown_as_typed_like_trains_seed(tmp_path, capsys, seeds, bad):
    """A seed --seed-list gives that train refuses is a spec error printed as train prints
    one for --seed (and sweep for --vary): bare, at the flag's line as typed, exit 1. It
    showed a `--seed-list -1` never written, with the caret off what was."""
    [spec, _] = _specs(tmp_path)
    assert main(["train", spec, "--seed", bad]) == 1
    trains = capsys.readouterr().err.splitlines()
    assert main(["sweep", spec, "--out", str(tmp_path / "sw"), "--seed-list", seeds]) == 1
    err = capsys.readouterr().err
    first, line, caret = err.splitlines()[:3]
    assert line == f"    --seed-list {seeds}" and caret.index("^") == line.rindex(bad), err
    assert first == f"<--seed-list>:1:{line.rindex(bad) - 3}: error: " \
        + trains[0].partition(": error: ")[2]
    assert err.splitlines()[3:] == trains[3:]  # the same hint, if any
    assert not (tmp_path / "sw").exists()


def test_a_run_trained_otherwise_is_not_taken_for_the_sweeps(tmp_path, capsys):
    """A folder already holding a run of other settings (an override, an edited spec) is
    refused by name, never counted as done or resumed under the new settings."""
    spec = _specs(tmp_path)[0]
    out = tmp_path / "sweep"
    assert main(["train", spec, "--seed", "0", "--out", str(out / "std-s0"), "--no-progress",
                 "--threads", "1"]) == 0
    kept = {p: p.read_bytes() for p in (out / "std-s0").rglob("*") if p.is_file()}
    assert main(["sweep", spec, "--out", str(out), "--set", "model.width=32"]) == 1
    err = capsys.readouterr().err
    assert "trained with other settings" in err
    assert "model.width=32 now, (unset) then" in err
    # written otherwise, the same settings: the spec's own value given by --set, a comment
    # added to the file (a --set of the file's own steps was refused as 'unset then')
    assert main(["sweep", spec, "--out", str(out), "--dry-run", "--set", "train.steps=5"]) == 0
    assert "std-s0" in capsys.readouterr().out
    Path(spec).write_text("# a note\n" + Path(spec).read_text())
    assert main(["sweep", spec, "--out", str(out), "--dry-run"]) == 0
    capsys.readouterr()
    Path(spec).write_text(Path(spec).read_text().replace("steps: 5", "steps: 6"))
    assert main(["sweep", spec, "--out", str(out), "--dry-run"]) == 1
    assert f"{spec} has changed since" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (out / "std-s0").rglob("*") if p.is_file()} == kept
    with pytest.raises(ValueError, match="std.restopo is given twice"):
        make_grid([spec, spec], [0])


def test_a_run_stopped_by_ctrl_c_is_recorded_as_interrupted_not_failed(tmp_path,
                                                                      monkeypatch):
    from restopo.experiments import runner
    job = make_grid(["a/std.restopo"], [0])[0]
    monkeypatch.setattr(type(job), "command", lambda self, out, resume, threads=1: [
        sys.executable, "-c", "import sys; print('restopo train: starting'); sys.exit(130)"])
    result = runner.run_job(job, tmp_path, resume=False)
    info = json.loads((tmp_path / job.name / "run.json").read_text())
    assert result["status"] == info["status"] == "interrupted"
    assert "resumes it" in info["error"]


def test_a_second_sweep_of_a_folder_is_refused_and_a_live_run_left_alone(tmp_path, capsys,
                                                                         monkeypatch):
    """Running a sweep again while its first is still running (another terminal, a
    restarted job) had the second start each run, fail on the run's lock, and write
    'failed' over the live run's run.json. Now a sweep holds its folder as a run does, and
    a run folder held by a live run is reported without being touched."""
    from restopo.experiments import runner
    from restopo.train.runlock import run_lock
    spec = _specs(tmp_path)[0]
    out = tmp_path / "sweep"
    with run_lock(out, who="sweep"):  # the first sweep, still running
        assert main(["sweep", spec, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert f"{out} is in use by another sweep (pid {os.getpid()}" in err
        assert not (out / "std-s0").exists()
    job = make_grid([spec], [0])[0]
    monkeypatch.setattr(type(job), "command", lambda self, out, resume, threads=1: [
        sys.executable, "-c", "raise SystemExit('the run was started')"])
    (out / job.name).mkdir(parents=True)
    live = json.dumps({"status": "running", "arm": "std"})
    (out / job.name / "run.json").write_text(live)
    with run_lock(out / job.name):  # a live `restopo train --out sweep/std-s0`
        result = runner.run_job(job, out, resume=False)
    assert result["status"] == "failed" and "in use by another run" in result["error"]
    assert (out / job.name / "run.json").read_text() == live
    assert not (out / job.name / "train.log").exists()


def _running(marker: str) -> list[str]:
    """Processes whose command line holds `marker` (a run folder), as pgrep lists them."""
    found = subprocess.run(["pgrep", "-f", "-a", marker], capture_output=True, text=True)
    return [ln for ln in found.stdout.splitlines() if "pgrep" not in ln]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_sweep_stopped_by_a_signal_to_it_alone_stops_its_runs(tmp_path, how):
    """`kill PID` (a scheduler, systemd) reaches the sweep alone, not its runs' process
    group: the sweep died at once and left its run training, orphaned, with run.json at
    'running'. Now SIGTERM stops it as Ctrl-C does, after passing the stop on, and a sweep
    killed outright has its run stop too (after saving); a rerun resumes it."""
    spec = _specs(tmp_path)[0]
    out = tmp_path / "sw"
    args = [spec, "--out", str(out), "--set", "train.steps=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "restopo", "sweep", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    latest = out / "std-s0" / "ckpt" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and not latest.exists():
        time.sleep(0.2)
    assert latest.exists(), "the run never saved a checkpoint"
    proc.send_signal(how)
    err = proc.communicate(timeout=120)[1]
    deadline = time.time() + 60
    while time.time() < deadline and _running(str(out)):
        time.sleep(0.2)
    left = _running(str(out))
    subprocess.run(["pkill", "-KILL", "-f", str(out)])  # a failing run leaves none behind
    assert not left, left
    if how == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "restopo sweep: stopped (SIGTERM); the runs are stopped" in err
        assert json.loads((out / "std-s0" / "run.json").read_text())["status"] == "interrupted"
    again = _sweep(*args, "--dry-run")
    assert again.returncode == 0 and "std-s0" in again.stdout and " resume " in again.stdout, \
        again.stdout + again.stderr


def test_statistics_against_hand_computation():
    assert mean_std([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, math.sqrt(7 / 3)))
    assert t975(2) == 4.303 and t975(2.9) == 4.303 and t975(500) == 1.96
    # paired: the differences 0.1, 0.3 -> mean 0.2, sd 0.1414, half 12.706 * 0.1414 / sqrt 2
    d = difference({0: 1.1, 1: 2.3}, {0: 1.0, 1: 2.0})
    assert d.paired and d.n == 2 and d.mean == pytest.approx(0.2)
    assert d.high - d.mean == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))
    assert not d.excludes_zero
    w = difference({0: 1.0, 1: 1.02, 2: 1.01}, {5: 2.0, 6: 2.02})  # no shared seeds: Welch
    va, vb = 1e-4 / 3, 2e-4 / 2                  # variances of the two means
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 1)  # 1.68: rounds down to 1
    assert not w.paired and w.mean == pytest.approx(1.01 - 2.01) and w.excludes_zero
    assert w.high - w.mean == pytest.approx(t975(df) * math.sqrt(va + vb)) and t975(df) == 12.706
    assert difference({0: 1.0}, {0: 2.0}) is None


def test_power_law_fit_recovers_a_known_law():
    a, b = 7.5, 0.083
    cs = [1e12, 4e12, 1.6e13, 6.4e13]
    fit = fit_power_law(cs, [a * c ** -b for c in cs])
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.compute_for(fit.loss(3e12)) == pytest.approx(3e12, rel=1e-9)
    with pytest.raises(ValueError, match="three or more"):
        fit_power_law([1e12, 1e12, 2e12], [3.0, 3.0, 2.9])
    with pytest.raises(ValueError, match="does not fall"):
        fit_power_law(cs, [1.0, 1.1, 1.2, 1.3])


def _synthetic_run(arm, family, seed, steps, loss):
    meta = {"step": steps, "spec_path": f"/x/{family}.restopo",
            "config": {"steps": steps, "batch": 8, "context": 32, "seed": seed}}
    return Run(Path(f"/x/{arm}-s{seed}"), arm, seed, meta,
               [{"step": steps, "val_loss": loss, "elapsed": 1.0}])


def test_runs_trained_differently_are_said_so_with_each_arms_budget():
    """Two arms with 20 and 40 steps and another lr: the report named the first run's
    budget for both and said nothing of the difference."""
    text = TINY.format(residual="standard", data="c.txt")

    def run(arm, steps, lr):
        meta = {"step": steps, "spec_path": f"/x/{arm}.restopo", "spec_text": text,
                "overrides": [f"train.steps={steps}", f"train.lr={lr}"],
                "config": {"steps": steps, "batch": 4, "context": 16, "seed": 0}}
        return Run(Path(f"/x/{arm}-s0"), arm, 0, meta, [{"step": steps, "val_loss": 2.0}])

    arms = report.group([run("a", 20, 3e-3), run("b", 40, 1e-3)])
    assert report.settings_differ(arms) == ["steps: 20 (a), 40 (b)", "lr: 0.003 (a), 0.001 (b)"]
    note = report.scale_note(arms)
    assert "a 1,280 (20 steps of 64)" in note and "b 2,560 (40 steps of 64)" in note
    for baseline in (None, arms[0]):
        report.compare(arms, baseline)
        said = "\n".join(report.reading(arms, baseline))
        assert "not trained alike" in said and "steps: 20 (a), 40 (b)" in said
    same = report.group([run("a", 20, 3e-3), run("b", 20, 3e-3)])
    assert report.settings_differ(same) == []
    assert report.loss_unit(same) == "byte-level token"
    # another vocabulary: said, and the loss unit no longer calls both byte-level
    other = run("c", 20, 3e-3)
    other.meta["spec_text"] = text.replace("vocab: 256", "vocab: 512")
    mixed = report.group([run("a", 20, 3e-3), other])
    assert report.settings_differ(mixed) == ["vocab: 256 (a), 512 (c)"]
    assert "256, 512): losses over different vocabularies do not compare" in \
        report.loss_unit(mixed)
    assert "1,280 training tokens per run (20 steps of 64 tokens)" in report.scale_note(same)


def test_the_loss_unit_is_what_the_runs_trained_on_not_their_vocab(tmp_path):
    """Vocab 256 was taken to mean bytes: runs on .bin token ids at vocab 256 were said to
    be in nats per byte-level token, and text runs at vocab 300 per token (vocab 300). What
    each run trained on (its train.data, read from where the run read it) now decides."""
    (tmp_path / "ids.bin").write_bytes(bytes(64))
    (tmp_path / "text.txt").write_text("text")

    def arms(data, vocab=256):
        text = TINY.format(residual="standard", data=data).replace("vocab: 256",
                                                                  f"vocab: {vocab}")
        meta = {"step": 5, "spec_path": "/elsewhere/a.restopo", "spec_text": text,
                "data_base": str(tmp_path), "config": {"steps": 5}}
        return report.group([Run(tmp_path / "a-s0", "a", 0, meta, [{"step": 5}])])

    assert report.loss_unit(arms("ids.bin")) == "token (vocab 256)"
    assert report.loss_unit(arms("text.txt", vocab=300)) == "byte-level token"
    assert report.loss_unit(arms("gone.bin")) == "byte-level token"  # not known: by vocab


def test_an_unfinished_run_is_left_out_of_the_final_losses_and_named(tmp_path):
    """A seed stopped at step 300 of 400 was averaged into its arm's 'final' loss (and into
    the interval against the baseline) without a word. It is left out, counted and named."""
    def stopped(arm, seed, loss):
        r = _synthetic_run(arm, arm, seed, 400, loss)
        r.meta = {**r.meta, "step": 300}
        r.records = [{"step": 300, "val_loss": loss, "elapsed": 1.0}]
        return r
    std = [_synthetic_run("std", "std", s, 400, 2.0 + 0.01 * s) for s in (0, 1)]
    blk = [_synthetic_run("blk", "blk", 0, 400, 1.9), stopped("blk", 1, 2.6)]
    arms = report.group(std + blk)
    assert [len(a.finals) for a in arms] == [2, 1] and arms[1].finals == {0: 1.9}
    report.compare(arms, arms[0])
    table = report.rows(arms, arms[0])
    assert table[1][1] == "1 (+1 unfinished)" and table[1][2] == "1.9000"
    said = "\n".join(report.reading(arms, arms[0]))
    assert "Left out of the final and best losses, unfinished" in said
    assert "blk-s1 (step 300 of 400)" in said
    rows = list(csv.DictReader(io.StringIO(report.csv_text(arms, arms[0]))))
    assert rows[1]["seeds"] == "1" and rows[1]["unfinished_runs"] == "blk-s1"
    # a run with no checkpoint at all: the scale note says it cannot tell
    bare = Run(Path("/x/c-s0"), "c", 0, {}, [{"step": 3, "val_loss": 2.0}])
    assert report.scale_note(report.group([bare])).startswith("Scale: not known")


def test_an_arm_with_no_finished_run_says_so_not_that_it_needs_seeds():
    """An arm whose only run stopped early ('0 (+1 unfinished)') said '(needs 2+ seeds)',
    as if one more seed would give it an interval: nothing finished, and it says that."""
    def stopped(arm, seed):
        r = _synthetic_run(arm, arm, seed, 400, 2.5)
        r.meta = {**r.meta, "step": 300}
        return r
    std = [_synthetic_run("std", "std", s, 400, 2.0 + 0.01 * s) for s in (0, 1)]
    arms = report.group(std + [stopped("blk", 0), _synthetic_run("one", "one", 0, 400, 1.9)])
    report.compare(arms, arms[0])
    table = report.rows(arms, arms[0])
    assert [r[1] for r in table] == ["2", "0 (+1 unfinished)", "1"]
    assert [r[4] for r in table] == ["baseline", "(no run finished)", "(needs 2+ seeds)"]
    # the baseline with nothing finished: said of the baseline
    arms = report.group([stopped("std", 0), _synthetic_run("b", "b", 0, 9, 1.0)])
    report.compare(arms, arms[0])
    assert report.rows(arms, arms[0])[1][4] == "(the baseline: no run finished)"


def test_a_runs_end_is_said_before_the_next_run_starts(tmp_path, monkeypatch):
    """With --jobs 1 the sweep printed 'starting b' before 'a: done' (the end was reported
    by the main thread once it woke, the start by the worker already on the next run),
    which reads as two runs at once."""
    from restopo.experiments import runner
    monkeypatch.setattr(runner, "run_job", lambda job, out, resume, runs: {
        "name": job.name, "status": "done", "seconds": 0.0})
    events = []

    def report(event):
        if event["event"] == "end":
            time.sleep(0.2)  # a slow terminal: the race the main thread lost
        events.append((event["event"], event["job"].name))

    runner.run_local(make_grid(["a.restopo", "b.restopo"], [0]), tmp_path, 1, report)
    assert events == [("start", "a-s0"), ("end", "a-s0"), ("start", "b-s0"), ("end", "b-s0")]


def test_a_sweep_does_not_train_a_diverged_run_again(tmp_path):
    """A run whose loss became NaN (its metrics say so) is skipped with why, not resumed or
    restarted to diverge again; a run resumed past it (the record dropped) counts as usual."""
    from restopo.experiments import runner
    from restopo.experiments.grid import Job
    job = Job("blk-s0", "blk", str(ROOT / "examples" / "block_attnres.restopo"), (), 0)
    folder = tmp_path / job.name
    folder.mkdir()
    lines = [{"step": 1, "loss": 5.5}, {"step": 2, "diverged": "nan", "elapsed": 0.1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    events = []
    results = runner.run_local([job], tmp_path, 1, events.append)
    assert [r["status"] for r in results] == ["diverged"]
    assert events[0]["event"] == "skip" and "diverged at step 2" in events[0]["error"]
    assert "lower train.lr" in events[0]["error"]
    (folder / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert runner.state(tmp_path, job) == "new"


def test_a_diverged_run_is_said_to_have_diverged_not_to_be_unfinished():
    """A run whose loss became NaN (train stops it, recording the step) was counted and
    named 'unfinished', with `restopo train --resume` offered to finish it: resuming it
    only diverges again."""
    diverged = _synthetic_run("blk", "blk", 1, 400, 2.6)
    diverged.meta = {**diverged.meta, "step": 200}
    diverged.records = [{"step": 200, "val_loss": 2.6, "elapsed": 1.0},
                        {"step": 230, "diverged": "nan", "elapsed": 1.2}]
    runs = [_synthetic_run(a, a, s, 400, 2.0) for a in ("std", "blk") for s in (0,)]
    arms = report.group(runs + [diverged])
    assert diverged.diverged == 230 and not diverged.finished
    assert arms[1].finals == {0: 2.0} and arms[1].unfinished == []
    report.compare(arms, arms[0])
    assert report.rows(arms, arms[0])[1][1] == "1 (+1 diverged)"
    said = "\n".join(report.reading(arms, arms[0]))
    assert "unfinished" not in said
    assert "blk-s1 (diverged at step 230: loss nan)" in said and "train.lr" in said
    rows = list(csv.DictReader(io.StringIO(report.csv_text(arms, arms[0]))))
    assert rows[1]["diverged_runs"] == "blk-s1" and rows[1]["unfinished_runs"] == ""


def test_each_run_is_counted_once_by_how_it_ended():
    """An arm's finished, unfinished, failed and diverged runs split its runs: each run in
    one, reaching the last step outranking run.json's status, diverging outranking it too."""
    runs, want = [], {}
    for done in (True, False):
        for nan in (True, False):
            for status in ("done", "partial", "failed", "running"):
                r = _synthetic_run("a", "a", len(runs), 10, 2.0)
                r.meta = {**r.meta, "step": 10 if done else 5}
                r.status = status
                if nan:
                    r.records = r.records + [{"step": 11, "diverged": "nan"}]
                runs.append(r)
                want[r.name] = ("finished" if done else "diverged" if nan
                                else "failed" if status == "failed" else "unfinished")
    arm = report.group(runs)[0]
    got = {}
    for how in ("finished", "unfinished", "failed", "diverged"):
        for r in getattr(arm, how):
            got.setdefault(r.name, []).append(how)
    assert got == {name: [how] for name, how in want.items()}


def test_a_baseline_named_by_a_spec_of_several_sizes_says_so():
    """`--baseline standard` over a width sweep of standard.restopo said 'names no arm (or
    several)': which of the two, and what to name instead, was left to guess."""
    arms = report.group([_synthetic_run(f"width{w}", "standard", 0, 10, 2.0) for w in (16, 32)]
                        + [_synthetic_run("blk", "block", 0, 10, 2.0)])
    assert report.pick_baseline(arms, "width32").name == "width32"
    assert report.pick_baseline(arms, "block").name == "blk"  # the one arm of its spec
    with pytest.raises(ValueError, match=r"'standard' is the spec of 2 arms \(width16, "
                                         r"width32\): name the one"):
        report.pick_baseline(arms, "standard")
    with pytest.raises(ValueError, match="names no arm, spec or --vary value: the arms are "
                                         "width16"):
        report.pick_baseline(arms, "nosuch")


def test_compute_equivalence_from_synthetic_runs(tmp_path):
    """The baseline follows loss = a C^-b over three sizes (two seeds each, symmetric noise);
    an arm at the middle size whose loss the baseline reaches with 1.25x its compute is
    worth 1.25x."""
    a, b, flops = 9.0, 0.07, {"small": 1e6, "mid": 4e6, "big": 1.6e7}
    tokens = 8 * 32 * 100
    arms = []
    for size, f in flops.items():
        loss = a * (f * tokens) ** -b
        runs = [_synthetic_run(f"standard-{size}", "standard", s, 100, loss + e)
                for s, e in ((0, 0.002), (1, -0.002))]
        arms.append(report.Arm(f"standard-{size}", runs, train_flops_per_token=f))
    better = a * (1.25 * flops["mid"] * tokens) ** -b
    arms.append(report.Arm("block-mid", [_synthetic_run("block-mid", "block", 0, 100, better)],
                           train_flops_per_token=flops["mid"]))
    fit, equiv = report.compute_equivalence(arms, "standard")
    assert fit.b == pytest.approx(b, rel=1e-3) and fit.a == pytest.approx(a, rel=1e-2)
    [(arm, loss, compute, ratio)] = equiv
    assert arm.name == "block-mid" and ratio == pytest.approx(1.25, rel=1e-3)
    report.compare(arms, arms[0])
    # the baseline at its other sizes is a scaling series, not an arm against it
    table = report.rows(arms, arms[0])
    assert [r[4] for r in table] == ["baseline", "baseline, another size",
                                     "baseline, another size", "(needs 2+ seeds)"]
    paths = report.write_report(arms, arms[0], tmp_path, ["restopo", "compare"], scaling=True)
    assert "| 1.250 | no interval (needs 2+ seeds) |" in paths["md"].read_text()
    assert paths["scaling"].read_bytes()[:4] == b"\x89PNG"


def test_the_scaling_section_names_families_without_the_settings_all_share(tmp_path):
    """A sweep's --set given to every run (train.lr, train.eval_batches) named each family
    with it, in the compute-equivalence text, table and plot legend ('standard
    [train.eval_batches=2, train.eval_every=10]'), as if it told them apart. A setting
    every arm shares is left out; one that differs stays."""
    def run(arm, family, seed, loss, *overrides):
        r = _synthetic_run(arm, family, seed, 100, loss)
        r.meta = {**r.meta, "overrides": ["train.lr=0.001", *overrides]}
        return r
    flops = (1e6, 4e6, 1.6e7)
    arms = [report.Arm(f"standard-{i}", [run(f"standard-{i}", "standard", s,
                                             9.0 * (f * 25600) ** -0.07 + e)
                                         for s, e in ((0, 0.002), (1, -0.002))],
                       train_flops_per_token=f) for i, f in enumerate(flops)]
    arms.append(report.Arm("block", [run("block", "block", 0, 2.0)], train_flops_per_token=4e6))
    arms.append(report.Arm("block2", [run("block2", "block", 0, 2.0, "residual.blocks=2")],
                           train_flops_per_token=4e6))
    assert arms[0].family == "standard [train.lr=0.001]"
    assert report.family_names(arms) == {
        "standard [train.lr=0.001]": "standard", "block [train.lr=0.001]": "block",
        "block [residual.blocks=2, train.lr=0.001]": "block [residual.blocks=2]"}
    report.compare(arms, arms[0])
    text = report.write_report(arms, arms[0], tmp_path, ["restopo"], scaling=True)["md"]
    said = text.read_text().split("## Compute equivalence")[1]
    assert said.startswith("\n\nstandard's final loss against training compute")
    assert "| standard compute to match / own |" in said and "train.lr" not in said


def test_a_scaling_fit_counts_sizes_not_arms(tmp_path):
    """`compare runs/ablation runs/scaling --scaling`, where runs/scaling holds standard at
    the ablation's width too, said the fit was 'over its 4 sizes' for 3, and called that
    arm 'baseline, another size': two arms of one model and budget are one size."""
    flops = (1e6, 4e6, 1.6e7, 4e6)  # the last: the ablation's standard, a size again
    arms = [report.Arm(f"standard-{i}", [_synthetic_run(f"standard-{i}", "standard", 0, 100,
                                                        9.0 * f ** -0.07)],
                       train_flops_per_token=f) for i, f in enumerate(flops)]
    arms.append(report.Arm("block", [_synthetic_run("block", "block", 0, 100, 2.0)],
                           train_flops_per_token=4e6))
    base = arms[-2]
    report.compare(arms, base)
    text = report.write_report(arms, base, tmp_path, ["restopo"], scaling=True)["md"]
    assert f"fitted over its {len(set(flops))} sizes:" in text.read_text()
    # and the table calls the one at the baseline's compute no other size
    assert {r[0]: r[4] for r in report.rows(arms, base)[:4]} == {
        "standard-3": "baseline", "standard-0": "baseline, another size",
        "standard-1": "baseline, same size", "standard-2": "baseline, another size"}


@pytest.mark.slow
def test_tiny_sweep_kill_rerun_and_compare(tmp_path):
    """2 specs x 2 seeds x 5 steps, one run at a time. Killed after the first run has
    finished, then rerun: the finished run is left untouched, the rest complete, and the
    interrupted one continues from its checkpoint to the same losses a clean run gives."""
    specs = _specs(tmp_path)
    out = tmp_path / "sweep"
    args = [*specs, "--seeds", "2", "--out", str(out), "--baseline", "std"]
    proc = subprocess.Popen([sys.executable, "-m", "restopo", "sweep", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = out / "std-s0" / "run.json"
    second = out / "std-s1" / "ckpt" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (
            first.exists() and json.loads(first.read_text())["status"] == "done"
            and second.exists()):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(first.read_text())["status"] == "done", "the first run never finished"
    kept = {p: p.read_bytes() for p in (out / "std-s0").rglob("*") if p.is_file()}
    done = _sweep(*args)
    assert done.returncode == 0, done.stderr
    assert "std-s0: already done" in done.stderr and "resuming std-s1" in done.stderr
    assert {p: p.read_bytes() for p in (out / "std-s0").rglob("*") if p.is_file()} == kept
    with open(out / "results.csv") as f:
        table = {r["arm"]: r for r in csv.DictReader(f)}
    assert set(table) == {"std", "blk"} and table["blk"]["seeds"] == "2"
    assert table["blk"]["diff_mean"] != ""
    for png in ("val_loss_by_step.png", "val_loss_by_tokens.png", "final_val_loss.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    text = (out / "results.md").read_text()
    assert "## What the figures show" in text
    assert f"restopo train {specs[1]} --seed S --out {out}/blk-sS   # blk: S = 0, 1" in text
    # each finished run records the load it ran under; std-s0 ran alone, the rest too
    info = json.loads((out / "blk-s0" / "run.json").read_text())
    assert info["cpus"] == os.cpu_count() and 0 <= info["load_mean"] <= info["load_max"]
    # the resumed run equals the same run done in one go
    clean = tmp_path / "clean"
    assert main(["train", specs[0], "--seed", "1", "--out", str(clean), "--no-progress",
                 "--threads", "1"]) == 0
    resumed = {r.seed: r for r in find_runs([out])}
    assert resumed[1].final_val == find_runs([clean])[0].final_val


def test_curves_of_runs_not_yet_evaluated_say_so_without_a_warning(tmp_path, monkeypatch):
    """A sweep whose runs were all stopped before their first evaluation drew an empty
    legend, and matplotlib's UserWarning about it reached the user with its source line."""
    import warnings
    drawn = []
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.append(fig) or path)
    run = _synthetic_run("std", "std", 0, 20, 2.0)
    run.records = [{"step": 3, "loss": 4.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report.plot_curves(report.group([run]), tmp_path / "c.png", tokens=False)
    assert [t.get_text() for t in drawn[0].axes[0].texts] == ["no run has a validation "
                                                               "loss yet"]


def test_curves_of_runs_evaluated_once_are_drawn(tmp_path, monkeypatch):
    """A sweep of 20-step runs evaluates each once, at its end: val_loss_by_step.png was an
    empty frame with a legend (a line through one point draws nothing). Each evaluation is
    marked, so every arm shows."""
    drawn = []
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.append(fig) or path)
    arms = report.group([_synthetic_run(a, a, s, 20, 2.0 + s) for a in ("std", "blk")
                         for s in (0, 1)])
    report.plot_curves(arms, tmp_path / "c.png", tokens=False)
    lines = drawn[0].axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["std (2)", "blk (2)"]
    for ln in lines:  # one point each: seen only as a mark
        assert len(ln.get_xdata()) == 1 and ln.get_marker() not in ("None", "", " ", None)


def test_a_scaling_fit_that_cannot_be_made_writes_nothing(tmp_path):
    """compare --scaling with the baseline at one size failed after writing results.csv
    and the plots beside the previous results.md (in a sweep's folder, a report half new,
    half old). It is refused, as --scaling's, before anything is written, saying how to
    give the sizes (it did not)."""
    arms = report.group([_synthetic_run(a, a, s, 20, 2.0 + s) for a in ("std", "blk")
                         for s in (0, 1)])
    report.compare(arms, arms[0])
    (tmp_path / "results.md").write_text("the sweep's report")
    with pytest.raises(ValueError, match="--scaling: a compute-equivalence fit needs the "
                                         "baseline at three or more sizes") as e:
        report.write_report(arms, arms[0], tmp_path, ["restopo", "compare"], scaling=True)
    assert str(e.value).endswith(": train it at more (restopo sweep SPEC --vary "
                                 "model.width=32,48,96 --out DIR) and compare that folder too")
    assert [p.name for p in tmp_path.iterdir()] == ["results.md"]


def test_how_the_runs_were_made_gives_each_seeds_folder(tmp_path):
    """The report's `restopo train` line per arm had no --out: pasted, the first seed
    trained in train's default folder, not the sweep's, and the next was refused there as
    a run already in it."""
    std = tmp_path / "std.restopo"
    std.write_text(TINY.format(residual="standard", data=CORPUS))
    jobs = make_grid([str(std)], [0, 1], ["train.steps=3"], ["train.lr=1e-3,3e-3"])
    _sweep_folder(tmp_path / "my sweep", {j.name: (j.arm, j.spec, list(j.overrides), j.seed,
                                                   2.0) for j in jobs})
    arms = report.group(find_runs([tmp_path / "my sweep"]))
    lines = report.made_by(arms)
    assert len(lines) == 2
    for line, arm in zip(lines, arms):
        argv = shlex.split(line.partition("#")[0])
        for r in arm.runs:  # the command for seed S trains in that seed's folder
            out = argv[argv.index("--out") + 1].replace("-sS", f"-s{r.seed}")
            assert Path(out) == r.path


def test_timing_note_says_when_step_times_compare_arms():
    """s/step compares arms only when every run recorded its load and none competed for
    cores; otherwise the reading says it does not."""
    def run(load):
        r = _synthetic_run("a", "a", 0, 10, 2.0)
        r.load = load
        return r
    quiet = [run({"load_mean": 1.0, "load_max": 1.4, "cpus": 2}) for _ in range(3)]
    assert "compares arms roughly" in report.timing_note(quiet)
    busy = quiet + [run({"load_mean": 3.5, "load_max": 5.0, "cpus": 2})]
    note = report.timing_note(busy)
    assert "does not compare arms" in note and "5.0 on 2 CPUs" in note
    assert "not recorded" in report.timing_note(quiet + [run({})])


@pytest.mark.slow
def test_a_failing_run_is_reported_and_the_rest_complete(tmp_path):
    specs = _specs(tmp_path)
    bad = tmp_path / "bad.restopo"
    # text, so the sweep's own check passes it, but shorter than the context: its run
    # fails when it reads it all
    (tmp_path / "short-data.txt").write_text("too short\n")
    bad.write_text(TINY.format(residual="standard", data=tmp_path / "short-data.txt"))
    out = tmp_path / "sweep"
    done = _sweep(specs[0], str(bad), "--seeds", "1", "--out", str(out), "--jobs", "2")
    assert done.returncode == 1
    assert "bad-s0 failed" in done.stderr and "short-data.txt" in done.stderr
    info = json.loads((out / "bad-s0" / "run.json").read_text())
    assert info["status"] == "failed" and "fewer than context + 1" in info["error"]
    assert json.loads((out / "std-s0" / "run.json").read_text())["status"] == "done"
    assert (out / "results.md").exists()


def test_compare_errors_are_one_line(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "missing")]) == 1
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "a.restopo").write_text("residual standard\n")
    assert main(["compare", str(tmp_path / "a.restopo")]) == 1
    assert "a.restopo is a file; give a run folder" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "a.restopo")]) == 1
    assert "--out" in capsys.readouterr().err and (tmp_path / "a.restopo").is_file()
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty")]) == 1
    assert "neither a run folder nor a folder of runs" in capsys.readouterr().err


def test_an_out_folder_that_cannot_be_made_says_which_part_is_in_the_way(tmp_path, capsys):
    """mkdir's own words named the path alone: 'Not a directory'."""
    specs = _specs(tmp_path)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    said = (f"restopo: error: {out}: cannot make this folder: {tmp_path / 'file'} is a file, "
            "not a folder; choose another --out\n")
    assert main(["sweep", specs[0], "--out", str(out), "--set", "train.steps=2"]) == 1
    assert capsys.readouterr().err.endswith(said)
    run = tmp_path / "run"
    assert main(["train", specs[0], "--out", str(run), "--steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["compare", str(run), "--out", str(out)]) == 1
    assert capsys.readouterr().err == said


@pytest.mark.slow
def test_submitit_local_executor_runs_the_sweep(tmp_path):
    """--executor submitit-local: each run is a submitit job on this machine (the path a
    Slurm sweep takes), through the same restopo train; a rerun skips the finished runs."""
    pytest.importorskip("submitit")
    specs = _specs(tmp_path)
    out = tmp_path / "sweep"
    args = [*specs, "--seeds", "1", "--out", str(out), "--baseline", "std",
            "--executor", "submitit-local"]
    done = _sweep(*args)
    assert done.returncode == 0, done.stderr
    assert any((out / ".submitit").iterdir())  # submitit's own job folders
    for name in ("std-s0", "blk-s0"):
        assert json.loads((out / name / "run.json").read_text())["status"] == "done"
        assert len((out / name / "metrics.jsonl").read_text().splitlines()) >= 5
    with open(out / "results.csv") as f:
        assert {r["arm"] for r in csv.DictReader(f)} == {"std", "blk"}
    again = _sweep(*args)
    assert again.returncode == 0, again.stderr
    assert "std-s0: already done" in again.stderr and "blk-s0: already done" in again.stderr


def _md_table(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_docs_results_agree_with_todays_model_counts():
    """docs/results.md was written by restopo compare from runs that are not in the
    repository; what it derives from the specs alone (parameters, live values, training
    FLOPs per token, and through them the compute-equivalence ratios) must be what restopo
    computes today, else the file is stale and the command at its top must be run again.
    The ratios are recomputed here from the CSV's losses with a least-squares fit of
    log loss on log compute."""
    import numpy as np
    docs = ROOT / "docs"
    with open(docs / "results.csv") as f:
        table = {r["arm"]: r for r in csv.DictReader(f)}
    from restopo.api import compile as compile_spec
    from restopo.spec import load_spec
    for arm, row in table.items():
        if arm.startswith("width"):  # runs/scaling: the standard spec at another width
            name, sets = "standard", [f"model.width={arm[len('width'):]}"]
        else:
            name, sets = arm, []
        path = ROOT / "experiments" / "ablation" / f"{name}.restopo"
        proc = subprocess.run([sys.executable, "-m", "restopo", "inspect", str(path),
                               "--format", "json", *(a for s in sets for a in ("--set", s))],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        info = json.loads(proc.stdout)
        model = compile_spec(load_spec(path, sets), backend="eager")
        assert int(row["parameters"]) == sum(p.numel() for p in model.parameters()), arm
        assert int(row["live_values_per_token"]) == info["live_values_per_token"], arm
        assert float(row["train_flops_per_token"]) == info["flops_per_token"]["train"], arm
    tokens = 600 * 16 * 64  # steps x batch x context of experiments/ablation
    base = [a for a in table if a == "standard" or a.startswith("width")]
    x = np.log([float(table[a]["train_flops_per_token"]) * tokens for a in base])
    y = np.log([float(table[a]["final_val_mean"]) for a in base])
    slope, intercept = np.polyfit(x, y, 1)
    text = (docs / "results.md").read_text()
    equiv = _md_table(text, "| arm | final val loss | compute (FLOPs) | "
                            "standard compute to match / own | loss gap vs baseline |")
    assert {r[0] for r in equiv} == set(table) - set(base)
    for arm, _, _, ratio, _ in equiv:
        loss = float(table[arm]["final_val_mean"])
        compute = float(table[arm]["train_flops_per_token"]) * tokens
        want = math.exp((math.log(loss) - intercept) / slope) / compute
        assert float(ratio) == pytest.approx(want, abs=6e-4), arm


def test_arms_of_one_spec_that_differ_in_topology_are_compared_not_called_sizes():
    """`sweep tiny.restopo --vary residual=standard,full_attnres` made every arm 'baseline,
    another size' (the family was the spec's name alone): no difference, no interval, and
    --scaling fitted a compute curve through three topologies."""
    def run(arm, seed, loss, *overrides):
        r = _synthetic_run(arm, "tiny", seed, 10, loss)
        r.job = {"spec": "/x/tiny.restopo", "overrides": ["train.steps=10", *overrides]}
        return r

    arms = report.group(
        [run("standard", s, 2.0 + 0.01 * s, "residual=standard") for s in (0, 1)]
        + [run("full_attnres", s, 1.9 + 0.01 * s, "residual=full_attnres") for s in (0, 1)]
        + [run("width64", s, 1.8, "residual=standard", "model.width=64") for s in (0, 1)])
    base = report.pick_baseline(arms, "standard")
    report.compare(arms, base)
    by = {a.name: a for a in arms}
    assert by["full_attnres"].family != base.family and by["full_attnres"].diff is not None
    assert report._diff(by["full_attnres"], base) != "baseline, another size"
    # a size of the baseline stays one: width is not what the run is
    assert by["width64"].family == base.family == "tiny [residual=standard]"
    assert report._diff(by["width64"], base) == "baseline, another size"
    # --baseline may still name the spec when it has one arm
    assert report.pick_baseline([by["full_attnres"]], "tiny").name == "full_attnres"


def test_an_arm_that_differs_only_in_heads_is_compared_not_called_a_size():
    """`sweep std.restopo --vary model.heads=2,4` made heads4 'baseline, another size' of
    heads2: no difference, no interval, though heads change neither the parameters nor the
    FLOPs (a size is what --scaling fits loss against compute over). The context is no size
    either; the width stays one."""
    from restopo.api import compile as compile_spec
    from restopo.spec import parse_spec

    text = TINY.format(residual="standard", data="c.txt")
    counts = {h: sum(p.numel() for p in compile_spec(parse_spec(
        text, "std.restopo", (f"model.heads={h}",)), backend="eager").parameters())
        for h in (2, 4)}
    assert counts[2] == counts[4]  # the same model's size, split into other heads

    def run(arm, seed, *overrides):
        r = _synthetic_run(arm, "std", seed, 10, 2.0 + 0.01 * seed + 0.1 * len(arm))
        r.job = {"spec": "/x/std.restopo", "overrides": list(overrides)}
        return r

    arms = report.group([run(arm, s, o) for arm, o in
                         (("heads2", "model.heads=2"), ("heads4", "model.heads=4"),
                          ("context32", "model.context=32"))
                         for s in (0, 1)])
    report.compare(arms, arms[0])
    by = {a.name: a for a in arms}
    for name in ("heads4", "context32"):
        assert by[name].family != arms[0].family and by[name].diff is not None, name
        assert report._diff(by[name], arms[0]).startswith("+"), name
    base = report.group([run("w16", s, "model.width=16") for s in (0, 1)]
                        + [run("w32", s, "model.width=32") for s in (0, 1)])
    report.compare(base, base[0])
    assert report._diff(base[1], base[0]) == "baseline, another size"


def _sweep_folder(out: Path, runs: dict) -> None:
    """A sweep's folder as `restopo sweep` leaves it, without training: per run, run.json,
    metrics.jsonl with its final validation loss and a finished checkpoint's meta.json.
    runs: name -> (arm, spec path, overrides, seed, loss)."""
    from restopo.train.checkpoint import FILES
    for name, (arm, spec, overrides, seed, loss) in runs.items():
        step = out / name / "ckpt" / "step_000005"
        step.mkdir(parents=True)
        for f in FILES:
            (step / f).write_bytes(b"x")
        (step / "meta.json").write_text(json.dumps(
            {"step": 5, "spec_path": spec, "spec_text": Path(spec).read_text(),
             "overrides": [*overrides, f"train.seed={seed}"],
             "config": {"steps": 5, "batch": 4, "context": 16, "seed": seed}}))
        (out / name / "ckpt" / "latest").write_text(step.name)
        (out / name / "metrics.jsonl").write_text(
            json.dumps({"step": 5, "val_loss": loss, "elapsed": 1.0}) + "\n")
        (out / name / "run.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "spec": spec, "overrides": overrides, "status": "done"}))


def test_a_sweep_over_specs_and_vary_values_pairs_each_arm_with_the_baseline_at_its_values(
        tmp_path, capsys):
    """`sweep std blk --vary train.lr=1e-3,3e-3`: --baseline std was refused ('the spec of
    2 arms: name the one'), and naming std-lr1e_3 compared blk at lr 3e-3 with std at lr
    1e-3 (a gap of the lr, not the topology). Each arm is now compared with std at its own
    lr, which the table names."""
    std, blk = _specs(tmp_path)
    vary = ["--vary", "train.lr=1e-3,3e-3"]
    assert main(["sweep", std, blk, *vary, "--baseline", "std", "--out",
                 str(tmp_path / "sw"), "--dry-run"]) == 0
    capsys.readouterr()
    losses = {("std", "1e-3"): (2.00, 2.03), ("std", "3e-3"): (1.50, 1.52),
              ("blk", "1e-3"): (1.90, 1.94), ("blk", "3e-3"): (1.45, 1.46)}
    runs = {}
    for job in make_grid([std, blk], [0, 1], [], vary[1:]):
        spec, lr = Path(job.spec).stem, job.overrides[-1].partition("=")[2]
        runs[job.name] = (job.arm, job.spec, list(job.overrides), job.seed,
                          losses[spec, lr][job.seed])
    _sweep_folder(tmp_path / "sw", runs)
    for baseline in ("std", "std-lr1e_3"):
        out = tmp_path / f"vs-{baseline}"
        assert main(["compare", str(tmp_path / "sw"), "--baseline", baseline,
                     "--out", str(out)]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        with open(out / "results.csv") as f:
            table = {r["arm"]: r for r in csv.DictReader(f)}
        for lr, name in (("1e-3", "lr1e_3"), ("3e-3", "lr3e_3")):
            row = table[f"blk-{name}"]
            assert row["baseline"] == f"std-{name}"
            want = [b - s for b, s in zip(losses["blk", lr], losses["std", lr])]
            assert float(row["diff_mean"]) == pytest.approx(sum(want) / 2)
            assert table[f"std-{name}"]["diff_mean"] == ""  # a baseline, not an arm
        cells = {r[0]: r[4] for r in _md_table((out / "results.md").read_text(),
                                               "| " + " | ".join(report.COLUMNS) + " |")}
        assert cells["std-lr3e_3"] == "baseline" and cells["std-lr1e_3"] == "baseline"
        assert cells["blk-lr3e_3"].endswith(" vs std-lr3e_3")
        assert cells["blk-lr1e_3"].endswith(" vs std-lr1e_3")
        assert "blk-lr3e_3 with std-lr3e_3" in printed
        assert "not trained alike" not in printed  # each pair was, at its own lr


def _run_of_tiny(arm, seed, loss, *overrides):
    """A synthetic finished run of tiny.restopo with `overrides`, its loss moved by seed."""
    r = _synthetic_run(arm, "tiny", seed, 10, loss + 0.01 * seed)
    r.job = {"spec": "/x/tiny.restopo", "overrides": list(overrides)}
    return r


# (residual, lr) -> final loss of a one-spec sweep over --vary residual=... x train.lr=...
_RESIDUAL_LR_GRID = {("standard", "1e-3"): 2.0, ("standard", "3e-3"): 1.5,
                     ("block_attnres", "1e-3"): 1.9, ("block_attnres", "3e-3"): 1.45}


def _residual_lr_arms():
    """The arms of that sweep, two seeds each, named as a sweep names them."""
    return report.group([_run_of_tiny(f"{r}-lr{lr}", s, loss, f"residual={r}",
                                      f"train.lr={lr}")
                         for (r, lr), loss in _RESIDUAL_LR_GRID.items() for s in (0, 1)])


def test_a_sweep_of_residuals_and_lrs_of_one_spec_pairs_each_arm_at_its_lr():
    """`sweep tiny.restopo --vary residual=standard,block_attnres --vary train.lr=1e-3,3e-3
    --baseline standard-lr1e_3`: the topology is varied by --vary, not by a spec file, and
    block at lr 3e-3 is compared with standard at lr 3e-3. An lr swept alone is still what
    is compared."""
    grid, run = _RESIDUAL_LR_GRID, _run_of_tiny
    arms = _residual_lr_arms()
    base = report.pick_baseline(arms, "standard-lr1e-3")
    report.compare(arms, base)
    by = {a.name: a for a in arms}
    assert report.compared_with(by["block_attnres-lr3e-3"], base) is by["standard-lr3e-3"]
    assert by["block_attnres-lr3e-3"].diff.mean == pytest.approx(1.45 - 1.5)
    assert report._diff(by["standard-lr3e-3"], base) == "baseline"
    lrs = report.group([run(f"lr{lr}", s, loss, f"train.lr={lr}")
                        for (r, lr), loss in grid.items() if r == "standard" for s in (0, 1)])
    report.compare(lrs, lrs[0])
    assert report.compared_with(lrs[1], lrs[0]) is lrs[0]
    assert lrs[1].diff.mean == pytest.approx(1.5 - 2.0)


def test_vary_splits_at_the_commas_between_values_not_inside_them(tmp_path, capsys):
    """`--vary residual=block_attnres(blocks: 4, gate: sigmoid),standard` split inside the
    parentheses (error: "this '(' is never closed"): a topology of two options could not be
    swept. The dry run prints each command quoted, so it can be pasted into a shell."""
    key, values = parse_vary("residual=block_attnres(blocks: 4, gate: sigmoid),standard")
    assert key == "residual" and values == ["block_attnres(blocks: 4, gate: sigmoid)", "standard"]
    assert parse_vary('train.data="a,b.txt",c.txt')[1] == ['"a,b.txt"', "c.txt"]
    jobs = make_grid(["x/tiny.restopo"], [0], [],
                     ["residual=block_attnres(blocks: 4, gate: sigmoid),standard"])
    assert [j.name for j in jobs] == ["block_attnres_blocks_4_gate_sigmoid-s0", "standard-s0"]
    assert jobs[0].overrides[-1] == "residual=block_attnres(blocks: 4, gate: sigmoid)"
    spec = _specs(tmp_path)[0]
    assert main(["sweep", spec, "--out", str(tmp_path / "sw"), "--dry-run", "--vary",
                 "residual=block_attnres(blocks: 2, gate: sigmoid),standard"]) == 0
    listed = capsys.readouterr().out
    assert "--set 'residual=block_attnres(blocks: 2, gate: sigmoid)'" in listed


def test_a_damaged_newest_meta_is_passed_over_by_compare_and_sweep(tmp_path):
    """A run whose newest checkpoint's meta.json was torn made compare and sweep stop with a
    CheckpointError traceback; `train --resume` passes over such a checkpoint, and so do
    they, reading the one before it."""
    from restopo.experiments import runner
    from restopo.experiments.grid import Job
    from restopo.experiments.runs import read_run
    from restopo.train.checkpoint import FILES

    run = tmp_path / "sw" / "a-s0"
    for step in (2, 4):
        d = run / "ckpt" / f"step_{step:06d}"
        d.mkdir(parents=True)
        for name in FILES:
            (d / name).write_bytes(b"x")
        (d / "meta.json").write_text(json.dumps(
            {"step": step, "spec_path": "/x/a.restopo", "overrides": ["train.seed=0"],
             "config": {"steps": 4, "seed": 0}}))
    (run / "ckpt" / "latest").write_text("step_000004")
    (run / "ckpt" / "step_000004" / "meta.json").write_text('{"step": 4')  # torn
    assert read_run(run).meta["step"] == 2
    job = Job("a-s0", "a", str(tmp_path / "a.restopo"), (), 0)
    assert runner.state(tmp_path / "sw", job) == "resume"  # train --resume falls back
    # step 2 was trained as the job asks (its seed, no other override): nothing changed
    assert runner.changed(tmp_path / "sw", job) is None


def test_two_runs_of_one_arm_and_seed_are_refused_not_one_dropped():
    """by_seed kept the last run of a seed: a second copy of a run (another sweep's folder
    of the same name) silently replaced the first in the arm's figures."""
    a = _synthetic_run("blk", "blk", 0, 100, 2.5)
    b = _synthetic_run("blk", "blk", 0, 100, 2.7)
    b.path = Path("/y/blk-s0")
    with pytest.raises(ValueError, match="/x/blk-s0 and /y/blk-s0 are both arm 'blk', seed 0"):
        report.group([a, b])
    b.seed = 1
    assert [len(arm.runs) for arm in report.group([a, b])] == [2]


def test_a_baseline_named_by_its_vary_value_picks_that_topologys_arms(tmp_path, capsys):
    """`sweep tiny.restopo --vary residual=standard,block_attnres(...) --vary train.lr=...`
    refused --baseline standard ('names no arm and no spec'): only the whole arm name
    (standard-lr1e-3) was taken. The value, as typed or as run names give it, names the
    arms of that topology, each the baseline at its lr; a value of several arms that do
    not pair up is refused, naming them."""
    spec = _specs(tmp_path)[0]
    vary = ["--vary", "residual=standard,block_attnres(blocks: 1)", "--vary",
            "train.lr=1e-3,3e-3"]
    for name in ("standard", "block_attnres(blocks:1)", "block_attnres_blocks_1"):
        assert main(["sweep", spec, *vary, "--baseline", name, "--out",
                     str(tmp_path / "sw"), "--dry-run"]) == 0, capsys.readouterr().err
    assert main(["sweep", spec, *vary, "--baseline", "lr3e_3", "--out",
                 str(tmp_path / "sw"), "--dry-run"]) == 2
    assert "--baseline 'lr3e_3' is a value of 2 arms (standard-lr3e_3, " \
           "block_attnres_blocks_1-lr3e_3): name the one" in capsys.readouterr().err

    arms = _residual_lr_arms()
    base = report.pick_baseline(arms, "standard")
    report.compare(arms, base)
    by = {a.name: a for a in arms}
    assert base is by["standard-lr1e-3"]
    assert report.compared_with(by["block_attnres-lr3e-3"], base) is by["standard-lr3e-3"]
    with pytest.raises(ValueError, match="'nosuch' names no arm, spec or --vary value: the "
                                         "arms are standard-lr1e-3, standard-lr3e-3, "):
        report.pick_baseline(arms, "nosuch")


def test_compare_puts_the_baseline_first_and_sizes_in_numeric_order(tmp_path, capsys):
    """compare listed arms in the folder's text order: the baseline wherever its name fell
    (blk above std), and a width sweep as width128, width16, width32. The baseline (and the
    baselines paired with it) now comes first, then the rest by the numbers in their names."""
    std, blk = _specs(tmp_path)
    runs = {f"{arm}-s{seed}": (arm, spec, [f"model.width={w}"] if w else [], seed,
                               2.0 + 0.01 * seed + 0.001 * (w or 0))
            for arm, spec, w in (("blk", blk, None), ("std-width128", std, 128),
                                 ("std-width16", std, 16), ("std-width32", std, 32))
            for seed in (0, 1)}
    _sweep_folder(tmp_path / "sw", runs)
    assert main(["compare", str(tmp_path / "sw"), "--baseline", "std-width32"]) == 0
    table = _md_table(capsys.readouterr().out, "| " + " | ".join(report.COLUMNS) + " |")
    assert [r[0] for r in table] == ["std-width32", "blk", "std-width16", "std-width128"]
    assert [r[4] for r in table][0] == "baseline"
    with open(tmp_path / "sw" / "results.csv") as f:
        assert [r["arm"] for r in csv.DictReader(f)] == [r[0] for r in table]
    # paired baselines (one per --vary value) come before the arms compared with them
    def run(arm, seed, *overrides):
        r = _synthetic_run(arm, "tiny", seed, 10, 2.0 + 0.01 * seed)
        r.job = {"spec": "/x/tiny.restopo", "overrides": list(overrides)}
        return r

    arms = report.group([run(f"{r}-lr{lr}", s, f"residual={r}", f"train.lr={lr}")
                         for r in ("block_attnres", "standard") for lr in ("1e-3", "3e-3")
                         for s in (0, 1)])
    report.compare(arms, report.pick_baseline(arms, "standard-lr3e-3"))
    assert [a.name for a in arms] == ["standard-lr3e-3", "standard-lr1e-3",
                                      "block_attnres-lr1e-3", "block_attnres-lr3e-3"]


def test_a_figure_the_last_compare_drew_and_this_one_does_not_is_removed(tmp_path):
    """compare --scaling, then compare without it in the same folder, left the first one's
    scaling.png beside the new results.md, a figure the new report does not have. A figure
    the earlier report linked is removed; other files, and a scaling.png no compare's
    report linked, are left alone."""
    flops = (1e6, 4e6, 1.6e7)
    arms = [report.Arm(f"standard-{i}", [_synthetic_run(f"standard-{i}", "standard", 0, 100,
                                                        9.0 * f ** -0.07)],
                       train_flops_per_token=f) for i, f in enumerate(flops)]
    report.compare(arms, arms[0])
    (tmp_path / "notes.png").write_bytes(b"mine")
    written = report.write_report(arms, arms[0], tmp_path, ["restopo"], scaling=True)
    assert written["scaling"].exists()
    again = report.write_report(arms, arms[0], tmp_path, ["restopo"])
    assert "scaling" not in again and not (tmp_path / "scaling.png").exists()
    assert all(p.exists() for p in again.values())
    assert (tmp_path / "notes.png").read_bytes() == b"mine"
    # a scaling.png of the user's, beside a results.md no compare wrote, stays
    (tmp_path / "scaling.png").write_bytes(b"mine too")
    (tmp_path / "results.md").write_text("# notes\n\n![fit](scaling.png)\n")
    report.write_report(arms, arms[0], tmp_path, ["restopo"])
    assert (tmp_path / "scaling.png").read_bytes() == b"mine too"


def test_sweep_progress_lines_are_whole_and_end_with_the_error(capsys):
    """With --jobs 2 the runs' ends are said from the threads that run them: each line is
    said whole, and a failed run's line gave its time after the error ('... is empty in
    24 s (24 s so far)'), where it read as the error's own words. The error comes last."""
    import threading

    from restopo.commands.sweep import _Progress
    jobs = make_grid([f"{a}.restopo" for a in "abcdefgh"], [0, 1])
    progress = _Progress(len(jobs))
    error = "bad.restopo:3:15: error: data file 'empty.txt' is empty"

    def run(job):
        progress({"event": "start", "job": job, "resume": False})
        progress({"event": "end", "job": job, "status": "failed" if job.seed else "done",
                  "seconds": 3.0, "error": error})

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = capsys.readouterr().err.splitlines()
    assert sorted(ln for ln in lines if "starting" in ln) == sorted(
        f"  starting {j.name}" for j in jobs)
    ends = [ln for ln in lines if "starting" not in ln]
    assert len(ends) == len(jobs) and len(lines) == 2 * len(jobs)
    for ln in ends:
        name = re.match(r"  \[\d+/16\] (\S+): ", ln).group(1)
        tail = f": {error}" if name.endswith("-s1") else ""
        assert re.fullmatch(rf"  \[\d+/16\] {name}: (done|failed) in 3 s \(\d+ s so far\)"
                            rf"{re.escape(tail)}", ln), ln


def test_a_failed_run_is_said_to_have_failed_with_its_error_not_to_be_unfinished(tmp_path):
    """A sweep's run that failed (its run.json: status failed, the error) was counted and
    named 'unfinished' ('no checkpoint'), with `restopo train --resume` offered to finish
    it: run again as it is, it fails again. It is said failed, with its error."""
    std = [_synthetic_run("std", "std", s, 400, 2.0 + 0.01 * s) for s in (0, 1)]
    error = "bad.restopo:3:15: error: data file 'empty.txt' is empty"
    (tmp_path / "bad-s0").mkdir()
    (tmp_path / "bad-s0" / "run.json").write_text(json.dumps(
        {"arm": "bad", "seed": 0, "status": "failed", "error": error}))
    failed = find_runs([tmp_path / "bad-s0"])[0]
    arms = report.group(std + [failed, _synthetic_run("bad", "bad", 1, 400, 1.9)])
    assert arms[1].failed == [failed] and arms[1].unfinished == []
    report.compare(arms, arms[0])
    assert report.rows(arms, arms[0])[1][1] == "1 (+1 failed)"
    said = "\n".join(report.reading(arms, arms[0]))
    assert "unfinished" not in said and "--resume" not in said
    assert "Left out of the final and best losses, failed** (1 run: " in said
    assert f"bad-s0 (no checkpoint; {error})" in said
    rows = list(csv.DictReader(io.StringIO(report.csv_text(arms, arms[0]))))
    assert rows[1]["failed_runs"] == "bad-s0" and rows[1]["unfinished_runs"] == ""


def test_a_paired_gap_within_the_seed_spread_is_not_said_unestablished():
    """Pairing by seed tells apart a gap smaller than the seeds' spread: the reading said
    blk's interval excluded zero, then, as every gap was within the spread, that 'the
    ordering of arms is not established', and its scale note that 'a gap inside the seed
    spread says nothing either way'. Both now say what the intervals say."""
    base = (2.0, 2.1, 2.2)
    arms = report.group([_synthetic_run(a, a, s, 10, base[s] + shift)
                         for a, shifts in (("std", (0, 0, 0)), ("blk", (-0.010, -0.012, -0.011)),
                                           ("full", (0.02, -0.02, 0.01)))
                         for s, shift in enumerate(shifts)])
    report.compare(arms, arms[0])
    told = {a.name: a.diff.excludes_zero for a in arms[1:]}
    assert told == {"blk": True, "full": False}
    said = report.reading(arms, arms[0])
    line = next(ln for ln in said if ln.startswith("- The baseline's seed spread"))
    assert "not established" not in line
    assert line.endswith("the ordering is established only where an interval above "
                         "excludes zero (blk).")
    # nor does the scale note say such a gap tells nothing (it said: inside the spread)
    assert report.scale_note(arms).endswith("a gap whose 95% interval contains zero says "
                                            "nothing either way.")
    alike = [a for a in arms if a.name != "blk"]  # no interval excludes zero: nothing is
    report.compare(alike, alike[0])
    assert "the ordering of arms is not established." in "\n".join(report.reading(alike,
                                                                                 alike[0]))


def test_arms_without_an_interval_are_said_so_in_the_reading():
    """A sweep with --seeds 1 had '(needs 2+ seeds)' in the table and nothing in the
    reading of it: an arm with no interval was left out of the words without a trace. The
    reading names each and why, and how to add seeds."""
    arms = report.group([_synthetic_run(a, a, 0, 10, loss)
                         for a, loss in (("std", 2.0), ("blk", 1.9), ("full", 1.8))])
    arms.append(report.Arm("more", [_synthetic_run("more", "more", s, 10, 1.7 + 0.01 * s)
                                    for s in (0, 1)]))
    report.compare(arms, arms[0])
    said = report.reading(arms, arms[0])
    line = next(ln for ln in said if ln.startswith("- **No interval**"))
    assert "blk against std (needs 2+ seeds); full against std (needs 2+ seeds)" in line
    assert "more" in line and "higher --seeds and the same --out" in line
    base = report.group([_synthetic_run(a, a, s, 10, 2.0 + 0.1 * s + (a == "blk"))
                         for a in ("std", "blk") for s in (0, 1)])
    report.compare(base, base[0])
    assert not any("No interval" in ln for ln in report.reading(base, base[0]))


def test_no_gap_is_taken_between_runs_on_other_data_or_vocabularies():
    """compare of runs validated on other text (or over another vocabulary) gave a gap with
    an interval and a verdict ('lower (better) than'), though the two losses measure other
    things; 'not trained alike' came only after. The cell and the reading now say the
    losses do not compare. Another context still has its gap, said to be not the
    topology's alone."""
    text = TINY.format(residual="standard", data="c.txt")

    def run(arm, seed, loss, edit=("", "")):
        meta = {"step": 20, "spec_path": f"/x/{arm}.restopo",
                "spec_text": text.replace(*edit), "overrides": [],
                "config": {"steps": 20, "batch": 4, "context": 16, "seed": seed}}
        return Run(Path(f"/x/{arm}-s{seed}"), arm, seed, meta,
                   [{"step": 20, "val_loss": loss + 0.01 * seed}])

    edits = {"data": ('"c.txt"', '"other.txt"'), "vocab": ("vocab: 256", "vocab: 512"),
             "ctx": ("context: 16", "context: 8")}
    arms = report.group([run("a", s, 2.0) for s in (0, 1)] + [
        run(name, s, 1.0, edit) for name, edit in edits.items() for s in (0, 1)])
    report.compare(arms, arms[0])
    by = {a.name: a for a in arms}
    assert by["data"].diff is None and by["vocab"].diff is None
    assert by["ctx"].diff.mean == pytest.approx(-1.0)
    cells = {r[0]: r[4] for r in report.rows(arms, arms[0])}
    assert cells["data"] == "(other data: the losses do not compare)"
    assert cells["vocab"] == "(other vocab: the losses do not compare)"
    said = "\n".join(report.reading(arms, arms[0]))
    assert "**data**" not in said and "data against a (other data: the losses do not " \
                                       "compare)" in said
    assert "**ctx**: final validation loss 1.0000 lower" in said
    assert "context: 16 (a, data, vocab), 8 (ctx)" in said


def test_one_data_file_given_two_ways_is_one_data(tmp_path):
    """compare took train.data as written: runs on one file, given as a relative path (read
    from the run's folder, data_base) and as an absolute one, were 'other data' with no gap,
    and a relative path read from two folders was one data. Where each run read it decides."""
    def run(arm, seed, data, base):
        text = TINY.format(residual="standard", data=data)
        meta = {"step": 20, "spec_path": f"/specs/{arm}.restopo", "spec_text": text,
                "overrides": [], "data_base": str(base),
                "config": {"steps": 20, "batch": 4, "context": 16, "seed": seed}}
        return Run(tmp_path / f"{arm}-s{seed}", arm, seed, meta,
                   [{"step": 20, "val_loss": (2.0 if arm == "a" else 1.0) + 0.01 * seed}])

    here, there = tmp_path / "here", tmp_path / "there"
    arms = report.group([run("a", s, "c.txt", here) for s in (0, 1)]
                        + [run("abs", s, here / "c.txt", there) for s in (0, 1)]
                        + [run("elsewhere", s, "c.txt", there) for s in (0, 1)])
    report.compare(arms, arms[0])
    by = {a.name: a for a in arms}
    assert by["abs"].diff.mean == pytest.approx(-1.0) and by["elsewhere"].diff is None
    said = "\n".join(report.reading(arms, arms[0]))
    assert f"data: {here / 'c.txt'} (a, abs), {there / 'c.txt'} (elsewhere)" in said


def test_a_run_stopped_from_outside_the_sweep_is_said_and_the_sweep_fails(tmp_path, capsys,
                                                                          monkeypatch):
    """A run stopped by a signal sent to it alone (SIGTERM from an admin or a scheduler, or
    Ctrl-C in a sweep that ignores it, as `sweep ... &` in a script does) counted as
    neither done nor failed: the sweep compared the rest and exited 0, the run unfinished.
    It is named, with how to resume it, and the sweep exits 1."""
    from restopo.experiments import runner
    std, blk = _specs(tmp_path)
    out = tmp_path / "sw"
    _sweep_folder(out, {"std-s0": ("std", std, [], 0, 2.0)})
    monkeypatch.setattr(runner, "run_job", lambda job, out, resume, runs: {
        "name": job.name, "status": "interrupted", "seconds": 1.0,
        "error": "interrupted; the sweep resumes it from its last checkpoint when run again"})
    assert main(["sweep", std, blk, "--out", str(out), "--baseline", "std"]) == 1
    err = capsys.readouterr().err
    assert "std-s0: already done" in err
    assert "restopo sweep: blk-s0 was stopped before its end, not by this sweep; run the " \
           "sweep again to resume it" in err


def test_a_sweep_starts_no_more_runs_once_one_is_stopped_from_outside(tmp_path, capsys,
                                                                       monkeypatch):
    """A stop the sweep did not get itself (sent to a run, or to the process group of a
    sweep started in the background, which ignores Ctrl-C) ended that run, and the sweep
    went on to start the others. It now starts no more, and says which it left."""
    spec = _specs(tmp_path)[0]
    out = tmp_path / "sweep"
    job = make_grid([spec], [0])[0]
    monkeypatch.setattr(type(job), "command", lambda self, out, resume, threads=1: [
        sys.executable, "-c", f"import sys; open(sys.argv[1], 'w'); "
        f"sys.exit(130 if {self.seed} == 0 else 0)", str(tmp_path / f"started{self.seed}")])
    assert main(["sweep", spec, "--out", str(out), "--seeds", "3"]) == 1
    err = capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("started*")) == ["started0"], err
    assert f"{job.name} was stopped before its end, not by this sweep" in err, err
    assert "2 runs not started after that stop (such as std-s1); run the sweep again to " \
           "train them" in err, err


# A run that says which stop signal it got (in FILE), once up (FILE.up)
_STOPPABLE = """import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".up", "w")
time.sleep(120)
"""


@pytest.mark.parametrize("sigint", ["default_int_handler", "SIG_IGN"])
def test_a_ctrl_c_stops_every_run_once_even_one_started_just_after_it(tmp_path, sigint):
    """A terminal's Ctrl-C reached the runs alive when it came: a run whose process
    started in the milliseconds after it never got it, and the sweep waited STOP_WAIT (30 s)
    before sending SIGTERM. Every run now gets the stop from the sweep, once, and a run
    the stop comes before is not started; so too in a sweep started in the background by a
    script (SIGINT ignored), whose runs took that Ctrl-C. (The sweep runs in a session of
    its own, whose process group stands for the terminal's.)"""
    spec = _specs(tmp_path)[0]
    sweep = f"""
import os, signal, sys, time
from pathlib import Path
from restopo.experiments import runner
from restopo.experiments.grid import Job, make_grid
tmp = Path({str(tmp_path)!r})
Job.command = lambda self, out, resume, threads=1: [
    sys.executable, "-c", {_STOPPABLE!r}, str(tmp / f"stop{{self.seed}}")]
runner.STOP_WAIT = 20.0
def report(event):  # the Ctrl-C comes as run 1 starts, once run 0 is up
    if event["event"] == "start" and event["job"].seed == 1:
        while not (tmp / "stop0.up").exists():
            time.sleep(0.05)
        os.killpg(os.getpgrp(), signal.SIGINT)
signal.signal(signal.SIGINT, signal.{sigint})
t0 = time.monotonic()
try:
    runner.run_local(make_grid([{spec!r}], [0, 1]), tmp / "sw", 2, report)
except KeyboardInterrupt:
    print(time.monotonic() - t0)
"""
    done = subprocess.run([sys.executable, "-c", sweep], capture_output=True, text=True,
                          timeout=300, start_new_session=True)
    assert done.returncode == 0 and done.stdout, done.stderr
    assert float(done.stdout) < 20.0, done.stdout
    assert (tmp_path / "stop0").read_text() == "SIGINT"
    info = json.loads((tmp_path / "sw" / "std-s0" / "run.json").read_text())
    assert info["status"] == "interrupted"
    # run 1: not started, or stopped by the one Ctrl-C too
    assert not (tmp_path / "stop1.up").exists() or (tmp_path / "stop1").read_text() == "SIGINT"


class _Submitted:
    """A submitit job: the first finishes, the second is being waited for when the stop
    comes (`stop`: Ctrl-C, or SIGTERM sent to the sweep alone), the third never starts."""

    def __init__(self, fn, job, out, resume, index, stop, cancelled):
        self.name, self.index, self.stop, self.cancelled = job.name, index, stop, cancelled

    def done(self):
        return self.index == 0

    def cancel(self, check=True):
        self.cancelled.append(self.name)

    def result(self):
        if self.index == 0:
            return {"name": self.name, "status": "done", "seconds": 1.0}
        if self.stop == "SIGINT":
            raise KeyboardInterrupt
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, \
            "SIGTERM would end the sweep without a word"
        os.kill(os.getpid(), signal.SIGTERM)
        signal.getsignal(signal.SIGTERM)  # the handler runs between bytecodes
        raise AssertionError("the sweep did not stop")


@pytest.mark.parametrize("executor, stop", [("submitit", "SIGINT"), ("submitit", "SIGTERM"),
                                            ("submitit-local", "SIGTERM"),
                                            ("submitit-local", "SIGINT")])
def test_a_stopped_submitit_sweep_cancels_its_unfinished_jobs(tmp_path, capsys, monkeypatch,
                                                              executor, stop):
    """--executor submitit submits every job up front: a sweep stopped while it waited said
    its runs were stopped at their last checkpoints, and the Slurm jobs trained on (SIGTERM
    to the sweep ended it without a word). Every job not yet finished is now cancelled
    (scancel: its run saves and stops), as a stopped local sweep stops its runs; but not
    local jobs after a Ctrl-C, which reached them too: a second SIGINT stops a run at once."""
    submitit = pytest.importorskip("submitit")
    spec = _specs(tmp_path)[0]
    cancelled = []

    class Executor:
        def __init__(self, folder, cluster):
            self.submitted = 0

        def update_parameters(self, **parameters):
            pass

        def submit(self, fn, job, out, resume):
            self.submitted += 1
            return _Submitted(fn, job, out, resume, self.submitted - 1, stop, cancelled)

    monkeypatch.setattr(submitit, "AutoExecutor", Executor)
    code = main(["sweep", spec, "--out", str(tmp_path / "sw"), "--seeds", "3",
                 "--executor", executor])
    err = capsys.readouterr().err
    assert code == 128 + getattr(signal, stop), err
    local_ctrl_c = (executor, stop) == ("submitit-local", "SIGINT")
    assert sorted(cancelled) == ([] if local_ctrl_c else ["std-s1", "std-s2"])
    how = "interrupted" if stop == "SIGINT" else "stopped (SIGTERM)"
    assert f"restopo sweep: {how}; the runs are stopped at their last checkpoints" in err


def test_submitit_local_jobs_of_a_sweep_ignoring_ctrl_c_still_take_its_cancel(tmp_path,
                                                                             monkeypatch):
    """A sweep started in the background by a script (`restopo sweep ... &`) ignores SIGINT,
    and submitit's local jobs, its children, inherited that: the SIGINT submitit's cancel
    sends did nothing, and after SIGTERM to the sweep their runs trained on. While its runs
    run, the sweep takes SIGINT (as restopo train takes its first Ctrl-C), and so do the
    processes it starts; after them it ignores it again."""
    submitit = pytest.importorskip("submitit")
    from restopo.experiments import runner
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    started = []

    class Executor:  # starts a process as submitit's local executor starts its controller
        def __init__(self, folder, cluster):
            pass

        def update_parameters(self, **parameters):
            pass

        def submit(self, fn, job, out, resume):
            started.append(subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                          text=True, timeout=60).stdout.strip())
            return _Submitted(fn, job, out, resume, 0, None, [])

    monkeypatch.setattr(submitit, "AutoExecutor", Executor)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `&` without job control leaves it
    jobs = make_grid([_specs(tmp_path)[0]], [0, 1])
    results = runner.run_submitit(jobs, tmp_path / "sw", lambda event: None, cluster="local")
    assert [r["status"] for r in results] == ["done", "done"]
    assert started == ["False", "False"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_submitit_sweep_starts_no_more_runs_once_one_is_stopped_from_outside(tmp_path,
                                                                                monkeypatch):
    """A Slurm job stopped from outside the sweep (an admin's scancel: its run saves and
    ends interrupted) stopped no other, unlike a local sweep, which starts no more runs
    once one was stopped so: the jobs still pending are now cancelled, as not started."""
    submitit = pytest.importorskip("submitit")
    from restopo.experiments import runner
    cancelled = []

    class Handle:
        def __init__(self, name, state, status):
            self.name, self.state, self.status = name, state, status

        def result(self):
            assert self.name not in cancelled
            return {"name": self.name, "status": self.status, "seconds": 1.0}

        def done(self):
            return False

        def cancel(self, check=True):
            cancelled.append(self.name)

    plan = [("RUNNING", "interrupted"), ("RUNNING", "done"), ("PENDING", "done")]

    class Executor:
        def __init__(self, folder, cluster):
            pass

        def update_parameters(self, **parameters):
            pass

        def submit(self, fn, job, out, resume):
            return Handle(job.name, *plan[job.seed])

    monkeypatch.setattr(submitit, "AutoExecutor", Executor)
    jobs = make_grid([_specs(tmp_path)[0]], [0, 1, 2])
    results = runner.run_submitit(jobs, tmp_path / "sw", lambda event: None)
    assert [r["status"] for r in results] == ["interrupted", "done", runner.NOT_STARTED]
    assert cancelled == [jobs[2].name]


def test_a_run_folder_that_holds_runs_too_is_read_whole(tmp_path):
    """`restopo train --out SWEEP` trains in a sweep's folder: compare SWEEP then read it as
    that one run and left the sweep's runs out without a word. Both are read."""
    std, blk = _specs(tmp_path)
    out = tmp_path / "sw"
    _sweep_folder(out, {"std-s0": ("std", std, [], 0, 2.0), "blk-s0": ("blk", blk, [], 0, 1.9)})
    _sweep_folder(tmp_path, {"sw": ("sw", std, [], 0, 2.1)})  # the train run in its folder
    assert sorted(r.name for r in find_runs([out])) == ["blk-s0", "std-s0", "sw"]
    assert [r.name for r in find_runs([out / "std-s0"])] == ["std-s0"]


def test_compare_output_keeps_its_order_in_one_pipe(tmp_path):
    """`restopo sweep ... 2>&1 | tee log`: stdout into a pipe was block-buffered, stderr
    not, so compare's table and reading (stdout) came out after its 'wrote results.md'
    line (stderr), and a long table could be split by stderr lines. Lines now keep the
    order they were printed in."""
    std, blk = _specs(tmp_path)
    _sweep_folder(tmp_path / "sw", {f"{a}-s{s}": (a, spec, [], s, 2.0 + 0.01 * s)
                                    for a, spec in (("std", std), ("blk", blk)) for s in (0, 1)})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-m", "restopo", "compare", str(tmp_path / "sw"),
                           "--baseline", "std"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].startswith("| arm |") and lines[-1].startswith("wrote "), done.stdout


def test_slurm_parameters_submitit_refuses_are_one_line_and_its_types_are_kept(tmp_path,
                                                                               capsys):
    """A --slurm key or value submitit refuses came out as its traceback (NameError,
    AssertionError), and mem_gb=1.5 or stderr_to_stdout=true, passed as text, were refused
    for their type; without Slurm, submitit's 'Could not detect srun' said nothing to do."""
    submitit = pytest.importorskip("submitit")
    from restopo.commands.sweep import _parameters
    typed = _parameters(["timeout_min=5", "mem_gb=1.5", "stderr_to_stdout=true",
                         "slurm_partition=gpu"], "submitit")
    assert typed == {"timeout_min": 5, "mem_gb": 1.5, "stderr_to_stdout": True,
                     "slurm_partition": "gpu"}
    submitit.AutoExecutor(folder=str(tmp_path / "ex"), cluster="local").update_parameters(
        **typed)  # what submitit takes
    specs = _specs(tmp_path)
    for n, (flags, said) in enumerate((
            (["--slurm", "foo=1"], "--slurm: Parameter 'foo' need to be prefixed"),
            (["--slurm", "timeout_min=abc"], '--slurm: Parameter "timeout_min" expected type'))):
        assert main(["sweep", *specs, "--out", str(tmp_path / f"s{n}"), "--executor",
                     "submitit-local", *flags]) == 1
        err = capsys.readouterr().err
        assert f"restopo sweep: error: {said}" in err and err.count("\n") == 2, err
    if shutil.which("srun") is None:
        assert main(["sweep", *specs, "--out", str(tmp_path / "slurm"), "--executor",
                     "submitit"]) == 1
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith('restopo sweep: error: --executor submitit: Could not detect')
        assert err.endswith("or use --executor local (or submitit-local) here")


def test_the_scaling_plots_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    """docs/scaling.png's compute axis, about a decade and a half of FLOPs, read
    '3x10^11 4x10^11' and '3x10^12 4x10^12' run together: matplotlib labels 2, 3, 4 and 6 x
    10^n on such a log axis, wider than the gaps between them."""
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    for low, high in ((4.5e11, 3.5e12), (2e9, 6e10), (1e6, 1e12)):
        tokens = 8 * 32 * 100
        flops = [low * (high / low) ** (k / 3) / tokens for k in range(4)]
        arms = [report.Arm(f"standard-{i}", [_synthetic_run(f"standard-{i}", "standard", 0,
                                                            100, 25.4 * (f * tokens) ** -0.1)],
                           train_flops_per_token=f) for i, f in enumerate(flops)]
        fit, _ = report.compute_equivalence(arms, "standard")
        report.plot_scaling(arms, fit, "standard", tmp_path / "scaling.png")
        fig = figures.pop()
        fig.canvas.draw()
        ax = fig.axes[0]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            boxes = [t.label1.get_window_extent() for x, t in zip(
                axis.get_majorticklocs().tolist() + axis.get_minorticklocs().tolist(),
                axis.get_major_ticks() + axis.get_minor_ticks())
                if lo <= x <= hi and t.label1.get_visible() and t.label1.get_text()]
            assert len(boxes) >= 2, (low, high)  # still labelled
            assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[:i]
                        if a.overlaps(b)], (low, high, axis.axis_name)


@pytest.mark.parametrize("shift,verdict", [(-0.05, "lower (better)"),
                                           (0.05, "higher (worse)")])
def test_a_gap_is_said_by_its_size_beside_its_direction(shift, verdict):
    """'final validation loss -0.0500 lower (better) than std': a signed gap beside its
    direction read as a double negative (0.05 higher). The size is said unsigned; the
    interval keeps its signs."""
    arms = report.group([_synthetic_run(a, a, s, 10, 2.0 + 0.1 * s + d + 0.001 * s * (d != 0))
                         for a, d in (("std", 0.0), ("blk", shift)) for s in range(3)])
    report.compare(arms, arms[0])
    line = next(ln for ln in report.reading(arms, arms[0]) if ln.startswith("- **blk**"))
    size = f"{abs(arms[1].diff.mean):.4f}"
    assert f"final validation loss {size} {verdict} than std" in line
    assert f"[{arms[1].diff.low:+.4f}, {arms[1].diff.high:+.4f}]" in line
