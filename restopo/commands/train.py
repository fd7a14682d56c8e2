"""`restopo train SPEC`: train the spec's model on its data, with checkpoints and plots."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..cli import SetOverride, device_arg, int_range, noter, output_error
from ..spec.objects import RECOMPUTE
from ..words import counted

EXAMPLES = """\
examples:
  restopo train examples/tiny.restopo
  restopo train examples/tiny.restopo --set model.width=128 --set train.lr=1e-3 --out runs/w128
  restopo train examples/tiny.restopo --steps 50 --out runs/quick
  restopo train examples/tiny.restopo --out runs/quick --resume     # continue from latest
  restopo train --resume --out runs/quick --steps 400                # spec from the checkpoint
  restopo train examples/tiny.restopo --nproc 2                      # 2 processes via torchrun
  restopo train examples/tiny.restopo --peak-tflops 1                # MFU against 1 TFLOP/s
  restopo train examples/tiny.restopo --compile                      # torch.compile per region
  restopo train examples/tiny.restopo --set train.compile=whole      # one graph: faster steps
  torchrun --nproc_per_node 2 -m restopo train examples/tiny.restopo
  restopo train examples/tiny.restopo --nproc 2 --data fsdp          # shard params + AdamW
  restopo train examples/tiny.restopo --nproc 4 --pipeline 2x2       # stage-local pipeline
  restopo train examples/tiny.restopo --recompute block   # less activation memory, slower
  restopo train examples/tiny.restopo --nproc 2 --resume --data fsdp # resume another layout
  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 --rdzv-id run1 -m restopo train examples/tiny.restopo

