"""The training loop over any `model(idx [B,T]) -> logits [B,T,vocab]`.

AdamW (weight decay on matrices only), linear warmup then cosine (or constant) learning
rate down to min_lr, gradient clipping, bf16 autocast on CUDA only, validation loss on
fixed batches, checkpoints, metrics (JSONL, TensorBoard when installed), a tqdm bar on
stderr and a loss plot at the end.

How a step's gradients are made (one process or data parallel, with gradient
accumulation; or pipeline parallel) is the `Stepper` the caller passes (stepper.py); the
loop is the same for all of them.

Steps count optimizer updates: "step k" in metrics and checkpoints means k updates are done,
and resuming from it runs update k + 1 next with the same data, weights, optimizer moments
and RNG states as an uninterrupted run, so the losses that follow are identical (CPU).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..io import full_disk_said, write_atomic
from ..spec.objects import TrainSpec
from ..words import counted
from .checkpoint import (CheckpointError, is_sharded, load_checkpoint, load_into,
                         save_checkpoint, save_sharded, step_dir_name, tie_aliases)
from .data import BatchSampler, Corpus, DataError, fixed_batches
from .dist import DistContext, any_rank, barrier, collectively, exchange, mean_over_ranks
from .interrupt import deferred_interrupt
from .plots import plot_losses, read_metrics
from .shards import local_tensor
from .stepper import DataParallelStep, Stepper, evaluate  # noqa: F401 (evaluate: re-export)
from .throughput import Throughput


class TrainingError(RuntimeError):
    """Training cannot go on (a diverged loss, a batch that does not split); says why."""


@dataclass
class TrainConfig:
    """The numbers the loop needs (from spec.train plus the model's context); the defaults
    are the spec's own, so a loop run without a spec behaves like one with an empty train
    section."""

    steps: int
    batch: int
    context: int
    lr: float = TrainSpec.lr
    schedule: str = TrainSpec.schedule
    warmup: int = TrainSpec.warmup
    min_lr: float | None = TrainSpec.min_lr
    weight_decay: float = TrainSpec.weight_decay
    grad_clip: float = TrainSpec.grad_clip
    accum: int = TrainSpec.accum
    eval_every: int = TrainSpec.eval_every
    eval_batches: int = TrainSpec.eval_batches
    save_every: int = TrainSpec.save_every
    seed: int = TrainSpec.seed
    log_every: int = TrainSpec.log_every
    keep: int = TrainSpec.keep  # checkpoints kept on disk

    @classmethod
    def from_spec(cls, train, context: int, **changes) -> "TrainConfig":
        fields = {k: getattr(train, k) for k in cls.__dataclass_fields__
                  if k != "context" and hasattr(train, k)}
        return cls(context=context, **{**fields, **changes})

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update `step` (0-based): linear warmup from lr/warmup to lr over
    `warmup` updates, then cosine from lr to min_lr at the last update (or constant lr)."""
    if cfg.warmup > 0 and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup - 1)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.final_lr + 0.5 * (cfg.lr - cfg.final_lr) * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights) only; vectors (norm gains,
    pseudo-queries, biases, scalars) are not pulled towards zero."""
    decay, keep = [], []
    for p in model.parameters():  # parameters() yields a tied tensor once
        if p.requires_grad:
            (decay if p.ndim >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": keep, "weight_decay": 0.0}]


def optimizer_order(model: torch.nn.Module, weight_decay: float = 0.1) -> list[str]:
    """The names of `model`'s parameters in the order make_optimizer numbers them (how a
    single-process optimizer.pt is read by name in another layout)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in param_groups(model, weight_decay) for p in g["params"]]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(0.9, 0.95), eps=1e-8, **extra)


