"""`restopo train SPEC`: train the spec's model on its data, with checkpoints and plots."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXAMPLES = """\
examples:
  restopo train examples/tiny.restopo
  restopo train examples/tiny.restopo --set model.width=128 --set train.lr=1e-3 --out runs/w128
  restopo train examples/tiny.restopo --steps 50 --out runs/quick
  restopo train examples/tiny.restopo --out runs/quick --resume     # continue from latest
  restopo train --resume --out runs/quick --steps 400                # spec from the checkpoint
  restopo train examples/tiny.restopo --nproc 2                      # 2 processes via torchrun
  torchrun --nproc_per_node 2 -m restopo train examples/tiny.restopo

`batch` is the global batch of one optimizer step: with --nproc N each process takes
batch/N rows of it, so the numbers match a 1-process run. Data: `data:` in the spec's train
section (builtin:stdlib, a text file or folder, or a nanoGPT-style uint16 .bin).
Writes OUT/metrics.jsonl, OUT/loss.png and OUT/ckpt/step_NNNNNN/ (safetensors weights).
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a spec's model (checkpoints, metrics, loss plot)",
        description="Train the model a .restopo spec describes, on the spec's train data.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", metavar="SPEC",
                   help="the .restopo file (optional with --resume: the checkpoint has it)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec value, e.g. --set model.width=64 (repeatable)")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<spec name>)")
    p.add_argument("--steps", type=int, metavar="N", help="same as --set train.steps=N")
    p.add_argument("--seed", type=int, metavar="N", help="same as --set train.seed=N")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", choices=("auto", "eager", "triton"), default="auto",
                   help="aggregation kernels (default: triton on CUDA when available)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in OUT/ckpt")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an OUT that holds an earlier run's checkpoints "
                        "(they are deleted)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="launch N processes through torchrun (data parallel)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="with --nproc: let torchrun restart a failed job R times (each "
                        "restart resumes from the latest checkpoint)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads per process (default: $OMP_NUM_THREADS, else 1: the "
                        "small models trained on CPU gain little from more threads and slow "
                        "down badly when the cores are shared)")
    p.add_argument("--pipeline", metavar="PxV",  # -- pipeline parallel (backends/pipeline) --
                   help="pipeline parallel: P stages x V virtual stages (needs a multiple "
                        "of P processes: --nproc P, or torchrun); the spec's parallel "
                        "section gives schedule, microbatches and cache")
    p.set_defaults(func=run)


class _Stop(Exception):
    """A user mistake found while setting up the run (printed as one line, exit 1)."""


def _fail(message: str) -> int:
    print(f"restopo train: error: {message}", file=sys.stderr)
    return 1


def _overrides(args) -> tuple[str, ...]:
    extra = []
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.seed is not None:
        extra.append(f"train.seed={args.seed}")
    return tuple(args.overrides) + tuple(extra)


def _worker_argv(args) -> list[str]:
    """The same command for each torchrun worker, without --nproc."""
    argv = ["train"]
    if args.spec:
        argv.append(args.spec)
    for o in args.overrides:
        argv += ["--set", o]
    for flag, value in (("--out", args.out), ("--steps", args.steps), ("--seed", args.seed)):
        if value is not None:
            argv += [flag, str(value)]
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
    from ..train.data import DataError
    from ..train.dist import cpu_threads
    from ..train.loop import TrainingError
    PlanError = get_backend("pipeline").PlanError

    if args.threads is not None and args.threads < 1:
        return _fail("--threads must be at least 1")
    try:
        with cpu_threads(args.threads):
            return _run(args)
    except (DataError, CheckpointError, TrainingError, PlanError, _Stop) as e:
        return _fail(str(e))


def _fresh_start(out: Path, overwrite: bool) -> None:
    """A new run must not mix with an old one's checkpoints (resume would pick theirs)."""
    import shutil

    from ..train.checkpoint import latest_checkpoint

    old = latest_checkpoint(out / "ckpt")
    if old is None:
        return
    if not overwrite:
        raise _Stop(f"{out} already holds a run (latest checkpoint {old.name}); continue it "
                    f"with --resume, start over with --overwrite, or choose another --out")
    if os.environ.get("RANK", "0") == "0":
        shutil.rmtree(out / "ckpt", ignore_errors=True)