`batch` is the global batch of one optimizer step: with --nproc N each process takes
batch/N rows of it, so the numbers match a 1-process run. Data: `data:` in the spec's train
section (builtin:stdlib, a text file or folder, or a nanoGPT-style uint16 .bin), a relative
path read from the spec's folder, or from the current folder when --set gives it.
Writes OUT/metrics.jsonl (loss, val_loss, lr, tokens_per_s, and mfu when the device's peak
is known: --peak-tflops, or a known CUDA GPU's dense bf16 peak), OUT/loss.png and
OUT/ckpt/step_NNNNNN/ (safetensors weights, and a manifest of checksums; with FSDP or a
pipeline, one share per process and an index.json). --resume continues from the newest
checkpoint that verifies, whatever layout wrote it; a damaged one is named and moved to
OUT/ckpt/damaged/. One run at a time per OUT (a second is refused, naming the first). A
text-folder corpus is bounded: set RESTOPO_DATA_MAX_FILES or RESTOPO_DATA_MAX_BYTES to raise
the bounds.
"""


# Bounds of the numeric flags (--steps and --seed are spec values, checked like the file).
MAX_NPROC = 256
MAX_RESTARTS = 100
MAX_THREADS = 1024  # torch crashes outright far above this (100,000 threads)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a spec's model (checkpoints, metrics, loss plot)",
        description="Train the model a .restopo spec describes, on the spec's train data.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", metavar="SPEC",
                   help="the .restopo file (optional with --resume: the checkpoint has it)")
    p.add_argument("--set", dest="overrides", action=SetOverride, default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set model.width=64 (repeatable)")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/ and the spec "
                                                "file's name, e.g. runs/tiny for tiny.restopo)")
    p.add_argument("--steps", type=int, metavar="N", help="same as --set train.steps=N")
    p.add_argument("--seed", type=int, metavar="N", help="same as --set train.seed=N")
    p.add_argument("--peak-tflops", type=float, metavar="T",
                   help="one device's peak TFLOP/s for the MFU figure, e.g. 989 (same as "
                        "--set train.peak_tflops=T; default: the spec's, else known CUDA "
                        "GPUs' dense bf16 peak, none on the CPU)")
    p.add_argument("--recompute", choices=RECOMPUTE,
                   help="activation recompute: keep less for backward, run it again there "
                        "(same as --set train.recompute=MODE; default: the spec's, else "
                        "none)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model region by region, in place: each sublayer, "
                        "and each aggregation point and phase 1 that the fused C kernels do not "
                        "run (same as --set train.compile=regional, unless the spec already "
                        "says compile: whole, which it keeps); the first step compiles. "
                        "--set train.compile=whole compiles the model as one graph instead: "
                        "faster steps, a slower first step (one process or DDP)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", type=device_arg,
                   help="where to train (default auto: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--backend", choices=("auto", "eager", "triton", "cpu"), default="auto",
                   help="aggregation kernels (default: triton on CUDA when available, else the "
                        "fused C kernels on the CPU where they build)")
    start = p.add_mutually_exclusive_group()  # continue the run, or replace it: not both
    start.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in OUT/ckpt")
    start.add_argument("--overwrite", action="store_true",
                       help="start a new run in an OUT that holds an earlier run's "
                            "checkpoints (they are deleted)")
    p.add_argument("--nproc", type=int_range(1, MAX_NPROC, "processes on this machine"),
                   metavar="N", help="launch N processes through torchrun (data parallel; "
                                     "default: this one process, or those torchrun started)")
    p.add_argument("--max-restarts", type=int_range(0, MAX_RESTARTS), default=0, metavar="R",
                   help="with --nproc: let torchrun restart a failed job R times (each "
                        "restart resumes from the latest checkpoint; default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int_range(1, MAX_THREADS, "more threads than cores "
                                               "only slow a run down"), metavar="N",
                   help="CPU threads per process (default: $OMP_NUM_THREADS, else 1: the "
                        "small models trained on CPU gain little from more threads and slow "
                        "down badly when the cores are shared)")
    p.add_argument("--pipeline", metavar="PxV",  # -- pipeline parallel (backends/pipeline) --
                   help="pipeline parallel: P stages x V virtual stages (P alone: Px1; "
                        "needs a multiple of P processes: --nproc P, or torchrun; default: "
                        "the spec's parallel section's, if any); that section gives schedule, "
                        "microbatches and cache")
    p.add_argument("--data", choices=("ddp", "fsdp"), dest="data_parallel",
                   help="the data-parallel engine over the processes (same as --set "
                        "parallel.data=...): ddp replicates the model, fsdp shards "
                        "parameters, gradients and AdamW state per sublayer (FSDP2; "
                        "default: the spec's, else ddp)")
    p.set_defaults(func=run)


class _Stop(Exception):
    """A user mistake found while setting up the run (printed as one line, exit 1)."""


def _fail(message: str) -> int:
    """Say a mistake once: every worker of a run meets it, rank 0 says it (and the workers
    exit with USAGE_EXIT, so the launcher adds nothing)."""
    if _is_writer():
        print(f"restopo train: error: {message}", file=sys.stderr)
    return _usage_exit()


def _usage_exit() -> int:
    """The exit status after a mistake. Under torchrun the other workers give rank 0 time to
    say it and exit first: torchrun stops every worker as soon as one exits."""
    import time

    from ..train.dist import USAGE_EXIT, under_torchrun

    if not under_torchrun():
        return 1
    if not _is_writer():
        time.sleep(float(os.environ.get("RESTOPO_USAGE_WAIT", "10")))
    return USAGE_EXIT


# Flags that stand for a spec key: (flag, attribute of args, key). `_overrides` turns them
# into --set values, `_worker_argv` hands them on to torchrun's workers.
SPEC_FLAGS = (("--steps", "steps", "train.steps"), ("--seed", "seed", "train.seed"),
              ("--peak-tflops", "peak_tflops", "train.peak_tflops"),
              ("--data", "data_parallel", "parallel.data"),
              ("--recompute", "recompute", "train.recompute"),
              ("--compile", "compile", "train.compile"))


def _flag_values(args):
    """(flag, value, key) of each SPEC_FLAGS flag given (--compile's value: "true")."""
    for flag, attr, key in SPEC_FLAGS:
        value = getattr(args, attr)
        if value is True:
            yield flag, "true", key
        elif value is not None and value is not False:
            yield flag, value, key


def _overrides(args) -> tuple[str, ...]:
    """The --set overrides, then those the flags stand for (a flag that disagrees with a
    --set of its key is refused)."""
    from ..spec.overrides import FlagConflict, with_flags

    try:
        return with_flags(args.overrides, ((flag, getattr(args, attr), key)
                                           for flag, attr, key in SPEC_FLAGS))
    except FlagConflict as e:
        raise _Stop(str(e)) from None


def _worker_argv(args) -> list[str]:
    """The same command for each torchrun worker, without --nproc."""
    argv = ["train"]
    if args.spec:
        argv.append(args.spec)
    for o in args.overrides:
        argv += ["--set", o]
    for flag, value, _ in _flag_values(args):
        argv += [flag] if flag == "--compile" else [flag, str(value)]
    if args.out is not None:
        argv += ["--out", args.out]
    argv += ["--device", args.device, "--backend", args.backend]
    if args.resume:
        argv.append("--resume")
    if args.overwrite:
        argv.append("--overwrite")
    if args.pipeline:
        argv += ["--pipeline", args.pipeline]
    if args.no_progress:
        argv.append("--no-progress")
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    return argv


def run(args) -> int:
    from ..registry import get_backend
    from ..train.checkpoint import CheckpointError
    from ..train.compile import CompileError
    from ..train.data import DataError
    from ..train.dist import cpu_threads
    from ..train.layout import LayoutError
    from ..train.loop import StoppedEarly, TrainingError
    from ..train.runlock import RunLocked
    PlanError = get_backend("pipeline").PlanError

    from ..spec import SpecError
    from ..train.dist import under_torchrun

    from ..worker import STOP_WITH_PARENT, die_with_parent
    if os.environ.pop(STOP_WITH_PARENT, None):  # a sweep's run (experiments.runner.run_job)
        die_with_parent(signal.SIGTERM)  # its sweep killed outright: stop, saving first
    elif under_torchrun():  # a live agent stops its workers itself; one killed (a second
        die_with_parent(signal.SIGKILL)  # stop of the launcher, dist.launch) ends them at once
    try:
        if args.max_restarts and args.nproc is None and not under_torchrun():
            raise _Stop("--max-restarts is torchrun's, so it needs --nproc N; a run of one "
                        "process resumes with --resume")
        with cpu_threads(args.threads):
            return _run(args)
    except (DataError, CheckpointError, TrainingError, PlanError, LayoutError, RunLocked,
            CompileError, _Stop) as e:
        return _fail(str(e))
    except StoppedEarly:
        if _is_writer():  # every rank stopped at that step: rank 0 says where
            raise
        return 130
    except SpecError as e:
        if not under_torchrun():
            raise  # the CLI renders it
        if _is_writer():  # every worker read the same spec: rank 0 says it
            print(e.render(), file=sys.stderr)
        return _usage_exit()
    except RuntimeError as e:
        from ..train.dist import LOST_PEER_EXIT, lost_peer
        broke = lost_peer(e) if under_torchrun() else None
        if broke is None:
            raise
        # another rank stopped, and the launcher names it: a traceback here would bury that
        print(f"restopo train: rank {os.environ['RANK']} lost its connection to another rank "
              f"({broke}); that rank's failure is the cause", file=sys.stderr)
        return LOST_PEER_EXIT


def _is_writer() -> bool:
    """Rank 0 (or a single process) writes the run folder; the other ranks only read it."""
    from ..worker import speaks_for_all

    return speaks_for_all()


# Set for the workers of `restopo train --nproc`: the launcher has said the notes of the
# first attempt already (a restarted attempt says its own).
NOTES_SAID = "RESTOPO_NOTES_SAID"


def _note(message: str) -> None:
    from ..train.dist import restart_count

    if _is_writer() and not (os.environ.get(NOTES_SAID) and restart_count() == 0):
        noter("train")(message)


def _out_folder(args) -> Path:
    """--out, or runs/<spec name>; a folder (an existing file there is a mistake)."""
    if args.out:
        out = Path(args.out)
    elif args.spec:
        out = Path("runs") / Path(args.spec).stem
    else:
        raise _Stop("give a SPEC file (or --resume with --out DIR to continue "
                    "a run from its checkpoint)")
    if out.exists() and not out.is_dir():
        raise _Stop(f"--out {out} is a file, not a folder; choose another --out")
    why = output_error(str(out), folder=True)  # not inside another run's checkpoints
    if why:
        raise _Stop(f"--out {why}")
    _not_a_folder_of_runs(out)
    return out


def _not_a_folder_of_runs(out: Path) -> None:
    """A run's --out must not be a folder of runs (a sweep's, or runs trained into its
    subfolders): restopo compare would take the run for one more arm, named for the folder,
    and restopo.load the folder for that one run. A run folder may hold runs of its own."""
    from ..experiments.runs import sweep_runs
    from ..train.checkpoint import runs_in
    from ..words import counted

    if (out / "ckpt").is_dir():
        return
    swept = sweep_runs(out)
    held = swept or runs_in(out)
    if held:
        whose = ": a sweep's" if swept else ""
        raise _Stop(f"--out {out} is a folder of runs ({counted(len(held), 'run')}, such as "
                    f"{held[0].name}{whose}), which restopo compare would take this run "
                    f"for one of; give it a folder of its own, e.g. --out {out / 'NAME'} "
                    f"(inside it: compared with them)")


def _tidy(out: Path) -> None:
    """Sweep what killed runs left behind (temporary files and folders, half-pruned or
    incomplete checkpoints); only while holding the run's lock."""
    from ..train.checkpoint import clean_leftovers, remove_leftovers

    # the atomic writer's temporary files (metrics, plot), the checkpoints --overwrite set
    # aside to delete
    done = clean_leftovers(out / "ckpt") + remove_leftovers(out)
    if done:
        _note(f"tidied {out} after an interrupted run: " + "; ".join(done))


# What a run writes in its folder: a new run into a folder holding any of them needs
# --overwrite (or --resume), so nothing there is replaced unasked.
RUN_FILES = ("metrics.jsonl", "loss.png", "tensorboard")


def _fresh_start(out: Path, overwrite: bool) -> bool:
    """A new run must not mix with an old one's checkpoints (resume would pick theirs), nor
    replace files it did not write. True when an old run is there to replace (--overwrite):
    `_replace_old_run` deletes it once every check has passed, never before (a refused
    command with --overwrite deleted the run it was refused for)."""
    from ..train.checkpoint import latest_checkpoint

    old = latest_checkpoint(out / "ckpt", resume=False)  # weights alone are a run's too
    found = [name for name in RUN_FILES if (out / name).exists()]
    if old is None and not found:
        return
    if not overwrite:
        if old is None:  # nothing to resume: --resume would only refuse in turn
            raise _Stop(f"{out} already holds {' and '.join(found)} of a run that saved no "
                        f"checkpoint; start over with --overwrite (replaces them), or "
                        f"choose another --out")
        raise _Stop(f"{out} already holds a run (latest checkpoint {old.name}); continue it "
                    f"with --resume, start over with --overwrite (replaces it), or choose "
                    f"another --out")
    return True


def _replace_old_run(args, out: Path) -> None:
    """Delete the old run --overwrite replaces (its checkpoints; its metrics and plot are
    rewritten by the new run), now that the new one has passed every check and is about
    to start. A Ctrl-C that came before (one an import dropped) stops it here."""
    from ..io import remove_folder
    from ..worker import stop_if_interrupted

    stop_if_interrupted()
    if getattr(args, "replace_old_run", False) and _is_writer():
        # set aside in one step, then deleted: a stop during a long delete left the old
        # run's checkpoints half gone, for the next run to take for damaged ones (_tidy
        # removes a folder set aside)
        remove_folder(out / "ckpt")
        args.replace_old_run = False


def _resume_point(out: Path, required: bool):
    """The newest checkpoint under OUT/ckpt that verifies; the newer, damaged ones are said
    and (by the writer) moved to ckpt/damaged/."""
    from ..train.checkpoint import find_resumable, has_manifest, quarantine, step_of

    step_dir, skipped = find_resumable(out / "ckpt")
    skipped = sorted(skipped + _refuse_newer_weights(out, step_dir), reverse=True,
                     key=lambda s: step_of(s[0]))  # newest first
    for bad, why in skipped:
        where = ""
        if _is_writer():
            where = f"; moved to {quarantine(bad).relative_to(out)}"
        _note(f"{bad} is damaged ({why}){where}")
    if step_dir is not None and skipped:
        _note(f"resuming from {step_dir.name}, the newest checkpoint that verifies")
    if step_dir is not None and not has_manifest(step_dir):
        _note(f"{step_dir} has no manifest.json (saved by an older restopo): it is used "
              f"without checksums")
    if step_dir is None and required:
        what = f"no intact checkpoint (all {len(skipped)} damaged)" if skipped else \
            "no checkpoint"
        held = skipped or any((out / name).exists() for name in RUN_FILES)
        instead = ("start a new run with --overwrite in place of --resume (replaces what is "
                   "there), or choose another --out") if held else \
            "drop --resume to start a new run"
        raise _Stop(f"--resume: {what} in {out / 'ckpt'} to resume from; {instead}")
    return step_dir


def _refuse_newer_weights(out: Path, step_dir) -> list[tuple[Path, str]]:
    """Refuse to resume when a newer checkpoint than `step_dir` holds weights but not the
    optimizer state resuming needs (deleted to save space): training on from an older
    step would replace it at its step, and its steps would be trained again. Those newer
    ones whose weights are damaged too hold nothing to keep: returned, each with why, to be
    passed over as damaged ones are (find_resumable never lists them, so none was said)."""
    from ..train.checkpoint import RESUME_ONLY, check_checkpoint, list_checkpoints

    found = list_checkpoints(out / "ckpt", resume=False)  # oldest first
    whole = list_checkpoints(out / "ckpt")
    newer = [p for p in found[found.index(step_dir) + 1 if step_dir in found else 0:]
             if p not in whole]
    damaged = {p: why for p in newer if (why := check_checkpoint(p, resume=False))}
    newer = [p for p in newer if p not in damaged]

    def lacks(p: Path) -> str:
        return " and ".join(f for f in RESUME_ONLY if not (p / f).exists())

    if not newer:
        return [(p, f"{why}, and it has no {lacks(p)}") for p, why in damaged.items()]
    p = newer[-1]
    gone = lacks(p)
    instead = (f"to resume from {step_dir.name}, the newest checkpoint that has it, move "
               f"{p.name} out of {out / 'ckpt'} first" if step_dir is not None else
               "start a new run in another --out (--overwrite would delete it)")
    raise _Stop(f"--resume: {p} has no {gone}, which resuming needs (the optimizer state, "
                f"the RNG states and data position; restopo eval and export read its weights "
                f"without them); {instead}")


def _load_spec(args, out: Path):
    """The spec and the checkpoint to resume from (runspec.Resumed, or None)."""
    from ..train import runspec
    from ..train.dist import restart_count

    overrides = _overrides(args)
    if args.spec is None:
        if not args.resume:
            raise _Stop("give a SPEC file (or --resume with --out DIR to continue "
                        "a run from its checkpoint)")
        resumed = runspec.Resumed.read(_resume_point(out, required=True))
        # without this run's --set values the run's spec is the checkpoint's own
        spec = runspec.spec_from_meta(resumed.meta, overrides) if overrides else resumed.spec
        _run_seed(spec, resumed, overrides)
        _note_resume(spec, resumed, spec_file=False)
        return spec, resumed
    spec = runspec.load(args.spec, overrides)
    resume = args.resume or restart_count() > 0
    step_dir = _resume_point(out, required=args.resume) if resume else None
    resumed = runspec.Resumed.read(step_dir) if step_dir is not None else None
    kept = _run_seed(spec, resumed, overrides) if resumed is not None else None
    if kept is not None:  # the spec file's seed is not the run's
        spec = runspec.load(args.spec, overrides + (kept,))
    if restart_count() > 0:  # torchrun restarted the workers (--max-restarts): say so
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - restart_count()
        _note(f"restart {restart_count()} after a worker failed ({max(left, 0)} left): "
              + (f"resuming from {step_dir}" if step_dir is not None else
                 "no checkpoint yet, so from the start"))
    if not resume:
        args.replace_old_run = _fresh_start(out, args.overwrite)
    if resumed is not None:
        first = origin = None
        if resumed.meta.get("spec_text") != spec.text:
            then = str(resumed.meta.get("spec_path") or "")
            if _same_file(then, args.spec):
                first = (f"{args.spec} changed since {step_dir} was saved; resuming with the "
                         f"current file")
            else:
                origin = (f"{step_dir} was trained from {then or 'another spec'}, not from "
                          f"{args.spec}")
                first = f"{origin}, whose text differs; resuming with {args.spec}"
        _note_resume(spec, resumed, first=first, origin=origin)
    return spec, resumed


def _run_seed(spec, resumed, overrides) -> str | None:
    """The override that keeps the seed of the run `resumed` goes on (None: `spec` has it
    already). The seed drew the run's first weights and its data order, which
    resuming restores from the checkpoint: another one would change nothing but what the
    run records, so one asked for on this command (`overrides`) is refused."""
    from ..spec.overrides import override_key

    seed, step_dir = (resumed.meta.get("config") or {}).get("seed"), resumed.step_dir
    if type(seed) is not int or seed == spec.train.seed:
        return None
    asked = [o for o in overrides if override_key(o) == "train.seed"]
    if asked:
        shown = getattr(asked[-1], "shown", f"--set {asked[-1]}")
        raise _Stop(f"{step_dir} is a run of seed {seed}: its first weights and data order "
                    f"were drawn from it and resuming restores them, so {shown} would change "
                    f"only what the run records; leave {shown} out to resume it, or train "
                    f"seed {spec.train.seed} as a new run (another --out)")
    return f"train.seed={seed}"


def _same_file(a: str, b: str) -> bool:
    """Whether two spec paths name one file (the checkpoint's may be from another cwd)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _note_resume(spec, resumed, spec_file: bool = True,
                 first: str | None = None, origin: str | None = None) -> None:
    """The notes on resuming `spec` from the checkpoint `resumed`, `first` (if any) before
    them; none when resume_notes refuses it (a note saying 'resuming with' then
    an error said no): the refusal then carries `origin`, the spec file the run was trained
    from."""
    from ..train import runspec
    from ..train.checkpoint import CheckpointError
    try:
        notes = runspec.resume_notes(spec, resumed, spec_file=spec_file)
    except CheckpointError as e:
        if origin is None:
            raise
        raise CheckpointError(f"{e} ({origin})") from None
    for note in ([first] if first else []) + notes:
        _note(note)


def _run(args) -> int:
    from ..train.dist import under_torchrun
    from ..train.runlock import run_lock

    out = _out_folder(args)
    if not _is_writer():
        return _train(args, out)
    with run_lock(out):  # held until the run ends: one run per folder
        _tidy(out)
        if args.nproc is not None and not under_torchrun():
            return _launch(args, out)
        return _train(args, out)


def _launch(args, out: Path) -> int:
    """--nproc N: check the spec and data once, here, then run N workers under torchrun,
    handing them this process's lock on the run folder."""
    from ..train import dist, runspec
    from ..train.runlock import hand_down

    spec, resumed = _load_spec(args, out)  # bad specs and data fail here, once, not per rank
    if spec.model is None:
        return _fail(f"{spec.path} has no model section; training needs one")
    _note_schedule(spec)
    _layout(args, spec, args.nproc)  # so do layouts that cannot run
    try:
        dist.dist_timeout()  # and a timeout each worker would refuse
    except RuntimeError as e:
        raise _Stop(str(e)) from None
    corpus = runspec.open_data(spec, progress=not args.no_progress, resuming=args.resume)
    _note_data(spec, corpus, resumed)
    _replace_old_run(args, out)  # every check passed here; the workers find it gone
    return dist.launch(_worker_argv(args), args.nproc, args.max_restarts,
                       env={**hand_down(out), NOTES_SAID: "1"}, checkpoints=out / "ckpt")


def _note_data(spec, corpus, resumed) -> None:
    """The note when a resumed run's data changed since its checkpoint (runspec.data_note)."""
    if resumed is not None:
        from ..train import runspec
        note = runspec.data_note(spec, corpus, resumed)
        if note:
            _note(note)


def _layout(args, spec, world: int):
    """The run's layout over `world` processes, checked against the spec (LayoutError)."""
    from ..train import layout

    chosen = layout.resolve(args.pipeline, spec.parallel, world)
    layout.check_layout(spec, chosen, "--nproc" if args.nproc or world == 1 else None)
    p = spec.parallel
    if world == 1 and args.pipeline is None and p is not None and p.sharded:
        # resolve sets the section aside for one process: say so
        # name what asked for it: --data is a flag, not the spec's section
        flag = args.data_parallel == "fsdp"
        what = ", ".join([f"pipeline {p.stages}x{p.virtual}"] * p.pipelined
                         + ["FSDP"] * (p.data == "fsdp" and not flag))
        asked = ([f"the spec's parallel section ({what})"] * bool(what)
                 + ["--data fsdp"] * flag)
        _note(f"{' and '.join(asked)} {'are' if len(asked) > 1 else 'is'} for several "
              f"processes; this run of one trains the whole model in one process (--nproc "
              f"{max(p.stages, 2)} runs {'them' if len(asked) > 1 else 'it'})")
    if chosen.pipeline is not None and chosen.replicas == 1 and chosen.data == "fsdp":
        # FSDP shards over the replicas of each stage: a pipeline as wide as the run has one
        what = ("--data fsdp" if args.data_parallel == "fsdp" else
                "the spec's parallel section (data: fsdp)")
        _note(f"{what} shards each stage over its data-parallel replicas, and pipeline "
              f"{chosen.pipeline.stages}x{chosen.pipeline.virtual} on {world} processes "
              f"leaves one: nothing is sharded (--nproc {2 * world} gives each stage 2)")
    if chosen.pipeline is not None and spec.train.accum > 1:  # PipelinedStep.accum is 1
        micro = chosen.pipeline.microbatches or chosen.pipeline.stages
        _note(f"train.accum ({spec.train.accum}) is set aside in a pipeline: its {micro} "
              f"microbatches split each step's rows instead (parallel microbatches sets them)")
    return chosen


def _note_schedule(spec) -> None:
    """Say what the run's learning-rate schedule leaves unused, which went unsaid. Not spec
    errors: a --set or --vary of the schedule alone tries a constant rate on a spec whose
    cosine ends at min_lr, and checkpoints of such specs must still load."""
    from ..spec.nodes import from_command_line

    t = spec.train
    if t.schedule == "constant" and t.min_lr is not None:
        _note(f"train.min_lr ({t.min_lr:g}) is unused: it is where the cosine schedule ends, "
              f"and schedule: constant keeps lr ({t.lr:g}) after warmup")
    # the file's steps below the default warmup: the run never leaves it (a written warmup
    # is checked against steps; a --steps for a quick try stays in warmup, as meant)
    given = dict(t.positions)
    if ("warmup" not in given and "steps" in given and t.warmup > t.steps
            and not from_command_line(given["steps"].source)):
        _note(f"train.steps ({t.steps}) is shorter than the default warmup ({t.warmup}): the "
              f"whole run warms up and never reaches lr ({t.lr:g}); set train.warmup")


def _note_unfused(spec, backend: str, device) -> None:
    """Say which aggregation points run on the eager reference though the run's backend is
    a fused one (the sigmoid gate, input-dependent queries, triton's depth heads): their
    speed is not the kernels', and nothing said so."""
    import torch

    from .. import ops
    if spec.train.compile != "off":  # traced: inductor fuses the eager forms of such points
        return                         # (regional compiles every region the kernels leave)
    picked = ops.picked_for(backend, torch.device(device), torch.float32)
    slow = ops.unfused_points(spec.ir(), picked)
    if slow:
        what = ", ".join(f"{n} with {why}" for why, n in slow.items())
        _note(f"{sum(slow.values())} aggregation points run on the eager reference, unfused "
              f"({what}): the {picked} kernels do not cover them (same results, slower)")


def _train(args, out: Path) -> int:
    from ..train import dist, layout, runspec
    from ..train.data import DataError
    from ..nn.flops import flops_per_token
    from ..train.loop import TrainConfig, train
    from ..train.throughput import Throughput

    if args.nproc is not None and args.nproc != int(os.environ["WORLD_SIZE"]):
        return _fail("--nproc was given inside a torchrun job; run either torchrun or --nproc")

    spec, resumed = _load_spec(args, out)
    step_dir = resumed.step_dir if resumed is not None else None
    if spec.model is None:
        return _fail(f"{spec.path} has no model section; training needs one")
    _note_schedule(spec)
    chosen = _layout(args, spec, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        ctx = dist.setup(args.device)
    except RuntimeError as e:
        return _fail(str(e))
    try:
        if spec.train.compile != "off":
            from ..train.compile import check_compile

            check_compile(ctx.device, spec.train.compile, chosen, spec.train.recompute)
        if not ctx.is_main:
            dist.barrier(ctx)  # rank 0 prepares the cached corpus first
        corpus = runspec.open_data(spec, progress=ctx.is_main and not args.no_progress,
                                   resuming=args.resume)
        if ctx.is_main:
            dist.barrier(ctx)
        _note_data(spec, corpus, resumed)
        try:  # whole, or this process's share of it (restopo.train.layout)
            model, stepper = layout.build(spec, chosen, ctx, args.backend)
        except RuntimeError as e:  # a backend that cannot run here says why
            raise _Stop(str(e)) from None
        compiled = 0
        if spec.train.compile != "off":
            from ..train.compile import compile_model

            compiled = compile_model(model, stepper, spec.train.compile)
        cfg = TrainConfig.from_spec(spec.train, spec.model.context)
        if ctx.is_main:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"restopo train: {spec.path} ({spec.topology.name}, {n_params:,} parameters) "
                  f"on {corpus.description}; {counted(cfg.steps, 'step')} x {cfg.batch:,} x "
                  f"{counted(cfg.context, 'token')}, {chosen.describe()} on {ctx.device}"
                  + (f"; resuming from {step_dir}" if step_dir else ""), file=sys.stderr)
            _note_unfused(spec, args.backend, ctx.device)
        _replace_old_run(args, out)  # the layout, compile, data and model are ready
        try:
            summary = train(model, corpus, cfg, out, ctx,
                            meta=runspec.run_meta(spec, runspec.data_base(spec), corpus),
                            resume_from=step_dir, progress=not args.no_progress,
                            stepper=stepper,
                            throughput=Throughput.of(flops_per_token(spec.ir(), spec.model).train,
                                                     ctx.device, ctx.world,
                                                     spec.train.peak_tflops),
                            compiled=compiled)
        except DataError as e:
            raise spec.error(*e.where, str(e)) from None
    finally:
        dist.cleanup(ctx)
    if ctx.is_main:
        loss, val = summary["loss"], summary["val_loss"]
        seconds, first = summary["seconds"], summary.get("from_step", 0) + 1
        took = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
        if first > 1:  # this command's time, not the run's: say for which steps
            took = (f"steps {first:,} to {summary['steps']:,} in {took}"
                    if first <= summary["steps"] else "no step trained")
        print(f"done: {counted(summary['steps'], 'step')}"
              + (f", loss {loss:.4f}" if loss is not None else "")
              + (f", val loss {val:.4f}" if val is not None else "")
              + f" ({took})")
        print(f"  metrics     {summary['metrics']}")
        print(f"  loss plot   {summary['plot']}")
        print(f"  checkpoint  {summary['checkpoint'] or 'none'}")
    return 0
