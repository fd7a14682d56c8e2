"""How one optimizer step's gradients are made: the interface the training loop steps
through, and its data-parallel implementation.

The loop (loop.py) owns the schedule, the optimizer and checkpoints; a stepper owns how
this process's rows of a batch go forward and backward, what the processes must exchange
around that, how validation runs, and which parameters this process holds and saves.
`DataParallelStep` runs the whole model in every process (DDP under torchrun);
restopo.train.fsdp.FSDPStep shards it (FSDP2), and
restopo.backends.pipeline.train.PipelinedStep runs this process's pipeline stages only
(with either data-parallel engine across pipelines); restopo.train.layout builds the one a
run asks for.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F

from .dist import DistContext, mean_over_ranks


class Stepper(Protocol):
    data_rank: int   # which rows of each global batch this process feeds
    data_world: int  # into how many parts each global batch is split
    accum: int       # into how many microbatches a process's rows are split, one at a time
    model: torch.nn.Module    # the whole model (meta tensors where this process holds none)
    trained: torch.nn.Module  # its parameters() are what this process's optimizer updates
    sharded: bool    # checkpoints: each process saves its share (True) or rank 0 all (False)
    whole: bool      # held() is the whole model
    layout: str      # e.g. "pipeline 2x2, data fsdp (4 processes)", for people

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this process's rows; their mean loss (detached)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so the whole model's gradient norm is at most max_norm."""

    def evaluate(self, batches) -> float:
        """Mean loss over the validation batches (all processes' rows), without training."""

    def held(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in the whole model, parameter) of every parameter this process holds, whole
        or its FSDP shard: what resuming fills."""

    def saved(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The part of held() this process writes to a sharded checkpoint (each tensor, or
        each row of it, by one process)."""


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class DataParallelStep:
    """The whole model in every process; `accum` microbatches per step, gradients averaged
    over processes by DDP once, on the last microbatch."""

    sharded, whole = False, True

    def __init__(self, model: torch.nn.Module, ctx: DistContext, accum: int):
        self.model, self.ctx, self.accum = model, ctx, accum
        self.trained = model
        self.data_rank, self.data_world = ctx.rank, ctx.world
        self.layout = f"data ddp ({ctx.world} processes)" if ctx.distributed else "1 process"
        self.net = model
        if ctx.distributed:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(
                model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.ctx.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(self.accum), y.chunk(self.accum))):
            sync = i == self.accum - 1 or not self.ctx.distributed
            no_sync = contextlib.nullcontext() if sync else self.net.no_sync()
            with no_sync, autocast(self.ctx.device):
                loss = lm_loss(self.net, xm, ym)
            (loss / self.accum).backward()
            loss_sum += loss.detach()
        return loss_sum / self.accum

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def evaluate(self, batches) -> float:
        return evaluate(self.model, batches, self.ctx.device, self.ctx, self.accum)

    def held(self):
        return list(self.model.named_parameters())

    def saved(self):
        return self.held() if self.ctx.is_main else []


@torch.no_grad()
def evaluate(model, batches, device: torch.device, ctx: DistContext, accum: int = 1) -> float:
    """Mean loss over the fixed validation batches (all ranks' rows). Each batch goes
    forward in `accum` pieces, as a training step's rows do: a model that fits in memory
    only thanks to accumulation ran out of it at its first evaluation of a whole batch."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):  # equal pieces: mean of means
            with autocast(device):
                total += lm_loss(model, xm.to(device), ym.to(device)).item() / accum
    model.train(was_training)
    return mean_over_ranks(total / len(batches), ctx)
