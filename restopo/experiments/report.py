"""The comparison of runs: one row per arm (runs that differ only by seed), a markdown and a
CSV table, a reading of the table in plain words, and plots. Everything in the written
report is computed here from the runs; nothing is typed by hand.
"""
from __future__ import annotations

import csv
import io
import os
import platform
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..io import make_folder, write_atomic
from ..spec.datapath import data_place
from ..words import alts, counted
from .grid import short_name
from .runs import EARLY_ENDINGS, Run, family_name
from .stats import Difference, PowerLaw, difference, fit_power_law, mean_std


@dataclass
class Arm:
    """Runs that differ only by seed."""

    name: str
    runs: list[Run]
    parameters: int | None = None
    live_values: int | None = None
    train_flops_per_token: float | None = None
    diff: Difference | None = None          # final validation loss against `against`
    against: Arm | None = None              # its baseline (compare): itself if it is one
    extra: dict = field(default_factory=dict)

    def ended(self, how: str) -> list[Run]:
        """The runs whose Run.ending is `how`."""
        return [r for r in self.runs if r.ending == how]

    @property
    def finished(self) -> list[Run]:
        """The runs that reached their last step: the only ones whose losses are final."""
        return self.ended("finished")

    @property
    def unfinished(self) -> list[Run]:
        """The runs that stopped early and can go on (not those that diverged or failed)."""
        return self.ended("unfinished")

    @property
    def failed(self) -> list[Run]:
        """The runs that stopped at an error (a sweep's run.json says so): run as they
        are, they fail again."""
        return self.ended("failed")

    @property
    def diverged(self) -> list[Run]:
        return self.ended("diverged")

    def by_seed(self, value) -> dict:
        """value(run) per seed, over the finished runs (an unfinished run's last loss is
        not a final one: averaged in, it would pass for one)."""
        out = {}
        for r in self.finished:
            v = value(r)
            if v is not None:
                out[r.seed if r.seed is not None else r.name] = v
        return out

    @property
    def finals(self) -> dict:
        return self.by_seed(lambda r: r.final_val)

    @property
    def bests(self) -> dict:
        return self.by_seed(lambda r: r.best_val)

    @property
    def family(self) -> str:
        return self.runs[0].family

    @property
    def spec_name(self) -> str:
        return self.runs[0].spec_name

    @property
    def settings(self) -> frozenset:
        return self.runs[0].settings

    @property
    def compute(self) -> float | None:
        """Training FLOPs of one run (all steps), from the IR's count per token."""
        r = self.runs[0]
        if self.train_flops_per_token is None or not r.tokens_per_step:
            return None
        return self.train_flops_per_token * r.tokens_per_step * r.planned_steps

    @property
    def seconds_per_step(self) -> float | None:
        times = [r.seconds_per_step for r in self.runs if r.seconds_per_step is not None]
        return sum(times) / len(times) if times else None


def group(runs: list[Run]) -> list[Arm]:
    """Arms in the order their first run appears; only runs with validation losses count.
    Two runs of one arm and one seed are refused: an arm's figures are per seed, and one of
    them was silently left out (and they are no independent samples anyway)."""
    arms: dict[str, Arm] = {}
    for r in runs:
        arms.setdefault(r.arm, Arm(r.arm, [])).runs.append(r)
    for arm in arms.values():
        seen: dict[int, Run] = {}
        for r in arm.runs:
            if r.seed is not None and seen.setdefault(r.seed, r) is not r:
                raise ValueError(
                    f"{seen[r.seed].path} and {r.path} are both arm {arm.name!r}, seed "
                    f"{r.seed}: an arm counts each seed once; compare one of them (or give "
                    f"the other a folder of another name: the arm is the folder's name less "
                    f"-s<seed>, or what a sweep's run.json says)")
    return list(arms.values())


def describe_models(arms: list[Arm]) -> None:
    """Parameters, live values per token and training FLOPs per token of each arm's model,
    from its spec (the copy in its checkpoint)."""
    from ..api import compile as compile_spec
    from ..ir import live_values_per_token
    from ..nn.flops import flops_per_token

    for arm in arms:
        spec = next((r.spec for r in arm.runs if r.spec is not None), None)
        if spec is None or spec.model is None:
            continue
        g = spec.ir()
        arm.parameters = sum(p.numel() for p in compile_spec(spec, backend="eager").parameters())
        arm.live_values = live_values_per_token(g)
        arm.train_flops_per_token = flops_per_token(g, spec.model).train


def pick_baseline(arms: list[Arm], name: str | None) -> Arm | None:
    """The arm named `name` (or the first arm of that spec, where its arms pair with the
    others: baseline_arm); None without a name."""
    if name is None:
        return None
    chosen = baseline_arm(name, [(a.name, a.spec_name, a.settings) for a in arms])
    return next(a for a in arms if a.name == chosen)


