"""Training through the pipeline: the training loop's Stepper (restopo/train/stepper.py)
over pipeline stages.

`PipelineConfig` says how to pipeline (from `--pipeline PxV` or the spec's `parallel`
section); `PipelinedStep(model, config, ctx, batch)` is built inside each torchrun worker
(by restopo.train.layout) from a model built on the meta device, and handed to the loop:
  data_rank, data_world  which rows of the batch this process feeds (its replica's)
  trained                this process's chunks: the loop's AdamW covers only them
  step(x, y)             forward + backward of one batch through the schedule -> mean loss
                         (the schedule's microbatches replace gradient accumulation)
  clip_grad_norm_(c)     clipping by the norm over the whole model (all stages)
  evaluate(batches)      validation loss, forward only through the schedule
  held(), saved()        what this process loads and writes of a sharded checkpoint

A process materialises only the units of its own chunks (restopo.nn.init: each from a
generator seeded by (seed, unit name), so the weights are those of one process), and keeps
gradients and AdamW state only for them. Across pipeline replicas the chunks are either
replicated (gradients averaged) or FSDP-sharded by `shard` (restopo.train.layout passes it:
this backend does not import the training layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import PlanError, make_plan, model_costs, parse_pv
from .runtime import SCHEDULES, Groups, Pipeline
from .stage import chunk_units
from restopo.nn.init import reshard_units


@dataclass(frozen=True)
class PipelineConfig:
    stages: int
    virtual: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None  # None: one per stage
    cached: bool = True

    @classmethod
    def resolve(cls, pv: str | None, parallel=None) -> "PipelineConfig | None":
        """From `--pipeline PxV` (wins) and/or the spec's parallel section; None when neither
        asks for more than one stage."""
        if pv is None and (parallel is None or parallel.stages * parallel.virtual <= 1):
            return None
        if pv is not None:
            stages, virtual = parse_pv(pv)
        else:
            stages, virtual = parallel.stages, parallel.virtual
        if stages < 2:
            raise PlanError(f"a pipeline needs at least 2 stages; got {stages}x{virtual}")
        schedule = parallel.schedule if parallel is not None else "1f1b"
        if schedule not in SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {schedule!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
        micro = parallel.microbatches if parallel is not None and parallel.microbatches > 1 \
            else None
        if pv is not None and micro is not None and micro < stages:
            # the spec's check held its microbatches against its own stages, not these
            raise PlanError(f"--pipeline {stages}x{virtual} has more stages than the spec's "
                            f"parallel microbatches ({micro}), so some would sit idle; add "
                            f"--set parallel.microbatches={stages} (or more)")
        cached = parallel.cache if parallel is not None else True
        return cls(stages, virtual, schedule, micro, cached)


class PipelinedStep:
    """The loop's Stepper over this process's pipeline stages (see the module docstring)."""

    sharded, whole = True, False
    accum = 1  # the schedule's microbatches split the rows instead of train.accum

    def __init__(self, model, config: PipelineConfig, ctx, batch: int, model_spec=None, *,
                 shard=None):
        if not dist.is_initialized() or dist.get_world_size() % config.stages:
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise PlanError(f"--pipeline {config.stages}x{config.virtual} needs a multiple of "
                            f"{config.stages} processes; this run has {world} (launch with "
                            f"--nproc {config.stages}, or torchrun --nproc_per_node "
                            f"{config.stages})")
        device = ctx.device
        self.ctx = ctx
        self.groups = Groups(config.stages, device.type)
        self.data_rank, self.data_world = self.groups.replica, self.groups.replicas
        if batch % self.data_world:
            raise PlanError(f"train.batch ({batch}) must split evenly over "
                            f"{self.data_world} pipeline replicas")
        rows = batch // self.data_world
        micro = config.microbatches or config.stages
        if rows % micro:
            raise PlanError(f"each pipeline takes {rows} rows per step, which do not split "
                            f"into {micro} microbatches; set parallel microbatches (or "
                            f"train.batch) so that it divides")
        g = model.restopo_ir
        if model_spec is None and getattr(model, "restopo_spec", None) is not None:
            model_spec = model.restopo_spec.model
        self.plan = make_plan(g, config.stages, config.virtual,
                              **(model_costs(model_spec, g) if model_spec is not None else {}))
        fsdp = shard is not None and self.groups.replicas > 1
        data = "fsdp" if fsdp else "ddp"
        self.layout = (f"pipeline {config.stages}x{config.virtual}"
                       + (f", data {data}" if self.groups.replicas > 1 else "")
                       + f" ({dist.get_world_size()} processes)")
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # `shard(chunk, [(unit, module)], dp_mesh, init, model)` FSDP-shards one chunk
        self.pipe = Pipeline(model, self.plan, schedule=config.schedule, n_microbatches=micro,
                             cached=config.cached, device=device, groups=self.groups,
                             dtype=dtype, replicated=not fsdp)
        self.model = model
        self._materialize(shard if fsdp else None)
        self.trained = torch.nn.ModuleList(self.pipe.chunks)
        # Each parameter is saved (and counted in the gradient norm) by one process: the
        # lowest stage that holds it, in the first replica unless FSDP shards it over all.
        from restopo.nn.init import unit_of
        owner = {}
        for r in range(config.stages):
            for u in chunk_units(self.plan, r):
                owner.setdefault(u, r)
        self._saved = [(n, p) for n, p in self.held()
                       if owner.get(unit_of(n, owner)) == self.groups.stage
                       and (self.groups.replica == 0 or (fsdp and hasattr(p, "to_local")))]

    def _materialize(self, shard) -> None:
        """Make this rank's units real (restopo.nn.init), each from its seeded generator,
        and with FSDP shard them unit by unit over the replicas (`shard`, from the caller:
        restopo.train.layout), so no process ever holds the whole model."""
        from restopo.nn.init import materialize, retie

        init, device = getattr(self.model, "restopo_init", None), self.ctx.device
        if init is None or not init.meta:  # built whole: every process keeps all of it
            self.model.to(device)
            return
        if getattr(self.model, "context", None) is not None:
            self.model.context.to(device)
        units = chunk_units(self.plan, self.groups.stage)
        if shard is None:
            materialize(self.model, init, units, device)
            return
        # FSDP: every sublayer (and an untied embedding or head) is a unit of its own, made
        # real just before it is sharded; the rest goes with its chunk's root unit.
        own = ("sublayers.",) if init.ties else ("sublayers.", "embed", "head")
        materialize(self.model, init, [u for u in units if not u.startswith(own)], device)
        for m in self.pipe.chunks:
            mine = [(f"sublayers.{int(k) - 1}", s) for k, s in m.sublayers.items()]
            if not init.ties:
                mine = [("embed", m.embed)] * (m.embed is not None) + mine \
                    + [("head", m.head)] * (m.head is not None)
            shard(m, mine, self.groups.dp_mesh, init, self.model)
        retie(self.model, init, units)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.pipe.step(x, y)

    def held(self):
        return self.pipe.named_parameters()

    def saved(self):
        return list(self._saved)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the whole model's gradient norm is at most max_norm (each
        entry counted once: by the process that saves it), as torch.nn.utils.clip_grad_norm_
        does in one process. Returns the total norm."""
        sq = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        for _, p in self._saved:
            if p.grad is not None:
                sq += _local(p.grad).detach().double().pow(2).sum().to(self.comm_device)
        dist.all_reduce(sq)
        total = sq.sqrt()
        coef = min(1.0, max_norm / (total.item() + 1e-6))
        for p in self.pipe.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        return total

    def evaluate(self, batches) -> float:
        """Mean validation loss, forward only through the pipeline schedule (each process
        runs its own chunks), averaged over the replicas."""
        total = 0.0
        was = self.model.training
        self.model.eval()
        for x, y in batches:
            total += self.pipe.evaluate(x, y).item()
        self.model.train(was)
        reshard_units(self.trained)  # FSDP keeps a chunk's root unit whole after a forward
        t = torch.tensor([total / len(batches)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)
