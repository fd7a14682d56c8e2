"""`restopo sweep SPEC... --seeds N`: train a grid of specs x overrides x seeds, then compare."""
from __future__ import annotations

import argparse
import signal
import shlex
import sys
import threading
import time
from pathlib import Path

from ..cli import SetOverride, at_least, output_error
from ..words import counted

EXAMPLES = """\
examples:
  restopo sweep examples/standard.restopo examples/block_attnres.restopo --seeds 3 \\
      --set train.steps=2000 --jobs 2 --out runs/ablation
  restopo sweep examples/standard.restopo --vary model.width=32,64,128 --seeds 2 \\
      --out runs/scaling                        a size axis (compare --scaling fits it)
  restopo sweep examples/standard.restopo examples/block_attnres.restopo \\
      --vary train.lr=1e-3,3e-3 --seeds 3 --baseline standard --out runs/lr
      each arm against standard at its own lr (block_attnres-lr1e_3 vs standard-lr1e_3)
  restopo sweep experiments/ablation/*.restopo --seeds 3 --out runs/ablation   # again:
      finished runs are skipped, interrupted ones resumed, failed ones tried again

Each run is `restopo train SPEC --set ... --seed S --out OUT/NAME` (one thread), named from
what differs (spec, varied values, seed); its log is OUT/NAME/train.log and its state
OUT/NAME/run.json. A failed run is recorded and the others go on. At the end the runs are
compared (OUT/results.md, which opens with the `restopo compare OUT --baseline ...` line
that redoes it).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="train a grid of specs x overrides x seeds, then compare the runs",
        description="Train every combination of spec, varied overrides and seed through "
                    "`restopo train`, a few processes at a time; rerunning completes only "
                    "what is missing.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", metavar="SPEC", help=".restopo files (the arms)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder of the sweep's runs")
    p.add_argument("--seeds", type=at_least(1), metavar="N",
                   help="seeds 0..N-1 for every arm (default 1)")
    p.add_argument("--seed-list", metavar="S,S,...", help="these seeds instead of 0..N-1")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a spec value in every run (repeatable)")
    p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                   help="an axis of the grid: one arm per value (repeatable: all combinations)")
    p.add_argument("--jobs", type=at_least(1), default=1, metavar="J",
                   help="runs at a time, one CPU thread each (default 1)")
    p.add_argument("--executor", choices=("local", "submitit", "submitit-local"),
                   default="local",
                   help="local processes (default); submitit: one Slurm job per run; "
                        "submitit-local: the same through submitit on this machine")
    p.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                   help="a submitit/Slurm parameter, e.g. timeout_min=120, "
                        "slurm_partition=gpu (repeatable)")
    p.add_argument("--baseline", metavar="ARM",
                   help="compare the others with this arm (or spec, or --vary value such "
                        "as standard: with it at their own other --vary values)")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state only")
    p.set_defaults(func=run)


MAX_SEEDS = 10_000  # each seed is a whole training run of every arm


def _seeds(args) -> list[int]:
    if args.seeds is not None and args.seeds > MAX_SEEDS:  # a typo: its grid fills memory
        raise ValueError(f"--seeds {args.seeds} asks for {args.seeds:,} training runs of every "
                         f"arm; give at most {MAX_SEEDS:,} (or --seed-list S,S,... for "
                         f"particular seeds)")
    if args.seed_list is None:
        return list(range(1 if args.seeds is None else args.seeds))
    if args.seeds is not None:  # one would be dropped silently: --seed-list won
        raise ValueError(f"--seeds {args.seeds} and --seed-list {args.seed_list} both say "
                         "which seeds to run; give one of them")
    try:
        return [int(s) for s in args.seed_list.split(",")]
    except ValueError:
        raise ValueError(f"--seed-list takes whole numbers separated by commas, e.g. "
                         f"0,1,2; got {args.seed_list!r}") from None


def _check_seeds(seeds: list[int], job, args) -> None:
    """Each run is `train --seed S`: a seed train refuses (below 0, above the spec's bound)
    is refused here, before any run, rather than fail every run of the sweep. The error
    shows the flag as typed, as train's --seed and sweep's --vary do."""
    from ..spec import load_spec
    from ..spec.overrides import FlagOverride

    if args.seed_list is None:  # 0..N-1: the one value typed is N
        flag, typed, at = "--seeds", str(args.seeds or 1), dict.fromkeys(seeds, 0)
    else:
        flag, typed, at, col = "--seed-list", args.seed_list, {}, 0
        for item in typed.split(","):
            at.setdefault(int(item), col + len(item) - len(item.lstrip()))
            col += len(item) + 1
    for seed in dict.fromkeys((min(seeds), max(seeds))):  # the bounds are a range
        load_spec(job.spec, overrides=job.overrides + (
            FlagOverride.of(flag, "train.seed", str(seed), typed=typed, at=at[seed]),))


def _check_baseline(name: str | None, jobs) -> None:
    """--baseline names an arm of the grid (or the one arm of a spec), checked before any
    run trains rather than when the runs are compared at the end (as compare picks it)."""
    from ..experiments.report import baseline_arm
    from ..experiments.runs import settings_of
    if name is not None:
        arms = {j.arm: (Path(j.spec).stem, settings_of(j.overrides)) for j in jobs}
        baseline_arm(name, [(arm, *spec) for arm, spec in arms.items()])


def _parameters(items, executor: str) -> dict:
    if items and executor == "local":  # else dropped silently: the runs go on unlimited
        raise ValueError(f"--slurm {items[0]} is a parameter of submitit's jobs, but the runs "
                         f"are local processes (--executor local); add --executor submitit "
                         f"(or submitit-local), or drop --slurm")
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--slurm takes KEY=VALUE; got {item!r}")
        out[key.strip()] = _slurm_value(value.strip())
    return out


def _slurm_value(text: str):
    """A --slurm value typed as submitit checks it (mem_gb=1.5 is a number, stderr_to_stdout=
    true a bool; as text they were refused): a whole or real number, true/false, or text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def run(args) -> int:
    from ..experiments import runner
    from ..experiments.grid import make_grid
    from ..spec import SpecError, load_spec
    from ..spec.datapath import check_data_path
    from ..spec.errors import raise_all

    out = Path(args.out)
    why = output_error(args.out, folder=True)  # its runs' folders, inside another run's
    if why:
        print(f"restopo sweep: error: --out {why}", file=sys.stderr)
        return 1
    try:
        seeds = _seeds(args)
        grid = make_grid(args.specs, seeds, args.overrides, args.vary)
        jobs = runner.adopt_names(grid, out)  # the folder's names for runs it holds
        # every run's spec, overrides and data path check before any run trains; each
        # mistake said once (a bad --vary value, not only the first, as train says each --set)
        errors: dict[tuple, SpecError] = {}
        for spec, overrides in dict.fromkeys((j.spec, j.overrides) for j in jobs):
            try:
                check_data_path(load_spec(spec, overrides=overrides))
            except SpecError as e:
                for one in getattr(e, "errors", [e]):
                    errors.setdefault((one.path, one.line, one.column, one.message), one)
        raise_all(list(errors.values()))
        _check_seeds(seeds, jobs[0], args)
        slurm = _parameters(args.slurm, args.executor)
        _check_baseline(args.baseline, jobs)
    except ValueError as e:
        print(f"restopo sweep: error: {e}", file=sys.stderr)
        return 2
    from ..experiments.runs import holds_a_run
    if holds_a_run(out):  # its runs would be compared with that one, as one more arm
        print(f"restopo sweep: error: --out {out} holds a run of restopo train (metrics.jsonl "
              f"or ckpt/), which restopo compare would take for one of the sweep's arms; "
              f"give the sweep another --out, or move that run's files into a folder of "
              f"their own", file=sys.stderr)
        return 1
    changed = [why for j in jobs if (why := runner.changed(out, j))]
    if changed:
        print("restopo sweep: error: " + "\n  ".join(
            ["these runs in the sweep's folder were trained with other settings, so they "
             "would not be what this sweep asks for:", *changed]) + "\ngive another --out, "
            "or delete those run folders to train them again", file=sys.stderr)
        return 1
    renamed = [(g.name, j.name) for g, j in zip(grid, jobs) if g.name != j.name]
    if renamed:
        keep = "keeps" if len(renamed) == 1 else "keep"
        print(f"restopo sweep: note: {counted(len(renamed), 'run')} {keep} the names {out} "
              f"gave their arms before, such as {renamed[0][1]} (this grid alone names it "
              f"{renamed[0][0]})",
              file=sys.stderr)
    states = {j.name: runner.state(out, j) for j in jobs}
    print(f"restopo sweep: {counted(len(jobs), 'run')} in {out} "
          f"({sum(s == 'done' for s in states.values())} done, "
          f"{sum(s == 'resume' for s in states.values())} to resume)", file=sys.stderr)
    if args.dry_run:
        for j in jobs:
            # a run the sweep skips (done, diverged) as a resume: pasted, --overwrite, for a
            # run never saved, would delete it
            command = j.command(out, resume=states[j.name] != "new")[3:]
            # quoted as a shell would need them: a pasted line runs as listed
            print(f"  {j.name:40s} {states[j.name]:7s} {shlex.join(command)}")
        return 0
    from ..train.runlock import RunLocked, run_lock
    from ..worker import stop_if_interrupted
    stop_if_interrupted()  # checked: the runs begin
    try:
        with run_lock(out, who="sweep"):  # one sweep per folder; its runs lock their own
            return _execute(args, jobs, out, slurm)
    except RunLocked as e:
        print(f"restopo sweep: error: {e}", file=sys.stderr)
        return 1


def _execute(args, jobs, out: Path, slurm: dict) -> int:
    """Run the sweep's jobs, say which failed, and compare what finished."""
    from ..experiments import runner
    progress = _Progress(len(jobs))
    try:
        if args.executor == "local":
            results = runner.run_local(jobs, out, args.jobs, progress)
        else:
            cluster = "local" if args.executor == "submitit-local" else "slurm"
            results = runner.run_submitit(jobs, out, progress, cluster=cluster, parameters=slurm)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)  # runner.Stopped: SIGTERM, SIGHUP
        how = ("interrupted" if signum == signal.SIGINT else
               f"stopped ({signal.Signals(signum).name})")
        print(f"restopo sweep: {how}; the runs are stopped at their last checkpoints; run "
              "it again to finish (finished runs are kept)", file=sys.stderr)
        return 128 + signum
    except RuntimeError as e:
        print(f"restopo sweep: error: {e}", file=sys.stderr)
        return 1
    failed = [r for r in results if r["status"] == "failed"]
    for r in failed:
        print(f"restopo sweep: {r['name']} failed: {r.get('error')} (log: "
              f"{out / r['name'] / 'train.log'})", file=sys.stderr)
    # stopped by a signal that did not stop the sweep (sent to the run alone): not done
    stopped = [r for r in results if r["status"] == "interrupted"]
    for r in stopped:
        print(f"restopo sweep: {r['name']} was stopped before its end, not by this sweep; "
              f"run the sweep again to resume it", file=sys.stderr)
    unstarted = [r for r in results if r["status"] == runner.NOT_STARTED]
    if unstarted:
        print(f"restopo sweep: {counted(len(unstarted), 'run')} not started after that stop "
              f"(such as {unstarted[0]['name']}); run the sweep again to train them",
              file=sys.stderr)
    from .compare import run as compare_run
    compare_args = argparse.Namespace(runs=[str(out)], baseline=args.baseline, out=str(out),
                                      scaling=False, title=f"restopo sweep {out.name}")
    ran = len(results) - len(failed) - len(unstarted)
    code = compare_run(compare_args) if ran else 1
    return 1 if failed or stopped else code


class _Progress:
    """One line per run as it starts and ends, with the count and the time so far."""

    def __init__(self, total: int):
        self.total, self.ended, self.t0 = total, 0, time.perf_counter()
        self.lock = threading.Lock()  # runs start and end on several threads

    def __call__(self, event: dict) -> None:
        with self.lock:
            self._print(event)

    def _print(self, event: dict) -> None:
        from ..experiments.report import elapsed

        job = event["job"]
        if event["event"] == "start":
            verb = "resuming" if event.get("resume") else "starting"
            print(f"  {verb} {job.name}", file=sys.stderr, flush=True)
            return
        self.ended += 1
        what = event["status"]
        if event["event"] == "skip":
            what = "already done" if what == "done" else f"{what} before"
        took = f" in {elapsed(event['seconds'])}" if "seconds" in event else ""
        # the error last: a time after it read as the error's own words ('... is empty in 3 s')
        why = f": {event.get('error')}" if what.startswith(("failed", "diverged")) else ""
        print(f"  [{self.ended}/{self.total}] {job.name}: {what}{took} "
              f"({elapsed(time.perf_counter() - self.t0)} so far){why}", file=sys.stderr,
              flush=True)