class MetricsLog:
    """metrics.jsonl (one JSON object per line, flushed) plus TensorBoard when importable."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None):
        self.path = out / "metrics.jsonl"
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            # drop records of steps that ran after the checkpoint (they will run again)
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        events = out / "tensorboard"
        if resume_step is None:  # an earlier run's curves would be drawn into this one's
            shutil.rmtree(events, ignore_errors=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            # resuming, TensorBoard drops the steps after the checkpoint, as the JSONL does
            self.writer = SummaryWriter(str(events), purge_step=None if resume_step is None
                                        else resume_step + 1)
        except Exception:  # tensorboard not installed: the JSONL is the record
            self.writer = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with full_disk_said(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def draw_losses(metrics: Path, out: Path, meta: dict | None) -> Path:
    """OUT/loss.png from the run's metrics.jsonl."""
    return plot_losses(read_metrics(metrics), out / "loss.png",
                       title=(meta or {}).get("title", ""))


def resume(step_dir, stepper: Stepper, optimizer, cfg: TrainConfig, device) -> tuple[dict, dict]:
    """Load a checkpoint of any layout into this process's share of the model and its AdamW
    state; (state, meta). A whole model loads a single-process checkpoint as it always did;
    every other case reads tensors by name (restopo.train.shards)."""
    if not stepper.sharded and not is_sharded(step_dir):
        return load_checkpoint(step_dir, stepper.model, optimizer, map_location=device)
    model = stepper.model
    return load_into(step_dir, stepper.held(), optimizer,
                     order=optimizer_order(model, cfg.weight_decay),
                     aliases=tie_aliases(model), whole=stepper.whole)


class StoppedEarly(KeyboardInterrupt):
    """The run stopped at Ctrl-C after step `step`; `saved`: the step of its newest
    checkpoint (None: none yet)."""

    def __init__(self, step: int, saved: int | None, ckpt_root: Path):
        super().__init__(step)
        self.step, self.saved, self.ckpt_root = step, saved, ckpt_root

    def __str__(self) -> str:
        if self.saved is None:
            return (f"stopped after step {self.step}, before its first checkpoint; run it "
                    f"again (with --overwrite) to start over")
        return (f"stopped after step {self.step}; --resume continues from its checkpoint "
                f"{self.ckpt_root / step_dir_name(self.saved)}")


