"""Statistics for comparing runs: no scipy, small samples, honest intervals."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond, the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: float) -> float:
    """The t quantile for a 95% two-sided interval; fractional df round down (wider)."""
    if df < 1:
        return math.inf
    k = int(math.floor(df))
    return _T975[k - 1] if k <= len(_T975) else 1.96


def mean_std(xs) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    xs = list(xs)
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclass(frozen=True)
class Difference:
    """mean(arm) - mean(baseline) with a 95% interval (low, high); paired over shared seeds
    when every seed of one is a seed of the other, else Welch's."""

    mean: float
    low: float
    high: float
    paired: bool
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def difference(arm: dict, baseline: dict) -> Difference | None:
    """arm, baseline: seed -> value. None when an interval cannot be formed (fewer than two
    values on a side)."""
    shared = sorted(set(arm) & set(baseline))
    if len(shared) >= 2 and len(shared) == len(arm) == len(baseline):
        d = [arm[s] - baseline[s] for s in shared]
        m, sd = mean_std(d)
        half = t975(len(d) - 1) * sd / math.sqrt(len(d))
        return Difference(m, m - half, m + half, True, len(d))
    if len(arm) < 2 or len(baseline) < 2:
        return None
    (ma, sa), (mb, sb) = mean_std(arm.values()), mean_std(baseline.values())
    va, vb = sa ** 2 / len(arm), sb ** 2 / len(baseline)
    se = math.sqrt(va + vb)
    if se == 0:
        return Difference(ma - mb, ma - mb, ma - mb, False, len(arm) + len(baseline))
    df = (va + vb) ** 2 / ((va ** 2 / (len(arm) - 1)) + (vb ** 2 / (len(baseline) - 1)))
    half = t975(df) * se
    return Difference(ma - mb, ma - mb - half, ma - mb + half, False, len(arm) + len(baseline))


@dataclass(frozen=True)
class PowerLaw:
    """loss = a * compute^(-b), fitted by least squares on log loss against log compute."""

    a: float
    b: float
    r2: float

    def loss(self, compute: float) -> float:
        return self.a * compute ** (-self.b)

    def compute_for(self, loss: float) -> float:
        """The compute at which the fitted curve reaches `loss`."""
        return (loss / self.a) ** (-1.0 / self.b)


def fit_power_law(compute, loss) -> PowerLaw:
    """Fit loss = a C^-b to points (C_i, L_i); needs three or more distinct compute values
    and a loss that falls with compute (b > 0), else ValueError saying what is wrong."""
    pts = [(math.log(c), math.log(l)) for c, l in zip(compute, loss)]
    if len({x for x, _ in pts}) < 3:
        raise ValueError("a compute-equivalence fit needs the baseline at three or more sizes "
                         f"(compute values); got {len({x for x, _ in pts})}: train it at more "
                         f"(restopo sweep SPEC --vary model.width=32,48,96 --out DIR) and "
                         f"compare that folder too")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    slope = sxy / sxx
    if slope >= 0:
        raise ValueError("the baseline's loss does not fall with compute across its sizes "
                         "(train longer or over a wider range of sizes)")
    intercept = my - slope * mx
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in pts)
    ss_tot = sum((y - my) ** 2 for _, y in pts)
    return PowerLaw(math.exp(intercept), -slope, 1 - ss_res / ss_tot if ss_tot else 1.0)
