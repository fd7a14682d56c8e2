"""The grid of a sweep: specs x varied overrides x seeds, as jobs named by what differs."""
from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..spec.overrides import FlagOverride, override_key, same_setting, split_values


@dataclass(frozen=True)
class Job:
    """One run of a sweep: `restopo train spec --set ... --seed seed`, in folder `name`."""

    name: str
    arm: str
    spec: str
    overrides: tuple[str, ...]
    seed: int

    def command(self, out: Path, *, resume: bool, threads: int = 1) -> list[str]:
        """`resume`: continue from the run's checkpoint; otherwise start it afresh, over
        whatever a run killed before its first checkpoint left (nothing to lose there)."""
        cmd = [sys.executable, "-m", "restopo", "train", self.spec, "--out", str(out / self.name),
               "--seed", str(self.seed), "--no-progress", "--threads", str(threads)]
        for s in self.overrides:
            cmd += ["--set", s]
        return cmd + (["--resume"] if resume else ["--overwrite"])


def parse_vary(text: str) -> tuple[str, list[str]]:
    """'model.width=64,128' -> ('model.width', ['64', '128']); ValueError names the form."""
    key, eq, values = text.partition("=")
    items = [v.strip() for v in split_values(values)]
    if not eq or not key.strip() or not any(items):
        raise ValueError(f"--vary takes KEY=V1,V2,... e.g. model.width=64,128; got {text!r}")
    if not all(items):
        raise ValueError(f"--vary {text!r} has an empty value; give each value between commas")
    twice = sorted({v for v in items if items.count(v) > 1})
    if twice:
        raise ValueError(f"--vary {text!r} gives {', '.join(twice)} twice; each value is one "
                         f"arm, so give it once")
    return key.strip(), items


def short_name(key: str, value: str) -> str:
    """The part of a run's name one varied value gives: model.width=128 -> width128; a whole
    section's value is named by itself: residual=block_attnres(blocks: 4) ->
    block_attnres_blocks_4 (not residualblock_attnres...)."""
    if "." not in key:
        return re.sub(r"[^A-Za-z0-9_.]+", "_", value).strip("_") or key.strip()
    leaf = key.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{leaf}{value}")


def make_grid(specs, seeds, sets=(), varies=()) -> list[Job]:
    """Every (spec, combination of varied values, seed). `sets` apply to every job."""
    specs = [str(s) for s in specs]
    if not specs:
        raise ValueError("a sweep needs at least one spec file")
    stems = [Path(s).stem for s in specs]
    twice = [s for i, s in enumerate(specs) if s in specs[:i]]
    if twice:
        raise ValueError(f"{twice[0]} is given twice; give each spec once (--seeds repeats "
                         "runs)")
    alike = [(specs[stems.index(s)], spec) for i, (s, spec) in enumerate(zip(stems, specs))
             if s in stems[:i]]
    if alike:  # named, as among many (experiments/*/*.restopo) the pair is hard to find
        raise ValueError(f"{alike[0][0]} and {alike[0][1]} share the name "
                         f"{Path(alike[0][0]).stem!r}; run names come from file names, so "
                         "rename one")
    axes = [parse_vary(v) for v in varies]
    # each value as the override it makes, an error in which points into the --vary typed
    shown = [dict(zip(values, FlagOverride.vary(text))) for (_, values), text in zip(axes, varies)]
    keys = [key for key, _ in axes]
    again = sorted({k for k in keys if keys.count(k) > 1})
    if again:
        raise ValueError(f"--vary {again[0]} is given more than once; give all its values in "
                         f"one --vary {again[0]}=V1,V2,...")
    for text in varies:  # a run's `train --set` would give the key twice, which it refuses
        both = [s for s in sets if same_setting(override_key(s), override_key(text))]
        if both:
            raise ValueError(f"--set {both[0]} and --vary {text} both set "
                             f"{override_key(text)}; give it in one of them")
    for text in (*sets, *varies):  # each run is given --seed S, which train.seed would meet
        if override_key(text) == "train.seed":
            flag = "--set" if text in sets else "--vary"
            raise ValueError(f"{flag} {text}: the seed is the sweep's to give, one run per "
                             f"seed; give --seeds N or --seed-list S,S,... instead")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the seeds {', '.join(map(str, seeds))} repeat one; each seed is one "
                         f"run of every arm")
    jobs = []
    for spec, stem in zip(specs, stems):
        for combo in itertools.product(*[values for _, values in axes]):
            varied = [made[value] for made, value in zip(shown, combo)]
            parts = ([stem] if len(specs) > 1 or not axes else []) + \
                [short_name(key, value) for (key, _), value in zip(axes, combo)]
            arm = "-".join(parts)
            for seed in seeds:
                jobs.append(Job(f"{arm}-s{seed}", arm, spec, tuple(sets) + tuple(varied), seed))
    one_folder_each(jobs)
    return jobs


def one_folder_each(jobs: list[Job]) -> None:
    """Refuse two jobs that a name gives one folder: a name keeps a value's letters, digits,
    '_' and '.', so blocks: 4 and blocks:4, or data a/b.txt and a-b.txt, met in one folder
    (one run failed on the other's lock, or resumed it as its own)."""
    first = {}
    for job in jobs:
        other = first.setdefault(job.name, job)
        if other is not job:
            said = [", ".join(str(o) for o in a.overrides if o not in b.overrides) or a.spec
                    for a, b in ((other, job), (job, other))]
            raise ValueError(f"{said[0]!r} and {said[1]!r} would both train in the run folder "
                             f"{job.name}: give the values in one form each (a run's name "
                             f"keeps only letters, digits, '_' and '.' of a value)")
