"""Pipeline runtime on torch.distributed.pipelining (PipelineStage and its schedules).

`Pipeline(model, plan, ...)` splits a compiled restopo model (restopo.compile -> fx
GraphModule) into the plan's chunks, keeps this rank's chunks (rank, rank + P, ...) as
`PipelineStage`s and runs one of the library's schedules:

  schedule            V = 1                 V > 1
  gpipe               ScheduleGPipe         ScheduleLoopedBFS (GPipe over looped stages)
  1f1b                Schedule1F1B          ScheduleInterleaved1F1B
  interleaved_1f1b    ScheduleInterleaved1F1B

Stage I/O is the plan's flat tuple of [b, T, d] values per cut (naive or cached; a
multi-stream state is one [b, T, n, d] value). The
rank-local side channel of the cache (cache.py) needs no library support: a chunk keeps
detached leaves for the later chunks of its rank and takes their gradients back through an
identity on its own first output, so PipelineStage only ever carries what another rank needs.

Bytes are counted at the send calls: `CountingStage` adds up the tensors of every isend op
the stage hands the schedule, forward (activations) and backward (gradients) separately.

Every process builds the whole model from the same seed and keeps its chunks' parameters;
parameters shared across ranks (tied embedding and LM head) have their gradients summed over
the pipeline group after each step. With more processes than stages the world is laid out as
rank = replica * P + stage and gradients are averaged over the replicas (data parallel).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleLoopedBFS)

from .plan import Plan
from .stage import ChunkModule, build_chunks

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class CountingStage(PipelineStage):
    """A PipelineStage that counts the bytes of the tensors it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = {"forward": 0, "backward": 0}

    def _count(self, ops, direction):
        self.sent[direction] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._count(super().get_fwd_send_ops(fwd_chunk_id), "forward")

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._count(super().get_bwd_send_ops(bwd_chunk_id), "backward")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Groups:
    """The process layout: pipeline stage = rank % P, replica = rank // P."""

    def __init__(self, stages: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % stages:
            raise ValueError(f"{world} processes cannot run a {stages}-stage pipeline: the "
                             f"number of processes must be a multiple of {stages}")
        self.stages, self.replicas = stages, world // stages
        self.stage, self.replica = rank % stages, rank // stages
        if self.replicas == 1:
            self.pp, self.dp = None, None
            self.pp_ranks = list(range(stages))
            return
        # new_group must be called by every process, for every group, in the same order.
        self.pp = self.dp = None
        for r in range(self.replicas):
            ranks = [r * stages + s for s in range(stages)]
            grp = dist.new_group(ranks)
            if r == self.replica:
                self.pp, self.pp_ranks = grp, ranks
        for s in range(stages):
            grp = dist.new_group([r * stages + s for r in range(self.replicas)])
            if s == self.stage:
                self.dp = grp


class Pipeline:
    """This process's share of a pipelined model, stepped with `step(idx, targets)`."""

    def __init__(self, model, plan: Plan, *, schedule: str = "1f1b", n_microbatches: int = 2,
                 cached: bool = True, device=None, groups: Groups | None = None,
                 loss_fn=lm_loss):
        from restopo.fx.lower import aggregation_modules, lowered, parts_of

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if plan.stages < 2:
            raise ValueError("a pipeline needs at least 2 stages; run a single process instead")
        self.groups = groups or Groups(plan.stages)
        self.plan, self.schedule_name, self.cached = plan, schedule, cached
        self.n_microbatches, self.loss_fn = n_microbatches, loss_fn
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        gm = lowered(model)
        self.g = gm.restopo_ir
        parts, aggs = parts_of(model), aggregation_modules(model)
        rank = self.groups.stage
        self.chunks: list[ChunkModule] = build_chunks(
            plan, self.g, parts, aggs, rank, cached=cached, n_microbatches=n_microbatches)
        self.vocab = _vocab(parts.head)
        self._tied = _cross_rank_parameters(plan, self.g, parts, aggs)
        self.width = plan.width or self.g.graph.get("width") or parts.embed.weight.shape[1]
        self._stages = None
        self._shape = None
        self.sent = {"forward": 0, "backward": 0}       # bytes sent by this process, all steps
        self.last_sent = {"forward": 0, "backward": 0}  # ... in the last step

    # ------------------------------------------------------------------ parameters
    def parameters(self):
        seen, out = set(), []
        for m in self.chunks:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def named_parameters(self, model):
        """(name, parameter) of `model` for the parameters this rank holds."""
        mine = {id(p) for p in self.parameters()}
        return [(n, p) for n, p in model.named_parameters() if id(p) in mine]

    # ------------------------------------------------------------------ stages
    def _build(self, batch: int, T: int):
        M = self.n_microbatches
        if batch % M:
            raise ValueError(f"batch {batch} does not split into {M} microbatches; use a "
                             f"batch that is a multiple of the microbatch count")
        mb, d = batch // M, self.width
        dev, C = self.device, self.plan.n_chunks
        stages = []
        for m in self.chunks:
            c = m.c
            if c == 0:
                ins = (torch.zeros(mb, T, dtype=torch.long, device=dev),)
            else:
                ins = tuple(torch.empty(v.shape(mb, T, d), device=dev, requires_grad=True)
                            for v in m.in_values)
            if c == C - 1:
                outs = (torch.empty(mb, T, self.vocab, device=dev, requires_grad=True),)
            else:
                outs = tuple(torch.empty(v.shape(mb, T, d), device=dev, requires_grad=True)
                             for v in m.out_values)
            stages.append(CountingStage(m, c, C, dev, input_args=ins, output_args=outs,
                                        group=self.groups.pp))
        V = len(stages)
        if self.schedule_name == "gpipe":
            sched = ScheduleGPipe(stages[0], M, loss_fn=self.loss_fn) if V == 1 else \
                ScheduleLoopedBFS(stages, M, loss_fn=self.loss_fn)
        elif self.schedule_name == "1f1b" and V == 1:
            sched = Schedule1F1B(stages[0], M, loss_fn=self.loss_fn)
        else:
            sched = ScheduleInterleaved1F1B(stages, M, loss_fn=self.loss_fn)
        self._stages, self._schedule, self._shape = stages, sched, (batch, T)

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (every process passes the same batch). Returns
        the batch's mean loss on every process of the pipeline; gradients are left in the
        parameters' .grad (summed across ranks for shared ones, averaged over replicas)."""
        batch, T = idx.shape
        if self._shape != (batch, T):
            self._build(batch, T)
        for m in self.chunks:
            m.calls = 0
        self.chunks[0].cache.clear()
        before = {k: sum(s.sent[k] for s in self._stages) for k in self.sent}
        losses = []
        first = any(m.c == 0 for m in self.chunks)
        last = any(m.c == self.plan.n_chunks - 1 for m in self.chunks)
        args = (idx.to(self.device),) if first else ()
        kwargs = {"target": targets.to(self.device), "losses": losses} if last else {}
        self._schedule.step(*args, **kwargs)
        self.chunks[0].cache.clear()
        for k in self.sent:
            self.last_sent[k] = sum(s.sent[k] for s in self._stages) - before[k]
            self.sent[k] += self.last_sent[k]
        self._sync_grads()
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        src = self.groups.pp_ranks[self.plan.stages - 1]
        loss = loss.to(self.device).contiguous()
        dist.broadcast(loss, src=src, group=self.groups.pp)
        return loss

    def _sync_grads(self):
        for p in self._tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.groups.pp)
        if self.groups.dp is not None:
            for p in self.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.groups.dp)
                p.grad /= self.groups.replicas

    def bytes_per_microbatch(self) -> dict[str, float]:
        """Bytes this process sent in the last step, per microbatch."""
        return {k: v / self.n_microbatches for k, v in self.last_sent.items()}


def _vocab(head) -> int:
    lm = getattr(head, "lm_head", None)
    if lm is not None:
        return lm.out_features
    return [p for p in head.parameters() if p.dim() == 2][-1].shape[0]


def _cross_rank_parameters(plan: Plan, g, parts, aggs) -> list[torch.nn.Parameter]:
    """Parameters used by chunks on more than one rank (a tied embedding and LM head), in a
    fixed order so every process all-reduces them in step."""
    ranks_of: dict[int, set[int]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    order: list[int] = []
    for r in range(plan.stages):
        for m in build_chunks(plan, g, parts, aggs, r):
            for p in m.parameters():
                if id(p) not in params:
                    params[id(p)] = p
                    order.append(id(p))
                ranks_of.setdefault(id(p), set()).add(r)
    return [params[i] for i in order if len(ranks_of[i]) > 1]
