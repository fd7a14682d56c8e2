"""Training through the pipeline: the training loop's Stepper (restopo/train/stepper.py)
over pipeline stages.

`PipelineConfig` says how to pipeline (from `--pipeline PxV` or the spec's `parallel`
section); `PipelinedStep(model, config, ctx, batch)` is built inside each torchrun worker
(by `restopo train`) and handed to the loop, which it gives:
  data_rank, data_world  which rows of the batch this process feeds (its replica's)
  step(x, y)             forward + backward of one batch through the schedule -> mean loss
                         (the schedule's microbatches replace gradient accumulation)
  clip_grad_norm_(c)     clipping by the norm over the whole model (all stages)
  before_save(opt)       every parameter and its AdamW state broadcast from the stage that
                         trains it, so rank 0 holds the whole model for the checkpoint (a
                         single-process run loads it as it is)
  before_eval()          the same for the parameters, so every rank evaluates the whole,
                         current model

Every process holds the whole model and the loop's usual AdamW over all of it; a parameter
only gets a gradient (hence an update) on the stage that owns it, so AdamW skips the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import PlanError, make_plan, model_costs, parse_pv
from .runtime import SCHEDULES, Groups, Pipeline


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
        cached = parallel.cache if parallel is not None else True
        return cls(stages, virtual, schedule, micro, cached)


class PipelinedStep:
    def __init__(self, model, config: PipelineConfig, ctx, batch: int, model_spec=None):
        if not dist.is_initialized() or dist.get_world_size() % config.stages:
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise PlanError(f"--pipeline {config.stages}x{config.virtual} needs a multiple of "
                            f"{config.stages} processes; this run has {world} (launch with "
                            f"--nproc {config.stages}, or torchrun --nproc_per_node "
                            f"{config.stages})")
        self.groups = Groups(config.stages)
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
        costs = head = None
        if model_spec is None and getattr(model, "restopo_spec", None) is not None:
            model_spec = model.restopo_spec.model
        if model_spec is not None:
            costs, head = model_costs(model_spec), float(model_spec.vocab * model_spec.width)
        self.plan = make_plan(g, config.stages, config.virtual, costs=costs,
                              head_cost=head or 0.0)
        device = ctx.device
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self.pipe = Pipeline(model, self.plan, schedule=config.schedule, n_microbatches=micro,
                             cached=config.cached, device=device, groups=self.groups)
        self.model = model
        # The stage that trains each parameter: the lowest pipeline rank that holds it.
        self.owner = {}
        from restopo.fx.lower import aggregation_modules, parts_of
        from .stage import build_chunks
        for r in range(config.stages):
            for m in build_chunks(self.plan, g, parts_of(model), aggregation_modules(model), r):
                for p in m.parameters():
                    self.owner.setdefault(id(p), r)
        self._src = {r: self.groups.pp_ranks[r] for r in range(config.stages)}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.pipe.step(x, y)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so the whole model's gradient norm is at most max_norm (each
        parameter counted once, on its owner), as torch.nn.utils.clip_grad_norm_ does in one
        process. Returns the total norm."""
        me = self.groups.stage
        sq = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        mine = [p for p in self.model.parameters() if self.owner.get(id(p)) == me]
        for p in mine:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum().to(self.comm_device)
        dist.all_reduce(sq, group=self.groups.pp)
        total = sq.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in self.pipe.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    def before_save(self, optimizer) -> None:
        self._sync(optimizer)

    def before_eval(self) -> None:
        self._sync()

    @torch.no_grad()
    def _sync(self, optimizer=None) -> None:
        """Broadcast each parameter (and its AdamW state) from the stage that trains it."""
        for p in self.model.parameters():
            src = self._src[self.owner[id(p)]]
            self._bcast(p.data, src)
            if optimizer is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                self._bcast(state[key], src)

    def _bcast(self, t: torch.Tensor, src: int) -> None:
        buf = t.detach().to(self.comm_device).contiguous().clone()
        dist.broadcast(buf, src=src, group=self.groups.pp)
        t.copy_(buf.to(t.device))
