"""Running a sweep's jobs: local processes (`--jobs` at a time, one thread each), or one
Slurm job each through submitit (its local executor runs the same path on this machine).

Each job is `restopo train` in its own folder, so every run has the usual checkpoints and
metrics. The sweep keeps run.json per job (arm, seed, status, error), which makes it
restartable: a finished run is skipped, an interrupted one resumed from its checkpoint, a
failed one tried again; a failing run is recorded and never stops the others.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ..io import write_atomic
from ..spec.overrides import override_values
from ..train.checkpoint import latest_checkpoint, newest_meta
from ..train.runlock import held_by
from ..worker import STOP_WITH_PARENT, signals_handled
from .grid import Job, one_folder_each
from .runs import RUN_FILE, diverged_step, reached_end

TAIL = 20  # lines of a failed run's log kept as its error
# How a run stopped by Ctrl-C or the sweep's SIGTERM exits: restopo's 130, or the signal.
INTERRUPTED = (130, -signal.SIGINT, -signal.SIGTERM)
STOP_WAIT = 30.0  # seconds a run gets to finish its step and save it after Ctrl-C


class Stopped(KeyboardInterrupt):
    """The sweep was told to stop by a signal other than Ctrl-C (SIGTERM from `kill` or a
    scheduler, SIGHUP): stopped as Ctrl-C stops it, after passing the stop on to the runs,
    which that signal (sent to the sweep alone) did not reach."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def state(out: Path, job: Job) -> str:
    """done (finished all its steps), diverged (stopped at a NaN or infinite loss, as its
    metrics record: resumed, it would diverge again), resume (has a checkpoint), or new."""
    folder = out / job.name
    if diverged_at(folder) is not None:  # before its first checkpoint too
        return "diverged"
    info = _read(folder / RUN_FILE)
    ckpt, meta = newest_meta(folder / "ckpt")  # a damaged newest one: train --resume passes it
    if ckpt is None and latest_checkpoint(folder / "ckpt") is None:
        return "new"
    return "done" if reached_end(meta) and info.get("status") == "done" else "resume"


def diverged_at(folder: Path) -> int | None:
    """The step a run's loss became NaN or infinite at, as its metrics.jsonl records."""
    from ..train.plots import read_metrics
    return diverged_step(read_metrics(folder / "metrics.jsonl"))


def _skipped(todo, out: Path, report) -> list[dict]:
    """The results of the jobs a sweep does not run (done, or diverged), each reported."""
    results = []
    for job, s in todo:
        if s in ("done", "diverged"):
            event = {"name": job.name, "status": s, "skipped": True}
            if s == "diverged":
                event["error"] = (f"it diverged at step {diverged_at(out / job.name)}; "
                                  f"not run again (lower train.lr or train.grad_clip, or "
                                  f"delete {out / job.name} to train it afresh)")
            report({"event": "skip", "job": job, **event})
            results.append(event)
    return results


def adopt_names(jobs: list[Job], out: Path) -> list[Job]:
    """The jobs, each named as the sweep's folder already names the same run (spec file,
    overrides, seed; the arm's name for a new seed of a known arm). A name depends on the
    grid (a lone spec's name is left out of it), so sweeping the folder again with another
    set of specs named the runs anew and trained every one again."""
    known: dict[tuple, str] = {}
    for path in sorted(out.glob(f"*/{RUN_FILE}")):
        info = _read(path)
        if isinstance(info.get("arm"), str) and isinstance(info.get("spec"), str):
            known.setdefault(_identity(info["spec"], info.get("overrides") or ()), info["arm"])
    adopted = []
    for job in jobs:
        arm = known.get(_identity(job.spec, job.overrides), job.arm)
        adopted.append(job if arm == job.arm else
                       dataclasses.replace(job, arm=arm, name=f"{arm}-s{job.seed}"))
    one_folder_each(adopted)
    return adopted


def _identity(spec: str, overrides) -> tuple:
    """What makes two jobs one arm: the spec file and the settings the overrides give."""
    return os.path.realpath(spec), frozenset(override_values(overrides).items())


