"""Uncertainty of the held-out numbers (`genomelm eval`, `eval_every`): ratio estimators over windows and
their paired intervals.

Every number the bucket table shows is a linear combination of ratios of totals over the held-out windows,

    theta = sum_j c_j * R_j + offset,    R_j = sum_w y_jw / sum_w x_jw

(the token-weighted mean loss: y = a window's loss sum, x = its token count; the relative change after vs
before on the same tokens: y = the after sum, x = the before sum, offset -1; the change in nats: y = after
sum - before sum, x = tokens; a late-minus-early contrast: two such ratios with c = +1 and -1). Windows are
the independent units: the tokens of one window share its sequence, so they are not independent samples.

The standard error is the linearisation (delta-method, cluster-robust) estimate over the n windows that hold
tokens of any term:

    u_w = sum_j c_j (y_jw - R_j x_jw) / sum_v x_jv,    se^2 = n / (n - 1) * sum_w (u_w - mean(u))^2

and the 95% interval is theta +- t(n - 1, 0.975) * se, Student's t with n - 1 degrees of freedom (with the
few windows of a held-out chromosome the normal quantile would cover too little). A before/after comparison
is paired: both models score the same windows, so a window's before and after sums enter the same u_w and
what the windows share cancels. Hand-written rather than taken from a package: no well-kept one gives the
cluster error of a ratio of totals over arbitrary subsets; the tests hold it to scipy.stats.bootstrap
resampling the windows and to the interval's coverage on simulated evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95  # the confidence level of every interval the evaluator reports


@dataclass(frozen=True)
class Ratio:
    """sum_w y_w / sum_w x_w over windows; y, x: float [W] per-window totals; present: bool [W], the windows
    that hold tokens of it (the others add nothing and are not counted as samples)."""

    y: np.ndarray
    x: np.ndarray
    present: np.ndarray

    @classmethod
    def of(cls, y: np.ndarray, x: np.ndarray, tokens: np.ndarray) -> Ratio:
        """The ratio of `y` to `x` over the windows with `tokens` > 0 (all [W])."""
        return cls(np.asarray(y, np.float64), np.asarray(x, np.float64), np.asarray(tokens) > 0)

    def value(self) -> float:
        total = float(self.x[self.present].sum())
        return float(self.y[self.present].sum()) / total if total else math.nan


@dataclass(frozen=True)
class Estimate:
    """A number with its standard error and 95% interval [low, high], resting on `windows` windows; `note`
    says why the interval (or the number) is n/a, i.e. NaN, when it is ("" otherwise)."""

    value: float
    se: float
    low: float
    high: float
    windows: int
    note: str = ""

    @classmethod
    def unavailable(cls, windows: int, note: str) -> Estimate:
        """An estimate that cannot be made (NaN), and why."""
        return cls(math.nan, math.nan, math.nan, math.nan, windows, note)

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval excludes 0 (False when it is n/a)."""
        return bool(self.low > 0 or self.high < 0)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "se": self.se,
            "low": self.low,
            "high": self.high,
            "windows": self.windows,
            "excludes_zero": self.excludes_zero,
            "note": self.note,
        }


def t_quantile(windows: int) -> float:
    """The two-sided `LEVEL` quantile of Student's t with windows - 1 degrees of freedom."""
    # imported here: scipy.stats takes ~0.7 s of CPU to import, which every training process and rank (this
    # module is on their import path) would pay before any interval is computed
    from scipy import stats

    return float(stats.t.ppf(0.5 + LEVEL / 2, windows - 1))


def combine(terms: Sequence[tuple[float, Ratio]], offset: float = 0.0) -> Estimate:
    """sum_j c_j * R_j + offset for `terms` [(c_j, R_j)], with its linearised standard error and interval
    (module docstring). NaN with a note when a ratio has no tokens or fewer than 2 windows hold any."""
    present = np.logical_or.reduce([ratio.present for _, ratio in terms])
    windows = int(present.sum())
    values = [ratio.value() for _, ratio in terms]
    if any(math.isnan(v) for v in values):
        return Estimate.unavailable(windows, "no tokens")
    value = sum(c * v for (c, _), v in zip(terms, values)) + offset
    if windows < 2:
        return Estimate(value, math.nan, math.nan, math.nan, windows, f"{windows} window with tokens")
    influence = np.zeros(int(present.size))
    for (c, ratio), r in zip(terms, values):
        keep = ratio.present
        influence[keep] += c * (ratio.y[keep] - r * ratio.x[keep]) / ratio.x[keep].sum()
    u = influence[present]
    se = math.sqrt(windows / (windows - 1) * float(((u - u.mean()) ** 2).sum()))
    half = t_quantile(windows) * se
    return Estimate(value, se, value - half, value + half, windows)


def ratio_estimate(ratio: Ratio, offset: float = 0.0) -> Estimate:
    """One ratio (plus `offset`) with its interval."""
    return combine([(1.0, ratio)], offset)


def slope_weights(x: np.ndarray) -> np.ndarray:
    """Least-squares slope weights a [K] for points at `x` [K]: the slope of values v over x is sum(a v)."""
    centred = np.asarray(x, np.float64) - np.mean(x)
    return centred / float((centred**2).sum())