def baseline_arm(name: str, arms: list[tuple[str, str, frozenset]]) -> str:
    """Which of `arms` ((name, the spec's stem, settings) triples) --baseline `name` picks:
    the arm of that name, or the one arm of that spec (else of that --vary value, as typed
    or as run names give it: residual=standard as 'standard', train.lr=1e-3 as 'lr1e_3'),
    or the first of those where each other arm has its own among them (a grid of specs x
    --vary values: each is compared with the baseline at its values); ValueError says
    which case failed (a sweep checks its --baseline with this before any run trains,
    compare after)."""
    if any(arm == name for arm, _, _ in arms):
        return name
    what, family = "the spec", [a for a in arms if a[1] == name]
    if not family:
        what, family = "a value", [a for a in arms if any(
            name == short_name(k, v) or short_name(k, name) == short_name(k, v)
            for k, v in a[2])]
    others = [a for a in arms if a not in family]
    if len(family) == 1 or family and others and all(
            counterpart(a, family[0], arms) for a in others):
        return family[0][0]
    if family:
        raise ValueError(
            f"--baseline {name!r} is {what} of {len(family)} arms "
            f"({', '.join(arm for arm, _, _ in family)}): name the one the others are "
            f"compared with" + (f" (--scaling fits all of {name}'s sizes whichever it is)"
                                if what == "the spec" else ""))
    raise ValueError(f"--baseline {name!r} names no arm, spec or --vary value: the arms are "
                     f"{', '.join(arm for arm, _, _ in arms)}")


def compare(arms: list[Arm], baseline: Arm | None) -> None:
    """Each arm's difference to its baseline (pair_baselines); the baseline's own family
    at other sizes (a scaling series) is not an arm against it. `arms` is reordered for
    the report: the baseline first, then the baselines paired with it, then the rest as
    they came (in a folder's order the baseline was anywhere among the rows)."""
    pair_baselines(arms, baseline)
    arms.sort(key=lambda a: 0 if a is baseline else 1 if a.against is a else 2)
    for arm in arms:
        against = compared_with(arm, baseline)
        if against is not None and not measured_otherwise(arm, against):
            arm.diff = difference(arm.finals, against.finals)


def pair_baselines(arms: list[Arm], baseline: Arm | None) -> None:
    """Set each arm's `against`: its counterpart where it has one (in a sweep of topologies
    x --vary values, block at lr 1e-3 against standard at lr 1e-3, not at the baseline's
    lr), else `baseline`; an arm that is a baseline so is its own."""
    for arm in arms:
        arm.against = None
    if baseline is None:
        return
    by_name = {a.name: a for a in arms}
    triples = [(a.name, a.spec_name, a.settings) for a in arms]
    base = (baseline.name, baseline.spec_name, baseline.settings)
    paired = {t[0]: c for t in triples if (c := counterpart(t, base, triples))}
    for arm in arms:
        arm.against = by_name[paired.get(arm.name, baseline.name)]
    for name in [*paired.values(), baseline.name]:
        by_name[name].against = by_name[name]


def _topology(key: str) -> bool:
    return key == "residual" or key.startswith("residual.")


def counterpart(arm: tuple, baseline: tuple, arms: list[tuple]) -> str | None:
    """The name of the arm `arm` is compared with in place of `baseline` (each a (name,
    spec stem, settings) triple), or None: for an arm of another topology (its spec or its
    residual settings), the one arm of the baseline's topology trained with its other
    settings (the same --vary values; maybe the baseline itself)."""
    name, spec, settings = arm
    topology = {(k, v) for k, v in baseline[2] if _topology(k)}
    if spec == baseline[1] and {(k, v) for k, v in settings if _topology(k)} == topology:
        return None  # the baseline's topology: what differs is what is compared
    want = {(k, v) for k, v in settings if not _topology(k)} | topology
    alike = [a[0] for a in arms if a[1] == baseline[1] and a[2] == want]
    return alike[0] if len(alike) == 1 else None


def compared_with(arm: Arm, baseline: Arm | None) -> Arm | None:
    """The arm `arm` is compared with, or None: no baseline, `arm` is a baseline, or it is
    the baseline's family at another size."""
    if baseline is None or arm is baseline or arm.against is arm or same_family(arm, baseline):
        return None
    return arm.against or baseline


def same_family(arm: Arm, baseline: Arm) -> bool:
    return arm is baseline or arm.family == baseline.family


# -- the table ------------------------------------------------------------------------------
COLUMNS = ("arm", "seeds", "final val loss", "best val loss", "vs baseline (95% CI)",
           "s/step", "parameters", "live values/token", "train FLOPs/token")