def changed(out: Path, job: Job) -> str | None:
    """How the run already in `job`'s folder was trained differently from what `job` asks
    (its newest checkpoint's spec text and overrides against the spec file's and the
    job's), else None. A sweep must not count such a run as one of its own, nor resume it
    under other settings."""
    ckpt, meta = newest_meta(out / job.name / "ckpt")
    if ckpt is None:
        return None  # nothing trained yet (or nothing readable): the run starts afresh
    # what `restopo train` records: the job's --set values, then --seed as train.seed
    then = override_values(meta.get("overrides", ()))
    now = override_values((*job.overrides, f"train.seed={job.seed}"))
    diffs = [f"{k}={now.get(k, '(unset)')} now, {then.get(k, '(unset)')} then"
             for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)]
    try:
        text = Path(job.spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = None  # the spec check before this reports an unreadable spec
    if text is not None and meta.get("spec_text") != text:
        diffs.insert(0, f"{job.spec} has changed since")
    if diffs and text is not None and _same_settings(text, job, meta):
        return None  # written otherwise (a --set of the spec's own value, a comment)
    return f"{out / job.name}: {'; '.join(diffs)}" if diffs else None


def _same_settings(text: str, job: Job, meta: dict) -> bool:
    """Whether the spec text with the job's overrides checks to the same model, residual,
    training and parallel settings as the run's checkpoint recorded."""
    from ..spec import SpecError, parse_spec
    try:
        now = parse_spec(text, job.spec, (*job.overrides, f"train.seed={job.seed}"))
        then = parse_spec(meta.get("spec_text") or "", str(meta.get("spec_path", "<run>")),
                          tuple(meta.get("overrides") or ()))
    except SpecError:
        return False
    return all(getattr(now, k) == getattr(then, k)
               for k in ("model", "residual", "train", "parallel"))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _record(out: Path, job: Job, **fields) -> None:
    folder = out / job.name
    folder.mkdir(parents=True, exist_ok=True)
    info = {"arm": job.arm, "seed": job.seed, "spec": job.spec,
            "overrides": list(job.overrides), **fields}
    write_atomic(folder / RUN_FILE, json.dumps(info, indent=1) + "\n")


def run_job(job: Job, out: Path, resume: bool, threads: int = 1) -> dict:
    """Run one job to the end in a child process; its outcome as run.json records it.
    (Module level so that submitit can pickle it.)"""
    folder = out / job.name
    holder = held_by(folder)
    if holder is not None:  # its run.json is that run's to write, not this failure's
        error = f"{folder} is in use by another run ({holder}); run the sweep again when it ends"
        return {"name": job.name, "status": "failed", "error": error, "seconds": 0.0}
    folder.mkdir(parents=True, exist_ok=True)
    _record(out, job, status="running")
    # STOP_WITH_PARENT: the run stops (saving, as on SIGTERM) if the sweep is killed
    # outright, rather than train on unwatched with run.json left at 'running'
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), STOP_WITH_PARENT: "1"}
    t0 = time.perf_counter()
    with open(folder / "train.log", "a") as log:
        child = subprocess.Popen(job.command(out, resume=resume, threads=threads),
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
        load = machine_load(child)
    code = child.returncode
    seconds = time.perf_counter() - t0
    if code == 0:
        _record(out, job, status="done", seconds=round(seconds, 1), **load)
        return {"name": job.name, "status": "done", "seconds": seconds}
    if code in INTERRUPTED:  # stopped by the sweep's Ctrl-C, not failed: rerun resumes it
        why = "interrupted; the sweep resumes it from its last checkpoint when run again"
        _record(out, job, status="interrupted", returncode=code, error=why)
        return {"name": job.name, "status": "interrupted", "error": why, "seconds": seconds}
    lines = (folder / "train.log").read_text(errors="replace").splitlines()[-TAIL:]
    error = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines
                 else f"exit status {code}")
    _record(out, job, status="failed", returncode=code, error=error, log_tail=lines)
    return {"name": job.name, "status": "failed", "error": error, "seconds": seconds}


def machine_load(child: subprocess.Popen, every: float = 5.0) -> dict:
    """Wait for `child`, sampling the machine's 1-minute load average: a run's step time
    means something only beside the load it ran under (other runs, other work)."""
    if not hasattr(os, "getloadavg"):
        child.wait()
        return {}
    samples = [os.getloadavg()[0]]
    while True:
        try:
            child.wait(timeout=every)
            break
        except subprocess.TimeoutExpired:
            samples.append(os.getloadavg()[0])
    return {"load_mean": round(sum(samples) / len(samples), 2),
            "load_max": round(max(samples), 2), "cpus": os.cpu_count()}


def run_local(jobs: list[Job], out: Path, workers: int, report) -> list[dict]:
    """Run `jobs` with up to `workers` child processes at once. `report(event)` is called
    with each start and end. Ctrl-C stops the children (their last checkpoints stay)."""
    todo = [(job, state(out, job)) for job in jobs]
    results = _skipped(todo, out, report)
    pending = [(j, s) for j, s in todo if s in ("new", "resume")]
    halted = threading.Event()  # a run was stopped from outside: start no more
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, _stop_signals():
        futures = {}
        for job, s in pending:
            futures[pool.submit(_started, job, out, s == "resume", report, halted)] = job
        try:
            for f in as_completed(futures):
                results.append(f.result())
        except KeyboardInterrupt as e:
            for f in futures:
                f.cancel()
            # Ctrl-C reached the runs too (one process group); a signal to the sweep alone
            # did not: pass it on as SIGTERM, which a run takes as its first Ctrl-C
            _stop_children(tell=isinstance(e, Stopped))
            raise
    return results


