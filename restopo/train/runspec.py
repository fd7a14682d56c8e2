"""From a spec (file + --set overrides, or the copy inside a checkpoint) to a seeded model.

A checkpoint's meta.json carries the spec text, its path and the overrides, so a run can be
resumed or diagnosed without the original file.
"""
from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path

import torch

from ..spec.datapath import data_base, data_place
from ..spec.overrides import override_values, same_setting
from ..words import counted
from .checkpoint import CheckpointError, read_meta


def load(path: str, overrides=()):
    from ..spec import load_spec

    return load_spec(path, overrides=tuple(overrides))


def from_text(text: str, path: str, overrides=()):
    from ..spec import parse_spec

    return parse_spec(text, path=path, overrides=tuple(overrides))


def recorded(spec, overrides: int, base: str | None):
    """`spec` knowing that its first `overrides` overrides, and its relative train.data,
    were recorded with a run that read that data from `base` (None: not recorded)."""
    return spec if base is None else dataclasses.replace(spec, recorded=(overrides, base))


def build_model(spec, backend: str = "auto", seed: int | None = None, *,
                meta: bool = False) -> torch.nn.Module:
    """restopo.compile(spec) with each unit's weights drawn from a generator seeded by (seed,
    unit name) (restopo.nn.init): the same seed gives the same weights in one process and in
    any pipeline or data-parallel layout. meta=True builds every unit on the meta device
    (restopo.nn.init.materialize makes the ones a process holds real). torch's global
    generator is seeded too."""
    from ..api import compile as compile_spec
    from ..nn.init import Init

    seed = spec.train.seed if seed is None else seed
    torch.manual_seed(seed)
    return compile_spec(spec, backend=backend, init=Init(seed, meta=meta))


def run_meta(spec, base: str, corpus=None) -> dict:
    """What a checkpoint records about the spec (JSON), and about `corpus`, the data it
    trains on (for data_note)."""
    path = str(spec.path)
    return {"spec_text": spec.text,
            "spec_path": path if path.startswith("<") else str(Path(path).resolve()),
            "overrides": list(spec.overrides or ()), "data_base": base,
            "title": f"{Path(str(spec.path)).stem} ({spec.topology.name})",
            **({"data": {"source": spec.train.data, **corpus.fingerprint}}
               if corpus is not None else {})}


def data_note(spec, corpus, resumed: Resumed) -> str | None:
    """The note when the data at the same train.data changed since the checkpoint `resumed`
    was saved: the run then goes on with other batches than it would have. (Another
    train.data is said by resume_notes.)"""
    meta, step_dir = resumed.meta, resumed.step_dir
    then = meta.get("data")
    if not isinstance(then, dict) or data_place(resumed.spec) != data_place(spec):
        return None
    now = corpus.fingerprint
    if then.get("tokens") == now["tokens"] and then.get("sha256") == now["sha256"]:
        return None
    tokens = then.get("tokens")
    how = (f"{tokens[0] + tokens[1]:,} tokens then, {sum(now['tokens']):,} now"
           if isinstance(tokens, list) and tokens != now["tokens"] else
           "as many tokens, other content")
    step = int(meta.get("step", 0))
    # the description may hold brackets of its own (a folder's: its files), so no more here
    return (f"train.data, {corpus.description}, has changed since {step_dir} was saved "
            f"({how}): the steps from {step + 1} on draw their batches from it as it is now, "
            f"and the validation losses before and after do not compare")


def open_data(spec, *, progress: bool = True, resuming: bool = False):
    """The spec's corpus, checked against its model; a problem is a SpecError at the value
    that caused it (the data line, or model.vocab for a vocab mismatch). `resuming`: data
    no longer where the run read it is said with how to give its new place."""
    from .data import DataError, open_corpus

    try:
        corpus = open_corpus(spec.train.data, base_dir=data_base(spec), progress=progress)
        corpus.check(spec.model.vocab, spec.model.context)
    except DataError as e:
        moved = ("if the run's data has moved since it trained, give its new place: "
                 "--set train.data=PATH") if resuming and e.missing else None
        raise spec.error(*e.where, str(e), moved) from None
    return corpus


def spec_from_meta(meta: dict, extra_overrides=()):
    if "spec_text" not in meta:
        raise CheckpointError("this checkpoint carries no spec text (meta.json: spec_text)")
    kept = tuple(meta.get("overrides", ()))
    spec = from_text(meta["spec_text"], meta.get("spec_path", "<checkpoint>"),
                     kept + tuple(extra_overrides))
    return recorded(spec, len(kept), meta.get("data_base"))


@dataclasses.dataclass
class Resumed:
    """The checkpoint a run goes on from: its folder, its meta.json and the spec it was
    trained with, each read once for all that resuming checks and says."""

    step_dir: Path
    meta: dict

    @classmethod
    def read(cls, step_dir) -> Resumed:
        return cls(step_dir, read_meta(step_dir))

    @cached_property
    def spec(self):
        """The spec the run was trained with (its text and --set values), parsed when
        first asked (CheckpointError where the checkpoint carries none)."""
        return spec_from_meta(self.meta)


def model_from_meta(step_dir, backend: str = "eager"):
    """(spec, model, meta) of a checkpoint folder; the weights are not loaded yet."""
    meta = read_meta(step_dir)
    spec = spec_from_meta(meta)
    return spec, build_model(spec, backend), meta


