"""What `restopo check` accepts, `restopo train` can run: the bounds on a spec's sizes.

Each bound says why it is there. They are far above any model trained today and stop the
numbers that would only exhaust memory or time (a batch of 10^8 sequences, a depth whose
IR has billions of edges) at the line that wrote them, in one pass over the depth.

    depth            4,096 layers    fields.MAX_DEPTH: one module per sublayer is built
    source reads     4,194,304       the IR and the lowered graph hold one entry per source
                                     an aggregation reads (Full AttnRes: about L^2 / 2)
    tokens per step  16,777,216      batch x context ids are made in memory at once
    validation       16,777,216      eval_batches x batch x context ids, kept for the run
    context          131,072         the rotary tables and attention's scores grow with it
    parameters       17,179,869,184  every process builds the whole model in fp32 (64 GiB)
                                     before a pipeline stage keeps its share
    sinkhorn         1,000           mHC's iterations per sublayer (topology.MAX_SINKHORN,
                                     checked with the topology): every forward runs them
                                     all, and the backward keeps two tensors per iteration
"""
from __future__ import annotations

from ..sizes import model_parameters, sublayer_parameters
from .fields import Checker
from .nodes import blame
from .objects import ModelSpec, ParallelSpec, TrainSpec

MAX_SOURCE_READS = 1 << 22
MAX_STEP_TOKENS = 1 << 24
MAX_VAL_TOKENS = 1 << 24
MAX_CONTEXT = 1 << 17
MAX_PARAMETERS = 1 << 34


def _parts(model: ModelSpec) -> tuple[int, int, int]:
    """The parameters of all attention sublayers, of all MLPs, and of one vocab x width
    table (the embedding; an untied LM head is a second)."""
    d = model.width
    n_attn = sum(k == "attn" for k in model.kinds)
    per_mlp = sublayer_parameters("mlp", d, model.mlp, model.mlp_ratio)
    return (n_attn * sublayer_parameters("attn", d), (len(model.kinds) - n_attn) * per_mlp,
            model.vocab * d)


def parameters(model: ModelSpec) -> int:
    """The parameter count of restopo's transformer for `model` (sublayers, embedding and
    LM head; the topology's own few are left out)."""
    return sum(model_parameters(model))


def check_model_limits(model: ModelSpec, c: Checker) -> bool:
    """Context and parameter count; False after an error (then nothing is built)."""
    ok = True
    if model.context > MAX_CONTEXT:
        c.error(model.where("context"), f"'context' is at most {MAX_CONTEXT:,} tokens, got "
                f"{model.context:,}", "the rotary tables and attention's scores grow with "
                "the context; train with a shorter one")
        ok = False
    n = parameters(model)
    if n > MAX_PARAMETERS:
        c.error(model.where(_largest_factor(model)), f"this model has {n:,} parameters, "
                f"more than the {MAX_PARAMETERS:,} restopo can build", "every process "
                "builds the whole model in fp32 before a pipeline stage keeps its share; use "
                "a smaller width, depth, MLP ratio or vocab")
        ok = False
    return ok


def _largest_factor(model: ModelSpec) -> str:
    """The value to point at for too many parameters: the MLP ratio where the MLPs' hidden
    width is what makes them (ratio past 16x), the vocab where the embedding outweighs the
    layers, else the width."""
    attention, mlps, table = _parts(model)
    if model.mlp_ratio > 16 and mlps > attention:
        return "mlp_ratio" if model.where("mlp_ratio") != model.pos else "mlp"
    if table > attention + mlps:
        return "vocab"
    return "width"


def check_source_reads(model: ModelSpec, reads: int, c: Checker, *,
                       attends: bool = True) -> None:
    """The IR's size, counted in O(depth) before anything is built. `attends`: the
    topology attends over its sources, so a window or Block AttnRes would read fewer; a
    sum (the standard residual) is only made smaller by depth."""
    if reads > MAX_SOURCE_READS:
        shorter = (f" or a shorter layer ({len(model.layer)} sublayers a layer)"
                   if len(model.layer) > 2 else "")
        c.error(model.where("depth"), f"the aggregations of this topology read {reads:,} "
                f"sources in all at depth {model.depth}, more than {MAX_SOURCE_READS:,}",
                "the IR and the lowered model hold one entry per source read (about L^2/2 "
                "for L sublayers when every point reads all earlier outputs); use a smaller "
                "depth" + shorter + (", a window, or Block AttnRes" if attends else ""))


def check_train_limits(train: TrainSpec, context: int | None, c: Checker) -> None:
    """Tokens of one optimizer step and of the validation batches; accumulation steps
    must cut the batch evenly."""
    if train.batch % train.accum:
        c.error(blame(train.where("accum"), train.where("batch")),
                f"accum ({train.accum}) must divide batch "
                f"({train.batch})", "each accumulation step takes batch/accum sequences")
    if context is None:
        return
    step = train.batch * context
    if step > MAX_STEP_TOKENS:
        c.error(train.where("batch"), f"one step would take batch x context = {train.batch:,} "
                f"x {context:,} = {step:,} tokens, more than {MAX_STEP_TOKENS:,}",
                "a step's token ids are made in memory at once; use a smaller batch")
    val = train.eval_batches * step
    if step <= MAX_STEP_TOKENS and val > MAX_VAL_TOKENS:
        c.error(train.where("eval_batches"), f"validation would keep eval_batches x batch x "
                f"context = {val:,} tokens, more than {MAX_VAL_TOKENS:,}",
                "the validation batches are made once and kept for the run; use fewer "
                "eval_batches")


def check_microbatches(parallel: ParallelSpec, train: TrainSpec, c: Checker) -> None:
    """A pipeline cuts each replica's rows of train.batch into its microbatches, so they
    must divide train.batch whatever the number of replicas (train checks the rest, once it
    knows the processes)."""
    micro = parallel.microbatches
    if train.batch % micro:
        given = any(k == "microbatches" for k, _ in parallel.positions)
        what = (f"microbatches ({micro})" if given else
                f"stages ({micro}), the number of microbatches when none is given,")
        c.error(blame(parallel.where("microbatches" if given else "stages"),
                      train.where("batch")),
                f"{what} must divide train.batch ({train.batch})",
                "each microbatch takes batch/microbatches sequences of a pipeline's rows; "
                "use microbatches that divide the batch, or a batch that is a multiple of "
                "them")