def _pm(values: dict) -> str:
    if not values:
        return "-"
    m, s = mean_std(values.values())
    return f"{m:.4f} ± {s:.4f}" if len(values) > 1 else f"{m:.4f}"


def _diff(arm: Arm, baseline: Arm | None, named: bool = False) -> str:
    if baseline is None:
        return "-"
    if arm is baseline or arm.against is arm:
        return "baseline"
    against = compared_with(arm, baseline)
    if against is None:  # of the baseline's family: the same size trained again, or not
        same = arm.compute is not None and arm.compute == baseline.compute
        return "baseline, same size" if same else "baseline, another size"
    d = arm.diff
    # where arms are paired with the baseline at their own settings, each names its own
    vs = f" vs {against.name}" if named or against is not baseline else ""
    if d is None:
        return f"({_why_no_interval(arm, against)}){vs}"
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{vs}"


# the one reason for no interval that more seeds cure (the reading then says how to add them)
NEEDS_SEEDS = "needs 2+ seeds"


def _why_no_interval(arm: Arm, baseline: Arm | None) -> str:
    """Why `arm` has no interval against `baseline`: a side with no final loss at all is
    not helped by more seeds, so it is said before the seed count."""
    other = measured_otherwise(arm, baseline) if baseline is not None else []
    if other:
        return f"other {', '.join(other)}: the losses do not compare"
    for side, who in ((arm, ""), (baseline, "the baseline: ")):
        if side is not None and not side.finals:
            return who + ("no run finished" if not side.finished else "no final val loss")
    return NEEDS_SEEDS


def made_by(arms: list[Arm]) -> list[str]:
    """One `restopo train` line per arm from what its runs recorded (seeds as a list);
    nothing for arms whose runs did not record it."""
    lines = []
    for a in arms:
        jobs = {(r.job.get("spec"), tuple(r.job.get("overrides", ()))) for r in a.runs}
        if len(jobs) != 1 or None in next(iter(jobs))[:1]:
            continue
        spec, overrides = next(iter(jobs))
        seeds = ", ".join(str(r.seed) for r in sorted(a.runs, key=lambda r: r.seed or 0))
        sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
        # the folder each seed trained in, as a sweep names it (without --out, train's
        # default folder took the first seed, and refused the next as a run already there)
        folders = {r.path.parent for r in a.runs}
        out = (f" --out {shlex.quote(f'{folders.pop() / a.name}-sS')}" if len(folders) == 1
               and all(r.path.name == f"{a.name}-s{r.seed}" for r in a.runs) else "")
        lines.append(f"restopo train {shlex.quote(spec)}{sets} --seed S{out}   # {a.name}: "
                     f"S = {seeds}")
    return lines


def _gap_verdict(arm: Arm, baseline: Arm) -> str:
    d = arm.diff
    if d is None:
        return f"no interval ({_why_no_interval(arm, arm.against or baseline)})"
    return "95% interval excludes 0" if d.excludes_zero else "within the noise"


def rows(arms: list[Arm], baseline: Arm | None) -> list[list[str]]:
    out, named = [], bool(pairs(arms, baseline))
    for a in arms:
        sps = a.seconds_per_step
        early = {how: a.ended(how) for how in EARLY_ENDINGS}
        seeds = str(len(a.finals)) + "".join(f" (+{len(left)} {how})"
                                             for how, left in early.items() if left)
        out.append([a.name, seeds, _pm(a.finals), _pm(a.bests), _diff(a, baseline, named),
                    "-" if sps is None else f"{sps:.3f}",
                    "-" if a.parameters is None else f"{a.parameters:,}",
                    "-" if a.live_values is None else str(a.live_values),
                    "-" if a.train_flops_per_token is None
                    else f"{a.train_flops_per_token:.3g}"])
    return out


def markdown_table(header, body) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def csv_text(arms: list[Arm], baseline: Arm | None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arm", "seeds", "final_val_mean", "final_val_std", "best_val_mean",
                "best_val_std", "diff_mean", "diff_low", "diff_high", "paired",
                "seconds_per_step", "parameters", "live_values_per_token",
                "train_flops_per_token", *(f"{how}_runs" for how in EARLY_ENDINGS), "baseline"])
    for a in arms:
        fm, fs = mean_std(a.finals.values()) if a.finals else (None, None)
        bm, bs = mean_std(a.bests.values()) if a.bests else (None, None)
        d, against = a.diff, compared_with(a, baseline)
        w.writerow([a.name, len(a.finals), fm, fs, bm, bs,
                    d.mean if d else "", d.low if d else "", d.high if d else "",
                    d.paired if d else "", a.seconds_per_step or "", a.parameters or "",
                    a.live_values or "", a.train_flops_per_token or "",
                    *(" ".join(r.name for r in a.ended(how)) for how in EARLY_ENDINGS),
                    against.name if against else ""])
    return buf.getvalue()