def stored_sets(meta: dict, then_spec, keep=lambda key: True) -> str:
    """The --set values the run of `meta` (its spec: `then_spec`) was trained with, of the
    keys `keep` accepts, as flags to give again: each key once, with its last value (a
    resume records its own after the run's), and train.data as the place the run read it
    (relative, it names another file from another folder)."""
    given = override_values(meta.get("overrides", ()))
    return " ".join(f"--set {k}={data_place(then_spec) if k == 'train.data' else v}"
                    for k, v in given.items() if keep(k))


def _weights_shape(model) -> object:
    """What decides a model's parameter shapes (context only sizes rotary tables)."""
    return dataclasses.replace(model, context=0, name=None)


# The settings that shape what a step trains (steps has a note of its own; the others,
# eval_every, save_every, log_every, keep, only say when to evaluate, save and log).
TRAINED_BY = ("batch", "context", "lr", "schedule", "warmup", "min_lr", "weight_decay",
              "grad_clip", "accum", "seed")


def residual_text(spec) -> str:
    """The spec's residual topology as a person would write it: `block_attnres(blocks: 2)`,
    or `custom wiring 'NAME'`."""
    r = spec.residual
    if r.form != "named":
        return f"custom wiring {r.name!r}"
    options = [*((("blocks", r.blocks),) if r.blocks is not None else ()),
               *((("block_size", r.block_size),) if r.block_size is not None else ()),
               *r.options]
    return r.name + (f"({', '.join(f'{k}: {v}' for k, v in options)})" if options else "")


def resume_notes(spec, resumed: Resumed, *, spec_file: bool = True) -> list[str]:
    """What to tell a person resuming `spec` from the checkpoint `resumed`. Raises
    CheckpointError, naming the stored --set values, when the run's weights cannot fit this
    spec's model or it has another topology. `spec_file`: the spec is a file given again
    (else the checkpoint's own, with this run's --set values)."""
    from .loop import TrainConfig, lr_at

    instead = ("leave the spec file out to resume with the checkpoint's own spec and "
               "settings" if spec_file else "leave out the --set values that change it")
    notes = []
    meta, step_dir, then_spec = resumed.meta, resumed.step_dir, resumed.spec
    then = then_spec.model
    # the shape first: another depth also resolves to another topology, but the weights
    # not fitting is what is wrong then
    if _weights_shape(then) != _weights_shape(spec.model):
        differ = [f"{f.name} {getattr(then, f.name)!r} there, {getattr(spec.model, f.name)!r} "
                  f"here" for f in dataclasses.fields(then) if f.compare
                  and f.name not in ("context", "name")
                  and getattr(then, f.name) != getattr(spec.model, f.name)]
        # not train.steps: given again, the resume would end where the run already is
        stored = stored_sets(meta, then_spec, lambda k: k != "train.steps")
        raise CheckpointError(
            f"{step_dir}'s weights do not fit this run's model ({'; '.join(differ)}); resume "
            "with the spec and --set values it was trained with"
            + (f" ({stored})" if stored else "") + f", or {instead}")
    if then_spec.topology != spec.topology:
        stored = stored_sets(meta, then_spec, lambda k: k.split(".")[0] == "residual")
        raise CheckpointError(
            f"{step_dir} was trained as {residual_text(then_spec)}; this run's residual is "
            f"{residual_text(spec)}: its weights would go on under another topology, and "
            "the run folder would be read as the new one's; resume with the residual it was "
            "trained with" + (f" ({stored})" if stored else "") + f" ({instead}), or train "
            "the new topology in a folder of its own (--out)")
    # an override of the run that this one does not give at all (by key: a key given
    # again with another value, e.g. --steps, is a change this run asks for)
    given = override_values(spec.overrides or ())
    missing = stored_sets(meta, then_spec, lambda k: not any(same_setting(k, g)
                                                              for g in given))
    if missing:
        notes.append(f"{step_dir} was trained with {missing}; this run does not give it, so "
                     f"the spec's own value applies")
    old = meta.get("config")
    if old and spec.train is not None:
        new = TrainConfig.from_spec(spec.train, spec.model.context)
        old = TrainConfig(**{k: v for k, v in old.items() if k in TrainConfig.__dataclass_fields__})
        step = int(meta.get("step", 0))
        changed = [f"{k} {getattr(old, k)!r} there, {getattr(new, k)!r} here"
                   for k in TRAINED_BY if getattr(old, k) != getattr(new, k)]
        if data_place(then_spec) != data_place(spec):  # one file, written two ways, is one
            changed.append(f"data {data_place(then_spec)!r} there, {data_place(spec)!r} here")
        if changed:
            notes.append(f"this run trains on with other settings than {step_dir} was "
                         f"trained with ({'; '.join(changed)}): the steps from {step + 1} "
                         "on use this run's")  # step `step` is the checkpoint's, done
        if old.eval_batches != new.eval_batches:  # measures, not trains: a note of its own
            notes.append(f"train.eval_batches is now {new.eval_batches} ({old.eval_batches} in "
                         f"{step_dir}): validation losses from step {step + 1} on average other "
                         f"batches than the ones before, so the curve's two parts do not "
                         f"compare")
        if step >= new.steps:
            notes.append(f"{step_dir} is at step {step}, at or past train.steps ({new.steps}):"
                         " there is nothing to train; give more --steps to go on")
        elif new.steps != old.steps and "constant" not in (new.schedule, old.schedule):
            notes.append(
                f"train.steps is now {new.steps} (the run was scheduled for "
                f"{counted(old.steps, 'step')}): the cosine schedule is re-stretched over "
                f"{counted(new.steps, 'step')}, so the learning rate follows a new curve from "
                f"here (at step {step + 1}, the next: {lr_at(step, old):.3g} before, "
                f"{lr_at(step, new):.3g} now)")  # 0-based
    return notes
