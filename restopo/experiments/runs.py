"""Run folders, as `restopo train` leaves them, read back for comparison.

A run folder holds metrics.jsonl and ckpt/ (meta.json of the newest checkpoint carries the
spec text and overrides). A sweep adds run.json: the arm the run belongs to, its seed and
status. Without run.json the arm is the folder's name less a trailing `-s<seed>`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..spec.overrides import override_values
from ..train.checkpoint import newest_meta
from ..train.plots import read_metrics

RUN_FILE = "run.json"
# How a run can have stopped short of its last step (Run.ending, else 'finished'): such runs
# are left out of the final losses, and said apart, in this order.
EARLY_ENDINGS = ("unfinished", "failed", "diverged")
_SEED = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


class RunError(ValueError):
    """A folder that is not a run (message names it and says what was looked for)."""


# Overrides that change a run's size, not what it is: its parameters (width, depth) or its
# training tokens (steps, batch), the two axes a loss-against-compute fit spans. Runs of one
# spec that differ only in these are one family at several sizes. Heads are not a size (the
# same parameters and FLOPs, split otherwise), nor is the context (it changes what a token's
# loss is conditioned on, so losses at two contexts are not one curve): arms that differ in
# them are compared. The seed is not a size, but neither does it make a family.
SIZE_KEYS = frozenset({"model.width", "model.depth", "train.steps", "train.batch",
                       "train.seed"})


@dataclass
class Run:
    path: Path
    arm: str
    seed: int | None
    meta: dict = field(repr=False)
    records: list[dict] = field(repr=False)
    status: str = "done"  # done | partial | failed | diverged (run.json, else inferred)
    load: dict = field(default_factory=dict, repr=False)  # load_mean/max, cpus (run.json)
    job: dict = field(default_factory=dict, repr=False)   # spec, overrides (run.json)
    error: str = ""  # why it failed, as run.json records it

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    @property
    def steps(self) -> int:
        """Optimizer steps the run has done."""
        return int(self.meta.get("step") or 0)

    @property
    def planned_steps(self) -> int:
        return int(self.config.get("steps") or self.steps)

    @property
    def finished(self) -> bool:
        """Whether the run reached its last step, by its newest checkpoint (not by run.json,
        which a sweep killed outright leaves at 'running'): only then is its last
        validation loss a final one."""
        return reached_end(self.meta)

    @property
    def diverged(self) -> int | None:
        """The step at which the run stopped because its loss (or its weights) became NaN or
        infinite (as its metrics record), else None. Such a run is not unfinished: resuming
        it from its last checkpoint diverges again."""
        return diverged_step(self.records)

    @property
    def ending(self) -> str:
        """How the run stopped: finished, else one of EARLY_ENDINGS: diverged (resumed, it
        diverges again), failed at an error (run again as it is, it fails again), else
        unfinished (it can go on)."""
        if self.finished:
            return "finished"
        if self.diverged is not None:
            return "diverged"
        return "failed" if self.status == "failed" else "unfinished"

    @property
    def progress(self) -> str:
        """'step 300 of 400' (or 'no checkpoint', or 'diverged at step 230: loss nan') for a
        note on a run that did not finish."""
        if self.diverged is not None:
            last = self.records[-1]  # 'in': what diverged, when not the loss
            return (f"diverged at step {self.diverged}: {last.get('in', 'loss')} "
                    f"{last['diverged']}")
        if not self.meta:
            return "no checkpoint"
        return f"step {self.steps} of {self.planned_steps}"

    @property
    def tokens_per_step(self) -> int:
        return int(self.config.get("batch", 0)) * int(self.config.get("context", 0))

    def val_curve(self) -> list[tuple[int, float]]:
        return [(r["step"], r["val_loss"]) for r in self.records
                if r.get("val_loss") is not None]

    @property
    def final_val(self) -> float | None:
        curve = self.val_curve()
        return curve[-1][1] if curve else None

    @property
    def best_val(self) -> float | None:
        curve = self.val_curve()
        return min(v for _, v in curve) if curve else None

    @property
    def seconds_per_step(self) -> float | None:
        """Wall time per step over the whole run (training, evaluation and saving)."""
        timed = [r for r in self.records if r.get("elapsed") is not None]
        if not timed or not timed[-1]["step"]:
            return None
        return timed[-1]["elapsed"] / timed[-1]["step"]

    @cached_property
    def spec(self):
        """The checked spec the run trained (from its checkpoint), or None; a relative
        train.data in it is read from where the run read it."""
        from ..train.runspec import spec_from_meta

        if not isinstance(self.meta.get("spec_text"), str):
            return None
        return spec_from_meta({"spec_path": "<run>", **self.meta})

    @property
    def spec_name(self) -> str:
        """The spec file's stem (what --baseline may name)."""
        return Path(str(self.meta.get("spec_path", self.job.get("spec", self.arm)))).stem

    @property
    def settings(self) -> frozenset:
        """What its overrides set, but the seed (as a sweep recorded them, else its
        checkpoint): the same for every seed of an arm."""
        return settings_of(self.job.get("overrides") or self.meta.get("overrides") or ())

    @property
    def family_settings(self) -> list[str]:
        """Its overrides that are not a size (SIZE_KEYS), as sorted `key=value`."""
        return sorted(f"{k}={v}" for k, v in self.settings if k not in SIZE_KEYS)

    @property
    def family(self) -> str:
        """What the run trained, without its size: the spec file's stem and every override
        that is not a size (SIZE_KEYS). Arms of one spec that differ in topology or lr are
        families of their own, compared with the baseline; those that differ in width or
        steps are one family's sizes (compare --scaling fits them)."""
        return family_name(self.spec_name, self.family_settings)


