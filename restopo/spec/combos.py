"""Settings that do not combine: train.compile and train.recompute against each other and
against the layout. One rule for both places that meet it: the spec check (a `parallel`
section written in the spec) and `restopo train` (the layout its flags choose, --pipeline
and --data included), so `check` refuses what `train` would. Each rule returns (why, what
to do) or None; `said` joins them into one line.
"""
from __future__ import annotations


def compile_conflict(compile: str, recompute: str, *,
                     sharded: bool) -> tuple[str, str] | None:
    """Why train.compile: whole cannot run with `recompute` and a layout whose processes
    run parts of the model (`sharded`: pipeline chunks or FSDP units); None when it can."""
    if compile != "whole":
        return None
    if sharded:
        return ("train.compile: whole compiles the model as one graph, for one process or "
                "DDP, not a pipeline or FSDP",
                # not --compile: it keeps a spec's (or a resumed checkpoint's) whole
                "use train.compile: regional (--set train.compile=regional), which compiles "
                "what each process runs")
    if recompute == "sublayer":
        return ("train.compile: whole does not combine with train.recompute: sublayer (its "
                "checkpoint hooks do not trace into one graph)",
                "use train.recompute: block, or train.compile: regional")
    return None


def recompute_conflict(recompute: str, *, pipeline: bool) -> tuple[str, str] | None:
    """Why train.recompute cannot run in a pipeline; None when it can."""
    if recompute == "block" and pipeline:
        return ("train.recompute=block recomputes regions of the whole lowered model, which "
                "a pipeline stage does not run", "use train.recompute=sublayer with a pipeline")
    return None


def said(conflict: tuple[str, str]) -> str:
    """A conflict as one line: why; what to do."""
    return "; ".join(conflict)