def _stop_signals():
    """Within the block, SIGTERM and SIGHUP to the sweep raise Stopped in its main thread
    (they ended it at once, its runs training on, orphaned), and SIGINT raises
    KeyboardInterrupt even where the sweep inherited it ignored, as one started in the
    background by a script (`restopo sweep ... &`) does: restopo train takes a Ctrl-C so
    too (restopo.train.interrupt), and the processes the sweep starts take SIGINT (an
    ignored signal stays ignored in a new program, a handled one does not), as the SIGINT
    that cancels a submitit local job must: ignored, the job's run trained on."""
    def stop(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    return signals_handled(("SIGTERM", "SIGHUP") + (("SIGINT",) if ignored else ()), stop)


NOT_STARTED = "not started"


def _started(job: Job, out: Path, resume: bool, report, halted: threading.Event) -> dict:
    """Run `job`, reporting its start and its end from the thread that runs it: reported by
    the main thread, a run's end came after the next run's start ('starting b' before 'a:
    done' with --jobs 1, two runs at once to read). Once a run has been stopped by a signal
    the sweep did not get (`halted`: one sent to the run, or to a process group whose
    Ctrl-C the sweep ignores, as a sweep started in the background by a script does), a
    stop meant for the sweep, the runs not yet started are not: NOT_STARTED."""
    if halted.is_set():
        return {"name": job.name, "status": NOT_STARTED}
    report({"event": "start", "job": job, "resume": resume})
    result = run_job(job, out, resume)
    if result["status"] == "interrupted":
        halted.set()
    report({"event": "end", "job": job, **result})
    return result


def _stop_children(tell: bool = False) -> None:
    """Stop our child runs after a Ctrl-C: the terminal sent it to them too (one process
    group), and a run stops after its step with a checkpoint of it, so they get STOP_WAIT
    seconds to do that (a second SIGINT from here would stop them at once, unsaved); then
    SIGTERM to any still running (its last checkpoint stands). `tell`: the stop reached
    the sweep alone, so the runs are sent SIGTERM first (their first stop: they save)."""
    def children() -> list[int]:
        try:
            found = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                                   text=True).stdout.split()
        except OSError:
            return []
        return [int(p) for p in found if p.isdigit()]

    def terminate() -> None:
        for pid in children():
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass

    if tell:
        terminate()
    deadline = time.monotonic() + STOP_WAIT
    while children() and time.monotonic() < deadline:
        time.sleep(0.2)
    terminate()


def run_submitit(jobs: list[Job], out: Path, report, *, cluster: str = "slurm",
                 parameters: dict | None = None) -> list[dict]:
    """One submitit job per run (cluster 'slurm', or 'local' to run them on this machine
    through submitit's own local executor). Needs `pip install 'restopo[sweep]'`."""
    try:
        import submitit
    except ImportError:
        raise RuntimeError("--executor submitit needs submitit: pip install 'restopo[sweep]'") \
            from None
    try:
        executor = submitit.AutoExecutor(folder=str(out / ".submitit"), cluster=cluster)
    except RuntimeError as e:  # no Slurm here: 'Could not detect "srun", ...'
        raise RuntimeError(f"--executor submitit: {e} It submits Slurm jobs: run the sweep "
                           f"on a machine of the cluster, or use --executor local (or "
                           f"submitit-local) here") from None
    try:
        executor.update_parameters(**(parameters or {}))
    except (AssertionError, NameError, TypeError, ValueError) as e:  # submitit's own checks
        said = "; ".join(line.strip().rstrip(".") for line in str(e).splitlines())
        raise RuntimeError(f"--slurm: {said}") from None
    todo = [(job, state(out, job)) for job in jobs]
    results = _skipped(todo, out, report)
    submitted = []
    with _stop_signals():
        try:
            for job, s in todo:
                if s not in ("new", "resume"):
                    continue
                report({"event": "start", "job": job, "resume": s == "resume"})
                submitted.append((job, executor.submit(run_job, job, out, s == "resume")))
            for job, handle in submitted:
                try:
                    result = handle.result()
                except Exception as e:  # the job itself failed to run (not the training)
                    error = str(e).splitlines()[-1]
                    _record(out, job, status="failed", error=error)
                    result = {"name": job.name, "status": "failed", "error": error}
                results.append(result)
                report({"event": "end", "job": job, **result})
        except KeyboardInterrupt as e:
            # the jobs are submitted up front: a Slurm job trained on after its sweep was
            # stopped and had said its runs were, as a local one did after a stop sent to
            # the sweep alone. A Ctrl-C reached local ones too (one process group): cancel's
            # SIGINT, a second, would stop their runs at once, unsaved
            if cluster != "local" or isinstance(e, Stopped):
                cancel_unfinished([handle for _, handle in submitted])
            raise
    return results


def cancel_unfinished(handles) -> None:
    """Cancel each submitit job not yet finished: Slurm's scancel sends its run SIGTERM,
    which a run takes as its first Ctrl-C (it saves, then stops); one not yet started never
    starts."""
    for handle in handles:
        try:
            if not handle.done():
                handle.cancel(check=False)
        except OSError:  # scancel could not run: the others are still worth a try
            pass