def reading(arms: list[Arm], baseline: Arm | None) -> list[str]:
    """What the table says, arm by arm, and whether the seed spread allows saying it."""
    paired = pairs(arms, baseline)
    # paired, the settings that differ between pairs (the --vary axis) are no gap's cause
    differ = settings_differ(arms, within=paired or None)
    unlike = [f"- **The runs were not trained alike**, so their differences are not the "
              f"topology's alone: {'; '.join(differ)}."] if differ else []
    unlike += unfinished_note(arms)
    if baseline is None:
        return ["No baseline was named (--baseline), so no arm is compared with another."] + \
            unlike
    lines = pairing_note(arms, baseline)
    for a in arms:
        d, against = a.diff, compared_with(a, baseline)
        if d is None or against is None:
            continue
        how = "paired by seed" if d.paired else "unpaired"
        if d.excludes_zero:
            # the gap's size beside its direction: '-0.05 lower' read as higher
            verdict = ("lower (better) than" if d.mean < 0 else "higher (worse) than")
            lines.append(f"- **{a.name}**: final validation loss {abs(d.mean):.4f} {verdict} "
                         f"{against.name}; the 95% interval [{d.low:+.4f}, {d.high:+.4f}] "
                         f"({how}, n = {d.n}) excludes zero.")
        else:
            lines.append(f"- **{a.name}**: {d.mean:+.4f} against {against.name}, within the "
                         f"noise: the 95% interval [{d.low:+.4f}, {d.high:+.4f}] ({how}, "
                         f"n = {d.n}) contains zero.")
    # said, not left to a table cell: with one seed the reading said nothing of these arms
    bare = [(a, b) for a in arms if a.diff is None and (b := compared_with(a, baseline))]
    if bare:
        lines.append("- **No interval**, so no gap is claimed: "
                     + "; ".join(f"{a.name} against {b.name} ({_why_no_interval(a, b)})"
                                 for a, b in bare) + "."
                     + (" An interval needs two or more finished seeds of an arm and of its "
                        "baseline: a sweep again with a higher --seeds and the same --out "
                        "adds seeds and keeps the runs it has." if any(
                            _why_no_interval(a, b) == NEEDS_SEEDS for a, b in bare)
                        else ""))
    # each gap against the seed spread of the baseline it is a gap to
    gaps = [(abs(a.diff.mean), compared_with(a, baseline)) for a in arms if a.diff is not None]
    spreads = {b.name: mean_std(b.finals.values())[1] for _, b in gaps}
    if gaps and all(spreads.values()):
        wider = sum(g > spreads[b.name] for g, b in gaps)
        lo, hi = min(spreads.values()), max(spreads.values())
        said = (f"The baseline's seed spread (standard deviation of its final loss) is "
                f"{lo:.4f}; {wider} of {len(gaps)} gaps to it are larger" if len(spreads) == 1
                else f"The baselines' seed spreads (standard deviation of each one's final "
                     f"loss) are {lo:.4f} to {hi:.4f}; {wider} of {len(gaps)} gaps are larger "
                     f"than their own baseline's")
        # an interval that excludes zero tells its arm apart though the gap is within the
        # spread: pairing by seed takes out what the seeds share
        told = [a.name for a in arms if a.diff is not None and a.diff.excludes_zero]
        lines.append(f"- {said} (the largest {max(g for g, _ in gaps):.4f})"
                     + ("." if wider else
                        f": all within the seed spread; the ordering is established only "
                        f"where an interval above excludes zero ({alts(told)})." if told else
                        ": at this scale the seed spread is as large as the gaps, and the "
                        "ordering of arms is not established."))
    lines += unlike
    lines.append(timing_note([r for a in arms for r in a.runs]))
    return lines


def pairs(arms: list[Arm], baseline: Arm | None) -> list[tuple[Arm, Arm]]:
    """(arm, its baseline) of every compared arm where some are compared with the baseline's
    spec at their own settings (pair_baselines), else none."""
    out = [(a, b) for a in arms if (b := compared_with(a, baseline)) is not None]
    return out if any(b is not baseline for _, b in out) else []


def pairing_note(arms: list[Arm], baseline: Arm | None) -> list[str]:
    """Which arm each was compared with, where not all with the baseline named."""
    paired = pairs(arms, baseline)
    if not paired:
        return []
    return ["- **Each arm is compared with the baseline's topology trained with its own "
            "other settings** (its --vary values): "
            + "; ".join(f"{a.name} with {b.name}" for a, b in paired) + "."]


