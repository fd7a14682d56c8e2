"""Data parallel that divides memory: FSDP2 (torch.distributed.fsdp.fully_shard).

Applied as torchtitan applies it, by a small function over the plain model: one FSDP unit
per sublayer, one for the embedding and one for the head, and the root's unit for the rest
(aggregations, norms of the head aggregation). Each process keeps 1/N of every weight, of
its gradient and of its AdamW state (dimension 0 split over the data-parallel processes);
a unit's weights are gathered just before it runs and freed after.

Two things stay in the root's unit or out of FSDP:
- a tied LM head reads the embedding matrix: embedding and head then share the root's unit,
  which holds the one matrix once (two units cannot own one parameter);
- FSDP2 cannot shard a scalar parameter (ReZero's alpha, Hyper-Connections' s_alpha...),
  and a unit's parameter that the graph reads outside the unit (a PreNorm gain fused into
  phase 2) would not be gathered when read: both stay whole in every process and their
  gradients are averaged here.
The aggregation modules stay in the root's unit because a two-phase group (TwoPhase) reads
its members' pseudo-queries without calling them.

`FSDPStep` is the loop's Stepper over such a model; `shard_units` is also what a pipeline
applies to its own chunks (pipeline x FSDP on a 2-D mesh, restopo.train.layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..nn.init import Init, materialize, reshard_units, retie
from .dist import DistContext
from .stepper import autocast, evaluate, lm_loss


def scalars(module: nn.Module) -> set[nn.Parameter]:
    """The parameters FSDP2 cannot shard (zero-dimensional)."""
    return {p for p in module.parameters() if p.dim() == 0}


def borrowed(root: nn.Module, units: list[tuple[str, nn.Module]]) -> set[str]:
    """Names of the parameters of a unit that the lowered graph reads outside the unit's own
    forward (a get_attr: e.g. a sublayer's PreNorm gain handed to phase 2 to fuse the norm,
    restopo.fx.lower). FSDP gathers a unit's weights only around its forward, so these stay
    whole, like the scalars."""
    graph = getattr(root, "graph", None)
    if graph is None:
        return set()
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    return {t for t in read for name, _ in units if t.startswith(name + ".")}


def kept_whole(module: nn.Module, names: set[str], prefix: str = "") -> set[nn.Parameter]:
    """The parameters of `module` that no FSDP unit shards: scalars, and those in `names`
    (full names; `prefix`: the module's own)."""
    return scalars(module) | {p for n, p in module.named_parameters(prefix=prefix)
                              if n in names}


def tied(model: nn.Module) -> bool:
    head = getattr(getattr(model, "head", None), "lm_head", None)
    embed = getattr(model, "embed", None)
    return head is not None and embed is not None and \
        getattr(head, "weight", None) is getattr(embed, "weight", None)


def shard_units(root: nn.Module, mesh, units: list[tuple[str, nn.Module]], *,
                init: Init | None = None, full: nn.Module | None = None,
                device=None) -> set[nn.Parameter]:
    """fully_shard each module of `units` [(unit name, module)], in order, then `root` (all
    it holds besides; scalars ignored). With `init`, each unit of `full` (the meta-built
    whole model; `root` by default) is made real just before it is sharded, so a process
    holds its shards plus at most one whole unit at a time. Returns the parameters kept
    whole in every process (their gradients are the caller's to average)."""
    from torch.distributed.fsdp import fully_shard

    full = root if full is None else full
    whole = borrowed(root, units)
    for name, module in units:
        if init is not None:
            materialize(full, init, [name], device)
        fully_shard(module, mesh=mesh, ignored_params=kept_whole(module, whole, name) or None)
    unsharded = kept_whole(root, whole)
    fully_shard(root, mesh=mesh, ignored_params=unsharded)
    return unsharded


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units `shard_units` gives their own FSDP unit: every sublayer, and the embedding
    and head unless tied."""
    units = [(f"sublayers.{i}", m) for i, m in enumerate(model.sublayers)]
    if tied(model):
        return units
    return [("embed", model.embed), *units, ("head", model.head)]


def average_scalar_grads(params, group=None, size: int = 1) -> None:
    """Average the gradients of whole (unsharded) parameters over the data-parallel group."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def clip_total_norm(counted, scaled, max_norm: float, group=None) -> torch.Tensor:
    """Scale the gradients of `scaled` so that the norm of all gradients, each entry counted
    once (`counted`: this process's local shards and the whole tensors it counts), is at most
    max_norm, as torch.nn.utils.clip_grad_norm_ does in one process. Returns the norm."""
    sq = torch.zeros((), dtype=torch.float64)
    for g in counted:
        sq += _local(g).detach().double().pow(2).sum().cpu()
    dev = next((_local(g).device for g in counted if _local(g).is_cuda), torch.device("cpu"))
    sq = sq.to(dev)
    dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    for p in scaled:
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPStep:
    """The whole model sharded over every process (FSDP2); `accum` microbatches per step,
    gradients reduced once, on the last."""

    sharded, whole = True, True

    def __init__(self, model: nn.Module, ctx: DistContext, accum: int, mesh=None):
        from torch.distributed.device_mesh import init_device_mesh

        self.ctx, self.accum = ctx, accum
        self.data_rank, self.data_world = ctx.rank, ctx.world
        self.layout = f"data fsdp ({ctx.world} processes)"
        self.mesh = mesh or init_device_mesh(ctx.device.type, (ctx.world,))
        init = getattr(model, "restopo_init", None)
        if init is not None and init.meta:
            if getattr(model, "context", None) is not None:
                model.context.to(ctx.device)
            materialize(model, init, [u for u in init.factories
                                      if u.startswith("aggregations.")], ctx.device)
            if tied(model):
                materialize(model, init, ["head"], ctx.device)
        else:
            model.to(ctx.device)
            init = None
        # whole in every process: their gradients are averaged in step
        self.unsharded = shard_units(model, self.mesh, model_units(model), init=init,
                                     device=ctx.device)
        if init is not None:  # both names of a tied matrix: the one shard
            retie(model, init, list(init.factories))
        self.model = self.trained = model
        # in the model's order, the same in every process: they are all-reduced one by one
        self.whole_params = [p for p in model.parameters() if p in self.unsharded]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.ctx.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(self.accum), y.chunk(self.accum))):
            last = i == self.accum - 1
            self.model.set_requires_gradient_sync(last)
            with autocast(self.ctx.device):
                loss = lm_loss(self.model, xm, ym)
            (loss / self.accum).backward()
            loss_sum += loss.detach()
        average_scalar_grads(self.whole_params, size=self.ctx.world)
        return loss_sum / self.accum

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in params if p not in self.unsharded or self.ctx.is_main]
        return clip_total_norm(counted, params, max_norm)

    def evaluate(self, batches) -> float:
        loss = evaluate(self.model, batches, self.ctx.device, self.ctx, self.accum)
        reshard_units(self.model)
        return loss

    def held(self):
        return list(self.model.named_parameters())

    def saved(self):
        return [(n, p) for n, p in self.held() if p not in self.unsharded or self.ctx.is_main]