def _load_spec(args, out: Path | None):
    """The spec and the checkpoint to resume from (or None)."""
    from ..train import runspec
    from ..train.checkpoint import latest_checkpoint, read_meta
    from ..train.dist import restart_count

    overrides = _overrides(args)
    if args.spec is None:
        if not (args.resume and out is not None):
            raise _Stop("give a SPEC file (or --resume with --out DIR to continue "
                        "a run from its checkpoint)")
        step_dir = latest_checkpoint(out / "ckpt")
        if step_dir is None:
            raise _Stop(f"nothing to resume: no checkpoint in {out / 'ckpt'}")
        spec = runspec.spec_from_meta(read_meta(step_dir), overrides)
        _note_resume(spec, step_dir)
        return spec, step_dir
    spec = runspec.load(args.spec, overrides)
    out = out or Path("runs") / Path(args.spec).stem
    resume = args.resume or restart_count() > 0
    step_dir = latest_checkpoint(out / "ckpt") if resume else None
    if args.resume and step_dir is None:
        raise _Stop(f"--resume: no checkpoint in {out / 'ckpt'} to resume from; "
                    f"drop --resume to start a new run")
    if not resume:
        _fresh_start(out, args.overwrite)
    if step_dir is not None:
        old = read_meta(step_dir)
        if old.get("spec_text") != spec.text:
            print(f"restopo train: note: {args.spec} changed since {step_dir} was saved; "
                  f"resuming with the current file", file=sys.stderr)
        _note_resume(spec, step_dir)
    return spec, step_dir


def _note_resume(spec, step_dir) -> None:
    from ..train import runspec
    from ..train.checkpoint import read_meta
    for note in runspec.resume_notes(spec, read_meta(step_dir), step_dir):
        print(f"restopo train: note: {note}", file=sys.stderr)


def _run(args) -> int:
    from ..registry import get_backend
    from ..train import dist, runspec
    from ..train.data import DataError
    from ..train.loop import TrainConfig, train

    out = Path(args.out) if args.out else None
    if args.nproc is not None and not dist.under_torchrun():
        if args.nproc < 1:
            return _fail("--nproc must be at least 1")
        spec, _ = _load_spec(args, out)  # bad specs and data fail here, once, not per rank
        if spec.model is None:
            return _fail(f"{spec.path} has no model section; training needs one")
        runspec.open_data(spec, progress=not args.no_progress)
        return dist.launch(_worker_argv(args), args.nproc, args.max_restarts)
    if args.nproc is not None and args.nproc != int(os.environ["WORLD_SIZE"]):
        return _fail("--nproc was given inside a torchrun job; run either torchrun or --nproc")

    spec, step_dir = _load_spec(args, out)
    if spec.model is None:
        return _fail(f"{spec.path} has no model section; training needs one")
    out = out or Path("runs") / Path(str(spec.path)).stem
    try:
        ctx = dist.setup(args.device)
    except RuntimeError as e:
        return _fail(str(e))
    try:
        if not ctx.is_main:
            dist.barrier(ctx)  # rank 0 prepares the cached corpus first
        corpus = runspec.open_data(spec, progress=ctx.is_main and not args.no_progress)
        if ctx.is_main:
            dist.barrier(ctx)
        try:
            model = runspec.build_model(spec, args.backend)
        except RuntimeError as e:  # a backend that cannot run here says why
            raise _Stop(str(e)) from None
        cfg = TrainConfig.from_spec(spec.train, spec.model.context)
        if ctx.is_main:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"restopo train: {spec.path} ({spec.topology.name}, {n_params:,} parameters) "
                  f"on {corpus.description}; {cfg.steps} steps x {cfg.batch} x "
                  f"{cfg.context} tokens, {ctx.world} process(es) on {ctx.device}"
                  + (f"; resuming from {step_dir}" if step_dir else ""), file=sys.stderr)
        pipeline_backend = get_backend("pipeline")
        PipelineConfig, PipelinedStep = (pipeline_backend.PipelineConfig,
                                         pipeline_backend.PipelinedStep)
        # --pipeline, or the spec's parallel section when several processes run
        pipeline = PipelineConfig.resolve(args.pipeline, spec.parallel if ctx.distributed
                                          or args.pipeline else None)
        stepper = None  # the loop's default: data parallel
        if pipeline is not None:
            stepper = PipelinedStep(model.to(ctx.device), pipeline, ctx, cfg.batch)
        try:
            summary = train(model, corpus, cfg, out, ctx,
                            meta=runspec.run_meta(spec, runspec.data_base(spec)),
                            resume_from=step_dir, progress=not args.no_progress,
                            stepper=stepper)
        except DataError as e:
            raise spec.error(*e.where, str(e)) from None
    finally:
        dist.cleanup(ctx)
    if ctx.is_main:
        loss, val = summary["loss"], summary["val_loss"]
        print(f"done: {summary['steps']} steps"
              + (f", loss {loss:.4f}" if loss is not None else "")
              + (f", val loss {val:.4f}" if val is not None else "")
              + f" ({summary['seconds']:.0f} s)")
        print(f"  metrics     {summary['metrics']}")
        print(f"  loss plot   {summary['plot']}")
        print(f"  checkpoint  {summary['checkpoint']}")
    return 0