def unfinished_note(arms: list[Arm]) -> list[str]:
    """The runs left out of the final and best losses because they stopped early, failed
    or diverged."""
    left = [r for a in arms for r in a.unfinished]
    failed = [r for a in arms for r in a.failed]
    lost = [r for a in arms for r in a.diverged]
    out = []
    if left:
        out.append(f"- **Left out of the final and best losses, unfinished** "
                   f"({counted(len(left), 'run')}; `restopo sweep` again, or `restopo train "
                   f"--resume`, finishes them): "
                   + "; ".join(f"{r.name} ({r.progress})" for r in left) + ".")
    if failed:  # not 'unfinished': run again as they are, they meet the same error
        out.append(f"- **Left out of the final and best losses, failed** "
                   f"({counted(len(failed), 'run')}: training stopped at an error, which "
                   f"each run's train.log shows in full; fix it, then `restopo sweep` "
                   f"again tries them again): "
                   + "; ".join(f"{r.name} ({r.progress}; {r.error or 'no error recorded'})"
                               for r in failed) + ".")
    if lost:
        out.append(f"- **Left out of the final and best losses, diverged** "
                   f"({counted(len(lost), 'run')}: the loss or the weights became NaN or "
                   f"infinite and training stopped; resumed as they are they diverge again, "
                   f"so lower train.lr or train.grad_clip and train them anew): "
                   + "; ".join(f"{r.name} ({r.progress})" for r in lost) + ".")
    return out


def timing_note(runs) -> str:
    """Whether the s/step column compares arms: only if every run had the machine to itself
    in the same way (a sweep records the load average each run ran under)."""
    loads = [r.load for r in runs if r.load.get("load_max") is not None]
    if len(loads) < len(runs):
        return ("- s/step is wall time under whatever else the machine ran, which was not "
                "recorded for every run: it does not compare arms. `python bench/overhead.py` "
                "measures the aggregations' cost side by side.")
    lo = min(x["load_mean"] for x in loads)
    hi = max(x["load_max"] for x in loads)
    cpus = max(x.get("cpus") or 1 for x in loads)
    if hi <= cpus and hi - lo <= 0.5 * cpus:
        return (f"- s/step was measured at a load average of {lo:.1f} to {hi:.1f} on {cpus} "
                "CPUs: the runs did not compete for cores, so it compares arms roughly "
                "(`python bench/overhead.py` measures the overhead side by side).")
    return (f"- s/step was measured at a load average of {lo:.1f} to {hi:.1f} on {cpus} CPUs: "
            "runs competed for cores under a changing load, so it does not compare arms. "
            "`python bench/overhead.py` measures the aggregations' cost side by side.")


# Settings that make a validation loss another quantity: the text it is measured on, the
# vocabulary it is over. No gap is taken across them. (Another context is the same
# quantity, conditioned on less: a gap across it is said to be not the topology's alone.)
MEASURES = ("data", "vocab")


def measured_otherwise(arm: Arm, baseline: Arm) -> list[str]:
    """The MEASURES in which `arm`'s runs and `baseline`'s differ."""
    seen = _setting_values([arm, baseline])
    return [k for k in MEASURES if len(seen.get(k, ())) > 1]


# What a run's training was, besides its seed and the bookkeeping of evaluation, logging
# and checkpoints: runs that differ in any of these differ in more than their topology.
SETTINGS = ("data", "steps", "batch", "lr", "schedule", "warmup", "min_lr", "weight_decay",
            "grad_clip", "accum")


def settings_differ(arms: list[Arm], within: list[tuple[Arm, Arm]] | None = None) -> list[str]:
    """The training settings (SETTINGS, the context and the vocab) that are not the same
    for every run, each as 'key: value (arms), value (arms)'; `within`: only those that
    differ between an arm and the baseline it is compared with."""
    seen = _setting_values(arms)
    if within is not None:
        keys = {k for pair in within for k, by in _setting_values(pair).items() if len(by) > 1}
        seen = {k: by for k, by in seen.items() if k in keys}
    return [f"{k}: " + ", ".join(f"{v} ({', '.join(dict.fromkeys(names))})"
                                 for v, names in by.items())
            for k, by in seen.items() if len(by) > 1]


def _setting_values(arms) -> dict[str, dict]:
    """key -> value -> names of the arms whose runs trained with it."""
    seen: dict[str, dict] = {}
    for a in arms:
        for r in a.runs:
            if r.spec is None or r.spec.train is None:
                continue
            values = {k: getattr(r.spec.train, k) for k in SETTINGS}
            values["data"] = data_place(r.spec)  # not as written: where the run read it
            values["context"] = r.spec.model.context if r.spec.model is not None else None
            values["vocab"] = r.spec.model.vocab if r.spec.model is not None else None
            for k, v in values.items():
                seen.setdefault(k, {}).setdefault(v, []).append(a.name)
    return seen