def family_name(spec_name: str, settings) -> str:
    return spec_name + (f" [{', '.join(settings)}]" if settings else "")


def settings_of(overrides) -> frozenset:
    """(key, value) of each setting `overrides` give, but train.seed (`restopo train
    --seed` records one, a sweep's job does not)."""
    return frozenset((k, v) for k, v in override_values(overrides).items() if k != "train.seed")


def reached_end(meta: dict) -> bool:
    """Whether a checkpoint's meta.json is of its run's last step (train.steps)."""
    planned = int(meta.get("config", {}).get("steps") or 0)
    return planned > 0 and int(meta.get("step") or 0) >= planned


def diverged_step(records: list[dict]) -> int | None:
    """The step a run's loss became NaN or infinite at, as the last of its metrics records
    (restopo train writes it before it stops), else None."""
    last = records[-1] if records else {}
    return last.get("step") if last.get("diverged") is not None else None


def read_run(path: str | Path) -> Run:
    """The run in folder `path`; RunError when it holds neither metrics nor checkpoints."""
    path = Path(path)
    info = _json(path / RUN_FILE)
    _, meta = newest_meta(path / "ckpt")  # a damaged newest meta.json: the one before it
    records = read_metrics(path / "metrics.jsonl")
    if not meta and not records and not info:
        raise RunError(f"{path}: not a run folder (no metrics.jsonl, ckpt/ or {RUN_FILE})")
    m = _SEED.match(path.name)
    arm = info.get("arm") or (m.group("arm") if m else path.name)
    seed = info.get("seed", meta.get("config", {}).get("seed",
                                                       int(m.group("seed")) if m else None))
    status = info.get("status") or ("done" if reached_end(meta) else "partial")
    load = {k: info[k] for k in ("load_mean", "load_max", "cpus") if k in info}
    job = {k: info[k] for k in ("spec", "overrides") if k in info}
    run = Run(path, arm, seed, meta, records, status, load, job, str(info.get("error") or ""))
    if run.diverged is not None and not run.finished:  # more than run.json's 'failed' says
        run.status = "diverged"
    return run


def sweep_runs(folder: Path) -> list[Path]:
    """The runs a sweep keeps in `folder` (its --out): the folders inside with its run.json."""
    return sorted((p.parent for p in Path(folder).glob(f"*/{RUN_FILE}")), key=_natural)


def holds_a_run(folder: Path) -> bool:
    """Whether `folder` is a run folder itself (restopo train --out), whatever it holds."""
    try:
        read_run(folder)
    except RunError:
        return False
    return True


def find_runs(paths) -> list[Run]:
    """Runs from folders given on the command line: a run folder, or a folder of runs (a
    sweep's --out), or both. Folders that are not runs inside a sweep folder are skipped."""
    runs = []
    for p in map(Path, paths):
        if p.exists() and not p.is_dir():
            raise RunError(f"{p} is a file; give a run folder (restopo train --out) or a "
                           f"folder of runs (restopo sweep --out)")
        if not p.is_dir():
            raise RunError(f"{p}: no such folder")
        try:
            own = [read_run(p)]
        except RunError:
            own = []
        # a run folder may hold runs too (a sweep's --out that a `train --out` trained in):
        # read as the one run alone, the sweep's runs were left out without a word
        inner = []
        for child in sorted((q for q in p.iterdir() if q.is_dir()), key=_natural):
            try:
                inner.append(read_run(child))
            except RunError:
                continue
        if not own and not inner:
            raise RunError(f"{p}: neither a run folder nor a folder of runs")
        runs += own + inner
    return runs


def _natural(path: Path) -> list:
    """A folder's runs in the order of the numbers in their names (width16, width32,
    width128; s2 before s10; lr0.0003 before lr0.001), where sorted text put width128
    first. Split so, text and numbers alternate: each position compares like with like."""
    parts = re.split(r"(\d+(?:\.\d+)?)", path.name)
    return [float(t) if i % 2 else t for i, t in enumerate(parts)]


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
