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
NOT_STARTED = "not started"


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


def run_job(job: Job, out: Path, resume: bool, threads: int = 1,
            runs: Runs | None = None) -> dict:
    """Run one job to the end in a child process; its outcome as run.json records it
    (NOT_STARTED: `runs`, a local sweep's, was stopped before it). The process has a
    session of its own, so a stop reaches it only as the sweep, or a scheduler's signal to
    the whole job, passes it on. (Module level so that submitit can pickle it.)"""
    folder = out / job.name
    holder = held_by(folder)
    if holder is not None:  # its run.json is that run's to write, not this failure's
        error = f"{folder} is in use by another run ({holder}); run the sweep again when it ends"
        return {"name": job.name, "status": "failed", "error": error, "seconds": 0.0}
    folder.mkdir(parents=True, exist_ok=True)
    # STOP_WITH_PARENT: the run stops (saving, as on SIGTERM) if the sweep is killed
    # outright, rather than train on unwatched with run.json left at 'running'
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), STOP_WITH_PARENT: "1"}
    t0 = time.perf_counter()
    with open(folder / "train.log", "a") as log:
        child = (runs or Runs()).start(job.command(out, resume=resume, threads=threads),
                                       stdout=log, stderr=subprocess.STDOUT, env=env)
        if child is None:
            return {"name": job.name, "status": NOT_STARTED}
        _record(out, job, status="running")
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
    runs = Runs()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, _stop_signals():
        futures = {}
        for job, s in pending:
            futures[pool.submit(_started, job, out, s == "resume", report, halted,
                                runs)] = job
        try:
            for f in as_completed(futures):
                results.append(f.result())
        except KeyboardInterrupt as e:
            for f in futures:
                f.cancel()
            # SIGTERM for a stop that was not a Ctrl-C (a run's SIGHUP ends it unsaved)
            _stop_runs(runs, signal.SIGTERM if isinstance(e, Stopped) else signal.SIGINT)
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


def _started(job: Job, out: Path, resume: bool, report, halted: threading.Event,
             runs: Runs) -> dict:
    """Run `job`, reporting its start and its end from the thread that runs it: reported by
    the main thread, a run's end came after the next run's start ('starting b' before 'a:
    done' with --jobs 1, two runs at once to read). Once a run has been stopped by a signal
    the sweep did not get (`halted`: one sent to the run alone, as an admin's kill), a
    stop meant for the sweep, the runs not yet started are not; nor once the sweep was
    stopped (`runs`): NOT_STARTED."""
    if halted.is_set() or runs.stopped:
        return {"name": job.name, "status": NOT_STARTED}
    report({"event": "start", "job": job, "resume": resume})
    result = run_job(job, out, resume, runs=runs)
    if result["status"] == "interrupted":
        halted.set()
    report({"event": "end", "job": job, **result})
    return result


class Runs:
    """The runs a sweep started, each in a session of its own (as dist runs torchrun), and
    whether it was stopped. A stop then reaches each run once, as the sweep passes it on:
    a terminal's Ctrl-C reached only the runs alive when it came, not one whose process
    started in the milliseconds after (trained on till SIGTERM, STOP_WAIT seconds later),
    and a run started after the stop trained to its end while the sweep waited for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # between a stop and a start: one is first
        self.children: list[subprocess.Popen] = []
        self.stopped = False

    def start(self, command: list[str], **kw) -> subprocess.Popen | None:
        """The run's process, or None once the runs were stopped."""
        with self.lock:
            if self.stopped:
                return None
            child = subprocess.Popen(command, start_new_session=True, **kw)
            self.children.append(child)
            return child

    def stop(self, signum: int) -> list[subprocess.Popen]:
        """Start no more, and send `signum` to the runs still running (those)."""
        with self.lock:
            self.stopped = True
            live = [c for c in self.children if c.poll() is None]
        for child in live:
            try:
                child.send_signal(signum)
            except OSError:  # ended meanwhile
                pass
        return live


def _stop_runs(runs: Runs, signum: int) -> None:
    """Stop the runs after the sweep was stopped: each gets `signum`, its first stop, and
    STOP_WAIT seconds to finish its step and save it; then SIGTERM, a second stop, at once
    to any still running (its last checkpoint stands), as a second Ctrl-C does meanwhile."""
    live = runs.stop(signum)
    deadline = time.monotonic() + STOP_WAIT
    try:
        while any(c.poll() is None for c in live) and time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        runs.stop(signal.SIGINT)
        raise
    runs.stop(signal.SIGTERM)


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
            halted = False  # a run was stopped from outside (scancel): start no more
            for job, handle in submitted:
                if halted and _pending(handle):  # as run_local starts no more
                    cancel_unfinished([handle])
                    result = {"name": job.name, "status": NOT_STARTED}
                else:
                    try:
                        result = handle.result()
                    except Exception as e:  # the job itself failed to run (not the training)
                        error = str(e).splitlines()[-1]
                        _record(out, job, status="failed", error=error)
                        result = {"name": job.name, "status": "failed", "error": error}
                halted = halted or result["status"] == "interrupted"
                results.append(result)
                report({"event": "end", "job": job, **result})
        except KeyboardInterrupt as e:
            # the jobs are submitted up front: a Slurm job trained on after its sweep was
            # stopped and had said its runs were, as a local one did after a stop sent to
            # the sweep alone. A Ctrl-C reached local ones too (the sweep's process group),
            # which stop their runs (run_job's, in sessions of their own) as cancel does
            if cluster != "local" or isinstance(e, Stopped):
                cancel_unfinished([handle for _, handle in submitted])
            raise
    return results


def _pending(handle) -> bool:
    """Whether a submitit job has not started yet (Slurm's PENDING; a local one starts at
    once). Unknown (sacct failed): started."""
    try:
        return handle.state == "PENDING"
    except Exception:  # the scheduler could not say
        return False


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
