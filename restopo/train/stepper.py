"""How one optimizer step's gradients are made: the interface the training loop steps
through, and its data-parallel implementation.

The loop (loop.py) owns the schedule, the optimizer, evaluation and checkpoints; a stepper
owns how this process's rows of a batch go forward and backward and what the processes
must exchange around that. `DataParallelStep` runs the whole model in every process (DDP
under torchrun); restopo.backends.pipeline.train.PipelinedStep implements the same
interface over pipeline stages, and the caller hands the loop the one it wants.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F

from .dist import DistContext


class Stepper(Protocol):
    data_rank: int   # which rows of each global batch this process feeds
    data_world: int  # into how many parts each global batch is split

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this process's rows; their mean loss (detached)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so the whole model's gradient norm is at most max_norm."""

    def before_save(self, optimizer: torch.optim.Optimizer) -> None:
        """Gather on rank 0 what the checkpoint holds (every weight and its optimizer state)."""

    def before_eval(self) -> None:
        """Give every process the whole, current model (each evaluates all of it)."""


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

    def __init__(self, model: torch.nn.Module, ctx: DistContext, accum: int):
        self.model, self.ctx, self.accum = model, ctx, accum
        self.data_rank, self.data_world = ctx.rank, ctx.world
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

    def before_save(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # every process already holds the whole model and its optimizer state

    def before_eval(self) -> None:
        pass