def loss_unit(arms: list[Arm]) -> str:
    """What a loss is per: a byte-level token when every model reads bytes (trained on text,
    reads_bytes), else a token of the vocab(s) the runs used (losses over other vocabularies
    do not compare)."""
    from ..train.data import reads_bytes, trained_on
    specs = [r.spec for a in arms for r in a.runs
             if r.spec is not None and r.spec.model is not None]
    if specs and all(reads_bytes(s.model.vocab, trained_on(s)) for s in specs):
        return "byte-level token"
    vocabs = sorted({s.model.vocab for s in specs})
    if len(vocabs) == 1:
        return f"token (vocab {vocabs[0]:,})"
    return ("token of each run's own vocabulary (" + ", ".join(f"{v:,}" for v in vocabs)
            + "): losses over different vocabularies do not compare") if vocabs else "token"


def scale_note(arms: list[Arm]) -> str:
    """What these runs are, in numbers, against the paper's setting."""
    read = [x for a in arms for x in a.runs if x.meta]
    if not read:
        return ("Scale: not known; no run has a checkpoint to read its model and training "
                "settings from.")
    r = read[0]
    params = [a.parameters for a in arms if a.parameters]
    budgets = {(x.planned_steps, x.tokens_per_step) for x in read}
    data = data_place(r.spec) if r.spec is not None and r.spec.train is not None else "?"
    if len(budgets) == 1:
        budget = (f"{r.tokens_per_step * r.planned_steps:,} training tokens per run "
                  f"({counted(r.planned_steps, 'step')} of "
                  f"{counted(r.tokens_per_step, 'token')})")
    else:  # one budget per arm, never the first run's for all
        budget = "training tokens per run differing by arm: " + "; ".join(
            f"{a.name} " + " or ".join(sorted({f"{x.tokens_per_step * x.planned_steps:,} "
                                                f"({counted(x.planned_steps, 'step')} of "
                                                f"{x.tokens_per_step:,})" for x in a.runs
                                               if x.meta}))
            for a in arms if any(x.meta for x in a.runs))
    return (f"Scale: {min(params):,} to {max(params):,} parameters" if params else "Scale: ") + \
        (f", {budget}, data `{data}`. The paper's ablation trained "
         "436M-parameter models on far more tokens and reports gaps of a few thousandths of "
         "a nat between its arms; a sign that agrees with it here is suggestive, not a "
         "replication, and a gap whose 95% interval contains zero says nothing either way.")


# -- compute equivalence ------------------------------------------------------------------------
def compute_equivalence(arms: list[Arm], baseline_family: str) -> tuple[PowerLaw, list[tuple]]:
    """Fit the baseline family's final loss against training compute over its sizes; for
    every other arm, the baseline compute that reaches its loss, as a multiple of its own."""
    base = scaling_series(arms, baseline_family)
    fit = fit_power_law([a.compute for a in base],
                        [mean_std(a.finals.values())[0] for a in base])
    out = []
    for a in arms:
        if a.family == baseline_family or not a.compute or not a.finals:
            continue
        loss = mean_std(a.finals.values())[0]
        out.append((a, loss, a.compute, fit.compute_for(loss) / a.compute))
    return fit, out


def scaling_series(arms: list[Arm], family: str) -> list[Arm]:
    """The arms of `family` a loss-against-compute fit takes: those with a compute and a
    final loss."""
    return [a for a in arms if a.family == family and a.compute and a.finals]


# -- plots -------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    _pyplot().close(fig)
    return path


