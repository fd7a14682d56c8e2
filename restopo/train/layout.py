"""How a run lays the model over its processes, and the Stepper that does it.

A layout is a pipeline (P stages x V virtual stages, from `--pipeline PxV` or the spec's
`parallel` section) or none, times a data-parallel engine across the rest of the processes
(`parallel { data: ddp | fsdp }`): world = P x replicas, on a 2-D mesh (replica, stage).

  layout                      each process holds               stepper
  1 process, or ddp           the whole model                  DataParallelStep
  fsdp                        1/N of every unit                fsdp.FSDPStep
  pipeline                    its chunks only                  PipelinedStep
  pipeline x fsdp             1/replicas of its chunks         PipelinedStep + FSDP shards

`check_layout` says in one line why a layout cannot run (it is called by the launcher before
any process starts, and by every worker, where rank 0 says it); `build` makes the model as
the layout needs it (whole, or on the meta device with each process materialising its own
share, restopo.nn.init) and its Stepper.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..registry import get_backend
from ..spec.combos import recompute_conflict, said
from ..words import counted


class LayoutError(ValueError):
    """A layout that cannot run (the message names the value and what would work)."""


@dataclass(frozen=True)
class Layout:
    world: int
    pipeline: object | None = None  # restopo.backends.pipeline.PipelineConfig
    data: str = "ddp"

    @property
    def stages(self) -> int:
        return self.pipeline.stages if self.pipeline is not None else 1

    @property
    def replicas(self) -> int:
        return self.world // self.stages

    @property
    def whole(self) -> bool:
        """Each process builds and steps the whole model: one process, or DDP replicas
        (no pipeline stages, no FSDP shards)."""
        return self.pipeline is None and (self.data == "ddp" or self.world == 1)

    def describe(self) -> str:
        if self.world == 1 and self.pipeline is None:
            return "1 process"
        parts = []
        if self.pipeline is not None:
            parts.append(f"pipeline {self.pipeline.stages}x{self.pipeline.virtual}")
        if self.replicas > 1 or not parts:
            parts.append(f"data {self.data}")
        return ", ".join(parts) + f" ({counted(self.world, 'process', 'processes')})"


def resolve(pv: str | None, parallel, world: int) -> Layout:
    """The layout of a run of `world` processes: `--pipeline PxV` (wins over the spec's
    stages) and the spec's parallel section (None: no section). The section is ignored by
    a single process that was not given --pipeline, as before."""
    pipeline_backend = get_backend("pipeline")
    if world == 1 and pv is None:
        parallel = None
    try:
        pipeline = pipeline_backend.PipelineConfig.resolve(pv, parallel)
    except pipeline_backend.PlanError as e:
        raise LayoutError(str(e)) from None
    data = parallel.data if parallel is not None else "ddp"
    return Layout(world, pipeline, data)


def check_layout(spec, layout: Layout, flag: str | None = "--nproc") -> None:
    """Raise LayoutError, in one line naming the value and what would work, when `spec`'s
    model and train section cannot run in `layout`. `flag`: how the person sets the number
    of processes (None: under torchrun, its own options)."""
    train, L = spec.train, spec.ir().n_sublayers
    batch, accum, world = train.batch, train.accum, layout.world
    p = layout.pipeline
    if p is not None:
        chunks = p.stages * p.virtual
        if chunks > L:
            fits = [f"{s}x{v}" for s in (2, 4, 8) for v in (1, 2) if s * v <= L][-2:]
            raise LayoutError(
                f"--pipeline {p.stages}x{p.virtual} needs {chunks} chunks but the model has "
                f"{L} sublayers; use at most {L} chunks (stages x virtual)"
                + (f", e.g. --pipeline {' or '.join(fits)}" if fits else ""))
        if world % p.stages:
            raise LayoutError(
                f"--pipeline {p.stages}x{p.virtual} needs a multiple of {p.stages} processes; "
                f"this run has {world} ("
                + (f"use {flag} {p.stages}" if flag else f"run {p.stages} processes")
                + (f" or {2 * p.stages}" if world > p.stages else "") + ")")
    why = recompute_conflict(train.recompute, pipeline=p is not None)
    if why is not None:
        raise LayoutError(said(why))
    replicas = world // layout.stages
    if batch % replicas:
        what = "FSDP processes" if layout.data == "fsdp" else "data-parallel replicas"
        raise LayoutError(
            f"train.batch ({batch}) does not split over {replicas} {what}; use a multiple of "
            f"{replicas} (e.g. {_multiple(batch, replicas)})")
    rows = batch // replicas
    if p is not None:
        micro = p.microbatches or p.stages
        if rows % micro:
            raise LayoutError(
                f"each pipeline takes {rows} rows of train.batch ({batch}) per step, which do "
                f"not split into {micro} microbatches; use a train.batch that is a multiple "
                f"of {replicas * micro} (e.g. {_multiple(batch, replicas * micro)})")
    elif rows % accum:
        raise LayoutError(
            f"train.batch ({batch}) must split evenly over "
            f"{counted(world, 'process', 'processes')} x "
            f"{counted(accum, 'accumulation step')}; use a multiple of {world * accum} "
            f"(e.g. {_multiple(batch, world * accum)})")


def _multiple(n: int, k: int) -> int:
    return max(k, (n + k - 1) // k * k)


def build(spec, layout: Layout, ctx, backend: str = "auto"):
    """(model, stepper) for `layout` in this process; the stepper is None for the loop's
    default (one process or DDP over whole models)."""
    from ..fx.recompute import apply as recompute
    from .runspec import build_model

    # recompute first: DDP, FSDP and the pipeline's chunks wrap the modules it set up
    if layout.whole:
        return recompute(build_model(spec, backend), spec.train.recompute), None
    model = recompute(build_model(spec, backend, meta=True), spec.train.recompute)
    if layout.pipeline is None:
        from .fsdp import FSDPStep

        return model, FSDPStep(model, ctx, spec.train.accum)
    shard = None
    if layout.data == "fsdp" and layout.replicas > 1:
        from .fsdp import shard_units

        def shard(chunk, units, mesh, init, full):
            shard_units(chunk, mesh, units, init=init, full=full, device=ctx.device)

    stepper = get_backend("pipeline").PipelinedStep(
        model, layout.pipeline, ctx, spec.train.batch, model_spec=spec.model, shard=shard)
    return model, stepper
