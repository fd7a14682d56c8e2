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

A process holds only its chunks' modules (the caller builds the rest of the model on the
meta device: restopo.nn.init, backends/pipeline/train.py). Parameters shared across ranks
(a tied embedding and LM head) have their gradients summed over the pipeline group after
each step, found by name. With more processes than stages the world is a 2-D mesh, rank =
replica * P + stage; gradients are averaged over the replicas (replicated data parallel) or
the chunks are FSDP-sharded over them by the caller (FSDP handles them).

With a compute dtype other than float32 (bf16 on CUDA), each chunk runs under autocast and
the tensors crossing cuts are sent in that dtype, so the bytes counted follow it.
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
    """The process layout, a 2-D DeviceMesh ("dp", "pp"): pipeline stage = rank % P,
    replica = rank // P. `pp`/`dp` are this process's groups along each dimension (None
    when that dimension has size 1: the whole world, or no one else)."""

    def __init__(self, stages: int, device_type: str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        world, rank = dist.get_world_size(), dist.get_rank()
        if world % stages:
            raise ValueError(f"{world} processes cannot run a {stages}-stage pipeline: the "
                             f"number of processes must be a multiple of {stages}")
        self.stages, self.replicas = stages, world // stages
        self.stage, self.replica = rank % stages, rank // stages
        self.pp_ranks = [self.replica * stages + s for s in range(stages)]
        self.mesh = init_device_mesh(device_type, (self.replicas, stages),
                                     mesh_dim_names=("dp", "pp"))
        self.dp_mesh = self.mesh["dp"]
        self.pp = self.mesh["pp"].get_group() if self.replicas > 1 else None
        self.dp = self.dp_mesh.get_group() if self.replicas > 1 else None


class Pipeline:
    """This process's share of a pipelined model, stepped with `step(idx, targets)`."""

    def __init__(self, model, plan: Plan, *, schedule: str = "1f1b", n_microbatches: int = 2,
                 cached: bool = True, device=None, groups: Groups | None = None,
                 loss_fn=lm_loss, dtype: torch.dtype = torch.float32,
                 replicated: bool = True):
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
        self.dtype, self.replicated = dtype, replicated
        self.chunks: list[ChunkModule] = build_chunks(
            plan, self.g, parts, aggs, rank, cached=cached, n_microbatches=n_microbatches,
            dtype=dtype, device_type=self.device.type)
        self.vocab = _vocab(parts.head)
        self.model = model
        # a tied tensor's gradient is summed by the stages that hold it, in each replica
        self.tied = {}
        P = plan.stages
        for name, stages in cross_rank_names(plan, self.g, parts, aggs, model).items():
            for r in range(self.groups.replicas):  # every process makes every group, in order
                group = dist.new_group([r * P + s for s in stages])
                if r == self.groups.replica and self.groups.stage in stages:
                    self.tied[name] = group
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

    def named_parameters(self, model=None):
        """(name in the whole model, parameter) of the parameters this rank holds."""
        mine = {id(p) for p in self.parameters()}
        return [(n, p) for n, p in (model or self.model).named_parameters() if id(p) in mine]

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
                ins = tuple(torch.empty(v.shape(mb, T, d), device=dev, dtype=self.dtype,
                                        requires_grad=True) for v in m.in_values)
            if c == C - 1:
                outs = (torch.empty(mb, T, self.vocab, device=dev, requires_grad=True),)
            else:
                outs = tuple(torch.empty(v.shape(mb, T, d), device=dev, dtype=self.dtype,
                                         requires_grad=True) for v in m.out_values)
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
        loss = self._run(idx, targets, train=True)
        self._sync_grads()
        return loss

    @torch.no_grad()
    def evaluate(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, forward only through the same schedule (no process holds
        more than its chunks); on every process of the pipeline."""
        return self._run(idx, targets, train=False)

    def _run(self, idx: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
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
        (self._schedule.step if train else self._schedule.eval)(*args, **kwargs)
        self.chunks[0].cache.clear()
        if train:
            for k in self.sent:
                self.last_sent[k] = sum(s.sent[k] for s in self._stages) - before[k]
                self.sent[k] += self.last_sent[k]
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        src = self.groups.pp_ranks[self.plan.stages - 1]
        loss = loss.to(self.device, torch.float32).contiguous()
        dist.broadcast(loss, src=src, group=self.groups.pp)
        return loss

    def _sync_grads(self):
        for name, group in self.tied.items():
            p = self.model.get_parameter(name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(_local(p.grad), group=group)
        if self.groups.dp is None:
            return
        # Replicated: every gradient; FSDP-sharded chunks: only what FSDP leaves whole.
        for p in self.parameters():
            if not self.replicated and hasattr(p, "to_local"):
                continue
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


def cross_rank_names(plan: Plan, g, parts, aggs, model) -> dict[str, list[int]]:
    """The parameters used by chunks on more than one rank (a tied embedding and LM head):
    name -> the stages that use it, in a fixed order so every process agrees."""
    name = {id(p): n for n, p in model.named_parameters()}
    ranks_of: dict[str, set[int]] = {}
    for r in range(plan.stages):
        for m in build_chunks(plan, g, parts, aggs, r):
            for p in m.parameters():
                ranks_of.setdefault(name[id(p)], set()).add(r)
    return {n: sorted(ranks) for n, ranks in ranks_of.items() if len(ranks) > 1}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds of `t` (a DTensor's local shard, sharing its storage)."""
    return getattr(t, "_local_tensor", t)