def plot_curves(arms: list[Arm], path: Path, *, tokens: bool) -> Path:
    """Validation loss per arm: the mean over seeds, and a band from the lowest to the
    highest seed at each evaluation."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, a in enumerate(arms):
        per_step: dict[int, list[float]] = {}
        for r in a.runs:
            for s, v in r.val_curve():
                per_step.setdefault(s, []).append(v)
        if not per_step:
            continue
        steps = sorted(per_step)
        scale = a.runs[0].tokens_per_step if tokens else 1
        x = [s * scale for s in steps]
        mean = [sum(per_step[s]) / len(per_step[s]) for s in steps]
        # ten colours, then the same colours dashed: every arm its own line; a mark at each
        # evaluation, or a run evaluated once (short runs, eval_every past the end) shows none
        line, = ax.plot(x, mean, ("-", "--", ":")[i // 10 % 3], color=f"C{i % 10}", lw=1.5,
                        marker="o", ms=3, label=f"{a.name} ({len(a.runs)})")
        ax.fill_between(x, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps],
                        color=line.get_color(), alpha=0.18, lw=0)
    ax.set_xlabel("training tokens" if tokens else "step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("validation loss: mean over seeds, band from lowest to highest seed",
                 fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    else:  # a legend of nothing is a matplotlib warning the user saw, with its source line
        ax.text(0.5, 0.5, "no run has a validation loss yet", ha="center",
                transform=ax.transAxes)
    _tail_ylim(ax, arms)
    return _save(fig, path)


def _tail_ylim(ax, arms: list[Arm]) -> None:
    """Zoom on the second half of training, where the arms separate (the start is shared)."""
    tail = [v for a in arms for r in a.runs for s, v in r.val_curve()
            if s >= r.planned_steps / 2]
    if tail:
        lo, hi = min(tail), max(tail)
        pad = 0.15 * (hi - lo or 0.05)
        ax.set_ylim(lo - pad, hi + 4 * pad)


def plot_finals(arms: list[Arm], baseline: Arm | None, path: Path) -> Path:
    """Final validation loss per arm: every seed as a dot, the mean with its spread."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(arms) + 2), 4.2))
    for i, a in enumerate(arms):
        vals = list(a.finals.values())
        if not vals:
            continue
        m, s = mean_std(vals)
        ax.errorbar([i], [m], yerr=[s], fmt="o", capsize=4, ms=6,
                    color="black" if a is baseline or a.against is a else "C0")
        ax.plot([i] * len(vals), vals, ".", color="C1", ms=5, alpha=0.8)
    if baseline is not None and baseline.finals and \
            not any(a.against is a and a is not baseline for a in arms):  # one baseline
        ax.axhline(mean_std(baseline.finals.values())[0], color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(arms)), [a.name for a in arms], rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("final validation loss")
    ax.set_title("final validation loss: mean ± std over seeds (dots: seeds)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def family_names(arms: list[Arm]) -> dict[str, str]:
    """Each family as the report names it: less the settings every arm shares, which tell
    no family from another (a sweep's --set train.lr=... named each one with it)."""
    runs = [a.runs[0] for a in arms]
    shared = set.intersection(*(set(r.family_settings) for r in runs)) if runs else set()
    return {r.family: family_name(r.spec_name, [s for s in r.family_settings
                                                if s not in shared]) for r in runs}


def plot_scaling(arms: list[Arm], fit: PowerLaw, baseline_family: str, path: Path) -> Path:
    named = family_names(arms)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = scaling_series(arms, baseline_family)
    cs = [a.compute for a in base]
    lo, hi = min(cs) / 1.5, max(cs) * 1.5
    grid = [lo * (hi / lo) ** (k / 50) for k in range(51)]
    ax.plot(grid, [fit.loss(c) for c in grid], "k--", lw=1,
            label=f"{named[baseline_family]} fit: {fit.a:.3g} C^-{fit.b:.3g} (R² {fit.r2:.3f})")
    ax.plot(cs, [mean_std(a.finals.values())[0] for a in base], "ko",
            label=named[baseline_family])
    for family in sorted({a.family for a in arms} - {baseline_family}):
        pts = [a for a in arms if a.family == family and a.compute and a.finals]
        ax.plot([a.compute for a in pts], [mean_std(a.finals.values())[0] for a in pts], "o",
                label=named[family])
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter
    ax.yaxis.set_major_formatter(ScalarFormatter())  # plain losses, not 1.6 x 10^0
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    _label_what_fits(ax)
    return _save(fig, path)


def _label_what_fits(ax) -> None:
    """Leave out each tick label that would overlap one kept: a log axis over a decade or
    two is labelled at 2, 3, 4 and 6 x 10^n too, closer than such labels are wide (the
    compute axis read '3x10^11 4x10^11' run together). Major ticks (decades) first, then
    the minor ones in order; every axis of `ax`, measured as drawn."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    ax.figure.canvas.draw()  # extents scale with the dpi as the axes do: any dpi will do
    for axis in (ax.xaxis, ax.yaxis):
        scale = axis.get_transform()  # in view as matplotlib draws it: to a hair past the ends
        lo, hi = sorted(scale.transform(np.asarray(axis.get_view_interval())))
        slack = 1e-9 * (hi - lo)
        kept, dropped = [], set()
        for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks),
                            (axis.get_minorticklocs(), axis.get_minor_ticks)):
            for x, tick in zip(locs, ticks(len(locs))):
                label = tick.label1
                if not (lo - slack <= scale.transform(np.asarray([x]))[0] <= hi + slack
                        and label.get_visible() and label.get_text()):
                    continue
                box = label.get_window_extent().padded(2)
                if any(box.overlaps(k) for k in kept):
                    dropped.add(x)
                else:
                    kept.append(box)
        for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                         (axis.get_minor_formatter, axis.set_minor_formatter)):
            put(FuncFormatter(lambda x, pos, f=get(), dropped=dropped: "" if x in dropped
                              else f(x, pos)))


# -- the whole report ------------------------------------------------------------------------
def machine() -> str:
    import torch

    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def write_report(arms: list[Arm], baseline: Arm | None, out: Path, command: list[str], *,
                 scaling: bool = False, title: str = "restopo compare") -> dict[str, Path]:
    """results.md, results.csv and the plots in `out`; returns their paths. A --scaling
    that cannot be fitted is refused before anything is written (a report left half new,
    half old, in a sweep's folder)."""
    if scaling:
        if baseline is None:
            raise ValueError("--scaling needs --baseline (the family fitted across sizes)")
        try:
            fit, equiv = compute_equivalence(arms, baseline.family)
        except ValueError as e:
            raise ValueError(f"--scaling: {e}") from None
    make_folder(out)
    paths = {"csv": out / "results.csv", "md": out / "results.md"}
    before = report_figures(paths["md"])
    write_atomic(paths["csv"], csv_text(arms, baseline))
    paths["curves"] = plot_curves(arms, out / "val_loss_by_step.png", tokens=False)
    paths["curves_tokens"] = plot_curves(arms, out / "val_loss_by_tokens.png", tokens=True)
    paths["finals"] = plot_finals(arms, baseline, out / "final_val_loss.png")
    md = [f"# {title}", "",
          "Written by `restopo compare`; regenerate it with:", "",
          "```sh", " ".join(shlex.quote(c) for c in command), "```", "",
          f"Machine: {machine()}. Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
          "", "## Final validation loss", "",
          markdown_table(COLUMNS, rows(arms, baseline)),
          f"Loss in nats per {loss_unit(arms)}, mean ± standard deviation over seeds. "
          "`vs baseline`: the difference of the means with its 95% interval (paired by seed "
          "when both arms ran the same seeds: same data order and same sublayer weights at "
          "step 0)" + ("; an arm of another topology is compared with the baseline's "
                       "trained with its own other settings (a sweep's --vary values), named "
                       "in the cell"
                       if pairs(arms, baseline) else "")
          + ". `s/step`: wall time per step over the whole run, evaluation included.",
          "", "## What the figures show, and what they do not", ""]
    md += reading(arms, baseline) + ["", scale_note(arms), ""]
    made = made_by(arms)
    if made:
        md += ["## How the runs were made", "",
               "Each arm's `restopo train` (a sweep recorded it in each run's run.json; "
               "`restopo sweep` with the same specs, `--vary` and `--seeds` makes them all):",
               "", "```sh", *made, "```", ""]
    md += ["## Curves", "", "![validation loss by step](val_loss_by_step.png)", "",
           "![validation loss by training tokens](val_loss_by_tokens.png)", "",
           "![final validation loss per arm](final_val_loss.png)", ""]
    if scaling:
        paths["scaling"] = plot_scaling(arms, fit, baseline.family, out / "scaling.png")
        named = family_names(arms)[baseline.family]
        md += ["## Compute equivalence", "",
               f"{named}'s final loss against training compute, fitted over its "
               f"{len({a.compute for a in scaling_series(arms, baseline.family)})} sizes: "
               f"loss = {fit.a:.4g} · C^-{fit.b:.4g} (R² {fit.r2:.3f}). For each other arm, "
               f"the compute the fitted {named} needs to reach its loss, as a "
               "multiple of the compute it used (above 1: it matches a larger-compute "
               "baseline). A ratio is only as sure as the loss gap under it: where the "
               "gap's 95% interval contains zero, the ratio is not told apart from 1.", "",
               markdown_table(("arm", "final val loss", "compute (FLOPs)",
                               f"{named} compute to match / own",
                               "loss gap vs baseline"),
                              [[a.name, f"{loss:.4f}", f"{c:.3g}", f"{ratio:.3f}",
                                _gap_verdict(a, baseline)] for a, loss, c, ratio in equiv]),
               "![compute equivalence](scaling.png)", ""]
    write_atomic(paths["md"], "\n".join(md))
    # a figure the report before this one drew and this one does not (scaling.png of an
    # earlier --scaling) would sit beside the new report as if it were the new report's
    for name in before - {p.name for p in paths.values()}:
        (out / name).unlink(missing_ok=True)
    return paths


def report_figures(md: Path) -> set[str]:
    """The figures a results.md that compare wrote links (in its own folder): compare's
    own files, unlike any other PNG there."""
    try:
        text = md.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    if "Written by `restopo compare`" not in text:
        return set()
    return set(re.findall(r"!\[[^\]]*\]\(([^()/\\]+\.png)\)", text))


def elapsed(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