def first_diverged(seen: tuple[torch.Tensor, torch.Tensor], loss: torch.Tensor,
                   step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`seen` (step, loss) of the first update whose loss was not finite ((0, 0): none yet;
    float64 scalars) with update `step`'s `loss`, on the device: reading the loss at every
    step would make each step wait for its kernels. Six small ops a step."""
    at, value = seen
    loss = loss.detach()  # a step's loss holding its graph would chain every step's to it
    # loss - loss is 0, or NaN where the loss is not finite (inf - inf too); as 1/2, that is
    # above `at` only while no step is recorded (0; steps count from 1)
    first = torch.nan_to_num(loss - loss, nan=0.5).gt(at)
    return at.masked_fill(first, step), torch.where(first, loss, value)


def read_diverged(seen: tuple[torch.Tensor, torch.Tensor],
                  ctx: DistContext) -> tuple[int, float]:
    """first_diverged's (step, loss) read from the device ((0, 0.0): none), the same on
    every rank: the first step any of them diverged at."""
    at, value = torch.stack(seen).tolist()
    if ctx.distributed:
        at, value = min(exchange(ctx, [at, value]), key=lambda seen: seen[0] or math.inf)
    return int(at), value


@torch.no_grad()
def largest_weight(params) -> float:
    """The largest |entry| of `params` (of a DTensor, this process's shard), NaN when any is
    NaN: one fused reduction, read before each checkpoint."""
    held = [t for t in map(local_tensor, params) if t.numel()]
    return torch.stack(torch._foreach_norm(held, math.inf)).max().item() if held else 0.0


def stopped_at_once(ckpt_root: Path) -> str:
    """What a run stopped mid-step leaves to go on from (its newest checkpoint on disk:
    the stop may have come while one was written)."""
    from .checkpoint import latest_checkpoint

    found = latest_checkpoint(ckpt_root)
    if found is None:
        return ("stopped at once, before the run's first checkpoint; run it again (with "
                "--overwrite) to start over")
    return f"stopped at once; --resume continues from its newest checkpoint {found}"


@contextlib.contextmanager
def _compile_stopped(stop, stopped: StoppedEarly):
    """A compile that fails once a stop was asked for was stopped by it: Ctrl-C reaches the
    C++ compiler torch.compile runs too (the terminal's process group), and its failure
    came out as a compiler traceback. It ends the run as that stop: `stopped`, with the
    step before this one."""
    try:
        yield
    except Exception as e:
        if stop.asked and type(e).__module__.startswith(("torch._inductor", "torch._dynamo")):
            raise stopped from None
        raise


def train(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, out: str | os.PathLike,
          ctx: DistContext | None = None, *, meta: dict | None = None,
          resume_from: str | os.PathLike | None = None, progress: bool = True,
          stepper: Stepper | None = None, throughput: Throughput | None = None,
          compiled: int | str = 0) -> dict:
    """Train `model` in place; returns a summary (final loss, val loss, paths).

    `stepper` makes each step's gradients; by default `DataParallelStep` (one process, or
    DDP over all of them). restopo.train.layout builds the others (FSDP, pipeline stages),
    which place the model themselves and hold only their share of it.

    Only rank 0 writes metrics, plot and bar, and checkpoints of a whole-model layout; in a
    sharded layout every rank writes its share of each checkpoint. `meta` (spec text,
    overrides, ...) is stored in every checkpoint. `throughput`: what makes MFU of tokens/s
    (metrics.jsonl and the bar say it when it has a peak). `compiled`: what was compiled
    (restopo.train.compile.compile_model: a number of regions, or "the whole model"; 0:
    nothing); rank 0 says after the first step how long it took.
    """
    from tqdm import tqdm

    ctx = ctx or DistContext()
    out = Path(out)
    device = ctx.device
    if stepper is None:
        stepper = DataParallelStep(model.to(device), ctx, cfg.accum)
    raw = stepper.model
    data_rank, data_world = stepper.data_rank, stepper.data_world
    per_rank = cfg.batch // data_world if cfg.batch % data_world == 0 else None
    if per_rank is None or per_rank % stepper.accum:  # its data replicas, not processes
        raise DataError(f"train.batch ({cfg.batch}) must split evenly over "
                        f"{counted(data_world, 'data replica')} x "
                        f"{counted(stepper.accum, 'accumulation step')}",
                        ("train", "batch"))
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)

    optimizer = make_optimizer(stepper.trained, cfg, device)
    sampler = BatchSampler(corpus.train, cfg.context, cfg.batch, seed=cfg.seed,
                           rank=data_rank, world=data_world)
    val_batches = fixed_batches(corpus.val, cfg.context, cfg.batch, cfg.eval_batches,
                                rank=data_rank, world=data_world)

    start, elapsed0 = 0, 0.0
    last = {"loss": None, "val_loss": None}
    if resume_from is not None:
        state, ckpt_meta = collectively(ctx, lambda: resume(resume_from, stepper, optimizer,
                                                            cfg, device), (CheckpointError,))
        start, elapsed0 = int(state["step"]), float(state.get("elapsed", 0.0))
        sampler.load_state_dict(state["data"])
        torch.set_rng_state(state["torch_cpu"])
        if device.type == "cuda" and "torch_cuda" in state:
            torch.cuda.set_rng_state(state["torch_cuda"], device)
        last = {"loss": ckpt_meta.get("loss"), "val_loss": ckpt_meta.get("val_loss")}
    log = MetricsLog(out, ctx.is_main, start if resume_from is not None else None)
    ckpt_root = out / "ckpt"
    tokens_per_step = cfg.batch * cfg.context

    diverged = torch.zeros(2, dtype=torch.float64, device=device).unbind()  # first_diverged

    def diverged_at(at: int, value: float, what: str, advice: str, when: str = "at") -> None:
        """Record that `what` became `value` at step `at` (so that a report says the run
        diverged, and that resuming it diverges again, rather than that it is unfinished)
        and stop with TrainingError; `when`: "by" where it was seen at `at`, not first."""
        log.write({"step": at, "diverged": str(value),
                   **({"in": what} if what != "loss" else {}),
                   "elapsed": elapsed0 + time.perf_counter() - t0})
        kept = ("no checkpoint was saved" if saved is None else
                f"checkpoints stop at step {saved}, before it")
        raise TrainingError(f"the {what} became {value} {when} step {at} ({kept}); {advice}")

    checked = None  # the step whose losses check_loss last read

    def check_loss(step: int) -> None:
        """Stop (diverged_at) when a loss up to `step` was not finite on any rank: read where
        a line is logged and before every checkpoint, which must not save weights trained on
        it over good ones; once a step that does both (a wait for the device, and an
        exchange between ranks, that would find what the first found)."""
        nonlocal checked
        if step == checked:
            return
        checked = step
        at, value = read_diverged(diverged, ctx)
        if at:
            diverged_at(at, value, "loss", f"lower train.lr (now {cfg.lr:g}) or train.grad_clip")

    def check_weights(step: int) -> None:
        """Stop when a weight is not finite on any rank, before it is saved: gradients that
        overflowed at a step whose loss was finite (clipping an infinite norm makes them NaN)
        make NaN weights that the loss shows only at the next step."""
        values = exchange(ctx, largest_weight(p for _, p in stepper.held()))
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            diverged_at(step, min(bad, key=math.isinf), "weights",  # NaN before inf
                        f"the gradients overflowed though the loss was finite: lower "
                        f"train.lr (now {cfg.lr:g})", when="by")

    def save(step: int) -> None:
        check_loss(step)
        check_weights(step)
        state = {"step": step, "data": sampler.state_dict(),
                 "torch_cpu": torch.get_rng_state(),
                 "elapsed": elapsed0 + time.perf_counter() - t0}
        if device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(device)
        info = {**(meta or {}), **last, "config": asdict(cfg), "world": ctx.world,
                "layout": stepper.layout}
        if stepper.sharded:  # every rank writes its share; rank 0 commits
            save_sharded(ckpt_root, step, stepper.saved(), optimizer, state, info,
                         rank=ctx.rank, world=ctx.world, exchange=lambda o: exchange(ctx, o),
                         keep=cfg.keep, layout=stepper.layout)
            return
        if ctx.is_main:
            save_checkpoint(ckpt_root, step, raw, optimizer, state, info, keep=cfg.keep)
        barrier(ctx)  # nobody runs ahead while rank 0 writes (keeps ranks in lockstep)

    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=not (progress and ctx.is_main), dynamic_ncols=True)
    t0 = time.perf_counter()
    # tokens/s counts training steps only: `paused` is the time since the last log line
    # spent evaluating and writing checkpoints, taken out of the interval, and the run's
    # first step is left out: its one-time costs (compiling, kernels built or JIT-compiled,
    # memory first allocated) are no step's
    t_log, steps_since_log, paused = t0, 0, 0.0
    raw.train()
    if compiled and ctx.is_main:  # else a bar sits at 0 for a minute with no word why
        from .compile import compiling_line

        bar.write(compiling_line(compiled), file=sys.stderr)
    saved = start if resume_from is not None else None  # the step of the newest checkpoint

    def say(line: str) -> None:
        bar.write(f"restopo train: {line}", file=sys.stderr)

    with deferred_interrupt(say if ctx.is_main else lambda line: None) as stop:
        try:
            for step in range(start, cfg.steps):
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x, y = sampler.next()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with _compile_stopped(stop, StoppedEarly(step, saved, ckpt_root)):
                    loss = stepper.step(x, y)
                diverged = first_diverged(diverged, loss, step + 1)
                if cfg.grad_clip > 0:
                    stepper.clip_grad_norm_(cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                # every rank stops at one step: the save that ends it is collective
                stopping = any_rank(stop.asked, ctx)
                steps_since_log += 1
                bar.update(1)
                if step == start:  # tokens/s: of the steps after it
                    now = time.perf_counter()
                    if compiled and ctx.is_main:  # compiling it took most of its time
                        from .compile import compiled_line

                        bar.write(compiled_line(compiled, now - t0), file=sys.stderr)
                    t_log, steps_since_log = now, 0

                val_loss = None
                # 0 turns evaluation (eval_every) and the periodic checkpoints (save_every)
                # off; the last step, and the one a stop ends at, are saved all the same:
                # a run must not end with its training lost
                if cfg.eval_every > 0 and (done % cfg.eval_every == 0 or done == cfg.steps):
                    t_eval = time.perf_counter()
                    val_loss = stepper.evaluate(val_batches)
                    last["val_loss"] = val_loss
                    paused += time.perf_counter() - t_eval
                if (cfg.log_every > 0 and done % cfg.log_every == 0) or done in (1, cfg.steps) \
                        or val_loss is not None:
                    check_loss(done)
                    loss_value = mean_over_ranks(loss.item(), ctx)
                    now = time.perf_counter()
                    # none when the line's only step was the run's first
                    rate = (steps_since_log * tokens_per_step / max(now - t_log - paused, 1e-9)
                            if steps_since_log else None)
                    mfu = None if throughput is None or rate is None else throughput.mfu(rate)
                    t_log, steps_since_log, paused = now, 0, 0.0
                    last["loss"] = loss_value
                    log.write({"step": done, "loss": loss_value, "val_loss": val_loss, "lr": lr,
                               **({"tokens_per_s": rate} if rate is not None else {}),
                               "elapsed": elapsed0 + now - t0,
                               **({"mfu": mfu} if mfu is not None else {})})
                    bar.set_postfix_str(f"loss {loss_value:.3f}"
                                        + (f" val {last['val_loss']:.3f}" if last["val_loss"]
                                           is not None else "")
                                        + (f" {rate:,.0f} tok/s" if rate is not None else "")
                                        + (f" MFU {mfu:.1%}" if mfu is not None else ""),
                                        refresh=False)
                if (cfg.save_every > 0 and done % cfg.save_every == 0) or done == cfg.steps \
                        or stopping:
                    t_save = time.perf_counter()
                    save(done)
                    saved = done
                    paused += time.perf_counter() - t_save
                if stopping and done < cfg.steps:
                    raise StoppedEarly(done, saved, ckpt_root)
        except (StoppedEarly, TrainingError):
            # a run stopped by Ctrl-C or by a diverged loss still gets its curve up to there
            # (else loss.png is the previous run's, or none after --overwrite)
            if ctx.is_main:
                try:
                    draw_losses(log.path, out, meta)
                except Exception as e:  # the stop's own message matters more than the plot
                    say(f"loss.png was not redrawn ({type(e).__name__}: {e})")
            raise
        except KeyboardInterrupt:  # a second Ctrl-C (the first under torchrun): said where
            if not ctx.is_main:    # the run goes on from, as a first one's stop says it
                raise
            raise KeyboardInterrupt(stopped_at_once(ckpt_root)) from None
        finally:
            bar.close()
            log.close()

    # the step the run is at: cfg.steps, or past it for a checkpoint resumed with fewer
    summary = {"steps": max(cfg.steps, start), "loss": last["loss"], "val_loss": last["val_loss"],
               "out": str(out), "metrics": str(log.path), "checkpoint": None, "plot": None,
               "seconds": time.perf_counter() - t0, "from_step": start}
    if ctx.is_main:
        from .checkpoint import latest_checkpoint

        summary["plot"] = str(draw_losses(log.path, out, meta))
        found = latest_checkpoint(ckpt_root)
        summary["checkpoint"] = str(found) if found else None
    return summary
